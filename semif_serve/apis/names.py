"""The model names the ecosystem's apps send unchanged: the hosted services' own names.

The SDKs and apps built for System One and OpenAI Decisions send the hosted model names
(`jev-latest`, the TypeSafe SDK's default; versioned names such as `jev-1.13.0` and
`typesafe/jev-1.13`; `gpt-6-luna`, the only model OpenAI Decisions names). Unless the operator
turns them off (SEMIF_HOSTED_MODEL_NAMES=0), each names the server's default model, after the
registered ids and the configured aliases (SEMIF_MODEL_ALIASES), which always win.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

HOSTED_NAMES = frozenset({"jev-latest", "gpt-6-luna"})
# A hosted name's family: `jev-1.13.0`, `typesafe/jev-1.13`, `gpt-6-luna-2026-10-06`.
HOSTED_FAMILY = re.compile(r"(?:typesafe/)?jev-[!-~]{1,120}|gpt-6-luna-[!-~]{1,120}")
SHOWN = "jev-latest, jev-*, typesafe/jev-*, gpt-6-luna, gpt-6-luna-*"


def is_hosted_name(name: str) -> bool:
    """Whether `name` is one of the hosted services' model names (visible ASCII only)."""
    return name in HOSTED_NAMES or HOSTED_FAMILY.fullmatch(name) is not None


def resolve(
    name: str,
    registered: Callable[[str], bool],
    default_id: str,
    aliases: Mapping[str, str],
    hosted: bool,
) -> str | None:
    """The registered model `name` means: itself when registered, else the model its alias
    names, else (`hosted`) the default model for a hosted name; None when it means none (an
    empty name means none: it is not the default model)."""
    if not name:
        return None
    for model in (name, aliases.get(name)):
        if model is not None and registered(model):
            return model
    if hosted and is_hosted_name(name):
        return default_id
    return None


def listed_aliases(
    aliases: Mapping[str, str], default_id: str, hosted: bool, model_ids: list[str]
) -> dict[str, str]:
    """The names a model list shows besides the models' ids: the configured aliases, then
    (`hosted`) each exact hosted name that neither a model nor an alias takes."""
    listed = dict(aliases)
    if hosted:
        for name in sorted(HOSTED_NAMES):
            if name not in listed and name not in model_ids:
                listed[name] = default_id
    return listed

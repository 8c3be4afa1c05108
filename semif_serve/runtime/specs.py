"""`ModelSpec`: what one registered model is, from the environment or SEMIF_MODELS_FILE (TOML).

With no models file there is one model, id `default`, from SEMIF_MODEL/SEMIF_REVISION, loaded at
startup. A models file has one table per model id; exactly one is the default (the only one, or
the one with `default = true`). Explicit `slots` need the parallel runtime (SEMIF_PARALLEL_SLOTS);
without it every model has one slot, as the semif-serve contract's single lock.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from semif_serve.config import DEVICE_PATTERN, DTYPES, MAX_TOKENS_LIMIT, ConfigError
from semif_serve.errors import InvalidRequest

MAX_SLOTS = 16
# Bounds that keep absurd values out of the arithmetic downstream (a 400-digit max_tokens would
# overflow boot's float capacity estimate; math.isfinite(10**400) itself raises). max_tokens has
# SEMIF_MAX_TOKENS's bound (config.MAX_TOKENS_LIMIT).
MAX_KEEP_ALIVE_S = 30 * 24 * 3600
MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RESERVED_IDS = frozenset({"unload"})  # POST /v1/models/unload is the bulk call
SPEC_KEYS = frozenset(
    {
        "source",
        "revision",
        "dtype",
        "device",
        "max_tokens",
        "slots",
        "keep_alive_s",
        "load_on_startup",
        "default",
    }
)


class SpecError(ValueError):
    """A model specification is invalid; the message names the model and the key."""


@dataclass(frozen=True)
class ModelSpec:
    id: str
    source: str
    revision: str | None
    dtype: str
    device: str
    max_tokens: int
    slots: int = 1
    keep_alive_s: float | None = None  # None: stays loaded until unloaded or evicted
    load_on_startup: bool = False

    def identity(self) -> dict[str, Any]:
        """As configured, before any load (what /health reports for an unloaded model)."""
        return {
            "source": self.source,
            "revision": self.revision,
            "dtype": self.dtype,
            "device": self.device,
        }

    def weights(self) -> tuple:
        """Which weights it loads, and how: a change to any of it needs a new engine."""
        return (self.source, self.revision, self.dtype, self.device)

    def configuration(self) -> tuple:
        """What its answers depend on: the weights and how they run, and the limit a row must
        fit (what a request of several calls pins, `pinning.Pinned`). It is also what the
        model's slot capacity depends on (a lower max_tokens supports more slots)."""
        return (*self.weights(), self.max_tokens)


def default_spec(settings: Any) -> ModelSpec:
    """The single model of the contract: SEMIF_MODEL at SEMIF_REVISION, loaded at startup."""
    return ModelSpec(
        id="default",
        source=settings.model,
        revision=settings.revision,
        dtype=settings.dtype,
        device=settings.device,
        max_tokens=settings.max_tokens,
        slots=settings.parallel_slots or 1,
        load_on_startup=True,
    )


def requested_model(value: Any) -> str | None:
    """A scoring request's `model` field, the one check every route makes: None (absent or
    null) is the default model; a name must be a nonempty string, never blank (a 422 naming
    `model`: an empty name is not the default model)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest("model: must be a model name string")
    if not value.strip():
        raise InvalidRequest(
            "model: must name a model (a nonempty name; leave it out, or null, for the default)"
        )
    return value


def parse_spec(
    model_id: str,
    table: Mapping[str, Any],
    settings: Any,
    where: str = "",
    *,
    in_models_file: bool = False,
) -> ModelSpec:
    """Validate one model table (from the models file, or a PUT body: no `default` key there,
    since a PUT cannot change the default) against `settings`."""
    name = f"{where}{model_id}"
    if not MODEL_ID.fullmatch(model_id) or model_id in RESERVED_IDS:
        raise SpecError(
            f"{name}: a model id is 1-64 letters, digits, '.', '_' or '-', and not "
            f"{' or '.join(sorted(RESERVED_IDS))}"
        )
    unknown = sorted(set(table) - SPEC_KEYS)
    if unknown:
        raise SpecError(f"{name}: unknown keys {unknown}")
    if "default" in table and not in_models_file:
        raise SpecError(
            f"{name}.default: only SEMIF_MODELS_FILE chooses the default model; a registered "
            "model is named by the request's `model` field"
        )
    source = table.get("source")
    if not isinstance(source, str) or not source.strip():
        raise SpecError(f"{name}.source: required, a nonempty string")
    revision = table.get("revision")
    if revision is not None and not isinstance(revision, str):
        raise SpecError(f"{name}.revision: must be a string")
    device = table.get("device", settings.device)
    if not isinstance(device, str) or not DEVICE_PATTERN.fullmatch(device):
        raise SpecError(f"{name}.device: must be cuda, cuda:N or cpu")
    dtype = table.get("dtype", "float32" if device == "cpu" else "bfloat16")
    if dtype not in DTYPES:
        raise SpecError(f"{name}.dtype: must be one of {', '.join(DTYPES)}")
    return ModelSpec(
        id=model_id,
        source=source,
        revision=revision,
        dtype=dtype,
        device=device,
        max_tokens=_max_tokens(table.get("max_tokens", settings.max_tokens), name),
        slots=parse_slots(table.get("slots"), settings.parallel_slots, name),
        keep_alive_s=_keep_alive(table.get("keep_alive_s"), name),
        load_on_startup=_flag(table, "load_on_startup", False, name),
    )


def parse_slots(value: Any, parallel_slots: int | None, name: str) -> int:
    """An integer 1..16, and explicit slots only with the parallel runtime (the range first: a
    value outside it is wrong with either runtime)."""
    if value is None:
        return parallel_slots or 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SLOTS:
        raise SpecError(f"{name}.slots: must be an integer 1..{MAX_SLOTS}, got {_shown(value)}")
    if parallel_slots is None:
        raise SpecError(
            f"{name}.slots: explicit slots need the parallel runtime (set SEMIF_PARALLEL_SLOTS)"
        )
    return value


def load_models_file(path: str, settings: Any) -> tuple[list[ModelSpec], str]:
    """All specs in the file and the default id; ConfigError names SEMIF_MODELS_FILE."""
    variable = "SEMIF_MODELS_FILE"
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{variable}: file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"{variable}: cannot read {path!r}: {error}") from None
    if not document or not all(isinstance(table, dict) for table in document.values()):
        raise ConfigError(f"{variable}: {path!r} must hold one [table] per model id")
    specs, defaults = [], []
    for model_id, table in document.items():
        try:
            specs.append(
                parse_spec(model_id, table, settings, where=f"{variable}: ", in_models_file=True)
            )
            if _flag(table, "default", False, model_id):
                defaults.append(model_id)
        except SpecError as error:
            message = str(error)
            raise ConfigError(
                message if message.startswith(variable) else f"{variable}: {message}"
            ) from None
    if len(specs) == 1 and not defaults:
        defaults = [specs[0].id]
    if len(defaults) != 1:
        raise ConfigError(
            f"{variable}: exactly one model must have default = true, found {len(defaults)}"
        )
    default = defaults[0]
    specs = [
        replace(spec, load_on_startup=True)
        if spec.id == default and "load_on_startup" not in document[default]
        else spec
        for spec in specs
    ]
    return specs, default


def _max_tokens(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise SpecError(
            f"{name}.max_tokens: must be an integer >= 1 and <= {MAX_TOKENS_LIMIT}, "
            f"got {_shown(value)}"
        )
    return value


def _keep_alive(value: Any, name: str) -> float | None:
    if value is None:
        return None
    # Compared, never converted: NaN, infinities and 400-digit integers all fail the range.
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= MAX_KEEP_ALIVE_S
    ):
        raise SpecError(
            f"{name}.keep_alive_s: must be a number of seconds > 0 and <= {MAX_KEEP_ALIVE_S} "
            f"(30 days), got {_shown(value)}"
        )
    return float(value)


def _shown(value: Any) -> str:
    """A refused value for a message, cut short (a 400-digit integer is not worth echoing)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _flag(table: Mapping[str, Any], key: str, default: bool, name: str) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"{name}.{key}: must be true or false")
    return value

"""The parity reference of `semif-serve accept`: results that `semif-serve score` wrote for the
same rows, made with the server's model in the server's dtype.

A float32 and a bfloat16 run of one model differ by more than float32's tolerance (and the CPU's
default dtype depends on the CPU: docs/configuration.md), so a reference is kept per dtype and
`--reference FOLDER` takes the one whose results name the server's model.
"""

from __future__ import annotations

from typing import Any

MODEL_KEYS = ("source", "revision", "dtype")  # what a reference must share with the server


def reference_for(
    candidates: dict[str, dict[str, dict[str, Any]]], model: dict[str, Any]
) -> str | None:
    """Of several references (name: results by row id), the first whose every result names the
    server's `model` (`/health`'s): the same source, revision and dtype; None when none does."""
    for name, results in candidates.items():
        if results and all(made_with(result, model) for result in results.values()):
            return name
    return None


def made_with(result: dict[str, Any], model: dict[str, Any]) -> bool:
    """Whether a result names `model`'s source, revision and dtype."""
    named = result.get("model") or {}
    return all(named.get(key) == model.get(key) for key in MODEL_KEYS)

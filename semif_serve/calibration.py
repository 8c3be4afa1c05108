"""SEMIF_CALIBRATION's file: a temperature per workload, `{workload: T}`, read once at startup.

Each T is a finite number (not a bool) in [MIN_TEMPERATURE, MAX_TEMPERATURE]; anything else is a
`ConfigError` naming the variable and the file. `semif-serve calibrate` writes such files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from semif_serve.errors import ConfigError

MIN_TEMPERATURE, MAX_TEMPERATURE = 0.05, 20.0


def load_calibration(path: str | None) -> Mapping[str, float]:
    """`{workload: T}` from a JSON file; each T a finite number (not a bool) in [0.05, 20]."""
    if path is None:
        return MappingProxyType({})
    name = "SEMIF_CALIBRATION"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{name}: file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{name}: cannot read {path!r}: {error}") from None
    try:
        table = json.loads(text, parse_constant=_reject_constant)
    except ValueError as error:
        raise ConfigError(f"{name}: {path!r} is not valid JSON: {error}") from None
    if not isinstance(table, dict):
        raise ConfigError(f"{name}: {path!r} must hold a JSON object {{workload: temperature}}")
    for workload, temperature in table.items():
        if not workload.strip():
            raise ConfigError(f"{name}: workload names must be nonempty")
        valid_number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
        if not valid_number or not math.isfinite(temperature):
            raise ConfigError(
                f"{name}: temperature of {workload!r} must be a finite number, got {temperature!r}"
            )
        if not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
            raise ConfigError(
                f"{name}: temperature of {workload!r} must be in "
                f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {temperature!r}"
            )
    return MappingProxyType({workload: float(t) for workload, t in table.items()})


def _reject_constant(constant: str) -> None:
    raise ValueError(f"{constant} is not a JSON number")

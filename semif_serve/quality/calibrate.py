"""`semif-serve calibrate`: fit one temperature for a workload and write the SEMIF_CALIBRATION file.

T minimises the mean NLL of the gold options under `softmax(option_logits / T)` over every
labelled row, using the native (unaveraged) logits, since the server applies T only to native
results. The report measures that honestly: "after" figures come from leave-one-group-out fits,
so no row is scored with a T that saw it. The file is `{workload: T}`; an existing file keeps its
other workloads (it must already be a valid calibration file, else nothing is written).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from semif_serve.calibration import MAX_TEMPERATURE, MIN_TEMPERATURE, load_calibration
from semif_serve.config import ConfigError
from semif_serve.quality.evaluate import Prediction
from semif_serve.quality.labelled import LabelledRow
from semif_serve.quality.temperature import (
    ECE_BINS,
    expected_calibration_error,
    fit_temperature,
    mean_nll,
    out_of_fold_probabilities,
    probabilities,
)

TEMPERATURE_DIGITS = 4


class CalibrationFileError(ValueError):
    """The calibration file cannot be updated; the message says why."""


def fit_report(rows: list[LabelledRow], predictions: list[Prediction]) -> dict[str, Any]:
    """T on all rows, plus ECE and NLL before (T = 1) and after (out of fold)."""
    logits = []
    for predicted in predictions:
        if predicted.option_logits is None:
            raise ValueError("a temperature is fitted on native results (orderings none)")
        logits.append(predicted.option_logits)
    gold = [labelled.option_ids.index(labelled.gold) for labelled in rows]
    groups = [labelled.cluster for labelled in rows]
    temperature = round(fit_temperature(logits, gold), TEMPERATURE_DIGITS)
    held_out, fold_temperatures = out_of_fold_probabilities(logits, gold, groups)
    native = probabilities(logits)
    return {
        "temperature": temperature,
        # At a bound the optimum lies beyond what the server accepts: at 20 the scores carry
        # almost no information about the answer, at 0.05 they are far too timid.
        "at_bound": temperature in (MIN_TEMPERATURE, MAX_TEMPERATURE),
        "rows": len(rows),
        "groups": len(set(groups)),
        "ece_bins": ECE_BINS,
        "before": {
            "ece": expected_calibration_error(native, gold),
            "nll": mean_nll(logits, gold, 1.0),
        },
        "after_out_of_fold": {
            "ece": expected_calibration_error(held_out, gold),
            "nll": _nll_of_probabilities(held_out, gold),
            "fold_temperature_range": [min(fold_temperatures), max(fold_temperatures)],
        },
        "in_sample_after": {
            "ece": expected_calibration_error(probabilities(logits, temperature), gold),
            "nll": mean_nll(logits, gold, temperature),
        },
    }


def _nll_of_probabilities(matrix, gold: list[int]) -> float:
    import numpy as np

    chosen = matrix[np.arange(len(gold)), np.asarray(gold)]
    return float(-np.log(np.maximum(chosen, np.finfo(float).tiny)).mean())


def write_calibration(path: Path, workload: str, temperature: float) -> dict[str, float]:
    """Set `workload` to `temperature` in the file at `path` (created if missing, other workloads
    kept), written whole through a temporary file. Returns the table written."""
    if not workload.strip():
        raise CalibrationFileError("workload: must be a nonempty name")
    table: dict[str, float] = {}
    if path.exists():
        try:
            table = dict(load_calibration(str(path)))
        except ConfigError as error:
            raise CalibrationFileError(
                f"{path} exists but is not a valid calibration file, so it was left alone: "
                f"{str(error).removeprefix('SEMIF_CALIBRATION: ')}"
            ) from None
    table[workload] = temperature
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", delete=False
    )
    try:
        with handle:
            json.dump(table, handle, indent=2, sort_keys=True)
            handle.write("\n")
        load_calibration(handle.name)  # what the server will read must parse and pass its checks
        os.replace(handle.name, path)
    finally:
        if os.path.exists(handle.name):
            os.unlink(handle.name)
    return table


def markdown(report: dict[str, Any], workload: str) -> str:
    before, after = report["before"], report["after_out_of_fold"]
    low, high = after["fold_temperature_range"]
    bound = " (at the bound of [0.05, 20])" if report["at_bound"] else ""
    return (
        f"Workload {workload!r}: T = {report['temperature']}{bound} over {report['rows']} rows "
        f"in {report['groups']} groups (leave-one-group-out T {low:.3f} .. {high:.3f}).\n\n"
        "| | ECE ({bins} bins) | NLL |\n|---|---|---|\n"
        f"| native (T = 1) | {before['ece']:.4f} | {before['nll']:.4f} |\n"
        f"| scaled, out of fold | {after['ece']:.4f} | {after['nll']:.4f} |\n"
    ).replace("{bins}", str(report["ece_bins"]))

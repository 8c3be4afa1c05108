"""`semif-serve evaluate`: accuracy of a backend on labelled decisions, per ordering mode.

For each mode (none, rotations, all) every row is decided once. Over the original rows (not
perturbations) the report gives accuracy and balanced accuracy, overall and per family, and
accuracy by the gold option's position. Balanced accuracy's classes are positions (A, B, C...):
option ids are per-row names, and a position is what a biased model over-chooses; when the gold
is spread evenly over positions it equals accuracy. Averaged modes add the share and accuracy of
unanimous rows (every ordering chose the same option). Perturbation rows (`source_id`,
`variant`) are compared with their source row: a flip is a different chosen option id. With two
or more modes the first is the baseline, and each other mode gets the paired accuracy difference
with a group-bootstrap 95% interval.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from typing import IO, Any

from semif_serve.decisions import top_option
from semif_serve.quality.backends import Backend
from semif_serve.quality.labelled import VARIANTS, LabelledRow, originals
from semif_serve.quality.metrics import accuracy, balanced_accuracy, paired_difference


@dataclass(frozen=True)
class Prediction:
    id: str
    gold: str
    top: str
    correct: bool
    probabilities: list[float]  # in the row's own option order
    option_logits: list[float] | None  # native rows only: what a temperature is fitted on
    agreement: float | None  # averaged rows only: the share of orderings that chose `top`


def prediction(labelled: LabelledRow, result: dict[str, Any]) -> Prediction:
    """Read the chosen option out of a /decide reply (native or averaged)."""
    if "combined" in result:
        combined = result["combined"]
        top, probabilities = combined["top"], combined["probabilities"]
        logits, agreement = None, combined["agreement"]
    else:
        probabilities, logits, agreement = result["probabilities"], result["option_logits"], None
        top = top_option(result["option_ids"], probabilities)
    if result["option_ids"] != labelled.option_ids:
        raise ValueError(f"{labelled.id}: the reply's option ids {result['option_ids']} differ")
    return Prediction(
        id=labelled.id,
        gold=labelled.gold,
        top=top,
        correct=top == labelled.gold,
        probabilities=probabilities,
        option_logits=logits,
        agreement=agreement,
    )


def decide_all(
    backend: Backend,
    rows: list[LabelledRow],
    modes: list[str],
    progress: IO[str] | None = None,
) -> dict[str, list[Prediction]]:
    """Every row under every mode, with one progress bar (stderr) over all of them."""
    from tqdm import tqdm

    predictions: dict[str, list[Prediction]] = {}
    with tqdm(total=len(rows) * len(modes), unit="row", file=progress or sys.stderr) as bar:
        for mode in modes:
            bar.set_description(mode)
            predictions[mode] = []
            for labelled in rows:
                predictions[mode].append(prediction(labelled, backend.decide(labelled.row, mode)))
                bar.update(1)
    return predictions


def report(rows: list[LabelledRow], predictions: dict[str, list[Prediction]]) -> dict[str, Any]:
    """The figures for every mode and the comparisons with the first mode."""
    modes = list(predictions)
    base = originals(rows)
    if not base:
        raise ValueError("the data holds only perturbations; their source rows are needed too")
    by_mode = {mode: _mode_figures(rows, predictions[mode]) for mode in modes}
    comparisons = []
    baseline = _by_id(predictions[modes[0]])
    for mode in modes[1:]:
        other = _by_id(predictions[mode])
        difference = paired_difference(
            [baseline[labelled.id].correct for labelled in base],
            [other[labelled.id].correct for labelled in base],
            [labelled.cluster for labelled in base],
        )
        comparisons.append({"baseline": modes[0], "mode": mode, **difference.as_dict()})
    return {
        "rows": len(rows),
        "original_rows": len(base),
        "perturbation_rows": len(rows) - len(base),
        "modes": by_mode,
        "comparisons": comparisons,
    }


def prediction_records(
    rows: list[LabelledRow], predictions: list[Prediction]
) -> list[dict[str, Any]]:
    """One JSON-ready line per row: the labels next to what was chosen."""
    return [
        {
            **asdict(predicted),
            "family": labelled.family,
            "group": labelled.group,
            "source_id": labelled.source_id,
            "variant": labelled.variant,
        }
        for labelled, predicted in zip(rows, predictions)
    ]


def _mode_figures(rows: list[LabelledRow], predictions: list[Prediction]) -> dict[str, Any]:
    pairs = list(zip(rows, predictions))
    base = [(labelled, predicted) for labelled, predicted in pairs if labelled.source_id is None]
    figures: dict[str, Any] = {
        "overall": _accuracies(base),
        "families": {
            family: _accuracies([pair for pair in base if pair[0].family == family])
            for family in sorted({labelled.family for labelled, _ in base})
        },
        "gold_position": {
            position: _accuracies(
                [pair for pair in base if pair[0].gold_position == position], balanced=False
            )
            for position in sorted({labelled.gold_position for labelled, _ in base})
        },
    }
    if base[0][1].agreement is not None:
        unanimous = [pair for pair in base if pair[1].agreement == 1.0]
        figures["unanimous"] = {
            "rows": len(unanimous),
            "share": len(unanimous) / len(base),
            "accuracy": accuracy([p.correct for _, p in unanimous]) if unanimous else None,
        }
    flips = _flips(pairs)
    if flips:
        figures["perturbations"] = flips
    return figures


def _accuracies(
    pairs: list[tuple[LabelledRow, Prediction]], balanced: bool = True
) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "rows": len(pairs),
        "accuracy": accuracy([predicted.correct for _, predicted in pairs]),
    }
    if balanced:
        figures["balanced_accuracy"] = balanced_accuracy(
            [labelled.gold_position for labelled, _ in pairs],
            [labelled.position_of(predicted.top) for labelled, predicted in pairs],
        )
    return figures


def _flips(pairs: list[tuple[LabelledRow, Prediction]]) -> dict[str, Any]:
    """Per variant: rows, rows whose chosen option differs from the source row's, accuracy."""
    chosen = {labelled.id: predicted.top for labelled, predicted in pairs}
    variants = [pair for pair in pairs if pair[0].source_id is not None]
    missing = sorted({lab.source_id for lab, _ in variants if lab.source_id not in chosen})
    if missing:
        raise ValueError(f"perturbations refer to source rows not in the data: {missing[:5]}")
    figures: dict[str, Any] = {}
    for name in [*VARIANTS, "all"]:
        members = [pair for pair in variants if name in ("all", pair[0].variant)]
        if not members:
            continue
        flipped = sum(predicted.top != chosen[lab.source_id] for lab, predicted in members)
        figures[name] = {
            "rows": len(members),
            "flips": flipped,
            "flip_rate": flipped / len(members),
            "accuracy": accuracy([predicted.correct for _, predicted in members]),
        }
    return figures


def _by_id(predictions: list[Prediction]) -> dict[str, Prediction]:
    return {predicted.id: predicted for predicted in predictions}


def markdown(result: dict[str, Any]) -> str:
    """The report as Markdown tables (with the backend and data files when the report has them)."""
    lines = [f"Rows: {result['original_rows']} original, {result['perturbation_rows']} perturbed."]
    if "backend" in result:
        lines.append(f"Backend: `{json.dumps(result['backend'], ensure_ascii=False)}`")
    if "data" in result:
        lines.append(f"Data: {', '.join(result['data'])}")
    lines += ["", "| mode | scope | rows | accuracy | balanced accuracy |", "|---|---|---|---|---|"]
    for mode, figures in result["modes"].items():
        scopes = [("overall", figures["overall"]), *figures["families"].items()]
        for scope, values in scopes:
            lines.append(
                f"| {mode} | {scope} | {values['rows']} | {values['accuracy']:.3f} | "
                f"{values['balanced_accuracy']:.3f} |"
            )
    lines += ["", "| mode | gold position | rows | accuracy |", "|---|---|---|---|"]
    for mode, figures in result["modes"].items():
        for position, values in figures["gold_position"].items():
            lines.append(f"| {mode} | {position} | {values['rows']} | {values['accuracy']:.3f} |")
    averaged = {mode: f["unanimous"] for mode, f in result["modes"].items() if "unanimous" in f}
    if averaged:
        lines += [
            "",
            "| mode | unanimous rows | share | accuracy when unanimous |",
            "|---|---|---|---|",
        ]
        for mode, values in averaged.items():
            shown = "—" if values["accuracy"] is None else f"{values['accuracy']:.3f}"
            lines.append(f"| {mode} | {values['rows']} | {values['share']:.3f} | {shown} |")
    perturbed = {m: f["perturbations"] for m, f in result["modes"].items() if "perturbations" in f}
    if perturbed:
        lines += [
            "",
            "| mode | variant | rows | flips | flip rate | accuracy |",
            "|---|---|---|---|---|---|",
        ]
        for mode, variants in perturbed.items():
            for name, values in variants.items():
                lines.append(
                    f"| {mode} | {name} | {values['rows']} | {values['flips']} | "
                    f"{values['flip_rate']:.3f} | {values['accuracy']:.3f} |"
                )
    if result["comparisons"]:
        lines += ["", "| comparison | accuracy difference | group-bootstrap 95% CI | groups |"]
        lines.append("|---|---|---|---|")
        for item in result["comparisons"]:
            low, high = item["ci95"]
            lines.append(
                f"| {item['mode']} − {item['baseline']} | {item['difference']:+.3f} | "
                f"{low:+.3f} .. {high:+.3f} | {item['groups']} |"
            )
    return "\n".join(lines) + "\n"

"""`semif-serve evaluate` and `calibrate` end to end over the real app with a fake scorer whose
answers are known: content logits plus a position-A bias that only order averaging removes."""

import json

import pytest
from fakes import FakeScorer
from quality_fakes import (
    CONTENT,
    POSITION_A_BIAS,
    STRONG,
    ServedApp,
    expected_native_correct,
    labelled_rows,
    token_file,
    write_jsonl,
)

from semif_serve.calibration import load_calibration
from semif_serve.cli import main
from semif_serve.quality.labelled import ROW_KEYS, LabelledDataError, read_labelled
from semif_serve.quality.temperature import fit_temperature
from semif_serve.scoring import parse_row

ROWS = labelled_rows()


def perturbations():
    """Two reversed variants: a STRONG row (stays right) and a WEAK row at A (flips)."""
    strong = next(r for r in ROWS if r["options"][1]["description"] == STRONG)
    weak_at_a = next(
        r
        for r in ROWS
        if r["options"][0]["id"] == r["gold"] and r["options"][0]["description"] != STRONG
    )
    return [
        {
            **row,
            "id": f"{row['id']}-rev",
            "options": row["options"][::-1],
            "source_id": row["id"],
            "variant": "reversed",
        }
        for row in (strong, weak_at_a)
    ]


def served(scorer=None):
    return ServedApp(scorer or FakeScorer(base=CONTENT, bias=POSITION_A_BIAS))


def test_evaluate_compares_orderings_with_a_group_bootstrap(tmp_path, capsys):
    data, extra = tmp_path / "rows.jsonl", tmp_path / "perturbed.jsonl"
    write_jsonl(data, ROWS)
    write_jsonl(extra, perturbations())
    out = tmp_path / "out"
    with served() as server:
        status = main(
            [
                "evaluate",
                "--data",
                str(data),
                "--data",
                str(extra),
                "--orderings",
                "none,rotations",
                "--url",
                server.url,
                "--token-file",
                str(token_file(tmp_path)),
                "--out",
                str(out),
            ]
        )
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "52/52" in captured.err  # one progress bar over (24 + 2 rows) x 2 modes
    report = json.loads((out / "evaluate.json").read_text())
    native = sum(map(expected_native_correct, ROWS)) / len(ROWS)
    none, rotations = report["modes"]["none"], report["modes"]["rotations"]
    assert report["original_rows"] == 24 and report["perturbation_rows"] == 2
    assert none["overall"]["accuracy"] == pytest.approx(native)
    assert rotations["overall"]["accuracy"] == 1.0
    assert rotations["overall"]["balanced_accuracy"] == 1.0
    assert none["gold_position"]["A"]["accuracy"] == 1.0
    recalls = [values["accuracy"] for values in none["gold_position"].values()]
    assert none["overall"]["balanced_accuracy"] == pytest.approx(sum(recalls) / len(recalls))
    assert set(none["families"]) == {"fam1", "fam2"}
    # only the STRONG rows (1 of 3) are unanimous under rotations, and they are right
    assert rotations["unanimous"] == {"rows": 8, "share": 8 / 24, "accuracy": 1.0}
    assert "unanimous" not in none
    assert none["perturbations"]["reversed"] == {
        "rows": 2,
        "flips": 1,
        "flip_rate": 0.5,
        "accuracy": 0.5,
    }
    assert rotations["perturbations"]["all"]["flips"] == 0
    [comparison] = report["comparisons"]
    assert comparison["baseline"] == "none" and comparison["mode"] == "rotations"
    assert comparison["difference"] == pytest.approx(1.0 - native)
    low, high = comparison["ci95"]
    assert low <= comparison["difference"] <= high
    assert comparison["groups"] == 8
    assert "| rotations − none |" in captured.out
    assert (out / "evaluate.md").read_text() == captured.out
    lines = (out / "predictions-rotations.jsonl").read_text().splitlines()
    assert len(lines) == 26 and json.loads(lines[0])["agreement"] is not None


def test_evaluate_needs_exactly_one_backend_and_the_sources_of_perturbations(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, perturbations())
    status = main(["evaluate", "--data", str(data)])
    assert status == 2
    assert "give one of --url" in capsys.readouterr().err
    with served() as server:
        status = main(
            [
                "evaluate",
                "--data",
                str(data),
                "--url",
                server.url,
                "--token-file",
                str(token_file(tmp_path)),
            ]
        )
    assert status == 2
    assert "only perturbations" in capsys.readouterr().err


def test_balanced_accuracy_classes_are_gold_positions_not_option_ids():
    from semif_serve.quality.evaluate import Prediction, report
    from semif_serve.quality.labelled import LabelledRow

    def labelled(row_id, gold):
        options = [{"id": f"{row_id}-{k}", "description": k} for k in ("x", "y", "z")]
        row = {"id": row_id, "state": "s", "question": "q", "options": options}
        return LabelledRow(row=row, gold=f"{row_id}-{gold}", family="f", group=row_id)

    rows = [labelled("r1", "x"), labelled("r2", "x"), labelled("r3", "y")]  # gold at A, A, B
    chosen = ["r1-x", "r2-x", "r3-z"]
    predictions = [
        Prediction(r.id, r.gold, top, top == r.gold, [1 / 3] * 3, [0.0] * 3, None)
        for r, top in zip(rows, chosen)
    ]
    overall = report(rows, {"none": predictions})["modes"]["none"]["overall"]
    assert overall["accuracy"] == pytest.approx(2 / 3)
    assert overall["balanced_accuracy"] == 0.5  # recall of A: 2/2, of B: 0/1


def test_labelled_rows_are_checked_and_sent_without_their_labels(tmp_path):
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, ROWS[:2])
    [first, _] = read_labelled([data])
    assert set(first.row) == set(ROW_KEYS)
    assert first.cluster == ("fam1", "0")
    write_jsonl(data, [{**ROWS[0], "gold": "nope"}])
    with pytest.raises(LabelledDataError, match=r"rows.jsonl:1: gold"):
        read_labelled([data])
    write_jsonl(data, [ROWS[0], ROWS[0]])
    with pytest.raises(LabelledDataError, match="repeats"):
        read_labelled([data])
    write_jsonl(data, [{**ROWS[0], "source_id": "x"}])
    with pytest.raises(LabelledDataError, match="come together"):
        read_labelled([data])


def test_calibrate_fits_writes_and_merges_the_calibration_file(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, ROWS)
    out = tmp_path / "calibration.json"
    out.write_text(json.dumps({"triage": 1.5}))
    scorer = FakeScorer(base=CONTENT, bias=POSITION_A_BIAS)
    with served(scorer) as server:
        status = main(
            [
                "calibrate",
                "--data",
                str(data),
                "--workload",
                "quiz",
                "--out",
                str(out),
                "--report",
                str(tmp_path / "fit.json"),
                "--url",
                server.url,
                "--token-file",
                str(token_file(tmp_path)),
            ]
        )
    captured = capsys.readouterr()
    assert status == 0, captured.err
    logits = [scorer.result(parse_row({k: r[k] for k in ROW_KEYS}))["option_logits"] for r in ROWS]
    gold = [[o["id"] for o in r["options"]].index(r["gold"]) for r in ROWS]
    expected = round(fit_temperature(logits, gold), 4)
    table = dict(load_calibration(str(out)))
    assert table == {"triage": 1.5, "quiz": expected}
    report = json.loads((tmp_path / "fit.json").read_text())
    assert report["temperature"] == expected
    assert report["groups"] == 8 and report["rows"] == 24
    assert report["at_bound"] is (expected in (0.05, 20.0))
    assert report["after_out_of_fold"]["nll"] < report["before"]["nll"]
    assert "ECE" in captured.out and "quiz" in captured.out


def test_calibrate_leaves_an_invalid_existing_file_alone(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, ROWS)
    out = tmp_path / "calibration.json"
    out.write_text('{"triage": 99}')
    with served() as server:
        status = main(
            [
                "calibrate",
                "--data",
                str(data),
                "--workload",
                "quiz",
                "--out",
                str(out),
                "--url",
                server.url,
                "--token-file",
                str(token_file(tmp_path)),
            ]
        )
    assert status == 2
    assert "left alone" in capsys.readouterr().err
    assert out.read_text() == '{"triage": 99}'


def test_the_local_backend_scores_natively_or_all_orderings_in_one_shared_call(monkeypatch):
    from semif_serve.quality import backends

    fake, calls = FakeScorer(base=CONTENT, bias=POSITION_A_BIAS), []

    def score(model, row, *, max_tokens):
        calls.append(("score", model, row.id, max_tokens))
        return fake.result(row)

    def score_shared(model, rows, *, max_tokens):
        calls.append(("score_shared", model, [row.id for row in rows], max_tokens))
        return [fake.result(row) for row in rows], {}

    monkeypatch.setattr(backends, "score", score)
    monkeypatch.setattr(backends, "score_shared", score_shared)
    row = {key: ROWS[1][key] for key in ROW_KEYS}
    backend = backends.LocalBackend("the model", max_tokens=99)
    native = backend.decide(row, "none")
    assert native == fake.result(parse_row(row))
    averaged = backend.decide(row, "rotations")
    ids = [f"{row['id']}#o{k}" for k in range(3)]
    assert calls == [
        ("score", "the model", row["id"], 99),
        ("score_shared", "the model", ids, 99),
    ]
    assert averaged["combined"]["top"] == ROWS[1]["gold"]  # the position bias cancelled
    assert [result["id"] for result in averaged["orderings"]] == ids


def test_calibrate_and_evaluate_read_saved_score_results(tmp_path, capsys):
    data, results = tmp_path / "rows.jsonl", tmp_path / "scored.jsonl"
    write_jsonl(data, ROWS)
    scorer = FakeScorer(base=CONTENT, bias=POSITION_A_BIAS)
    write_jsonl(results, [scorer.result(parse_row({k: r[k] for k in ROW_KEYS})) for r in ROWS])
    out = tmp_path / "calibration.json"
    status = main(
        [
            "calibrate",
            "--data",
            str(data),
            "--workload",
            "quiz",
            "--out",
            str(out),
            "--results",
            str(results),
        ]
    )
    assert status == 0, capsys.readouterr().err
    logits = [json.loads(line)["option_logits"] for line in results.read_text().splitlines()]
    gold = [[o["id"] for o in r["options"]].index(r["gold"]) for r in ROWS]
    assert dict(load_calibration(str(out))) == {"quiz": round(fit_temperature(logits, gold), 4)}
    status = main(
        [
            "evaluate",
            "--data",
            str(data),
            "--orderings",
            "none,rotations",
            "--results",
            str(results),
        ]
    )
    assert status == 2
    assert "native results only" in capsys.readouterr().err

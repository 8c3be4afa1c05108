"""bench/options_methods.py (grouped-16 vs tournament-16, docs/quality.md) on the tiny random
Qwen3.5: the variants it builds, and the report of a two-row run through the real scorer."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from semif_serve.apis import grouped
from semif_serve.quality.labelled import read_labelled
from semif_serve.scoring.prompt import LETTERS

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "options_methods.py"
SIZES = (17, 40)


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("options_methods", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def labelled(script):
    return read_labelled([script.DATA])


@pytest.mark.parametrize("size", [17, 40, 255])
def test_a_variant_holds_the_rows_options_among_other_groups_distractors(script, labelled, size):
    pool = script.distractor_pool(labelled)
    row = labelled[4]
    options = script.variant(row, pool, size)
    ids = [option["id"] for option in options]
    assert len(options) == size and len(set(ids)) == size
    assert len({option["description"] for option in options}) == size
    own = [option for option in options if option in row.row["options"]]
    assert sorted(own, key=row.row["options"].index) == row.row["options"]  # all three, once
    groups = {
        f"x-{other.id}-{o['id']}": other.group for other in labelled for o in other.row["options"]
    }
    assert all(groups[k] != row.group for k in ids if k not in row.option_ids)
    assert script.variant(row, pool, size) == options  # seeded by id and size
    assert script.variant(labelled[5], pool, size) != options


def test_the_report_of_two_rows_on_the_tiny_qwen(script, labelled, tiny_qwen, tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["--model", "tiny-qwen", "--limit", "2", "--sizes", "17,40", "--json", str(out)]
    report = script.main(argv, scoring_model=tiny_qwen)
    assert json.loads(out.read_text())["runs"]["tiny-qwen"] == json.loads(json.dumps(report))
    assert "| 40 | tournament-16 |" in capsys.readouterr().out

    records = report["records"]
    assert len(records) == 2 * (1 + len(SIZES) * len(grouped.METHODS))
    assert {r["id"] for r in records} == {"ev-01a", "ev-01b"}
    for record in records:
        assert math.isclose(record["p_sum"], 1.0, abs_tol=1e-9), record
        assert 0.0 <= record["p_gold"] <= record.get("p_real", 1.0) <= 1.0 + 1e-12
        row = labelled[0 if record["id"] == "ev-01a" else 1]
        assert record["correct"] == (record["top"] == row.gold)
        if record["method"] == "direct":
            assert (record["letter"], record["group"]) == (
                LETTERS[row.option_ids.index(record["top"])],
                0,
            )
            continue
        # the top option's letter within its own group's row
        options = script.variant(row, script.distractor_pool(labelled), record["size"])
        position = [option["id"] for option in options].index(record["top"])
        group = grouped.groups(record["size"])[record["group"]]
        assert LETTERS[position - group.start] == record["letter"] and position in group
    direct = {r["id"]: r["top"] for r in records if r["method"] == "direct"}
    assert all(r["agrees"] == (r["top"] == direct[r["id"]]) for r in records)
    assert report["direct"]["accuracy"] == sum(r["correct"] for r in records if r["size"] == 3) / 2

    table = {(m["size"], m["method"]): m for m in report["methods"]}
    assert set(table) == {(n, method) for n in SIZES for method in grouped.METHODS}
    for (size, method), m in table.items():
        ours = [r for r in records if r["size"] == size and r["method"] == method]
        assert m["questions"] == 2
        assert m["accuracy"] == sum(r["correct"] for r in ours) / 2
        assert m["agreement"] == sum(r["agrees"] for r in ours) / 2
        assert 0.0 <= m["gold_mass"] <= m["real_mass"] <= 1.0
        groups = len(grouped.groups(size))  # 17: 9 + 8; 40: 14 + 13 + 13
        assert m["rows"] == groups + (method == grouped.TOURNAMENT)
    for size in SIZES:  # the final is a second call over the same state: more tokens
        assert (
            table[size, grouped.TOURNAMENT]["tokens"]
            > table[size, grouped.SHARED_NORMALISER]["tokens"]
        )
    assert (
        table[40, grouped.SHARED_NORMALISER]["tokens"]
        > table[17, grouped.SHARED_NORMALISER]["tokens"]
    )

    for paired in report["paired"]:
        counted = paired["both_right"] + paired["only_grouped"] + paired["only_tournament"]
        assert counted <= 2 and paired["same_top"] <= 2
        row = table[paired["size"], grouped.SHARED_NORMALISER]
        assert row["accuracy"] * 2 == paired["both_right"] + paired["only_grouped"]
        other = table[paired["size"], grouped.TOURNAMENT]
        difference = paired["agrees_only_tournament"] - paired["agrees_only_grouped"]
        assert (other["agreement"] - row["agreement"]) * 2 == difference


def test_sizes_must_need_more_than_one_row(script, tiny_qwen):
    with pytest.raises(SystemExit):
        script.main(["--model", "tiny-qwen", "--sizes", "16"], scoring_model=tiny_qwen)


def test_the_summary_counts_what_each_record_says(script):
    def record(row, size, method, top, correct, agrees, p_gold=0.25, letter="A"):
        return {
            "letter": letter,
            "id": row,
            "size": size,
            "method": method,
            "top": top,
            "correct": correct,
            "agrees": agrees,
            "p_gold": p_gold,
            "p_real": 0.5,
            "rows": 2,
            "tokens": 100,
        }

    g, t = grouped.SHARED_NORMALISER, grouped.TOURNAMENT
    records = [
        record("a", 3, "direct", "x", True, True, 0.75),
        record("b", 3, "direct", "y", False, True, 0.125),
        record("a", 17, g, "x", True, False),
        record("b", 17, g, "z", False, False, letter="C"),
        record("a", 17, t, "w", False, False, letter="B"),
        record("b", 17, t, "y", False, True, 0.75),
    ]
    report = script.summarise(records, [17])
    assert report["direct"] == {
        "questions": 2,
        "accuracy": 0.5,
        "gold_mass": 0.4375,
        "tokens": 100,
        "top_letter": "A",
        "top_share": 1.0,
    }
    table = {m["method"]: m for m in report["methods"]}
    assert (table[g]["accuracy"], table[g]["agreement"]) == (0.5, 0.0)
    assert (table[g]["top_letter"], table[t]["top_share"]) == ("A", 0.5)
    assert (table[t]["accuracy"], table[t]["agreement"], table[t]["gold_mass"]) == (0.0, 0.5, 0.5)
    assert report["paired"] == [
        {
            "size": 17,
            "both_right": 0,
            "only_grouped": 1,
            "only_tournament": 0,
            "agrees_only_grouped": 0,
            "agrees_only_tournament": 1,
            "same_top": 0,
        }
    ]

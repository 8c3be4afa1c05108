"""The labelled evaluation data in bench/data: shape, balance and how each perturbation relates
to its source row. No model: these checks guard the files `evaluate` and `calibrate` read."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from semif_serve.scoring.rows import parse_row
from semif_serve.state_key import state_json

DATA = Path(__file__).resolve().parents[1] / "bench" / "data"
FAMILIES = {
    "evidence_interpretation": "ev",
    "rule_application": "ru",
    "candidate_selection": "ca",
}
LABEL_KEYS = ("gold", "family", "group", "source_id", "variant")
VARIANT_SUFFIX = {"reversed": "-rev", "reworded": "-rew", "context": "-ctx"}
SLUG = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
GROUPS_PER_FAMILY = 16
ROWS_PER_GROUP = 3
SOURCES_PER_FAMILY = 12


def read_jsonl(name: str) -> list[dict]:
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def decisions() -> list[dict]:
    return read_jsonl("decisions144.jsonl")


@pytest.fixture(scope="module")
def perturbations() -> list[dict]:
    return read_jsonl("perturbations108.jsonl")


@pytest.fixture(scope="module")
def by_id(decisions) -> dict[str, dict]:
    return {row["id"]: row for row in decisions}


def unlabelled(row: dict) -> dict:
    """The row as a client would send it: the labels are ours, not part of the SemIf shape."""
    return {key: value for key, value in row.items() if key not in LABEL_KEYS}


def option_ids(row: dict) -> list[str]:
    return [option["id"] for option in row["options"]]


def gold_position(row: dict) -> str:
    return "ABC"[option_ids(row).index(row["gold"])]


def test_there_are_144_rows_48_per_family(decisions):
    assert len(decisions) == 144
    assert Counter(row["family"] for row in decisions) == {family: 48 for family in FAMILIES}


def test_each_family_has_16_groups_of_3_rows_named_after_it(decisions):
    groups = defaultdict(list)
    for row in decisions:
        groups[(row["family"], row["group"])].append(row)
    for family, prefix in FAMILIES.items():
        names = sorted(group for fam, group in groups if fam == family)
        assert names == [f"{prefix}-{n:02d}" for n in range(1, GROUPS_PER_FAMILY + 1)]
    assert all(len(rows) == ROWS_PER_GROUP for rows in groups.values())


def test_rows_of_a_group_share_one_exact_state(decisions):
    states = defaultdict(set)
    for row in decisions:
        states[row["group"]].add(state_json(row["state"]))
    assert all(len(keys) == 1 for keys in states.values())
    assert len(set().union(*states.values())) == len(states), "two groups share a state"


def test_ids_are_unique_across_both_files(decisions, perturbations):
    ids = [row["id"] for row in decisions + perturbations]
    assert len(ids) == len(set(ids))


def test_every_row_is_a_valid_semif_row_once_the_labels_are_dropped(decisions, perturbations):
    for row in decisions + perturbations:
        parsed = parse_row(unlabelled(row))
        assert parsed.id == row["id"]


def test_every_row_has_three_slug_options_and_a_gold_among_them(decisions, perturbations):
    for row in decisions + perturbations:
        ids = option_ids(row)
        assert len(ids) == 3, row["id"]
        assert all(SLUG.match(option_id) and len(option_id) > 1 for option_id in ids), row["id"]
        assert row["gold"] in ids, row["id"]
        assert isinstance(row["state"], dict), row["id"]


def test_gold_sits_16_times_at_each_position_in_every_family(decisions):
    for family in FAMILIES:
        positions = Counter(gold_position(row) for row in decisions if row["family"] == family)
        assert positions == {"A": 16, "B": 16, "C": 16}, family


def test_gold_length_gives_nothing_away(decisions):
    """The gold is the strictly longest (or shortest) description in at most half of a family."""
    for family in FAMILIES:
        rows = [row for row in decisions if row["family"] == family]
        longest = shortest = 0
        for row in rows:
            lengths = {option["id"]: len(option["description"]) for option in row["options"]}
            gold = lengths.pop(row["gold"])
            longest += gold > max(lengths.values())
            shortest += gold < min(lengths.values())
        assert longest <= len(rows) // 2, (family, longest)
        assert shortest <= len(rows) // 2, (family, shortest)


def test_there_are_36_sources_with_3_variants_each(perturbations, by_id):
    variants = defaultdict(list)
    for row in perturbations:
        assert row["source_id"] in by_id, row["id"]
        variants[row["source_id"]].append(row["variant"])
    assert len(perturbations) == 108
    assert len(variants) == 36
    assert all(sorted(kinds) == sorted(VARIANT_SUFFIX) for kinds in variants.values())


def test_sources_come_from_distinct_groups_with_balanced_gold_positions(perturbations, by_id):
    sources = [by_id[source_id] for source_id in {row["source_id"] for row in perturbations}]
    for family in FAMILIES:
        chosen = [row for row in sources if row["family"] == family]
        assert len(chosen) == SOURCES_PER_FAMILY, family
        assert len({row["group"] for row in chosen}) == SOURCES_PER_FAMILY, family
        assert Counter(gold_position(row) for row in chosen) == {"A": 4, "B": 4, "C": 4}, family


def test_a_variant_keeps_its_sources_labels_and_is_named_after_it(perturbations, by_id):
    for row in perturbations:
        source = by_id[row["source_id"]]
        assert row["id"] == source["id"] + VARIANT_SUFFIX[row["variant"]]
        for key in ("family", "group", "gold"):
            assert row[key] == source[key], (row["id"], key)


def test_reversed_reverses_the_options_and_changes_nothing_else(perturbations, by_id):
    for row in variants_of(perturbations, "reversed"):
        source = by_id[row["source_id"]]
        assert row["options"] == list(reversed(source["options"])), row["id"]
        assert state_json(row["state"]) == state_json(source["state"]), row["id"]
        assert row["question"] == source["question"], row["id"]


def test_reworded_changes_only_the_question(perturbations, by_id):
    for row in variants_of(perturbations, "reworded"):
        source = by_id[row["source_id"]]
        assert row["question"].strip() != source["question"].strip(), row["id"]
        assert row["options"] == source["options"], row["id"]
        assert state_json(row["state"]) == state_json(source["state"]), row["id"]


def test_context_adds_exactly_one_key_to_the_state(perturbations, by_id):
    for row in variants_of(perturbations, "context"):
        source = by_id[row["source_id"]]
        extra = [key for key in row["state"] if key not in source["state"]]
        assert len(extra) == 1, row["id"]
        without_extra = {key: value for key, value in row["state"].items() if key != extra[0]}
        assert state_json(without_extra) == state_json(source["state"]), row["id"]
        assert row["question"] == source["question"], row["id"]
        assert row["options"] == source["options"], row["id"]


def variants_of(perturbations: list[dict], kind: str) -> list[dict]:
    chosen = [row for row in perturbations if row["variant"] == kind]
    assert len(chosen) == 36, kind
    return chosen

"""Row validation: every malformed row is an InvalidRow (a ValueError) naming the bad field."""

import math

import pytest

from semif_serve.scoring import InvalidRow, parse_row


def valid(**changes):
    row = {
        "id": "r1",
        "state": "The door is open.",
        "question": "Is the door open?",
        "options": [{"id": "yes", "description": "Yes"}, {"id": "no", "description": "No"}],
    }
    row.update(changes)
    return {key: value for key, value in row.items() if value is not ...}


def options(count):
    return [{"id": f"o{index}", "description": f"option {index}"} for index in range(count)]


def test_a_valid_row_parses_into_an_immutable_row():
    row = parse_row(valid())
    assert row.id == "r1"
    assert row.option_ids == ["yes", "no"]
    assert row.options[0].description == "Yes"


@pytest.mark.parametrize("state", ["text", {"a": 1}, [1, "two", None, True, 2.5]])
def test_state_may_be_a_string_object_or_array(state):
    assert parse_row(valid(state=state)).state == state


@pytest.mark.parametrize("count", [2, 16])
def test_two_to_sixteen_options_are_accepted(count):
    assert len(parse_row(valid(options=options(count))).options) == count


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ("not an object", "row"),
        (valid(id=...), "id: missing"),
        (valid(id=""), "id: must be a nonempty string"),
        (valid(id="  "), "id: must be a nonempty string"),
        (valid(id=7), "id: must be a string"),
        (valid(question=...), "question: missing"),
        (valid(question=""), "question"),
        (valid(question=["q"]), "question: must be a string"),
        (valid(state=...), "state: missing"),
        (valid(state=""), "state"),
        (valid(state={}), "state"),
        (valid(state=[]), "state"),
        (valid(state=3), "state: must be a string, object or array"),
        (valid(state=None), "state"),
        (valid(state={"x": math.nan}), "state.x: numbers must be finite"),
        (valid(state=[1, [math.inf]]), "state[1][0]: numbers must be finite"),
        (valid(state={1: "a"}), "state: object keys must be strings"),
        (valid(state={"x": {1, 2}}), "state.x: not a JSON value"),
        (valid(options=...), "options: missing"),
        (valid(options="yes,no"), "options: must be an array"),
        (valid(options=options(1)), "options: must hold 2..16 items, got 1"),
        (valid(options=options(17)), "options: must hold 2..16 items, got 17"),
        (valid(options=["yes", "no"]), "options[0]: must be an object"),
        (
            valid(options=[{"id": "a", "description": "A"}, {"id": "b"}]),
            "options[1].description: missing",
        ),
        (
            valid(options=[{"id": "a", "description": "A"}, {"id": "", "description": "B"}]),
            "options[1].id",
        ),
        (
            valid(options=[{"id": "a", "description": "A"}, {"id": "a", "description": "B"}]),
            "options[1].id: duplicate",
        ),
        (
            valid(
                options=[{"id": "a", "description": "A", "x": 1}, {"id": "b", "description": "B"}]
            ),
            "options[0]: unknown keys ['x']",
        ),
    ],
)
def test_a_malformed_row_names_its_field(row, field):
    with pytest.raises(InvalidRow) as caught:
        parse_row(row)
    assert isinstance(caught.value, ValueError)
    assert str(caught.value).startswith(field.split(":")[0])
    assert field in str(caught.value)


def test_state_key_keeps_key_order_and_distinguishes_number_types():
    assert (
        parse_row(valid(state={"a": 1, "b": 2})).state_key
        != parse_row(valid(state={"b": 2, "a": 1})).state_key
    )
    assert parse_row(valid(state=[1])).state_key != parse_row(valid(state=[1.0])).state_key
    assert parse_row(valid(state="ü")).state_key == '"ü"'

"""Order averaging through the HTTP app (fake scorer) and as pure functions."""

import itertools
import math

import pytest
from fakes import AUTH, FakeScorer, decision, fake_app, row, softmax
from falcon import testing

from semif_serve.decisions import calibrated, combine, ordering_permutations

BASE = {"Red": 1.0, "Green": 0.2, "Blue": -0.5, "Grey": 0.1}
BIAS = [2.5, 0.0, -1.0, 0.7]  # a strong preference for whatever sits in position A


def client(scorer=None, **overrides):
    app, scorer = fake_app(scorer or FakeScorer(base=BASE, bias=BIAS), **overrides)
    return testing.TestClient(app), scorer


def post(api, path, body):
    response = api.simulate_post(path, json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json


def test_rotations_send_n_rows_in_one_shared_call_each_option_once_per_position():
    api, scorer = client()
    reply = post(api, "/decide", row("d", ("Red", "Green", "Blue"), orderings="rotations"))
    [(method, rows)] = scorer.calls
    assert method == "score_shared"
    assert [r.id for r in rows] == ["d#o0", "d#o1", "d#o2"]
    assert [r.option_ids for r in rows] == [
        ["o0", "o1", "o2"],
        ["o1", "o2", "o0"],
        ["o2", "o0", "o1"],
    ]
    for position in range(3):
        assert sorted(r.option_ids[position] for r in rows) == ["o0", "o1", "o2"]
    assert reply["id"] == "d" and reply["option_ids"] == ["o0", "o1", "o2"]
    assert reply["orderings"] == [scorer.result(r) for r in rows]  # native results unchanged
    assert set(reply) == {"id", "option_ids", "combined", "orderings"}


def test_rotations_cancel_a_position_bias_exactly():
    api, _ = client()
    reply = post(api, "/decide", row("d", ("Red", "Green", "Blue", "Grey"), orderings="rotations"))
    unbiased = softmax([BASE[name] for name in ("Red", "Green", "Blue", "Grey")])
    assert reply["combined"]["probabilities"] == pytest.approx(unbiased, abs=1e-12)
    assert reply["combined"]["top"] == "o0"
    # The biased native results disagree: position A wins whenever Red is not there.
    assert reply["combined"]["agreement"] == pytest.approx(1 / 4)


def test_agreement_and_spread_come_from_the_orderings():
    api, _ = client()
    reply = post(api, "/decide", row("d", ("Red", "Green", "Blue"), orderings="rotations"))
    natives = reply["orderings"]
    combined = reply["combined"]
    assert combined["method"] == "rotations" and combined["orderings"] == 3
    for option in ("o0", "o1", "o2"):
        values = [r["probabilities"][r["option_ids"].index(option)] for r in natives]
        assert combined["spread"][option] == [min(values), max(values)]
    tops = [r["option_ids"][r["probabilities"].index(max(r["probabilities"]))] for r in natives]
    assert combined["agreement"] == sum(top == combined["top"] for top in tops) / 3


def test_all_sends_every_permutation_caller_order_first():
    api, scorer = client()
    reply = post(api, "/decide", row("d", ("Red", "Green", "Blue", "Grey"), orderings="all"))
    rows = scorer.calls[0][1]
    assert len(rows) == 24 == reply["combined"]["orderings"]
    assert rows[0].option_ids == ["o0", "o1", "o2", "o3"]
    assert sorted(tuple(r.option_ids) for r in rows) == sorted(
        itertools.permutations(["o0", "o1", "o2", "o3"])
    )
    assert reply["combined"]["probabilities"] == pytest.approx(
        softmax([BASE[n] for n in ("Red", "Green", "Blue", "Grey")]), abs=1e-12
    )


def test_all_is_422_above_four_options():
    api, scorer = client()
    response = api.simulate_post(
        "/decide", json=row("d", ("A", "B", "C", "D", "E"), orderings="all"), headers=AUTH
    )
    assert response.status_code == 422
    assert "'all' is allowed for at most 4 options, got 5" in response.json["error"]["message"]
    assert scorer.calls == []


def test_a_mixed_shared_request_is_one_engine_call_in_request_order():
    api, scorer = client()
    body = {
        "state": "s",
        "decisions": [
            decision("plain1", ("Red", "Green")),
            decision("avg", ("Red", "Green", "Blue"), orderings="rotations"),
            decision("plain2", ("Blue", "Grey")),
        ],
    }
    reply = post(api, "/decide/shared", body)
    [(method, rows)] = scorer.calls
    assert method == "score_shared"
    assert [r.id for r in rows] == ["plain1", "avg#o0", "avg#o1", "avg#o2", "plain2"]
    results = reply["results"]
    assert [r["id"] for r in results] == ["plain1", "avg", "plain2"]
    assert results[0] == scorer.result(rows[0]) and results[2] == scorer.result(rows[4])
    assert "combined" in results[1] and "combined" not in results[0]
    assert reply["timing"]["batch_size"] == 5


def test_expanded_rows_count_toward_the_decision_cap():
    api, scorer = client(max_decisions=5)
    body = {
        "state": "s",
        "decisions": [
            decision("a", ("Red", "Green", "Blue"), orderings="rotations"),
            decision("b"),
            decision("c"),
            decision("e"),
        ],
    }
    response = api.simulate_post("/decide/shared", json=body, headers=AUTH)
    assert response.status_code == 422
    assert "expands to 6 rows, over the limit of 5" in response.json["error"]["message"]
    body["decisions"].pop()
    assert api.simulate_post("/decide/shared", json=body, headers=AUTH).status_code == 200
    response = api.simulate_post(
        "/decide", json=row("d", ("Red", "Green", "Blue", "Grey"), orderings="all"), headers=AUTH
    )
    assert "expands to 24 rows" in response.json["error"]["message"]


@pytest.mark.parametrize("path", ["/decide", "/decide/shared"])
def test_workload_with_orderings_is_422(path):
    api, scorer = client(calibration={"triage": 1.0})
    if path == "/decide":
        body = row("d", orderings="rotations", workload="triage")
    else:
        body = {
            "state": "s",
            "decisions": [decision("a"), decision("b", orderings="rotations")],
            "workload": "triage",
        }
    response = api.simulate_post(path, json=body, headers=AUTH)
    assert response.status_code == 422
    assert "workload: cannot be combined with orderings" in response.json["error"]["message"]
    assert scorer.calls == []


def test_an_unknown_ordering_mode_is_422_and_none_keeps_the_plain_shape():
    api, scorer = client()
    response = api.simulate_post("/decide", json=row(orderings="shuffle"), headers=AUTH)
    assert (
        response.status_code == 422
        and "orderings: must be one of none, rotations, all" in response.json["error"]["message"]
    )
    reply = post(api, "/decide", row(orderings="none"))
    assert reply == scorer.result(scorer.calls[-1][1]) and scorer.calls[-1][0] == "score"


def test_ordering_ids_may_not_collide_with_other_decisions():
    api, _ = client()
    body = {"state": "s", "decisions": [decision("a", orderings="rotations"), decision("a#o1")]}
    response = api.simulate_post("/decide/shared", json=body, headers=AUTH)
    assert response.status_code == 422
    assert (
        "decisions[1].id: 'a#o1' is already used by decisions[0]"
        in response.json["error"]["message"]
    )


# --- the pure functions --------------------------------------------------------------------------


def test_rotation_and_permutation_orders():
    assert ordering_permutations(3, "rotations") == [(0, 1, 2), (1, 2, 0), (2, 0, 1)]
    assert (
        ordering_permutations(3, "all")[0] == (0, 1, 2)
        and len(ordering_permutations(4, "all")) == 24
    )
    assert ordering_permutations(2, "none") == [(0, 1)]
    with pytest.raises(ValueError):
        ordering_permutations(5, "all")


def test_combine_is_the_renormalised_log_mean():
    results = [
        {
            "option_ids": ["a", "b"],
            "option_logits": [2.0, 0.0],
            "probabilities": softmax([2.0, 0.0]),
        },
        {
            "option_ids": ["b", "a"],
            "option_logits": [1.0, 0.0],
            "probabilities": softmax([1.0, 0.0]),
        },
    ]
    combined = combine(["a", "b"], results, "rotations")
    log_a = (math.log(softmax([2.0, 0.0])[0]) + math.log(softmax([1.0, 0.0])[1])) / 2
    log_b = (math.log(softmax([2.0, 0.0])[1]) + math.log(softmax([1.0, 0.0])[0])) / 2
    assert combined["probabilities"] == pytest.approx(softmax([log_a, log_b]), abs=1e-15)
    assert combined["top"] == "a"
    assert combined["agreement"] == 0.5


def test_calibrated_divides_logits_by_the_temperature():
    block = calibrated({"option_logits": [2.0, 1.0, -1.0]}, "w", 4.0)
    assert block["probabilities"] == pytest.approx(softmax([0.5, 0.25, -0.25]), abs=1e-15)


def test_ordering_permutations_refuses_with_a_precise_message():
    with pytest.raises(ValueError) as too_many:
        ordering_permutations(5, "all")
    assert str(too_many.value) == "orderings 'all' is allowed for at most 4 options, got 5"
    with pytest.raises(ValueError) as unknown:
        ordering_permutations(3, "shuffle")
    assert str(unknown.value) == "orderings must be one of none, rotations, all, got 'shuffle'"

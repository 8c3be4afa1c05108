"""Issue 38: what the ecosystem's apps send, accepted as the hosted services accept it (fake
scorer): unknown top-level fields ignored and listed, empty states, a noul with no instructions,
more than 16 options as option groups read back by one softmax, the old extension block's name
on request, and the /decide routes as strict as before."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
from fakes import AUTH, FakeScorer, fake_app
from falcon import testing

from semif_serve.apis import grouped
from semif_serve.apis.mapping import NO, YES
from semif_serve.apis.systemone import NOUL_WITHOUT_INSTRUCTIONS
from semif_serve.scoring.prompt import user_message
from semif_serve.scoring.rows import parse_row

NOUL = {"type": "noul", "instructions": "Is it open?"}
PREDICATE = {"type": "predicate", "instructions": "Is it open?"}


def s1(*questions, state="The door is open.", **more):
    return {"state": state, "questions": {f"q{k}": q for k, q in enumerate(questions)}, **more}


def od(*questions, input="The door is open.", **more):
    return {"input": input, "questions": list(questions), **more}


def post(path, body, scorer=None, **overrides):
    app, scorer = fake_app(scorer or FakeScorer(), **overrides)
    return testing.TestClient(app).simulate_post(path, json=body, headers=AUTH), scorer


def rows(scorer):
    return [row for _, call in scorer.calls for row in call]


# --- unknown top-level fields ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/systemone", s1(NOUL)), ("/v1/decisions", od(PREDICATE))]
)
def test_unknown_top_level_fields_are_ignored_and_listed_in_a_header(path, body):
    plain, plain_scorer = post(path, body)
    assert plain.status_code == 200 and "x-semif-ignored-fields" not in plain.headers
    extra, scorer = post(path, {**body, "seed": 7, "x_trace_id": "t", "metadata": {"a": 1}})
    assert extra.status_code == 200, extra.text
    assert extra.headers["x-semif-ignored-fields"] == "seed, x_trace_id, metadata"
    assert rows(scorer) == rows(plain_scorer)  # nothing of them reaches the prompt
    assert extra.json == plain.json


def test_the_ignored_fields_header_is_ascii_and_bounded():
    odd = {"a\nb": 1, "ü": 2, "x" * 70: 3}
    many = {f"f{k}": k for k in range(30)}
    response, _ = post("/v1/systemone", {**s1(NOUL), **odd, **many})
    assert response.status_code == 200, response.text
    header = response.headers["x-semif-ignored-fields"]
    shown = ['"a\\nb"', '"\\u00fc"', json.dumps("x" * 64)] + [f"f{k}" for k in range(13)]
    assert header == ", ".join([*shown, "... (17 more)"])
    assert header.isascii()


def test_a_question_s_unknown_key_is_still_refused():
    response, scorer = post("/v1/systemone", s1({**NOUL, "weight": 2}))
    assert response.status_code == 422
    assert response.json["error"]["param"] == "questions.q0"
    assert scorer.calls == []


def test_decide_keeps_its_strict_keys():
    body = {
        "id": "r",
        "state": "s",
        "question": "q",
        "options": [{"id": "y", "description": "Y"}, {"id": "n", "description": "N"}],
        "seed": 7,
    }
    app, scorer = fake_app(FakeScorer())
    response = testing.TestClient(app).simulate_post("/decide", json=body, headers=AUTH)
    assert response.status_code == 422
    assert "x-semif-ignored-fields" not in response.headers
    assert scorer.calls == []


# --- empty states ------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["", {}, []])
def test_an_empty_system_one_state_is_scored_as_sent(state):
    response, scorer = post("/v1/systemone", s1(NOUL, state=state))
    assert response.status_code == 200, response.text
    [row] = rows(scorer)
    assert row.state == state and type(row.state) is type(state)
    assert response.headers["x-semif-state-key"]


@pytest.mark.parametrize("given", ["", []])
def test_an_empty_decisions_input_is_scored_as_sent(given):
    response, scorer = post("/v1/decisions", od(PREDICATE, input=given))
    assert response.status_code == 200, response.text
    assert [row.state for row in rows(scorer)] == [given]


@pytest.mark.parametrize(("state", "evidence"), [("", '""'), ({}, "{}"), ([], "[]")])
def test_an_empty_state_renders_as_an_empty_evidence_block(state, evidence):
    body = {
        "id": "r",
        "state": state,
        "question": "Q?",
        "options": [{"id": "y", "description": "Y"}, {"id": "n", "description": "N"}],
    }
    row = parse_row(body, empty_state=True)
    assert user_message(row).startswith('{"evidence": ' + evidence + ', "criterion": "Q?"')


@pytest.mark.parametrize("state", ["", " ", {}, []])
def test_decide_still_refuses_an_empty_state(state):
    body = {
        "id": "r",
        "state": state,
        "question": "q",
        "options": [{"id": "y", "description": "Y"}, {"id": "n", "description": "N"}],
    }
    app, scorer = fake_app(FakeScorer())
    response = testing.TestClient(app).simulate_post("/decide", json=body, headers=AUTH)
    assert response.status_code == 422
    assert response.json["error"]["message"] == "state: must be a nonempty string, object or array"
    assert scorer.calls == []


# --- a noul without instructions ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("criteria", "descriptions"),
    [
        ({"true": "It rains"}, ["It rains", NO]),
        ({"false": "It is dry"}, [YES, "It is dry"]),
        ({"true": "It rains", "false": "It is dry"}, ["It rains", "It is dry"]),
        ({"true": {"weather": "rain"}, "false": None}, ['{"weather": "rain"}', NO]),
    ],
)
@pytest.mark.parametrize("instructions", ["missing", None, "", "  "])
def test_a_noul_with_a_described_side_and_no_instructions_asks_which_side_holds(
    criteria, descriptions, instructions
):
    question = {"type": "noul", "criteria": criteria}
    if instructions != "missing":
        question["instructions"] = instructions
    response, scorer = post("/v1/systemone", s1(question))
    assert response.status_code == 200, response.text
    [row] = rows(scorer)
    assert row.question == NOUL_WITHOUT_INSTRUCTIONS
    assert [option.description for option in row.options] == descriptions


# --- more than 16 options ----------------------------------------------------------------------


def planted(count):
    """A scorer whose logit for option k's description is k / 10 (so all differ)."""
    return FakeScorer(base={f"d{k}": k / 10 for k in range(count)})


def exact_softmax(values):
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    total = math.fsum(weights)
    return [w / total for w in weights]


def test_forty_choices_are_three_rows_of_one_question_read_back_by_one_softmax():
    criteria = {f"c{k}": f"d{k}" for k in range(40)}
    question = {"type": "choice", "instructions": "Which?", "criteria": criteria}
    body = {**s1(question), "model": "jev-latest", "state": {}}
    response, scorer = post("/v1/systemone", body, scorer=planted(40))
    assert response.status_code == 200, response.text
    sent = rows(scorer)
    assert [len(row.options) for row in sent] == [14, 13, 13]
    assert {row.question for row in sent} == {"Which?"} and {json.dumps(r.state) for r in sent} == {
        "{}"
    }
    assert [o.description for row in sent for o in row.options] == [f"d{k}" for k in range(40)]
    assert len(scorer.calls) == 1  # one shared call: the state prefilled once for every group
    answer = response.json["answers"]["q0"]
    expected = exact_softmax([k / 10 for k in range(40)])
    assert list(answer["probabilities"]) == list(criteria)
    assert list(answer["probabilities"].values()) == pytest.approx(expected, abs=1e-12)
    assert answer["choice"] == "c39"
    assert answer["confidence"] == pytest.approx((40 * expected[-1] - 1) / 39)
    block = answer["x_semif"]
    assert block["method"] == "grouped-16"
    assert len(block["group_prompt_sha256"]) == 3
    assert block["input_tokens"] == 3 * 10  # the fake's 10 tokens per row


def test_seventeen_levels_are_two_rows_and_the_score_is_the_expectation():
    levels = [f"d{k}" for k in range(17)]
    body = od({"type": "score", "instructions": "How?", "levels": [{"label": t} for t in levels]})
    response, scorer = post("/v1/decisions", body, scorer=planted(17))
    assert response.status_code == 200, response.text
    assert [len(row.options) for row in rows(scorer)] == [9, 8]
    [answer] = response.json["answers"]
    expected = exact_softmax([k / 10 for k in range(17)])
    assert [p["probability"] for p in answer["probabilities"]] == pytest.approx(expected, abs=1e-12)
    assert answer["score"] == pytest.approx(sum(k * p for k, p in enumerate(expected)))


def test_sixteen_options_stay_one_direct_row():
    criteria = {f"c{k}": f"d{k}" for k in range(16)}
    response, scorer = post(
        "/v1/systemone",
        s1({"type": "choice", "instructions": "Which?", "criteria": criteria}),
        scorer=planted(16),
    )
    [row] = rows(scorer)
    assert len(row.options) == 16
    block = response.json["answers"]["q0"]["x_semif"]
    assert block["method"] == "direct-options-v1" and "group_prompt_sha256" not in block
    assert (
        block["probabilities"]
        == FakeScorer(base={f"d{k}": k / 10 for k in range(16)}).result(row)["probabilities"]
    )


def test_grouped_and_plain_questions_share_one_call_in_order():
    many = {
        "type": "choice",
        "instructions": "Which?",
        "criteria": {f"c{k}": f"d{k}" for k in range(20)},
    }
    response, scorer = post("/v1/systemone", s1(NOUL, many, NOUL), scorer=planted(20))
    assert response.status_code == 200, response.text
    assert [len(row.options) for row in rows(scorer)] == [2, 10, 10, 2]
    assert list(response.json["answers"]) == ["q0", "q1", "q2"]
    assert response.json["usage"]["input_tokens"] == 6 + 4 * 4  # the fake's state once, 4 rows


def test_max_options_is_the_setting():
    criteria = {f"c{k}": None for k in range(17)}
    response, scorer = post(
        "/v1/systemone",
        s1({"type": "choice", "instructions": "Which?", "criteria": criteria}),
        max_options=16,
    )
    assert response.status_code == 422
    assert response.json["error"]["code"] == "option_count_unsupported"
    assert "over the 16 this server scores (SEMIF_MAX_OPTIONS" in response.json["error"]["message"]
    assert scorer.calls == []


def test_groups_are_balanced_and_cover_every_option_once():
    for count in range(17, 256):
        cuts = grouped.groups(count)
        sizes = [len(cut) for cut in cuts]
        assert len(cuts) == -(-count // 16) and max(sizes) <= 16 and max(sizes) - min(sizes) <= 1
        assert [k for cut in cuts for k in cut] == list(range(count))
    assert [len(cut) for cut in grouped.groups(40)] == [14, 13, 13]


def test_the_tournament_multiplies_the_group_and_final_probabilities():
    results = [
        {"probabilities": [0.5, 0.25, 0.25], "option_logits": [1, 0, 0], "prompt_sha256": "a"},
        {"probabilities": [0.1, 0.9], "option_logits": [0, 2], "prompt_sha256": "b"},
    ]
    cuts = [range(0, 3), range(3, 5)]
    assert grouped.winners(results, cuts) == [0, 4]
    final = {"probabilities": [0.2, 0.8]}
    assert grouped.knocked_out(results, final) == pytest.approx([0.1, 0.05, 0.05, 0.08, 0.72])


# --- the extension block's old name ------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/systemone", s1(NOUL)), ("/v1/decisions", od(PREDICATE))]
)
def test_the_old_block_name_is_added_only_on_request(path, body):
    response, _ = post(path, body)
    answers = response.json["answers"]
    [answer] = answers.values() if isinstance(answers, dict) else answers
    assert "x_semif" in answer and "semif" not in answer
    response, _ = post(path, body, legacy_extension_block=True)
    answers = response.json["answers"]
    [answer] = answers.values() if isinstance(answers, dict) else answers
    assert answer["semif"] == answer["x_semif"]


# --- the translator gaps found in review ------------------------------------------------------


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def json_part(data):
    return {"type": "input_json", "data": data}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            od(PREDICATE, input=user(json_part([{"a": 1}, "b"]))),
            "input[0].content[0].data[1]: must be an object",
        ),
        (
            od({**PREDICATE, "instructions": [json_part([1])]}),
            "questions[0].instructions[0].data[0]: must be an object",
        ),
        (
            od(
                PREDICATE,
                input=[
                    {
                        "role": "assistant",
                        "content": [
                            {
                                "type": "output_text",
                                "text": "ok",
                                "prompt_cache_breakpoint": {"mode": "explicit"},
                            }
                        ],
                    }
                ],
            ),
            "input[0].content[0]: unknown keys ['prompt_cache_breakpoint']; allowed: text, type",
        ),
        (
            od(
                PREDICATE,
                input=[
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "custom_tool_call", "call_id": "c", "name": "g", "input": ""},
                ],
            ),
            "input[1].call_id: 'c' is already an earlier call's id",
        ),
        (
            od(
                {
                    "type": "score",
                    "instructions": "How?",
                    "levels": [{"label": "low"}, {"label": "high"}, {"label": "low"}],
                }
            ),
            "questions[0].levels[2].label: 'low' is already the label of questions[0].levels[0]",
        ),
    ],
)
def test_what_the_format_does_not_allow_is_a_422_naming_the_field(body, message):
    response, scorer = post("/v1/decisions", body)
    assert response.status_code == 422
    assert response.json["error"]["message"] == message
    assert scorer.calls == []


def test_no_two_inputs_render_alike():
    one = od(PREDICATE, input=user(json_part([{"a": 1}, {"b": 2}])))
    two = od(PREDICATE, input=user(json_part({"a": 1}), json_part({"b": 2})))
    texts = od(PREDICATE, input=user({"type": "input_text", "text": '{"a": 1}'}))
    json_one = od(PREDICATE, input=user(json_part({"a": 1})))
    states = []
    for body in (one, two, texts, json_one):
        response, scorer = post("/v1/decisions", body)
        assert response.status_code == 200, response.text
        [row] = rows(scorer)
        states.append(json.dumps(row.state))
    assert len(set(states)) == 4
    assert states[0] == '[{"role": "user", "content": {"input_json": [{"a": 1}, {"b": 2}]}}]'


@pytest.mark.parametrize(
    ("question", "field"),
    [
        ({"type": "score", "instructions": "How?", "criteria": ["low", " "]}, "criteria[1]"),
        (
            {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "": None}},
            "criteria.",
        ),
        (
            {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b": "\n"}},
            "criteria.b",
        ),
    ],
)
def test_a_blank_option_is_refused_before_any_chunk_is_scored(question, field):
    questions = {f"n{k}": NOUL for k in range(5)}
    body = {"state": "s", "questions": {**questions, "late": question}}
    response, scorer = post("/v1/systemone", body, max_decisions=2)
    assert response.status_code == 422
    assert response.json["error"]["message"] == f"questions.late.{field}: must be a nonempty string"
    assert scorer.calls == []


def test_read_back_by_tournament_scores_the_group_winners_in_a_final():
    from semif_serve.apis.mapping import Mapped

    question = Mapped(
        "questions.q",
        "Which?",
        tuple(f"d{k}" for k in range(20)),
        tuple(f"criteria.c{k}" for k in range(20)),
    )
    plain = Mapped("questions.p", "Open?", (YES, NO), ("criteria.true", "criteria.false"))
    layout = grouped.plan([plain, question])
    assert [len(row.descriptions) for row in layout.rows] == [2, 10, 10]

    def result(probabilities, digest):
        logits = [math.log(p) for p in probabilities]
        common = {"prompt_version": "v", "probability_status": "s", "model": {"id": "m"}}
        return {
            **common,
            "probabilities": probabilities,
            "option_logits": logits,
            "input_tokens": 5,
            "prompt_sha256": digest,
            "cache_hit": False,
            "prefix_sha256": "p",
        }

    first = [0.05] * 5 + [0.55] + [0.05] * 4
    second = [0.05] * 9 + [0.55]
    results = [result([0.7, 0.3], "a"), result(first, "b"), result(second, "c")]
    finals_sent = []

    def finals(rows):
        finals_sent.extend(rows)
        return [result([0.25, 0.75], "f")]

    [kept, read] = grouped.read_back([plain, question], layout, results, grouped.TOURNAMENT, finals)
    assert kept is results[0]
    [final] = finals_sent
    assert final.descriptions == ("d5", "d19") and final.question == "Which?"
    assert final.option_fields == ("criteria.c5", "criteria.c19")
    expected = [p * 0.25 for p in first] + [p * 0.75 for p in second]
    assert read["probabilities"] == pytest.approx(expected, abs=1e-15)
    assert read["method"] == "tournament-16"
    assert read["group_prompt_sha256"] == ["b", "c", "f"]
    assert read["input_tokens"] == 15
    pooled = grouped.read_back([plain, question], layout, results, grouped.SHARED_NORMALISER)
    assert pooled[1]["method"] == "grouped-16" and pooled[1]["group_prompt_sha256"] == ["b", "c"]
    assert pooled[1]["probabilities"] == pytest.approx(
        exact_softmax([math.log(p) for p in first + second]), abs=1e-15
    )


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/systemone", s1(NOUL)), ("/v1/decisions", od(PREDICATE))]
)
def test_an_empty_model_name_names_no_model(path, body):
    # A 422 naming `model` since issue 43 (a 404 before; the default model before that).
    response, scorer = post(path, {**body, "model": " "})
    assert response.status_code == 422
    assert response.json["error"]["message"].startswith("model: must name a model")
    assert response.json["error"]["param"] == "model"
    assert scorer.calls == []


def test_models_retrieve_answers_head_and_an_empty_id_is_404():
    app, _ = fake_app(FakeScorer())
    client = testing.TestClient(app)
    head = client.simulate_head("/v1/models/gpt-6-luna", headers=AUTH)
    assert (head.status_code, head.content) == (200, b"")
    assert client.simulate_get("/v1/models/", headers=AUTH).status_code == 404


def test_the_ignored_fields_are_named_on_a_refusal_too():
    body = {"state": "s", "question": {"q": NOUL}}  # `questions` misspelt
    response, scorer = post("/v1/systemone", body)
    assert response.status_code == 422
    assert response.headers["x-semif-ignored-fields"] == "question"
    assert scorer.calls == []


# --- what the mutation grid asked for ----------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/v1/systemone",
            s1({"type": "score", "instructions": "How?", "criteria": [f"l{k}" for k in range(17)]}),
            "questions.q0.criteria",
        ),
        (
            "/v1/decisions",
            od(
                {
                    "type": "choice",
                    "instructions": "Which?",
                    "choices": [{"value": f"v{k}"} for k in range(17)],
                }
            ),
            "questions[0].choices",
        ),
        (
            "/v1/decisions",
            od(
                {
                    "type": "score",
                    "instructions": "How?",
                    "levels": [{"label": f"l{k}"} for k in range(17)],
                }
            ),
            "questions[0].levels",
        ),
    ],
)
def test_every_option_list_obeys_max_options(path, body, field):
    response, scorer = post(path, body, max_options=16)
    assert response.status_code == 422
    assert response.json["error"]["param"] == field
    assert response.json["error"]["code"] == "option_count_unsupported"
    assert scorer.calls == []
    assert post(path, body, max_options=17)[0].status_code == 200


def test_a_choice_with_blank_instructions_names_them():
    response, _ = post(
        "/v1/systemone",
        s1({"type": "choice", "instructions": " ", "criteria": {"a": None, "b": None}}),
    )
    assert response.json["error"]["message"] == "questions.q0.instructions: must not be empty"


def test_the_grouped_block_carries_the_rows_shared_fields():
    criteria = {f"c{k}": f"d{k}" for k in range(20)}
    response, scorer = post(
        "/v1/systemone",
        s1({"type": "choice", "instructions": "Which?", "criteria": criteria}),
        scorer=planted(20),
    )
    block = response.json["answers"]["q0"]["x_semif"]
    rows_sent = rows(scorer)
    own = [FakeScorer(base={f"d{k}": k / 10 for k in range(20)}).result(row) for row in rows_sent]
    hashes = [result["prompt_sha256"] for result in own]
    assert block["group_prompt_sha256"] == hashes
    assert block["prompt_sha256"] == hashlib.sha256("\n".join(hashes).encode()).hexdigest()
    plain, _ = post(
        "/v1/systemone",
        s1(
            {
                "type": "choice",
                "instructions": "Which?",
                "criteria": dict(list(criteria.items())[:2]),
            }
        ),
    )
    single = plain.json["answers"]["q0"]["x_semif"]
    for key in ("cache_hit", "prefix_sha256", "model", "prompt_version", "probability_status"):
        assert key in single and block[key] == single[key], key


def test_the_softmax_of_large_logits_does_not_overflow():
    assert grouped.softmax([1000.0, 1000.0 - math.log(3)]) == pytest.approx([0.75, 0.25], abs=1e-12)


def test_a_hosted_name_a_model_takes_is_not_listed_as_an_alias():
    from semif_serve.apis.names import listed_aliases

    assert listed_aliases({}, "m", True, ["m", "gpt-6-luna"]) == {"jev-latest": "m"}
    assert listed_aliases({"gpt-6-luna": "x"}, "m", True, ["m"]) == {
        "gpt-6-luna": "x",
        "jev-latest": "m",
    }
    assert listed_aliases({"a": "m"}, "m", False, ["m"]) == {"a": "m"}


def test_sixteen_ignored_fields_are_all_named():
    many = {f"f{k}": k for k in range(16)}
    response, _ = post("/v1/systemone", {**s1(NOUL), **many})
    assert response.headers["x-semif-ignored-fields"] == ", ".join(many)


def test_the_model_header_is_always_a_legal_value():
    from semif_serve.http.ecosystem import model_header

    assert model_header("m", None) == "m"
    assert model_header("m", ' a"b\\c~é\x7f\x1f') == 'm; revision=" a\\"b\\\\c~???"'


def test_a_decisions_state_refusal_names_the_input():
    deep: dict = {}
    for _ in range(40):
        deep = {"a": deep}
    body = od(PREDICATE, input=user(json_part(deep)))
    response, scorer = post("/v1/decisions", body)
    assert response.status_code == 422
    assert response.json["error"]["message"].startswith("input: nested deeper than 32 levels")
    assert scorer.calls == []

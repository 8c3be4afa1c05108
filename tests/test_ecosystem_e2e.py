"""End to end on the real SmolLM2: the official SDKs (typesafe-sdk, openai), unmodified, against
`semif-serve serve` under gunicorn, and each answer equal to the rows the mapping rules give.

The mapped rows are written out here by hand from the rules (docs/decision-apis.md), never
built by the translators: a request with k questions must give the prompts (prompt_sha256) and
probabilities of its k rows sent to `/decide/shared` (the same path: equal to 1e-6) and to
`/decide` one by one (the direct path: equal to float32 rounding, as shared and direct always
are)."""

import json
import math

import openai
import pytest
from fakes import AUTH, TOKEN
from live_server import LiveServer, real_env, semif_serve_command
from typesafe_sdk import Choice, Noul, Score, TypeSafeClient

pytestmark = [pytest.mark.slow, pytest.mark.server]

STATE = {"ticket": "The printer on floor 3 jams on every job.", "reporter": "Ana Müller"}
YES, NO = "The answer to the question is yes.", "The answer to the question is no."
# A state past the state-prefix cache's 128-token floor, so a second request resumes it.
LONG_STATE = "Log: " + " ".join(f"step {n} printed page {n} of the report." for n in range(40))


def rows(state):
    """The rows the three System One questions below map to, by the documented rules."""

    def row(row_id, question, descriptions):
        options = [{"id": f"o{k}", "description": text} for k, text in enumerate(descriptions)]
        return {"id": row_id, "state": state, "question": question, "options": options}

    return [
        row("billing", "Is this about billing?", [YES, NO]),
        row("tone", {"ask": "What is the tone?"}, ["calm", "An upset message"]),
        row("urgency", "How urgent is it?", ["Can wait", '{"when": "today"}', "Now"]),
    ]


QUESTIONS = {
    "billing": Noul(instructions="Is this about billing?"),
    "tone": Choice(
        instructions={"ask": "What is the tone?"},
        criteria={"calm": None, "angry": "An upset message"},
    ),
    "urgency": Score(
        instructions="How urgent is it?", criteria=["Can wait", {"when": "today"}, "Now"]
    ),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, builtin_cache):
    folder = tmp_path_factory.mktemp("ecosystem")
    env = real_env(builtin_cache)  # no alias: the hosted names are known out of the box
    with LiveServer(semif_serve_command(), env, folder / "server.log") as live:
        yield live


def shared_rows(server, state):
    """The mapped rows as one /decide/shared call and as /decide calls, by row id."""
    decisions = []
    for mapped in rows(state):
        decision = {key: mapped[key] for key in ("id", "question", "options")}
        if not isinstance(decision["question"], str):
            decision["question"] = json.dumps(decision["question"], ensure_ascii=False)
        decisions.append(decision)
    status, shared, _ = server.request(
        "POST", "/decide/shared", {"state": state, "decisions": decisions}, AUTH
    )
    assert status == 200, shared
    direct = {}
    for decision in decisions:
        status, reply, _ = server.request("POST", "/decide", {**decision, "state": state}, AUTH)
        assert status == 200, reply
        direct[decision["id"]] = reply
    return {result["id"]: result for result in shared["results"]}, direct


def test_system_one_answers_are_the_mapped_rows(server):
    with TypeSafeClient(api_key=TOKEN, base_url=f"http://127.0.0.1:{server.port}") as client:
        reply = client.system_one(state=STATE, questions=QUESTIONS)  # model: jev-latest
    assert reply.model == "jev-latest"
    assert reply.raw_http_response.headers["x-semif-model"].startswith("default; revision=")
    shared, direct = shared_rows(server, STATE)
    raw = json.loads(reply.raw_http_response.content)["answers"]
    for name in QUESTIONS:
        block = raw[name]["x_semif"]
        assert (
            block["prompt_sha256"] == shared[name]["prompt_sha256"] == direct[name]["prompt_sha256"]
        )
        assert block["probabilities"] == pytest.approx(shared[name]["probabilities"], abs=1e-6)
        assert block["probabilities"] == pytest.approx(direct[name]["probabilities"], abs=1e-4)
    p_billing = shared["billing"]["probabilities"]
    assert reply.nouls["billing"].noul == pytest.approx(p_billing[0], abs=1e-6)
    p_tone = shared["tone"]["probabilities"]
    assert reply.choices["tone"].probabilities == pytest.approx(
        {"calm": p_tone[0], "angry": p_tone[1]}, abs=1e-6
    )
    p_urgency = shared["urgency"]["probabilities"]
    assert reply.scores["urgency"].score == pytest.approx(p_urgency[1] + 2 * p_urgency[2], abs=1e-6)
    assert reply.scores["urgency"].legend == {0: "Can wait", 1: '{"when": "today"}', 2: "Now"}
    # The state once, then each question's own tokens: what one shared call evaluated.
    timing_tokens = sum(direct[name]["input_tokens"] for name in QUESTIONS)
    assert 0 < reply.usage.input_tokens < timing_tokens and reply.usage.output_tokens == 0


def test_decisions_answers_are_the_mapped_rows_and_count_the_cache(server):
    client = openai.OpenAI(api_key=TOKEN, base_url=f"http://127.0.0.1:{server.port}/v1")
    questions = [
        {"type": "predicate", "instructions": "Is this about billing?", "name": "billing"},
        {
            "type": "choice",
            "instructions": [{"type": "input_json", "data": {"ask": "What is the tone?"}}],
            "choices": [{"value": "calm"}, {"value": "angry", "description": "An upset message"}],
            "name": "tone",
        },
        {
            "type": "score",
            "instructions": "How urgent is it?",
            "levels": [{"label": "Can wait"}, {"label": '{"when": "today"}'}, {"label": "Now"}],
            "name": "urgency",
        },
    ]
    first = client.decisions.create(model="gpt-6-luna", input=LONG_STATE, questions=questions)
    again = client.decisions.create(model="default", input=LONG_STATE, questions=questions)
    assert (first.model, again.model) == ("gpt-6-luna", "default")
    shared, _ = shared_rows(server, LONG_STATE)
    for answer in first.answers:
        block = answer.x_semif
        assert block["prompt_sha256"] == shared[answer.name]["prompt_sha256"]
        assert block["probabilities"] == pytest.approx(
            shared[answer.name]["probabilities"], abs=1e-6
        )
    # The first request stored the state prefix; the second read it back (the same scores).
    stored = first.usage.input_tokens_details
    assert stored.cached_tokens == 0 and stored.cache_write_tokens > 100
    reused = again.usage.input_tokens_details
    assert reused.cached_tokens == stored.cache_write_tokens and reused.cache_write_tokens == 0
    assert again.usage.input_tokens == first.usage.input_tokens == first.usage.total_tokens
    for before, after in zip(first.answers, again.answers, strict=True):
        assert after.x_semif["probabilities"] == pytest.approx(
            before.x_semif["probabilities"], abs=1e-5
        )


NAMES = [f"Queue {k:02d}" for k in range(40)]
DESCRIPTIONS = [f"Tickets about topic {k}" for k in range(40)]
FORTY = {"queue": Choice(instructions="Which queue?", criteria=dict(zip(NAMES, DESCRIPTIONS)))}


def test_a_hosted_name_an_empty_state_and_forty_choices_are_answered(server):
    """Issue 38's drop-in request on a server with no alias configured."""
    with TypeSafeClient(api_key=TOKEN, base_url=f"http://127.0.0.1:{server.port}") as client:
        reply = client.system_one(state={}, questions=FORTY)  # model: jev-latest
        again = client.system_one(state={}, questions=FORTY)
    assert reply.model == "jev-latest"
    answer = reply.choices["queue"]
    assert list(answer.probabilities) == NAMES
    assert math.fsum(answer.probabilities.values()) == pytest.approx(1.0, abs=1e-12)
    assert answer.choice == max(NAMES, key=answer.probabilities.__getitem__)
    assert again.choices["queue"].probabilities == answer.probabilities  # deterministic
    block = json.loads(reply.raw_http_response.content)["answers"]["queue"]["x_semif"]
    assert block["method"] == "grouped-16" and len(block["group_prompt_sha256"]) == 3


def test_forty_choices_are_one_softmax_over_the_groups_rows(server):
    """grouped-16 as documented: the question as rows of 14, 13 and 13 options over the state in
    one shared call; the answer is one softmax over all of their option logits."""
    with TypeSafeClient(api_key=TOKEN, base_url=f"http://127.0.0.1:{server.port}") as client:
        reply = client.system_one(state=STATE, questions=FORTY)
    block = json.loads(reply.raw_http_response.content)["answers"]["queue"]["x_semif"]
    decisions = [
        {
            "id": f"g{index}",
            "question": "Which queue?",
            "options": [{"id": f"o{k}", "description": DESCRIPTIONS[k]} for k in range(*cut)],
        }
        for index, cut in enumerate([(0, 14), (14, 27), (27, 40)])
    ]
    status, shared, _ = server.request(
        "POST", "/decide/shared", {"state": STATE, "decisions": decisions}, AUTH
    )
    assert status == 200, shared
    results = shared["results"]
    assert block["group_prompt_sha256"] == [result["prompt_sha256"] for result in results]
    logits = [x for result in results for x in result["option_logits"]]
    assert block["option_logits"] == logits
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    expected = [w / math.fsum(weights) for w in weights]
    got = list(reply.choices["queue"].probabilities.values())
    assert got == pytest.approx(expected, abs=1e-12)

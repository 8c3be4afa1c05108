"""Growing states on real models (SmolLM2: attention only; tiny Qwen3.5: hybrid, with the real
vocabulary): a state that grew, was edited in the middle or was cut resumes from the stored
work of an earlier version, and scores what a cold call scores bit for bit (fp32, the CPU's
invariant numerics; the hybrid's prefills stop at delta-rule chunk starts), whatever the reuse
point. Hypothesis drives text and JSON states through random versions."""

from __future__ import annotations

import pytest
from exactness import worst_difference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rows_factory import make_rows

from semif_serve.scoring import score, score_shared
from semif_serve.scoring.checkpoints import BOUNDARY, CHECKPOINT, CROP, END, LINEAR_CHUNK_TOKENS
from semif_serve.scoring.prefix_cache import PrefixCache

TOLERANCE = 0
MAX_TOKENS = 4096
MODEL = ("source", "test")
EVENTS = [
    "user opened ticket about the printer on floor 3",
    "agent asked for the error code shown on the panel",
    "user replied: E-42 after every job, since Monday",
    "agent scheduled a technician visit for Thursday",
    "technician replaced the fuser unit and ran a test page",
    "user reports the jam is back after two days",
    "agent escalated to the vendor with the service log",
    "vendor shipped a replacement tray, tracking 1Z999",
]


def text_state(events: list[str]) -> str:
    return "\n".join(f"[{n:02d}] {event}." for n, event in enumerate(events))


def json_state(events: list[str]) -> dict:
    return {"ticket": "T-1042", "events": [{"n": n, "what": e} for n, e in enumerate(events)]}


STATES = {"text": text_state, "json": json_state}


def scored(scoring_model, state, view):
    """(cold results, results through `view`, the cached call's timing) for rows over `state`."""
    rows = make_rows(3, [2, 4], state=state)
    cold, _ = score_shared(scoring_model, rows, max_tokens=MAX_TOKENS)
    cached, timing = score_shared(scoring_model, rows, max_tokens=MAX_TOKENS, prefix_cache=view)
    return cold, cached, timing


def store(min_tokens=16, checkpoint_tokens=32) -> PrefixCache:
    return PrefixCache(1 << 30, min_tokens=min_tokens, checkpoint_tokens=checkpoint_tokens)


@pytest.mark.parametrize("kind", sorted(STATES))
@pytest.mark.parametrize("model_name", ["smollm2", "tiny_qwen"])
def test_a_state_grown_event_by_event_resumes_its_last_version_exactly(request, model_name, kind):
    scoring_model = request.getfixturevalue(model_name)
    view = store().for_model(MODEL)
    for count in range(3, len(EVENTS) + 1):
        cold, cached, timing = scored(scoring_model, STATES[kind](EVENTS[:count]), view)
        assert worst_difference(cold, cached) <= TOLERANCE
        if count == 3:
            assert timing["cached_tokens"] == 0 and timing["prefix_stored"]
            continue
        # Most of the state is reused: all but the tokens from where the new event starts.
        assert timing["prefix_tokens"] - timing["cached_tokens"] < 60 + 32
        assert timing["reuse_point"] in (END, CROP, CHECKPOINT, BOUNDARY)
    assert view.stats()["entries"] <= 2  # a grown version replaces the one it grew from


@pytest.mark.parametrize("model_name", ["smollm2", "tiny_qwen"])
def test_a_state_edited_in_the_middle_or_cut_resumes_exactly(request, model_name):
    scoring_model = request.getfixturevalue(model_name)
    view = store().for_model(MODEL)
    scored(scoring_model, text_state(EVENTS), view)
    edited = EVENTS[:4] + ["user changed the reported floor to 4"] + EVENTS[5:]
    for state in (text_state(edited), text_state(EVENTS[:5])):
        cold, cached, timing = scored(scoring_model, state, view)
        assert worst_difference(cold, cached) <= TOLERANCE
        assert timing["cached_tokens"] >= 32  # at least the first checkpoint


def test_the_hybrid_model_resumes_a_grown_json_state_where_its_prefill_stopped(tiny_qwen):
    view = store(checkpoint_tokens=0).for_model(MODEL)  # no periodic checkpoints
    _, _, first = scored(tiny_qwen, json_state(EVENTS[:4]), view)
    cold, cached, timing = scored(tiny_qwen, json_state(EVENTS[:5]), view)
    assert worst_difference(cold, cached) == 0
    # JSON closes the state with `]}`: the grown version diverges just before the first one's
    # end, after the delta-rule chunk start where the first one's prefill stopped and was stored.
    stored = first["prefix_tokens"]
    assert stored % LINEAR_CHUNK_TOKENS == 0 and stored > 100
    assert timing["reuse_point"] == END and timing["cached_tokens"] == stored


def test_a_direct_call_resumes_a_grown_state_too(smollm2):
    view = store().for_model(MODEL)
    (row,) = make_rows(1, 3, state=text_state(EVENTS[:5]))
    score(smollm2, row, max_tokens=MAX_TOKENS, prefix_cache=view)
    (grown,) = make_rows(1, 3, state=text_state(EVENTS[:6]))
    cold = score(smollm2, grown, max_tokens=MAX_TOKENS)
    cached = score(smollm2, grown, max_tokens=MAX_TOKENS, prefix_cache=view)
    assert worst_difference([cold], [cached]) <= TOLERANCE
    assert view.stats()["partial_hits"] == 1 and view.stats()["reused_tokens"] > 0


versions = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 2)),
        st.tuples(st.just("edit"), st.integers(0, 7)),
        st.tuples(st.just("cut"), st.integers(1, 7)),
    ),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize("model_name", ["smollm2", "tiny_qwen"])
def test_any_sequence_of_versions_scores_what_cold_calls_score(request, model_name):
    scoring_model = request.getfixturevalue(model_name)

    @settings(
        max_examples=4,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(st.sampled_from(sorted(STATES)), versions)
    def check(kind, steps):
        view = store().for_model(MODEL)
        events = list(EVENTS[:4])
        scored(scoring_model, STATES[kind](events), view)
        for step, amount in steps:
            if step == "append":
                events += [f"note {len(events)}: follow-up number {amount}"] * amount
            elif step == "edit":
                events[amount % len(events)] = "an edited event in the middle"
            else:
                events = events[: max(1, amount % len(events) or 1)]
            cold, cached, _ = scored(scoring_model, STATES[kind](events), view)
            assert worst_difference(cold, cached) <= TOLERANCE

    check()

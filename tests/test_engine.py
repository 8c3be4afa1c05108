"""The engine's lock and failure policy, with fake scorers."""

import pytest
from fakes import FakeScorer

from semif_serve.engine import Engine
from semif_serve.errors import OutOfMemory, ScoringFailed
from semif_serve.scoring import parse_row

ROW = parse_row(
    {
        "id": "a",
        "state": "s",
        "question": "q",
        "options": [{"id": "y", "description": "Y"}, {"id": "n", "description": "N"}],
    }
)


def test_value_errors_and_out_of_memory_pass_through():
    for error in (ValueError("options: bad"), OutOfMemory("CUDA out of memory")):
        with pytest.raises(type(error)) as caught:
            Engine(FakeScorer(error=error)).score(ROW)
        assert caught.value is error


def test_other_failures_become_an_unchained_scoring_failed(caplog):
    with pytest.raises(
        ScoringFailed, match="scoring failed: RuntimeError: kernel exploded"
    ) as caught:
        Engine(FakeScorer(error=RuntimeError("kernel exploded"))).score_shared([ROW])
    assert caught.value.__cause__ is None and caught.value.__context__ is None
    assert "kernel exploded" in caplog.text  # logged with its traceback
    assert "Traceback" in caplog.text


def test_the_lock_is_released_after_a_failure():
    scorer = FakeScorer(error=RuntimeError("once"))
    engine = Engine(scorer)
    with pytest.raises(ScoringFailed):
        engine.score(ROW)
    scorer.error = None
    assert engine.score(ROW)["id"] == "a"

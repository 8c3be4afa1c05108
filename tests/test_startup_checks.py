"""Issue 30's startup and reply checks: a model whose warm-up scores are not finite fails the
start (naming the model), a model that makes NaN for some inputs only answers those with a clear
500, and the /health anyone may read shows readiness and the model's id, never a path.

Before issue 30, 4 KB of 0xFF in the weights passed the warm-up, /health said ok, and every
/decide was a 500 "Out of range float values are not JSON compliant"; /health showed the
model's source, a local model's folder included, to callers without a token.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import serve_steered
from fakes import AUTH, TOKEN, FakeScorer, row, settings
from falcon import testing
from tiny_models import poisoned

from semif_serve.engine.boot import (
    StartupError,
    build_engine,
    check_finite_warm_up,
    non_finite_scores,
)
from semif_serve.engine.engine import Engine
from semif_serve.http import create_app
from semif_serve.runtime.service import SEMIF_COMMIT, DecisionService
from semif_serve.runtime.specs import default_spec
from semif_serve.server import build_runtime

FOLDER = "/srv/models/private-finetune"  # a local model's folder: never shown without a token
BOOT_TIMEOUT_S = 120  # the poisoned server loads torch and the tiny model, then gives up


def cpu_settings(**overrides):
    return settings(model=FOLDER, revision="poisoned", **overrides)


def app_over(factory, config):
    runtime = build_runtime(config, factory)
    runtime.start(idle_interval_s=None)
    return testing.TestClient(create_app(DecisionService(runtime, config), config))


# --- the warm-up -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "bad"),
    [
        ({"probabilities": [0.5, 0.5], "option_logits": [1.0, 1.0]}, []),
        (
            {"probabilities": [float("nan"), 0.5], "option_logits": [1.0, float("-inf")]},
            ["probabilities[0]=nan", "option_logits[1]=-inf"],
        ),
        (
            {"probabilities": [1.0, 0.0], "option_logits": [float("inf"), 0.0]},
            ["option_logits[0]=inf"],
        ),
        ({"probabilities": [1.0], "forward_seconds": float("nan")}, []),  # only the scores count
    ],
)
def test_the_non_finite_scores_of_a_result_are_named(result, bad):
    assert non_finite_scores(result) == bad


def test_a_non_finite_warm_up_names_the_model_and_its_source_in_one_line():
    spec = default_spec(cpu_settings())
    check_finite_warm_up({"probabilities": [0.5, 0.5], "option_logits": [0.0, 0.0]}, spec)
    with pytest.raises(StartupError) as caught:
        check_finite_warm_up(
            {"probabilities": [float("nan")] * 2, "option_logits": [0.0] * 2}, spec
        )
    assert str(caught.value) == (
        f"model 'default' ({FOLDER}): the warm-up decision's scores are not finite "
        "(probabilities[0]=nan, probabilities[1]=nan); its weights may be corrupt"
    )


def test_a_real_model_with_4_kb_of_0xff_in_its_weights_fails_the_warm_up():
    config = cpu_settings()
    with pytest.raises(StartupError) as caught:
        build_engine(config, load=lambda source, *args, **kwargs: poisoned(source))
    message = str(caught.value)
    assert message.startswith(f"model 'default' ({FOLDER}): the warm-up decision's scores are not")
    assert "probabilities[0]=nan" in message and "\n" not in message


def test_a_put_of_such_a_model_is_refused_and_the_server_keeps_serving():
    config = cpu_settings(admin_token="b" * 40)

    def factory(spec):
        if spec.source == "poisoned":
            return build_engine(config, spec, load=lambda source, *a, **k: poisoned(source))
        return Engine(FakeScorer())

    api = app_over(factory, config)
    admin = {"Authorization": f"Bearer {'b' * 40}"}
    reply = api.simulate_put("/v1/models/bad", json={"source": "poisoned"}, headers=admin)
    assert reply.status_code == 503, reply.text
    assert "the warm-up decision's scores are not finite" in reply.json["error"]["message"]
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200


def test_a_server_whose_model_fails_the_warm_up_does_not_start():
    """Through gunicorn: the worker fails to boot, the server exits non-zero, and the log says
    why in one line naming the model: once, with no traceback (issue 32)."""
    env = {
        **os.environ,
        "SEMIF_API_TOKEN": TOKEN,
        "SEMIF_BIND": "127.0.0.1:0",
        "SEMIF_DEVICE": "cpu",
        "SEMIF_MODEL": FOLDER,
    }
    done = subprocess.run(
        serve_steered.command("poisoned"),
        env=env,
        capture_output=True,
        text=True,
        timeout=BOOT_TIMEOUT_S,
    )
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "the warm-up decision's scores" in line]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert lines[0].endswith(  # the runtime's load names the model too
        f"loading model default failed: model 'default' ({FOLDER}): the warm-up decision's scores are not finite "
        "(probabilities[0]=nan, probabilities[1]=nan, option_logits[0]=nan, option_logits[1]=nan); "
        "its weights may be corrupt"
    )
    assert "Worker failed to boot" in done.stderr


# --- a model that makes NaN for some inputs ----------------------------------------------------


def test_a_reply_whose_scores_are_not_finite_is_a_clear_500_and_the_others_are_served():
    """The warm-up passes (its prompt is ASCII); a state with "ξ" meets the poisoned rows."""
    config = cpu_settings()
    tokens = poisoned(FOLDER).tokenizer.encode("ξ", add_special_tokens=False)
    api = app_over(
        lambda spec: build_engine(
            config, spec, load=lambda source, *a, **k: poisoned(source, token_ids=tokens)
        ),
        config,
    )
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200
    reply = api.simulate_post("/decide", json=row(state={"greek": "ξ"}), headers=AUTH)
    assert reply.status_code == 500
    assert reply.json["error"] == {
        "code": "scoring_failed",
        "message": "the model produced non-finite scores (NaN or infinity at probabilities[0], "
        "probabilities[1], option_logits[0], option_logits[1]); its weights may be corrupt",
    }
    shared = {"state": "ξ", "decisions": [{k: v for k, v in row().items() if k != "state"}]}
    reply = api.simulate_post("/decide/shared", json=shared, headers=AUTH)
    assert reply.status_code == 500
    assert "non-finite scores (NaN or infinity at results[0].probabilities[0]" in reply.text
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200


# --- /health -----------------------------------------------------------------------------------


class FolderScorer(FakeScorer):
    """A fake scorer reporting the local folder it was loaded from, as a real one does."""

    def model_info(self):
        return {**super().model_info(), "source": FOLDER}


def test_health_without_a_token_shows_readiness_and_the_model_id_never_a_path(tmp_path):
    config = cpu_settings(calibration={"triage": 1.5}, cache_dir=tmp_path / "cache")
    api = app_over(lambda spec: Engine(FolderScorer()), config)
    for method in (api.simulate_get, api.simulate_head):
        assert method("/health").status_code == 200
    response = api.simulate_get("/health")
    assert response.json == {
        "status": "ok",
        "semif_commit": SEMIF_COMMIT,
        "model": {"id": "default", "revision": "0" * 40, "dtype": "float32", "device": "cpu"},
        "vram_cap_gib": None,
        "max_tokens": 4096,
        "max_decisions": 64,
        "workloads": {"triage": 1.5},
    }
    assert FOLDER not in response.text and str(tmp_path) not in response.text
    assert "/" not in response.text  # no path of any kind
    # With a token, GET /v1/models still says where each model comes from.
    listed = api.simulate_get("/v1/models", headers=AUTH).json["models"]
    assert [model["source"] for model in listed] == [FOLDER]

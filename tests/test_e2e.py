"""End to end: `semif-serve serve` under gunicorn with the real built-in SmolLM2 on the CPU."""

import shutil
from pathlib import Path

import pytest
from fakes import AUTH, row
from live_server import LiveServer
from rows_factory import STATE

pytestmark = [pytest.mark.slow, pytest.mark.server]


def semif_serve_command():
    return [
        shutil.which("semif-serve") or str(Path(__import__("sys").prefix) / "bin" / "semif-serve"),
        "serve",
    ]


def real_env(builtin_cache, **extra):
    return {
        "SEMIF_MODEL": "builtin:smollm2-135m",
        "SEMIF_DEVICE": "cpu",
        "SEMIF_CACHE_DIR": str(builtin_cache),
        **extra,
    }


def test_decide_and_shared_with_rotations_on_the_real_model(tmp_path, builtin_cache, smollm2):
    plain = {**row("plain", ("Yes, it concerns the printer", "No")), "state": STATE}
    with LiveServer(
        semif_serve_command(), real_env(builtin_cache), tmp_path / "server.log"
    ) as server:
        status, health, _ = server.request("GET", "/health")
        assert status == 200 and health["model"]["source"] == "builtin:smollm2-135m"

        status, direct, _ = server.request("POST", "/decide", plain, AUTH)
        assert status == 200, direct
        assert (
            direct["option_ids"] == ["o0", "o1"] and direct["prompt_version"] == "direct-options-v1"
        )
        assert sum(direct["probabilities"]) == pytest.approx(1, abs=1e-6)

        decisions = [
            {key: plain[key] for key in ("id", "question", "options")},
            {
                **{key: plain[key] for key in ("question", "options")},
                "id": "avg",
                "orderings": "rotations",
            },
        ]
        decisions[1]["options"] = decisions[1]["options"] + [{"id": "o2", "description": "Unclear"}]
        status, shared, _ = server.request(
            "POST", "/decide/shared", {"state": STATE, "decisions": decisions}, AUTH
        )
        assert status == 200, shared
        first, averaged = shared["results"]
        assert first["prompt_sha256"] == direct["prompt_sha256"]
        assert first["probabilities"] == pytest.approx(direct["probabilities"], abs=1e-4)
        assert [r["id"] for r in averaged["orderings"]] == ["avg#o0", "avg#o1", "avg#o2"]
        assert sum(averaged["combined"]["probabilities"]) == pytest.approx(1, abs=1e-9)
        assert averaged["combined"]["top"] in {"o0", "o1", "o2"}
        assert shared["timing"]["batch_size"] == 4

        status, error, _ = server.request(
            "POST", "/decide", {**plain, "question": "x " * 5000}, AUTH
        )
        assert status == 422 and error["error"]["message"].startswith("max_tokens:")


def test_startup_fails_closed_when_the_model_cannot_load(tmp_path, builtin_cache):
    env = real_env(builtin_cache, SEMIF_MODEL=str(tmp_path / "no-such-model"))
    server = LiveServer(semif_serve_command(), env, tmp_path / "server.log")
    with pytest.raises(AssertionError, match="server exited early"):
        with server:
            pass
    assert server.process.returncode != 0
    assert "does not exist" in server.log_text()

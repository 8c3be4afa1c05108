"""End to end: `semif-serve serve` under gunicorn with the real built-in SmolLM2 on the CPU."""

import json
import subprocess

import pytest
import serve_steered
from fakes import AUTH, row
from live_server import LiveServer, real_env, semif_serve_command
from openapi_check import validate_reply
from rows_factory import STATE

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_decide_and_shared_with_rotations_on_the_real_model(tmp_path, builtin_cache, smollm2):
    plain = {**row("plain", ("Yes, it concerns the printer", "No")), "state": STATE}
    with LiveServer(
        semif_serve_command(), real_env(builtin_cache), tmp_path / "server.log"
    ) as server:
        status, health, _ = server.request("GET", "/health")
        assert status == 200 and health["model"]["id"] == "default"
        validate_reply("/health", "GET", 200, health)

        status, direct, _ = server.request("POST", "/decide", plain, AUTH)
        assert status == 200, direct
        validate_reply("/decide", "POST", 200, direct)
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
        validate_reply("/decide/shared", "POST", 200, shared)
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

        # A state long enough for the state-prefix cache: the second question over it resumes.
        long_state = {**STATE, "history": STATE["history"] * 30}
        asked = [{**plain, "id": f"step{n}", "state": long_state} for n in range(2)]
        asked[1]["question"] = "Is the reporter named?"
        status, cold, _ = server.request("POST", "/decide", asked[0], AUTH)
        assert status == 200 and cold["cache_hit"] is False, cold
        status, warm, _ = server.request("POST", "/decide", asked[1], AUTH)
        assert status == 200 and warm["cache_hit"] is True, warm
        validate_reply("/decide", "POST", 200, warm)
        assert warm["prefix_sha256"] == cold["prefix_sha256"] != direct["prefix_sha256"]
        expected = smollm2_score(smollm2, asked[1])
        assert warm["probabilities"] == pytest.approx(expected, abs=1e-5)
        status, models, _ = server.request("GET", "/v1/models", None, AUTH)
        cache = models["models"][0]["prefix_cache"]
        assert (cache["hits"], cache["misses"], cache["entries"]) == (1, 1, 1) and cache[
            "bytes"
        ] > 0


def test_a_server_left_to_the_cpu_default_dtype_answers_the_same_bits_on_every_path(
    tmp_path, builtin_cache
):
    """Issue 44: `make serve`'s settings (no SEMIF_DTYPE): bfloat16 on a CPU with native
    bfloat16, float32 elsewhere, named in /health and every reply; a decision gets the same
    probabilities alone, inside a shared call among others, and as a state-prefix cache hit."""
    from semif_serve import config

    expected = config.default_dtype_for("cpu", config.read_cpu_flags())
    env = real_env(builtin_cache)
    del env["SEMIF_DTYPE"]
    long_state = {**STATE, "history": STATE["history"] * 30}
    asked = [{**row(f"q{n}", ("Yes, it concerns the printer", "No")), "state": long_state}
             for n in range(3)]  # fmt: skip
    asked[1]["question"], asked[2]["question"] = "Is the reporter named?", "Is it urgent?"
    server = LiveServer(semif_serve_command(), env, tmp_path / "server.log")
    server.env.pop("SEMIF_DTYPE", None)  # the default, whatever the test runner's env says
    with server:
        status, health, _ = server.request("GET", "/health")
        assert status == 200 and health["model"]["dtype"] == expected
        alone = []
        for body in asked:  # the first stores the state's prefill, the others resume it
            status, decided, _ = server.request("POST", "/decide", body, AUTH)
            assert status == 200 and decided["model"]["dtype"] == expected, decided
            alone.append(decided)
        assert [d["cache_hit"] for d in alone] == [False, True, True]
        decisions = [{key: body[key] for key in ("id", "question", "options")} for body in asked]
        status, shared, _ = server.request(
            "POST", "/decide/shared", {"state": long_state, "decisions": decisions[::-1]}, AUTH
        )
        assert status == 200, shared
    by_id = {result["id"]: result for result in shared["results"]}
    for decided in alone:
        assert by_id[decided["id"]]["probabilities"] == decided["probabilities"]
        assert by_id[decided["id"]]["option_logits"] == decided["option_logits"]


def smollm2_score(smollm2, body):
    """The in-process direct scorer's probabilities for a /decide body (no cache)."""
    from semif_serve.scoring import score

    decision = {key: body[key] for key in ("id", "state", "question", "options")}
    return score(smollm2, decision, max_tokens=4096)["probabilities"]


def test_startup_fails_closed_when_the_model_cannot_load(tmp_path, builtin_cache):
    env = real_env(builtin_cache, SEMIF_MODEL=str(tmp_path / "no-such-model"))
    server = LiveServer(semif_serve_command(), env, tmp_path / "server.log")
    with pytest.raises(AssertionError, match="server exited early"):
        with server:
            pass
    assert server.process.returncode != 0
    assert "does not exist" in server.log_text()


def test_serve_without_a_token_prints_a_curl_command_that_returns_a_decision(
    tmp_path, builtin_cache, smollm2
):
    token_file = tmp_path / "token"
    command = [*semif_serve_command(), "--token-file", str(token_file)]
    env = real_env(builtin_cache, SEMIF_API_TOKEN="")
    server = LiveServer(command, env, tmp_path / "server.log")
    server.env.pop("SEMIF_API_TOKEN")
    with server:
        assert token_file.stat().st_mode & 0o777 == 0o600
        printed = server.log_text().split("Try:\n", 1)[1].split("\n\n", 1)[0]
        assert "curl" in printed and str(token_file) in printed
        done = subprocess.run(["bash", "-c", printed], capture_output=True, text=True, timeout=60)
        reply = json.loads(done.stdout)
        assert (
            reply["option_ids"] == ["yes", "no"] and reply["prompt_version"] == "direct-options-v1"
        )


def test_two_real_models_behind_one_server(tmp_path, builtin_cache, smollm2):
    from test_loading import save_tiny

    tiny_folder = tmp_path / "tiny"
    save_tiny(tiny_folder)
    models = tmp_path / "models.toml"
    models.write_text(
        f'[smol]\nsource = "builtin:smollm2-135m"\ndefault = true\n\n'
        f'[tiny]\nsource = "{tiny_folder}"\nkeep_alive_s = 600\n'
    )
    admin = {"Authorization": "Bearer " + "a" * 40}
    env = real_env(builtin_cache, SEMIF_MODELS_FILE=str(models), SEMIF_ADMIN_TOKEN="a" * 40)
    with LiveServer(semif_serve_command(), env, tmp_path / "server.log") as server:
        status, listing, _ = server.request("GET", "/v1/models", headers=AUTH)
        assert [(m["id"], m["state"]) for m in listing["models"]] == [
            ("smol", "ready"),
            ("tiny", "unloaded"),
        ]
        status, smol, _ = server.request("POST", "/decide", row(), AUTH)
        assert status == 200 and smol["model"]["source"] == "builtin:smollm2-135m"
        status, tiny, _ = server.request("POST", "/decide", row(model="tiny"), AUTH)
        assert status == 200 and tiny["model"]["source"] == str(tiny_folder)
        status, unloaded, _ = server.request("POST", "/v1/models/tiny/unload", headers=admin)
        assert status == 200 and unloaded == {"id": "tiny", "loaded": False}
        assert server.request("POST", "/v1/models/tiny/unload", headers=AUTH)[0] == 403
    assert server.process.returncode == 0
    assert "runtime closed: 2 models unloaded" in server.log_text()  # gunicorn's worker_exit


def test_the_default_device_with_a_vram_cap_starts(tmp_path, builtin_cache, smollm2):
    """SEMIF_DEVICE unset (cuda) plus SEMIF_VRAM_CAP_GIB: the H200 defect stopped this boot,
    since torch refuses the memory fraction for an index-less "cuda". Through the production
    CLI and boot path, torch.cuda faked (tests/serve_steered.py cuda), the model on the CPU."""
    control = tmp_path / "control"
    control.mkdir()
    env = {
        "SEMIF_MODEL": "builtin:smollm2-135m",
        "SEMIF_CACHE_DIR": str(builtin_cache),
        "SEMIF_VRAM_CAP_GIB": "20",
        "SEMIF_TEST_CONTROL": str(control),
    }
    env.pop("SEMIF_DEVICE", None)
    server = LiveServer(serve_steered.command("cuda"), env, tmp_path / "server.log")
    server.env.pop("SEMIF_DEVICE", None)  # the default, whatever the test runner's env says
    with server:
        status, health, _ = server.request("GET", "/health")
        assert status == 200 and health["model"]["device"] == "cuda:0"
        status, body, _ = server.request("POST", "/decide", row("d"), AUTH)
        assert status == 200, body
    calls = [json.loads(line) for line in (control / "cuda-calls.jsonl").read_text().splitlines()]
    assert calls == [{"call": "fraction", "device": "cuda:0"}]

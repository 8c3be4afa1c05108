"""Issue 32: `semif-serve serve` checks every setting, the startup models' names and devices, and
SEMIF_BIND before it prints or binds anything: a bad one is one line naming the variable, exit
status 2, no traceback, and no curl example.

Before issue 32 a bad built-in name or SEMIF_DEVICE=cuda without a GPU printed the curl and
"Listening at", then a 40-line traceback three times (exit 3); SEMIF_BIND=8765 printed
`curl -s http://8765/decide` before its error; a busy port printed a curl that worked against
the first server, then five gunicorn "Connection in use" lines and "Can't connect".
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from fake_torch import FakeTorch
from fakes import settings
from live_server import free_port

from semif_serve.cli import main
from semif_serve.config import ConfigError
from semif_serve.engine.boot import check_startup_models, invisible_device
from semif_serve.engine.loading import ModelLoadError

CPU = FakeTorch(available=False)


def serve(monkeypatch, capsys, tmp_path, **env: str) -> tuple[int, str, str]:
    """`semif-serve serve --token-file` in this process, as `make serve` runs it."""
    monkeypatch.delenv("SEMIF_API_TOKEN", raising=False)
    defaults = {
        "SEMIF_MODEL": "builtin:smollm2-135m",
        "SEMIF_DEVICE": "cpu",
        "SEMIF_CACHE_DIR": str(tmp_path / "cache"),  # not converted: nothing converts
        "SEMIF_BIND": f"127.0.0.1:{free_port()}",
    }
    for name, value in {**defaults, **env}.items():
        monkeypatch.setenv(name, value)
    status = main(["serve", "--token-file", str(tmp_path / "token")])
    out, err = capsys.readouterr()
    return status, out, err


def one_error_line(status: int, out: str, err: str) -> str:
    assert status == 2
    assert out == ""  # no curl example
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("semif-serve: error: ")
    return lines[0].removeprefix("semif-serve: error: ")


def test_an_unknown_builtin_model_is_one_line_naming_semif_model(monkeypatch, capsys, tmp_path):
    said = one_error_line(*serve(monkeypatch, capsys, tmp_path, SEMIF_MODEL="builtin:smollm2-136m"))
    assert said == (
        "SEMIF_MODEL: unknown built-in model 'builtin:smollm2-136m'; the only one is "
        "'builtin:smollm2-135m'"
    )


@pytest.mark.skipif(
    __import__("torch").cuda.device_count() > 0, reason="this host has a CUDA device"
)
def test_cuda_without_a_gpu_is_one_line_naming_semif_device(monkeypatch, capsys, tmp_path):
    said = one_error_line(*serve(monkeypatch, capsys, tmp_path, SEMIF_DEVICE="cuda"))
    assert said.startswith("SEMIF_DEVICE: cuda asked for, but torch sees no CUDA device")


def test_a_bind_without_a_host_is_one_line_before_any_curl(monkeypatch, capsys, tmp_path):
    said = one_error_line(*serve(monkeypatch, capsys, tmp_path, SEMIF_BIND="8765"))
    assert said == "SEMIF_BIND: must be HOST:PORT, got '8765'"


def test_a_busy_port_is_one_line_naming_semif_bind_at_once(monkeypatch, capsys, tmp_path):
    with socket.socket() as first:  # the first server
        first.bind(("127.0.0.1", 0))
        first.listen()
        port = first.getsockname()[1]
        began = time.monotonic()
        said = one_error_line(*serve(monkeypatch, capsys, tmp_path, SEMIF_BIND=f"127.0.0.1:{port}"))
    assert time.monotonic() - began < 5  # gunicorn's own bind retried for 5 s
    assert said == (
        f"SEMIF_BIND: 127.0.0.1:{port} is already in use (is another semif-serve running "
        "there?); stop it, or set SEMIF_BIND to a free HOST:PORT"
    )


def test_the_console_script_says_one_line_and_exits_2(tmp_path):
    """The whole process, as a newcomer runs it: besides the kernel-cache note, one line."""
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SEMIF_MODEL": "builtin:smollm2-136m",
        "SEMIF_DEVICE": "cpu",
        "SEMIF_BIND": f"127.0.0.1:{free_port()}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "semif_serve", "serve", "--token-file", str(tmp_path / "t")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if "kernel caches in" not in line]
    assert lines == [
        "semif-serve: error: SEMIF_MODEL: unknown built-in model 'builtin:smollm2-136m'; "
        "the only one is 'builtin:smollm2-135m'"
    ]


# --- check_startup_models, with a fake torch and a fake source check ---------------------------


def inspector(problem: str | None = None):
    seen = []

    def inspect(source, revision, dtype, cache_dir):
        seen.append((source, revision, dtype))
        if problem:
            raise ModelLoadError(problem)
        return None

    inspect.seen = seen
    return inspect


def test_the_default_model_is_checked_and_each_problem_names_its_variable():
    config = settings(model="/srv/m", revision="r1", device="cpu")
    inspect = inspector()
    check_startup_models(config, CPU, inspect)
    assert inspect.seen == [("/srv/m", "r1", config.dtype)]
    with pytest.raises(ConfigError, match=r"^SEMIF_MODEL: model folder '/srv/m' does not exist$"):
        check_startup_models(config, CPU, inspector("model folder '/srv/m' does not exist"))
    with pytest.raises(ConfigError, match=r"^SEMIF_REVISION: model id 'a/b' needs"):
        check_startup_models(config, CPU, inspector("revision: model id 'a/b' needs a commit"))
    gpu = settings(model="/srv/m", device="cuda:1")
    with pytest.raises(ConfigError, match=r"^SEMIF_DEVICE: cuda:1 asked for, but torch sees 1"):
        check_startup_models(gpu, FakeTorch(count=1), inspector())


def test_a_models_file_names_the_table_and_skips_models_not_loaded_at_startup(tmp_path):
    models = tmp_path / "models.toml"
    models.write_text(
        '[main]\nsource = "/srv/main"\ndevice = "cpu"\ndefault = true\n'
        '[later]\nsource = "/srv/later"\ndevice = "cuda:3"\nload_on_startup = false\n'
    )
    config = settings(models_file=str(models), device="cpu")
    inspect = inspector()
    check_startup_models(config, CPU, inspect)
    assert [source for source, _, _ in inspect.seen] == ["/srv/main"]
    with pytest.raises(ConfigError, match=r"^SEMIF_MODELS_FILE: \[main\] source: gone$"):
        check_startup_models(config, CPU, inspector("gone"))


@pytest.mark.parametrize(
    ("device", "count", "problem"),
    [
        ("cpu", 0, None),
        ("cuda", 1, None),
        ("cuda:0", 1, None),
        ("cuda", 0, "cuda asked for, but torch sees no CUDA device"),
        ("cuda:2", 2, "cuda:2 asked for, but torch sees 2 CUDA device(s) (cuda:0..cuda:1)"),
    ],
)
def test_a_device_is_checked_by_its_count_alone(device, count, problem):
    """The master makes no CUDA context (its forked worker could not use it): only the count."""
    said = invisible_device(device, FakeTorch(count=count, available=count > 0))
    if problem is None:
        assert said is None
    else:
        assert said.startswith(problem)

"""Kernel caches (semif_serve/engine/kernel_cache.py): every cache under one folder, the operator's
values kept, folders private, and `semif-serve serve` setting them before torch is imported."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from semif_serve.config import ConfigError
from semif_serve.engine.kernel_cache import configure, kernel_cache_root

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "t" * 40
CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_every_cache_goes_under_semif_kernel_cache_dir(tmp_path):
    root = tmp_path / "kernels"
    env = {"SEMIF_KERNEL_CACHE_DIR": str(root), "SEMIF_CACHE_DIR": str(tmp_path / "other")}
    caches = configure(env)
    assert env == {
        "SEMIF_KERNEL_CACHE_DIR": str(root),
        "SEMIF_CACHE_DIR": str(tmp_path / "other"),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "CUDA_CACHE_PATH": str(root / "cuda"),
        "TRITON_CACHE_AUTOTUNING": "1",
    }
    assert caches.root == root and caches.kept == {}
    assert caches.chosen == {
        name: env[name] for name in (*CACHE_VARIABLES, "TRITON_CACHE_AUTOTUNING")
    }
    assert not (tmp_path / "other").exists()


def test_without_it_the_caches_go_under_semif_cache_dir_then_home(tmp_path, monkeypatch):
    assert kernel_cache_root({"SEMIF_CACHE_DIR": str(tmp_path)}) == tmp_path / "kernels"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache_root({}) == tmp_path / "home/.cache/semif-serve/kernels"
    assert kernel_cache_root({"SEMIF_KERNEL_CACHE_DIR": "", "SEMIF_CACHE_DIR": ""}) == (
        tmp_path / "home/.cache/semif-serve/kernels"
    )
    env: dict[str, str] = {}
    configure(env)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "home/.cache/semif-serve/kernels/triton")


def test_a_relative_folder_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {"SEMIF_KERNEL_CACHE_DIR": "rel"}
    configure(env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "rel" / "inductor")


def test_an_operators_explicit_value_wins(tmp_path):
    env = {
        "SEMIF_KERNEL_CACHE_DIR": str(tmp_path / "kernels"),
        "TRITON_CACHE_DIR": "/srv/triton",
        "TRITON_CACHE_AUTOTUNING": "0",
        "CUDA_CACHE_PATH": "",  # empty is unset: triton and CUDA would fail on an empty path
    }
    caches = configure(env)
    assert env["TRITON_CACHE_DIR"] == "/srv/triton"
    assert env["TRITON_CACHE_AUTOTUNING"] == "0"
    assert env["CUDA_CACHE_PATH"] == str(tmp_path / "kernels" / "cuda")
    assert caches.kept == {"TRITON_CACHE_DIR": "/srv/triton", "TRITON_CACHE_AUTOTUNING": "0"}
    assert not (tmp_path / "kernels" / "triton").exists()  # not ours to create
    assert "kept the operator's TRITON_CACHE_DIR=/srv/triton" in caches.summary()


def test_with_every_variable_set_nothing_is_created(tmp_path):
    env = {name: f"/srv/{name}" for name in (*CACHE_VARIABLES, "TRITON_CACHE_AUTOTUNING")}
    env["SEMIF_KERNEL_CACHE_DIR"] = str(tmp_path / "kernels")
    assert configure(env).chosen == {}
    assert not (tmp_path / "kernels").exists()


def test_folders_are_created_private(tmp_path):
    old = os.umask(0o022)
    try:
        configure({"SEMIF_KERNEL_CACHE_DIR": str(tmp_path / "a" / "kernels")})
    finally:
        os.umask(old)
    root = tmp_path / "a" / "kernels"
    for folder in (tmp_path / "a", root, root / "triton", root / "inductor", root / "cuda"):
        assert mode(folder) == 0o700, folder


def test_an_existing_private_folder_is_reused(tmp_path):
    root = tmp_path / "kernels"
    configure({"SEMIF_KERNEL_CACHE_DIR": str(root)})
    (root / "triton" / "kept").write_text("a compiled kernel")
    configure({"SEMIF_KERNEL_CACHE_DIR": str(root)})
    assert (root / "triton" / "kept").read_text() == "a compiled kernel"


def test_a_folder_others_can_write_is_refused(tmp_path):
    root = tmp_path / "kernels"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(ConfigError, match=r"^SEMIF_KERNEL_CACHE_DIR: .* writable by others"):
        configure({"SEMIF_KERNEL_CACHE_DIR": str(root)})


def test_a_file_in_the_way_is_refused(tmp_path):
    (tmp_path / "kernels").write_text("")
    with pytest.raises(ConfigError, match=r"^SEMIF_KERNEL_CACHE_DIR: .*kernels is not a folder"):
        configure({"SEMIF_KERNEL_CACHE_DIR": str(tmp_path / "kernels")})


@pytest.mark.skipif(os.getuid() == 0, reason="root may create folders anywhere")
def test_an_uncreatable_folder_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=r"^SEMIF_KERNEL_CACHE_DIR: cannot create .*denied"):
        configure({"SEMIF_KERNEL_CACHE_DIR": str(locked / "kernels")})


def test_serve_refuses_an_unusable_folder_with_exit_2(tmp_path, monkeypatch, capsys):
    from semif_serve.cli import entry_point

    (tmp_path / "kernels").write_text("")
    monkeypatch.setattr(sys, "argv", ["semif-serve", "serve"])
    monkeypatch.setenv("SEMIF_API_TOKEN", TOKEN)
    monkeypatch.setenv("SEMIF_KERNEL_CACHE_DIR", str(tmp_path / "kernels"))
    with pytest.raises(SystemExit) as done:
        entry_point()
    assert done.value.code == 2
    assert "semif-serve: error: SEMIF_KERNEL_CACHE_DIR:" in capsys.readouterr().err


def test_other_commands_and_in_process_calls_leave_the_environment_alone(monkeypatch):
    from semif_serve.cli import main

    for name in (*CACHE_VARIABLES, "TRITON_CACHE_AUTOTUNING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SEMIF_API_TOKEN", "short")  # main stops at the settings, exit 2
    assert main(["serve"]) == 2
    assert not {"TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"} & set(os.environ)


# A `torch` that records the environment it was imported under, then ends the process: the
# first import of torch in `semif-serve serve` must already see the kernel cache variables.
POISONED_TORCH = """
import json, os
with open(os.environ["RECORD"], "w") as record:
    json.dump({name: os.environ.get(name) for name in json.loads(os.environ["NAMES"])}, record)
os._exit(0)
"""


def test_serve_sets_the_caches_before_anything_imports_torch(tmp_path):
    poisoned = tmp_path / "poisoned"
    (poisoned / "torch").mkdir(parents=True)
    (poisoned / "torch" / "__init__.py").write_text(POISONED_TORCH)
    names = [*CACHE_VARIABLES, "TRITON_CACHE_AUTOTUNING"]
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in names and name != "SEMIF_KERNEL_CACHE_DIR"
    }
    env.update(
        PYTHONPATH=os.pathsep.join([str(poisoned), str(ROOT)]),
        SEMIF_API_TOKEN=TOKEN,
        SEMIF_DEVICE="cpu",
        SEMIF_CACHE_DIR=str(tmp_path / "cache"),
        RECORD=str(tmp_path / "record.json"),
        NAMES=json.dumps(names),
    )
    done = subprocess.run(
        [sys.executable, "-m", "semif_serve", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    kernels = tmp_path / "cache" / "kernels"
    assert json.loads((tmp_path / "record.json").read_text()) == {
        "TRITON_CACHE_DIR": str(kernels / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(kernels / "inductor"),
        "CUDA_CACHE_PATH": str(kernels / "cuda"),
        "TRITON_CACHE_AUTOTUNING": "1",
    }
    assert f"semif-serve: kernel caches in {kernels}" in done.stderr

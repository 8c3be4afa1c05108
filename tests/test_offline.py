"""Importing semif_serve forces the Hugging Face libraries offline (INV-5, bug hunt S10)."""

import subprocess
import sys

import pytest

PROBE = "import os, huggingface_hub.constants as c; print(os.environ['HF_HUB_OFFLINE'], os.environ['TRANSFORMERS_OFFLINE'], c.HF_HUB_OFFLINE)"


def run_python(code, **env):
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize(
    "code",
    [
        "import semif_serve; " + PROBE,
        # A caller that imported the hub first: the already-read constant is corrected too.
        "import huggingface_hub.constants; import semif_serve.cli; " + PROBE,
        # gunicorn's entry: the server module, and the boot path that imports torch.
        "import semif_serve.server, semif_serve.engine.boot; " + PROBE,
    ],
)
def test_offline_is_forced_even_when_the_environment_says_otherwise(code):
    assert run_python(code, HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0") == ["1", "1", "True"]


def test_without_semif_serve_the_probe_sees_the_environment():
    # Guards the test above against a probe that always prints "1".
    assert run_python(
        PROBE.replace("os.environ['TRANSFORMERS_OFFLINE'], ", ""), HF_HUB_OFFLINE="0"
    ) == ["0", "False"]


def test_force_offline_sets_both_variables_and_corrects_an_imported_hub(monkeypatch):
    # In-process, so the mutation grid reaches it (the subprocesses above import the installed copy).
    import os
    from types import SimpleNamespace

    from semif_serve.offline import force_offline

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    hub = SimpleNamespace(HF_HUB_OFFLINE=False)
    monkeypatch.setitem(sys.modules, "huggingface_hub.constants", hub)
    force_offline()
    assert (os.environ["HF_HUB_OFFLINE"], os.environ["TRANSFORMERS_OFFLINE"]) == ("1", "1")
    assert hub.HF_HUB_OFFLINE is True


def test_force_offline_without_the_hub_imported_only_sets_the_variables(monkeypatch):
    import os

    from semif_serve.offline import force_offline

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delitem(sys.modules, "huggingface_hub.constants", raising=False)
    force_offline()
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert "huggingface_hub.constants" not in sys.modules

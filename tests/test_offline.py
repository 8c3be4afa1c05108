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
        "import semif_serve.server, semif_serve.boot; " + PROBE,
    ],
)
def test_offline_is_forced_even_when_the_environment_says_otherwise(code):
    assert run_python(code, HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0") == ["1", "1", "True"]


def test_without_semif_serve_the_probe_sees_the_environment():
    # Guards the test above against a probe that always prints "1".
    assert run_python(
        PROBE.replace("os.environ['TRANSFORMERS_OFFLINE'], ", ""), HF_HUB_OFFLINE="0"
    ) == ["0", "False"]

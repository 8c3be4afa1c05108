"""What does not score never imports torch (about 2.5 s of CPU a process): the HTTP layer, the
runtime, the ecosystem's translators, the CLI's parser, the server module and a whole server
over a fake scorer. Each check runs in a fresh interpreter where importing torch or
transformers raises."""

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
BLOCKED = """
import sys
for name in ("torch", "transformers"):
    sys.modules[name] = None  # importing it now raises ImportError
sys.path.insert(0, {tests!r})
"""


def run_without_torch(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED.format(tests=str(TESTS)) + code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize(
    "module",
    [
        "semif_serve.http",
        "semif_serve.runtime.registry",
        "semif_serve.runtime.service",
        "semif_serve.apis.systemone",
        "semif_serve.apis.decisions",
        "semif_serve.cli",
        "semif_serve.server",
        "semif_serve.scoring",
    ],
)
def test_a_module_that_does_not_score_imports_without_torch(module):
    run_without_torch(f"import {module}")


def test_a_server_over_a_fake_scorer_answers_a_decision_without_torch():
    stdout = run_without_torch(
        """
import json
from falcon import testing
from fakes import AUTH, FakeScorer, fake_app, row
app, _ = fake_app(FakeScorer(base={"Yes": 2.0}))
reply = testing.TestClient(app).simulate_post("/decide", json=row(), headers=AUTH)
print(reply.status_code, "probabilities" in json.dumps(reply.json))
"""
    )
    assert stdout.split() == ["200", "True"]


def test_the_torch_bound_names_of_scoring_load_on_first_use():
    stdout = run_without_torch(
        """
import semif_serve.scoring as scoring
try:
    scoring.score
except ImportError:
    print("torch needed")
print(scoring.PROMPT_VERSION)
"""
    )
    from semif_serve.scoring import PROMPT_VERSION

    assert stdout.split() == ["torch", "needed", PROMPT_VERSION]

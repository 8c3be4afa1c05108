"""A real gunicorn semif-serve: the production app (management state, its replay, the master that
notes how each worker ended) over fake engines (tests/test_management_state.py).

Every model's engine drives a FakeScorer; a model whose source has a file `fail-<source>` in the
SEMIF_TEST_CONTROL folder fails to load, so a test can make one model's replay fail.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fakes import FakeScorer  # noqa: E402

from semif_serve.config import Settings  # noqa: E402
from semif_serve.engine.engine import Engine  # noqa: E402
from semif_serve.server import run  # noqa: E402

CONTROL = Path(os.environ["SEMIF_TEST_CONTROL"])


def engine(spec):
    if (CONTROL / f"fail-{spec.source}").exists():
        raise RuntimeError(f"{spec.source} cannot load (fail-{spec.source} in the control folder)")
    return Engine(FakeScorer())


if __name__ == "__main__":
    run(Settings.from_env(), engine_factory=engine)

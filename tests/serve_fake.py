"""A real gunicorn semif-serve over a fake scorer, steered through files (tests/test_server.py).

SEMIF_TEST_CONTROL names a folder. With SEMIF_TEST_GATED=1 every scorer call writes
`entered-<n>` there and waits (bounded) for a `release` file. Every admitted POST writes
`admitted-<n>`. With SEMIF_TEST_START=gated the app is built only once a `start` file appears
(the worker answers meanwhile); with SEMIF_TEST_START=fails its build raises a StartupError.
Everything else is the production app and gunicorn configuration.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fakes import WAIT_S, FakeScorer, fake_runtime  # noqa: E402

from semif_serve.config import Settings  # noqa: E402
from semif_serve.http import create_app  # noqa: E402
from semif_serve.runtime.admission import InFlightLimit  # noqa: E402
from semif_serve.runtime.service import DecisionService  # noqa: E402
from semif_serve.server import run  # noqa: E402

CONTROL = Path(os.environ["SEMIF_TEST_CONTROL"])


def wait_for(path: Path, timeout: float = 3 * WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)


class GatedScorer(FakeScorer):
    calls_entered = 0

    def _enter(self):
        GatedScorer.calls_entered += 1
        (CONTROL / f"entered-{GatedScorer.calls_entered}").touch()
        wait_for(CONTROL / "release")


class ReportingLimit(InFlightLimit):
    admitted = 0

    def acquire(self):
        super().acquire()
        ReportingLimit.admitted += 1
        (CONTROL / f"admitted-{ReportingLimit.admitted}").touch()


def app():
    settings = Settings.from_env()
    start = os.environ.get("SEMIF_TEST_START")
    if start == "gated":
        wait_for(CONTROL / "start")
    elif start == "fails":
        from semif_serve.engine.boot import StartupError

        raise StartupError("model 'default' (fake): the warm-up decision failed on purpose")
    scorer = GatedScorer() if os.environ.get("SEMIF_TEST_GATED") == "1" else FakeScorer()
    service = DecisionService(fake_runtime(scorer, settings), settings)
    return create_app(service, settings, ReportingLimit(settings.max_queue))


if __name__ == "__main__":
    run(Settings.from_env(), app)

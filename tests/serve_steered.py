"""Real gunicorn semif-serve processes for the tests, each steered through files in the
SEMIF_TEST_CONTROL folder: `python tests/serve_steered.py MODE`. Everything not named below is
the production code (gunicorn, the worker, the app, the runtime).

- `fake` (tests/live_server.py `fake_server`): the app over a FakeScorer. With
  SEMIF_TEST_GATED=1 every scorer call writes `entered-<n>` and waits (bounded) for a `release`
  file; every admitted POST writes `admitted-<n>`. With SEMIF_TEST_START=gated the app is built
  only once a `start` file appears (the worker answers meanwhile); with SEMIF_TEST_START=fails
  its build raises a StartupError. No torch is imported.
- `managed` (tests/test_management_state.py): the production app (management state, its replay,
  the master that notes how each worker ended) over fake engines; a model whose source has a
  file `fail-<source>` in the control folder fails to load. No torch is imported.
- `poisoned` (tests/test_startup_checks.py): the production engine (load, warm-up, baseline)
  over the tiny random Llama whose weights hold 4 KB of 0xFF (tiny_models.poisoned).
- `cuda` (tests/test_e2e.py): `semif-serve serve` on a machine whose torch "has" one CUDA
  device: torch.cuda is tests/fake_torch.py's FakeCuda, the loader loads on the CPU whatever
  device it was asked for and reports that device, and every torch.cuda call naming a device is
  appended to cuda-calls.jsonl in the control folder.
"""

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fakes import WAIT_S, FakeScorer  # noqa: E402

from semif_serve.config import Settings  # noqa: E402


def control() -> Path:
    """The folder the test steers this server through (read in the server, not at import)."""
    return Path(os.environ["SEMIF_TEST_CONTROL"])


def wait_for(path: Path, timeout: float = 3 * WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)


def serve_fake() -> None:
    from fakes import fake_runtime

    from semif_serve.errors import StartupError
    from semif_serve.http import create_app
    from semif_serve.runtime.admission import InFlightLimit
    from semif_serve.runtime.service import DecisionService
    from semif_serve.server import run

    class GatedScorer(FakeScorer):
        calls_entered = 0

        def _enter(self):
            GatedScorer.calls_entered += 1
            (control() / f"entered-{GatedScorer.calls_entered}").touch()
            wait_for(control() / "release")

    class ReportingLimit(InFlightLimit):
        admitted = 0

        def acquire(self):
            super().acquire()
            ReportingLimit.admitted += 1
            (control() / f"admitted-{ReportingLimit.admitted}").touch()

    def app():
        settings = Settings.from_env()
        start = os.environ.get("SEMIF_TEST_START")
        if start == "gated":
            wait_for(control() / "start")
        elif start == "fails":
            raise StartupError("model 'default' (fake): the warm-up decision failed on purpose")
        scorer = GatedScorer() if os.environ.get("SEMIF_TEST_GATED") == "1" else FakeScorer()
        service = DecisionService(fake_runtime(scorer, settings), settings)
        return create_app(service, settings, ReportingLimit(settings.max_queue))

    run(Settings.from_env(), app)


def serve_managed() -> None:
    from semif_serve.engine.engine import Engine
    from semif_serve.server import run

    def engine(spec):
        if (control() / f"fail-{spec.source}").exists():
            raise RuntimeError(
                f"{spec.source} cannot load (fail-{spec.source} in the control folder)"
            )
        return Engine(FakeScorer())

    run(Settings.from_env(), engine_factory=engine)


def serve_poisoned() -> None:
    from tiny_models import poisoned

    from semif_serve.engine.boot import build_engine
    from semif_serve.server import run

    settings = Settings.from_env()
    run(
        settings,
        engine_factory=lambda spec: build_engine(
            settings, spec, load=lambda source, *args, **kwargs: poisoned(source)
        ),
    )


def serve_cuda() -> int:
    import torch
    from fake_torch import GIB, FakeCuda

    from semif_serve import cli
    from semif_serve.engine import loading

    calls = control() / "cuda-calls.jsonl"

    class RecordingCuda(FakeCuda):
        def set_per_process_memory_fraction(self, fraction, device=None):
            try:
                super().set_per_process_memory_fraction(fraction, device)
            finally:
                with calls.open("a") as log:
                    log.write(json.dumps({"call": "fraction", "device": device}) + "\n")

    real_load = loading.load_model

    def load_on_the_cpu(source, revision, *, device, **kwargs):
        scoring_model = real_load(source, revision, device="cpu", **kwargs)
        info = dataclasses.replace(scoring_model.info, device=device)
        return dataclasses.replace(scoring_model, info=info)

    fake = RecordingCuda(total=80 * GIB)
    for name in (
        "is_available",
        "device_count",
        "current_device",
        "get_device_capability",
        "get_arch_list",
        "get_device_properties",
        "set_per_process_memory_fraction",
        "memory_reserved",
        "memory_allocated",
        "max_memory_allocated",
        "reset_peak_memory_stats",
        "empty_cache",
    ):
        setattr(torch.cuda, name, getattr(fake, name))
    loading.load_model = load_on_the_cpu
    return cli.main(["serve"])


MODES = {
    "fake": serve_fake,
    "managed": serve_managed,
    "poisoned": serve_poisoned,
    "cuda": serve_cuda,
}


def command(mode: str) -> list[str]:
    """The command line that serves `mode`."""
    assert mode in MODES, mode
    return [sys.executable, str(Path(__file__).resolve()), mode]


if __name__ == "__main__":
    sys.exit(MODES[sys.argv[1]]())

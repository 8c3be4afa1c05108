"""`semif-serve serve` as production runs it, on a machine whose torch "has" one CUDA device.

torch.cuda is replaced by tests/fake_torch.py's FakeCuda (which, like torch, refuses an
index-less device for the memory fraction) and the model loader loads on the CPU whatever device
it was asked for, reporting that device. Every torch.cuda call naming a device is appended to
$SEMIF_TEST_CONTROL/cuda-calls.jsonl, so a test sees what the production boot path passed torch.
Everything else (the CLI, gunicorn, build_engine, the real built-in model) is production code.
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from fake_torch import GIB, FakeCuda  # noqa: E402

from semif_serve import cli  # noqa: E402
from semif_serve.engine import loading  # noqa: E402

CALLS = Path(os.environ["SEMIF_TEST_CONTROL"]) / "cuda-calls.jsonl"


class RecordingCuda(FakeCuda):
    def set_per_process_memory_fraction(self, fraction, device=None):
        try:
            super().set_per_process_memory_fraction(fraction, device)
        finally:
            with CALLS.open("a") as log:
                log.write(json.dumps({"call": "fraction", "device": device}) + "\n")


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
real_load = loading.load_model
loading.load_model = load_on_the_cpu

if __name__ == "__main__":
    sys.exit(cli.main(["serve"]))

"""GPU memory of a running semif-serve, read from outside the process with nvidia-smi.

The server does not report its memory peak, so `accept` samples `nvidia-smi` while it sends one
long decision, summing the memory of every GPU process whose command line names semif-serve
(gunicorn titles its processes `gunicorn: ... [semif-serve]`). nvidia-smi's figure includes the
CUDA context, which the torch cap (SEMIF_VRAM_CAP_GIB) does not cover, so a cap derived from it
errs on the safe side.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

MIB = 1 << 20
GIB = 1 << 30
SAMPLE_INTERVAL_S = 0.05
CAP_HEADROOM = 1.15  # fragmentation and longer-than-measured prompts
CAP_STEP_GIB = 0.5
PROCESS_NAME = "semif-serve"


class MemoryUnavailable(Exception):
    """GPU memory cannot be read here (no nvidia-smi, or no semif-serve process on a GPU)."""


def server_memory_bytes() -> int:
    """GPU memory in use now by semif-serve processes on this host, from nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        raise MemoryUnavailable("nvidia-smi is not on PATH")
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError) as error:
        raise MemoryUnavailable(f"nvidia-smi failed: {error}") from None
    total, found = 0, False
    for line in listing.splitlines():
        pid, _, used = (part.strip() for part in line.partition(","))
        if pid.isdigit() and used.isdigit() and _is_server(int(pid)):
            total += int(used) * MIB
            found = True
    if not found:
        raise MemoryUnavailable(
            f"no {PROCESS_NAME} process in nvidia-smi's list (run accept on the GPU host, "
            "outside the server's PID namespace)"
        )
    return total


def _is_server(pid: int) -> bool:
    try:
        return PROCESS_NAME in Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace")
    except OSError:
        return False


class PeakSampler:
    """Samples `read` every SAMPLE_INTERVAL_S while `during` runs; keeps the highest reading."""

    def __init__(self, read: Callable[[], int] = server_memory_bytes):
        self._read = read

    def peak(self, during: Callable[[], object]) -> tuple[int, int, object]:
        """(memory before, peak while `during` ran, what `during` returned)."""
        before = self._read()
        readings = [before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(SAMPLE_INTERVAL_S):
                try:
                    readings.append(self._read())
                except MemoryUnavailable:
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            outcome = during()
        finally:
            stop.set()
            sampler.join(timeout=30)
        readings.append(self._read())
        return before, max(readings), outcome


def suggested_cap_gib(peak_bytes: int) -> float:
    """The peak with headroom, rounded up to the next half GiB."""
    return math.ceil(peak_bytes * CAP_HEADROOM / GIB / CAP_STEP_GIB) * CAP_STEP_GIB

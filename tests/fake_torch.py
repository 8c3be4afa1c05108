"""A fake torch for the engine's memory policy and startup checks: no GPU needed.

`cuda.watch` holds weak references to a failed call's "tensors"; each `empty_cache()` call
records whether they were all freed by then.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

GIB = 1 << 30
MIB = 1 << 20


class FakeTensor:
    """Stands in for a tensor a scorer call holds; weak-referenceable."""


class FakeCuda:
    class OutOfMemoryError(RuntimeError):
        pass

    def __init__(
        self,
        available=True,
        capability=(9, 0),
        arch_list=("sm_80", "sm_90"),
        total=80 * GIB,
        count=1,
        current=0,
    ):
        self.available = available
        self.count = count if available else 0
        self.current = current
        self.capability = capability
        self.arch_list = list(arch_list)
        self.total = total
        self.reserved = 0
        self.fraction = None
        self.watch: list[weakref.ref] = []
        self.empty_cache_calls: list[bool] = []  # per call: were all watched tensors freed?

    def is_available(self):
        return self.available

    def get_device_capability(self, device=None):
        return self.capability

    def get_arch_list(self):
        return self.arch_list

    def get_device_properties(self, device=None):
        return SimpleNamespace(total_memory=self.total)

    def device_count(self):
        return self.count

    def current_device(self):
        return self.current

    def set_per_process_memory_fraction(self, fraction, device=None):
        """As torch.cuda's: the device needs an index ("cuda" is refused), the fraction a float
        in 0..1."""
        index = self.current if device is None else device_index(device)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fraction = fraction
        self.fraction_device = index

    def memory_reserved(self, device=None):
        return self.reserved

    allocated = 0
    peak_allocated = 0

    def memory_allocated(self, device=None):
        return self.allocated

    def max_memory_allocated(self, device=None):
        return self.peak_allocated

    def reset_peak_memory_stats(self, device=None):
        self.peak_allocated = self.allocated

    def empty_cache(self):
        self.empty_cache_calls.append(all(ref() is None for ref in self.watch))

    def hold(self) -> FakeTensor:
        tensor = FakeTensor()
        self.watch.append(weakref.ref(tensor))
        return tensor


def device_index(device) -> int:
    """torch._utils._get_device_index(device) without `optional`: an int, or "cuda:N"."""
    if isinstance(device, int):
        return device
    kind, _, index = str(device).partition(":")
    if kind != "cuda" or not index:
        raise ValueError(
            f"Expected a torch.device with a specified index or an integer, but got:{device}"
        )
    return int(index)


class FakeTorch:
    OutOfMemoryError = FakeCuda.OutOfMemoryError

    def __init__(self, **cuda):
        self.cuda = FakeCuda(**cuda)

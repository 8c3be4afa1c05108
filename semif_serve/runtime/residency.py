"""`Residency`: which models stay loaded, the policy beside the registry's transitions.

SEMIF_MAX_LOADED_MODELS and SEMIF_MEMORY_BUDGET_GIB evict idle, queue-free models least recently
used first to make room for a load; a reconfigure's new weights load beside the old ones only
when every limit still holds (`fits_beside`); models idle past their keep_alive_s are retired
(`retire_idle`, run by the runtime's idle loop). It decides; the unloads it asks for are the
caller's transition (`lifecycle.Lifecycle.unload`), each taken only while the model is idle and
held alone (`ModelScheduler.try_manage`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from semif_serve.errors import InsufficientMemory
from semif_serve.runtime.scheduler import UNLOADED, ModelScheduler
from semif_serve.runtime.specs import ModelSpec

GIB = 1 << 30
Unload = Callable[[ModelScheduler, str], None]  # (the model, its event: evict or retire)


class Residency:
    def __init__(
        self,
        settings: Any,
        models: Callable[[], list[ModelScheduler]],
        clock: Callable[[], float],
    ):
        self._settings = settings
        self._models = models  # every registered model, now
        self._clock = clock

    def fits_beside(self, entry: ModelScheduler, spec: ModelSpec, estimate: int | None) -> bool:
        """Whether `spec`'s weights fit while the old engine still holds its memory: within
        SEMIF_MEMORY_BUDGET_GIB (every loaded model's resident bytes plus the estimate) and, on a
        GPU, SEMIF_VRAM_CAP_GIB (every GPU model's plus the estimate; each GPU engine counts
        what its own load and warm-up added, boot.resident_difference). The estimate is the old
        engine's own size when the weights are the same, else the source check's. With neither
        limit set nothing bounds it (always beside); with a limit and no estimate, never."""
        old = entry.spec
        if (old.source, old.revision, old.dtype) == (spec.source, spec.revision, spec.dtype):
            estimate = resident(entry.engine) or estimate
        loaded = [e for e in self._models() if e.engine is not None]
        limits = []
        if self._settings.memory_budget_gib is not None:
            limits.append((self._settings.memory_budget_gib, loaded))
        if self._settings.vram_cap_gib is not None and spec.device != "cpu":
            on_gpu = [e for e in loaded if e.spec.device != "cpu"]
            limits.append((self._settings.vram_cap_gib, on_gpu))
        if limits and estimate is None:
            return False
        return all(
            sum(resident(e.engine) for e in held) + estimate <= limit_gib * GIB
            for limit_gib, held in limits
        )

    def make_room(self, loading: ModelScheduler, unload: Unload) -> None:
        """Below SEMIF_MAX_LOADED_MODELS, or evict idle models least recently used first."""
        limit = self._settings.max_loaded_models
        if limit is None:
            return
        while True:
            others = [e for e in self._models() if e is not loading]
            if sum(1 for e in others if e.state != UNLOADED) < limit:
                return
            if not evict_one(others, unload):
                raise InsufficientMemory(
                    f"{limit} models are loaded (SEMIF_MAX_LOADED_MODELS) and none is idle; "
                    "retry later"
                )

    def fit_in_memory_budget(self, loading: ModelScheduler, engine: Any, unload: Unload) -> None:
        """With SEMIF_MEMORY_BUDGET_GIB, evict idle models (LRU) until the new engine fits beside
        the other models (the loading model's old engine is being replaced), else refuse (503).
        Evictions done before a refusal are not undone."""
        budget_gib = self._settings.memory_budget_gib
        if budget_gib is None:
            return
        budget = budget_gib * GIB
        needed = resident(engine)
        while True:
            others = [e for e in self._models() if e is not loading]
            used = sum(resident(e.engine) for e in others)
            if used + needed <= budget:
                return
            if not evict_one(others, unload):
                raise InsufficientMemory(
                    f"model {loading.spec.id!r} needs {needed / GIB:.2f} GiB; "
                    f"{used / GIB:.2f} of SEMIF_MEMORY_BUDGET_GIB={budget_gib} are held by "
                    "busy models; retry later"
                )

    def retire_idle(self, unload: Unload) -> list[str]:
        """Unload every idle model past its keep_alive_s; returns their ids."""
        now = self._clock()
        retired = []
        for entry in self._models():
            keep_alive = entry.spec.keep_alive_s
            last_used = entry.last_used
            if keep_alive is None or last_used is None or now - last_used < keep_alive:
                continue
            if entry.try_manage(lambda held: unload(held, "retire")):
                retired.append(entry.spec.id)
        return retired


def evict_one(candidates: list[ModelScheduler], unload: Unload) -> bool:
    """Unload the least recently used idle candidate; False when none is idle."""
    victims = sorted((e for e in candidates if e.is_idle), key=lambda e: e.last_used or 0.0)
    return any(victim.try_manage(lambda held: unload(held, "evict")) for victim in victims)


def resident(engine: Any) -> int:
    """The bytes an engine holds (0 when none, or unknown)."""
    return getattr(engine, "resident_bytes", None) or 0

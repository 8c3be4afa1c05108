"""`Lifecycle`: every transition of a registered model's engine, in one place: load (at startup,
on a request's demand, for a manager), reconfigure (in place, beside the old engine, instead of
it with the old configuration restored on failure) and unload (by hand, evicted, retired).

Whoever calls it holds the model alone (a manager: `ModelScheduler.run_managed`, `try_manage`)
or is its one admitted loader (`ModelScheduler._start_load`); the model's queue decides who that
is, so no two transitions of a model overlap and none runs beside a request. An engine is built
privately, checked (slots, memory budget) and only then published whole; one never published is
closed here, since nobody else would. Which models stay loaded is the residency policy's call
(`residency.Residency`); its evictions come back here as unloads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

from semif_serve.errors import (
    BadManagementRequest,
    InsufficientMemory,
    ModelLoadFailed,
    ServeError,
)
from semif_serve.runtime.residency import Residency
from semif_serve.runtime.scheduler import LOADING, READY, RECONFIGURING, UNLOADED, ModelScheduler
from semif_serve.runtime.specs import ModelSpec

log = logging.getLogger(__name__)


class Lifecycle:
    def __init__(
        self,
        build: Callable[[ModelSpec], Any],
        residency: Residency,
        tell: Callable[[str, str], None],
    ):
        self._build_engine = build  # the engine factory: loads and warms `spec` up
        self._residency = residency
        self._tell = tell  # (model id, event): load, load_failed, unload, evict, retire

    # -- loads -----------------------------------------------------------------------------------

    def load(self, entry: ModelScheduler, spec: ModelSpec | None = None) -> None:
        """Load `spec` (default: the registered one) unless the model is loaded; a failure
        leaves it unloaded."""
        if entry.state == READY:
            return
        entry.set_state(LOADING)
        try:
            self.load_admitted(entry, spec)
        except BaseException:
            entry.abort_load()
            raise

    def load_requested(self, entry: ModelScheduler) -> None:
        """A request's lazy load of the registered spec (`load_admitted`). One that no longer
        loads as registered (its `slots` above what the device takes today, more memory in
        use) is the model's load failure (503, saying why, logged), never a management 400
        answered to a scoring call; its registration is unchanged."""
        try:
            self.load_admitted(entry)
        except BadManagementRequest as error:
            log.warning("model %s cannot be loaded as registered: %s", entry.spec.id, str(error))
            raise ModelLoadFailed(
                f"model {entry.spec.id!r} cannot be loaded as registered: {error}"
            ) from None

    def load_admitted(self, entry: ModelScheduler, spec: ModelSpec | None = None) -> None:
        """Build `spec`'s engine (default: the registered spec) privately, then publish it whole."""
        spec = spec or entry.spec
        engine, capacity = self._build(entry, spec)
        self._publish(entry, engine, capacity, spec)
        self._tell(spec.id, "load")

    def _build(self, entry: ModelScheduler, spec: ModelSpec) -> tuple[Any, int | None]:
        """Make room, build `spec`'s engine (the factory warms it up), check that it fits the
        memory budget and serves `spec.slots`; nothing is published. InsufficientMemory and
        BadManagementRequest pass as they are, any other failure is ModelLoadFailed (503); each
        is recorded as the model's last load error."""
        try:
            self._residency.make_room(entry, self.unload)
            engine = self._built(spec)
            try:
                self._residency.fit_in_memory_budget(entry, engine, self.unload)
                capacity = getattr(engine, "max_parallel_slots", None)
                if capacity is not None and spec.slots > capacity:
                    raise BadManagementRequest(
                        f"{spec.id}.slots: {spec.slots} is more than the {capacity} this "
                        "model supports"
                    )
            except BaseException:
                _teardown(engine)  # never published, so nobody else would close it
                raise
        except Exception as error:
            entry.record_load_error(str(error))
            raise
        return engine, capacity

    def _built(self, spec: ModelSpec) -> Any:
        try:
            return self._build_engine(spec)
        except Exception as error:
            self._tell(spec.id, "load_failed")
            if isinstance(error, (InsufficientMemory, BadManagementRequest)):
                raise
            log.error("loading model %s failed: %s", spec.id, str(error))  # no reference kept
            raise ModelLoadFailed(
                f"loading model {spec.id!r} failed: {error}",
                public=f"loading model {spec.id!r} failed ({type(error).__name__}); its "
                "last_load_error in GET /v1/models and the server's log say why",
            ) from None

    def _publish(self, entry: ModelScheduler, engine: Any, capacity: int | None, spec) -> None:
        try:
            entry.publish(engine, capacity, spec)
        except BaseException:
            _teardown(engine)  # never published, so nobody else would close it
            raise

    # -- unloads ---------------------------------------------------------------------------------

    def unload(self, entry: ModelScheduler, event: str = "unload") -> None:
        """Retire the engine and close it; the model is unloaded even when the close fails
        (requests may load it again). `event`: unload, evict or retire."""
        engine = entry.retire()
        try:
            _teardown(engine)
        finally:
            entry.set_state(UNLOADED)
        if engine is not None:
            self._tell(entry.spec.id, event)

    # -- reconfiguration -------------------------------------------------------------------------

    def reconfigure(self, entry: ModelScheduler, spec: ModelSpec, estimate: int | None) -> None:
        """Give the model `spec`; it is committed only together with an engine built from it.

        - unloaded: load it; a failure keeps the registered configuration (unloaded);
        - loaded, and `spec`'s weights fit beside the old ones (`Residency.fits_beside`): load
          the new engine (warm-up included) while the old one is kept, then switch; a failure
          leaves the old engine and configuration serving;
        - loaded, not fitting beside: tear the old engine down, load the new one; if that
          fails, load the old configuration again; if that fails too, the model is unloaded.
        Every failed load is the model's `last_load_error` until a load succeeds. A change that
        leaves the weights as they are is applied to the serving engine instead (`_retune`)."""
        if self._retune(entry, spec):
            return
        if (
            entry.capacity is not None
            and spec.slots > entry.capacity
            and spec.configuration() == entry.spec.configuration()
        ):
            raise BadManagementRequest(
                f"{spec.id}.slots: {spec.slots} is more than the {entry.capacity} this model "
                "supports; the current configuration keeps serving"
            )
        if entry.state != READY:
            self.load(entry, spec)
        elif self._residency.fits_beside(entry, spec, estimate):
            self._load_beside(entry, spec)
        else:
            self._load_instead(entry, spec)

    def _retune(self, entry: ModelScheduler, spec: ModelSpec) -> bool:
        """Apply `spec` to the loaded engine when only `keep_alive_s`, `slots` or `max_tokens`
        change and the engine can serve them (`capacity_at`): no reload, the model's stored
        prefixes kept. False: only a new engine can apply `spec`."""
        engine = entry.engine
        if entry.state != READY or spec.weights() != entry.spec.weights():
            return False
        capacity_at = getattr(engine, "capacity_at", None)
        capacity = None if capacity_at is None else capacity_at(spec.max_tokens)
        if capacity is None:
            return False
        if spec.slots > capacity:
            raise BadManagementRequest(
                f"{spec.id}.slots: {spec.slots} is more than the {capacity} this model "
                "supports; the current configuration keeps serving"
            )
        engine.retune(spec.max_tokens, spec.slots)
        entry.publish(engine, capacity, spec)
        log.info("model %s reconfigured in place (its weights are unchanged)", spec.id)
        return True

    def _load_beside(self, entry: ModelScheduler, spec: ModelSpec) -> None:
        old = entry.engine
        entry.set_state(RECONFIGURING)
        try:
            engine, capacity = self._build(entry, spec)
            self._publish(entry, engine, capacity, spec)
        except BaseException:
            entry.set_state(READY)  # nothing was published: the old engine serves on
            raise
        _teardown(old)
        self._tell(spec.id, "load")

    def _load_instead(self, entry: ModelScheduler, spec: ModelSpec) -> None:
        self.unload(entry)
        try:
            self.load(entry, spec)
        except ServeError as error:  # a load's failure; anything else is a bug: left unloaded
            self._restore(entry, error)

    def _restore(self, entry: ModelScheduler, error: ServeError) -> NoReturn:
        """The fallback's last step: load the registered (old) configuration again, which the
        failed load never replaced, then report `error`."""
        try:
            self.load(entry)
            outcome = "the previous configuration was loaded again and serves"
        except Exception as second:
            outcome = f"loading the previous configuration failed too ({second}); unloaded"
        message = f"{error}; {outcome}"
        entry.record_load_error(message)
        raise type(error)(message) from None


def _teardown(engine: Any) -> None:
    if engine is not None and hasattr(engine, "close"):
        engine.close()

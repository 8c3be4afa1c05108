"""`Reconfiguration`: how the runtime gives a registered model a new configuration, its
registry's mixin (registry.py), as `Residency` is for which models stay loaded.

A reconfigure never costs the serving model without need: a change that keeps the weights is
applied to the serving engine in place (`_retune`); new weights load beside the old ones when
memory allows (`_load_beside`), else instead of them, with the old configuration loaded again
if the new one fails (`_load_instead`, `_restore`). The caller holds the model alone.
"""

from __future__ import annotations

import logging
from typing import NoReturn

from semif_serve.errors import BadManagementRequest, ServeError
from semif_serve.runtime.scheduler import READY, RECONFIGURING, ModelScheduler
from semif_serve.runtime.specs import ModelSpec

log = logging.getLogger(__name__)


class Reconfiguration:
    """The reconfigure transitions; the registry provides loading, building and teardown."""

    def _reconfigure(self, entry: ModelScheduler, spec: ModelSpec, estimate: int | None) -> None:
        """Give the model `spec`; it is committed only together with an engine built from it.

        - unloaded: load it; a failure keeps the registered configuration (unloaded);
        - loaded, and `spec`'s weights fit beside the old ones (`_fits_beside`): load the new
          engine (warm-up included) while the old one is kept, then switch; a failure leaves
          the old engine and configuration serving;
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
            self._load_alone(entry, spec)
        elif self._fits_beside(entry, spec, estimate):
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
        self._teardown(old)
        self.on_event(spec.id, "load")

    def _load_instead(self, entry: ModelScheduler, spec: ModelSpec) -> None:
        self._unload_alone(entry)
        try:
            self._load_alone(entry, spec)
        except ServeError as error:  # a load's failure; anything else is a bug: left unloaded
            self._restore(entry, error)

    def _restore(self, entry: ModelScheduler, error: ServeError) -> NoReturn:
        """The fallback's last step: load the registered (old) configuration again, which the
        failed load never replaced, then report `error`."""
        try:
            self._load_alone(entry)
            outcome = "the previous configuration was loaded again and serves"
        except Exception as second:
            outcome = f"loading the previous configuration failed too ({second}); unloaded"
        message = f"{error}; {outcome}"
        entry.record_load_error(message)
        raise type(error)(message) from None


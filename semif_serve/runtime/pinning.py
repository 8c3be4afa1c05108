"""`Pinned`: the one model configuration a request of several engine calls is answered by.

An ecosystem request of more than SEMIF_MAX_DECISIONS questions runs as several calls, and a
`PUT` may reconfigure its model between two of them. Its first call pins the configuration it
ran under (`ModelSpec.configuration`: weights, revision, dtype, device, max_tokens); each later
call checks it while it holds the model, before anything of it runs, and one that finds another
fails the whole request (`ConfigurationChanged`, 503), so no reply mixes two configurations
and no row is refused by limits its request never started under. A reload of the same
configuration (after an eviction or an unload) keeps the pin.
"""

from __future__ import annotations

from semif_serve.errors import ConfigurationChanged
from semif_serve.runtime.specs import ModelSpec


class Pinned:
    """A request's configuration: none until its first call holds the model."""

    def __init__(self) -> None:
        self.configuration: tuple | None = None

    def check(self, spec: ModelSpec) -> None:
        """Pin `spec`'s configuration on the first call; on a later one, raise
        ConfigurationChanged unless `spec` has the pinned one. Called while the call holds
        the model (no manager can change it meanwhile)."""
        configuration = spec.configuration()
        if self.configuration is None:
            self.configuration = configuration
        elif configuration != self.configuration:
            raise ConfigurationChanged(
                f"model {spec.id!r} was reconfigured while this request was being scored in "
                "several calls; it was failed whole, before any answer, rather than answered "
                "by two configurations: retry it"
            )

"""`TorchScorer`: the direct and shared scorers over one loaded model, as the engine drives them.

It carries the model's `max_tokens` (a reconfigure may change it in place) and the model's view
of the process-wide state-prefix cache.
`prepare` and `prepare_shared` encode a request (every limit checked) without the engine lock;
`score` and `score_shared` take what they return (or plain rows, encoded then).
After an out-of-memory error the engine's policy (`oom_policy`) may ask it to `relieve` the
shortfall from THIS model's stored prefixes (never another model's), oldest first, and then run
the call once more with `cached=False`.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

from semif_serve.engine.oom_policy import bytes_to_drop, shortfall
from semif_serve.scoring.coalesced import score_batch
from semif_serve.scoring.inputs import DirectInput, SharedInput, direct_input, shared_input
from semif_serve.scoring.length_bound import bytes_per_token
from semif_serve.scoring.prefix_cache import ModelPrefixCache, PrefixCache
from semif_serve.scoring.rows import Row
from semif_serve.scoring.shapes import AUTO, bucketed_tokens, resolve
from semif_serve.scoring.template import TemplatePrefix

log = logging.getLogger(__name__)


class TorchScorer:
    """The direct and shared scorers over one loaded model, with its max_tokens."""

    def __init__(
        self,
        scoring_model: Any,
        max_tokens: int,
        prefix_cache: PrefixCache | None = None,
        torch_module: Any = None,
    ):
        self.scoring_model = scoring_model
        self.max_tokens = max_tokens
        self._torch = torch_module
        self.prefix_cache: ModelPrefixCache | None = None
        bytes_per_token(scoring_model.tokenizer)  # a pass over the vocabulary, once, at load
        if prefix_cache is not None and prefix_cache.budget_bytes > 0:
            identity = scoring_model.info.identity()
            self.prefix_cache = prefix_cache.for_model(tuple(sorted(identity.items())))
        # The prompt start every request shares: a batch of distinct states prefills it once.
        self.template = TemplatePrefix.of(scoring_model.tokenizer, max_tokens)

    def model_info(self) -> dict[str, Any]:
        return self.scoring_model.info.identity()

    def prepare(self, row: Row) -> DirectInput:
        """Encode one row for `score`, every limit checked (needs no lock: the tokenizer only),
        with its state prefix located: a batch shares one prefill among requests over the same
        state, cache or not (`scoring.coalesced`)."""
        return direct_input(self.scoring_model.tokenizer, row, self.max_tokens, with_prefix=True)

    def prepare_shared(self, rows: list[Row]) -> SharedInput:
        """Encode rows over one state for `score_shared`, every limit checked (no lock)."""
        return shared_input(self.scoring_model.tokenizer, rows, self.max_tokens)

    def score(self, row: Row | DirectInput, cached: bool = True) -> dict[str, Any]:
        from semif_serve.scoring import score

        return score(
            self.scoring_model, row, max_tokens=self.max_tokens, prefix_cache=self._cache(cached)
        )

    def score_shared(
        self, rows: list[Row] | SharedInput, cached: bool = True
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        from semif_serve.scoring import score_shared

        return score_shared(
            self.scoring_model, rows, max_tokens=self.max_tokens, prefix_cache=self._cache(cached)
        )

    def weights_unchanged(self) -> bool:
        """Whether the loaded weights are still what the source holds (a local folder's files
        may have been rewritten since): if not, a reconfigure must load them again."""
        from semif_serve.engine.loading import weights_unchanged

        info = self.scoring_model.info
        return weights_unchanged(info.source, info.revision)

    def score_batch(
        self,
        items: list[DirectInput | SharedInput],
        cached: bool = True,
        left: Callable[[Any], bool] | None = None,
    ) -> list[Any]:
        """Several requests' inputs in as few forwards as exactness allows (`scoring.coalesced`;
        `left`: whose caller has gone, asked before each forward)."""
        return score_batch(
            self.scoring_model,
            items,
            max_tokens=self.max_tokens,
            prefix_cache=self._cache(cached),
            template=self.template if cached else None,
            left=left,
        )

    def batch_tokens(self, rows: int, length: int) -> int:
        """A batch forward's tokens as this model runs it: bucketed rows x width on CUDA
        (`shapes.bucketed_tokens`), rows x length on the CPU."""
        buckets = resolve(AUTO, self.scoring_model.model.device)
        return bucketed_tokens(rows, length, buckets)

    def cache_stats(self) -> dict[str, int] | None:
        """hits, misses, evictions, bytes and entries of this model's prefixes (None: cache off)."""
        return None if self.prefix_cache is None else self.prefix_cache.stats()

    def held_bytes(self) -> int:
        """Bytes kept between calls: the state-prefix cache's (every model's: one budget) and
        this model's template prefill."""
        template = 0 if self.template is None else self.template.held_bytes()
        return template + (0 if self.prefix_cache is None else self.prefix_cache.store.total_bytes)

    def close(self) -> None:
        """The model is going: its stored prefixes go too, unless another loaded model id on
        the same weights still uses them."""
        if self.template is not None:
            self.template.drop()
        if self.prefix_cache is not None:
            self.prefix_cache.close()

    def relieve(self, message: str) -> bool:
        """After an out-of-memory error (`message`, torch's): drop as many of this model's stored
        prefixes as `oom_policy` says cover what the allocation lacked, and hand the memory
        back. True when that was enough for one more try without the cache."""
        cache = self.prefix_cache
        if cache is None:
            return False
        stored = cache.stats()["bytes"]
        wanted = bytes_to_drop(stored, shortfall(message))
        if wanted is None:
            return False
        freed = cache.drop(at_least=wanted)
        if freed < wanted:
            return False
        log.warning(
            "out of memory (%s): dropped %d of this model's %d stored prefix bytes, scoring "
            "again without the prefix cache",
            message.strip().splitlines()[0],  # the engine's message is never empty
            freed,
            stored,
        )
        gc.collect()
        self._empty_device_cache()
        return True

    def _cache(self, cached: bool) -> ModelPrefixCache | None:
        return self.prefix_cache if cached else None

    def _torch_module(self) -> Any:
        if self._torch is None:
            import torch

            self._torch = torch
        return self._torch

    def _empty_device_cache(self) -> None:
        if str(self.scoring_model.info.device).startswith("cuda"):
            self._torch_module().cuda.empty_cache()

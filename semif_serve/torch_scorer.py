"""`TorchScorer`: the direct and shared scorers over one loaded model, as the engine drives them.

It carries the model's `max_tokens` (a reconfigure may change it in place) and the model's view
of the process-wide state-prefix cache.
`prepare` and `prepare_shared` encode a request (every limit checked) without the engine lock;
`score` and `score_shared` take what they return (or plain rows, encoded then).
An out-of-memory error in a call goes through `oom_policy`: some of THIS model's stored prefixes
(never another model's), oldest first, may be dropped to cover what the allocation lacked, and
the call runs once more without the cache; otherwise, or on a second out-of-memory, the error
goes to the engine's policy (503) at once.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

from semif_serve.engine import is_out_of_memory
from semif_serve.errors import OutOfMemory
from semif_serve.oom_policy import bytes_to_drop, shortfall
from semif_serve.scoring.batched import score_batch
from semif_serve.scoring.inputs import Batched, DirectInput, SharedInput, direct_input, shared_input
from semif_serve.scoring.length_bound import bytes_per_token
from semif_serve.scoring.prefix_cache import ModelPrefixCache, PrefixCache
from semif_serve.scoring.rows import Row

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

    def model_info(self) -> dict[str, Any]:
        return self.scoring_model.info.identity()

    def prepare(self, row: Row) -> DirectInput:
        """Encode one row for `score`, every limit checked (needs no lock: the tokenizer only),
        with its state prefix located: a batch shares one prefill among requests over the same
        state, cache or not (`scoring.batched`)."""
        return direct_input(self.scoring_model.tokenizer, row, self.max_tokens, with_prefix=True)

    def prepare_shared(self, rows: list[Row]) -> SharedInput:
        """Encode rows over one state for `score_shared`, every limit checked (no lock)."""
        return shared_input(self.scoring_model.tokenizer, rows, self.max_tokens)

    def score(self, row: Row | DirectInput) -> dict[str, Any]:
        from semif_serve.scoring import score

        return self._with_fallback(
            lambda cache: score(
                self.scoring_model, row, max_tokens=self.max_tokens, prefix_cache=cache
            )
        )

    def score_shared(
        self, rows: list[Row] | SharedInput
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        from semif_serve.scoring import score_shared

        return self._with_fallback(
            lambda cache: score_shared(
                self.scoring_model, rows, max_tokens=self.max_tokens, prefix_cache=cache
            )
        )

    def weights_unchanged(self) -> bool:
        """Whether the loaded weights are still what the source holds (a local folder's files
        may have been rewritten since): if not, a reconfigure must load them again."""
        from semif_serve.loading import weights_unchanged

        info = self.scoring_model.info
        return weights_unchanged(info.source, info.revision)

    def score_batch(self, items: list[DirectInput | SharedInput]) -> list[Batched]:
        """Several requests' inputs in as few forwards as exactness allows (`scoring.batched`)."""
        return self._with_fallback(
            lambda cache: score_batch(
                self.scoring_model, items, max_tokens=self.max_tokens, prefix_cache=cache
            )
        )

    def cache_stats(self) -> dict[str, int] | None:
        """hits, misses, evictions, bytes and entries of this model's prefixes (None: cache off)."""
        return None if self.prefix_cache is None else self.prefix_cache.stats()

    def held_bytes(self) -> int:
        """Bytes the state-prefix cache keeps between calls (every model's: one budget)."""
        return 0 if self.prefix_cache is None else self.prefix_cache.store.total_bytes

    def close(self) -> None:
        """The model is going: its stored prefixes go too, unless another loaded model id on
        the same weights still uses them."""
        if self.prefix_cache is not None:
            self.prefix_cache.close()

    def _with_fallback(self, call: Callable[[ModelPrefixCache | None], Any]) -> Any:
        """Run `call` with this model's prefix cache; on out of memory, `oom_policy` decides
        whether some of its stored prefixes go and the call runs once more without the cache,
        or the error is a 503 at once."""
        cache = self.prefix_cache
        try:
            return call(cache)
        except Exception as error:
            if cache is None or not is_out_of_memory(error, self._torch_module()):
                raise
            message = str(error)
        # Outside the except block, so the failed call's frames (and tensors) are gone.
        stored = cache.stats()["bytes"]
        wanted = bytes_to_drop(stored, shortfall(message))
        if wanted is None:
            raise OutOfMemory(message)
        freed = cache.drop(at_least=wanted)
        if freed < wanted:
            raise OutOfMemory(message)
        log.warning(
            "out of memory (%s): dropped %d of this model's %d stored prefix bytes, scoring "
            "again without the prefix cache",
            message.strip().splitlines()[0] if message.strip() else "no message",
            freed,
            stored,
        )
        gc.collect()
        self._empty_device_cache()
        return call(None)

    def _torch_module(self) -> Any:
        if self._torch is None:
            import torch

            self._torch = torch
        return self._torch

    def _empty_device_cache(self) -> None:
        if str(self.scoring_model.info.device).startswith("cuda"):
            self._torch_module().cuda.empty_cache()

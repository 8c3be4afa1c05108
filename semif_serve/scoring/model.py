"""`ScoringModel`: a loaded causal LM, its tokenizer, and the `model` block results report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from semif_serve.scoring.prompt import ChatTokenizer


@dataclass(frozen=True)
class ModelInfo:
    """Where the weights came from and how they run: `source` and `revision` pin them exactly.
    `attention` is the attention implementation the model was loaded with (its config's
    `_attn_implementation`, as SemIf reports it); results report it, the identity does not."""

    source: str
    revision: str
    dtype: str
    device: str
    attention: str = "sdpa"  # transformers' default; `loading.load_model` sets the real one

    def identity(self) -> dict[str, str]:
        """Which weights, and how they run (what /health reports)."""
        return {
            "source": self.source,
            "revision": self.revision,
            "dtype": self.dtype,
            "device": self.device,
        }

    def as_dict(self) -> dict[str, str]:
        """The `model` block of every result: the identity, the attention implementation and
        the library versions."""
        import torch
        import transformers

        return {
            **self.identity(),
            "attention": self.attention,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
        }


@dataclass(frozen=True)
class ScoringModel:
    """What both scorers read: `model` is a transformers *ForCausalLM in eval mode, of a class
    whose final logits every scoring path reproduces (`head.UnsupportedModel` otherwise). On
    the CPU it runs batch-invariant numerics (`invariant.install`), so every path gives a row
    the same bits; `invariant=False` keeps the stock kernels (tests of those paths, and the
    bench that measures what invariance costs)."""

    model: Any
    tokenizer: ChatTokenizer
    info: ModelInfo
    invariant: bool = True

    def __post_init__(self) -> None:
        from semif_serve.scoring import invariant  # torch: only with a real model
        from semif_serve.scoring.head import check_supported

        check_supported(self.model)  # at load, not at the first batched or cached call
        if self.invariant:
            invariant.install(self.model)

    @property
    def device(self):
        return self.model.device

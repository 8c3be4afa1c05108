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
    whose final logits every scoring path reproduces (`head.UnsupportedModel` otherwise)."""

    model: Any
    tokenizer: ChatTokenizer
    info: ModelInfo

    def __post_init__(self) -> None:
        from semif_serve.scoring.head import check_supported  # torch: only with a real model

        check_supported(self.model)  # at load, not at the first batched or cached call

    @property
    def device(self):
        return self.model.device

"""The model's own final logits for the option letters, from its decoder's hidden states.

A causal LM's forward applies the output embedding and then, in some architectures,
post-processes the logits. Every scoring path (direct, a batch's padded forward, the shared
forwards, a resumed prefill) runs the decoder itself and reads its letters through
`letter_logits`, which applies the output embedding and the same post-processing in float32,
so a row's numbers never depend on the path it took. What each architecture's forward
does after `lm_head`, read from transformers' own `*ForCausalLM.forward`:
- Cohere: `logits * model.logit_scale`;
- Granite: `logits / config.logits_scaling`;
- Gemma2, Gemma3 (text): `tanh(logits / cap) * cap`, cap = `config.final_logit_softcapping`
  (None: none);
- Llama, Mistral, Qwen2, Qwen3, Qwen3.5, Phi3, Gemma: nothing.
What happens before `lm_head` (Gemma's sqrt(hidden_size) embedding scale, Granite's multipliers)
is the decoder's own, which every path runs whole. Any other class is refused when it is wrapped
(`check_supported`, from `ScoringModel`): its forward may do what this module does not, and its
batched, shared or cached results could then differ from its direct ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from semif_serve.scoring.prompt import EncodedPrompt


class UnsupportedModel(ValueError):
    """The model's forward is not one whose final logits every scoring path reproduces."""


def _unchanged(model: Any, logits: torch.Tensor) -> torch.Tensor:
    return logits


def _scaled(model: Any, logits: torch.Tensor) -> torch.Tensor:
    return logits * model.logit_scale  # the attribute CohereForCausalLM.forward reads


def _divided(model: Any, logits: torch.Tensor) -> torch.Tensor:
    return logits / model.config.logits_scaling  # a division, as Granite's (not a reciprocal)


def _soft_capped(model: Any, logits: torch.Tensor) -> torch.Tensor:
    return soft_cap(logits, model.config.final_logit_softcapping)


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma2/3's final soft-capping, in the order their forward computes it (None: off)."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


# The transformers classes whose forward is `lm_head` then exactly this.
POST_PROCESSING: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "LlamaForCausalLM": _unchanged,
    "MistralForCausalLM": _unchanged,
    "Qwen2ForCausalLM": _unchanged,
    "Qwen3ForCausalLM": _unchanged,
    "Qwen3_5ForCausalLM": _unchanged,
    "Phi3ForCausalLM": _unchanged,
    "GemmaForCausalLM": _unchanged,
    "CohereForCausalLM": _scaled,
    "GraniteForCausalLM": _divided,
    "Gemma2ForCausalLM": _soft_capped,
    "Gemma3ForCausalLM": _soft_capped,
}


def check_supported(model: Any) -> None:
    """UnsupportedModel unless `model` is an instance of exactly one of the transformers classes
    in POST_PROCESSING (a subclass or a same-named class elsewhere may override `forward`)."""
    import transformers

    name = type(model).__name__
    if name in POST_PROCESSING and getattr(transformers, name, None) is type(model):
        return
    raise UnsupportedModel(
        f"{type(model).__module__}.{type(model).__qualname__} is not supported: semif-serve "
        "reproduces the final logits (logit scaling, soft-capping) of these transformers "
        f"classes only: {', '.join(POST_PROCESSING)}; this class's forward may change its "
        "logits in a way that its batched, shared and cached scoring would not reproduce"
    )


def letter_logits(
    model: Any, hidden: torch.Tensor, prompts: list[EncodedPrompt]
) -> list[torch.Tensor]:
    """Each row's option-letter logits (float32, option order, on the CPU) from its last hidden
    state, `hidden` (rows, hidden_size): the model's output embedding at that position, then its
    post-processing, on the letters only.

    In float32 whatever the model's dtype: a bfloat16 `lm_head` rounds each logit to 8 bits
    (0.0625 apart near 10), which moves the probabilities more than anything else in the
    forward. Each logit is one product summed over the hidden size on its own (not a matmul,
    whose kernel may round a row differently with another row count), so a row's letters never
    depend on the other rows; one gather and one copy to the CPU for all rows."""
    counts = [len(prompt.letter_token_ids) for prompt in prompts]
    widest = max(counts)
    padded = [ids + [0] * (widest - len(ids)) for ids in (p.letter_token_ids for p in prompts)]
    letters = hidden.new_tensor(padded, dtype=torch.long)  # on hidden's device
    # (rows, letters, hidden); the output embedding of every class in POST_PROCESSING has no bias
    weights = model.get_output_embeddings().weight[letters].float()
    gathered = (hidden.float()[:, None, :] * weights).sum(dim=-1)
    final = POST_PROCESSING[type(model).__name__](model, gathered).float().cpu()
    return [final[row, :count] for row, count in enumerate(counts)]

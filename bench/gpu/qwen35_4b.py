"""The model the GPU script measures when no snapshot is given: random weights with Qwen3.5-4B's
text config, bf16 on CUDA. bench/gpu/run.py scores it in-process; bench/gpu/serve_check.py saves
it as a snapshot for a real server."""

from __future__ import annotations

# Qwen3.5-4B's text model (the hub config's text part); linear-attention sizes are the
# Qwen3_5TextConfig defaults, as in the released checkpoints.
QWEN35_4B = dict(
    vocab_size=248320,
    hidden_size=2560,
    intermediate_size=9216,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    rope_theta=10_000_000,
    partial_rotary_factor=0.25,
    tie_word_embeddings=True,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)


def random_qwen35_4b():
    """A Qwen3_5ForCausalLM with Qwen3.5-4B's config and seed-0 random weights, bf16 on CUDA."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**{**QWEN35_4B, "layer_types": QWEN35_4B["layer_types"] * 8})
    torch.manual_seed(0)
    with torch.device("cuda"):
        return Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()

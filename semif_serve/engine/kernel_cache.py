"""Kernel caches that survive restarts: one folder for Triton, Inductor and CUDA's JIT cache.

On a GPU the first decision after a cold start spends tens of seconds compiling and autotuning
Triton kernels (flash-linear-attention's), and every new batch size autotunes again. Those results
can live on disk, but each library picks its own default folder: Triton `~/.triton/cache`,
Inductor a folder under `/tmp` (gone on reboot, and private to one run under systemd's
PrivateTmp), CUDA `~/.nv/ComputeCache`. `prepare` points them all at subfolders of one folder
before torch, triton or fla are imported:

- `TRITON_CACHE_DIR` = `triton/`: compiled Triton kernels (cubins, launchers) and, with
  autotune caching on, each tuned kernel's `*.autotune.json` timings;
- `TORCHINDUCTOR_CACHE_DIR` = `inductor/`: torch.compile's FX-graph, AOTAutograd and autotune
  caches (unused until the server compiles);
- `CUDA_CACHE_PATH` = `cuda/`: the driver's cache of PTX it compiled for this card;

and sets `TRITON_CACHE_AUTOTUNING=1`, so every `triton.autotune` kernel stores its timings there
(flash-linear-attention 0.5.2 already asks for that through its own `FLA_CACHE_RESULTS`, on by
default). The folder is `SEMIF_KERNEL_CACHE_DIR`, else `<SEMIF_CACHE_DIR>/kernels`, else
`~/.cache/semif-serve/kernels`. A variable the operator already set (non-empty) is left alone.

The caches hold code the process loads and runs, so their folders must be the process's own:
created 0700, and an existing one owned by someone else or writable by others is refused.
"""

from __future__ import annotations

import os
import stat
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from semif_serve.config import ConfigError

DEFAULT_CACHE_DIR = Path("~/.cache/semif-serve")
SUBFOLDERS = {
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "CUDA_CACHE_PATH": "cuda",
}
SWITCHES = {"TRITON_CACHE_AUTOTUNING": "1"}
FOLDER_MODE = 0o700


@dataclass(frozen=True)
class KernelCaches:
    """What `configure` decided: the root folder, the variables it set, those it left alone."""

    root: Path
    chosen: dict[str, str]
    kept: dict[str, str]

    def summary(self) -> str:
        chosen = ", ".join(f"{name}={value}" for name, value in self.chosen.items()) or "none"
        kept = ", ".join(f"{name}={value}" for name, value in self.kept.items()) or "none"
        return (
            f"semif-serve: kernel caches in {self.root}; set {chosen}; kept the operator's {kept}"
        )


def kernel_cache_root(environ: MutableMapping[str, str]) -> Path:
    """SEMIF_KERNEL_CACHE_DIR, else <SEMIF_CACHE_DIR or ~/.cache/semif-serve>/kernels."""
    explicit = environ.get("SEMIF_KERNEL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser().absolute()
    base = environ.get("SEMIF_CACHE_DIR") or DEFAULT_CACHE_DIR
    return (Path(base).expanduser() / "kernels").absolute()


def configure(environ: MutableMapping[str, str] | None = None) -> KernelCaches:
    """Point the unset cache variables of `environ` (default: os.environ) at subfolders of the
    kernel cache root, creating those folders; raise ConfigError when one is unusable."""
    env = os.environ if environ is None else environ
    root = kernel_cache_root(env)
    kept = {name: env[name] for name in [*SUBFOLDERS, *SWITCHES] if env.get(name)}
    chosen: dict[str, str] = {}
    if set(SUBFOLDERS) - set(kept):
        _own_folder(root)
    for name, subfolder in SUBFOLDERS.items():
        if name not in kept:
            _own_folder(root / subfolder)
            chosen[name] = str(root / subfolder)
    for name, value in SWITCHES.items():
        if name not in kept:
            chosen[name] = value
    env.update(chosen)
    return KernelCaches(root=root, chosen=chosen, kept=kept)


def prepare(stream: TextIO | None = None) -> KernelCaches | None:
    """`configure` the process environment and say on `stream` (stderr) what it did; None after
    saying why it could not. `semif-serve serve` calls it before anything imports torch."""
    import sys

    out = stream or sys.stderr
    try:
        caches = configure()
    except ConfigError as error:
        print(f"semif-serve: error: {error}", file=out, flush=True)
        return None
    print(caches.summary(), file=out, flush=True)
    return caches


def _own_folder(folder: Path) -> None:
    """Create `folder` and its missing parents with mode 0700, or check an existing one: a
    folder, owned by this user, not writable by group or others."""
    missing = [path for path in (folder, *folder.parents) if not path.exists()]
    try:
        for path in reversed(missing):
            try:
                path.mkdir(mode=FOLDER_MODE)
            except FileExistsError:  # another process made it meanwhile: checked below
                pass
        info = folder.stat()
    except OSError as error:
        raise ConfigError(
            f"SEMIF_KERNEL_CACHE_DIR: cannot create {folder}: {error.strerror or error}"
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"SEMIF_KERNEL_CACHE_DIR: {folder} is not a folder")
    if info.st_uid != os.getuid():
        raise ConfigError(
            f"SEMIF_KERNEL_CACHE_DIR: {folder} belongs to uid {info.st_uid}, not this user "
            f"({os.getuid()}); cached kernels are code this process runs"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"SEMIF_KERNEL_CACHE_DIR: {folder} is writable by others "
            f"(mode {stat.S_IMODE(info.st_mode):04o}); cached kernels are code this process runs"
        )

"""A converted snapshot's manifest: every file's size and sha256, checked at every load.

A conversion writes its files aside, then this manifest as its completion marker, last, then
renames the folder into place, so a folder with a readable manifest is a complete conversion.
At load each listed file's size, then its sha256, is compared with the manifest (about 0.3 s for
SmolLM2's 538 MB of float32 weights, read once more from the page cache the load then reads):
a zeroed block or a flipped byte anywhere in any file is a mismatch, and so is a listed file
that is gone or a file the manifest does not list. The manifest's own digest (`digest`) is part
of the revision, so results name the snapshot that was loaded, not only what it came from.

What is not caught: a file changed between this check and the read that follows it (the loader
compares the files' sizes and modification times before and after it reads them, so a copy still
being written is caught there), and weights damaged in memory after the load (a file changed
on disk after the load changes nothing served: the loader copies the CPU weights into the
process's own memory, `loading.held_privately`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MARKER = "semif-snapshot-complete"  # the manifest is the completion marker
FORMAT = "semif-snapshot-manifest/1"
BLOCK = 1 << 22


class ManifestError(ValueError):
    """A marker that is not a manifest of this format: damaged, or (`OlderMarker`) the line of
    text an older semif-serve wrote as its completion marker."""


class OlderMarker(ManifestError):
    """The completion marker of a semif-serve from before manifests: no manifest to check by."""


OLDER_MARKER = "converted from "  # how those markers begin (`converted from <gguf path>`)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def listed_files(folder: Path) -> list[str]:
    """The files a manifest covers: every file under `folder`, at any depth, hidden ones
    included ('/'-separated paths relative to it), but the marker and its copy being written:
    whatever a loader may read is checked, and a file added anywhere is a difference. Folders
    linked from inside are not walked (a link loop never ends the walk)."""
    own = {MARKER, f".{MARKER}.writing"}
    names = []
    for parent, _, files in os.walk(folder):
        for file in files:
            path = Path(parent, file)
            name = path.relative_to(folder).as_posix()
            if path.is_file() and name not in own:
                names.append(name)
    return sorted(names)


def build(folder: Path, **about: str) -> dict[str, Any]:
    """The manifest of `folder` as it is now; `about` says where it came from (kept as written)."""
    files = {
        name: {"size": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
        for name in listed_files(folder)
    }
    return {"format": FORMAT, **about, "files": files}


def write(folder: Path, manifest: dict[str, Any]) -> None:
    """Write the marker atomically (aside, then renamed): it is there whole or not at all."""
    aside = folder / f".{MARKER}.writing"
    aside.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(aside, folder / MARKER)


def read(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest; None when it has no marker; OlderMarker when an older
    semif-serve's line of text is there; ManifestError when the marker is damaged (not JSON,
    another format, its files listed badly): a damaged snapshot, never one to load unchecked."""
    try:
        text = (folder / MARKER).read_text(errors="replace")
    except FileNotFoundError:
        return None
    if text.startswith(OLDER_MARKER) and text.count("\n") <= 1:
        raise OlderMarker(f"{MARKER} is an older semif-serve's marker, not a manifest")
    try:
        manifest = json.loads(text)
    except ValueError:
        raise ManifestError(f"{MARKER} is damaged (not a JSON manifest)") from None
    if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT):
        raise ManifestError(f"{MARKER} is not a {FORMAT} manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(entry, dict)
        and isinstance(entry.get("size"), int)
        and isinstance(entry.get("sha256"), str)
        for entry in files.values()
    ):
        raise ManifestError(f"{MARKER} lists its files badly")
    return manifest


def digest(manifest: dict[str, Any]) -> str:
    """16 hex digits naming the files a manifest lists (names, sizes, sha256s), nothing else."""
    lines = "".join(
        f"{name}\0{entry['size']}\0{entry['sha256']}\n"
        for name, entry in sorted(manifest["files"].items())
    )
    return hashlib.sha256(lines.encode()).hexdigest()[:16]


def size_problems(listed: dict[str, dict[str, Any]], present: dict[str, int]) -> list[str]:
    """What differs between the manifest's files and the folder's (name -> size), sizes only:
    one line per file gone, resized or not listed, in name order."""
    problems = []
    for name in sorted(set(listed) | set(present)):
        if name not in present:
            problems.append(f"{name} is missing")
        elif name not in listed:
            problems.append(f"{name} is not in the manifest")
        elif present[name] != listed[name]["size"]:
            problems.append(f"{name} has {present[name]} bytes, not {listed[name]['size']}")
    return problems


def problems(
    folder: Path, manifest: dict[str, Any], names: Iterable[str] | None = None
) -> list[str]:
    """Every way `folder` differs from `manifest` (empty: it is what was written); `names`:
    only those files (what a check that reads no weights reads, the config, before it reads
    it). Sizes are compared first; only files of the right size are hashed."""
    listed = manifest["files"]
    present = {name: (folder / name).stat().st_size for name in listed_files(folder)}
    if names is not None:
        listed = {name: entry for name, entry in listed.items() if name in names}
        present = {name: size for name, size in present.items() if name in names}
    found = size_problems(listed, present)
    for name in sorted(set(listed) & set(present)):
        if present[name] == listed[name]["size"]:
            sha256 = file_sha256(folder / name)
            if sha256 != listed[name]["sha256"]:
                expected = listed[name]["sha256"]
                found.append(f"{name} has sha256 {sha256[:16]}..., not {expected[:16]}...")
    return sorted(found)

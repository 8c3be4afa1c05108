"""A damaged converted snapshot of the real SmolLM2 is never served (issue 30, item 8): its
manifest finds the damage at the next load, which converts it again from the GGUF (a local
folder carrying a manifest is refused instead, naming the file). Each test damages a copy of the
session's converted snapshot, never the snapshot itself; the marker and the files' modification
times are left as they were, so only the contents tell."""

import logging
import os
import shutil

import pytest
from fakes import AUTH, row
from live_server import LiveServer, real_env, semif_serve_command
from rows_factory import STATE
from test_snapshot_manifest import flip_byte, zero_block

from semif_serve.engine import builtin, snapshot_manifest
from semif_serve.engine.loading import ModelLoadError, inspect_source, load_model
from semif_serve.scoring import score

pytestmark = pytest.mark.slow

EIGHT_MB = 8 << 20
DECISION = {**row("plain", ("Yes, it concerns the printer", "No")), "state": STATE}


@pytest.fixture(scope="module")
def pristine(smollm2, builtin_cache):
    """The session's converted snapshot (the smollm2 fixture converted it); read only."""
    folder, revision = builtin.snapshot(builtin.SMOLLM2, cache_dir=builtin_cache, convert=False)
    assert folder is not None and revision == smollm2.info.revision
    return folder


@pytest.fixture(scope="module")
def undamaged(smollm2):
    """What the undamaged snapshot answers to DECISION."""
    return probabilities(smollm2)


@pytest.fixture
def copies(tmp_path):
    """Folders under tmp_path holding copies of the 538 MB snapshot, removed after the test."""
    yield tmp_path
    for entry in tmp_path.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)


def cache_copy(pristine, root):
    """A semif-serve cache folder whose built-in snapshot is a copy of `pristine`."""
    folder = root / "builtin" / "smollm2-135m" / pristine.name
    shutil.copytree(pristine, folder)
    return root, folder


def probabilities(model, decision=DECISION):
    asked = {key: decision[key] for key in ("id", "state", "question", "options")}
    return score(model, asked, max_tokens=4096)["probabilities"]


def test_the_snapshot_s_manifest_lists_its_files_and_its_digest_is_in_the_revision(
    pristine, smollm2
):
    manifest = snapshot_manifest.read(pristine)
    assert set(manifest["files"]) == set(snapshot_manifest.listed_files(pristine))
    assert "model.safetensors" in manifest["files"] and "tokenizer.json" in manifest["files"]
    assert snapshot_manifest.problems(pristine, manifest) == []
    assert smollm2.info.revision.endswith(f";snapshot-sha256={snapshot_manifest.digest(manifest)}")


def test_a_one_byte_flip_is_converted_again_and_scores_as_before(
    pristine, smollm2, undamaged, copies, monkeypatch, caplog
):
    cache, folder = cache_copy(pristine, copies / "cache")
    weights = folder / "model.safetensors"
    flip_byte(weights, weights.stat().st_size // 2)
    converted = []

    def dequantise(gguf, work):  # the 20 s conversion's files, as the real one wrote them
        converted.append(gguf)
        for name in snapshot_manifest.listed_files(pristine):
            shutil.copyfile(pristine / name, work / name)

    monkeypatch.setattr(builtin, "_dequantise", dequantise)
    with caplog.at_level(logging.WARNING, logger="semif_serve.engine.builtin"):
        loaded = load_model(builtin.SMOLLM2, cache_dir=cache)
    assert converted == [builtin.gguf_path()]
    (warning,) = caplog.records
    assert "model.safetensors has sha256" in warning.getMessage()
    assert loaded.info.revision == smollm2.info.revision
    assert probabilities(loaded) == undamaged


def test_a_copied_snapshot_zeroed_in_the_middle_is_refused_naming_the_file(
    pristine, undamaged, copies
):
    folder = copies / "models" / "smol"
    shutil.copytree(pristine, folder)
    zero_block(folder / "model.safetensors", EIGHT_MB)
    with pytest.raises(ModelLoadError, match="model.safetensors has sha256 .*copy it again"):
        load_model(str(folder))
    # Guards the check above: without a manifest the same folder loads, and answers otherwise.
    (folder / snapshot_manifest.MARKER).unlink()
    assert probabilities(load_model(str(folder))) != pytest.approx(undamaged, abs=1e-3)


def truncated_config(folder):
    config = folder / "config.json"
    config.write_bytes(config.read_bytes()[:10])


@pytest.mark.server
@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (
            lambda folder: zero_block(folder / "model.safetensors", EIGHT_MB),
            "model.safetensors has sha256",
        ),
        # Issue 43, finding 3: the start-up check read this config before the manifest was
        # checked, and the server exited 2 instead of converting again.
        (truncated_config, "config.json has 10 bytes"),
    ],
)
def test_a_server_on_a_damaged_snapshot_converts_it_again_and_serves_the_right_numbers(
    pristine, smollm2, undamaged, copies, damage, said
):
    """The operator's fault test: 8 MB zeroed in the middle of model.safetensors (or its config
    cut short), its marker intact. The server converts again from the GGUF (the real
    conversion), saying so in one line, and answers what the undamaged snapshot answers, under
    the undamaged revision."""
    cache, folder = cache_copy(pristine, copies / "cache")
    damage(folder)
    with LiveServer(semif_serve_command(), real_env(cache), copies / "server.log") as server:
        status, health, _ = server.request("GET", "/health")
        assert status == 200 and health["model"]["revision"] == smollm2.info.revision
        status, decided, _ = server.request("POST", "/decide", DECISION, AUTH)
        assert status == 200, decided
        assert decided["model"]["revision"] == smollm2.info.revision
        assert decided["probabilities"] == pytest.approx(undamaged, abs=1e-6)
        log = server.log_text()
    warnings = [line for line in log.splitlines() if "converting it again" in line]
    assert len(warnings) == 1 and said in warnings[0], log
    assert snapshot_manifest.problems(folder, snapshot_manifest.read(folder)) == []


def cut_in_half(path):
    data = path.read_bytes()
    path.unlink()  # a link to the pristine file: the copy is written anew, never through it
    path.write_bytes(data[: len(data) // 2])


def only_the_marker(folder):
    for path in folder.iterdir():
        if path.name != snapshot_manifest.MARKER:
            path.unlink()


SMALL_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
]
DAMAGES = {
    **{
        f"{name} cut in half": (lambda folder, name=name: cut_in_half(folder / name), name)
        for name in SMALL_FILES
    },
    "model.safetensors missing": (
        lambda folder: (folder / "model.safetensors").unlink(),
        "model.safetensors",
    ),
    "only the marker left": (only_the_marker, "config.json"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_every_file_of_the_snapshot_damaged_passes_the_start_up_check_and_is_converted_again(
    pristine, copies, monkeypatch, caplog, damage
):
    """Issue 43, finding 3, for each file the loader reads: the start-up check (which reads the
    config) never trips over a damaged file before the manifest check; the load converts the
    snapshot again (one warning naming the file) and the new one passes its manifest."""
    cache, folder = copies, copies / "builtin" / "smollm2-135m" / pristine.name
    folder.mkdir(parents=True)
    for path in pristine.iterdir():  # hard links: no 538 MB copy per case
        os.link(path, folder / path.name)
    harm, named = DAMAGES[damage]
    harm(folder)
    # The start-up check raises nothing (before: a cut config exited 2): the load repairs it.
    inspect_source(builtin.SMOLLM2, cache_dir=cache)
    converted = []

    def dequantise(gguf, work):
        converted.append(gguf)
        for name in snapshot_manifest.listed_files(pristine):
            os.link(pristine / name, work / name)

    monkeypatch.setattr(builtin, "_dequantise", dequantise)
    with caplog.at_level(logging.WARNING, logger="semif_serve.engine.builtin"):
        again, revision = builtin.snapshot(builtin.SMOLLM2, cache_dir=cache)
    assert converted == [builtin.gguf_path()] and again == folder
    (warning,) = caplog.records
    assert "converting it again" in warning.getMessage() and named in warning.getMessage()
    assert snapshot_manifest.problems(folder, snapshot_manifest.read(folder)) == []
    assert revision == builtin.snapshot(builtin.SMOLLM2, cache_dir=cache, convert=False)[1]

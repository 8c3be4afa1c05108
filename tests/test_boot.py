"""Fail-closed startup (INV-3) and the VRAM cap before the load (INV-4), against a fake torch;
and an injected OOM on the real CPU engine with the built-in model."""

import pytest
import torch
from fake_torch import GIB, FakeTorch
from fakes import AUTH, row, settings
from falcon import testing

from semif_serve.engine.boot import StartupError, TorchScorer, build_engine, missing_fast_kernels
from semif_serve.engine.engine import Engine
from semif_serve.http import create_app
from semif_serve.runtime.service import DecisionService
from semif_serve.server import build_runtime


def loader(scoring_model, fake=None, seen=None):
    def load(source, revision, **kwargs):
        if seen is not None:
            seen.append(fake.cuda.fraction)
        return scoring_model

    return load


def gpu_settings(**overrides):
    return settings(
        **{"device": "cuda", "dtype": "float32", "require_fast_kernels": False, **overrides}
    )


def test_a_cuda_device_with_a_listed_arch_warms_up_and_records_the_baseline(tiny_qwen):
    fake = FakeTorch(capability=(9, 0), arch_list=["sm_80", "sm_90"])
    fake.cuda.reserved = 3 * GIB
    engine = build_engine(gpu_settings(), torch_module=fake, load=loader(tiny_qwen))
    assert engine.baseline_reserved == 3 * GIB


def test_no_cuda_device_refuses_to_start_and_names_the_cpu_escape(tiny_qwen):
    with pytest.raises(StartupError, match="torch sees no CUDA device; set SEMIF_DEVICE=cpu"):
        build_engine(
            gpu_settings(), torch_module=FakeTorch(available=False), load=loader(tiny_qwen)
        )


def test_a_card_missing_from_the_arch_list_refuses_to_start(tiny_qwen):
    fake = FakeTorch(capability=(12, 0), arch_list=["sm_80", "sm_90"])
    with pytest.raises(
        StartupError, match="is sm_120, which this torch build has no kernels for .*sm_80, sm_90"
    ):
        build_engine(gpu_settings(), torch_module=fake, load=loader(tiny_qwen))


def test_the_cpu_is_used_only_when_asked_for_and_then_skips_the_gpu_checks(tiny_qwen):
    class NoCuda:
        OutOfMemoryError = torch.OutOfMemoryError

        @property
        def cuda(self):
            raise AssertionError("touched torch.cuda on the CPU")

    engine = build_engine(
        settings(device="cpu", dtype="float32"), torch_module=NoCuda(), load=loader(tiny_qwen)
    )
    assert engine.baseline_reserved is None
    from semif_serve.config import Settings

    assert Settings.from_env({"SEMIF_API_TOKEN": "k" * 32}).device == "cuda"  # never a silent CPU


def test_the_vram_cap_is_set_before_the_model_loads(tiny_qwen):
    fake = FakeTorch(total=80 * GIB)
    seen = []
    build_engine(
        gpu_settings(vram_cap_gib=20.0), torch_module=fake, load=loader(tiny_qwen, fake, seen)
    )
    assert seen == [0.25]


def test_no_cap_sets_no_fraction_and_a_cap_over_the_card_refuses_to_start(tiny_qwen):
    fake = FakeTorch(total=80 * GIB)
    build_engine(gpu_settings(), torch_module=fake, load=loader(tiny_qwen))
    assert fake.cuda.fraction is None
    with pytest.raises(
        StartupError, match="SEMIF_VRAM_CAP_GIB=81.0 is more than the card's 80.0 GiB"
    ):
        build_engine(gpu_settings(vram_cap_gib=81.0), torch_module=fake, load=loader(tiny_qwen))


def test_a_failing_warm_up_stops_startup(tiny_qwen):
    broken = type(tiny_qwen)(
        model=tiny_qwen.model, tokenizer=tiny_qwen.tokenizer, info=tiny_qwen.info
    )
    object.__setattr__(broken, "model", None)  # past the load's checks: its first call fails
    with pytest.raises(StartupError, match="the warm-up decision failed"):
        build_engine(gpu_settings(), torch_module=FakeTorch(), load=loader(broken))


def test_a_load_failure_stops_startup():
    def load(*args, **kwargs):
        raise OSError("no weights here")

    with pytest.raises(StartupError, match="cannot load model 'default' .*no weights here"):
        build_engine(gpu_settings(), torch_module=FakeTorch(), load=load)


def test_missing_fast_kernels_fail_closed_naming_the_packages(tiny_qwen):
    with pytest.raises(StartupError, match="flash-linear-attention, causal-conv1d not usable"):
        build_engine(
            gpu_settings(require_fast_kernels=True),
            torch_module=FakeTorch(),
            load=loader(tiny_qwen),
        )


def test_fast_kernels_matter_only_for_linear_attention_models(tiny_qwen, smollm2):
    none_there = {"flash-linear-attention": False, "causal-conv1d": False}
    assert missing_fast_kernels(tiny_qwen.model.config, none_there) == [
        "flash-linear-attention",
        "causal-conv1d",
    ]
    assert (
        missing_fast_kernels(
            tiny_qwen.model.config, {"flash-linear-attention": True, "causal-conv1d": True}
        )
        == []
    )
    assert missing_fast_kernels(smollm2.model.config, none_there) == []


def test_fast_kernels_are_required_by_default_on_cuda_only():
    from semif_serve.config import Settings

    base = {"SEMIF_API_TOKEN": "k" * 32}
    assert Settings.from_env(base).require_fast_kernels is True
    assert Settings.from_env({**base, "SEMIF_DEVICE": "cpu"}).require_fast_kernels is False
    assert (
        Settings.from_env({**base, "SEMIF_REQUIRE_FAST_KERNELS": "0"}).require_fast_kernels is False
    )


@pytest.mark.slow
def test_an_injected_oom_on_the_real_cpu_engine_is_503_and_the_next_request_succeeds(
    smollm2, monkeypatch
):
    config = settings(device="cpu", dtype="float32")
    runtime = build_runtime(
        config, lambda spec: Engine(TorchScorer(smollm2, config.max_tokens), torch_module=torch)
    )
    runtime.start(idle_interval_s=None)
    api = testing.TestClient(create_app(DecisionService(runtime, config), config))
    decoder = smollm2.model.get_decoder()  # what every scoring path calls
    real_forward = decoder.forward
    calls = []

    def forward_once_oom(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(decoder, "forward", forward_once_oom)
    failed = api.simulate_post("/decide", json=row(), headers=AUTH)
    assert failed.status_code == 503 and failed.json["error"]["code"] == "out_of_memory"
    assert "Tried to allocate" in failed.json["error"]["message"]
    recovered = api.simulate_post("/decide", json=row(), headers=AUTH)
    assert recovered.status_code == 200 and recovered.json["prompt_version"] == "direct-options-v1"


def test_capacity_is_the_decisions_that_fit_beside_the_model_clamped_to_1_16():
    from semif_serve.engine.boot import derive_capacity

    assert derive_capacity(10 * GIB, 4 * GIB, 2 * GIB) == 3
    assert derive_capacity(10 * GIB, 4 * GIB, 7 * GIB) == 1  # never below one slot
    assert derive_capacity(100 * GIB, 1 * GIB, 0.1 * GIB) == 16
    assert derive_capacity(10 * GIB, 4 * GIB, 0) == 16


def test_gpu_capacity_scales_the_warm_up_peak_to_max_tokens(tiny_qwen):
    fake = FakeTorch(total=80 * GIB)
    fake.cuda.allocated = fake.cuda.reserved = 2 * GIB
    real_score = TorchScorer.score

    def score_with_peak(self, row):
        result = real_score(self, row)
        fake.cuda.peak_allocated = fake.cuda.allocated + result["input_tokens"] * (
            1 << 20
        )  # 1 MiB/token
        return result

    TorchScorer.score = score_with_peak
    try:
        engine = build_engine(
            gpu_settings(vram_cap_gib=12.0, max_tokens=2048),
            torch_module=fake,
            load=loader(tiny_qwen),
        )
    finally:
        TorchScorer.score = real_score
    # 2 GiB per max_tokens decision (2048 tokens x 1 MiB) beside a 2 GiB baseline, in 12 GiB.
    assert engine.max_parallel_slots == 5


def test_cpu_capacity_comes_from_the_memory_budget(smollm2):
    from semif_serve.engine.boot import kv_bytes_per_token, parameter_bytes

    # SmolLM2-135M: 30 layers x 3 kv heads x 64 dims x 2 (k, v) x 4 bytes = 46,080 bytes a token.
    assert kv_bytes_per_token(smollm2.model) == 46080
    assert 500e6 < parameter_bytes(smollm2.model) < 600e6
    config = settings(device="cpu", dtype="float32", memory_budget_gib=1.0, max_tokens=4096)
    engine = build_engine(config, torch_module=torch, load=loader(smollm2))
    per_decision = 46080 * 4096 * 2
    assert engine.max_parallel_slots == min(
        16, int((GIB - parameter_bytes(smollm2.model)) // per_decision)
    )

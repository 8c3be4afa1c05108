"""boot.py's checks and arithmetic against a fake torch and a fake model: fast enough for the
mutation grid (tests/test_boot.py runs the same paths on real models).

The device and VRAM-cap checks, the load and warm-up failures, the fast-kernel check, the
engine's slots and lock, its resident bytes and its capacity on a GPU (the warm-up's peak scaled
to max_tokens) and on the CPU (the attention cache), and `check_source`, a reconfigure's check.
"""

import threading
from types import SimpleNamespace

import pytest
import torch
from fake_torch import GIB, MIB, FakeCuda, FakeTorch
from fakes import settings

from semif_serve.engine import boot, warmup
from semif_serve.engine.boot import (
    StartupError,
    TorchScorer,
    apply_vram_cap,
    build_engine,
    check_device,
    check_source,
    derive_capacity,
    kv_bytes_per_token,
    missing_fast_kernels,
    parameter_bytes,
    resident_difference,
    resolve_device,
)
from semif_serve.errors import BadManagementRequest
from semif_serve.runtime.specs import parse_spec
from semif_serve.scoring import ModelInfo
from semif_serve.scoring.prefix_cache import PrefixCache


class FakeParameter:
    def __init__(self, count, size):
        self.count, self.size = count, size

    def numel(self):
        return self.count

    def element_size(self):
        return self.size


class FakeModel:
    def __init__(self, **config):
        defaults = {
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "hidden_size": 256,
            "layer_types": None,
        }
        self.config = SimpleNamespace(**{**defaults, **config})
        self.weights = [FakeParameter(1000, 4), FakeParameter(500, 2)]  # 5000 bytes

    def parameters(self):
        return iter(self.weights)


class DeviceCuda(FakeCuda):
    """Records the device each device-specific call names."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.devices: list[tuple[str, object]] = []

    def _seen(self, name, device):
        self.devices.append((name, device))

    def get_device_capability(self, device=None):
        self._seen("capability", device)
        return super().get_device_capability(device)

    def get_device_properties(self, device=None):
        self._seen("properties", device)
        return super().get_device_properties(device)

    def set_per_process_memory_fraction(self, fraction, device=None):
        self._seen("fraction", device)
        super().set_per_process_memory_fraction(fraction, device)

    def memory_allocated(self, device=None):
        self._seen("allocated", device)
        return super().memory_allocated(device)

    def max_memory_allocated(self, device=None):
        self._seen("peak", device)
        return super().max_memory_allocated(device)

    def reset_peak_memory_stats(self, device=None):
        self._seen("reset", device)
        super().reset_peak_memory_stats(device)


def device_torch(**cuda):
    fake = FakeTorch()
    fake.cuda = DeviceCuda(**cuda)
    return fake


def scoring_model(**config):
    info = ModelInfo(source="fake", revision="0", dtype="float32", device="cpu")
    return SimpleNamespace(model=FakeModel(**config), tokenizer=None, info=info)


class Loads:
    """A `load` that records its arguments and returns (or raises) what it was given."""

    def __init__(self, result):
        self.result, self.calls = result, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.fixture
def warm_up(monkeypatch):
    """The warm-up decision: `input_tokens` tokens; on a GPU it raises the peak by `peak`."""
    plan = SimpleNamespace(
        input_tokens=100, peak=100 * MIB, fake=None, error=None, calls=0, seen=None
    )

    def score(self, row):
        plan.calls += 1
        plan.seen = (self.scoring_model, self.max_tokens, row.id)
        if plan.error is not None:
            raise plan.error
        if plan.fake is not None:
            cuda = plan.fake.cuda
            cuda.peak_allocated = max(cuda.peak_allocated, cuda.allocated + plan.peak)
        return {"input_tokens": plan.input_tokens}

    def warm_up_shapes(scoring_model, **kwargs):
        """The shape warm-up (semif_serve.engine.warmup): recorded; returns `plan.shapes`."""
        plan.shape_calls.append((scoring_model, kwargs))
        return plan.shapes

    plan.shapes, plan.shape_calls = None, []
    monkeypatch.setattr(TorchScorer, "score", score)
    monkeypatch.setattr(warmup, "warm_up_shapes", warm_up_shapes)
    return plan


def gpu(**overrides):
    return settings(**{"device": "cuda", "require_fast_kernels": False, **overrides})


def model_spec(config, **table):
    return parse_spec("m", {"source": "acme/m", "revision": "r", **table}, config)


# --- devices and the VRAM cap ----------------------------------------------------------------------


def test_the_cpu_needs_no_torch_and_cuda_needs_a_device_in_the_arch_list():
    check_device("cpu", None)
    check_device("cuda:1", FakeTorch(capability=(8, 0), arch_list=["sm_80"]))
    with pytest.raises(StartupError) as caught:
        check_device("cuda", FakeTorch(available=False))
    assert str(caught.value) == (
        "SEMIF_DEVICE=cuda but torch sees no CUDA device; set SEMIF_DEVICE=cpu to serve on the "
        "CPU on purpose"
    )
    with pytest.raises(StartupError) as caught:
        check_device("cuda:0", FakeTorch(capability=(12, 0), arch_list=["sm_80", "sm_90"]))
    assert str(caught.value) == (
        "the GPU on cuda:0 is sm_120, which this torch build has no kernels for "
        "(arch list: sm_80, sm_90)"
    )
    with pytest.raises(StartupError, match=r"\(arch list: empty\)$"):
        check_device("cuda", FakeTorch(arch_list=[]))


def test_the_vram_cap_is_a_fraction_of_the_card_up_to_all_of_it():
    fake = FakeTorch(total=80 * GIB)
    assert apply_vram_cap(None, "cuda:0", fake) is None and fake.cuda.fraction is None
    assert apply_vram_cap(20.0, "cpu", fake) is None and fake.cuda.fraction is None
    assert apply_vram_cap(20.0, "cuda:0", fake) == 0.25 and fake.cuda.fraction == 0.25
    assert apply_vram_cap(80.0, "cuda:0", fake) == 1.0
    with pytest.raises(StartupError) as caught:
        apply_vram_cap(80.5, "cuda:0", fake)
    assert str(caught.value) == "SEMIF_VRAM_CAP_GIB=80.5 is more than the card's 80.0 GiB"
    assert fake.cuda.fraction == 1.0  # the refused cap was not set


def test_the_fake_torch_refuses_an_index_less_device_for_the_cap_as_torch_does():
    # The H200 defect: torch.cuda.set_per_process_memory_fraction(f, "cuda") raises ValueError.
    # The fake must refuse it too, or no test could catch a caller passing "cuda" again.
    with pytest.raises(ValueError, match="with a specified index or an integer, but got:cuda"):
        apply_vram_cap(20.0, "cuda", FakeTorch(total=80 * GIB))
    # What the real set_per_process_memory_fraction calls on its device (after CUDA init, so
    # the function itself cannot run here): it refuses "cuda" with the same message.
    with pytest.raises(ValueError, match="with a specified index or an integer, but got:cuda"):
        torch._utils._get_device_index("cuda")
    assert torch._utils._get_device_index("cuda:1") == 1


def test_cuda_resolves_once_to_the_current_device_and_an_index_must_be_visible():
    fake = FakeTorch(count=4, current=2)
    assert resolve_device("cuda", fake) == "cuda:2"
    assert resolve_device("cuda:3", fake) == "cuda:3"
    assert resolve_device("cpu", fake) == "cpu"
    assert resolve_device("cuda", FakeTorch(available=False)) == "cuda"  # check_device refuses
    with pytest.raises(StartupError) as caught:
        resolve_device("cuda:4", fake)
    assert str(caught.value) == (
        "SEMIF_DEVICE=cuda:4 but torch sees 4 CUDA device(s) (cuda:0..cuda:3); "
        "check CUDA_VISIBLE_DEVICES"
    )


def test_the_default_device_with_a_cap_starts_and_torch_only_sees_the_resolved_index(warm_up):
    fake = device_torch(count=2, current=1, total=80 * GIB)
    warm_up.fake = fake
    model = scoring_model()
    load = Loads(model)
    engine = build_engine(gpu(vram_cap_gib=40.0), torch_module=fake, load=load)
    assert fake.cuda.fraction == 0.5 and fake.cuda.fraction_device == 1
    assert load.calls[0][1]["device"] == "cuda:1"
    assert {device for _, device in fake.cuda.devices} == {"cuda:1"}
    assert engine.on_gpu and engine.baseline_reserved == 0


def test_fast_kernels_are_needed_only_by_linear_attention_layers():
    none_there = {"flash-linear-attention": False, "causal-conv1d": False}
    assert missing_fast_kernels(SimpleNamespace(), none_there) == []
    assert missing_fast_kernels(SimpleNamespace(layer_types=None), none_there) == []
    full = SimpleNamespace(layer_types=["full_attention"])
    assert missing_fast_kernels(full, none_there) == []
    linear = SimpleNamespace(layer_types=["linear_attention", "full_attention"])
    assert missing_fast_kernels(linear, none_there) == ["flash-linear-attention", "causal-conv1d"]
    assert missing_fast_kernels(linear, {"causal-conv1d": True}) == ["flash-linear-attention"]
    assert missing_fast_kernels(linear, {"flash-linear-attention": True}) == ["causal-conv1d"]


# --- build_engine ----------------------------------------------------------------------------------


def test_the_default_spec_is_loaded_with_its_settings(warm_up, tmp_path):
    config = settings(cache_dir=tmp_path, revision="r" * 40, dtype="bfloat16")
    load = Loads(scoring_model())
    engine = build_engine(config, torch_module=FakeTorch(), load=load)
    assert load.calls == [
        ((config.model, "r" * 40), {"dtype": "bfloat16", "device": "cpu", "cache_dir": tmp_path})
    ]
    assert engine.max_parallel_slots == 16 and engine.resident_bytes == 5000
    assert engine.baseline_reserved is None and warm_up.calls == 1


@pytest.mark.parametrize("cap_gib", [None, 40.0])
def test_a_given_spec_is_loaded_and_measured_on_its_device_in_its_dtype(warm_up, cap_gib):
    fake = device_torch(count=2)
    warm_up.fake = fake
    config = gpu(vram_cap_gib=cap_gib)
    model = scoring_model()
    load = Loads(model)
    spec = model_spec(config, dtype="float16", device="cuda:1", max_tokens=777)
    build_engine(config, spec, fake, load)
    assert load.calls == [
        (("acme/m", "r"), {"dtype": "float16", "device": "cuda:1", "cache_dir": None})
    ]
    assert warm_up.seen == (model, 777, "warm-up")
    names = {name for name, _ in fake.cuda.devices}
    assert names >= {"capability", "properties", "allocated", "peak", "reset"}
    assert ("fraction" in names) == (cap_gib is not None)
    assert {device for _, device in fake.cuda.devices} == {"cuda:1"}


def test_the_device_is_checked_with_the_given_torch_and_the_cap_set_before_the_load(warm_up):
    fake = FakeTorch(total=80 * GIB)
    warm_up.fake = fake
    fractions = []
    model = scoring_model()

    def load(*args, **kwargs):
        fractions.append(fake.cuda.fraction)
        return model

    build_engine(gpu(vram_cap_gib=40.0), torch_module=fake, load=load)
    assert fractions == [0.5]
    with pytest.raises(StartupError, match="torch sees no CUDA device"):
        build_engine(gpu(), torch_module=FakeTorch(available=False), load=Loads(model))


def test_a_load_failure_names_the_model_and_keeps_the_cause(warm_up):
    cause = OSError("no weights here")
    with pytest.raises(StartupError) as caught:
        build_engine(settings(), torch_module=FakeTorch(), load=Loads(cause))
    assert str(caught.value) == (
        f"cannot load model 'default' ({settings().model}): no weights here"
    )
    assert caught.value.__cause__ is cause and warm_up.calls == 0


def test_a_failed_warm_up_stops_the_build_and_keeps_the_cause(warm_up):
    warm_up.error = RuntimeError("kernel exploded")
    with pytest.raises(StartupError) as caught:
        build_engine(settings(), torch_module=FakeTorch(), load=Loads(scoring_model()))
    assert str(caught.value).startswith("the warm-up decision failed: ")
    assert "kernel exploded" in str(caught.value)
    assert caught.value.__cause__ is not None


def test_missing_fast_kernels_stop_the_build_only_when_required(warm_up, monkeypatch):
    monkeypatch.setattr(boot, "fast_kernel_availability", dict)
    linear = scoring_model(layer_types=["linear_attention", "full_attention"])
    with pytest.raises(StartupError) as caught:
        build_engine(
            settings(require_fast_kernels=True), torch_module=FakeTorch(), load=Loads(linear)
        )
    assert str(caught.value) == (
        f"{settings().model} has linear-attention layers and would run the slow reference path: "
        "flash-linear-attention, causal-conv1d not usable. Install the gpu extra, or set "
        "SEMIF_REQUIRE_FAST_KERNELS=0 to accept the slow path"
    )
    assert warm_up.calls == 0
    build_engine(settings(require_fast_kernels=False), torch_module=FakeTorch(), load=Loads(linear))
    monkeypatch.setattr(
        boot, "fast_kernel_availability", lambda: dict.fromkeys(boot.FAST_KERNEL_PACKAGES, True)
    )
    build_engine(settings(require_fast_kernels=True), torch_module=FakeTorch(), load=Loads(linear))


def test_the_engine_has_the_specs_slots_or_the_shared_lock(warm_up):
    config = settings(parallel_slots=3)
    engine = build_engine(config, model_spec(config, slots=3), FakeTorch(), Loads(scoring_model()))
    assert engine._lock._value == 3
    lock = threading.Lock()
    engine = build_engine(config, None, FakeTorch(), Loads(scoring_model()), lock=lock)
    assert engine._lock is lock


@pytest.mark.parametrize(
    ("cap_gib", "total_gib", "input_tokens", "peak", "slots"),
    [
        (20.0, 80, 100, 100 * MIB, 4),  # 100 MiB for 100 tokens: 4 GiB a decision; (20-3)//4
        (None, 40, 100, 100 * MIB, 9),  # no cap: the card's 40 GiB; (40-3)//4
        (20.0, 80, 0, 1 * MIB, 4),  # no input tokens counted as one: 1 MiB x 4096
        (20.0, 80, 1, 1 * MIB, 4),
    ],
)
def test_gpu_capacity_scales_the_warm_up_peak_to_max_tokens(
    warm_up, cap_gib, total_gib, input_tokens, peak, slots
):
    fake = FakeTorch(total=total_gib * GIB)
    fake.cuda.reserved, fake.cuda.allocated = 3 * GIB, 2 * GIB
    fake.cuda.peak_allocated = 50 * GIB  # an old peak: reset before the warm-up
    warm_up.fake, warm_up.input_tokens, warm_up.peak = fake, input_tokens, peak
    engine = build_engine(
        gpu(vram_cap_gib=cap_gib, max_tokens=4096), torch_module=fake, load=Loads(scoring_model())
    )
    assert engine.max_parallel_slots == slots
    assert engine.baseline_reserved == 3 * GIB
    assert engine.resident_bytes == 0  # the 3 GiB were reserved before this model loaded
    # A reconfigure in place asks the same rule at another max_tokens (issue 22.7), up to the
    # longest prompt warm-up ran.
    assert engine.capacity_for(4096) == slots
    assert engine.warmed_max_tokens == 4096


def test_the_gpu_capacity_rule_at_another_max_tokens(warm_up):
    fake = FakeTorch(total=80 * GIB)
    fake.cuda.reserved, fake.cuda.allocated = 3 * GIB, 2 * GIB
    warm_up.fake, warm_up.input_tokens, warm_up.peak = fake, 100, 100 * MIB
    engine = build_engine(
        gpu(vram_cap_gib=20.0, max_tokens=4096), torch_module=fake, load=Loads(scoring_model())
    )
    # 1 MiB a token beside 3 GiB in 20 GiB: 17 GiB / (max_tokens MiB)
    assert [engine.capacity_for(tokens) for tokens in (4096, 2048, 1024, 17 * 1024)] == [
        4,
        8,
        16,
        1,
    ]
    assert engine.capacity_at(8192) is None  # past the warmed shapes: only a reload can tell


class GrowsWhileLoading(Loads):
    """A load that reserves `grows` bytes on the fake card, as a model's weights would."""

    def __init__(self, result, fake, grows):
        super().__init__(result)
        self.fake, self.grows = fake, grows

    def __call__(self, *args, **kwargs):
        self.fake.cuda.reserved += self.grows
        return super().__call__(*args, **kwargs)


def test_a_gpu_models_resident_bytes_are_what_it_added_not_what_the_process_holds(warm_up):
    fake = FakeTorch(total=80 * GIB)
    fake.cuda.reserved = 7 * GIB  # another model and its stored prefixes, loaded before
    warm_up.fake = fake
    cache = PrefixCache(GIB)
    cache._bytes = 512 * MIB  # the other model's stored prefixes (inside the 7 GiB)
    stored_by_warm_up = 256 * MIB
    devices = []
    reserved = fake.cuda.memory_reserved

    def memory_reserved(device=None):  # on a host with several cards, the wrong one would lie
        devices.append(device)
        return reserved(device)

    fake.cuda.memory_reserved = memory_reserved

    def load_then_store_a_prefix(*args, **kwargs):  # as the warm-up decision may
        cache._bytes += stored_by_warm_up
        fake.cuda.reserved += stored_by_warm_up
        return loads(*args, **kwargs)

    loads = GrowsWhileLoading(scoring_model(), fake, 5 * GIB)
    engine = build_engine(
        gpu(vram_cap_gib=40.0), torch_module=fake, load=load_then_store_a_prefix, prefix_cache=cache
    )
    assert engine.baseline_reserved == 12 * GIB + stored_by_warm_up  # the whole process
    assert engine.resident_bytes == 5 * GIB  # its own: no neighbour, no stored prefix
    assert devices and all(device == "cuda:0" for device in devices)


def test_without_a_prefix_cache_a_gpu_model_counts_exactly_what_it_reserved(warm_up):
    fake = FakeTorch(total=80 * GIB)
    fake.cuda.reserved = 2 * GIB
    warm_up.fake = fake
    engine = build_engine(
        gpu(vram_cap_gib=40.0),
        torch_module=fake,
        load=GrowsWhileLoading(scoring_model(), fake, 3 * GIB + 1),
        prefix_cache=None,
    )
    assert engine.resident_bytes == 3 * GIB + 1


def test_a_cpu_model_asks_the_gpu_nothing_to_count_its_weights(warm_up):
    fake = FakeTorch()

    def no_gpu_please(device=None):  # on a GPU host it would initialise CUDA for nothing
        raise AssertionError(f"a CPU model asked for the reserved memory of {device!r}")

    fake.cuda.memory_reserved = no_gpu_please
    engine = build_engine(settings(), torch_module=fake, load=Loads(scoring_model()))
    assert engine.resident_bytes == 5000  # its parameters


def test_resident_bytes_are_never_negative():
    assert resident_difference(3 * GIB, 4 * GIB, 0) == 0
    assert resident_difference(10 * GIB, 4 * GIB, GIB) == 5 * GIB


def test_the_shape_warm_up_runs_after_the_decision_and_its_largest_shape_sizes_capacity(warm_up):
    fake = FakeTorch(total=80 * GIB)
    warm_up.fake, warm_up.input_tokens, warm_up.peak = fake, 100, 4 * GIB
    lock = threading.Lock()
    model = scoring_model()
    config = gpu(
        vram_cap_gib=40.0,
        max_tokens=4096,
        max_decisions=48,
        max_batch_rows=8,
        max_batch_tokens=2048,
    )
    engine = build_engine(config, torch_module=fake, load=Loads(model), lock=lock)
    assert warm_up.shape_calls == [
        (
            model,
            {
                "max_tokens": 4096,
                "max_rows": 48,
                "lock": lock,
                "max_batch_rows": 8,  # every batch shape the budget reaches (issue 30)
                "max_batch_tokens": 2048,
            },
        )
    ]
    # without the shape warm-up: 4 GiB x 4096 / 100 tokens per decision, far over the cap
    assert engine.max_parallel_slots == 1
    warm_up.shapes = {"largest_direct_tokens": 4096}
    engine = build_engine(config, torch_module=fake, load=Loads(model), lock=lock)
    assert engine.max_parallel_slots == 10  # (40 GiB - a 0 baseline) / (4 GiB x 4096 / 4096)
    warm_up.error = RuntimeError("boom")
    with pytest.raises(StartupError, match="the warm-up decision failed: .*RuntimeError: boom"):
        build_engine(config, torch_module=fake, load=Loads(model), lock=lock)


def test_cpu_capacity_comes_from_the_memory_budget_and_the_attention_cache(warm_up):
    # 1024 bytes a token (2 x 4 layers x 2 heads x 16 dims x 4 bytes) x 65536 tokens x 2: 128 MiB
    # a decision beside 5000 bytes of weights, in 1 GiB: 7 (8 would need the weights to be free).
    config = settings(memory_budget_gib=1.0, max_tokens=65536)
    engine = build_engine(config, torch_module=FakeTorch(), load=Loads(scoring_model()))
    assert engine.max_parallel_slots == 7 and engine.resident_bytes == 5000
    assert engine.capacity_for(32768) == 15  # the same rule at another max_tokens (22.7)
    assert engine.warmed_max_tokens is None  # the CPU builds no shapes: any max_tokens in place
    engine = build_engine(settings(), torch_module=FakeTorch(), load=Loads(scoring_model()))
    assert engine.max_parallel_slots == 16
    assert engine.capacity_for(1 << 20) == 16


def test_the_prefix_cache_budget_is_kept_out_of_the_slot_capacity(warm_up):
    fake = FakeTorch(total=80 * GIB)
    fake.cuda.reserved = 3 * GIB
    warm_up.fake, warm_up.input_tokens, warm_up.peak = fake, 100, 100 * MIB  # 4 GiB a decision
    config = gpu(vram_cap_gib=20.0, max_tokens=4096)
    slots = [
        build_engine(
            config, torch_module=fake, load=Loads(scoring_model()), prefix_cache=PrefixCache(size)
        ).max_parallel_slots
        for size in (0, 8 * GIB, 9 * GIB, 30 * GIB)
    ]
    assert slots == [4, 2, 2, 1]  # (20 - cache - 3) // 4, at least one
    cpu = settings(memory_budget_gib=1.0, max_tokens=65536)  # 128 MiB a decision (above)
    engine = build_engine(
        cpu,
        torch_module=FakeTorch(),
        load=Loads(scoring_model()),
        prefix_cache=PrefixCache(GIB // 2),
    )
    assert engine.max_parallel_slots == 3  # (512 MiB - 5000 bytes of weights) // 128 MiB


def test_the_scorer_gets_the_process_wide_prefix_cache_and_the_engines_torch(warm_up):
    cache, fake = PrefixCache(GIB), FakeTorch()
    engine = build_engine(
        settings(), torch_module=fake, load=Loads(scoring_model()), prefix_cache=cache
    )
    # the cache's OOM fallback must recognise this torch's out-of-memory errors
    assert engine._scorer.prefix_cache.store is cache and engine._scorer._torch is fake
    assert engine.cache_stats() == cache.stats(engine._scorer.prefix_cache.model)
    assert set(engine.cache_stats().values()) == {0} and "hits" in engine.cache_stats()
    engine = build_engine(settings(), torch_module=fake, load=Loads(scoring_model()))
    assert engine.cache_stats() is None


def test_capacity_is_what_fits_beside_the_model_as_one_to_sixteen_slots():
    assert derive_capacity(10 * GIB, 4 * GIB, 2 * GIB) == 3
    assert derive_capacity(10 * GIB, 4 * GIB, 3 * GIB) == 2  # 2.0 exactly
    assert derive_capacity(10 * GIB, 4 * GIB, 7 * GIB) == 1
    assert derive_capacity(10 * GIB, 12 * GIB, 1 * GIB) == 1  # never below one slot
    assert derive_capacity(100 * GIB, 1 * GIB, 0.1 * GIB) == 16
    assert derive_capacity(17 * GIB, 0, 1 * GIB) == 16
    assert derive_capacity(10 * GIB, 4 * GIB, 0) == 16
    assert derive_capacity(10 * GIB, 4 * GIB, -1) == 16
    assert derive_capacity(10, 0, 1) == 10  # one byte a decision is still a cost
    assert derive_capacity(1, 0, 0.1) == 9  # floor division: 1 / 0.1 rounds up to 10.0


def test_the_attention_cache_counts_full_attention_layers_and_key_value_heads():
    assert kv_bytes_per_token(FakeModel()) == 2 * 4 * 2 * 16 * 4
    mixed = ["linear_attention", "full_attention", "linear_attention", "sliding_attention"]
    assert kv_bytes_per_token(FakeModel(layer_types=mixed)) == 2 * 2 * 2 * 16 * 4
    plain = FakeModel(num_key_value_heads=None, head_dim=None)  # 8 heads of 256 / 8 = 32
    assert kv_bytes_per_token(plain) == 2 * 4 * 8 * 32 * 4
    bare = FakeModel()  # a config without the optional attributes at all
    for name in ("layer_types", "num_key_value_heads", "head_dim"):
        delattr(bare.config, name)
    assert kv_bytes_per_token(bare) == 2 * 4 * 8 * 32 * 4
    assert type(kv_bytes_per_token(bare)) is int
    assert parameter_bytes(FakeModel()) == 5000


# --- check_source: a reconfigure's check before anything is torn down (issue 13, finding 7) ----


def test_the_source_check_passes_the_spec_to_the_inspector_and_returns_its_estimate(tmp_path):
    seen = []

    def inspect(source, revision, **kwargs):
        seen.append((source, revision, kwargs))
        return 12345

    config = settings(cache_dir=tmp_path)
    spec = model_spec(config, dtype="bfloat16")
    assert check_source(config, spec, torch_module=torch, inspect=inspect) == 12345
    assert seen == [("acme/m", "r", {"dtype": "bfloat16", "cache_dir": tmp_path})]


def test_a_missing_source_is_a_400_naming_the_source(tmp_path):
    spec = parse_spec("m", {"source": str(tmp_path / "nowhere"), "device": "cpu"}, settings())
    with pytest.raises(BadManagementRequest) as caught:
        check_source(settings(), spec, torch_module=torch)
    assert str(caught.value) == f"m.source: model folder '{tmp_path / 'nowhere'}' does not exist"
    assert caught.value.__cause__ is None


def test_a_usable_device_is_checked_with_the_torch_given(tmp_path):
    spec = parse_spec("m", {"source": "x", "device": "cuda"}, settings())
    fake = FakeTorch(capability=(9, 0), arch_list=["sm_90"])
    assert check_source(settings(), spec, torch_module=fake, inspect=lambda *a, **k: 7) == 7


def test_an_unusable_device_is_a_400_naming_the_device_before_the_source_is_read():
    def inspect(*args, **kwargs):
        raise AssertionError("the source was inspected")

    spec = parse_spec("m", {"source": "x", "device": "cuda"}, settings())
    with pytest.raises(BadManagementRequest) as caught:
        check_source(settings(), spec, torch_module=FakeTorch(available=False), inspect=inspect)
    assert str(caught.value).startswith("m.device: SEMIF_DEVICE=cuda but torch sees no CUDA")
    assert caught.value.__cause__ is None


def test_the_production_runtime_refuses_a_missing_source_before_anything_changes(tmp_path):
    """server.build_runtime wires boot.check_source: a PUT naming a folder that is not there is a
    400 at once, and the serving model's entry is untouched (finding 7)."""
    from semif_serve.config import Settings
    from semif_serve.errors import BadManagementRequest
    from semif_serve.server import build_runtime

    config = Settings(api_token="t" * 40, device="cpu", dtype="float32", cache_dir=tmp_path)
    runtime = build_runtime(config)
    before = runtime.status()
    with pytest.raises(BadManagementRequest, match=r"^default\.source: "):
        runtime.register("default", {"source": str(tmp_path / "nonexistent"), "device": "cpu"})
    assert runtime.status() == before

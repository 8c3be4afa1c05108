"""Build the production engine, failing closed (INV-3, INV-4).

In order: the device checks (`cuda` resolved to the concrete `cuda:N` every later torch call
gets; a CUDA device whose `sm_XY` is in torch's arch list, unless SEMIF_DEVICE=cpu was set
explicitly), the VRAM cap (torch's per-process memory fraction, set
BEFORE the model loads), the model load, the fast-kernel check for linear-attention models, one
warm-up decision, and the memory baseline the engine releases back to. Any failure raises
`StartupError` and nothing is served. `check_source` is the cheap check a reconfigure runs
before it tears anything down.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from semif_serve.engine.engine import Engine
from semif_serve.engine.torch_scorer import TorchScorer
from semif_serve.errors import BadManagementRequest, StartupError
from semif_serve.runtime.specs import MAX_SLOTS
from semif_serve.scoring.rows import parse_row

GIB = 1 << 30
WARM_UP_ROW = {
    "id": "warm-up",
    "state": "The service is starting.",
    "question": "Is the service starting?",
    "options": [{"id": "yes", "description": "Yes"}, {"id": "no", "description": "No"}],
}
FAST_KERNEL_PACKAGES = ("flash-linear-attention", "causal-conv1d")


def resolve_device(device: str, torch_module: Any) -> str:
    """`cuda` becomes the concrete `cuda:N` torch will use (its current device), once, so every
    later call gets an index: some torch calls refuse an index-less device (the per-process
    memory fraction raises ValueError for "cuda"). `cuda:N` must name a visible device."""
    if not device.startswith("cuda") or not torch_module.cuda.is_available():
        return device  # cpu, or a CUDA request check_device refuses with its own message
    visible = torch_module.cuda.device_count()
    if device == "cuda":
        return f"cuda:{torch_module.cuda.current_device()}"
    index = int(device.partition(":")[2])
    if index >= visible:
        raise StartupError(
            f"SEMIF_DEVICE={device} but torch sees {visible} CUDA device(s) "
            f"(cuda:0..cuda:{visible - 1}); check CUDA_VISIBLE_DEVICES"
        )
    return device


def check_device(device: str, torch_module: Any) -> None:
    """A CUDA device this torch build has kernels for; the CPU only when asked for by name."""
    if device == "cpu":
        return
    cuda = torch_module.cuda
    if not cuda.is_available():
        raise StartupError(
            f"SEMIF_DEVICE={device} but torch sees no CUDA device; set SEMIF_DEVICE=cpu to "
            "serve on the CPU on purpose"
        )
    major, minor = cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}"
    arch_list = list(cuda.get_arch_list())
    if arch not in arch_list:
        raise StartupError(
            f"the GPU on {device} is {arch}, which this torch build has no kernels for "
            f"(arch list: {', '.join(arch_list) or 'empty'})"
        )


def apply_vram_cap(cap_gib: float | None, device: str, torch_module: Any) -> float | None:
    """Cap this process at `cap_gib` of the card; returns the fraction set (None: uncapped)."""
    if cap_gib is None or device == "cpu":
        return None
    total = torch_module.cuda.get_device_properties(device).total_memory
    fraction = cap_gib * GIB / total
    if fraction > 1:
        raise StartupError(
            f"SEMIF_VRAM_CAP_GIB={cap_gib} is more than the card's {total / GIB:.1f} GiB"
        )
    torch_module.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def missing_fast_kernels(model_config: Any, availability: dict[str, bool]) -> list[str]:
    """The gpu-extra packages a linear-attention model would run without (the slow path)."""
    if "linear_attention" not in (getattr(model_config, "layer_types", None) or []):
        return []
    return [package for package in FAST_KERNEL_PACKAGES if not availability.get(package)]


def fast_kernel_availability() -> dict[str, bool]:
    from transformers.utils.import_utils import (
        is_causal_conv1d_available,
        is_flash_linear_attention_available,
    )

    return {
        "flash-linear-attention": bool(is_flash_linear_attention_available()),
        "causal-conv1d": bool(is_causal_conv1d_available()),
    }


def check_source(
    settings: Any, spec: Any, torch_module: Any = None, inspect: Any = None
) -> int | None:
    """A register's or reconfigure's check, before anything is torn down: `spec`'s device is
    usable and its source is here with a config that loads (no weights read, nothing converted).
    Else BadManagementRequest (400) naming the field. Returns the estimated resident bytes of
    its weights in spec.dtype (None: unknown), for the runtime's load-beside decision."""
    from semif_serve.engine.loading import ModelLoadError

    if torch_module is None:
        import torch as torch_module
    if inspect is None:
        from semif_serve.engine.loading import inspect_source as inspect
    try:
        check_device(resolve_device(spec.device, torch_module), torch_module)
    except StartupError as error:
        raise BadManagementRequest(f"{spec.id}.device: {error}") from None
    try:
        return inspect(spec.source, spec.revision, dtype=spec.dtype, cache_dir=settings.cache_dir)
    except ModelLoadError as error:
        raise BadManagementRequest(f"{spec.id}.source: {error}") from None


def check_startup_models(settings: Any, torch_module: Any = None, inspect: Any = None) -> None:
    """`semif-serve serve`'s check before anything is printed or bound, in gunicorn's master:
    each startup model's device is one torch sees and its source is here (a built-in name with
    its file, a folder, a cached hub commit; nothing converted, no weights read). A ConfigError
    names the variable. No CUDA context is made (a forked worker could not use it): the card's
    arch, the VRAM cap, the load and the warm-up stay the worker's (INV-3)."""
    from semif_serve.config import ConfigError
    from semif_serve.engine.loading import ModelLoadError
    from semif_serve.runtime.specs import default_spec, load_models_file

    if torch_module is None:
        import torch as torch_module
    if inspect is None:
        from semif_serve.engine.loading import inspect_source as inspect
    if settings.models_file:
        specs, _ = load_models_file(settings.models_file, settings)
    else:
        specs = [default_spec(settings)]
    for spec in (spec for spec in specs if spec.load_on_startup):
        named = partial(startup_variable, spec.id if settings.models_file else None)
        problem = invisible_device(spec.device, torch_module)
        if problem is not None:
            raise ConfigError(f"{named('device')}: {problem}")
        try:
            inspect(spec.source, spec.revision, dtype=spec.dtype, cache_dir=settings.cache_dir)
        except ModelLoadError as error:
            field, _, why = str(error).partition(": ")
            if field == "revision":
                raise ConfigError(f"{named('revision')}: {why}") from None
            raise ConfigError(f"{named('source')}: {error}") from None


def startup_variable(model_id: str | None, field: str) -> str:
    """What a startup check names: SEMIF_MODEL, SEMIF_REVISION or SEMIF_DEVICE for the one
    model of SEMIF_MODEL (`model_id` None), else the field of SEMIF_MODELS_FILE's table."""
    if model_id is None:
        return "SEMIF_MODEL" if field == "source" else f"SEMIF_{field.upper()}"
    return f"SEMIF_MODELS_FILE: [{model_id}] {field}"


def invisible_device(device: str, torch_module: Any) -> str | None:
    """Why torch cannot use `device` as far as it can tell without a CUDA context (its device
    count comes from NVML), or None."""
    if device == "cpu":
        return None
    count = torch_module.cuda.device_count()
    if count == 0:
        return (
            f"{device} asked for, but torch sees no CUDA device; set SEMIF_DEVICE=cpu to serve "
            "on the CPU on purpose"
        )
    index = device.partition(":")[2]
    if index and int(index) >= count:
        return (
            f"{device} asked for, but torch sees {count} CUDA device(s) "
            f"(cuda:0..cuda:{count - 1}); check CUDA_VISIBLE_DEVICES"
        )
    return None


def build_engine(
    settings: Any,
    spec: Any = None,
    torch_module: Any = None,
    load: Any = None,
    lock: Any = None,
    prefix_cache: Any = None,
) -> Engine:
    """The engine for one model (`spec`, default: SEMIF_MODEL); StartupError instead of serving
    badly. `prefix_cache`: the process-wide state-prefix cache (None: off); its budget is kept
    out of the memory the slot capacity is sized from."""
    if spec is None:
        from semif_serve.runtime.specs import default_spec

        spec = default_spec(settings)
    if torch_module is None:
        import torch as torch_module
    if load is None:
        from semif_serve.engine.loading import load_model as load
    device = resolve_device(spec.device, torch_module)  # torch only ever sees this one
    check_device(device, torch_module)
    apply_vram_cap(settings.vram_cap_gib, device, torch_module)
    on_gpu = device != "cpu"
    # What this model adds is measured as a difference: the process may already hold other
    # models and stored prefixes, which must not be counted again as this model's.
    reserved_before = torch_module.cuda.memory_reserved(device) if on_gpu else 0
    stored_before = prefix_cache.total_bytes if prefix_cache is not None else 0
    try:
        scoring_model = load(
            spec.source,
            spec.revision,
            dtype=spec.dtype,
            device=device,
            cache_dir=settings.cache_dir,
        )
    except Exception as error:
        raise StartupError(f"cannot load model {spec.id!r} ({spec.source}): {error}") from error
    if settings.require_fast_kernels:
        missing = missing_fast_kernels(scoring_model.model.config, fast_kernel_availability())
        if missing:
            raise StartupError(
                f"{spec.source} has linear-attention layers and would run the slow reference "
                f"path: {', '.join(missing)} not usable. Install the gpu extra, or set "
                "SEMIF_REQUIRE_FAST_KERNELS=0 to accept the slow path"
            )
    engine = Engine(
        TorchScorer(scoring_model, spec.max_tokens, prefix_cache, torch_module),
        device=device,
        torch_module=torch_module,
        concurrency=spec.slots,
        lock=lock,
    )
    if on_gpu:
        torch_module.cuda.reset_peak_memory_stats(device)
        allocated_before = torch_module.cuda.memory_allocated(device)
    from semif_serve.engine.warmup import warm_up_shapes

    try:
        warm_up = engine.score(parse_row(WARM_UP_ROW))
        check_finite_warm_up(warm_up, spec)
        shapes = warm_up_shapes(
            scoring_model,
            max_tokens=spec.max_tokens,
            max_rows=settings.max_decisions,
            lock=lock,  # the process-wide lock, taken per shape (INV-2 during a load beside)
            max_batch_rows=settings.max_batch_rows,  # every batch shape the budget can reach
            max_batch_tokens=settings.max_batch_tokens,
        )
    except StartupError:
        raise
    except Exception as error:
        raise StartupError(f"the warm-up decision failed: {error}") from error
    if shapes is not None:  # every shape ran (CUDA): the peak is the largest shape's, reached
        # by at most a max_tokens prompt padded to its bucket
        warm_up = {**warm_up, "input_tokens": shapes["largest_direct_tokens"]}
    engine.record_baseline()
    cache_budget = prefix_cache.budget_bytes if prefix_cache is not None else 0
    stored = (prefix_cache.total_bytes if prefix_cache is not None else 0) - stored_before
    engine.resident_bytes = (
        resident_difference(engine.baseline_reserved, reserved_before, stored)
        if on_gpu
        else parameter_bytes(scoring_model.model)
    )
    if on_gpu:
        budget = (
            settings.vram_cap_gib * GIB
            if settings.vram_cap_gib
            else (torch_module.cuda.get_device_properties(device).total_memory)
        )
        warm_up_bytes = torch_module.cuda.max_memory_allocated(device) - allocated_before
        # the warm-up's peak scaled to max_tokens (memory grows about linearly with tokens)
        per_token = warm_up_bytes / max(warm_up["input_tokens"], 1)
        free, baseline = budget - cache_budget, engine.baseline_reserved
        engine.warmed_max_tokens = spec.max_tokens  # longer prompts would build new shapes
    elif settings.memory_budget_gib:
        per_token = kv_bytes_per_token(scoring_model.model) * ACTIVATION_FACTOR
        free = settings.memory_budget_gib * GIB - cache_budget
        baseline = parameter_bytes(scoring_model.model)
    else:
        per_token = free = baseline = 0  # no budget: every slot fits
    engine.capacity_for = lambda max_tokens: derive_capacity(free, baseline, per_token * max_tokens)
    engine.max_parallel_slots = engine.capacity_for(spec.max_tokens)
    return engine


SCORE_FIELDS = ("probabilities", "option_logits")


def non_finite_scores(result: dict[str, Any]) -> list[str]:
    """The scores of a scorer result that are NaN or infinite, e.g. `probabilities[0]=nan`."""
    return [
        f"{name}[{index}]={value!r}"
        for name in SCORE_FIELDS
        for index, value in enumerate(result.get(name) or ())
        if not math.isfinite(value)
    ]


def check_finite_warm_up(result: dict[str, Any], spec: Any) -> None:
    """Fail closed on a model whose warm-up scores are not numbers (corrupt weights: a few KB of
    0xFF in a tensor make NaN): served, every reply would be a 500."""
    bad = non_finite_scores(result)
    if bad:
        raise StartupError(
            f"model {spec.id!r} ({spec.source}): the warm-up decision's scores are not finite "
            f"({', '.join(bad)}); its weights may be corrupt"
        )


def resident_difference(reserved_after: int, reserved_before: int, stored: int) -> int:
    """The bytes a GPU model added: reserved after its warm-up less what was reserved before
    its load, less the prefixes its warm-up stored (the prefix cache counts those, once)."""
    return max(reserved_after - reserved_before - stored, 0)


ACTIVATION_FACTOR = 2  # CPU estimate: activations about as large as the attention cache


def derive_capacity(budget_bytes: float, baseline_bytes: float, per_decision_bytes: float) -> int:
    """How many max_tokens decisions fit beside the loaded model, as slots 1..16.

    On a GPU the per-decision cost is the warm-up's peak scaled to max_tokens (memory grows about
    linearly with tokens); on the CPU it is estimated from the attention cache's size."""
    if per_decision_bytes <= 0:
        return MAX_SLOTS
    fits = int((budget_bytes - baseline_bytes) // per_decision_bytes)
    return max(1, min(MAX_SLOTS, fits))


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of attention keys and values one token adds (full-attention layers only)."""
    config = model.config
    layer_types = (
        getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    )
    attention_layers = sum(1 for kind in layer_types if kind != "linear_attention")
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * attention_layers * heads * head_dim * element


def parameter_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())

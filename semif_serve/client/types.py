"""What goes over the wire, as TypedDicts that mirror docs/api.md (and docs/openapi.yaml).

Requests are plain dicts of these shapes; replies are the server's JSON objects, unchanged, typed
by these for editors and checkers. `NotRequired` marks what a body or reply may leave out.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

Orderings = Literal["none", "rotations", "all"]


class OptionSpec(TypedDict):
    id: str
    description: str


class DecideRequest(TypedDict):
    """`POST /decide`: one decision."""

    id: str
    state: Any  # a nonempty string, object or array
    question: str
    options: list[OptionSpec]
    workload: NotRequired[str | None]
    orderings: NotRequired[Orderings]
    model: NotRequired[str | None]
    timeout_s: NotRequired[float | None]


class DecisionSpec(TypedDict):
    """One decision of a `POST /decide/shared` body (the state is the body's)."""

    id: str
    question: str
    options: list[OptionSpec]
    orderings: NotRequired[Orderings]


class SharedRequest(TypedDict):
    """`POST /decide/shared`: many decisions over one state."""

    state: Any
    decisions: list[DecisionSpec]
    workload: NotRequired[str | None]
    model: NotRequired[str | None]
    timeout_s: NotRequired[float | None]


class ModelInfo(TypedDict):
    source: str
    revision: str
    dtype: str
    device: str
    attention: str
    torch_version: str
    transformers_version: str
    serving_config: NotRequired[str]  # shared results only


class Calibrated(TypedDict):
    workload: str
    temperature: float
    probabilities: list[float]


class Result(TypedDict):
    """A scorer's native result (docs/scoring.md#the-result), plus `calibrated` for a workload."""

    id: str
    option_ids: list[str]
    probabilities: list[float]
    option_logits: list[float]
    input_tokens: int
    forward_seconds: float
    total_seconds: float
    prompt_sha256: str
    prompt_version: str
    model: ModelInfo
    readout: str
    summary: str
    probability_status: str
    cache_hit: bool
    prefix_sha256: str | None
    calibrated: NotRequired[Calibrated]


class Combined(TypedDict):
    method: Literal["rotations", "all"]
    orderings: int
    probabilities: list[float]
    top: str
    agreement: float
    spread: dict[str, list[float]]  # option id -> [min, max]


class AveragedResult(TypedDict):
    """A decision scored under `orderings`: the combined scores and every ordering's result."""

    id: str
    option_ids: list[str]
    combined: Combined
    orderings: list[Result]


DecideReply = Result | AveragedResult


class SharedReply(TypedDict):
    results: list[DecideReply]  # in request order
    timing: dict[str, float | int]  # docs/scoring.md explains the keys


class HealthModel(TypedDict):
    id: str  # the default model's id (its source is shown only by GET /v1/models)
    revision: str
    dtype: str
    device: str


class Health(TypedDict):
    status: Literal["ok"]
    semif_commit: str
    model: HealthModel
    vram_cap_gib: float | None
    max_tokens: int
    max_decisions: int
    workloads: dict[str, float]  # the calibration table: workload -> temperature


class LoadError(TypedDict):
    message: str
    at: str  # UTC, e.g. 2026-11-30T21:05:56Z


class PrefixCacheStats(TypedDict):
    hits: int
    misses: int
    evictions: int
    bytes: int
    entries: int


class ModelStatus(TypedDict):
    id: str
    state: Literal["unloaded", "loading", "ready", "reconfiguring", "unloading"]
    loaded: bool
    slots: int
    active_slots: int
    queued_requests: int
    max_parallel_slots: int | None
    source: str
    revision: str | None
    keep_alive_s: float | None
    last_used: float | None
    last_load_error: LoadError | None
    prefix_cache: PrefixCacheStats | None


class ModelList(TypedDict):
    models: list[ModelStatus]

"""`Settings`: every SEMIF_* variable, parsed and validated once at startup, then frozen.

A bad value raises `ConfigError` (a ValueError) naming the variable, and the server does not
start (contract "Configuration (env)", bug hunt C1, S1, S2, S8). Nothing here imports torch.
"""

from __future__ import annotations

import hmac
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from semif_serve.calibration import load_calibration
from semif_serve.errors import ConfigError

DEFAULT_MODEL = "Qwen/Qwen3.5-4B"
DEFAULT_REVISION = "851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a"
DEFAULT_BIND = "127.0.0.1:8471"
MIN_TOKEN_LENGTH = 32
DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")  # \d would take any Unicode digit
DTYPES = ("float32", "bfloat16", "float16")
# SEMIF_PREFIX_CACHE_GIB's default: on a GPU host ~70 states of ~2k tokens of Qwen3.5-4B; on the
# CPU ~10 of SmolLM2's. At most MAX_PREFIX_CACHE_GIB (more is a typo: no card holds it).
PREFIX_CACHE_GIB = {"cpu": 1.0, "cuda": 8.0}
MAX_PREFIX_CACHE_GIB = 1024.0
# SEMIF_PREFIX_CHECKPOINT_TOKENS: a hybrid model's stored prefix keeps its linear-attention states
# every this many tokens, so that a state edited or cut inside it resumes from the checkpoint
# before the change. One checkpoint of Qwen3.5-4B is ~50 MiB (24 linear layers' recurrent and
# conv states), as much as ~1,600 tokens of its keys and values: 1024 keeps them under the
# entry's own size. At least 64 (a prefill cut into smaller pieces runs slower than it saves).
PREFIX_CHECKPOINT_TOKENS = 1024
MIN_PREFIX_CHECKPOINT_TOKENS = 64
# The dynamic batcher's defaults (rows, padded tokens), by measurement (docs/performance.md): on 2
# CPU cores a batched forward gains up to ~1.27x per row at ~110 tokens and loses beyond ~1.5-4k
# padded tokens, so the CPU batches up to 1,024 padded tokens (16 callers of ~110 tokens: 1.43x
# decisions/s; ~600-token prompts run one per forward, as unbatched: 1.04x). CUDA stays
# unbatched until a GPU run measures it (bench/gpu/run.sh).
BATCH_DEFAULTS = {"cpu": (16, 1024), "cuda": (1, 16384)}
# Upper bounds of the integer limits: generous but finite, so a mistaken value (400 digits) is
# refused at startup, naming the variable, instead of overflowing arithmetic downstream.
MAX_TOKENS_LIMIT = 1 << 20  # models.toml's max_tokens has the same bound
MAX_BATCH_ROWS_LIMIT = 1024
MAX_BATCH_TOKENS_LIMIT = 1 << 24
MAX_BATCH_WAIT_MS = 1000  # a batch never waits longer than a second for company
MAX_DECISIONS_LIMIT = 1 << 16
MAX_BODY_BYTES_LIMIT = 1 << 30
MAX_QUEUE_LIMIT = 4096  # each admitted request holds a worker thread
MAX_LOADED_MODELS_LIMIT = 1024
MAX_CONNECTIONS_LIMIT = 1 << 16
MAX_OPTIONS_LIMIT = 255  # per question: what System One and OpenAI Decisions allow


@dataclass(frozen=True)
class Settings:
    api_token: str = field(repr=False)
    model: str = DEFAULT_MODEL
    revision: str | None = DEFAULT_REVISION
    device: str = "cuda"
    dtype: str = "bfloat16"
    vram_cap_gib: float | None = None
    max_tokens: int = 4096
    max_decisions: int = 64
    max_body_bytes: int = 1 << 20
    max_queue: int = 32
    calibration: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    bind: str = DEFAULT_BIND
    graceful_timeout_s: int = 60
    cache_dir: Path | None = None
    require_fast_kernels: bool = False
    parallel_slots: int | None = None  # SEMIF_PARALLEL_SLOTS: set selects the parallel runtime
    models_file: str | None = None
    queue_timeout_s: float = 0.0  # 0: a queued request waits as long as it takes
    admin_token: str | None = field(default=None, repr=False)
    max_loaded_models: int | None = None
    memory_budget_gib: float | None = None
    header_timeout_s: float = 10.0  # a request's line and headers must arrive within this
    body_timeout_s: float = 30.0  # and its body within this, counted from the end of the headers
    write_timeout_s: float = 30.0  # a reply must be taken by the client within this
    max_connections: int = 1000  # open connections the worker holds; more wait in the backlog
    prefix_cache_gib: float = PREFIX_CACHE_GIB["cuda"]  # 0: no state-prefix cache
    prefix_checkpoint_tokens: int = PREFIX_CHECKPOINT_TOKENS
    max_batch_rows: int = 1  # rows one batched forward takes at most; 1: no batching
    max_batch_tokens: int = 16384  # its padded tokens (rows x longest prompt) at most
    batch_wait_ms: int = 0  # how long a batch waits for more requests; 0: never
    # SEMIF_MODEL_ALIASES: names the ecosystem routes accept for a registered model (jev-latest)
    model_aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # SEMIF_HOSTED_MODEL_NAMES: the hosted services' model names (jev-latest, jev-*,
    # typesafe/jev-*, gpt-6-luna) name the default model on the ecosystem routes; 0: strict names
    hosted_model_names: bool = True
    # SEMIF_MAX_OPTIONS: choices or levels per question on the ecosystem routes (above 16 they
    # are scored as option groups, semif_serve/apis/grouped.py)
    max_options: int = 255
    # SEMIF_LEGACY_EXTENSION_BLOCK: answers also carry their extension block under its old
    # name `semif` (deprecated; removed in the next release)
    legacy_extension_block: bool = False
    # SEMIF_STATE_DIR: where management changes are kept for the next worker (None: a private
    # folder for this server's run only; semif_serve/runtime/management_state.py)
    state_dir: Path | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings from `environ` (default: the process environment)."""
        return settings_from_env(os.environ if environ is None else environ)


def settings_from_env(env: Mapping[str, str], cpu_flags: frozenset[str] | None = None) -> Settings:
    """Every SEMIF_* variable parsed and validated (a module function, so the mutation grid can
    mutate it: mutmut leaves decorated methods such as `from_env` alone). `cpu_flags`: this
    machine's (`read_cpu_flags`) unless given."""
    device = env.get("SEMIF_DEVICE", "cuda")
    if not DEVICE_PATTERN.fullmatch(device):
        raise ConfigError(f"SEMIF_DEVICE: must be cuda, cuda:N or cpu, got {device!r}")
    flags = read_cpu_flags() if cpu_flags is None and device == "cpu" else cpu_flags
    default_dtype = default_dtype_for(device, flags or frozenset())
    device_kind = "cpu" if device == "cpu" else "cuda"
    batch_rows, batch_tokens = BATCH_DEFAULTS[device_kind]
    dtype = env.get("SEMIF_DTYPE", default_dtype)
    if dtype not in DTYPES:
        raise ConfigError(f"SEMIF_DTYPE: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model = _nonempty(env, "SEMIF_MODEL", DEFAULT_MODEL)
    api_token = parse_token(env.get("SEMIF_API_TOKEN"))
    return Settings(
        api_token=api_token,
        model=model,
        revision=parse_revision(env, model),
        device=device,
        dtype=dtype,
        vram_cap_gib=parse_gib(env.get("SEMIF_VRAM_CAP_GIB"), "SEMIF_VRAM_CAP_GIB"),
        max_tokens=parse_limit(env, "SEMIF_MAX_TOKENS", 4096, MAX_TOKENS_LIMIT),
        max_decisions=parse_limit(env, "SEMIF_MAX_DECISIONS", 64, MAX_DECISIONS_LIMIT),
        max_body_bytes=parse_limit(env, "SEMIF_MAX_BODY_BYTES", 1 << 20, MAX_BODY_BYTES_LIMIT),
        max_queue=parse_limit(env, "SEMIF_MAX_QUEUE", 32, MAX_QUEUE_LIMIT),
        calibration=load_calibration(env.get("SEMIF_CALIBRATION")),
        bind=parse_bind(env.get("SEMIF_BIND", DEFAULT_BIND)),
        graceful_timeout_s=parse_limit(env, "SEMIF_GRACEFUL_TIMEOUT_S", 60, int(MAX_WAIT_S)),
        cache_dir=Path(env["SEMIF_CACHE_DIR"]) if env.get("SEMIF_CACHE_DIR") else None,
        require_fast_kernels=parse_flag(env, "SEMIF_REQUIRE_FAST_KERNELS", default=device != "cpu"),
        parallel_slots=parse_slot_count(env.get("SEMIF_PARALLEL_SLOTS")),
        models_file=env.get("SEMIF_MODELS_FILE") or None,
        queue_timeout_s=parse_seconds(env, "SEMIF_QUEUE_TIMEOUT_S"),
        admin_token=parse_admin_token(env.get("SEMIF_ADMIN_TOKEN"), api_token),
        max_loaded_models=(
            parse_limit(env, "SEMIF_MAX_LOADED_MODELS", 0, MAX_LOADED_MODELS_LIMIT) or None
        ),
        memory_budget_gib=parse_gib(env.get("SEMIF_MEMORY_BUDGET_GIB"), "SEMIF_MEMORY_BUDGET_GIB"),
        header_timeout_s=parse_deadline(env, "SEMIF_HEADER_TIMEOUT_S", 10.0),
        body_timeout_s=parse_deadline(env, "SEMIF_BODY_TIMEOUT_S", 30.0),
        write_timeout_s=parse_deadline(env, "SEMIF_WRITE_TIMEOUT_S", 30.0),
        max_connections=parse_limit(env, "SEMIF_MAX_CONNECTIONS", 1000, MAX_CONNECTIONS_LIMIT),
        prefix_cache_gib=parse_cache_gib(
            env.get("SEMIF_PREFIX_CACHE_GIB"), PREFIX_CACHE_GIB[device_kind]
        ),
        prefix_checkpoint_tokens=parse_checkpoint_tokens(env),
        max_batch_rows=parse_limit(env, "SEMIF_MAX_BATCH_ROWS", batch_rows, MAX_BATCH_ROWS_LIMIT),
        max_batch_tokens=parse_limit(
            env, "SEMIF_MAX_BATCH_TOKENS", batch_tokens, MAX_BATCH_TOKENS_LIMIT
        ),
        batch_wait_ms=parse_wait_ms(env, "SEMIF_BATCH_WAIT_MS"),
        model_aliases=parse_aliases(env.get("SEMIF_MODEL_ALIASES")),
        hosted_model_names=parse_flag(env, "SEMIF_HOSTED_MODEL_NAMES", default=True),
        max_options=parse_max_options(env),
        legacy_extension_block=parse_flag(env, "SEMIF_LEGACY_EXTENSION_BLOCK", default=False),
        state_dir=Path(env["SEMIF_STATE_DIR"]) if env.get("SEMIF_STATE_DIR") else None,
    )


# CPU flags of native bfloat16 arithmetic (/proc/cpuinfo): AMX tiles, AVX-512 BF16.
NATIVE_BFLOAT16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
CPUINFO = Path("/proc/cpuinfo")


def default_dtype_for(device: str, cpu_flags: frozenset[str]) -> str:
    """bfloat16 on GPUs and on CPUs that compute it natively; float32 on other CPUs, where
    bfloat16 is emulated and ~5.7x slower. The CPU's invariant numerics make bfloat16's paths
    agree bit for bit (docs/performance.md, "Batch-invariant numerics")."""
    native = bool(cpu_flags & NATIVE_BFLOAT16_FLAGS)
    return "bfloat16" if device != "cpu" or native else "float32"


def default_dtype(device: str) -> str:
    """`semif-serve serve`'s dtype on `device` ("cpu", "cuda", "cuda:N") on this machine."""
    return default_dtype_for(device, read_cpu_flags())  # (the flags matter on the CPU only)


def read_cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first processor's `flags` in /proc/cpuinfo; empty when there is none to read."""
    try:
        text = cpuinfo.read_bytes().decode("ascii", "replace")  # a stray byte names no flag
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def parse_token(token: str | None) -> str:
    """At least 32 characters, each visible ASCII (33-126): a CR, LF or NUL can never arrive."""
    if token is None or token == "":
        raise ConfigError("SEMIF_API_TOKEN: required (at least 32 visible ASCII characters)")
    if any(not 33 <= ord(char) <= 126 for char in token):
        raise ConfigError("SEMIF_API_TOKEN: only visible ASCII characters (33-126) are allowed")
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"SEMIF_API_TOKEN: must be at least {MIN_TOKEN_LENGTH} characters, got {len(token)}"
        )
    return token


def parse_limit(env: Mapping[str, str], name: str, default: int, most: int) -> int:
    """An integer in [1, most] written in ASCII digits (int() would also take ' 5', '٥' or
    '1_0'). The upper bound keeps absurd values (400 digits) out of the arithmetic downstream."""
    text = env.get(name)
    if text is None:
        return default
    value = _counted(text, most)
    if value is None:
        raise ConfigError(f"{name}: must be an integer in [1, {most}], got {_shown(text)}")
    return value


def _counted(text: str, most: int) -> int | None:
    """`text` as an integer in [1, most] when it is ASCII digits, else None. The length is
    checked before int(), which raises its own ValueError past 4,300 digits."""
    if not re.fullmatch(r"[0-9]+", text):
        return None
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(most)) or not 1 <= int(digits) <= most:
        return None
    return int(digits)


def _shown(text: str) -> str:
    """A value for a message: its repr, cut after 40 characters."""
    return repr(text) if len(text) <= 40 else f"{text[:40]!r}... ({len(text)} characters)"


def parse_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(name)
    if text is None:
        return default
    if text not in ("0", "1"):
        raise ConfigError(f"{name}: must be 0 or 1, got {text!r}")
    return text == "1"


def parse_gib(text: str | None, name: str) -> float | None:
    """Unset: None. Set: a finite number of GiB > 0 (for the VRAM cap, 0 never meant uncapped)."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}: must be a number of GiB, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}: must be finite and > 0, got {text!r}")
    return value


def parse_cache_gib(text: str | None, default: float) -> float:
    """Unset: `default`. Set: a number of GiB in [0, MAX_PREFIX_CACHE_GIB]; 0 turns it off."""
    name = "SEMIF_PREFIX_CACHE_GIB"
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}: must be a number of GiB, got {text!r}") from None
    if not 0 <= value <= MAX_PREFIX_CACHE_GIB:  # also refuses nan and inf
        raise ConfigError(f"{name}: must be in [0, {MAX_PREFIX_CACHE_GIB:g}] GiB, got {text!r}")
    return value


def parse_checkpoint_tokens(env: Mapping[str, str]) -> int:
    """SEMIF_PREFIX_CHECKPOINT_TOKENS: an integer in [MIN_PREFIX_CHECKPOINT_TOKENS,
    MAX_TOKENS_LIMIT]; unset: PREFIX_CHECKPOINT_TOKENS."""
    name = "SEMIF_PREFIX_CHECKPOINT_TOKENS"
    value = parse_limit(env, name, PREFIX_CHECKPOINT_TOKENS, MAX_TOKENS_LIMIT)
    if value < MIN_PREFIX_CHECKPOINT_TOKENS:
        raise ConfigError(
            f"{name}: must be at least {MIN_PREFIX_CHECKPOINT_TOKENS} tokens, got {value}"
        )
    return value


MAX_WAIT_S = 86_400.0  # a day: longer waits are configuration mistakes (and overflow timers)


def parse_wait_ms(env: Mapping[str, str], name: str) -> int:
    """Milliseconds in [0, MAX_BATCH_WAIT_MS] written in ASCII digits; unset: 0."""
    text = env.get(name)
    if text is None or text == "0":
        return 0
    value = _counted(text, MAX_BATCH_WAIT_MS)
    if value is None:
        raise ConfigError(
            f"{name}: must be an integer in [0, {MAX_BATCH_WAIT_MS}], got {_shown(text)}"
        )
    return value


def parse_seconds(env: Mapping[str, str], name: str) -> float:
    """A number of seconds in [0, MAX_WAIT_S]; unset or 0 means no limit."""
    text = env.get(name)
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}: must be a number of seconds, got {text!r}") from None
    if not 0 <= value <= MAX_WAIT_S:  # also refuses nan and inf
        raise ConfigError(
            f"{name}: must be a number of seconds in [0, {MAX_WAIT_S:g}], got {text!r}"
        )
    return value


def parse_deadline(env: Mapping[str, str], name: str, default: float) -> float:
    """A finite number of seconds > 0: a read deadline always ends (0 would mean none at all)."""
    text = env.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}: must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}: must be finite and > 0, got {text!r}")
    return value


def parse_slot_count(text: str | None) -> int | None:
    if text is None:
        return None
    value = _counted(text, 16)
    if value is None:
        raise ConfigError(f"SEMIF_PARALLEL_SLOTS: must be an integer 1..16, got {_shown(text)}")
    return value


def parse_admin_token(token: str | None, api_token: str) -> str | None:
    """Unset: every management call is refused. Set: the same rules as SEMIF_API_TOKEN, and never
    the API token itself (every caller would then be an admin)."""
    if token is None:
        return None
    try:
        parse_token(token)
    except ConfigError as error:
        raise ConfigError(str(error).replace("SEMIF_API_TOKEN", "SEMIF_ADMIN_TOKEN")) from None
    if hmac.compare_digest(token.encode(), api_token.encode()):
        raise ConfigError(
            "SEMIF_ADMIN_TOKEN: must differ from SEMIF_API_TOKEN (with the same value every "
            "caller holding the API token could register, reconfigure and unload models)"
        )
    return token


ALIAS = re.compile(r"[!-~]{1,128}")  # visible ASCII: what an SDK's model string can carry
ALIAS_TARGET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a model id (runtime/specs.py)


def parse_aliases(text: str | None) -> Mapping[str, str]:
    """`alias=model,alias=model`: each alias visible ASCII but `=` and `,`, each once; each model
    a model id. Unset or empty: no aliases (a request must name a registered model)."""
    name = "SEMIF_MODEL_ALIASES"
    aliases: dict[str, str] = {}
    if text is None or not text.strip():
        return MappingProxyType(aliases)
    for pair in text.split(","):
        alias, separator, model = (part.strip() for part in pair.partition("="))
        if not separator or not ALIAS.fullmatch(alias) or not ALIAS_TARGET.fullmatch(model):
            raise ConfigError(
                f"{name}: must be alias=model_id pairs separated by commas, got {_shown(pair)}"
            )
        if alias in aliases:
            raise ConfigError(f"{name}: alias {alias!r} is given twice")
        aliases[alias] = model
    return MappingProxyType(aliases)


def check_alias_targets(aliases: Mapping[str, str], model_ids: list[str]) -> None:
    """Every alias names a model of the startup registry, and none is itself a model's id (a
    registered id always names that model)."""
    name = "SEMIF_MODEL_ALIASES"
    known = ", ".join(model_ids)
    for alias, model in aliases.items():
        if alias in model_ids:
            raise ConfigError(f"{name}: {alias!r} is a registered model's own id (models: {known})")
        if model not in model_ids:
            raise ConfigError(
                f"{name}: {alias!r} names {model!r}, which is not a registered model ({known})"
            )


def parse_max_options(env: Mapping[str, str]) -> int:
    """2..255 (the formats' own limit): at most 16 groups of at most 16 options."""
    name = "SEMIF_MAX_OPTIONS"
    text = env.get(name)
    if text is None:
        return MAX_OPTIONS_LIMIT
    limit = _counted(text, MAX_OPTIONS_LIMIT)
    if limit is None or limit < 2:
        raise ConfigError(
            f"{name}: must be an integer in [2, {MAX_OPTIONS_LIMIT}], got {_shown(text)}"
        )
    return limit


def parse_bind(text: str) -> str:
    host, separator, port = text.rpartition(":")
    if not separator or not host or not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
        raise ConfigError(f"SEMIF_BIND: must be HOST:PORT, got {text!r}")
    return text


def parse_revision(env: Mapping[str, str], model: str) -> str | None:
    """SEMIF_REVISION; unset, the default model's pinned commit when SEMIF_MODEL is that model,
    else none: a built-in model and a local folder name their own, and a hub id must pin one."""
    if "SEMIF_REVISION" not in env and model != DEFAULT_MODEL:
        return None
    return _nonempty(env, "SEMIF_REVISION", DEFAULT_REVISION)


def _nonempty(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, default)
    if not value.strip():
        raise ConfigError(f"{name}: must not be empty")
    return value

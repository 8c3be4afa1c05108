"""`Settings.from_env` as a whole: every SEMIF_* variable reaches its own field, every default is
the documented one, and docs/configuration.md lists exactly the variables the server reads."""

from pathlib import Path

import pytest

from semif_serve import config
from semif_serve.config import DEFAULT_BIND, DEFAULT_MODEL, DEFAULT_REVISION, Settings

TOKEN = "k" * 32
ADMIN = "a" * 40
ROOT = Path(__file__).resolve().parent.parent

# Every field's value when only the token is set (device cuda, the contract's defaults).
DEFAULTS = {
    "api_token": TOKEN,
    "model": DEFAULT_MODEL,
    "revision": DEFAULT_REVISION,
    "device": "cuda",
    "dtype": "bfloat16",
    "vram_cap_gib": None,
    "max_tokens": 4096,
    "max_decisions": 64,
    "max_body_bytes": 1 << 20,
    "max_queue": 32,
    "calibration": {},
    "bind": DEFAULT_BIND,
    "graceful_timeout_s": 60,
    "cache_dir": None,
    "require_fast_kernels": True,
    "parallel_slots": None,
    "models_file": None,
    "queue_timeout_s": 0.0,
    "admin_token": None,
    "max_loaded_models": None,
    "memory_budget_gib": None,
    "header_timeout_s": 10.0,
    "body_timeout_s": 30.0,
    "write_timeout_s": 30.0,
    "max_connections": 1000,
    "prefix_cache_gib": 8.0,
    "prefix_checkpoint_tokens": 1024,
    "max_batch_rows": 1,
    "max_batch_tokens": 16384,
    "batch_wait_ms": 0,
    "model_aliases": {},
    "hosted_model_names": True,
    "max_options": 255,
    "legacy_extension_block": False,
    "state_dir": None,
}

# (variable, a valid value other than the default, field, what the field then holds)
ONE_VARIABLE = [
    ("SEMIF_MODEL", "org/other-model", "model", "org/other-model"),
    ("SEMIF_REVISION", "0123abc", "revision", "0123abc"),
    ("SEMIF_DEVICE", "cuda:1", "device", "cuda:1"),
    ("SEMIF_DTYPE", "float16", "dtype", "float16"),
    ("SEMIF_VRAM_CAP_GIB", "12.5", "vram_cap_gib", 12.5),
    ("SEMIF_MAX_TOKENS", "100", "max_tokens", 100),
    ("SEMIF_MAX_DECISIONS", "7", "max_decisions", 7),
    ("SEMIF_MAX_BODY_BYTES", "2048", "max_body_bytes", 2048),
    ("SEMIF_MAX_QUEUE", "3", "max_queue", 3),
    ("SEMIF_BIND", "0.0.0.0:9000", "bind", "0.0.0.0:9000"),
    ("SEMIF_GRACEFUL_TIMEOUT_S", "5", "graceful_timeout_s", 5),
    ("SEMIF_CACHE_DIR", "/var/cache/semif", "cache_dir", Path("/var/cache/semif")),
    ("SEMIF_REQUIRE_FAST_KERNELS", "0", "require_fast_kernels", False),
    ("SEMIF_PARALLEL_SLOTS", "4", "parallel_slots", 4),
    ("SEMIF_MODELS_FILE", "/etc/semif/models.toml", "models_file", "/etc/semif/models.toml"),
    ("SEMIF_QUEUE_TIMEOUT_S", "2.5", "queue_timeout_s", 2.5),
    ("SEMIF_ADMIN_TOKEN", ADMIN, "admin_token", ADMIN),
    ("SEMIF_MAX_LOADED_MODELS", "2", "max_loaded_models", 2),
    ("SEMIF_MEMORY_BUDGET_GIB", "3", "memory_budget_gib", 3.0),
    ("SEMIF_HEADER_TIMEOUT_S", "2.5", "header_timeout_s", 2.5),
    ("SEMIF_BODY_TIMEOUT_S", "7", "body_timeout_s", 7.0),
    ("SEMIF_WRITE_TIMEOUT_S", "4", "write_timeout_s", 4.0),
    ("SEMIF_MAX_CONNECTIONS", "50", "max_connections", 50),
    ("SEMIF_PREFIX_CACHE_GIB", "0", "prefix_cache_gib", 0.0),
    ("SEMIF_PREFIX_CHECKPOINT_TOKENS", "64", "prefix_checkpoint_tokens", 64),
    ("SEMIF_MAX_BATCH_ROWS", "16", "max_batch_rows", 16),
    ("SEMIF_MAX_BATCH_TOKENS", "4096", "max_batch_tokens", 4096),
    ("SEMIF_BATCH_WAIT_MS", "5", "batch_wait_ms", 5),
    ("SEMIF_MODEL_ALIASES", "jev-latest=default", "model_aliases", {"jev-latest": "default"}),
    ("SEMIF_HOSTED_MODEL_NAMES", "0", "hosted_model_names", False),
    ("SEMIF_MAX_OPTIONS", "16", "max_options", 16),
    ("SEMIF_LEGACY_EXTENSION_BLOCK", "1", "legacy_extension_block", True),
    ("SEMIF_STATE_DIR", "/var/lib/semif", "state_dir", Path("/var/lib/semif")),
]


def fields(settings: Settings) -> dict:
    values = {name: getattr(settings, name) for name in DEFAULTS}
    values["calibration"] = dict(values["calibration"])
    return values


def test_only_the_token_set_gives_every_documented_default():
    assert fields(Settings.from_env({"SEMIF_API_TOKEN": TOKEN})) == DEFAULTS


def test_the_table_covers_every_field_of_settings():
    names = set(Settings.__dataclass_fields__)
    assert names == set(DEFAULTS)
    assert {field for _, _, field, _ in ONE_VARIABLE} | {"api_token", "calibration"} == names


@pytest.mark.parametrize(("variable", "text", "field", "expected"), ONE_VARIABLE)
def test_each_variable_sets_its_own_field_and_nothing_else(variable, text, field, expected):
    settings = Settings.from_env({"SEMIF_API_TOKEN": TOKEN, variable: text})
    assert getattr(settings, field) == expected
    changed = {name: value for name, value in fields(settings).items() if value != DEFAULTS[name]}
    # The device also chooses the dtype and the fast-kernel requirement (below); another model
    # has no default revision (test_the_default_revision_is_the_default_models_only).
    assert set(changed) == {field} | ({"revision"} if variable == "SEMIF_MODEL" else set())


@pytest.mark.parametrize(
    ("env", "revision"),
    [
        ({}, DEFAULT_REVISION),
        ({"SEMIF_MODEL": DEFAULT_MODEL}, DEFAULT_REVISION),
        ({"SEMIF_MODEL": "builtin:smollm2-135m"}, None),  # it names its own
        ({"SEMIF_MODEL": "/models/mine"}, None),  # a folder's is its files' digest
        ({"SEMIF_MODEL": "org/other-model"}, None),  # a hub id must pin one: refused at load
        ({"SEMIF_MODEL": "org/other-model", "SEMIF_REVISION": "0123abc"}, "0123abc"),
        ({"SEMIF_MODEL": "builtin:smollm2-135m", "SEMIF_REVISION": "mine"}, "mine"),
    ],
)
def test_the_default_revision_is_the_default_models_only(env, revision):
    """Issue 24: one revision per model: the default model's pinned commit no longer labels a
    built-in model or a folder (GET /v1/models showed it for builtin:smollm2-135m)."""
    settings = Settings.from_env({"SEMIF_API_TOKEN": TOKEN, **env})
    assert settings.revision == revision
    assert settings.model == env.get("SEMIF_MODEL", DEFAULT_MODEL)


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        ({"avx512f", "avx512_bf16"}, "bfloat16"),  # the development EPYC
        ({"avx512f", "amx_tile", "amx_bf16"}, "bfloat16"),  # an AMX Xeon
        ({"avx2", "avx512f", "avx512_vnni"}, "float32"),  # emulated bfloat16: ~5.7x slower
        (set(), "float32"),  # no /proc/cpuinfo to read
    ],
)
def test_the_cpu_device_defaults_to_bfloat16_where_native_and_does_not_require_fast_kernels(
    flags, dtype
):
    """Issue 44: bfloat16 where the CPU computes it natively (its paths agree bit for bit under
    the invariant numerics), float32 elsewhere; SEMIF_DTYPE chooses either."""
    env = {"SEMIF_API_TOKEN": TOKEN, "SEMIF_DEVICE": "cpu"}
    settings = config.settings_from_env(env, cpu_flags=frozenset(flags))
    assert (settings.device, settings.dtype, settings.require_fast_kernels) == ("cpu", dtype, False)
    for chosen in ("float32", "bfloat16"):
        explicit = config.settings_from_env(env | {"SEMIF_DTYPE": chosen}, frozenset(flags))
        assert explicit.dtype == chosen
    gpu = config.settings_from_env({"SEMIF_API_TOKEN": TOKEN}, cpu_flags=frozenset(flags))
    assert gpu.dtype == "bfloat16"
    required = config.settings_from_env(
        env | {"SEMIF_REQUIRE_FAST_KERNELS": "1"}, cpu_flags=frozenset(flags)
    )
    assert required.require_fast_kernels is True


def test_the_cpu_flags_are_the_first_processors(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_bytes(
        b"processor\t: 0\nmodel name\t: AMD EPYC\xae\nflags\t\t: fpu avx512f avx512_bf16\n\n"
        b"processor\t: 1\nflags\t\t: fpu\n"
    )
    assert config.read_cpu_flags(cpuinfo) == {"fpu", "avx512f", "avx512_bf16"}
    cpuinfo.write_text("flags\t\t: fpu x:y\n")  # the value is all after the first colon
    assert config.read_cpu_flags(cpuinfo) == {"fpu", "x:y"}
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # an Arm machine's
    assert config.read_cpu_flags(cpuinfo) == frozenset()
    assert config.read_cpu_flags(tmp_path / "missing") == frozenset()


def test_the_machines_own_flags_choose_the_cpu_default(monkeypatch):
    """For the server and for `score`, `evaluate` and `calibrate` run locally (`default_dtype`)."""
    cpu = {"SEMIF_API_TOKEN": TOKEN, "SEMIF_DEVICE": "cpu"}
    monkeypatch.setattr(config, "read_cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert Settings.from_env(cpu).dtype == config.default_dtype("cpu") == "bfloat16"
    monkeypatch.setattr(config, "read_cpu_flags", lambda: frozenset({"avx2"}))
    assert Settings.from_env(cpu).dtype == config.default_dtype("cpu") == "float32"
    assert config.default_dtype("cuda") == config.default_dtype("cuda:1") == "bfloat16"


def test_the_prefix_cache_budget_defaults_by_device_and_takes_0_to_1024_gib():
    cpu = Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_DEVICE": "cpu"})
    gpu = Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_DEVICE": "cuda:0"})
    assert (cpu.prefix_cache_gib, gpu.prefix_cache_gib) == (1.0, 8.0)
    for text, value in [("0", 0.0), ("0.25", 0.25), ("1024", 1024.0)]:
        settings = Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_PREFIX_CACHE_GIB": text})
        assert settings.prefix_cache_gib == value
    for text in ["-1", "1024.5", "nan", "inf", "", "1e400", "lots", "0x10"]:
        with pytest.raises(config.ConfigError) as refused:
            Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_PREFIX_CACHE_GIB": text})
        assert str(refused.value).startswith("SEMIF_PREFIX_CACHE_GIB: ")
        assert repr(text) in str(refused.value)


def test_the_batch_limits_default_by_device_as_measured():
    """docs/performance.md, "Dynamic batching": the CPU batches up to 1,024 padded tokens of 16
    rows; CUDA stays unbatched until a GPU run measures it. The variables override both."""
    cpu = Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_DEVICE": "cpu"})
    gpu = Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_DEVICE": "cuda:1"})
    assert (cpu.max_batch_rows, cpu.max_batch_tokens) == (16, 1024)
    assert (gpu.max_batch_rows, gpu.max_batch_tokens) == (1, 16384)
    chosen = Settings.from_env(
        {
            "SEMIF_API_TOKEN": TOKEN,
            "SEMIF_DEVICE": "cpu",
            "SEMIF_MAX_BATCH_ROWS": "1",
            "SEMIF_MAX_BATCH_TOKENS": "9",
        }
    )
    assert (chosen.max_batch_rows, chosen.max_batch_tokens) == (1, 9)


def test_the_calibration_variable_loads_its_file(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text('{"triage": 1.5}', encoding="utf-8")
    settings = Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_CALIBRATION": str(path)})
    assert dict(settings.calibration) == {"triage": 1.5}


@pytest.mark.parametrize("variable", ["SEMIF_MODELS_FILE", "SEMIF_CACHE_DIR"])
def test_an_empty_path_variable_means_unset(variable):
    settings = Settings.from_env({"SEMIF_API_TOKEN": TOKEN, variable: ""})
    assert getattr(settings, variable.removeprefix("SEMIF_").lower()) is None


@pytest.mark.parametrize(
    "variable",
    # Any path is a valid SEMIF_MODELS_FILE, SEMIF_CACHE_DIR or SEMIF_STATE_DIR until it is used
    # (then checked; the state folder as `semif-serve serve` starts: tests/test_management_state.py).
    [
        v
        for v, *_ in ONE_VARIABLE
        if v not in ("SEMIF_MODELS_FILE", "SEMIF_CACHE_DIR", "SEMIF_STATE_DIR")
    ]
    + ["SEMIF_API_TOKEN", "SEMIF_CALIBRATION"],
)
def test_a_bad_value_of_each_variable_is_refused_naming_it(variable, tmp_path):
    bad = {
        "SEMIF_MODEL": " ",
        "SEMIF_REVISION": "",
        "SEMIF_CALIBRATION": str(tmp_path / "missing.json"),
        "SEMIF_ADMIN_TOKEN": "short",
        "SEMIF_API_TOKEN": "short",
    }.get(variable, "-1x")
    env = {"SEMIF_API_TOKEN": TOKEN, variable: bad}
    with pytest.raises(config.ConfigError, match=rf"^{variable}: "):
        Settings.from_env(env)


def test_the_process_environment_is_read_when_no_mapping_is_given(monkeypatch):
    monkeypatch.setenv("SEMIF_API_TOKEN", TOKEN)
    monkeypatch.setenv("SEMIF_MAX_QUEUE", "5")
    assert Settings.from_env().max_queue == 5


@pytest.mark.parametrize("text", ["1e300", "86400.5", "inf", "nan", "-1"])
def test_the_queue_timeout_is_at_most_a_day(text):
    with pytest.raises(config.ConfigError, match=r"^SEMIF_QUEUE_TIMEOUT_S: .*\[0, 86400\]"):
        Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_QUEUE_TIMEOUT_S": text})
    day = Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_QUEUE_TIMEOUT_S": "86400"})
    assert day.queue_timeout_s == 86400.0


@pytest.mark.parametrize("device", ["cuda:٣", "cuda:", "cuda:1x", "CPU"])
def test_a_device_index_is_ascii_digits(device):
    with pytest.raises(config.ConfigError, match=r"^SEMIF_DEVICE: "):
        Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_DEVICE": device})


@pytest.mark.parametrize(
    ("text", "accepted"),
    [("127.0.0.1:65535", True), ("127.0.0.1:65536", False), ("[::1]:8080", True),
     (":8080", False), ("localhost:", False), ("8080", False)],
)  # fmt: skip
def test_bind_is_host_colon_port_split_at_the_last_colon(text, accepted):
    env = {"SEMIF_API_TOKEN": TOKEN, "SEMIF_BIND": text}
    if accepted:
        assert Settings.from_env(env).bind == text
    else:
        with pytest.raises(config.ConfigError, match=r"^SEMIF_BIND: must be HOST:PORT"):
            Settings.from_env(env)


@pytest.mark.parametrize(("text", "expected"), [("0", 0.0), ("0.5", 0.5), ("86400", 86400.0)])
def test_the_queue_timeout_takes_zero_and_fractions(text, expected):
    env = {"SEMIF_API_TOKEN": TOKEN, "SEMIF_QUEUE_TIMEOUT_S": text}
    assert Settings.from_env(env).queue_timeout_s == expected


@pytest.mark.parametrize(
    ("text", "accepted"), [("1", True), ("16", True), ("17", False), ("0", False)]
)
def test_parallel_slots_are_1_to_16(text, accepted):
    env = {"SEMIF_API_TOKEN": TOKEN, "SEMIF_PARALLEL_SLOTS": text}
    if accepted:
        assert Settings.from_env(env).parallel_slots == int(text)
    else:
        with pytest.raises(
            config.ConfigError, match=r"^SEMIF_PARALLEL_SLOTS: must be an integer 1..16"
        ):
            Settings.from_env(env)


def test_a_bad_dtype_names_the_choices():
    with pytest.raises(config.ConfigError) as error:
        Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_DTYPE": "fp8"})
    assert str(error.value) == ("SEMIF_DTYPE: must be one of float32, bfloat16, float16, got 'fp8'")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", 0), ("1", 1), ("1000", 1000), ("-1", None), ("1001", None), ("5ms", None), (" 5", None)],
)
def test_the_batch_wait_is_whole_milliseconds_up_to_a_second(text, expected):
    env = {"SEMIF_API_TOKEN": TOKEN, "SEMIF_BATCH_WAIT_MS": text}
    if expected is None:
        with pytest.raises(config.ConfigError, match=r"^SEMIF_BATCH_WAIT_MS: must be an integer"):
            Settings.from_env(env)
        return
    assert Settings.from_env(env).batch_wait_ms == expected


@pytest.mark.parametrize(
    ("variable", "most"),
    [("SEMIF_MAX_BATCH_ROWS", 1024), ("SEMIF_MAX_BATCH_TOKENS", 1 << 24)],
)
def test_the_batch_limits_are_bounded(variable, most):
    assert (
        getattr(
            Settings.from_env({"SEMIF_API_TOKEN": TOKEN, variable: str(most)}), variable[6:].lower()
        )
        == most
    )
    with pytest.raises(
        config.ConfigError, match=rf"^{variable}: must be an integer in \[1, {most}\]"
    ):
        Settings.from_env({"SEMIF_API_TOKEN": TOKEN, variable: str(most + 1)})


def test_the_checkpoint_spacing_takes_64_to_a_million_tokens():
    for text, value in [("64", 64), ("0512", 512), (str(1 << 20), 1 << 20)]:
        env = {"SEMIF_API_TOKEN": TOKEN, "SEMIF_PREFIX_CHECKPOINT_TOKENS": text}
        assert Settings.from_env(env).prefix_checkpoint_tokens == value
    for text, shown in [("63", "at least 64 tokens, got 63"), ("0", "[1, 1048576]")]:
        with pytest.raises(config.ConfigError) as refused:
            Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_PREFIX_CHECKPOINT_TOKENS": text})
        assert str(refused.value).startswith("SEMIF_PREFIX_CHECKPOINT_TOKENS: must be ")
        assert shown in str(refused.value)
    for text in ["1048577", "1e3", "", "9" * 400]:
        with pytest.raises(config.ConfigError, match="^SEMIF_PREFIX_CHECKPOINT_TOKENS: "):
            Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_PREFIX_CHECKPOINT_TOKENS": text})


@pytest.mark.parametrize(("text", "limit"), [("2", 2), ("17", 17), ("0255", 255)])
def test_max_options_is_2_to_255(text, limit):
    env = {"SEMIF_API_TOKEN": TOKEN, "SEMIF_MAX_OPTIONS": text}
    assert Settings.from_env(env).max_options == limit


@pytest.mark.parametrize("text", ["1", "0", "256", "-3", "1e2", ""])
def test_max_options_outside_2_to_255_stops_the_start(text):
    message = rf"^SEMIF_MAX_OPTIONS: must be an integer in \[2, 255\], got '{text}'$"
    with pytest.raises(config.ConfigError, match=message):
        Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_MAX_OPTIONS": text})

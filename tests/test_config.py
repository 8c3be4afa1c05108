"""Startup validation: every bad SEMIF_* value stops startup with an error naming the variable."""

import json

import pytest

from semif_serve import config
from semif_serve.config import DEFAULT_MODEL, DEFAULT_REVISION, ConfigError, Settings

TOKEN = "k" * 32


def settings(**env):
    return Settings.from_env({"SEMIF_API_TOKEN": TOKEN, **env})


def test_defaults_follow_the_contract():
    s = settings()
    assert (s.model, s.revision, s.device, s.dtype) == (
        DEFAULT_MODEL,
        DEFAULT_REVISION,
        "cuda",
        "bfloat16",
    )
    assert (s.max_tokens, s.max_decisions, s.max_body_bytes, s.max_queue) == (4096, 64, 1 << 20, 32)
    assert s.vram_cap_gib is None and dict(s.calibration) == {} and s.bind == "127.0.0.1:8471"
    native = config.read_cpu_flags() & config.NATIVE_BFLOAT16_FLAGS  # this machine's CPU
    assert settings(SEMIF_DEVICE="cpu").dtype == ("bfloat16" if native else "float32")
    assert TOKEN not in repr(s)


def test_settings_are_frozen():
    s = settings()
    with pytest.raises(AttributeError):
        s.max_tokens = 1
    with pytest.raises(TypeError):
        s.calibration["x"] = 1.0


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"SEMIF_API_TOKEN": ""}, "SEMIF_API_TOKEN: required"),
        ({"SEMIF_API_TOKEN": "k" * 31}, "SEMIF_API_TOKEN: must be at least 32"),
        ({"SEMIF_API_TOKEN": "k" * 31 + " "}, "SEMIF_API_TOKEN: only visible ASCII"),
        ({"SEMIF_API_TOKEN": "k" * 32 + "\n"}, "SEMIF_API_TOKEN: only visible ASCII"),
        ({"SEMIF_API_TOKEN": "k" * 32 + "\r"}, "SEMIF_API_TOKEN: only visible ASCII"),
        ({"SEMIF_API_TOKEN": "k" * 32 + "\x00"}, "SEMIF_API_TOKEN: only visible ASCII"),
        ({"SEMIF_API_TOKEN": "k" * 32 + "é"}, "SEMIF_API_TOKEN: only visible ASCII"),
        ({"SEMIF_API_TOKEN": "k" * 32 + "\x7f"}, "SEMIF_API_TOKEN: only visible ASCII"),
        (
            {"SEMIF_ADMIN_TOKEN": "k" * 31},
            "SEMIF_ADMIN_TOKEN: must be at least 32 characters, got 31",
        ),
        ({"SEMIF_ADMIN_TOKEN": "k" * 32 + "\n"}, "SEMIF_ADMIN_TOKEN: only visible ASCII"),
        ({"SEMIF_VRAM_CAP_GIB": "0"}, "SEMIF_VRAM_CAP_GIB: must be finite and > 0"),
        ({"SEMIF_VRAM_CAP_GIB": "-1"}, "SEMIF_VRAM_CAP_GIB"),
        ({"SEMIF_VRAM_CAP_GIB": "inf"}, "SEMIF_VRAM_CAP_GIB"),
        ({"SEMIF_VRAM_CAP_GIB": "nan"}, "SEMIF_VRAM_CAP_GIB"),
        ({"SEMIF_VRAM_CAP_GIB": "lots"}, "SEMIF_VRAM_CAP_GIB"),
        ({"SEMIF_DEVICE": "gpu"}, "SEMIF_DEVICE"),
        ({"SEMIF_DTYPE": "fp8"}, "SEMIF_DTYPE"),
        ({"SEMIF_MODEL": " "}, "SEMIF_MODEL"),
        ({"SEMIF_BIND": "8471"}, "SEMIF_BIND"),
        ({"SEMIF_BIND": "127.0.0.1:99999"}, "SEMIF_BIND"),
    ],
)
def test_bad_values_name_their_variable(env, variable):
    with pytest.raises(ConfigError) as caught:
        settings(**env)
    assert str(caught.value).startswith(variable.split(":")[0])
    assert variable in str(caught.value)


def test_an_admin_token_equal_to_the_api_token_is_refused_naming_both():
    """Issue 30: with both tokens the same, every caller of the API was an admin."""
    with pytest.raises(ConfigError) as caught:
        settings(SEMIF_ADMIN_TOKEN=TOKEN)
    message = str(caught.value)
    assert message == (
        "SEMIF_ADMIN_TOKEN: must differ from SEMIF_API_TOKEN (with the same value every caller "
        "holding the API token could register, reconfigure and unload models)"
    )
    assert TOKEN not in message  # a token is never echoed
    assert settings(SEMIF_ADMIN_TOKEN=TOKEN + "x").admin_token == TOKEN + "x"  # a longer one is not
    assert settings(SEMIF_ADMIN_TOKEN=TOKEN[:-1] + "K").admin_token == TOKEN[:-1] + "K"


def test_the_visible_ascii_range_is_33_to_126_inclusive():
    token = "!" * 16 + "~" * 16  # chr(33) and chr(126), the ends of the range
    assert settings(SEMIF_API_TOKEN=token).api_token == token
    admin = "~" * 40
    assert settings(SEMIF_ADMIN_TOKEN=admin).admin_token == admin
    assert settings().admin_token is None


def test_the_token_is_required():
    with pytest.raises(ConfigError, match="SEMIF_API_TOKEN: required"):
        Settings.from_env({})


# Every integer limit and its upper bound.
LIMITS = {
    "SEMIF_MAX_TOKENS": 1 << 20,
    "SEMIF_MAX_DECISIONS": 1 << 16,
    "SEMIF_MAX_BODY_BYTES": 1 << 30,
    "SEMIF_MAX_QUEUE": 4096,
    "SEMIF_GRACEFUL_TIMEOUT_S": 86400,
    "SEMIF_MAX_LOADED_MODELS": 1024,
    "SEMIF_MAX_CONNECTIONS": 1 << 16,
}


@pytest.mark.parametrize("name", LIMITS)
@pytest.mark.parametrize("value", ["0", "-1", "1.5", "", " 5", "٥", "1_0", "ten", "1e3"])
def test_every_limit_is_an_integer_of_at_least_one(name, value):
    with pytest.raises(ConfigError) as refused:
        settings(**{name: value})
    assert str(refused.value) == f"{name}: must be an integer in [1, {LIMITS[name]}], got {value!r}"


@pytest.mark.parametrize("name", LIMITS)
def test_every_limit_takes_one_and_its_bound_and_refuses_one_more(name):
    field = name.removeprefix("SEMIF_").lower()
    assert getattr(settings(**{name: "1"}), field) == 1
    assert getattr(settings(**{name: str(LIMITS[name])}), field) == LIMITS[name]
    with pytest.raises(ConfigError, match=rf"^{name}: must be an integer in \[1, {LIMITS[name]}\]"):
        settings(**{name: str(LIMITS[name] + 1)})


@pytest.mark.parametrize(
    ("name", "field"),
    [("SEMIF_MAX_QUEUE", "max_queue"), ("SEMIF_PARALLEL_SLOTS", "parallel_slots")],
)
def test_thousands_of_digits_are_read_or_refused_never_a_crash(name, field):
    # int() raises its own ValueError past 4,300 digits: the length is checked first.
    for text in ("9" * 5000, "0" * 5000):
        with pytest.raises(
            ConfigError, match=rf"^{name}: must be an integer .*\(5000 characters\)$"
        ):
            settings(**{name: text})
    assert getattr(settings(**{name: "0" * 5000 + "7"}), field) == 7


def test_a_400_digit_limit_is_refused_and_shown_cut():
    with pytest.raises(ConfigError) as refused:
        settings(SEMIF_MAX_TOKENS="9" * 400)
    assert str(refused.value) == (
        f"SEMIF_MAX_TOKENS: must be an integer in [1, {1 << 20}], got "
        f"{'9' * 40!r}... (400 characters)"
    )
    with pytest.raises(ConfigError, match=r", got '9{40}'$"):
        settings(SEMIF_MAX_TOKENS="9" * 40)
    with pytest.raises(ConfigError, match=r", got '9{40}'\.\.\. \(41 characters\)$"):
        settings(SEMIF_MAX_TOKENS="9" * 41)


def test_limits_and_cap_are_parsed():
    s = settings(
        SEMIF_MAX_TOKENS="1",
        SEMIF_MAX_QUEUE="2",
        SEMIF_VRAM_CAP_GIB="6.5",
        SEMIF_BIND="0.0.0.0:9000",
    )
    assert (s.max_tokens, s.max_queue, s.vram_cap_gib, s.bind) == (1, 2, 6.5, "0.0.0.0:9000")
    assert settings(SEMIF_VRAM_CAP_GIB="0.5").vram_cap_gib == 0.5  # any cap > 0, also under 1


def test_read_deadlines_and_the_connection_cap_have_defaults_and_parse():
    s = settings()
    assert (s.header_timeout_s, s.body_timeout_s, s.max_connections) == (10.0, 30.0, 1000)
    s = settings(
        SEMIF_HEADER_TIMEOUT_S="0.5", SEMIF_BODY_TIMEOUT_S="120", SEMIF_MAX_CONNECTIONS="300"
    )
    assert (s.header_timeout_s, s.body_timeout_s, s.max_connections) == (0.5, 120.0, 300)


@pytest.mark.parametrize(
    "name", ["SEMIF_HEADER_TIMEOUT_S", "SEMIF_BODY_TIMEOUT_S", "SEMIF_WRITE_TIMEOUT_S"]
)
@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ("0", "must be finite and > 0"),
        ("-1", "must be finite and > 0"),
        ("inf", "must be finite and > 0"),
        ("nan", "must be finite and > 0"),
        ("", "must be a number of seconds"),
        ("soon", "must be a number of seconds"),
    ],
)
def test_a_read_deadline_must_be_a_finite_number_of_seconds_over_zero(name, value, rule):
    with pytest.raises(ConfigError, match=f"^{name}: {rule}"):
        settings(**{name: value})


def write(tmp_path, content):
    path = tmp_path / "calibration.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_a_calibration_file_loads(tmp_path):
    s = settings(SEMIF_CALIBRATION=write(tmp_path, {"triage": 1.23, "edge": 20, "low": 0.05}))
    assert dict(s.calibration) == {"triage": 1.23, "edge": 20.0, "low": 0.05}


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "is not valid JSON"),
        ('{"triage": NaN}', "is not valid JSON: NaN is not a JSON number"),
        ("[1.0]", "must hold a JSON object"),
        ({"triage": "1.2"}, "must be a finite number"),
        ({"triage": True}, "must be a finite number"),
        ({"triage": None}, "must be a finite number"),
        ({"triage": 1e400}, "must be a finite number"),
        ({"triage": 0.049}, "must be in [0.05, 20.0]"),
        ({"triage": 20.01}, "must be in [0.05, 20.0]"),
        ({"triage": 0}, "must be in [0.05, 20.0]"),
        ({" ": 1.0}, "workload names must be nonempty"),
    ],
)
def test_a_bad_calibration_file_stops_startup(tmp_path, content, fragment):
    if isinstance(content, dict) and content.get("triage") == 1e400:
        content = '{"triage": 1e400}'
    with pytest.raises(ConfigError, match="^SEMIF_CALIBRATION") as caught:
        settings(SEMIF_CALIBRATION=write(tmp_path, content))
    assert fragment in str(caught.value)


def test_an_unreadable_calibration_file_stops_startup(tmp_path):
    with pytest.raises(ConfigError, match="^SEMIF_CALIBRATION: cannot read .*Is a directory"):
        settings(SEMIF_CALIBRATION=str(tmp_path))


def test_a_missing_calibration_file_stops_startup(tmp_path):
    with pytest.raises(ConfigError, match="SEMIF_CALIBRATION: file .* does not exist"):
        settings(SEMIF_CALIBRATION=str(tmp_path / "absent.json"))


def test_the_serve_command_refuses_a_bad_value_with_exit_2(capsys, monkeypatch):
    from semif_serve.cli import main

    monkeypatch.setenv("SEMIF_API_TOKEN", "short")
    assert main(["serve"]) == 2
    assert "SEMIF_API_TOKEN: must be at least 32 characters" in capsys.readouterr().err

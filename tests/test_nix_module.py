"""nix/module.nix (services.semif-serve), evaluated with nixpkgs' lib and `nix-instantiate`:
its documented defaults, the option types that refuse bad values (as the server would at start),
its assertions, and the systemd unit it produces (issue 32, item 5).

nixpkgs itself is not needed: tests/nix/eval-module.nix runs `lib.evalModules` over the module
with stub declarations of the NixOS options it sets and a stub `pkgs`, and each test reads one
attribute of that evaluation as JSON. The lib comes from ../shared/nixpkgs-lib next to the
repository; without it or without nix-instantiate (Debian: nix-bin) the whole file is skipped.
"""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from semif_serve.config import (
    DEFAULT_BIND,
    DEFAULT_MODEL,
    DEFAULT_REVISION,
    MAX_BODY_BYTES_LIMIT,
    MAX_CONNECTIONS_LIMIT,
    MAX_DECISIONS_LIMIT,
    MAX_PREFIX_CACHE_GIB,
    MAX_QUEUE_LIMIT,
    MAX_TOKENS_LIMIT,
    MAX_WAIT_S,
    ConfigError,
    parse_bind,
    settings_from_env,
)

REPOSITORY = Path(__file__).resolve().parents[1]
NIXPKGS_LIB = Path(__file__).resolve().parents[2] / "shared" / "nixpkgs-lib" / "lib"
EVAL_MODULE = REPOSITORY / "tests" / "nix" / "eval-module.nix"
NIX_INSTANTIATE = shutil.which("nix-instantiate")

if NIX_INSTANTIATE is None:
    pytest.skip(
        "nix-instantiate is not installed (on Debian: apt-get install nix-bin)",
        allow_module_level=True,
    )
if not (NIXPKGS_LIB / "default.nix").is_file():
    pytest.skip(f"nixpkgs' lib is not at {NIXPKGS_LIB}", allow_module_level=True)

NIX_TIMEOUT_S = 120
API_TOKEN_FILE = "/run/secrets/semif-api-token"
ADMIN_TOKEN_FILE = "/run/secrets/semif-admin-token"
# eval-module.nix's stub package: a store path as a plain string (no derivation is ever built).
PACKAGE = "/nix/store/00000000000000000000000000000000-semif-serve"
# The least a host sets: the token file has no default, and evaluating without it fails.
ENABLED = {"enable": True, "apiTokenFile": API_TOKEN_FILE}
LIMIT_OPTIONS = [
    "maxTokens",
    "maxDecisions",
    "maxBodyBytes",
    "maxQueue",
    "maxConnections",
    "headerTimeoutSec",
    "bodyTimeoutSec",
]
# The server's token rule, for settings_from_env over what the module writes.
SERVER_TOKEN = {"SEMIF_API_TOKEN": "k" * 32}
HOME_ASSERTION = (
    "services.semif-serve.hfCacheDir: the unit cannot see /home, /root or /run/user"
    " (ProtectHome); move the cache, e.g. to /srv/hf-cache/hub."
)
CALIBRATION_ASSERTION = (
    "services.semif-serve.calibrationFile: the unit cannot see /home, /root or /run/user"
    " (ProtectHome), nor the host's /tmp and /var/tmp (PrivateTmp); move the file, e.g. to"
    " /etc/semif-serve/calibration.json."
)
# Each integer limit, its variable and the server's upper bound (semif_serve/config.py).
INTEGER_BOUNDS = [
    ("maxTokens", "SEMIF_MAX_TOKENS", MAX_TOKENS_LIMIT),
    ("maxDecisions", "SEMIF_MAX_DECISIONS", MAX_DECISIONS_LIMIT),
    ("maxBodyBytes", "SEMIF_MAX_BODY_BYTES", MAX_BODY_BYTES_LIMIT),
    ("maxQueue", "SEMIF_MAX_QUEUE", MAX_QUEUE_LIMIT),
    ("maxConnections", "SEMIF_MAX_CONNECTIONS", MAX_CONNECTIONS_LIMIT),
    ("gracefulTimeoutSec", "SEMIF_GRACEFUL_TIMEOUT_S", int(MAX_WAIT_S)),
]
# Binds the module accepts, edges included; each one the server's parse_bind accepts too.
GOOD_BINDS = [
    "127.0.0.1:8471",
    "0.0.0.0:1",
    "255.255.255.255:65535",
    "[::1]:8471",
    "[::]:8471",
    "[2001:db8::5]:80",
    "[::ffff:192.0.2.1]:80",
    "[1:2:3:4:5:6:7:8]:80",
    "[1:2:3:4:5:6:7::]:80",
    "[FE80::A]:80",
    "localhost:8471",
    "my-host.example.org:443",
    "a:80",
    "10-0-0-1.lan:80",
]


@pytest.fixture(scope="module")
def nix_env(tmp_path_factory) -> dict[str, str]:
    """No daemon and a throwaway state folder and home: --eval builds nothing, but nix still
    opens its store and may write caches under $HOME."""
    home = tmp_path_factory.mktemp("nix-home")
    return {
        "PATH": str(Path(NIX_INSTANTIATE).parent),
        "HOME": str(home),
        "NIX_REMOTE": "",
        "NIX_STATE_DIR": str(home / "state"),
        "XDG_CACHE_HOME": str(home / "cache"),
    }


@pytest.fixture
def evaluate(nix_env):
    """evaluate(attribute, settings): nix-instantiate's run over eval-module.nix's `attribute`
    with `settings` as services.semif-serve's definitions."""

    def run(attribute: str, settings: dict) -> subprocess.CompletedProcess[str]:
        command = [
            NIX_INSTANTIATE,
            "--eval",
            "--strict",
            "--json",
            str(EVAL_MODULE),
            "-A",
            attribute,
            "--argstr",
            "libDir",
            str(NIXPKGS_LIB),
            "--argstr",
            "settingsJson",
            json.dumps(settings),
        ]
        return subprocess.run(
            command, env=nix_env, capture_output=True, text=True, timeout=NIX_TIMEOUT_S
        )

    return run


@pytest.fixture
def value_of(evaluate):
    """value_of(attribute, settings): the attribute as Python data; the evaluation must succeed."""

    def read(attribute: str, settings: dict):
        result = evaluate(attribute, settings)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    return read


@pytest.fixture
def error_of(evaluate):
    """error_of(attribute, settings): nix-instantiate's error; the evaluation must fail."""

    def read(attribute: str, settings: dict) -> str:
        result = evaluate(attribute, settings)
        assert result.returncode != 0, f"evaluated: {result.stdout}"
        return result.stderr

    return read


def probed_url(health_script: str) -> str:
    """The URL the ExecStartPost script polls: the last word of its `until curl ...; do` line,
    unquoted the way the shell reads it."""
    (line,) = [line for line in health_script.splitlines() if line.startswith("until curl ")]
    assert line.endswith("; do"), line
    return shlex.split(line.removeprefix("until ").removesuffix("; do"))[-1]


# --- defaults -----------------------------------------------------------------------------------


def test_disabled_module_adds_no_unit_and_no_assertion(value_of):
    assert value_of("unit", {}) is None
    assert value_of("failedAssertions", {}) == []


def test_enabling_without_an_api_token_file_fails_naming_the_option(error_of):
    error = error_of("unit", {"enable": True})
    assert "`services.semif-serve.apiTokenFile' was accessed but has no value defined" in error


def test_defaults_are_the_documented_ones(value_of):
    assert value_of("settings", ENABLED) == {
        "enable": True,
        "package": PACKAGE,
        "apiTokenFile": API_TOKEN_FILE,
        "adminTokenFile": None,
        "model": "Qwen/Qwen3.5-4B",
        "revision": "851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a",
        "hfCacheDir": None,
        "supplementaryGroups": [],
        "gpu": 0,
        "vramCapGib": None,
        "prefixCacheGib": None,
        "maxTokens": None,
        "maxDecisions": None,
        "maxBodyBytes": None,
        "maxQueue": None,
        "maxConnections": None,
        "headerTimeoutSec": None,
        "bodyTimeoutSec": None,
        "calibrationFile": None,
        "bind": "127.0.0.1:8471",
        "gracefulTimeoutSec": 60,
        "startupTimeoutSec": 600,
        "environment": {},
    }


def test_defaults_are_the_servers_own(value_of):
    """The module repeats the server's defaults; a changed one in semif_serve/config.py must be
    changed here too, or a NixOS host would quietly run something else than the docs say."""
    settings = value_of("settings", ENABLED)
    assert (settings["model"], settings["revision"], settings["bind"]) == (
        DEFAULT_MODEL,
        DEFAULT_REVISION,
        DEFAULT_BIND,
    )


def test_default_environment_is_exactly_the_fixed_one(value_of):
    """Unset options add no variable: the server's own defaults apply."""
    assert value_of("unit", ENABLED)["environment"] == {
        "SEMIF_MODEL": "Qwen/Qwen3.5-4B",
        "SEMIF_REVISION": "851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a",
        "SEMIF_DEVICE": "cuda",
        "SEMIF_BIND": "127.0.0.1:8471",
        "SEMIF_GRACEFUL_TIMEOUT_S": "60",
        "SEMIF_CACHE_DIR": "/var/cache/semif-serve",
        "SEMIF_KERNEL_CACHE_DIR": "/var/lib/semif-serve/kernels",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "0",
        "HOME": "/var/lib/semif-serve",
        "XDG_CACHE_HOME": "/var/cache/semif-serve",
        "HF_HOME": "/var/cache/semif-serve/huggingface",
    }


# --- option types -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("bind", "8765"),
        ("bind", "not an address"),
        ("bind", "not an address:80"),  # any text before the colon was taken
        ("bind", "127.0.0.1:"),
        ("bind", ":8471"),
        ("bind", "127.0.0.1:84x1"),
        ("bind", "127.0.0.1:65536"),  # the server: at most 65535
        ("bind", "127.0.0.1:99999"),
        ("bind", "127.0.0.1:123456"),  # the server: at most 5 digits
        ("bind", "127.0.0.1:0"),  # any free port: the health check could not know which
        ("bind", "127.0.0.1:08471"),
        ("bind", "::1:8471"),  # unbracketed IPv6: http://::1:8471/health is no URL
        ("bind", "[::1]"),
        ("bind", "[::1]8471"),
        ("bind", "[1::2::3]:80"),
        ("bind", "[1:2:3]:80"),
        ("bind", "[1:2:3:4:5:6:7:8:9]:80"),
        ("bind", "[12345::]:80"),
        ("bind", "[fe80::1%eth0]:8471"),  # a zone id: curl's URL would need %25
        ("bind", "[]:80"),
        ("bind", "[127.0.0.1]:80"),
        ("bind", "256.0.0.1:80"),
        ("bind", "999.1.1.1:80"),
        ("bind", "127.1:80"),
        ("bind", "010.0.0.1:80"),  # octal to inet_aton
        ("bind", "1.2.3.4.5:80"),
        ("bind", "-bad.example:80"),
        ("bind", "bad-.example:80"),
        ("bind", "a_b:80"),
        ("bind", "host.:80"),
        ("bind", f"{'a' * 64}:80"),  # a label of at most 63
        ("bind", f"{'.'.join(['a' * 63] * 4)}:80"),  # 255 characters: a name of at most 253
        ("apiTokenFile", "secrets/semif-api-token"),
        ("apiTokenFile", ""),
        ("apiTokenFile", "/"),
        ("adminTokenFile", "semif-admin-token"),
        ("hfCacheDir", "hf-cache/hub"),
        ("calibrationFile", "calibration.json"),
        *[(option, value) for option in LIMIT_OPTIONS for value in (0, -1)],
        ("maxTokens", 1.5),
        *[(option, bound + 1) for option, _, bound in INTEGER_BOUNDS],
        ("headerTimeoutSec", 0.0),
        ("headerTimeoutSec", 1.0e-7),  # written "0.000000", which the server refuses
        ("bodyTimeoutSec", -0.5),
        ("bodyTimeoutSec", 1.0e-7),
        ("gracefulTimeoutSec", 0),
        ("gracefulTimeoutSec", 1.5),
        ("startupTimeoutSec", -1),
        ("gpu", -1),
        ("vramCapGib", 0),
        ("vramCapGib", 0.0),
        ("vramCapGib", -1.5),
        ("vramCapGib", 1.0e-7),
        ("prefixCacheGib", -1),
        ("prefixCacheGib", -0.5),
        ("prefixCacheGib", MAX_PREFIX_CACHE_GIB + 0.5),
        ("prefixCacheGib", int(MAX_PREFIX_CACHE_GIB) + 1),
        ("model", 42),
        ("supplementaryGroups", "hf-cache"),
        ("environment", {"SEMIF_MAX_QUEUE": 8}),
    ],
)
def test_option_type_refuses_a_bad_value(error_of, option, value):
    # `settings` forces every option's value, so every definition is type-checked.
    error = error_of("settings", {**ENABLED, option: value})
    assert f"A definition for option `services.semif-serve.{option}" in error
    assert "is not of type" in error
    assert "In `the test's settings'" in error  # the message points at the bad definition


@pytest.mark.parametrize(
    ("option", "value"),
    [
        *[("bind", bind) for bind in GOOD_BINDS],
        ("hfCacheDir", "/srv/hf-cache/hub"),
        *[(option, 1) for option in LIMIT_OPTIONS],
        *[(option, bound) for option, _, bound in INTEGER_BOUNDS],
        ("gracefulTimeoutSec", 1),
        ("headerTimeoutSec", 0.5),
        ("headerTimeoutSec", 1.0e-6),  # written "0.000001"
        ("bodyTimeoutSec", 1.5),
        ("bodyTimeoutSec", 1.0e6),  # the server has no upper bound
        ("gpu", 0),
        ("vramCapGib", 12),
        ("vramCapGib", 11.5),
        ("vramCapGib", 1.0e-6),
        ("prefixCacheGib", 0),
        ("prefixCacheGib", 0.5),
        ("prefixCacheGib", int(MAX_PREFIX_CACHE_GIB)),
        ("prefixCacheGib", MAX_PREFIX_CACHE_GIB),
    ],
)
def test_option_type_accepts_a_value_at_its_edge(value_of, option, value):
    """The other side of the refusals above: the types are not merely refusing everything."""
    assert value_of("settings", {**ENABLED, option: value})[option] == value


@pytest.mark.parametrize(
    ("option", "variable", "bound"),
    [*INTEGER_BOUNDS, ("prefixCacheGib", "SEMIF_PREFIX_CACHE_GIB", MAX_PREFIX_CACHE_GIB)],
)
def test_upper_bound_is_the_servers(value_of, error_of, option, variable, bound):
    """The module's bound is semif_serve/config.py's: the server starts with what the module
    writes at the bound, and refuses one past it, which the module refuses first."""
    environment = value_of("unit", {**ENABLED, option: bound})["environment"]
    settings_from_env({**environment, **SERVER_TOKEN})
    with pytest.raises(ConfigError, match=variable):
        settings_from_env({**environment, variable: str(bound + 1), **SERVER_TOKEN})
    assert f"`services.semif-serve.{option}' is not of type" in error_of(
        "settings", {**ENABLED, option: bound + 1}
    )


@pytest.mark.parametrize("bind", GOOD_BINDS)
def test_server_accepts_every_bind_the_module_accepts(value_of, bind):
    environment = value_of("unit", {**ENABLED, "bind": bind})["environment"]
    assert parse_bind(environment["SEMIF_BIND"]) == bind


@pytest.mark.parametrize(
    "address",
    [
        "::",
        "::1",
        "1::",
        "1:2:3:4:5:6:7:8",
        "1:2:3:4:5:6:7::",
        "::2:3:4:5:6:7:8",
        "1:2:3:4:5:6::8",
        "1:2:3:4:5:6:192.0.2.1",
        "::192.0.2.1",
        "::ffff:192.0.2.1",
        "abcd:EF01::",
        "1:2:3:4:5:6:7:8:9",
        "1:2:3:4:5:6:7",
        "1:2:3:4:5:6:7:8::",
        "1::2::3",
        ":::",
        ":1::",
        "1::2:",
        "12345::",
        "g::",
        "1.2.3.4::",
        "::1.2.3",
        "::256.0.0.1",
        "1:2:3:4:5:6:7:192.0.2.1",
        "",
    ],
)
def test_bracketed_ipv6_is_what_inet_pton_takes(evaluate, address):
    """The bind's IPv6 check follows inet_pton, which the server's socket calls in the end."""
    try:
        socket.inet_pton(socket.AF_INET6, address)
        valid = True
    except OSError:
        valid = False
    result = evaluate("settings", {**ENABLED, "bind": f"[{address}]:8471"})
    assert (result.returncode == 0) == valid, result.stderr


def test_fractional_seconds_are_written_as_the_server_reads_them(value_of):
    settings = {**ENABLED, "headerTimeoutSec": 2.5, "bodyTimeoutSec": 1.0e-6, "vramCapGib": 1.0e-6}
    environment = value_of("unit", settings)["environment"]
    assert environment["SEMIF_HEADER_TIMEOUT_S"] == "2.500000"  # Nix's toString of a float
    assert environment["SEMIF_BODY_TIMEOUT_S"] == "0.000001"
    server = settings_from_env({**environment, **SERVER_TOKEN})
    assert (server.header_timeout_s, server.body_timeout_s) == (2.5, 1.0e-6)
    assert server.vram_cap_gib == 1.0e-6


# --- assertions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hf_cache_dir",
    [
        "/home/alice/hf-cache",
        "/root/hf-cache/hub",
        "/home",  # the folder itself, no trailing slash
        "/root",
        "/home/",
        "/run/user",
        "/run/user/1000/hf-cache",
        "//home/alice/hf-cache",  # spelled otherwise, resolved as the kernel would
        "/srv/../home/alice",
        "/./root/hub",
    ],
)
def test_hf_cache_under_a_home_folder_fails_the_assertion(value_of, hf_cache_dir):
    failed = value_of("failedAssertions", {**ENABLED, "hfCacheDir": hf_cache_dir})
    assert failed == [HOME_ASSERTION]


@pytest.mark.parametrize(
    "hf_cache_dir",
    [
        None,
        "/srv/hf-cache/hub",
        "/homestead/hf-cache",
        "/rooted",
        "/run/users-cache",
        "/run/hf-cache",
        "/home/../srv/hf-cache",
        "/tmp/hf-cache",  # bound into the unit's private /tmp: that works
    ],
)
def test_hf_cache_elsewhere_passes_the_assertion(value_of, hf_cache_dir):
    assert value_of("failedAssertions", {**ENABLED, "hfCacheDir": hf_cache_dir}) == []


@pytest.mark.parametrize(
    "calibration_file",
    [
        "/home/alice/calibration.json",
        "/root/calibration.json",
        "/run/user/1000/calibration.json",
        "/tmp/calibration.json",  # the unit has its own /tmp (PrivateTmp)
        "/var/tmp/calibration.json",
        "/etc/../home/alice/calibration.json",
    ],
)
def test_calibration_file_the_unit_cannot_see_fails_the_assertion(value_of, calibration_file):
    failed = value_of("failedAssertions", {**ENABLED, "calibrationFile": calibration_file})
    assert failed == [CALIBRATION_ASSERTION]


@pytest.mark.parametrize(
    "calibration_file",
    [
        None,
        "/etc/semif-serve/calibration.json",
        "/srv/tmp/calibration.json",
        "/var/lib/semif/calibration.json",
        "/homestead/calibration.json",
    ],
)
def test_calibration_file_elsewhere_passes_the_assertion(value_of, calibration_file):
    settings = {**ENABLED, "calibrationFile": calibration_file}
    assert value_of("failedAssertions", settings) == []


@pytest.mark.parametrize(
    ("variable", "option"),
    [
        ("SEMIF_BIND", "bind"),
        ("SEMIF_MAX_QUEUE", "maxQueue"),
        ("SEMIF_MAX_TOKENS", "maxTokens"),
        ("SEMIF_HEADER_TIMEOUT_S", "headerTimeoutSec"),
        ("SEMIF_GRACEFUL_TIMEOUT_S", "gracefulTimeoutSec"),
        ("SEMIF_CALIBRATION", "calibrationFile"),
        ("HF_HUB_CACHE", "hfCacheDir"),
        ("CUDA_VISIBLE_DEVICES", "gpu"),
        ("SEMIF_MODEL", "model"),
        ("SEMIF_API_TOKEN", "apiTokenFile"),
        ("SEMIF_ADMIN_TOKEN", "adminTokenFile"),
    ],
)
def test_environment_may_not_set_a_variable_an_option_sets(value_of, variable, option):
    """SEMIF_BIND there would move the server away from the address the health check polls
    (the start fails after startupTimeoutSec); a SEMIF_MAX_* would skip the option's bounds; a
    token would land in the Nix store."""
    failed = value_of("failedAssertions", {**ENABLED, "environment": {variable: "1"}})
    assert len(failed) == 1
    assert failed[0].startswith(f"services.semif-serve.environment.{variable}: ")
    assert f"use services.semif-serve.{option}" in failed[0]


def test_environment_may_set_none_of_the_modules_own_variables(value_of):
    """Every variable the unit carries with every option set, and the tokens, is refused in
    `environment`: a variable added to the module without its ownVariables entry fails here."""
    all_set = {
        **ENABLED,
        "adminTokenFile": ADMIN_TOKEN_FILE,
        "hfCacheDir": "/srv/hf-cache/hub",
        "vramCapGib": 12,
        "prefixCacheGib": 4,
        "maxTokens": 2048,
        "maxDecisions": 16,
        "maxBodyBytes": 65536,
        "maxQueue": 8,
        "maxConnections": 200,
        "headerTimeoutSec": 5,
        "bodyTimeoutSec": 20,
        "calibrationFile": "/etc/semif-serve/calibration.json",
    }
    own = set(value_of("unit", all_set)["environment"]) | {"SEMIF_API_TOKEN", "SEMIF_ADMIN_TOKEN"}
    failed = value_of("failedAssertions", {**all_set, "environment": dict.fromkeys(own, "x")})
    named = {message.split(":", 1)[0] for message in failed}
    assert named == {f"services.semif-serve.environment.{variable}" for variable in own}


# --- the unit -----------------------------------------------------------------------------------


def test_start_script_reads_the_tokens_and_runs_the_package(value_of):
    unit = value_of("unit", ENABLED)
    start = value_of("scripts", ENABLED)["ExecStart"]
    assert unit["serviceConfig"]["ExecStart"].endswith("/bin/semif-serve-start")
    assert start["name"] == "semif-serve-start"
    assert 'SEMIF_API_TOKEN="$(< "$CREDENTIALS_DIRECTORY/api-token")"' in start["text"]
    assert 'SEMIF_ADMIN_TOKEN="$(< "$CREDENTIALS_DIRECTORY/admin-token")"' in start["text"]
    # exec: the server is the unit's main process, so systemd's stop signal reaches gunicorn.
    assert start["text"].rstrip().endswith(f"exec {PACKAGE}/bin/semif-serve serve")


@pytest.mark.parametrize(
    ("admin_token_file", "credentials"),
    [
        (None, [f"api-token:{API_TOKEN_FILE}"]),
        (ADMIN_TOKEN_FILE, [f"api-token:{API_TOKEN_FILE}", f"admin-token:{ADMIN_TOKEN_FILE}"]),
    ],
)
def test_tokens_reach_the_unit_only_through_load_credential(
    value_of, admin_token_file, credentials
):
    settings = {**ENABLED, "adminTokenFile": admin_token_file}
    unit = value_of("unit", settings)
    assert unit["serviceConfig"].pop("LoadCredential") == credentials
    assert not {"SEMIF_API_TOKEN", "SEMIF_ADMIN_TOKEN"} & unit["environment"].keys()
    # Nowhere else in the unit or its scripts, which land in the world-readable store.
    everything_else = json.dumps([unit, value_of("scripts", settings)])
    assert API_TOKEN_FILE not in everything_else
    assert ADMIN_TOKEN_FILE not in everything_else


def test_unit_is_hardened(value_of):
    service_config = value_of("unit", ENABLED)["serviceConfig"]
    expected = {
        "DynamicUser": True,
        "StateDirectory": "semif-serve",
        "CacheDirectory": "semif-serve",
        "WorkingDirectory": "/var/lib/semif-serve",
        "BindReadOnlyPaths": [],
        "SupplementaryGroups": [],
        "UMask": "0077",
        "PrivateDevices": False,  # DevicePolicy closes the devices instead: see the next test
        "DevicePolicy": "closed",
        "ProtectSystem": "strict",
        "ProtectHome": True,
        "PrivateTmp": True,
        "NoNewPrivileges": True,
        "CapabilityBoundingSet": "",
        "ProtectKernelTunables": True,
        "ProtectKernelModules": True,
        "ProtectKernelLogs": True,
        "ProtectControlGroups": True,
        "ProtectClock": True,
        "ProtectHostname": True,
        "RestrictAddressFamilies": ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"],
        "RestrictNamespaces": True,
        "RestrictRealtime": True,
        "RestrictSUIDSGID": True,
        "LockPersonality": True,
        "SystemCallArchitectures": "native",
    }
    assert {name: service_config.get(name) for name in expected} == expected


@pytest.mark.parametrize("gpu", [0, 3])
def test_unit_may_open_the_chosen_card_only(value_of, gpu):
    unit = value_of("unit", {**ENABLED, "gpu": gpu})
    assert unit["serviceConfig"]["DeviceAllow"] == [
        f"/dev/nvidia{gpu} rw",
        "/dev/nvidiactl rw",
        "/dev/nvidia-uvm rw",
        "/dev/nvidia-uvm-tools rw",
    ]
    assert unit["environment"]["CUDA_VISIBLE_DEVICES"] == str(gpu)
    assert unit["environment"]["SEMIF_DEVICE"] == "cuda"


def test_unit_start_stop_and_restart_policy(value_of):
    settings = {**ENABLED, "startupTimeoutSec": 100, "gracefulTimeoutSec": 20}
    unit = value_of("unit", settings)
    health = value_of("scripts", settings)["ExecStartPost"]
    assert (unit["wantedBy"], unit["after"]) == (["multi-user.target"], ["network.target"])
    assert (unit["startLimitBurst"], unit["startLimitIntervalSec"]) == (3, 600)
    service_config = unit["serviceConfig"]
    assert service_config["Type"] == "exec"
    assert (service_config["Restart"], service_config["RestartSec"]) == ("on-failure", "10s")
    assert service_config["RestartPreventExitStatus"] == [2]  # a configuration error
    # Room for the health check's own limit, and for the graceful stop before systemd kills.
    assert service_config["TimeoutStartSec"] == 100 + 30
    assert service_config["TimeoutStopSec"] == 20 + 15
    assert unit["environment"]["SEMIF_GRACEFUL_TIMEOUT_S"] == "20"
    assert "limit=100\n" in health["text"]


@pytest.mark.parametrize(
    ("bind", "url"),
    [
        ("127.0.0.1:8471", "http://127.0.0.1:8471/health"),
        ("0.0.0.0:9000", "http://127.0.0.1:9000/health"),
        ("[::]:9000", "http://[::1]:9000/health"),
        ("[::1]:9000", "http://[::1]:9000/health"),
        ("[2001:db8::5]:8471", "http://[2001:db8::5]:8471/health"),
        ("192.0.2.7:80", "http://192.0.2.7:80/health"),
        ("localhost:8471", "http://localhost:8471/health"),
    ],
)
def test_health_check_polls_a_reachable_address_of_the_bind(value_of, bind, url):
    """A wildcard bind is polled on the loopback of its family (IPv6 bracketed), any other
    address as it is."""
    settings = {**ENABLED, "bind": bind}
    unit = value_of("unit", settings)
    health = value_of("scripts", settings)["ExecStartPost"]
    assert unit["environment"]["SEMIF_BIND"] == bind
    assert unit["serviceConfig"]["ExecStartPost"].endswith("/bin/semif-serve-wait-healthy")
    assert probed_url(health["text"]) == url
    assert f"semif-serve: {url} did not answer 200 within $limit s" in health["text"]
    assert set(health["runtimeInputs"]) == {"coreutils", "curl"}


@pytest.mark.parametrize(
    ("option", "value", "variable", "text"),
    [
        ("model", "builtin:smollm2-135m", "SEMIF_MODEL", "builtin:smollm2-135m"),
        ("revision", "main", "SEMIF_REVISION", "main"),
        ("hfCacheDir", "/srv/hf-cache/hub", "HF_HUB_CACHE", "/srv/hf-cache/hub"),
        ("vramCapGib", 12, "SEMIF_VRAM_CAP_GIB", "12"),
        ("vramCapGib", 11.5, "SEMIF_VRAM_CAP_GIB", "11.500000"),  # Nix's toString of a float
        ("prefixCacheGib", 0, "SEMIF_PREFIX_CACHE_GIB", "0"),
        ("maxTokens", 2048, "SEMIF_MAX_TOKENS", "2048"),
        ("maxDecisions", 16, "SEMIF_MAX_DECISIONS", "16"),
        ("maxBodyBytes", 65536, "SEMIF_MAX_BODY_BYTES", "65536"),
        ("maxQueue", 8, "SEMIF_MAX_QUEUE", "8"),
        ("maxConnections", 200, "SEMIF_MAX_CONNECTIONS", "200"),
        ("headerTimeoutSec", 5, "SEMIF_HEADER_TIMEOUT_S", "5"),
        ("headerTimeoutSec", 1.5, "SEMIF_HEADER_TIMEOUT_S", "1.500000"),
        ("bodyTimeoutSec", 20, "SEMIF_BODY_TIMEOUT_S", "20"),
        (
            "calibrationFile",
            "/etc/semif-serve/calibration.json",
            "SEMIF_CALIBRATION",
            "/etc/semif-serve/calibration.json",
        ),
    ],
)
def test_option_becomes_its_variable(value_of, option, value, variable, text):
    assert value_of("unit", {**ENABLED, option: value})["environment"][variable] == text


def test_server_accepts_the_environment_every_option_writes(value_of, tmp_path):
    """What the module writes parses as the server parses it at startup (e.g. Nix's "11.500000"
    for a float): a mismatch would only show as the unit failing with exit status 2."""
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"triage": 1.5}))
    environment = value_of(
        "unit",
        {
            **ENABLED,
            "vramCapGib": 11.5,
            "prefixCacheGib": MAX_PREFIX_CACHE_GIB,
            "maxTokens": 2048,
            "maxDecisions": 16,
            "maxBodyBytes": 65536,
            "maxQueue": 8,
            "maxConnections": 200,
            "headerTimeoutSec": 5,
            "bodyTimeoutSec": 20.5,
            # Under /tmp, which the calibrationFile assertion refuses for a real host; only the
            # unit's environment is read here, and the file must exist for settings_from_env.
            "calibrationFile": str(calibration),
            "bind": "[::]:9000",
        },
    )["environment"]
    settings = settings_from_env({**environment, **SERVER_TOKEN})
    assert (settings.vram_cap_gib, settings.prefix_cache_gib) == (11.5, MAX_PREFIX_CACHE_GIB)
    assert (settings.max_tokens, settings.max_decisions, settings.max_queue) == (2048, 16, 8)
    assert (settings.max_body_bytes, settings.max_connections) == (65536, 200)
    assert (settings.header_timeout_s, settings.body_timeout_s) == (5.0, 20.5)
    assert dict(settings.calibration) == {"triage": 1.5}
    assert (settings.bind, settings.device, settings.graceful_timeout_s) == (
        "[::]:9000",
        "cuda",
        60,
    )


def test_hf_cache_is_bound_read_only_for_the_supplementary_groups(value_of):
    unit = value_of(
        "unit", {**ENABLED, "hfCacheDir": "/srv/hf-cache/hub", "supplementaryGroups": ["hf-cache"]}
    )
    assert unit["serviceConfig"]["BindReadOnlyPaths"] == ["/srv/hf-cache/hub"]
    assert unit["serviceConfig"]["SupplementaryGroups"] == ["hf-cache"]


def test_environment_option_adds_variables_of_its_own(value_of):
    extra = {"SEMIF_PARALLEL_SLOTS": "2", "SEMIF_QUEUE_TIMEOUT_S": "30"}
    settings = {**ENABLED, "maxQueue": 8, "environment": extra}
    environment = value_of("unit", settings)["environment"]
    assert (environment["SEMIF_PARALLEL_SLOTS"], environment["SEMIF_QUEUE_TIMEOUT_S"]) == (
        "2",
        "30",
    )
    assert environment["SEMIF_MAX_QUEUE"] == "8"
    assert value_of("failedAssertions", settings) == []

"""SEMIF_MODEL_ALIASES (`config.parse_aliases`, `Settings.model_aliases`), what the ecosystem
routes do with a model name (a registered id, an alias of one, else 404 naming both lists), and
GET /v1/models as both SDKs read it (`management.model_listing`: OpenAI's `data`, TypeSafe's
`models`, every alias)."""

from __future__ import annotations

import json
import time
from types import MappingProxyType

import pytest
from fakes import AUTH, FakeScorer, fake_app, settings
from falcon import testing
from runtime_fixtures import Background, Factory, spec

from semif_serve.config import ConfigError, Settings, check_alias_targets, parse_aliases
from semif_serve.http import create_app
from semif_serve.http.management import model_listing
from semif_serve.runtime.registry import Runtime
from semif_serve.runtime.service import DecisionService

TOKEN = "k" * 32


# --- parse_aliases -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", [None, "", "   ", "\t"])
def test_unset_or_blank_means_no_aliases(text):
    aliases = parse_aliases(text)
    assert aliases == {}
    assert isinstance(aliases, MappingProxyType)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("jev-latest=default", {"jev-latest": "default"}),
        (" jev-latest = default ", {"jev-latest": "default"}),
        (
            "jev-latest=default, gpt-6-luna=default,smol=builtin-smol",
            {"jev-latest": "default", "gpt-6-luna": "default", "smol": "builtin-smol"},
        ),
        ("org/model:v1@2026!=m.2_x-y", {"org/model:v1@2026!": "m.2_x-y"}),
        ("a" * 128 + "=" + "B" * 64, {"a" * 128: "B" * 64}),
        ("0=9", {"0": "9"}),
        ("~=Z", {"~": "Z"}),
        ("a=default\n", {"a": "default"}),  # any surrounding whitespace is stripped
    ],
)
def test_valid_aliases_map_each_alias_to_its_model_in_order(text, expected):
    aliases = parse_aliases(text)
    assert list(aliases.items()) == list(expected.items())
    assert isinstance(aliases, MappingProxyType)
    with pytest.raises(TypeError):
        aliases["new"] = "x"  # read-only: the settings are shared by every request


@pytest.mark.parametrize(
    ("text", "pair"),
    [
        ("jev-latest", "'jev-latest'"),
        ("=default", "'=default'"),
        ("jev-latest=", "'jev-latest='"),
        ("jev latest=default", "'jev latest=default'"),
        ("jév=default", "'jév=default'"),
        ("a=-default", "'a=-default'"),
        ("a=.default", "'a=.default'"),
        ("a=de fault", "'a=de fault'"),
        ("a=b=c", "'a=b=c'"),  # the alias ends at the first '='; a model id has none
        ("a=org/model", "'a=org/model'"),
        ("jev-latest=default,", "''"),
        (",jev-latest=default", "''"),
        ("a=default,,b=default", "''"),
        ("a=default; b=default", "'a=default; b=default'"),
        ("a" * 129 + "=default", "'" + "a" * 40 + "'... (137 characters)"),
        ("a=" + "m" * 65, "'a=" + "m" * 38 + "'... (67 characters)"),
    ],
)
def test_every_malformed_pair_is_refused_naming_the_variable_and_the_pair(text, pair):
    with pytest.raises(ConfigError) as raised:
        parse_aliases(text)
    assert str(raised.value) == (
        f"SEMIF_MODEL_ALIASES: must be alias=model_id pairs separated by commas, got {pair}"
    )


def test_an_alias_given_twice_is_refused():
    with pytest.raises(ConfigError) as raised:
        parse_aliases("jev-latest=default, b=x, jev-latest = other")
    assert str(raised.value) == "SEMIF_MODEL_ALIASES: alias 'jev-latest' is given twice"
    assert parse_aliases("a=m,A=m") == {"a": "m", "A": "m"}  # names are case-sensitive


def test_the_variable_reaches_the_settings():
    settings = Settings.from_env(
        {"SEMIF_API_TOKEN": TOKEN, "SEMIF_MODEL_ALIASES": "jev-latest=default,g=m"}
    )
    assert dict(settings.model_aliases) == {"jev-latest": "default", "g": "m"}
    assert Settings.from_env({"SEMIF_API_TOKEN": TOKEN}).model_aliases == {}
    assert Settings(api_token=TOKEN).model_aliases == {}
    with pytest.raises(ConfigError, match=r"^SEMIF_MODEL_ALIASES: must be alias=model_id pairs"):
        Settings.from_env({"SEMIF_API_TOKEN": TOKEN, "SEMIF_MODEL_ALIASES": "nope"})


# --- what a request's model name means ----------------------------------------------------------

NOUL = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "Open?"}}}
PREDICATE = {"input": "s", "questions": [{"type": "predicate", "instructions": "Open?"}]}
ROUTES = [("/v1/systemone", NOUL), ("/v1/decisions", PREDICATE)]


def post(path, body, **overrides):
    app, scorer = fake_app(FakeScorer(), **overrides)
    return testing.TestClient(app).simulate_post(path, json=body, headers=AUTH), scorer


def answered_by(response):
    """The model id the x-semif-model header names (before its `; revision=...`)."""
    return response.headers["x-semif-model"].split(";")[0]


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize("name", [None, "default", "jev-latest", "old"])
def test_the_reply_echoes_the_name_asked_for_and_the_header_names_the_model(path, body, name):
    sent = body if name is None else {**body, "model": name}
    response, scorer = post(path, sent, model_aliases={"old": "default"})
    assert response.status_code == 200, response.text
    assert response.json["model"] == (name or "default")
    assert response.headers["x-semif-model"] == 'default; revision="' + "0" * 40 + '"'
    assert len(scorer.calls) == 1


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize(
    "name",
    ["jev-latest", "jev-1.13.0", "typesafe/jev-1.13", "gpt-6-luna", "gpt-6-luna-2026-10-06"],
)
def test_hosted_names_name_the_default_model_unless_turned_off(path, body, name):
    response, scorer = post(path, {**body, "model": name})
    assert (response.status_code, response.json["model"]) == (200, name), response.text
    assert answered_by(response) == "default"
    response, scorer = post(path, {**body, "model": name}, hosted_model_names=False)
    assert response.status_code == 404
    assert response.json["error"]["message"].endswith(
        "(aliases: none configured (SEMIF_MODEL_ALIASES); hosted names: off "
        "(SEMIF_HOSTED_MODEL_NAMES=0))"
    )
    assert scorer.calls == []


@pytest.mark.parametrize(
    "name", ["jev-", "typesafe/jev-", "jev", "Jev-Latest", "gpt-6", "gpt-6-luna-", "jev-a b"]
)
def test_a_name_outside_the_hosted_families_is_not_hosted(name):
    response, scorer = post("/v1/systemone", {**NOUL, "model": name})
    assert response.status_code == 404
    assert scorer.calls == []


def test_a_registered_id_and_an_alias_win_over_a_hosted_name():
    client = two_models(model_aliases={"jev-1": "b"})
    for name, model in (("jev-1", "b"), ("jev-2", "a"), ("b", "b")):
        response = client.simulate_post("/v1/systemone", json={**NOUL, "model": name}, headers=AUTH)
        assert (response.json["model"], answered_by(response)) == (name, model)


def test_the_access_log_names_the_model_that_answered(caplog):
    with caplog.at_level("INFO", logger="semif_serve.access"):
        response, _ = post("/v1/systemone", {**NOUL, "model": "jev-latest"})
    assert response.status_code == 200
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == "semif_serve.access"]
    assert (line["model"], line["revision"]) == ("default", "0" * 40)


@pytest.mark.parametrize(
    ("aliases", "message"),
    [
        (
            {"default": "default"},
            "SEMIF_MODEL_ALIASES: 'default' is a registered model's own id (models: default)",
        ),
        (
            {"jev-latest": "default", "gpt": "missing"},
            "SEMIF_MODEL_ALIASES: 'gpt' names 'missing', which is not a registered model (default)",
        ),
    ],
)
def test_an_alias_that_is_a_model_s_id_or_names_no_model_stops_the_start(aliases, message):
    with pytest.raises(ConfigError) as raised:
        fake_app(FakeScorer(), model_aliases=aliases)
    assert str(raised.value) == message
    with pytest.raises(ConfigError) as raised:
        check_alias_targets(aliases, ["default"])
    assert str(raised.value) == message


def test_alias_targets_are_checked_against_every_startup_model():
    assert check_alias_targets({}, []) is None
    assert check_alias_targets({"x": "b", "y": "a", "z": "b"}, ["a", "b"]) is None
    with pytest.raises(ConfigError) as raised:
        check_alias_targets({"x": "b", "a": "b"}, ["a", "b"])
    assert (
        str(raised.value)
        == "SEMIF_MODEL_ALIASES: 'a' is a registered model's own id (models: a, b)"
    )
    with pytest.raises(ConfigError) as raised:
        check_alias_targets({"x": "c"}, ["a", "b"])
    assert (
        str(raised.value)
        == "SEMIF_MODEL_ALIASES: 'x' names 'c', which is not a registered model (a, b)"
    )


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize(
    ("aliases", "name", "listed"),
    [
        ({"jev-latest": "default", "b": "default"}, "gpt-x", "b, jev-latest"),
        ({}, "gpt-5", "none configured (SEMIF_MODEL_ALIASES)"),
        ({"old": "default"}, "Old", "old"),  # names are case-sensitive
    ],
)
def test_an_unknown_name_is_404_listing_the_models_and_aliases(path, body, aliases, name, listed):
    response, scorer = post(path, {**body, "model": name}, model_aliases=aliases)
    assert response.status_code == 404
    message = (
        f"model {name!r} is neither a registered model (default) nor an alias of one (aliases: "
        f"{listed}; hosted names: jev-latest, jev-*, typesafe/jev-*, gpt-6-luna, gpt-6-luna-*)"
    )
    assert response.json == {
        "error": {
            "code": "model_not_found",
            "message": message,
            "type": "not_found_error",
            "param": None,
        },
        "detail": {"error_type": "not_found_error", "message": message},
    }
    assert scorer.calls == []


def two_models(**overrides):
    """Models `a` (the default, loaded) and `b` (loaded when first asked for)."""
    config = settings(parallel_slots=2, **overrides)
    runtime = Runtime(
        config,
        Factory(),
        [spec("a", load_on_startup=True), spec("b")],
        "a",
        source_check=lambda spec: None,
    )
    Background(lambda: runtime.start(idle_interval_s=None)).result()
    return testing.TestClient(create_app(DecisionService(runtime, config), config))


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_with_two_models_each_name_and_alias_reaches_its_own(path, body):
    client = two_models(model_aliases={"jev-latest": "b", "old": "a"})
    for name, answered in ((None, "a"), ("a", "a"), ("b", "b"), ("jev-latest", "b"), ("old", "a")):
        sent = body if name is None else {**body, "model": name}
        response = client.simulate_post(path, json=sent, headers=AUTH)
        assert (response.status_code, answered_by(response)) == (200, answered), response.text
    response = client.simulate_post(path, json={**body, "model": "c"}, headers=AUTH)
    assert response.status_code == 404
    assert response.json["error"]["message"] == (
        "model 'c' is neither a registered model (a, b) nor an alias of one (aliases: jev-latest, "
        "old; hosted names: jev-latest, jev-*, typesafe/jev-*, gpt-6-luna, gpt-6-luna-*)"
    )


def test_only_the_ecosystem_routes_read_aliases():
    app, _ = fake_app(FakeScorer(), model_aliases={"jev-latest": "default"})
    body = {
        "model": "jev-latest",
        "state": "s",
        "decisions": [
            {
                "id": "a",
                "question": "q",
                "options": [{"id": "y", "description": "Y"}, {"id": "n", "description": "N"}],
            }
        ],
    }
    response = testing.TestClient(app).simulate_post("/decide/shared", json=body, headers=AUTH)
    assert response.status_code == 404
    assert response.json["error"]["code"] == "model_not_found"


# --- GET /v1/models ----------------------------------------------------------------------------

STARTED = 1_796_200_000  # 2026-12-02 08:26:40 UTC
STATUSES = [
    {"id": "default", "state": "ready", "source": "org/model", "revision": "abc123"},
    {"id": "local", "state": "unloaded", "source": "/models/mine", "revision": None},
]


def test_the_listing_has_openai_s_data_and_typesafe_s_models():
    listing = model_listing(
        STATUSES,
        MappingProxyType({"jev-latest": "default", "a-old": "default", "l": "local"}),
        STARTED,
    )
    assert listing == {
        "object": "list",
        "data": [
            {"id": "default", "object": "model", "created": STARTED, "owned_by": "semif-serve"},
            {"id": "local", "object": "model", "created": STARTED, "owned_by": "semif-serve"},
            {
                "id": "jev-latest",
                "object": "model",
                "created": STARTED,
                "owned_by": "semif-serve",
                "alias_of": "default",
            },
            {
                "id": "a-old",
                "object": "model",
                "created": STARTED,
                "owned_by": "semif-serve",
                "alias_of": "default",
            },
            {
                "id": "l",
                "object": "model",
                "created": STARTED,
                "owned_by": "semif-serve",
                "alias_of": "local",
            },
        ],
        "models": [
            {
                **STATUSES[0],
                "name": "default",
                "description": "org/model at revision abc123",
                "release_date": "2026-12-02",
                "aliases": ["a-old", "jev-latest"],
            },
            {
                **STATUSES[1],
                "name": "local",
                "description": "/models/mine",
                "release_date": "2026-12-02",
                "aliases": ["l"],
            },
        ],
    }


def test_the_listing_without_aliases_and_its_date_in_utc():
    listing = model_listing(
        [{"id": "m", "source": None}], {}, 1_790_000_000 - 1_790_000_000 % 86_400 - 1
    )
    assert listing["data"] == [
        {"id": "m", "object": "model", "created": 1_789_948_799, "owned_by": "semif-serve"}
    ]
    assert listing["models"] == [
        {
            "id": "m",
            "source": None,
            "name": "m",
            "description": "None",
            "release_date": "2026-09-20",
            "aliases": [],
        }
    ]


def test_get_v1_models_lists_every_name_a_request_can_send():
    before = int(time.time())
    app, _ = fake_app(FakeScorer(), model_aliases={"jev-latest": "default"})
    after = int(time.time())
    listing = testing.TestClient(app).simulate_get("/v1/models", headers=AUTH).json
    created = listing["data"][0]["created"]
    assert before <= created <= after
    assert listing["object"] == "list"
    # The configured alias, then the exact hosted names no alias takes (SEMIF_HOSTED_MODEL_NAMES).
    assert [(m["id"], m.get("alias_of")) for m in listing["data"]] == [
        ("default", None),
        ("jev-latest", "default"),
        ("gpt-6-luna", "default"),
    ]
    assert listing["data"][1]["created"] == created
    [model] = listing["models"]
    assert (model["id"], model["name"], model["state"], model["aliases"]) == (
        "default",
        "default",
        "ready",
        ["gpt-6-luna", "jev-latest"],
    )
    assert model["description"] == f"{model['source']} at revision {model['revision']}"
    assert model["release_date"] == time.strftime("%Y-%m-%d", time.gmtime(created))


def test_without_hosted_names_the_list_shows_only_models_and_aliases():
    app, _ = fake_app(FakeScorer(), model_aliases={"old": "default"}, hosted_model_names=False)
    listing = testing.TestClient(app).simulate_get("/v1/models", headers=AUTH).json
    assert [(m["id"], m.get("alias_of")) for m in listing["data"]] == [
        ("default", None),
        ("old", "default"),
    ]


@pytest.mark.parametrize(
    ("name", "alias_of"),
    [("default", None), ("old", "default"), ("gpt-6-luna", "default"), ("jev-1.13.0", "default")],
)
def test_get_v1_models_id_retrieves_any_name_a_request_can_send(name, alias_of):
    app, _ = fake_app(FakeScorer(), model_aliases={"old": "default"})
    client = testing.TestClient(app)
    response = client.simulate_get(f"/v1/models/{name}", headers=AUTH)
    assert response.status_code == 200, response.text
    entry = response.json
    assert (entry["id"], entry["object"], entry["owned_by"]) == (name, "model", "semif-serve")
    assert entry.get("alias_of") == alias_of
    listed = client.simulate_get("/v1/models", headers=AUTH).json["data"]
    assert entry["created"] == listed[0]["created"]
    assert client.simulate_get(f"/v1/models/{name}").status_code == 401


def test_get_v1_models_id_of_an_unknown_name_is_404_model_not_found():
    app, _ = fake_app(FakeScorer(), hosted_model_names=False)
    response = testing.TestClient(app).simulate_get("/v1/models/gpt-6-luna", headers=AUTH)
    assert response.status_code == 404
    assert response.json["error"]["code"] == "model_not_found"
    assert "hosted names: off (SEMIF_HOSTED_MODEL_NAMES=0)" in response.json["error"]["message"]

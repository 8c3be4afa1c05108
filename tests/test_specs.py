"""SEMIF_MODELS_FILE and model specs: validated at startup, naming the model and key."""

import pytest
from fakes import settings

from semif_serve.config import ConfigError
from semif_serve.runtime.specs import default_spec, load_models_file
from semif_serve.server import build_runtime


def models_file(tmp_path, text):
    path = tmp_path / "models.toml"
    path.write_text(text)
    return str(path)


def test_without_a_file_there_is_one_default_model_loaded_at_startup():
    spec = default_spec(settings(model="builtin:smollm2-135m"))
    assert (spec.id, spec.source, spec.slots, spec.load_on_startup) == (
        "default",
        "builtin:smollm2-135m",
        1,
        True,
    )
    assert default_spec(settings(parallel_slots=3)).slots == 3


def test_a_models_file_registers_every_table_with_one_default(tmp_path):
    path = models_file(
        tmp_path,
        """
[small]
source = "builtin:smollm2-135m"
device = "cpu"
keep_alive_s = 300

[big]
source = "Qwen/Qwen3.5-4B"
revision = "851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a"
default = true
slots = 2
max_tokens = 8192
""",
    )
    specs, default = load_models_file(path, settings(parallel_slots=1))
    assert default == "big"
    small, big = specs
    assert (small.device, small.dtype, small.keep_alive_s, small.load_on_startup) == (
        "cpu",
        "float32",
        300.0,
        False,
    )
    assert (big.slots, big.max_tokens, big.load_on_startup, big.dtype) == (2, 8192, True, "float32")


def test_the_runtime_is_built_from_the_file(tmp_path):
    path = models_file(tmp_path, '[only]\nsource = "x"\n')
    runtime = build_runtime(settings(models_file=path), lambda spec: None)
    assert runtime.default_id == "only" and [s["id"] for s in runtime.status()] == ["only"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[a]\nsource = "x"\nslots = 2\n', "a.slots: explicit slots need the parallel runtime"),
        ('[a]\nsource = "x"\nslots = 99\n', "a.slots: must be an integer 1..16, got 99"),
        (
            '[a]\nsource = "x"\n[b]\nsource = "y"\n',
            "exactly one model must have default = true, found 0",
        ),
        ('[a]\nsource = "x"\ndefault = true\n[b]\nsource = "y"\ndefault = true\n', "found 2"),
        ('[a]\ndevice = "cpu"\n', "a.source: required"),
        (
            '[a]\nsource = "x"\nkeep_alive_s = 0\n',
            "a.keep_alive_s: must be a number of seconds > 0",
        ),
        ('[a]\nsource = "x"\nmax_tokens = 0\n', "a.max_tokens: must be an integer >= 1"),
        ('[a]\nsource = "x"\ndtype = "int8"\n', "a.dtype"),
        ('[a]\nsource = "x"\ncolour = "red"\n', "a: unknown keys ['colour']"),
        ('["bad id!"]\nsource = "x"\n', "a model id is"),
        ("not toml [", "cannot read"),
        ("", "one [table] per model id"),
    ],
)
def test_a_bad_models_file_stops_startup_naming_the_model(tmp_path, text, message):
    with pytest.raises(ConfigError, match="^SEMIF_MODELS_FILE") as caught:
        load_models_file(models_file(tmp_path, text), settings())
    assert message in str(caught.value)


def test_slots_are_1_to_16_in_the_parallel_runtime(tmp_path):
    for slots, ok in [(1, True), (16, True), (0, False), (17, False)]:
        path = models_file(tmp_path, f'[a]\nsource = "x"\nslots = {slots}\n')
        if ok:
            assert load_models_file(path, settings(parallel_slots=4))[0][0].slots == slots
        else:
            with pytest.raises(ConfigError, match="a.slots: must be an integer 1..16"):
                load_models_file(path, settings(parallel_slots=4))


def test_the_runtime_variables_are_validated():
    from semif_serve.config import Settings

    base = {"SEMIF_API_TOKEN": "k" * 32}
    for env, message in [
        ({"SEMIF_PARALLEL_SLOTS": "17"}, "SEMIF_PARALLEL_SLOTS"),
        ({"SEMIF_QUEUE_TIMEOUT_S": "-1"}, "SEMIF_QUEUE_TIMEOUT_S"),
        ({"SEMIF_ADMIN_TOKEN": "short"}, "SEMIF_ADMIN_TOKEN: must be at least 32"),
        ({"SEMIF_MAX_LOADED_MODELS": "0"}, "SEMIF_MAX_LOADED_MODELS"),
        ({"SEMIF_MEMORY_BUDGET_GIB": "0"}, "SEMIF_MEMORY_BUDGET_GIB"),
    ]:
        with pytest.raises(ConfigError, match=message):
            Settings.from_env({**base, **env})
    parsed = Settings.from_env(
        {**base, "SEMIF_PARALLEL_SLOTS": "4", "SEMIF_QUEUE_TIMEOUT_S": "2.5"}
    )
    assert (parsed.parallel_slots, parsed.queue_timeout_s, parsed.admin_token) == (4, 2.5, None)

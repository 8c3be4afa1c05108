"""The docs' examples, run as written against a live server on the real SmolLM2.

Every fenced ```sh / ```bash block and every ```python block in COVERED runs, in document
order, against one `semif-serve serve` on 127.0.0.1 (the built-in model on the CPU), from a
scratch folder that looks like a checkout after `make serve`: `.semif-token` holds the token,
`.venv`, `docs` and `bench` point at the real ones. The only edit made to an example is the
port: `127.0.0.1:8471` becomes the test server's.

- A shell block runs in bash after the file's setup blocks (shell blocks with neither `curl` nor a
  `$ ` prompt, such as `TOKEN=$(cat .semif-token)`). Each `curl` in it must get a 2xx reply
  (or, where the shown reply is an `{"error": …}` envelope, that error) whose JSON body
  matches docs/openapi.yaml for its route and method, and the shape of the reply shown in the
  ```json block right after the example: the same keys, recursively (`"…": "…"` in a shown
  object allows more keys, `["…"]` any list, `{}` and `[]` any object or list), numbers where
  numbers are shown, strings where strings are, null where null is.
- A console block (lines starting `$ `, the rest its shown output) runs its commands; they must
  exit 0, and when the shown output is a JSON object its top-level keys must be in the real one.
- A Python block runs with this interpreter and must exit 0 with no traceback.

The server has what the examples that say so in their first lines need: a calibration table
holding `triage` (SEMIF_CALIBRATION) and an admin token (SEMIF_ADMIN_TOKEN, given to the shell
as ADMIN_TOKEN). It has no SEMIF_MODEL_ALIASES: the SDKs' default model names (`jev-latest`,
`gpt-6-luna`) are served as a plain `make serve` serves them (docs/decision-apis.md, "Model
names"), so the examples hold for a server started with no setting of its own.

A block that cannot run here (`make serve` itself, an install) has the marker
`<!-- docs-test: skip (why) -->` alone on the line right above its opening fence; Markdown
renders it as nothing. Other docs are not covered yet: their examples need a GPU host, nginx or
Nix (deploy.md), or run for minutes (quality.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from fakes import TOKEN
from live_server import LiveServer, real_env, semif_serve_command
from openapi_check import spec, validate_reply

ROOT = Path(__file__).parent.parent
COVERED = ("README.md", "docs/api.md", "docs/cli.md", "docs/client.md", "docs/decision-apis.md")
SKIP_MARKER = "<!-- docs-test: skip"
DOC_ADDRESS = "127.0.0.1:8471"
ADMIN_TOKEN = "a" * 40
STATUS_LINE = re.compile(r"\n?@@curl (?P<method>\S+) (?P<url>\S+) (?P<code>\d{3})@@\n")
# Every curl prints its method, URL and status after its body, so the body can be cut out.
CURL_SHIM = "curl() { command curl -sS -w '\\n@@curl %{method} %{url_effective} %{http_code}@@\\n' \"$@\"; }\n"
BLOCK_TIMEOUT_S = 300  # the console example loads the model in a process of its own
MAX_BLOCKS = 30  # a bound on what one run of this test may start


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    skipped: bool
    shown: str | None  # the ```json block right after it, if any

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def console(self) -> bool:
        return any(line.startswith("$ ") for line in self.text.splitlines())

    @property
    def setup(self) -> bool:
        return self.lang == "sh" and "curl" not in self.text and not self.console


def blocks(doc: str) -> list[Block]:
    """The fenced blocks of one Markdown file, each with the ```json block that follows it."""
    lines = (ROOT / doc).read_text().splitlines()
    found: list[tuple[int, str, str, bool]] = []
    index = 0
    while index < len(lines):
        fence = re.fullmatch(r"```(\w*)\s*", lines[index])
        if fence is None:
            index += 1
            continue
        end = index + 1
        while not lines[end].startswith("```"):
            end += 1
        skipped = index > 0 and lines[index - 1].strip().startswith(SKIP_MARKER)
        found.append((index, fence.group(1), "\n".join(lines[index + 1 : end]) + "\n", skipped))
        index = end + 1
    result = []
    for number, (start, lang, text, skipped) in enumerate(found):
        following = found[number + 1] if number + 1 < len(found) else None
        shown = None
        if following is not None and following[1] == "json":
            between = lines[start + text.count("\n") + 2 : following[0]]
            if not any(line.strip() for line in between):
                shown = following[2]
        lang = "sh" if lang in ("sh", "bash") else lang
        result.append(Block(doc, start + 1, lang, text, skipped, shown))
    return result


def runnable() -> list[Block]:
    return [
        block
        for doc in COVERED
        for block in blocks(doc)
        if block.lang in ("sh", "python") and not block.skipped and not block.setup
    ]


def test_the_examples_are_found_and_bounded():
    examples = runnable()
    assert len(examples) <= MAX_BLOCKS
    by_kind = {
        "curl": [b for b in examples if b.lang == "sh" and "curl" in b.text],
        "console": [b for b in examples if b.lang == "sh" and b.console],
        "python": [b for b in examples if b.lang == "python"],
    }
    # What the docs held when this test was written: a parser that stops finding them fails here.
    assert len(by_kind["curl"]) >= 6 and len(by_kind["console"]) >= 1, examples
    assert len(by_kind["python"]) >= 4, examples
    skipped = [b.name for doc in COVERED for b in blocks(doc) if b.skipped]
    assert any(name.startswith("README.md:") for name in skipped)  # `make serve` itself


@pytest.mark.parametrize(
    ("shown", "real", "ok"),
    [
        ({"a": 1, "b": "x"}, {"a": 2.5, "b": "y"}, True),
        ({"a": 1}, {"a": 1, "b": 2}, False),  # a key the docs do not show
        ({"a": 1, "…": "…"}, {"a": 1, "b": 2}, True),
        ({"a": 1, "c": 2}, {"a": 1}, False),  # a key the server does not send
        ({"a": None}, {"a": "r"}, False),
        ({"a": "r"}, {"a": None}, False),
        ({"a": {}}, {"a": {"triage": 1.2}}, True),
        ({"a": ["…"]}, {"a": [1, 2]}, True),
        ({"a": [{"b": 1}]}, {"a": [{"b": 1}, {"b": 2}]}, False),
        ({"a": True}, {"a": 1}, False),
    ],
)
def test_the_shape_comparison(shown, real, ok):
    assert (shape_mismatches(shown, real) == []) is ok


def shape_mismatches(shown, real, path: str = "$") -> list[str]:
    """Where `real` does not have the shape of the reply the docs show."""
    if isinstance(shown, dict):
        if not isinstance(real, dict):
            return [f"{path}: an object is shown, got {real!r:.80}"]
        if not shown:
            return []
        keys = set(shown) - {"…"}
        problems = [f"{path}.{key}: shown, not sent" for key in sorted(keys - set(real))]
        if "…" not in shown:
            problems += [f"{path}.{key}: sent, not shown" for key in sorted(set(real) - keys)]
        for key in sorted(keys & set(real)):
            problems += shape_mismatches(shown[key], real[key], f"{path}.{key}")
        return problems
    if isinstance(shown, list):
        if not isinstance(real, list):
            return [f"{path}: a list is shown, got {real!r:.80}"]
        if not shown or shown == ["…"]:
            return []
        if len(shown) != len(real):
            return [f"{path}: {len(shown)} items shown, {len(real)} sent"]
        return [
            problem
            for number, (one, other) in enumerate(zip(shown, real))
            for problem in shape_mismatches(one, other, f"{path}[{number}]")
        ]
    if shown == "…":
        return []
    kinds = (bool, type(None), str, (int, float))
    for kind in kinds:
        if isinstance(shown, kind):
            if isinstance(real, kind) and not (isinstance(real, bool) and kind is not bool):
                return []
            return [f"{path}: {shown!r:.40} shown, {real!r:.80} sent"]
    return [f"{path}: cannot compare {shown!r:.40}"]


def spec_route(url: str) -> str:
    """The docs/openapi.yaml path template that the URL's path matches."""
    path = re.sub(r"^https?://[^/]+", "", url).split("?")[0]
    for template in spec()["paths"]:
        if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path):
            return template
    raise AssertionError(f"{url}: no such route in docs/openapi.yaml")


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory, builtin_cache, smollm2):
    """A live server, and a scratch folder laid out as a checkout after `make serve`."""
    folder = tmp_path_factory.mktemp("docs-checkout")
    (folder / ".semif-token").write_text(TOKEN + "\n")
    (folder / ".venv").symlink_to(Path(sys.prefix))
    for name in ("docs", "bench"):
        (folder / name).symlink_to(ROOT / name)
    calibration = folder / "calibration.json"
    calibration.write_text('{"triage": 1.23}\n')
    env = real_env(
        builtin_cache,
        SEMIF_CALIBRATION=str(calibration),
        SEMIF_ADMIN_TOKEN=ADMIN_TOKEN,
    )
    with LiveServer(semif_serve_command(), env, folder / "server.log") as server:
        yield server, folder


def run_block(command: list[str], folder: Path, builtin_cache: Path):
    env = {**os.environ, "ADMIN_TOKEN": ADMIN_TOKEN, "SEMIF_CACHE_DIR": str(builtin_cache)}
    return subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )


def live_text(block: Block, server: LiveServer) -> str:
    return block.text.replace(DOC_ADDRESS, f"127.0.0.1:{server.port}")


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.parametrize("block", runnable(), ids=lambda block: block.name)
def test_the_example_runs_as_written(block, docs_server, builtin_cache):
    server, folder = docs_server
    if block.lang == "python":
        done = run_block([sys.executable, "-c", live_text(block, server)], folder, builtin_cache)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        assert done.stdout.strip(), "the example printed nothing"
        return
    if block.console:
        commands = [line[2:] for line in block.text.splitlines() if line.startswith("$ ")]
        shown = "\n".join(line for line in block.text.splitlines() if not line.startswith("$ "))
        script = "set -euo pipefail\n" + "\n".join(commands) + "\n"
        done = run_block(
            ["bash", "-c", script.replace(DOC_ADDRESS, f"127.0.0.1:{server.port}")],
            folder,
            builtin_cache,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        if shown.lstrip().startswith("{"):
            real = json.loads(done.stdout)
            shown_keys = re.findall(r'^    "([^"]+)":', shown, flags=re.MULTILINE)
            assert shown_keys and set(shown_keys) <= set(real), (shown_keys, sorted(real))
        return
    setup = "".join(
        other.text
        for other in blocks(block.doc)
        if other.setup and not other.skipped and other.line < block.line
    )
    done = run_block(
        ["bash", "-c", CURL_SHIM + setup + live_text(block, server)],
        folder,
        builtin_cache,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    pieces = STATUS_LINE.split(done.stdout)
    # split() gives: body, method, url, code, body, method, url, code, ..., trailing text
    calls = [pieces[index : index + 4] for index in range(0, len(pieces) - 1, 4)]
    assert calls, f"no curl ran:\n{done.stdout}\n{done.stderr}"
    shown = json.loads(block.shown) if block.shown else None
    for body, method, url, code in calls:
        reply = json.loads(body)
        expected_error = isinstance(shown, dict) and "error" in shown
        assert (int(code) >= 400) is expected_error, f"{method} {url}: {code} {body[:500]}"
        validate_reply(spec_route(url), method, int(code), reply)
    if shown is not None:
        assert len(calls) == 1, "a shown reply belongs to an example with one curl"
        assert shape_mismatches(shown, json.loads(calls[0][0])) == []

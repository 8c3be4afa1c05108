"""What tests/test_sdk_systemone.py and tests/test_sdk_decisions.py share: gated fake servers
(tests/serve_steered.py fake) steered through their control folder, a request held inside the scorer,
raw bodies in a Content-Encoding, the access log, and the worker's peak memory. Every wait is
bounded by fakes.WAIT_S."""

from __future__ import annotations

import functools
import gzip
import http.client
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from backports import zstd
from fakes import AUTH, WAIT_S, row
from live_server import LiveServer, fake_server, wait_for_file

ALIASES = "jev-latest=default,gpt-6-luna=default"
BODY_LIMIT = 1 << 20  # SEMIF_MAX_BODY_BYTES of the servers here: 1 MiB
BOMB_BYTES = 100 * 1000 * 1000  # what the zstd bomb inflates to: 100 MB of zeros
MiB = 1 << 20


Gated = tuple[LiveServer, Path]  # a gated server and its control folder


@contextmanager
def gated_servers(folder: Path, **variants: dict[str, str]) -> Iterator[dict[str, Gated]]:
    """One gated fake server per variant (its extra SEMIF_* settings), with the aliases and the
    1 MiB body limit, started and stopped side by side (each takes seconds), each gate open:
    every call passes until a `Holder` closes it. Yields each variant's (server, control)."""
    servers = {}
    for name, env in variants.items():
        settings = {"SEMIF_MODEL_ALIASES": ALIASES, "SEMIF_MAX_BODY_BYTES": str(BODY_LIMIT), **env}
        (folder / name).mkdir()
        servers[name] = fake_server(folder / name, gated=True, **settings)
    try:
        _raise_first(_side_by_side([server.__enter__ for server in servers.values()]))
        for name in servers:
            (folder / name / "control" / "release").touch()
        yield {name: (server, folder / name / "control") for name, server in servers.items()}
    finally:  # every process started, even one that never answered /health
        started = [server for server in servers.values() if hasattr(server, "process")]
        _raise_first(
            _side_by_side([functools.partial(s.__exit__, None, None, None) for s in started])
        )


def _side_by_side(calls: list[Callable[[], Any]]) -> list[BaseException | None]:
    """Each call on its own thread, all joined; what each raised, or None."""
    errors: list[BaseException | None] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            calls[index]()
        except BaseException as error:  # handed back to the caller
            errors[index] = error

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # LiveServer bounds its own start and stop
    return errors


def _raise_first(errors: list[BaseException | None]) -> None:
    for error in errors:
        if error is not None:
            raise error


class Holder:
    """One raw POST /decide held inside the gated scorer until `release`: it holds an admission
    slot (SEMIF_MAX_QUEUE) and the model. Closes the gate first; leaves it open on exit, so a
    failing test never blocks the next one."""

    def __init__(self, gated: tuple[LiveServer, Path]):
        self.server, self.control = gated
        self.replies: list[tuple[int, Any, dict]] = []
        self.thread = threading.Thread(target=self._post, daemon=True)

    def _post(self) -> None:
        self.replies.append(self.server.request("POST", "/decide", row(), AUTH, timeout=3 * WAIT_S))

    def __enter__(self) -> Holder:
        (self.control / "release").unlink(missing_ok=True)
        entered = len(list(self.control.glob("entered-*")))
        self.thread.start()
        wait_for_file(self.control / f"entered-{entered + 1}", WAIT_S)
        return self

    def release(self) -> None:
        (self.control / "release").touch()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the held request never finished"
        assert self.replies and self.replies[0][0] == 200, self.replies

    def __exit__(self, *exc) -> None:
        if self.thread.is_alive() or not (self.control / "release").exists():
            (self.control / "release").touch()
            self.thread.join(WAIT_S)


class InThread:
    """`call()` on a thread: its result, or the exception it raised, and how long it took."""

    def __init__(self, call: Callable[[], Any]):
        self.result: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._call = call
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self.result = self._call()
        except BaseException as error:  # handed to the test by `outcome`
            self.error = error
        self.seconds = time.monotonic() - started

    def outcome(self, timeout: float = 3 * WAIT_S) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the call never returned"
        if self.error is not None:
            raise self.error
        return self.result


def access_statuses(server: LiveServer, route: str) -> list[int]:
    """The status of every request to `route` in the server's access log, in order."""
    statuses = []
    for line in server.log_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("route") == route and record.get("status") is not None:
                statuses.append(record["status"])
    return statuses


def wait_for_status(server: LiveServer, route: str, status: int, after: int) -> None:
    """Until the access log shows a `status` reply to `route` past its first `after` lines."""
    deadline = time.monotonic() + WAIT_S
    while status not in access_statuses(server, route)[after:]:
        assert time.monotonic() < deadline, f"no {status} on {route}:\n{server.log_text()}"
        time.sleep(0.01)


def post_raw(
    server: LiveServer, path: str, data: bytes, encoding: str | None = None, timeout=WAIT_S
) -> tuple[int, Any, http.client.HTTPMessage]:
    """POST `data` as it is (already encoded), `Content-Encoding: encoding` when given; the
    status, the JSON reply and its headers."""
    headers = {**AUTH, "Content-Type": "application/json"}
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        connection.request("POST", path, body=data, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null"), response.headers
    finally:
        connection.close()


def encoded(body: dict, encoding: str) -> bytes:
    data = json.dumps(body).encode()
    return gzip.compress(data) if encoding == "gzip" else zstd.compress(data)


@functools.cache
def zstd_bomb() -> bytes:
    """One zstd frame, a few KB, of BOMB_BYTES zeros: 100 times the body limit once decoded.
    Compressed a MiB at a time, so the test never holds the 100 MB either."""
    compressor = zstd.ZstdCompressor()
    chunk = bytes(MiB)
    parts = [compressor.compress(chunk) for _ in range(BOMB_BYTES // MiB)]
    parts.append(compressor.compress(bytes(BOMB_BYTES % MiB)))
    parts.append(compressor.flush())
    return b"".join(parts)


def worker_pid(server: LiveServer) -> int:
    """The gunicorn worker's pid (the one child of the master, which owns the app)."""
    master = server.process.pid
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def peak_growth(server: LiveServer, action: Callable[[], Any]) -> tuple[Any, int]:
    """`action()`'s result and how far the worker's resident memory peaked above where it was
    before, in bytes: the peak (VmHWM) is reset to the current size first (clear_refs 5)."""
    pid = worker_pid(server)
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = _kib(pid, "VmRSS")
    result = action()
    return result, (_kib(pid, "VmHWM") - before) * 1024


def retry_headers_agree(headers) -> bool:
    """Retry-After is the estimate in whole seconds rounded up, retry-after-ms the same wait to
    the millisecond, both within [1 s, 60 s] (the estimate depends on this server's pace)."""
    ms = int(headers["retry-after-ms"])
    return 1000 <= ms <= 60_000 and int(headers["retry-after"]) == math.ceil(ms / 1000)

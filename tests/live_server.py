"""Start and stop a real semif-serve gunicorn process on 127.0.0.1 for a test, with bounds."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import serve_steered
from fakes import TOKEN

START_TIMEOUT_S = 90
STOP_TIMEOUT_S = 30


LISTENING = re.compile(rb"Listening at: http://127\.0\.0\.1:([0-9]+) ")


def free_port() -> int:
    """A port free now, for servers that cannot bind port 0 and say which port they got
    (nginx); another process may take it before they bind."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it is still running after `timeout_s`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)


def wait_for_file(path: Path, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


class LiveServer:
    """`with LiveServer(...)` returns once /health answers `ready_status` (200: ready; 503: the
    worker is up and its models are loading). The server binds 127.0.0.1:0 and `port` is the
    one its master says it listens on (no port is picked before the bind, so none is raced for)."""

    def __init__(
        self, command: list[str], env: dict[str, str], log_path: Path, ready_status: int = 200
    ):
        self.ready_status = ready_status
        self.port: int | None = None
        self.env = {**os.environ, "SEMIF_API_TOKEN": TOKEN, "SEMIF_BIND": "127.0.0.1:0", **env}
        self.log_path = log_path
        self.command = command

    def __enter__(self) -> LiveServer:
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=self.log, stderr=self.log
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.process.poll() is None, f"server exited early:\n{self.log_text()}"
            assert time.monotonic() < deadline, f"server did not start:\n{self.log_text()}"
            if self.port is None:
                self.port = self.listening_port()
                time.sleep(0.01)
                continue
            try:
                if self.request("GET", "/health", timeout=1)[0] == self.ready_status:
                    return self
            except OSError:
                time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        stop(self.process, STOP_TIMEOUT_S)
        self.log.close()

    def listening_port(self) -> int | None:
        """The port gunicorn's master logged ("Listening at: ..."), once it has."""
        found = LISTENING.search(self.log_path.read_bytes())
        return int(found.group(1)) if found else None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def connect(self, timeout: float = 10) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def request(self, method, path, body=None, headers=None, timeout=30):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            connection.request(method, path, body=payload, headers=headers or {})
            response = connection.getresponse()
            return (
                response.status,
                json.loads(response.read() or b"null"),
                dict(response.getheaders()),
            )
        finally:
            connection.close()


def semif_serve_command() -> list[str]:
    """`semif-serve serve` from this environment."""
    return [shutil.which("semif-serve") or str(Path(sys.prefix) / "bin" / "semif-serve"), "serve"]


def real_env(builtin_cache: Path, **extra: str) -> dict[str, str]:
    """The environment of a real server on the built-in SmolLM2 on the CPU, in float32 (the
    in-process `smollm2` fixture's dtype; the CPU default depends on the machine's flags, and
    tests/test_e2e.py checks a server left to it)."""
    return {
        "SEMIF_MODEL": "builtin:smollm2-135m",
        "SEMIF_DEVICE": "cpu",
        "SEMIF_DTYPE": "float32",
        "SEMIF_CACHE_DIR": str(builtin_cache),
        **extra,
    }


def fake_server(
    tmp_path: Path, gated: bool = False, ready_status: int = 200, **env: str
) -> LiveServer:
    control = tmp_path / "control"
    control.mkdir(exist_ok=True)
    extra = {"SEMIF_TEST_CONTROL": str(control), "SEMIF_TEST_GATED": "1" if gated else "0", **env}
    return LiveServer(serve_steered.command("fake"), extra, tmp_path / "server.log", ready_status)


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """Read one HTTP response (Content-Length framed) from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    headers = dict(
        line.decode("latin-1").lower().split(": ", 1) for line in head.split(b"\r\n")[1:]
    )
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(head.split()[1]), json.loads(body[:length])

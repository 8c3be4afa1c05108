"""Real nginx on 127.0.0.1 running deploy/nginx/semif.conf in front of test replicas.

`nginx_binary` finds nginx, installing Debian's nginx-light when it is missing (as root, or
with sudo), and skips the test with the reason where it cannot. `Nginx` renders the shipped
recipe with only its `listen` line and replica list changed (and, for the round-robin
comparison, its `hash` line removed), runs it in the foreground as one process, and reads back
its access log: which replica served each request.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from live_server import free_port, stop

RECIPE = Path(__file__).resolve().parents[1] / "deploy" / "nginx"
INSTALL_TIMEOUT_S = 300
START_TIMEOUT_S = 10
STOP_TIMEOUT_S = 10
LOG_TIMEOUT_S = 10
LISTEN = "listen 8470;"
HASH = "hash $semif_route consistent;"
LOG_FORMAT = (
    "$msec $http_x_semif_state_key $status [$upstream_addr] [$upstream_status] "
    "$http_x_semif_session"
)


def installed_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (path for path in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(path, os.X_OK)), None
    )


def nginx_binary() -> str:
    found = installed_nginx()
    if found:
        return found
    if not (Path("/etc/debian_version").exists() and shutil.which("apt-get")):
        pytest.skip("nginx is not installed and this is not Debian with apt-get to install it")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if sudo and not shutil.which("sudo"):
        pytest.skip("nginx is not installed; installing it needs root or sudo")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        # Two test workers may install at once: the second waits for dpkg's lock.
        ["apt-get", "-o", "DPkg::Lock::Timeout=300", "update", "-qq"],
        ["apt-get", "-o", "DPkg::Lock::Timeout=300", "install", "-y", "-qq", "nginx-light"],
    ):
        done = subprocess.run(
            sudo + command, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
        )
        if done.returncode != 0:
            pytest.skip(f"nginx is not installed and `{' '.join(command)}` failed: {done.stderr}")
    found = installed_nginx()
    if found is None:
        pytest.skip("nginx-light was installed, but no nginx binary is on PATH or in /usr/sbin")
    return found


@dataclass(frozen=True)
class Logged:
    """One access-log line: when nginx finished the request, its state key, its status, the
    replicas it tried in order (two when the first failed and nginx moved on), its session."""

    at: float
    state_key: str
    status: int
    upstreams: tuple[str, ...]
    session: str = ""


class Nginx:
    """`with Nginx(folder, [port_a, port_b]) as router:` nginx on `router.port`."""

    def __init__(self, folder: Path, replica_ports: list[int], hashed: bool = True):
        self.folder = folder
        self.port = free_port()
        folder.mkdir(parents=True, exist_ok=True)
        recipe = (RECIPE / "semif.conf").read_text()
        assert recipe.count(LISTEN) == 1 and recipe.count(HASH) == 1, "the recipe changed shape"
        recipe = recipe.replace(LISTEN, f"listen 127.0.0.1:{self.port};")
        if not hashed:
            recipe = recipe.replace(HASH, "")
        (folder / "semif.conf").write_text(recipe)
        (folder / "semif-replicas.conf").write_text(
            "".join(
                f"server 127.0.0.1:{port} max_fails=1 fail_timeout=10s;\n" for port in replica_ports
            )
        )
        temp = "\n".join(
            f"  {kind}_temp_path {folder / kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        # One process in the foreground (no master, no user switch): the test owns its pid.
        (folder / "nginx.conf").write_text(
            f"daemon off;\nmaster_process off;\npid {folder / 'nginx.pid'};\n"
            f"error_log {folder / 'error.log'} info;\n"
            "events { worker_connections 256; }\n"
            "http {\n"
            f"  log_format semif '{LOG_FORMAT}';\n"
            f"  access_log {folder / 'access.log'} semif;\n"
            f"{temp}\n"
            "  client_body_buffer_size 1m;\n"
            "  include semif.conf;\n"
            "}\n"
        )

    def __enter__(self) -> Nginx:
        self.process = subprocess.Popen(
            [nginx_binary(), "-p", str(self.folder), "-c", str(self.folder / "nginx.conf")],
            stdout=subprocess.DEVNULL,
            stderr=open(self.folder / "stderr.log", "wb"),
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.process.poll() is None, f"nginx exited:\n{self.logs()}"
            assert time.monotonic() < deadline, f"nginx did not listen:\n{self.logs()}"
            try:
                with socket.create_connection(("127.0.0.1", self.port), 1):
                    return self
            except OSError:
                time.sleep(0.02)

    def __exit__(self, *exc: object) -> None:
        stop(self.process, STOP_TIMEOUT_S)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        return "\n".join(
            (self.folder / name).read_text(errors="replace")
            for name in ("stderr.log", "error.log")
            if (self.folder / name).exists()
        )

    def access(self, expected: int) -> list[Logged]:
        """The access log once it holds `expected` lines: nginx writes a request's line just
        after its reply, so a caller that has every reply may still be ahead of the log."""
        deadline = time.monotonic() + LOG_TIMEOUT_S
        while True:
            lines = (self.folder / "access.log").read_text().splitlines()
            if len(lines) >= expected:
                return [parse_logged(line) for line in lines]
            assert time.monotonic() < deadline, f"{len(lines)} of {expected} requests logged"
            time.sleep(0.01)


def parse_logged(line: str) -> Logged:
    at, key, status, rest = line.split(" ", 3)
    upstreams = rest.split("] [", 1)[0].strip("[]")
    session = rest.rsplit("] ", 1)[1]
    return Logged(
        float(at),
        "" if key == "-" else key,
        int(status),
        tuple(part.strip() for part in upstreams.split(",") if part.strip() not in ("", "-")),
        "" if session == "-" else session,
    )

"""The management state: what the operator last set through the management API, kept in one
small file so that the next worker (gunicorn respawns one that died) serves it too.

Each model's entry is the table its last successful `PUT /v1/models/{id}` sent (None: the
model as configured, by SEMIF_MODEL or SEMIF_MODELS_FILE) and whether its last change loaded it
(a PUT) or unloaded it (an unload, alone or in bulk). A worker replays the state after its
startup models have loaded: every recorded table in the order of their last PUT, then every
unload. A model that fails to replay is logged and skipped; the others are still replayed.

The file is JSON, rewritten whole for each change (a temporary file in the same folder,
fsync, `os.replace`): a worker killed in the middle leaves the old state or the new one, never
half of one. It holds a key of the startup configuration it was recorded over: a state recorded
over other models (SEMIF_MODEL or SEMIF_MODELS_FILE changed between two runs with the same
SEMIF_STATE_DIR) is not replayed. A file that cannot be read is logged in one line and the
worker starts from the configured models; it never stops a worker from starting. A server
holds its folder (`lock_folder`): a second server started on it stops, naming the first.

Plain Python: no HTTP, no torch. `semif_serve/server.py` records and replays through it.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from semif_serve.config import ConfigError
from semif_serve.runtime.specs import MODEL_ID

log = logging.getLogger(__name__)

STATE_FILE = "management.json"
LOCK_FILE = ".lock"  # held by the server using the folder (`lock_folder`)
FORMAT = 1
FOLDER_MODE = 0o700
VARIABLE = "SEMIF_STATE_DIR"

# model id -> {"table": the PUT's table or None, "loaded": bool}, in the order of the last PUTs
Models = dict[str, dict[str, Any]]


class StateError(ValueError):
    """A state file that cannot be replayed; the message says why."""


def configuration_key(models: Iterable[dict[str, Any]], default_id: str) -> str:
    """A digest of the startup configuration: the configured models (their specs as dicts)
    and the default's id. A state recorded over another configuration is not replayed."""
    document = {"default": default_id, "models": list(models)}
    text = json.dumps(document, sort_keys=True, default=str, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def with_register(models: Models, model_id: str, table: dict[str, Any]) -> Models:
    """`models` after a successful PUT of `table`: the model loaded with it, and its PUT the
    latest (replayed last)."""
    changed = {key: entry for key, entry in models.items() if key != model_id}
    changed[model_id] = {"table": copy.deepcopy(table), "loaded": True}
    return changed


def with_unloads(models: Models, model_ids: Iterable[str]) -> Models:
    """`models` after a successful unload of `model_ids`: each keeps its table (and its place
    among the PUTs), unloaded."""
    changed = dict(models)
    for model_id in model_ids:
        table = changed.get(model_id, {}).get("table")
        changed[model_id] = {"table": table, "loaded": False}
    return changed


def replay_plan(models: Models) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """(the tables to register, in order; the ids to unload after them)."""
    registers = [
        (key, entry["table"]) for key, entry in models.items() if entry["table"] is not None
    ]
    unloads = [key for key, entry in models.items() if not entry["loaded"]]
    return registers, unloads


def render_state(models: Models, configuration: str) -> str:
    entries = [{"id": key, **entry} for key, entry in models.items()]
    document = {"format": FORMAT, "configuration": configuration, "models": entries}
    return json.dumps(document, indent=1, sort_keys=True, allow_nan=False) + "\n"


def parse_state(text: str, configuration: str) -> Models:
    """The models of a state file's text; StateError when it is not one, or was recorded over
    another configuration."""
    try:
        document = json.loads(text, parse_constant=_no_constant)
    except ValueError as error:
        raise StateError(f"not JSON: {error}") from None
    if not isinstance(document, dict) or set(document) != {"format", "configuration", "models"}:
        raise StateError("not a management state (keys format, configuration, models)")
    if document["format"] != FORMAT:
        raise StateError(f"format {document['format']!r}, not {FORMAT}")
    if document["configuration"] != configuration:
        raise StateError(
            "recorded over another startup configuration (SEMIF_MODEL, SEMIF_MODELS_FILE or a "
            "setting they depend on changed)"
        )
    entries = document["models"]
    if not isinstance(entries, list):
        raise StateError("models: must be a list")
    models: Models = {}
    for index, entry in enumerate(entries):
        valid = (
            isinstance(entry, dict)
            and set(entry) == {"id", "table", "loaded"}
            and isinstance(entry["id"], str)
            and (entry["table"] is None or isinstance(entry["table"], dict))
            and isinstance(entry["loaded"], bool)
        )
        if not valid:
            raise StateError(f"models[{index}]: must be {{id, table (object or null), loaded}}")
        if not MODEL_ID.fullmatch(entry["id"]):  # e.g. "": never registered, so never replayed
            log.error(
                "management state: models[%d]: %r is not a model id: ignored", index, entry["id"]
            )
            continue
        if entry["id"] in models:
            raise StateError(f"models[{index}]: {entry['id']!r} appears twice")
        models[entry["id"]] = {"table": entry["table"], "loaded": entry["loaded"]}
    return models


def _no_constant(constant: str) -> None:
    raise ValueError(f"{constant} is not a JSON number")


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` whole: a temporary file beside it (mode 0600), fsync'd, renamed
    over it, and the folder fsync'd so the rename itself survives a crash of the host."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def own_folder(folder: Path) -> Path:
    """`folder` (created with its missing parents, mode 0700) when it is a folder of this user
    that no one else can write; else ConfigError naming SEMIF_STATE_DIR. A state another user
    could write would choose the models (and so the files) this server loads."""
    folder = folder.expanduser().absolute()
    try:
        folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        info = folder.stat()
    except OSError as error:
        raise ConfigError(
            f"{VARIABLE}: cannot create {folder}: {error.strerror or error}"
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{VARIABLE}: {folder} is not a folder")
    if info.st_uid != os.getuid():
        raise ConfigError(
            f"{VARIABLE}: {folder} belongs to uid {info.st_uid}, not this user ({os.getuid()})"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"{VARIABLE}: {folder} is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{VARIABLE}: {folder} is not writable by this user")
    return folder


def lock_folder(folder: Path) -> int:
    """Take `folder` for this server: an exclusive lock on its LOCK_FILE (holding this process's
    pid), kept while the returned descriptor stays open (the worker forked from this process
    shares it). A folder another server holds is a ConfigError naming SEMIF_STATE_DIR and that
    server's pid: two servers on one folder would overwrite each other's state."""
    path = folder / LOCK_FILE
    try:
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        raise ConfigError(f"{VARIABLE}: cannot open {path}: {error.strerror or error}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(handle, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(handle)
        raise ConfigError(
            f"{VARIABLE}: {folder} is in use by another semif-serve server (pid {holder}); "
            "one server per folder"
        ) from None
    os.ftruncate(handle, 0)
    os.pwrite(handle, f"{os.getpid()}\n".encode(), 0)
    return handle


@dataclass
class ReplayReport:
    registered: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "id (why)"

    def summary(self) -> str:
        """One line: what was registered, unloaded and failed, or that nothing was recorded."""
        if not (self.registered or self.unloaded or self.failed):
            return "nothing recorded"
        parts = [
            f"{name} {', '.join(ids)}"
            for name, ids in (
                ("registered", self.registered),
                ("unloaded", self.unloaded),
                ("failed", self.failed),
            )
            if ids
        ]
        return "; ".join(parts)


class ManagementState:
    """The state file of one server and what it holds now; `registered` and `unloaded` record
    a change (thread-safe: management calls of different models run at once)."""

    def __init__(self, path: Path, configuration: str, models: Models | None = None):
        self.path = path
        self.configuration = configuration
        self._models: Models = dict(models or {})
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: Path, configuration: str) -> ManagementState:
        """The state in `path` (none when it does not exist). One that cannot be read or
        replayed is logged in one line and set aside: the worker starts from the configured
        models, and the next change replaces the file."""
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return cls(path, configuration)
        except (OSError, UnicodeDecodeError) as error:
            log.error("management state %s not replayed (unreadable: %s)", path, error)
            return cls(path, configuration)
        try:
            return cls(path, configuration, parse_state(text, configuration))
        except StateError as error:
            log.error(
                "management state %s not replayed (%s); starting from the configured models",
                path,
                error,
            )
            return cls(path, configuration)

    def models(self) -> Models:
        with self._lock:
            return copy.deepcopy(self._models)

    def registered(self, model_id: str, table: dict[str, Any]) -> None:
        self._change(lambda models: with_register(models, model_id, table))

    def unloaded(self, model_ids: Iterable[str]) -> None:
        ids = list(model_ids)
        self._change(lambda models: with_unloads(models, ids))

    def _change(self, change: Callable[[Models], Models]) -> None:
        with self._lock:
            changed = change(self._models)
            if changed == self._models and list(changed) == list(self._models):
                return  # a replayed change, or one that changes nothing: no write
            self._models = changed
            try:
                write_atomically(self.path, render_state(changed, self.configuration))
            except (OSError, ValueError) as error:
                log.error(
                    "management state not saved to %s (%s): the change is served, but a new "
                    "worker would not replay it",
                    self.path,
                    error,
                )

    def replay(
        self,
        register: Callable[[str, dict[str, Any]], Any],
        unload: Callable[[str], Any],
        before_each: Callable[[], None] | None = None,
    ) -> ReplayReport:
        """Apply the state: every recorded table in order, then every unload, calling
        `before_each` before each (the worker's heartbeat: a load may take a while). A model
        whose replay fails is logged and reported; the others are still replayed."""
        registers, unloads = replay_plan(self.models())
        report = ReplayReport()
        beat = before_each or (lambda: None)
        for model_id, table in registers:
            beat()
            if _replayed(report, register, model_id, table):
                report.registered.append(model_id)
        for model_id in unloads:
            beat()
            if _replayed(report, unload, model_id):
                report.unloaded.append(model_id)
        return report


def _replayed(report: ReplayReport, apply: Callable[..., Any], model_id: str, *rest: Any) -> bool:
    try:
        apply(model_id, *rest)
    except Exception as error:  # one model's failure never stops the others, nor the worker
        why = " ".join(str(error).split()) or type(error).__name__
        log.error("replaying the management state of model %s failed: %s", model_id, why)
        report.failed.append(f"{model_id} ({why})")
        return False
    return True

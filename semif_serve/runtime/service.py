"""`DecisionService`: request bodies → SemIf rows → ONE engine call → response bodies.

It checks the request shape and limits, expands order-averaged decisions into one row per
ordering, leases the requested model from the runtime (FIFO, within the queue timeout), sends
every row of a request to its engine in a single call (one `score` for a plain /decide, else one
`score_shared`), and builds the reply: native results untouched (INV-1), plus `calibrated` or
`combined` next to them. A request whose client has gone by the time it holds the model is
dropped unscored (`ClientGone`). A row the scorer refused (`RowError`) becomes
`InvalidRequest` (422); any other scorer failure is the engine's (500 `scoring_failed`, logged
with its traceback, or 503 `out_of_memory`), and any failure while building the reply becomes
`ScoringFailed` (500, bug hunt C3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from semif_serve.decisions import (
    MAX_OPTIONS_FOR_ALL,
    ORDERINGS,
    averaged_result,
    calibrated,
    expand,
)
from semif_serve.errors import InvalidRequest, ScoringFailed, same_failure
from semif_serve.runtime.jobs import Job
from semif_serve.runtime.pinning import Pinned
from semif_serve.runtime.registry import Runtime
from semif_serve.runtime.selection import cost_of
from semif_serve.runtime.specs import requested_model
from semif_serve.scoring.inputs import Batched
from semif_serve.scoring.rows import InvalidRow, Row, RowError, parse_row

SEMIF_COMMIT = "23cf1f39fc9534fe81437200959b6dfc7106e45a"
ROW_KEYS = ("id", "state", "question", "options")
ROUTING_KEYS = ("model", "timeout_s")
DECIDE_KEYS = frozenset({*ROW_KEYS, *ROUTING_KEYS, "workload", "orderings"})
SHARED_KEYS = frozenset({*ROUTING_KEYS, "state", "decisions", "workload"})
DECISION_KEYS = frozenset({"id", "question", "options", "orderings"})
MAX_TIMEOUT_S = 86_400  # a day: any longer wait is a caller's bug, never a plan
Route = tuple[str | None, float | None, float | None]  # (model id, timeout_s, arrived)


@dataclass(frozen=True)
class Outcome:
    body: dict[str, Any]
    rows: int  # rows the engine scored, for the request log


@dataclass
class _Decision:
    """One decision of a request and the rows it became."""

    field: str  # how error messages name it: "" for /decide, "decisions[i]." for shared
    id: str
    option_ids: list[str]
    mode: str
    rows: list[Row] = field(default_factory=list)


ClientCheck = Callable[[], bool]  # True once the caller has closed its connection


@dataclass(frozen=True)
class _Call:
    """An engine call in its two stages: encode (no lock), then score."""

    prepare: Callable[[Any, Any], Any]
    run: Callable[[Any, Any], Any]


DIRECT = _Call(
    prepare=lambda engine, row: engine.prepare(row), run=lambda engine, row: engine.score(row)
)
SHARED = _Call(
    prepare=lambda engine, rows: engine.prepare_shared(rows),
    run=lambda engine, rows: engine.score_shared(rows),
)


class DecisionService:
    def __init__(self, runtime: Runtime, settings: Any):
        self._runtime = runtime
        self._settings = settings

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    def health(self) -> dict[str, Any]:
        """/health's account: `status` "ok" while the default model is loaded or can load on
        demand; "unavailable", with `reason` "model_load_failed", while its last load failed
        (every request would get that 503), until a load succeeds."""
        settings = self._settings
        model, failed = self._runtime.default_model_state()
        state = {"status": "unavailable", "reason": "model_load_failed"} if failed else {}
        return {
            "status": "ok",
            **state,
            "semif_commit": SEMIF_COMMIT,
            "model": model,
            "vram_cap_gib": settings.vram_cap_gib,
            "max_tokens": settings.max_tokens,
            "max_decisions": settings.max_decisions,
            "workloads": dict(settings.calibration),
        }

    def decide(
        self,
        body: dict[str, Any],
        client_gone: ClientCheck | None = None,
        session: str | None = None,
        patience_s: float | None = None,
    ) -> Outcome:
        """/decide. `session`: the caller's (`semif_serve.session`), whose stored state
        prefixes the call may reuse and add to; `patience_s`: the timeout its client announced
        (it bounds the request's wait as `timeout_s` does). One call: its deadline counts from
        now."""
        _check_keys(body, DECIDE_KEYS, "body")
        workload = self._workload(body)
        decision = _decision(body, "", session)
        _check_workload_without_orderings(workload, [decision])
        route = _routing(body, patience_s, None)
        if decision.mode == "none":
            result, batch = self._scored(route, DIRECT, decision.rows[0], client_gone, [decision])
            return Outcome(
                _building(lambda: _with_batch(self._with_calibration(result, workload), batch)), 1
            )
        self._check_row_count([decision])
        (results, _), batch = self._scored(route, SHARED, decision.rows, client_gone, [decision])
        return Outcome(
            _building(lambda: _with_batch(_assemble([decision], results)[0], batch)), len(results)
        )

    def decide_shared(
        self,
        body: dict[str, Any],
        client_gone: ClientCheck | None = None,
        session: str | None = None,
        breakpoints: tuple[int, ...] = (),
        empty_state: bool = False,
        patience_s: float | None = None,
        arrived: float | None = None,
        pinned: Pinned | None = None,
    ) -> Outcome:
        """/decide/shared (and the ecosystem routes' calls: each of a request's calls passes
        the request's `arrived`, so all wait within its one deadline, and its `pinned`, so all
        run under one configuration); `session` and `patience_s` as for `decide`; `arrived`:
        when the request arrived (`time.monotonic`; default now), from which its one deadline
        counts; `pinned`: the configuration its first call ran under (`pinning.Pinned`);
        `breakpoints`: where the caller marked reusable ends of the state (`Row.breakpoints`);
        `empty_state`: an empty state is allowed (the ecosystem formats allow one)."""
        _check_keys(body, SHARED_KEYS, "body")
        workload = self._workload(body)
        if "state" not in body:
            raise InvalidRequest("state: missing")
        entries = body.get("decisions")
        if not isinstance(entries, list):
            raise InvalidRequest("decisions: must be an array of {id, question, options}")
        limit = self._settings.max_decisions
        if not 1 <= len(entries) <= limit:
            raise InvalidRequest(f"decisions: must hold 1..{limit} entries, got {len(entries)}")
        decisions = []
        for index, entry in enumerate(entries):
            where = f"decisions[{index}]."
            if not isinstance(entry, dict):
                raise InvalidRequest(f"decisions[{index}]: must be an object")
            _check_keys(entry, DECISION_KEYS, where)
            entry = {**entry, "state": body["state"]}
            decisions.append(_decision(entry, where, session, breakpoints, empty_state))
        _check_workload_without_orderings(workload, decisions)
        self._check_row_count(decisions)
        _check_unique_ids(decisions)
        route = _routing(body, patience_s, arrived)
        rows = [row for decision in decisions for row in decision.rows]
        (results, timing), batch = self._scored(
            route, SHARED, rows, client_gone, decisions, pinned
        )

        def reply() -> dict[str, Any]:
            built = _assemble(decisions, results)
            body = {
                "results": [self._with_calibration(result, workload) for result in built],
                "timing": timing,
            }
            return _with_batch(body, batch)

        return Outcome(_building(reply), len(rows))

    def _scored(
        self,
        route: Route,
        call: _Call,
        rows: Any,
        client_gone: ClientCheck | None,
        decisions: list[_Decision],
        pinned: Pinned | None = None,
    ) -> Any:
        """(the engine call's outcome, the batch it ran in or None). Encode the rows with the
        loaded model's tokenizer before queueing (every limit checked without holding a slot or
        the lock: a refusal delays no one); with SEMIF_MAX_BATCH_ROWS > 1, the dynamic batcher
        scores them with the model's other queued requests; else lease the model and, unless the
        caller has gone meanwhile (checked while it waits and once more when it holds the
        model), run the engine call. A request that found its model unloaded (or replaced while
        it waited) is encoded once it holds it. A row the scorer refused (RowError) is a 422
        naming its decision; any other failure is the engine's 500/503. A later call of a
        request that `pinned` a configuration is refused only under that configuration: once
        it holds the model and the pin has been checked (a refusal may come from limits a
        `PUT` set since its first call: 503 `configuration_changed` then)."""
        model_id, timeout_s, arrived = route
        early = self._runtime.entry(model_id).engine
        prepared = None
        if early is not None:
            try:
                prepared = _refused_as_422(call.prepare, early, rows, decisions)
            except InvalidRequest:
                if pinned is None or pinned.configuration is None:
                    raise
        if prepared is not None and self._settings.max_batch_rows > 1:
            job = Job(
                item=prepared,
                cost=cost_of(prepared),
                engine=early,
                prepare=lambda engine: call.prepare(engine, rows),
                gone=client_gone,
                pinned=pinned,
            )
            scored = self._runtime.score_batched(model_id, timeout_s, job, arrived)
            return _unbatched(scored, decisions)
        tokens = 0 if prepared is None else cost_of(prepared).tokens
        lease = self._runtime.lease(model_id, timeout_s, client_gone, tokens, arrived, pinned)
        with lease as engine:
            if prepared is None or engine is not early:
                prepared = _refused_as_422(call.prepare, engine, rows, decisions)
            return _refused_as_422(call.run, engine, prepared, decisions), None

    def _workload(self, body: dict[str, Any]) -> str | None:
        workload = body.get("workload")
        if workload is None:
            return None
        if not isinstance(workload, str):
            raise InvalidRequest("workload: must be a string")
        if workload not in self._settings.calibration:
            known = ", ".join(sorted(self._settings.calibration)) or "none configured"
            raise InvalidRequest(f"workload: unknown workload {workload!r} (known: {known})")
        return workload

    def _check_row_count(self, decisions: list[_Decision]) -> None:
        rows = sum(len(decision.rows) for decision in decisions)
        limit = self._settings.max_decisions
        if rows > limit:
            raise InvalidRequest(
                f"orderings: the request expands to {rows} rows, over the limit of {limit} "
                "decisions per request (SEMIF_MAX_DECISIONS)"
            )

    def _with_calibration(self, result: dict[str, Any], workload: str | None) -> dict[str, Any]:
        if workload is None:
            return result
        temperature = self._settings.calibration[workload]
        return {**result, "calibrated": calibrated(result, workload, temperature)}


def _check_keys(body: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequest(
            f"{where}: unknown keys {unknown}; allowed: {', '.join(sorted(allowed))}"
        )


def _decision(
    body: dict[str, Any],
    where: str,
    session: str | None = None,
    breakpoints: tuple = (),
    empty_state: bool = False,
) -> _Decision:
    """Validate one decision and expand it into its rows (one, or one per ordering), each in
    the caller's `session` with its state's `breakpoints`."""
    mode = body.get("orderings", "none")
    if mode not in ORDERINGS:
        raise InvalidRequest(
            f"{where}orderings: must be one of {', '.join(ORDERINGS)}, got {mode!r}"
        )
    fields = {key: body[key] for key in ROW_KEYS if key in body}
    try:
        row = replace(
            parse_row(fields, empty_state=empty_state), cache_key=session, breakpoints=breakpoints
        )
    except InvalidRow as error:
        message = str(error)
        # The shared state is one field of the request, not of each decision.
        raise InvalidRequest(message if message.startswith("state") else where + message) from None
    if mode == "all" and len(row.options) > MAX_OPTIONS_FOR_ALL:
        raise InvalidRequest(
            f"{where}orderings: 'all' is allowed for at most {MAX_OPTIONS_FOR_ALL} options, "
            f"got {len(row.options)}; use 'rotations'"
        )
    decision = _Decision(field=where, id=row.id, option_ids=row.option_ids, mode=mode)
    if mode == "none":
        decision.rows = [row]
    else:
        decision.rows = expand(row, mode)
    return decision


def _check_workload_without_orderings(workload: str | None, decisions: list[_Decision]) -> None:
    if workload is not None and any(decision.mode != "none" for decision in decisions):
        raise InvalidRequest(
            "workload: cannot be combined with orderings (no temperature is fitted on combined "
            "scores yet)"
        )


def _check_unique_ids(decisions: list[_Decision]) -> None:
    """Decision ids and the `<id>#o<k>` ids of their orderings share one namespace, so every id
    in the reply (a result's, or an ordering's) names one thing."""
    owners: dict[str, str] = {}
    for decision in decisions:
        # A plain decision's one row carries the decision's own id: count it once.
        for name in dict.fromkeys([decision.id, *(row.id for row in decision.rows)]):
            if name in owners:
                raise InvalidRequest(
                    f"{decision.field}id: {name!r} is already used by {owners[name]}"
                )
            owners[name] = decision.field.rstrip(".")


def _routing(body: dict[str, Any], patience_s: float | None, arrived: float | None) -> Route:
    """The optional `model` id, `timeout_s` (which may only lower the queue timeout: the
    shorter of the body's and the client's announced `patience_s`) and `arrived`."""
    model_id = requested_model(body.get("model"))
    timeout_s = body.get("timeout_s")
    if timeout_s is not None:
        valid = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
        # Compared before any float arithmetic: a 400-digit integer must be a 422, not an
        # OverflowError somewhere in the queue.
        if not valid or not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise InvalidRequest(
                f"timeout_s: must be a number of seconds, 0 < timeout_s <= {MAX_TIMEOUT_S}"
            )
        timeout_s = float(timeout_s)
    if patience_s is not None:
        timeout_s = patience_s if timeout_s is None else min(timeout_s, patience_s)
    return model_id, timeout_s, arrived


def _unbatched(outcome: Any, decisions: list[_Decision]) -> tuple[Any, dict[str, int] | None]:
    """A batched job's outcome as `_scored` returns it; its failure raised here, in its own
    request's thread (a copy: one exception raised in several threads garbles its traceback).
    A row refused, by the scorer or when a replaced model encoded it again, is the caller's 422."""
    value = outcome.outcome if isinstance(outcome, Batched) else outcome
    if isinstance(value, RowError):
        raise InvalidRequest(_locate(value, decisions))
    if not isinstance(outcome, Batched):  # failed before scoring: dropped, out of memory, ...
        raise same_failure(outcome)
    return value, {"rows": outcome.rows, "padded_length": outcome.padded_length}


def _with_batch(body: dict[str, Any], batch: dict[str, int] | None) -> dict[str, Any]:
    """The reply, with the batch it ran in next to the native fields (batching on)."""
    return body if batch is None else {**body, "batch": batch}


def _refused_as_422(
    stage: Callable[[Any, Any], Any], engine: Any, argument: Any, decisions: list[_Decision]
) -> Any:
    """Run one stage of an engine call; a row the scorer refused is the caller's 422."""
    try:
        return stage(engine, argument)
    except RowError as error:  # only the scorer's own refusals are the caller's fault
        raise InvalidRequest(_locate(error, decisions)) from None


def _locate(error: RowError, decisions: list[_Decision]) -> str:
    index = getattr(error, "row_index", None)
    message = str(error)
    if index is None:
        return message
    prefix = f"rows[{index}]"
    if message.startswith(prefix):
        message = message[len(prefix) :].lstrip(".: ")
    for decision in decisions:
        if index < len(decision.rows):
            row_id = decision.rows[index].id
            name = decision.field.rstrip(".") or "request"
            return f"{name} (row {row_id!r}): {message}"
        index -= len(decision.rows)
    return str(error)


def _assemble(decisions: list[_Decision], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One reply entry per decision, in request order: native, or averaged over orderings."""
    expected = sum(len(decision.rows) for decision in decisions)
    if len(results) != expected:
        raise ScoringFailed(f"the scorer returned {len(results)} results for {expected} rows")
    built, position = [], 0
    for decision in decisions:
        own = results[position : position + len(decision.rows)]
        position += len(decision.rows)
        if decision.mode == "none":
            built.append(own[0])
        else:
            built.append(averaged_result(decision.id, decision.option_ids, own, decision.mode))
    return built


def _building(build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Any failure while building the reply is a 500 in the envelope, never a bare crash (C3)."""
    try:
        return build()
    except ScoringFailed:
        raise
    except Exception as error:
        raise ScoringFailed(
            f"building the response failed: {type(error).__name__}: {error}"
        ) from None

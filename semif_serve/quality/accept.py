"""`semif-serve accept`: the contract's acceptance checks against a running server.

Checks, each pass, fail or skipped (thresholds in docs/quality.md):
1. parity: `/decide` on every row against a reference predictions file (`semif-serve score`);
2. noise floor: every row twice through `/decide` (A vs A);
3. negative control: option descriptions rotated across the option ids must break agreement;
4. shared vs direct: `/decide/shared` per state against the direct run, within the floor;
5. speed: 21 binary criteria over one state via `/decide/shared`, N >= 3 times, against 21
   separate `/decide` calls, every timed call cold (speed.py: the prefix cache kept out);
6. VRAM (CUDA servers only): the peak at a ~4096-token input and a suggested SEMIF_VRAM_CAP_GIB.
Rows agree as `agreement.compare_runs` defines, with a tolerance set by the model's dtype for
parity (another process, maybe another machine), and for the checks within the server (2-4)
float32's where the server runs batch-invariant numerics (its paths agree bit for bit; see
`server_tolerance`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import IO, Any
from urllib.parse import urlsplit

from semif_serve.client import ApiError, Client, SemifError
from semif_serve.quality.agreement import compare_runs
from semif_serve.quality.checks import Check, shared_body, status
from semif_serve.quality.reference import MODEL_KEYS
from semif_serve.quality.speed import speed_check
from semif_serve.quality.vram import MemoryUnavailable, PeakSampler, suggested_cap_gib
from semif_serve.state_key import state_key

TOLERANCE_BY_DTYPE = {"float32": 0.005, "float16": 0.03, "bfloat16": 0.06}
DEFAULT_TOLERANCE = 0.005
INVARIANT_ATTENTION = "semif_invariant"  # what /health's model.attention says of such a server
NEGATIVE_CONTROL_MAX_AGREEMENT = 0.5
MIN_REPEATS = 3
VRAM_TARGET_TOKENS = 4096
VRAM_PROBE_WORDS = (64, 128)
VRAM_MARGIN_TOKENS = 16
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class AcceptInputs:
    rows: list[dict[str, Any]]  # plain {id, state, question, options}
    speed_rows: list[dict[str, Any]]  # speed.SPEED_CRITERIA rows over one state
    reference: dict[str, dict[str, Any]] | None = None  # `semif-serve score` results by id
    repeats: int = MIN_REPEATS
    tolerance: float | None = None  # None: by the model's dtype
    max_speed_p50_s: float | None = None


def server_tolerance(model: dict[str, Any], explicit: float | None) -> float:
    """The tolerance of the checks within one server: `explicit` (--tolerance) if given; float32's
    where the server's paths agree bit for bit (`model.attention` is the CPU's invariant
    attention, whatever the dtype); else the dtype's, as for parity."""
    if explicit:
        return explicit
    if model.get("attention") == INVARIANT_ATTENTION:
        return DEFAULT_TOLERANCE
    return TOLERANCE_BY_DTYPE.get(model.get("dtype"), DEFAULT_TOLERANCE)


class Acceptance:
    def __init__(
        self,
        client: Client,
        inputs: AcceptInputs,
        *,
        sampler: PeakSampler | None = None,
        clock: Callable[[], float] | None = None,
        progress: IO[str] | None = None,
    ):
        if inputs.repeats < MIN_REPEATS:
            raise ValueError(f"repeats: at least {MIN_REPEATS}, got {inputs.repeats}")
        self._client = client
        self._inputs = inputs
        self._sampler = sampler or PeakSampler()
        self._clock = clock or now
        self._progress = progress or sys.stderr
        self._runs: dict[str, dict[str, dict[str, Any]]] = {}
        self.floor: float | None = None  # the A-vs-A max gap, once the noise floor has run

    def run(self) -> dict[str, Any]:
        """Every check, in order; a server that cannot be reached raises SemifError."""
        self.health = self._client.health()
        model = self.health.get("model") or {}
        self.tolerance = self._inputs.tolerance or TOLERANCE_BY_DTYPE.get(
            model.get("dtype"), DEFAULT_TOLERANCE
        )
        # A wrong token stops here, before any check; a result's model names its attention.
        first = self._client.decide(self._inputs.rows[0])
        self.server_tolerance = server_tolerance(first.get("model") or {}, self._inputs.tolerance)
        checks = [
            self._guarded("parity", self.parity),
            self._guarded("noise floor", self.noise_floor),
            self._guarded("negative control", self.negative_control),
            self._guarded("shared vs direct", self.shared_vs_direct),
            self._guarded("speed", self.speed),
            self._guarded("vram", self.vram),
        ]
        return {
            "url": self._client.base_url,
            "health": self.health,
            "rows": len(self._inputs.rows),
            "tolerance": self.tolerance,
            "server_tolerance": self.server_tolerance,
            "passed": all(check.status != "fail" for check in checks),
            "checks": [asdict(check) for check in checks],
        }

    def _guarded(self, name: str, check: Callable[[], Check]) -> Check:
        try:
            return check()
        except SemifError as error:
            return Check(name, "fail", f"request failed: {error}", "every request succeeds")

    # -- runs ------------------------------------------------------------------------------------

    def _direct(self, label: str, rows: list[dict[str, Any]] | None = None) -> dict[str, dict]:
        """Every row through /decide once, remembered under `label`."""
        if label not in self._runs:
            rows = self._inputs.rows if rows is None else rows
            results = {}
            for row in self._bar(rows, f"/decide ({label})"):
                results[row["id"]] = self._client.decide(row)
            self._runs[label] = results
        return self._runs[label]

    def _shared(self) -> dict[str, dict]:
        """Rows grouped by exact state, each group in /decide/shared calls of <= max_decisions."""
        groups: dict[str, list[dict[str, Any]]] = {}
        for row in self._inputs.rows:
            groups.setdefault(state_key(row["state"]), []).append(row)
        limit = int(self.health.get("max_decisions") or 1)
        calls = [
            group[start : start + limit]
            for group in groups.values()
            for start in range(0, len(group), limit)
        ]
        results = {}
        for call in self._bar(calls, "/decide/shared"):
            reply = self._client.decide_shared(shared_body(call))
            results.update((result["id"], result) for result in reply["results"])
        return results

    def _bar(self, items: list, description: str):
        from tqdm import tqdm

        return tqdm(items, desc=description, unit="call", file=self._progress, leave=False)

    # -- checks ----------------------------------------------------------------------------------

    def parity(self) -> Check:
        reference = self._inputs.reference
        threshold = f"every row agrees (max gap <= {self.tolerance}), same prompts and model"
        if reference is None:
            return Check("parity", "skipped", "no --reference given", threshold)
        ids = [row["id"] for row in self._inputs.rows]
        missing = [row_id for row_id in ids if row_id not in reference]
        if missing:
            return Check(
                "parity",
                "fail",
                f"the reference lacks {len(missing)} rows",
                threshold,
                {"missing_ids": missing[:10]},
            )
        served = self._direct("A")
        comparison = compare_runs({i: reference[i] for i in ids}, served, self.tolerance)
        prompts = [
            i
            for i in ids
            if reference[i].get("prompt_sha256") not in (None, served[i]["prompt_sha256"])
        ]
        # Each row's own served model (/health names the model by id only, never its source).
        other_model = [
            key
            for key in MODEL_KEYS
            if any(
                reference[i].get("model", {}).get(key, served[i]["model"].get(key))
                != served[i]["model"].get(key)
                for i in ids
            )
        ]
        passed = comparison.agreeing == comparison.rows and not prompts and not other_model
        measured = (
            f"{comparison.agreeing}/{comparison.rows} agree, top {comparison.same_top}/"
            f"{comparison.rows}, max gap {comparison.max_gap:.2g}"
        )
        if prompts:
            measured += f", {len(prompts)} prompts differ"
        if other_model:
            measured += f", reference model {'/'.join(other_model)} differs"
        details = {
            **comparison.as_dict(),
            "prompt_mismatches": prompts[:10],
            "model_mismatch": other_model,
        }
        return Check("parity", status(passed), measured, threshold, details)

    def noise_floor(self) -> Check:
        tolerance = self.server_tolerance
        comparison = compare_runs(self._direct("A"), self._direct("A again"), tolerance)
        self.floor = comparison.max_gap
        passed = comparison.same_top == comparison.rows and comparison.max_gap <= tolerance
        return Check(
            "noise floor",
            status(passed),
            f"top {comparison.same_top}/{comparison.rows}, max gap {comparison.max_gap:.2g}",
            f"same top on every row, max gap <= {tolerance}",
            comparison.as_dict(),
        )

    def negative_control(self) -> Check:
        shuffled_rows = [rotated_descriptions(row) for row in self._inputs.rows]
        changed = {row["id"] for row, new in zip(self._inputs.rows, shuffled_rows) if new != row}
        threshold = f"agreement <= {NEGATIVE_CONTROL_MAX_AGREEMENT} (A vs A is 1.0)"
        if not changed:
            return Check("negative control", "fail", "no row has distinct descriptions", threshold)
        shuffled = self._direct("shuffled", [row for row in shuffled_rows if row["id"] in changed])
        original = {
            row_id: result for row_id, result in self._direct("A").items() if row_id in changed
        }
        comparison = compare_runs(original, shuffled, self.server_tolerance)
        passed = comparison.agreement <= NEGATIVE_CONTROL_MAX_AGREEMENT
        return Check(
            "negative control",
            status(passed),
            f"agreement {comparison.agreement:.3f}, same top {comparison.top_agreement:.3f}",
            threshold,
            comparison.as_dict(),
        )

    def shared_vs_direct(self) -> Check:
        tolerance = max(self.server_tolerance, self.floor or 0.0)
        comparison = compare_runs(self._direct("A"), self._shared(), tolerance)
        passed = comparison.agreeing == comparison.rows
        return Check(
            "shared vs direct",
            status(passed),
            f"{comparison.agreeing}/{comparison.rows} agree, max gap {comparison.max_gap:.2g}",
            f"every row agrees within max(floor, tolerance) = {tolerance:.2g}",
            {**comparison.as_dict(), "tolerance": tolerance},
        )

    def speed(self) -> Check:
        return speed_check(
            self._client,
            self._inputs.speed_rows,
            repeats=self._inputs.repeats,
            max_decisions=int(self.health.get("max_decisions") or 0),
            max_p50_s=self._inputs.max_speed_p50_s,
            clock=self._clock,
            bar=self._bar,
        )

    def vram(self) -> Check:
        model = self.health.get("model") or {}
        device = str(model.get("device", ""))
        target = min(VRAM_TARGET_TOKENS, int(self.health.get("max_tokens") or VRAM_TARGET_TOKENS))
        threshold = f"a ~{target}-token decision scores (no 503)"
        if not device.startswith("cuda"):
            return Check("vram", "skipped", f"server device is {device or 'unknown'}", threshold)
        host = urlsplit(self._client.base_url).hostname
        if host not in LOCAL_HOSTS:
            return Check("vram", "skipped", f"server {host} is not on this host", threshold)
        words = self._words_for(target)
        try:
            before, peak, result = self._sampler.peak(lambda: self._decide_long(words, target))
        except MemoryUnavailable as error:
            return Check("vram", "skipped", f"GPU memory unreadable: {error}", threshold)
        gib = 1 << 30
        cap = suggested_cap_gib(peak)
        details = {
            "input_tokens": result["input_tokens"],
            "before_gib": before / gib,
            "peak_gib": peak / gib,
            "configured_cap_gib": self.health.get("vram_cap_gib"),
            "suggested_cap_gib": cap,
        }
        measured = (
            f"{result['input_tokens']} tokens: peak {peak / gib:.2f} GiB "
            f"(idle {before / gib:.2f}); suggested SEMIF_VRAM_CAP_GIB={cap:g}"
        )
        return Check("vram", "pass", measured, threshold, details)

    def _words_for(self, target: int) -> int:
        """State words for a ~target-token prompt, from two small probes (tokens grow linearly)."""
        small, large = VRAM_PROBE_WORDS
        first = self._client.decide(long_row(small))["input_tokens"]
        second = self._client.decide(long_row(large))["input_tokens"]
        per_word = (second - first) / (large - small)
        if per_word <= 0:
            raise SemifError("input_tokens does not grow with the state; cannot size the input")
        return large + int((target - VRAM_MARGIN_TOKENS - second) / per_word)

    def _decide_long(self, words: int, target: int) -> dict[str, Any]:
        """Score the long row; a prompt just over max_tokens (422) is retried 3% shorter."""
        for _ in range(5):
            try:
                return self._client.decide(long_row(words))
            except ApiError as error:
                if error.status != 422 or "max_tokens" not in error.message:
                    raise
                words = int(words * 0.97)
        raise SemifError(f"could not fit a ~{target}-token prompt under max_tokens")


def now() -> float:
    """The speed check's clock (tests replace it: they never time real work)."""
    return time.perf_counter()


def rotated_descriptions(row: dict[str, Any]) -> dict[str, Any]:
    """The row with option k described as option k+1 was (ids and positions unchanged)."""
    options = row["options"]
    descriptions = [option["description"] for option in options]
    moved = descriptions[1:] + descriptions[:1]
    return {
        **row,
        "options": [
            {"id": option["id"], "description": text} for option, text in zip(options, moved)
        ],
    }


def long_row(words: int) -> dict[str, Any]:
    return {
        "id": "vram-long",
        "state": " ".join(["evidence"] * words),
        "question": "Is the evidence relevant?",
        "options": [{"id": "yes", "description": "Yes"}, {"id": "no", "description": "No"}],
    }


def table(report: dict[str, Any]) -> str:
    """The checks as a plain-text table, then the verdict."""
    rows = [("check", "status", "measured", "threshold")]
    rows += [
        (check["name"], check["status"].upper(), check["measured"], check["threshold"])
        for check in report["checks"]
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
        for row in rows
    ]
    verdict = "ACCEPTED" if report["passed"] else "NOT ACCEPTED"
    lines.append(
        f"\n{verdict}: {report['url']} ({report['rows']} rows, tolerance {report['tolerance']}, "
        f"within the server {report['server_tolerance']})"
    )
    return "\n".join(lines) + "\n"

"""The ecosystem routes' cost (issue 29), each measured beside what it replaces in one run,
against one real server (the state-prefix cache off, so that no comparison measures the cache):

(a) one `/v1/systemone` request with 21 yes/no questions over a ~1,800-token state vs one
    `/decide/shared` with the same 21 rows, the rounds alternating; target: at most 1.05x;
(b) the same 21 questions as 21 single-question `/v1/systemone` requests; target: at least 10x
    the cost of (a);
(c) a zstd body's decode (semif_serve.http.encoding, in this process) against the wall time of
    the ~2,000-token decision it carries; target: at most 2%; and the same request sent with
    zstd and as identity through the server, alternating (reported).
Every size checks that the System One answers are the shared rows' (prompt hashes and
probabilities); the targets are asserted in full runs only (SEMIF_BENCH_SIZE=full).
"""

import http.client
import json
import time

import pytest
from backports import zstd
from benchlib import FULL, model_source, report, spread
from fakes import AUTH
from live_server import LiveServer, semif_serve_command
from workloads import make_workload

from semif_serve.http.encoding import decoded

SHARED_TARGET = 1.05  # /v1/systemone p50 / /decide/shared p50, same rows
SINGLES_TARGET = 10.0  # 21 single-question requests / one 21-question request
ZSTD_TARGET = 0.02  # decode seconds / the decision's wall seconds
YES, NO = "The answer to the question is yes.", "The answer to the question is no."


@pytest.fixture(scope="module")
def server(tmp_path_factory, bench_model):
    folder = tmp_path_factory.mktemp("bench-ecosystem")
    env = {
        "SEMIF_DEVICE": "cpu",
        "SEMIF_MAX_TOKENS": "8192",
        "SEMIF_MAX_BODY_BYTES": str(8 << 20),
        "SEMIF_PREFIX_CACHE_GIB": "0",
        "SEMIF_MODEL": model_source(folder, bench_model),
    }
    with LiveServer(semif_serve_command(), env, folder / "server.log") as live:
        yield live


def post(server, path: str, payload: bytes, encoding: str | None = None) -> dict:
    headers = {**AUTH, "Content-Type": "application/json"}
    if encoding:
        headers["Content-Encoding"] = encoding
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    try:
        connection.request("POST", path, body=payload, headers=headers)
        response = connection.getresponse()
        reply = json.loads(response.read())
    finally:
        connection.close()
    assert response.status == 200, reply
    return reply


def bodies(bench_model, criteria: int, tokens: int) -> tuple[bytes, bytes, list[bytes]]:
    """(one System One request, the same rows as /decide/shared, one request per question)."""
    [rows] = make_workload(bench_model.tokenizer, 1, criteria, tokens)
    state = rows[0]["state"]
    questions = {row["id"]: {"type": "noul", "instructions": row["question"]} for row in rows}
    options = [{"id": "true", "description": YES}, {"id": "false", "description": NO}]
    decisions = [{"id": row["id"], "question": row["question"], "options": options} for row in rows]
    system_one = {"model": "default", "state": state, "questions": questions}
    singles = [
        json.dumps({**system_one, "questions": {name: question}}).encode()
        for name, question in questions.items()
    ]
    shared = {"state": state, "decisions": decisions}
    return json.dumps(system_one).encode(), json.dumps(shared).encode(), singles


def alternating(calls: dict, rounds: int) -> dict[str, list[float]]:
    """Each call's wall seconds over `rounds` rounds, the calls taking turns within a round."""
    for call in calls.values():
        call()  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def test_system_one_vs_decide_shared_and_single_questions(server, bench_model):
    criteria, tokens, rounds = (21, 1800, 3) if FULL else (4, 80, 1)
    system_one, shared, singles = bodies(bench_model, criteria, tokens)
    answers = post(server, "/v1/systemone", system_one)["answers"]
    results = post(server, "/decide/shared", shared)["results"]
    for result in results:
        block = answers[result["id"]]["x_semif"]
        assert block["prompt_sha256"] == result["prompt_sha256"]
        assert block["probabilities"] == pytest.approx(result["probabilities"], abs=1e-6)
    seconds = alternating(
        {
            "system_one": lambda: post(server, "/v1/systemone", system_one),
            "decide_shared": lambda: post(server, "/decide/shared", shared),
        },
        rounds,
    )
    started = time.perf_counter()
    for single in singles:
        post(server, "/v1/systemone", single)
    singles_s = time.perf_counter() - started
    system_one_s = spread(seconds["system_one"])
    shared_s = spread(seconds["decide_shared"])
    ratio = system_one_s["p50"] / shared_s["p50"]
    singles_ratio = singles_s / system_one_s["p50"]
    report(
        "systemone_vs_shared",
        f"one /v1/systemone with {criteria} questions over a ~{tokens}-token state",
        "one /decide/shared with the same rows",
        ratio,
        system_one_s=system_one_s,
        decide_shared_s=shared_s,
    )
    report(
        "systemone_singles",
        f"{criteria} single-question /v1/systemone requests (one round, after the others)",
        f"one /v1/systemone with all {criteria}",
        singles_ratio,
        singles_s=singles_s,
        system_one_p50_s=system_one_s["p50"],
    )
    if FULL:
        assert ratio <= SHARED_TARGET, f"systemone/shared {ratio:.3f}"
        assert singles_ratio >= SINGLES_TARGET, f"singles/one {singles_ratio:.1f}"


def test_zstd_decode_against_a_2k_decision(server, bench_model):
    tokens, rounds = (2000, 5) if FULL else (80, 1)
    system_one, _, _ = bodies(bench_model, 1, tokens)
    frame = zstd.compress(system_one)
    assert decoded(frame, "zstd", 8 << 20) == system_one
    repeats = 200
    started = time.perf_counter()
    for _ in range(repeats):
        decoded(frame, "zstd", 8 << 20)
    decode_s = (time.perf_counter() - started) / repeats
    seconds = alternating(
        {
            "zstd": lambda: post(server, "/v1/systemone", frame, "zstd"),
            "identity": lambda: post(server, "/v1/systemone", system_one),
        },
        rounds,
    )
    zstd_s, identity_s = spread(seconds["zstd"]), spread(seconds["identity"])
    ratio = decode_s / identity_s["p50"]
    report(
        "zstd_decode",
        f"decoding a {len(frame)}-byte zstd body ({len(system_one)} bytes decoded)",
        f"the ~{tokens}-token decision it carries (identity body, wall time)",
        ratio,
        decode_s=decode_s,
        zstd_request_s=zstd_s,
        identity_request_s=identity_s,
        zstd_over_identity_p50=zstd_s["p50"] / identity_s["p50"],
    )
    if FULL:
        assert ratio <= ZSTD_TARGET, f"decode/decision {ratio:.4f}"

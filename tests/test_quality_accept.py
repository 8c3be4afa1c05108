"""`semif-serve accept` against the real app over fake scorers: each check passes against a sound
server and fails against one broken in exactly the way that check exists to catch."""

import json
from pathlib import Path

import pytest
from fakes import TOKEN, FakeScorer
from quality_fakes import (
    CONTENT,
    POSITION_A_BIAS,
    FakeClock,
    ServedApp,
    TimedScorer,
    labelled_rows,
    token_file,
    write_jsonl,
)

from semif_serve.cli import main
from semif_serve.client import ApiError, Client, RetryPolicy
from semif_serve.errors import OutOfMemory
from semif_serve.quality import accept as accept_module
from semif_serve.quality.accept import Acceptance, AcceptInputs, rotated_descriptions
from semif_serve.quality.labelled import ROW_KEYS, read_plain_rows
from semif_serve.quality.reference import reference_for
from semif_serve.quality.vram import GIB, MemoryUnavailable, PeakSampler, suggested_cap_gib
from semif_serve.scoring import parse_row

TICKET_21 = Path(__file__).parents[1] / "docs" / "examples" / "ticket-21.jsonl"
ROWS = [{key: row[key] for key in ROW_KEYS} for row in labelled_rows()]


def sound_scorer(clock=None):
    return TimedScorer(clock or FakeClock(), 1.0, 2.0, base=CONTENT, bias=POSITION_A_BIAS)


def reference_of(scorer, rows=ROWS):
    return {row["id"]: scorer.result(parse_row(row)) for row in rows}


def run_checks(scorer, clock=None, reference=None, sampler=None, **settings):
    with ServedApp(scorer, **settings) as server:
        inputs = AcceptInputs(rows=ROWS, speed_rows=read_plain_rows(TICKET_21), reference=reference)
        with Client(server.url, TOKEN, policy=RetryPolicy(deadline_s=10)) as client:
            report = Acceptance(client, inputs, clock=clock, sampler=sampler).run()
    return report, {check["name"]: check for check in report["checks"]}


def test_a_sound_server_passes_every_check():
    clock = FakeClock()
    scorer = sound_scorer(clock)
    report, checks = run_checks(scorer, clock, reference=reference_of(scorer))
    assert {name: check["status"] for name, check in checks.items()} == {
        "parity": "pass",
        "noise floor": "pass",
        "negative control": "pass",
        "shared vs direct": "pass",
        "speed": "pass",
        "vram": "skipped",  # the fake runs on "cpu"
    }
    assert report["passed"] is True
    assert report["tolerance"] == 0.005  # float32
    assert checks["parity"]["details"]["agreeing"] == len(ROWS)
    assert checks["noise floor"]["details"]["max_gap"] == 0.0
    speed = checks["speed"]["details"]
    assert speed["shared_seconds"] == [2.0, 2.0, 2.0]  # one shared call per repeat
    assert speed["direct_seconds"] == [21.0, 21.0, 21.0]  # 21 separate /decide calls
    assert speed["speedup"] == 10.5


def test_parity_is_skipped_without_a_reference_and_fails_on_a_different_one():
    scorer = sound_scorer()
    _, checks = run_checks(scorer)
    assert checks["parity"]["status"] == "skipped"

    reference = reference_of(scorer)
    changed = ROWS[4]["id"]
    reference[changed] = {**reference[changed], "probabilities": [0.1, 0.2, 0.7]}
    _, checks = run_checks(scorer, reference=reference)
    assert checks["parity"]["status"] == "fail"
    assert checks["parity"]["details"]["disagreeing_ids"] == [changed]


def test_parity_fails_when_the_reference_lacks_rows_or_saw_other_prompts_or_model():
    scorer = sound_scorer()
    reference = reference_of(scorer)
    del reference[ROWS[0]["id"]]
    _, checks = run_checks(scorer, reference=reference)
    assert checks["parity"]["status"] == "fail"
    assert "lacks 1 rows" in checks["parity"]["measured"]

    reference = reference_of(scorer)
    reference[ROWS[1]["id"]]["prompt_sha256"] = "0" * 64
    _, checks = run_checks(scorer, reference=reference)
    assert checks["parity"]["status"] == "fail"
    assert checks["parity"]["details"]["prompt_mismatches"] == [ROWS[1]["id"]]

    reference = reference_of(scorer)
    reference[ROWS[2]["id"]]["model"] = {**reference[ROWS[2]["id"]]["model"], "revision": "x"}
    _, checks = run_checks(scorer, reference=reference)
    assert checks["parity"]["status"] == "fail"
    assert checks["parity"]["details"]["model_mismatch"] == ["revision"]

    reference = reference_of(scorer)  # the same weights in another dtype
    reference[ROWS[3]["id"]]["model"] = {**reference[ROWS[3]["id"]]["model"], "dtype": "bfloat16"}
    _, checks = run_checks(scorer, reference=reference)
    assert checks["parity"]["status"] == "fail"
    assert checks["parity"]["details"]["model_mismatch"] == ["dtype"]
    assert "reference model dtype differs" in checks["parity"]["measured"]


class DriftingScorer(FakeScorer):
    """Answers the same row differently each time: no noise floor to speak of."""

    def result(self, row):
        self.drift = getattr(self, "drift", 0.0) + 0.3
        self.base = {
            **CONTENT,
            row.options[0].description: CONTENT.get(row.options[0].description, 0) + self.drift,
        }
        return super().result(row)


def test_the_noise_floor_fails_when_the_same_row_answers_differently():
    _, checks = run_checks(DriftingScorer())
    assert checks["noise floor"]["status"] == "fail"
    assert checks["noise floor"]["details"]["max_gap"] > 0.005


def test_the_negative_control_fails_for_a_model_blind_to_the_descriptions():
    report, checks = run_checks(FakeScorer(bias=POSITION_A_BIAS))
    assert checks["negative control"]["status"] == "fail"
    assert checks["negative control"]["details"]["agreement"] == 1.0
    assert checks["noise floor"]["status"] == "pass"
    assert report["passed"] is False


class SkewedSharedScorer(FakeScorer):
    """The shared path adds a logit to the first option: shared disagrees with direct."""

    def score_shared(self, rows):
        results, timing = super().score_shared(rows)
        for result in results:
            logits = [result["option_logits"][0] + 0.5, *result["option_logits"][1:]]
            result["option_logits"] = logits
            result["probabilities"] = [p for p in _softmax(logits)]
        return results, timing


def _softmax(values):
    from fakes import softmax

    return softmax(values)


def test_shared_vs_direct_fails_when_the_shared_path_changes_scores():
    _, checks = run_checks(SkewedSharedScorer(base=CONTENT, bias=POSITION_A_BIAS))
    assert checks["noise floor"]["status"] == "pass"
    assert checks["shared vs direct"]["status"] == "fail"
    assert checks["shared vs direct"]["details"]["agreeing"] == 0


def test_speed_fails_when_shared_is_slower_than_separate_calls_or_cannot_take_21():
    clock = FakeClock()
    slow_shared = TimedScorer(clock, 0.1, 10.0, base=CONTENT)
    _, checks = run_checks(slow_shared, clock)
    assert checks["speed"]["status"] == "fail"
    assert checks["speed"]["details"]["shared_p50_s"] == 10.0
    assert checks["speed"]["details"]["direct_p50_s"] == pytest.approx(2.1)

    _, checks = run_checks(sound_scorer(), max_decisions=8)
    assert checks["speed"]["status"] == "fail"
    assert checks["speed"]["measured"] == "max_decisions is 8"
    assert checks["shared vs direct"]["status"] == "pass"  # groups of 3 still fit


class CudaScorer(FakeScorer):
    """Reports a CUDA device; a state of w words makes a prompt of 40 + w tokens."""

    def __init__(self, out_of_memory_over=None, **kwargs):
        super().__init__(**kwargs)
        self.out_of_memory_over = out_of_memory_over
        self.longest = 0

    def model_info(self):
        return {**super().model_info(), "device": "cuda:0"}

    def result(self, row):
        tokens = 40 + len(str(row.state).split())
        if tokens > 4096:
            raise ValueError(f"max_tokens: the prompt has {tokens} tokens, over the limit of 4096")
        if self.out_of_memory_over is not None and tokens > self.out_of_memory_over:
            raise OutOfMemory("CUDA out of memory")
        self.longest = max(self.longest, tokens)
        return {**super().result(row), "input_tokens": tokens}


def memory_readings(*values):
    """A reader that returns `values` in turn, then the last one forever."""
    remaining = list(values)

    def read():
        return remaining.pop(0) if len(remaining) > 1 else remaining[0]

    return read


def test_vram_on_cuda_measures_a_near_4096_token_decision_and_suggests_a_cap():
    scorer = CudaScorer(base=CONTENT)
    sampler = PeakSampler(memory_readings(2 * GIB, 3 * GIB, int(2.5 * GIB)))
    _, checks = run_checks(scorer, sampler=sampler)
    vram = checks["vram"]
    assert vram["status"] == "pass"
    assert 4096 - 64 <= vram["details"]["input_tokens"] <= 4096
    assert vram["details"]["before_gib"] == 2.0
    assert vram["details"]["peak_gib"] == 3.0
    assert vram["details"]["suggested_cap_gib"] == suggested_cap_gib(3 * GIB) == 3.5


def test_vram_fails_when_the_long_decision_runs_out_of_memory():
    scorer = CudaScorer(out_of_memory_over=1000, base=CONTENT)
    _, checks = run_checks(scorer, sampler=PeakSampler(memory_readings(GIB)))
    assert checks["vram"]["status"] == "fail"
    assert "503" in checks["vram"]["measured"]


def test_vram_is_skipped_when_gpu_memory_cannot_be_read():
    def unreadable():
        raise MemoryUnavailable("nvidia-smi is not on PATH")

    _, checks = run_checks(CudaScorer(base=CONTENT), sampler=PeakSampler(unreadable))
    assert checks["vram"]["status"] == "skipped"
    assert "nvidia-smi" in checks["vram"]["measured"]


def test_suggested_cap_rounds_the_peak_with_headroom_up_to_half_gib():
    assert suggested_cap_gib(10 * GIB) == 11.5  # 11.5 exactly
    assert suggested_cap_gib(int(10.1 * GIB)) == 12.0


def test_rotated_descriptions_move_every_description_and_keep_ids():
    row = ROWS[0]
    rotated = rotated_descriptions(row)
    assert [o["id"] for o in rotated["options"]] == [o["id"] for o in row["options"]]
    before = [o["description"] for o in row["options"]]
    assert [o["description"] for o in rotated["options"]] == before[1:] + before[:1]


def accept_cli(tmp_path, url, capsys, *extra):
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, labelled_rows())  # labels are dropped before sending
    out = tmp_path / "out"
    status = main(
        [
            "accept",
            "--url",
            url,
            "--token-file",
            str(token_file(tmp_path)),
            "--data",
            str(data),
            "--speed-rows",
            str(TICKET_21),
            "--out",
            str(out),
            *extra,
        ]
    )
    captured = capsys.readouterr()
    return status, captured, out


def test_cli_exits_1_on_a_failing_check_and_writes_the_report(tmp_path, capsys):
    with ServedApp(FakeScorer(bias=POSITION_A_BIAS)) as server:
        status, captured, out = accept_cli(tmp_path, server.url, capsys)
    assert status == 1
    assert "NOT ACCEPTED" in captured.out
    assert "negative control  FAIL" in captured.out
    report = json.loads((out / "accept.json").read_text())
    assert report["passed"] is False


def test_cli_exits_0_when_every_check_passes(tmp_path, capsys, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(accept_module, "now", clock)
    scorer = sound_scorer(clock)
    reference = tmp_path / "reference.jsonl"
    write_jsonl(reference, reference_of(scorer).values())
    with ServedApp(scorer) as server:
        status, captured, out = accept_cli(
            tmp_path, server.url, capsys, "--reference", str(reference)
        )
    assert status == 0, captured.out
    assert "ACCEPTED" in captured.out and "NOT ACCEPTED" not in captured.out
    assert json.loads((out / "accept.json").read_text())["passed"] is True


def in_dtype(results, dtype):
    return [{**result, "model": {**result["model"], "dtype": dtype}} for result in results]


def test_a_reference_folder_gives_parity_the_file_made_in_the_servers_dtype(
    tmp_path, capsys, monkeypatch
):
    clock = FakeClock()
    monkeypatch.setattr(accept_module, "now", clock)
    scorer = sound_scorer(clock)  # serves "float32"
    results = list(reference_of(scorer).values())
    folder = tmp_path / "references"
    folder.mkdir()
    write_jsonl(folder / "a-bfloat16.jsonl", in_dtype(results, "bfloat16"))
    write_jsonl(folder / "b-float32.jsonl", results)
    (folder / "notes.txt").write_text("not a reference")
    with ServedApp(scorer) as server:
        status, captured, out = accept_cli(tmp_path, server.url, capsys, "--reference", str(folder))
        assert status == 0, captured.out
        report = json.loads((out / "accept.json").read_text())
        assert report["reference"] == str(folder / "b-float32.jsonl")
        assert report["checks"][0]["status"] == "pass"

        (folder / "b-float32.jsonl").unlink()
        status, captured, _ = accept_cli(tmp_path, server.url, capsys, "--reference", str(folder))
    assert status == 2
    assert captured.err.strip().splitlines() == [
        f"semif-serve: error: --reference {folder}: no results of fake at {'0' * 40} in float32 "
        "(make them with `semif-serve score --dtype float32`)"
    ]


def test_reference_for_takes_the_first_file_whose_every_result_names_the_model():
    model = {"source": "s", "revision": "r", "dtype": "bfloat16", "device": "cpu"}
    made = {"model": {**model, "device": "cuda"}}  # the device may differ
    float32 = {"model": {**model, "dtype": "float32"}}
    candidates = {
        "empty": {},
        "float32": {"x": float32},
        "mixed": {"x": made, "y": float32},
        "other revision": {"x": {"model": {**model, "revision": "q"}}},
        "other source": {"x": {"model": {**model, "source": "t"}}},
        "no model": {"x": {}},
        "bfloat16": {"x": made, "y": made},
        "later": {"x": made},
    }
    assert reference_for(candidates, model) == "bfloat16"
    assert reference_for({**candidates, "bfloat16": {}, "later": {}}, model) is None
    assert reference_for({"float32": {"x": float32}}, {**model, "dtype": "float32"}) == "float32"
    assert reference_for({}, model) is None


def test_cli_exits_2_with_one_line_for_a_wrong_token_or_no_server(tmp_path, capsys):
    (tmp_path / "bad").write_text("x" * 40)
    with ServedApp(FakeScorer()) as server:
        status = main(
            [
                "accept",
                "--url",
                server.url,
                "--token-file",
                str(tmp_path / "bad"),
                "--speed-rows",
                str(TICKET_21),
                "--data",
                str(TICKET_21),
            ]
        )
    err = capsys.readouterr().err
    assert status == 2
    assert "401 unauthorized" in err and len(err.strip().splitlines()) == 1
    status = main(
        [
            "accept",
            "--url",
            server.url,
            "--token-file",
            str(token_file(tmp_path)),
            "--speed-rows",
            str(TICKET_21),
            "--data",
            str(TICKET_21),
            "--timeout-s",
            "2",
        ]
    )
    assert status == 2
    assert capsys.readouterr().err.splitlines() == [
        f"semif-serve: error: cannot reach {server.url} (start the server, or pass --url)"
    ]


def test_a_server_error_reply_becomes_an_api_error_with_its_code():
    policy = RetryPolicy(deadline_s=10)
    with ServedApp(FakeScorer()) as server, Client(server.url, TOKEN, policy=policy) as client:
        with pytest.raises(ApiError) as caught:
            client.decide({"id": "x"})
    assert caught.value.status == 422
    assert caught.value.code == "invalid_request"


@pytest.mark.parametrize(
    ("model", "explicit", "expected"),
    [
        ({"dtype": "bfloat16", "attention": "semif_invariant"}, None, 0.005),
        ({"dtype": "bfloat16", "attention": "sdpa"}, None, 0.06),  # e.g. CUDA's stock kernels
        ({"dtype": "float16", "attention": "semif_invariant"}, None, 0.005),
        ({"dtype": "float16"}, None, 0.03),
        ({"dtype": "bfloat16", "attention": "semif_invariant"}, 0.02, 0.02),  # --tolerance
        ({}, None, 0.005),
    ],
)
def test_the_checks_within_an_invariant_server_use_float32s_tolerance(model, explicit, expected):
    """Issue 44: a server on the CPU's batch-invariant numerics gives every path the same bits,
    so its noise floor, negative control and shared-vs-direct checks are judged at float32's
    tolerance in bfloat16 too (at 0.06 the negative control could not tell rotated options
    apart); parity, against another process, keeps the dtype's."""
    assert accept_module.server_tolerance(model, explicit) == expected


def test_the_report_names_both_tolerances():
    scorer = sound_scorer()
    report, checks = run_checks(scorer)
    assert (report["tolerance"], report["server_tolerance"]) == (0.005, 0.005)
    assert "tolerance 0.005, within the server 0.005" in accept_module.table(report)

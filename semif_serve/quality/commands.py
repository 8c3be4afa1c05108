"""The `evaluate`, `calibrate` and `accept` commands: arguments in, files and exit status out.

Exit status: 0 done (accept: every check passed or was skipped); 1 accept found a failing check;
2 the command could not run (bad data, missing file, unloadable model, unreachable server), with
one line on stderr. A command that talks to a server asks its /health first, under a deadline
of seconds (reach.py): "cannot reach URL (start the server, or pass --url)".
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2


class CommandError(Exception):
    """The command cannot run as asked; the message is the one line to show."""


def run_evaluate(args: argparse.Namespace) -> int:
    def work(stack: ExitStack) -> None:
        from semif_serve.quality import evaluate

        rows = _labelled(args.data)
        backend = _backend(args, stack)
        predictions = evaluate.decide_all(backend, rows, args.orderings)
        report = {
            "data": [str(path) for path in args.data],
            "backend": backend.describe(),
            **evaluate.report(rows, predictions),
        }
        text = evaluate.markdown(report)
        print(text, end="")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            _write_json(args.out / "evaluate.json", report)
            (args.out / "evaluate.md").write_text(text, encoding="utf-8")
            for mode, predicted in predictions.items():
                records = evaluate.prediction_records(rows, predicted)
                lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
                (args.out / f"predictions-{mode}.jsonl").write_text(lines, encoding="utf-8")

    return _guard(work, args)


def run_calibrate(args: argparse.Namespace) -> int:
    def work(stack: ExitStack) -> None:
        from semif_serve.quality import calibrate
        from semif_serve.quality.evaluate import decide_all

        rows = _labelled(args.data)
        backend = _backend(args, stack)
        predictions = decide_all(backend, rows, ["none"])["none"]
        report = {
            "workload": args.workload,
            "data": [str(path) for path in args.data],
            "backend": backend.describe(),
            **calibrate.fit_report(rows, predictions),
        }
        table = calibrate.write_calibration(args.out, args.workload, report["temperature"])
        report["written"] = {"path": str(args.out), "table": table}
        if args.report is not None:
            _write_json(args.report, report)
        print(calibrate.markdown(report, args.workload), end="")
        print(f"\nWrote {args.out}: {json.dumps(table)}")

    return _guard(work, args)


def run_accept(args: argparse.Namespace) -> int:
    outcome: dict[str, Any] = {}

    def work(stack: ExitStack) -> None:
        from semif_serve.quality.accept import Acceptance, AcceptInputs, table
        from semif_serve.quality.backends import read_results
        from semif_serve.quality.labelled import read_plain_rows

        speed_rows = read_plain_rows(args.speed_rows)
        client = stack.enter_context(_client(args))
        path = args.reference
        rows = read_plain_rows(args.data)
        if path is not None and path.is_dir():
            # The served model as results name it (source included: /health names only its id).
            path = _reference_in(path, client.decide(rows[0]).get("model") or {})
        inputs = AcceptInputs(
            rows=rows,
            speed_rows=speed_rows,
            reference=read_results(path) if path is not None else None,
            repeats=args.repeats,
            tolerance=args.tolerance,
            max_speed_p50_s=args.max_speed_p50_s,
        )
        report = {**Acceptance(client, inputs).run(), "reference": str(path) if path else None}
        print(table(report), end="")
        if args.out is not None:
            _write_json(args.out / "accept.json", report)
        outcome["passed"] = report["passed"]

    status = _guard(work, args)
    if status == 0 and not outcome["passed"]:
        return EXIT_CHECK_FAILED
    return status


def _reference_in(folder: Path, model: dict[str, Any]) -> Path:
    """The `semif-serve score` output in `folder` made with the server's model and dtype."""
    from semif_serve.quality.backends import read_results
    from semif_serve.quality.reference import reference_for

    candidates = {str(path): read_results(path) for path in sorted(folder.glob("*.jsonl"))}
    chosen = reference_for(candidates, model)
    if chosen is None:
        raise CommandError(
            f"--reference {folder}: no results of {model.get('source')} at "
            f"{model.get('revision')} in {model.get('dtype')} (make them with `semif-serve score "
            f"--dtype {model.get('dtype')}`)"
        )
    return Path(chosen)


def _guard(work, args: argparse.Namespace) -> int:
    """Check the server first when the command talks to one (`_check_server`), then run `work`
    with an ExitStack that closes what it opened (the HTTP client); the expected failures become
    one line on stderr and exit status 2."""
    try:
        _check_server(args)
        with ExitStack() as stack:
            work(stack)
    except Exception as error:
        # A CommandError is told without the imports that name the others (they load torch).
        if not isinstance(error, CommandError) and not isinstance(error, _expected()):
            raise
        print(f"semif-serve: error: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _check_server(args: argparse.Namespace) -> None:
    """When the command talks to a server (accept; evaluate and calibrate given --url alone),
    that something answers its /health within seconds (quality/reach.py). First, before the data
    is read or the slow imports are made: a wrong port is told at once, not after --timeout-s of
    retried connections."""
    from semif_serve.quality.reach import REACH_DEADLINE_S, answers, unreachable

    others = (getattr(args, "model", None), getattr(args, "results", None))
    if args.url is None or any(other is not None for other in others):
        return  # no server, or a choice of backends that _backend refuses
    if not answers(args.url, min(REACH_DEADLINE_S, args.timeout_s)):
        raise CommandError(unreachable(args.url))


def _expected() -> tuple[type[Exception], ...]:
    """The failures a command reports in one line: its own, bad data, a failed call, a model
    that cannot load, a bad calibration file."""
    from semif_serve.client import SemifError
    from semif_serve.engine.builtin import BuiltinModelError
    from semif_serve.engine.loading import ModelLoadError
    from semif_serve.quality.calibrate import CalibrationFileError
    from semif_serve.quality.labelled import LabelledDataError

    return (
        CommandError,
        LabelledDataError,
        SemifError,
        ModelLoadError,
        BuiltinModelError,
        CalibrationFileError,
        ValueError,  # data the statistics cannot use, e.g. perturbations without their sources
    )


def _labelled(paths: list[Path]):
    from semif_serve.quality.labelled import read_labelled

    return read_labelled(paths)


def _client(args: argparse.Namespace):
    """semif_serve.client over --url with --token-file; --timeout-s is each call's deadline
    (`_guard` has checked that the server answers)."""
    from semif_serve.client import Client, RetryPolicy

    if args.token_file is None:
        raise CommandError("--token-file is needed with --url")
    policy = RetryPolicy(deadline_s=args.timeout_s)
    return Client(args.url, read_token(args.token_file), policy=policy)


def read_token(path: Path) -> str:
    """The bearer token stored in `path` (surrounding whitespace dropped)."""
    try:
        token = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise CommandError(f"token file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise CommandError(f"cannot read token file {path}: {error}") from None
    if not token:
        raise CommandError(f"token file {path} is empty")
    return token


def _backend(args: argparse.Namespace, stack: ExitStack):
    """--url with --token-file, --model, or --results: exactly one of them."""
    from semif_serve.quality.backends import HttpBackend, LocalBackend, SavedResults

    chosen = [args.url, args.model, args.results]
    if sum(choice is not None for choice in chosen) != 1:
        raise CommandError(
            "give one of --url URL --token-file FILE, --model SOURCE or --results FILE"
        )
    if args.url is not None:
        return HttpBackend(stack.enter_context(_client(args)))
    if args.results is not None:
        return SavedResults(args.results)
    from semif_serve import config
    from semif_serve.engine.loading import load_model

    model = load_model(
        args.model,
        args.revision,
        dtype=args.dtype or config.default_dtype(args.device),
        device=args.device,
    )
    return LocalBackend(model, args.max_tokens)


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

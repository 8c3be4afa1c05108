"""The `semif-serve` command: `serve` runs the HTTP service, `score` scores a JSONL file of rows,
`evaluate`, `calibrate` and `accept` measure a model or a running server on labelled decisions.

Exit status: 0 done, also when the reader of stdout closed it early (`| head -1`); 2 a bad row
(named by line), a missing file, an unloadable model or an unreachable server, with a one-line
message on stderr; 1 when `accept` finds a failing check; 5 when `serve` stopped with requests
cut off by SEMIF_GRACEFUL_TIMEOUT_S (each one logged).
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import textwrap
from functools import partial
from pathlib import Path

import semif_serve  # noqa: F401  (forces the hub offline before torch or transformers load)
from semif_serve.engine import kernel_cache

EXIT_USAGE = 2
DTYPE_HELP = (
    "the weights' dtype: float32, bfloat16 or float16 (default: the server's on that device: "
    "bfloat16 on a GPU or a CPU with native bfloat16, else float32)"
)
MAX_TOKENS_HELP = "longer prompts are rejected, never truncated (default: %(default)s)"
SERVE_DESCRIPTION = (
    "Run the HTTP service: one gunicorn worker that loads the model once, then answers "
    "/decide, /decide/shared, the decision APIs and /health. Every SEMIF_* variable, the "
    "model's name and the device are checked before anything is bound: a bad one stops it "
    "with one line naming the variable and exit status 2. While the model loads, /health "
    "answers 503 `loading`; once it is ready the log says `ready: model ... at http://...`."
)
SERVE_VARIABLES = """\
configured by environment variables (read once, at start-up):
  required   SEMIF_API_TOKEN (or --token-file)
  model      SEMIF_MODEL SEMIF_REVISION SEMIF_DEVICE SEMIF_DTYPE SEMIF_MODELS_FILE
             SEMIF_MODEL_ALIASES SEMIF_CALIBRATION SEMIF_REQUIRE_FAST_KERNELS SEMIF_CACHE_DIR
             SEMIF_KERNEL_CACHE_DIR SEMIF_STATE_DIR
  limits     SEMIF_MAX_TOKENS SEMIF_MAX_DECISIONS SEMIF_MAX_BODY_BYTES SEMIF_MAX_QUEUE
             SEMIF_QUEUE_TIMEOUT_S SEMIF_MAX_CONNECTIONS SEMIF_VRAM_CAP_GIB
  network    SEMIF_BIND (default 127.0.0.1:8471) SEMIF_HEADER_TIMEOUT_S SEMIF_BODY_TIMEOUT_S
             SEMIF_WRITE_TIMEOUT_S SEMIF_GRACEFUL_TIMEOUT_S
  models     SEMIF_ADMIN_TOKEN SEMIF_PARALLEL_SLOTS SEMIF_MAX_LOADED_MODELS
             SEMIF_MEMORY_BUDGET_GIB
  batching   SEMIF_MAX_BATCH_ROWS SEMIF_MAX_BATCH_TOKENS SEMIF_BATCH_WAIT_MS
             SEMIF_PREFIX_CACHE_GIB SEMIF_PREFIX_CHECKPOINT_TOKENS
  APIs       SEMIF_HOSTED_MODEL_NAMES SEMIF_MAX_OPTIONS SEMIF_LEGACY_EXTENSION_BLOCK
each one's default and rule: docs/configuration.md; running it: docs/operations.md"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="semif-serve",
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="`semif-serve COMMAND --help` tells more of each command; docs/cli.md shows them.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the HTTP service (configured by SEMIF_* variables)",
        description=textwrap.fill(SERVE_DESCRIPTION, 79),
        epilog=SERVE_VARIABLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "--token-file",
        type=Path,
        help="when SEMIF_API_TOKEN is unset, read the token from this file, creating it "
        "(mode 0600, random) if missing, and print a ready-to-paste curl example",
    )
    score = commands.add_parser("score", help="score a JSONL file of SemIf rows")
    score.add_argument(
        "rows", type=Path, help="JSONL file, one {id, state, question, options} per line"
    )
    score.add_argument(
        "--shared", action="store_true", help="group rows by exact state; one shared call per group"
    )
    score.add_argument(
        "--model",
        default="builtin:smollm2-135m",
        help="builtin:NAME, a local folder, or a hub id (default: %(default)s)",
    )
    score.add_argument(
        "--revision", help="40-hex commit for a hub id; free text for a local folder"
    )
    score.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    score.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help=DTYPE_HELP)
    score.add_argument("--max-tokens", type=_positive_int, default=4096, help=MAX_TOKENS_HELP)
    score.add_argument("--out", type=Path, help="write results here instead of stdout")
    add_quality_commands(commands)
    return parser


def add_quality_commands(commands) -> None:
    from semif_serve.decisions import ORDERINGS

    evaluate = commands.add_parser(
        "evaluate", help="accuracy on labelled decisions, per ordering mode (docs/quality.md)"
    )
    _add_data(evaluate)
    evaluate.add_argument(
        "--orderings",
        default="none",
        type=_modes(ORDERINGS),
        help="a mode, or comma-separated modes to compare with the first, e.g. none,rotations "
        f"(modes: {', '.join(ORDERINGS)}; default: %(default)s)",
    )
    _add_backend(evaluate)
    evaluate.add_argument(
        "--out", type=Path, help="folder for evaluate.json, evaluate.md and predictions-MODE.jsonl"
    )
    calibrate = commands.add_parser(
        "calibrate", help="fit a workload's temperature and write the SEMIF_CALIBRATION file"
    )
    _add_data(calibrate)
    calibrate.add_argument("--workload", required=True, help="the workload name callers will send")
    calibrate.add_argument(
        "--out",
        type=Path,
        required=True,
        help="the calibration JSON; an existing file keeps its other workloads",
    )
    calibrate.add_argument("--report", type=Path, help="also write the fit report as JSON here")
    _add_backend(calibrate)
    accept = commands.add_parser(
        "accept", help="the contract's acceptance checks against a running server"
    )
    _add_server(accept, required=False)
    accept.add_argument(
        "--data",
        type=Path,
        default=Path("bench/data/decisions144.jsonl"),
        help="rows to check with (labels ignored; default: %(default)s)",
    )
    accept.add_argument(
        "--reference",
        type=Path,
        help=(
            "`semif-serve score` output for the same rows, or a folder of them (the one made "
            "with the server's model and dtype is used); without it parity is skipped"
        ),
    )
    accept.add_argument(
        "--speed-rows",
        type=Path,
        default=Path("docs/examples/ticket-21.jsonl"),
        help="21 binary criteria over one state (default: %(default)s)",
    )
    accept.add_argument(
        "--repeats", type=_positive_int, default=3, help="speed repeats, >= 3 (default: 3)"
    )
    accept.add_argument(
        "--tolerance",
        type=float,
        help="largest probability gap between agreeing runs (default: by the server's dtype)",
    )
    accept.add_argument(
        "--max-speed-p50-s", type=float, help="also fail speed when the shared p50 is slower"
    )
    accept.add_argument("--out", type=Path, help="folder for accept.json")


def _add_data(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        type=Path,
        action="append",
        required=True,
        help="labelled JSONL (rows with gold, family, group); repeat to add files",
    )


def _add_server(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument(
        "--url",
        default=None if required else "http://127.0.0.1:8471",
        help="a running semif-serve" + ("" if required else " (default: %(default)s)"),
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None if required else Path(".semif-token"),
        help="file holding the bearer token" + ("" if required else " (default: %(default)s)"),
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="each call's deadline, retries of 429 and 503 server_busy included "
        "(default: %(default)s)",
    )


def _add_backend(parser: argparse.ArgumentParser) -> None:
    """A running server (--url, --token-file), a local model (--model and its options), or
    saved native results (--results)."""
    _add_server(parser, required=True)
    parser.add_argument(
        "--results",
        type=Path,
        help="`semif-serve score` output for the same rows (orderings none only)",
    )
    parser.add_argument("--model", help="score locally instead: builtin:NAME, a folder or a hub id")
    parser.add_argument("--revision", help="40-hex commit for a hub id")
    parser.add_argument("--device", default="cpu", help="local model device (default: %(default)s)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help=DTYPE_HELP)
    parser.add_argument("--max-tokens", type=_positive_int, default=4096, help=MAX_TOKENS_HELP)


def _modes(known: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        modes = [mode.strip() for mode in text.split(",")]
        unknown = [mode for mode in modes if mode not in known]
        if unknown or not modes:
            raise argparse.ArgumentTypeError(f"modes must be among {', '.join(known)}: {text!r}")
        if len(set(modes)) != len(modes):
            raise argparse.ArgumentTypeError(f"a mode is repeated: {text!r}")
        return modes

    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "score":
        return run_score(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command in ("evaluate", "calibrate", "accept"):
        from semif_serve.quality import commands

        return getattr(commands, f"run_{args.command}")(args)
    return EXIT_USAGE  # pragma: no cover  (argparse rejects unknown commands)


def run_score(args: argparse.Namespace) -> int:
    from semif_serve import config
    from semif_serve.engine.builtin import BuiltinModelError
    from semif_serve.engine.loading import ModelLoadError, load_model
    from semif_serve.score_file import BatchInputError, output_file, read_rows, score_file
    from semif_serve.scoring import score, score_shared

    try:
        rows = read_rows(args.rows)
        model = load_model(
            args.model,
            args.revision,
            dtype=args.dtype or config.default_dtype(args.device),
            device=args.device,
        )
        with output_file(args.out) as out:
            score_file(
                args.rows,
                out,
                rows=rows,
                score_one=partial(score, model, max_tokens=args.max_tokens),
                score_group=partial(score_shared, model, max_tokens=args.max_tokens)
                if args.shared
                else None,
            )
    except (BatchInputError, ModelLoadError, BuiltinModelError) as error:
        print(f"semif-serve: error: {one_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """Every setting, then the startup models' names and devices, then SEMIF_STATE_DIR and
    SEMIF_BIND (as the server starts): a bad one is one line naming it, exit 2, before
    anything is bound. --token-file's curl example is printed once the server is ready."""
    from semif_serve.config import ConfigError, Settings
    from semif_serve.devtoken import curl_example, ensure_token_file

    environ = dict(os.environ)
    made_token = args.token_file is not None and not environ.get("SEMIF_API_TOKEN")
    try:
        if made_token:
            environ["SEMIF_API_TOKEN"] = ensure_token_file(args.token_file)
        settings = Settings.from_env(environ)
        from semif_serve.engine.boot import check_startup_models
        from semif_serve.server import run

        check_startup_models(settings)
        run(
            settings,
            ready_note=partial(curl_example, token_file=args.token_file) if made_token else None,
        )
    except ConfigError as error:
        print(f"semif-serve: error: {one_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def entry_point() -> None:
    # A server process points the kernel caches at their folder first: build_parser's imports
    # already load torch (docs/operations.md, "Kernel caches").
    serving = sys.argv[1:2] == ["serve"] and not {"-h", "--help"} & set(sys.argv[2:])
    if serving and kernel_cache.prepare() is None:
        sys.exit(EXIT_USAGE)
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise
        # `semif-serve score ... | head -1`: the reader has what it wanted. End quietly, as Unix
        # tools do; stdout now points at /dev/null so the interpreter's last flush of the
        # buffered lines cannot fail again ("Exception ignored ... BrokenPipeError", exit 120).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    sys.exit(status)


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll says POLLERR), so that a
    BrokenPipeError came from our output and not from some other pipe or socket."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no real file descriptor behind stdout
        return False


if __name__ == "__main__":
    entry_point()

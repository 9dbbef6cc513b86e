"""``python -m tfpolicy.suggest``: the cheapest policy map that keeps a model within an error budget.

    python -m tfpolicy.suggest model/ --data val.npz --max_error 0.02 --out map.json
    python -m tfpolicy.suggest model/ --data val.npz --max_error 0.02 --objective bytes --out map.json --html frontier.html

Rewrites the model once per candidate policy (each on every layer) to measure
how much error each layer adds under each and what each costs on this
machine, searches for the cheapest assignment predicted to stay within
--max_error, and verifies it with the real rewrite on held-out rows of --data
(backing off until it holds). Writes the map in the plain form (OUT) and as
Keras serializes a DTypePolicyMap (OUT with .keras.json), and prints the
frontier: every map measured, its error, latency and size.

Exit status: 0 with a map written; 2 for a user error (one line on stderr,
nothing written), also when no map tried meets the budget; 3 for an internal
error; 130/143 when interrupted. The code lives in :mod:`tfpolicy.suggestion`;
Python calls ``tfpolicy.suggest(...)``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import time
from typing import Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from tfpolicy import cli  # noqa: E402  (no TensorFlow yet: the rewrite command's interrupt and quieting)

METRICS = ("rel_max", "rel_rms", "top1")


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(
        prog="python -m tfpolicy.suggest", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="Measured on this machine: run it where the model will be served (or with --objective bytes).")
    parse.add_argument("input", metavar="INPUT", help="the float32 SavedModel")
    parse.add_argument("--data", required=True, help="an .npz of serving_default inputs, batch first; the last"
                       " quarter of its rows is held out to verify the result")
    parse.add_argument("--max_error", required=True, type=float, help="the error budget, in --metric's units")
    parse.add_argument("--metric", default="rel_max", choices=METRICS, help="rel_max: max|y-y0|/max|y0|; rel_rms:"
                       " ||y-y0||/||y0||; top1: share of rows whose argmax changes (default rel_max)")
    parse.add_argument("--output", default=None, help="the output the metric reads (needed when there are several)")
    parse.add_argument("--target", default=None, choices=["cpu", "gpu", "tpu"], help="the serving target, as for"
                       " the rewrite: the forms whose cost is measured")
    parse.add_argument("--objective", default="latency", choices=["latency", "bytes"],
                       help="what to minimise: latency of serving_default on this machine, or stored bytes")
    parse.add_argument("--candidates", default=None, help="comma-separated policies, most precise first"
                       " (default: by objective and target, e.g. float32,mixed_bfloat16,int8_from_mixed_bfloat16)")
    parse.add_argument("--out", required=True, help="where the map goes (plain form); Keras's form goes beside it"
                       " as NAME.keras.json")
    parse.add_argument("--report", default=None, help="also write the frontier as JSON here")
    parse.add_argument("--html", default=None, help="also write the frontier as an HTML page (error against cost)")
    parse.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return parse


def main(argv: Optional[Sequence[str]] = None) -> None:
    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, cli._on_interrupt)
    cli.guarded(_main, list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> None:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        sys.exit(0 if exc.code == 0 else cli.EXIT_USER_ERROR)
    out = pathlib.Path(args.out)
    keras_out = out.with_name(out.stem + ".keras.json")
    _check_paths(args, out, keras_out)
    cli._quiet_tensorflow()
    from tfpolicy.suggestion import suggest  # noqa: PLC0415
    from tfpolicy.suggestion import frontier_html  # noqa: PLC0415

    started = time.monotonic()
    say = (lambda message: None) if args.quiet else (lambda message: print(f"tfpolicy: {message}", file=sys.stderr,
                                                                            flush=True))
    try:
        result = suggest(args.input, args.data, args.max_error, metric=args.metric, output=args.output,
                         target=args.target, objective=args.objective,
                         candidates=args.candidates.split(",") if args.candidates else None, progress=say)
        # Every text first: a failure to make one leaves no file of the set behind.
        texts = {out: json.dumps(result.policy_map, indent=2) + "\n",
                 keras_out: json.dumps(result.keras_config(), indent=2) + "\n"}
        if args.report:
            texts[pathlib.Path(args.report)] = json.dumps(result.to_json(), indent=2) + "\n"
        if args.html:
            texts[pathlib.Path(args.html)] = frontier_html.render(result)
        for path, text in texts.items():
            _write(path, text)
    except Exception as exc:  # noqa: BLE001  (a user error, or a bug of ours: one line, not a traceback)
        cli.fail_on(exc)
    if not args.quiet:
        print(result.format_table())
        chosen = result.chosen
        print(cli._line(f"tfpolicy: wrote {out} and {keras_out} in {time.monotonic() - started:.1f}s: {chosen.label},"
                        f" {args.metric} {chosen.error:.3g} (budget {args.max_error:g}) on {result.rows['held_out']}"
                        f" held-out rows, {chosen.latency_s * 1e3:.1f} ms, {chosen.bytes / 1e6:.2f} MB"),
              file=sys.stderr)


def _check_paths(args: argparse.Namespace, out: pathlib.Path, keras_out: pathlib.Path) -> None:
    from tfpolicy.core import paths  # noqa: PLC0415  (no TensorFlow)
    from tfpolicy.errors import TfPolicyError  # noqa: PLC0415

    if not args.max_error >= 0:
        cli._fail(f"--max_error must be a non-negative number, got {args.max_error}")
    try:
        with open(args.data, "rb"):
            pass
    except OSError as exc:
        cli._fail(f"cannot read --data {args.data}: {exc.strerror}")
    try:
        paths.check_input_dir(args.input)
        for flag, value in (("out", out), ("out", keras_out), ("report", args.report), ("html", args.html)):
            paths.check_report_path(None if value is None else str(value), args.input, (), what=f"--{flag} file")
    except TfPolicyError as exc:
        cli._fail(str(exc))


def _write(path: pathlib.Path, text: str) -> None:
    """Atomically: a temporary file beside ``path``, renamed over it."""
    temporary = path.with_name(f".{path.name}.tfpolicy-tmp-{os.getpid()}")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

"""The tfpolicy_test rule's check: the rewritten SavedModel against its input.

    compare.py --max_error 0.05 [--seed 0] [--validation_data DATA.npz]
               --rewritten OUT_DIR --saved_model IN_FILE_OR_DIR...

Runs ``tfpolicy.validate`` (the same comparison as ``python -m
tfpolicy.rewrite --validate``): every signature of both SavedModels on the
same inputs (the validation data, else generated inputs seeded with
``--seed``), and prints one line:

    tfpolicy_test: PASS: max abs error 3.1e-03 <= max_error 0.05 (serve/output_0, 2 signatures)
    tfpolicy_test: FAIL: max abs error 3.1e-03 > max_error 1e-03 (serve/output_0, 2 signatures)

Exit status: 0 on PASS, 1 on FAIL, 2 on a user error (one line, no traceback).

A non-float output that differs counts as an infinite error, a NaN as NaN
(which no bound accepts).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import sys
from typing import Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

EXIT_FAIL = 1
EXIT_USER_ERROR = 2


class CheckError(Exception):
    """A user error of the check: ``str()`` is one line."""


@dataclasses.dataclass(frozen=True)
class Measurement:
    """The largest absolute difference seen, and where."""

    max_abs_error: float
    where: str
    signatures: int


def _saved_model_dir(paths: Sequence[str]) -> pathlib.Path:
    """The SavedModel directory among a target's files (or the directory itself)."""
    if not paths:
        raise CheckError("saved_model has no files; expected a SavedModel directory or its files")
    for path in map(pathlib.Path, paths):
        if path.is_dir() and (path / "saved_model.pb").exists():
            return path
        if path.name == "saved_model.pb":
            return path.parent
    raise CheckError(f"saved_model '{paths[0]}' has no saved_model.pb")


def _import_tensorflow_quietly() -> None:
    """Import TensorFlow and start its devices with stderr muted.

    TensorFlow writes its start-up lines (oneDNN, CUDA) before it honours
    ``TF_CPP_MIN_LOG_LEVEL``; muted, the test log is this script's lines.
    """
    from tfpolicy.quiet import muted_stderr

    with muted_stderr():
        import tensorflow as tf

        tf.config.list_physical_devices()


def measure_error(input_dir: pathlib.Path, rewritten_dir: pathlib.Path, *, seed: int,
                  data: Optional[str] = None) -> Measurement:
    """The largest max-abs error of any output of any signature, by ``tfpolicy.validate``."""
    import tfpolicy

    try:
        report = tfpolicy.validate(input_dir, rewritten_dir, data=data, layers=False, seed=seed)
    except tfpolicy.TfPolicyError as exc:
        raise CheckError(str(exc)) from exc
    signatures = len({o.signature for o in report.outputs})
    worst = Measurement(0.0, "no outputs", signatures)
    for output in report.outputs:
        error = math.inf if output.mismatches else output.max_abs_error
        if math.isnan(error):
            return Measurement(error, f"{output.signature}/{output.output}", signatures)
        if error > worst.max_abs_error or worst.where == "no outputs":
            worst = Measurement(error, f"{output.signature}/{output.output}", signatures)
    return worst


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_error", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--validation_data", default=None)
    parser.add_argument("--rewritten", required=True)
    parser.add_argument("--saved_model", nargs="*", default=[])
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = _parse(argv)
    _import_tensorflow_quietly()
    try:
        input_dir = _saved_model_dir(args.saved_model)
        rewritten_dir = _saved_model_dir([args.rewritten])
        result = measure_error(input_dir, rewritten_dir, seed=args.seed, data=args.validation_data)
    except CheckError as exc:
        print(f"tfpolicy_test: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    passed = result.max_abs_error <= args.max_error  # False for NaN
    verdict, relation = ("PASS", "<=") if passed else ("FAIL", ">")
    print(
        f"tfpolicy_test: {verdict}: max abs error {result.max_abs_error:.3g} {relation} "
        f"max_error {args.max_error:g} ({result.where}, {result.signatures} signatures)",
        flush=True,
    )
    return 0 if passed else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

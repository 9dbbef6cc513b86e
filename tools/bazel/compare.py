"""The tfpolicy_test rule's check: the rewritten SavedModel against its input.

    compare.py --max_error 0.05 [--seed 0] [--batch_size 4]
               --rewritten OUT_DIR --saved_model IN_FILE_OR_DIR...

Loads both SavedModels with ``tf.saved_model.load``, runs every signature of
the input on the same generated inputs (seeded, shaped after the signature,
unknown dimensions set to ``--batch_size``), and prints one line:

    tfpolicy_test: PASS: max abs error 3.1e-03 <= max_error 0.05 (serve/output_0, 2 signatures)
    tfpolicy_test: FAIL: max abs error 3.1e-03 > max_error 1e-03 (serve/output_0, 2 signatures)

Exit status: 0 on PASS, 1 on FAIL, 2 on a user error (one line, no traceback).

:func:`measure_error` is the whole comparison; when ``tfpolicy.rewrite
--validate`` exists it is the one function to replace with a call of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import sys
from typing import Sequence

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
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow as tf

        tf.config.list_physical_devices()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _load(path: pathlib.Path):
    import tensorflow as tf

    try:
        return tf.saved_model.load(str(path))
    except Exception as exc:  # TensorFlow raises many types for a broken model
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckError(f"cannot load SavedModel '{path}': {first}") from exc


def _generated_input(spec, rng, batch_size: int):
    """A seeded array that fits ``spec``: unknown dimensions become ``batch_size``."""
    import numpy as np
    import tensorflow as tf

    if spec.shape.rank is None:
        raise CheckError(f"input '{spec.name}' has an unknown rank; cannot generate data for it")
    shape = tuple(batch_size if d is None else int(d) for d in spec.shape.as_list())
    dtype = tf.as_dtype(spec.dtype)
    if dtype.is_floating:
        return tf.constant(rng.standard_normal(shape), dtype=dtype)
    if dtype.is_integer:
        return tf.constant(rng.integers(0, 2, size=shape), dtype=dtype)
    if dtype == tf.bool:
        return tf.constant(rng.integers(0, 2, size=shape).astype(bool))
    if dtype == tf.string:
        return tf.constant(np.full(shape, b"tfpolicy", dtype=object))
    raise CheckError(f"input '{spec.name}' has dtype {dtype.name}; cannot generate data for it")


def measure_error(input_dir: pathlib.Path, rewritten_dir: pathlib.Path, *, seed: int, batch_size: int) -> Measurement:
    """Max abs difference of every output of every signature, on generated inputs.

    A non-float output that differs counts as an infinite error; a NaN where
    the input model has none counts as NaN (which no bound accepts).
    """
    import numpy as np

    original, rewritten = _load(input_dir), _load(rewritten_dir)
    keys = sorted(original.signatures.keys())
    missing = [k for k in keys if k not in rewritten.signatures]
    if missing:
        raise CheckError(f"rewritten SavedModel '{rewritten_dir}' lacks signature(s) {', '.join(missing)}")
    worst = Measurement(0.0, "no outputs", len(keys))
    for number, key in enumerate(keys):
        rng = np.random.default_rng(seed + number)
        _, specs = original.signatures[key].structured_input_signature
        inputs = {name: _generated_input(spec, rng, batch_size) for name, spec in sorted(specs.items())}
        expected = original.signatures[key](**inputs)
        actual = rewritten.signatures[key](**inputs)
        for output in sorted(expected):
            error = _difference(expected[output].numpy(), actual[output].numpy())
            if math.isnan(error) or error > worst.max_abs_error or worst.where == "no outputs":
                worst = Measurement(error, f"{key}/{output}", len(keys))
            if math.isnan(error):
                return worst
    return worst


def _difference(expected, actual) -> float:
    import numpy as np

    if expected.shape != actual.shape:
        return math.inf
    if np.issubdtype(expected.dtype, np.floating) or np.issubdtype(expected.dtype, np.complexfloating):
        if expected.size == 0:
            return 0.0
        diff = np.abs(expected.astype(np.float64) - actual.astype(np.float64))
        diff[np.isnan(expected) & np.isnan(actual)] = 0.0
        return float(np.max(diff))
    return 0.0 if np.array_equal(expected, actual) else math.inf


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_error", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--rewritten", required=True)
    parser.add_argument("--saved_model", nargs="*", default=[])
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = _parse(argv)
    _import_tensorflow_quietly()
    try:
        input_dir = _saved_model_dir(args.saved_model)
        rewritten_dir = _saved_model_dir([args.rewritten])
        result = measure_error(input_dir, rewritten_dir, seed=args.seed, batch_size=args.batch_size)
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

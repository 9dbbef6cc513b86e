"""Command line: ``python -m tfpolicy.rewrite --map MAP INPUT OUTPUT``.

Writes a copy of the SavedModel INPUT to OUTPUT with the policy map applied:
each layer's ops run in its policy's compute dtype (Casts inserted where
dtypes meet), variables are stored in its variable dtype, int8 and float8
layers get quantize-dequantize ops, and every signature keeps its input and
output dtypes.

    python -m tfpolicy.rewrite --map policy.json model/ model_bf16/
    python -m tfpolicy.rewrite --map policy.json --explain model/
    python -m tfpolicy.rewrite --map fp8.json --calibration_data batches.npz model/ model_fp8/

Any user error prints one line on stderr and exits with status 2; nothing is
written then.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("map", None, "Policy map JSON file: Keras's serialized DTypePolicyMap, or "
                    '{"default_policy": ..., "policy_map": {path_or_regex: policy}}.')
flags.DEFINE_list("signatures", None, "Comma-separated signature keys to rewrite (default: all).")
flags.DEFINE_bool("explain", False, "Print the per-layer plan and what would change; write nothing.")
flags.DEFINE_string("report", None, "Also write the report as JSON to this file.")
flags.DEFINE_bool("strict", False, "Treat warnings (a key matching no layer) as errors.")
flags.DEFINE_bool("overwrite", False, "Replace OUTPUT if it exists.")
flags.DEFINE_bool("quiet", False, "Print nothing but errors.")
flags.DEFINE_string("calibration_data", None, "float8 calibration inputs: an .npz of arrays keyed by the "
                    "serving_default signature's input names, batch first (strings as bytes arrays).")
flags.DEFINE_integer("calibration_batches", None, "Run at most this many calibration batches.", lower_bound=1)
flags.DEFINE_integer("calibration_batch_size", 32, "Rows of --calibration_data per calibration batch.", lower_bound=1)

USAGE = "usage: python -m tfpolicy.rewrite --map MAP [flags] INPUT OUTPUT  (--helpshort for flags)"
EXIT_USER_ERROR = 2


def _fail(message: str) -> None:
    print(f"tfpolicy: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def _progress(message: str) -> None:
    """A progress line: shown on an interactive stderr only (see _show_progress)."""
    import logging  # noqa: PLC0415

    logging.getLogger("tfpolicy").info(message)


def _summary(message: str) -> None:
    if not FLAGS.quiet:
        print(f"tfpolicy: {message}", file=sys.stderr, flush=True)


def _check_report_path() -> None:
    if not FLAGS.report:
        return
    parent = os.path.dirname(os.path.abspath(FLAGS.report))
    if not os.path.isdir(parent):
        _fail(f"cannot write report '{FLAGS.report}': directory '{parent}' does not exist")
    if not os.access(parent, os.W_OK) or os.path.isdir(FLAGS.report):
        _fail(f"cannot write report '{FLAGS.report}': not a writable file location")


def main(argv: Sequence[str]) -> None:
    positional = list(argv[1:])
    if FLAGS.map is None:
        _fail(f"--map is required; {USAGE}")
    wanted = 1 if FLAGS.explain else 2
    if len(positional) != wanted and not (FLAGS.explain and len(positional) == 2):
        _fail(f"expected {'INPUT [OUTPUT]' if FLAGS.explain else 'INPUT OUTPUT'}, got {len(positional)} argument(s); {USAGE}")
    _check_report_path()
    _quiet_tensorflow()
    import tfpolicy  # noqa: PLC0415  (after the environment is set)

    _show_progress()

    started = time.monotonic()
    try:
        if FLAGS.explain:
            report = tfpolicy.explain(positional[0], FLAGS.map, signatures=FLAGS.signatures, strict=FLAGS.strict)
            print(report.format_table())
        else:
            _progress(f"rewriting {positional[0]} -> {positional[1]}")
            batches, progress = _calibration_batches()
            report = tfpolicy.rewrite(
                positional[0], positional[1], FLAGS.map,
                signatures=FLAGS.signatures, overwrite=FLAGS.overwrite, strict=FLAGS.strict,
                calibration_data=batches, calibration_batches=FLAGS.calibration_batches,
                calibration_progress=progress,
            )
            _summary(
                f"wrote {positional[1]} in {time.monotonic() - started:.1f}s: "
                f"{sum(s.ops_retyped for s in report.signatures)} ops retyped, "
                f"{report.casts_inserted} casts inserted, {report.casts_reused} reused, "
                f"{len(report.variables_converted)} variables converted, "
                f"{sum(q.ops_quantized for q in report.quantization.values())} ops quantized"
                f"{f' ({report.calibration_batches} calibration batches)' if report.calibration_batches else ''}; "
                f"{report.input_bytes / 1e6:.2f} MB -> {report.output_bytes / 1e6:.2f} MB"
            )
        if FLAGS.report:
            import pathlib  # noqa: PLC0415

            try:
                report.write_json(pathlib.Path(FLAGS.report))
            except OSError as exc:
                _fail(f"cannot write report '{FLAGS.report}': {exc.strerror}")
    except tfpolicy.TfPolicyError as exc:
        _fail(str(exc))


def _calibration_batches():
    """The --calibration_data batches (read now, so a bad file fails first) and a progress bar."""
    if FLAGS.calibration_data is None:
        return None, None
    from tfpolicy import calibration, inputs  # noqa: PLC0415

    batches = calibration.NpzBatches(inputs.load_npz(FLAGS.calibration_data, what="calibration data"),
                                     FLAGS.calibration_batch_size)
    if FLAGS.quiet or not sys.stderr.isatty():
        return batches, None
    import keras  # noqa: PLC0415

    total = len(batches) if FLAGS.calibration_batches is None else min(len(batches), FLAGS.calibration_batches)
    bar = keras.utils.Progbar(total, unit_name="batch")
    return batches, lambda done: bar.update(done)


def _quiet_tensorflow() -> None:
    """Import TensorFlow with its start-up chatter (C++ INFO lines) silenced.

    TensorFlow 2.21 writes those lines before its logging honours
    ``TF_CPP_MIN_LOG_LEVEL``, so stderr is pointed at /dev/null while it starts
    and initialises its devices; an import error is still reported.
    """
    import logging  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    from absl import logging as absl_logging  # noqa: PLC0415

    warnings.filterwarnings("ignore")
    absl_logging.set_verbosity(absl_logging.ERROR)
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow as tf  # noqa: PLC0415

        import tfpolicy.api  # noqa: F401, PLC0415  (pulls in keras and tf_keras)

        tf.config.list_physical_devices()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    tf.get_logger().setLevel(logging.ERROR)


def _show_progress() -> None:
    """tfpolicy's log lines on stderr: warnings always, progress on a terminal.

    Progress (load, index, rewrite, save) is for a person watching; when stderr
    is a pipe or a file, a user error stays the only line there.
    """
    import logging  # noqa: PLC0415

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ProgressFormatter())
    package_logger = logging.getLogger("tfpolicy")
    package_logger.handlers[:] = [handler]
    package_logger.propagate = False
    interactive = sys.stderr.isatty() and not FLAGS.quiet
    package_logger.setLevel(logging.INFO if interactive else logging.WARNING)


class _ProgressFormatter:
    """``tfpolicy: message`` for progress, ``tfpolicy: warning: message`` above INFO."""

    def format(self, record) -> str:  # logging.Formatter protocol
        level = "" if record.levelname == "INFO" else record.levelname.lower() + ": "
        return f"tfpolicy: {level}{record.getMessage()}"


HELP_FLAGS = ("-h", "-?", "--help", "--helpshort", "--helpfull", "--helpxml")


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return FLAGS(argv)
    except SystemExit:
        # absl prints the help and exits 1; asking for help is not an error.
        if any(arg in HELP_FLAGS for arg in argv[1:]):
            sys.exit(0)
        raise
    except flags.Error as exc:
        _fail(f"{exc}; {USAGE}")
        raise  # unreachable


def run_main() -> None:
    """Console-script entry point (``tfpolicy-rewrite``)."""
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run_main()

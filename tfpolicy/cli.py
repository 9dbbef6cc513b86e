"""Command line: ``python -m tfpolicy.rewrite --map MAP INPUT OUTPUT`` (also ``python -m tfpolicy``).

Writes a copy of the SavedModel INPUT to OUTPUT with the policy map applied:
each layer's ops run in its policy's compute dtype (Casts inserted where
dtypes meet), variables are stored in its variable dtype, int8, int4 and
float8 layers are quantized as Keras quantizes them, and every signature keeps
its input and output dtypes.

    python -m tfpolicy.rewrite --map policy.json model/ model_bf16/
    python -m tfpolicy.rewrite --map policy.json --explain model/
    python -m tfpolicy.rewrite --map policy.json --serving_base /models/net model/
    python -m tfpolicy.rewrite --map policy.json --validate --max_error 0.05 model/ model_bf16/

Exit status: 0 on success; 2 for any user error, which prints one line on
stderr and writes nothing; 1 when ``--validate`` measures an output error above
``--max_error`` (the table is printed; a plain OUTPUT is kept for inspection, a
``--serving_base`` version is not published); 3 for an internal error (a bug in
tfpolicy: one line, nothing written; ``TFPOLICY_DEBUG=1`` shows the traceback);
130 or 143 when SIGINT or SIGTERM stops it (one line; nothing half-written is
left); 141 when the reader of ``--explain``'s table closed the pipe.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Callable, NoReturn, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

if TYPE_CHECKING:  # imported lazily at run time, after TensorFlow is quieted
    from tfpolicy.report import Report
    from tfpolicy.validation.compare import ValidationReport

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
flags.DEFINE_bool("calibrate_function", False, "Also write tfpolicy.calibrate(**inputs) into a float8 output, to"
                  " recalibrate its input scales later from the loaded model (a second copy of the forward pass:"
                  " more to write and to load).")
flags.DEFINE_string("serving_base", None, "Export for TF Serving: write the model to SERVING_BASE/<version>/, atomically,"
                    " instead of OUTPUT (then only INPUT is given).")
flags.DEFINE_integer("serving_version", None, "With --serving_base: the version to write (default: one more than the highest"
                     " existing version, 1 if none). An existing version is refused.")
flags.DEFINE_string("warmup_data", None, "With --serving_base: an .npz of serving_default inputs; each row becomes one"
                    " request in assets.extra/tf_serving_warmup_requests.")
flags.DEFINE_bool("validate", False, "Run INPUT and the output on the same inputs and report per-output and per-layer error.")
flags.DEFINE_string("validation_data", None, "With --validate: an .npz of inputs keyed by input name, batch first"
                    " (default: the calibration data, else generated inputs).")
flags.DEFINE_float("max_error", None, "With --validate: exit 1 when an output's max abs error exceeds this.")
flags.DEFINE_string("report_html", None, "With --validate: also write an HTML page with the per-layer error chart.")
flags.DEFINE_enum("target", None, ["gpu", "tpu", "cpu"], "Serving target; picks the fastest exact form of the"
                  " int8/float8 layers for it. cpu: oneDNN's int8 kernel (x86 TensorFlow; exact on CPUs with"
                  " AVX512-VNNI, AVX-VNNI or AMX), the output then runs only on such CPUs (elsewhere it stops with"
                  " a message). gpu/tpu: signatures with"
                  " quantized layers marked for XLA compilation (s8 and FP8 GEMMs); gpu also checks every op left"
                  " outside XLA has a GPU kernel; tpu refuses float16/float8 and requires every signature to"
                  " compile. Without it the output runs everywhere.")
flags.DEFINE_bool("int8_convolutions", False, "Also quantize the convolutions of int8 layers, which Keras cannot"
                  " (by default they stay in the source policy, as Keras's model.quantize leaves them): kernels stored"
                  " in int8 and read dequantized, inputs quantize-dequantized. Saves storage, not time (TensorFlow"
                  " has no integer convolution), and adds error.")
flags.DEFINE_bool("serving_checks", True, "Before writing, load the output with the TF1 session loader and compile"
                  " each signature under XLA (--noserving_checks skips both).")

USAGE = "usage: python -m tfpolicy.rewrite --map MAP [flags] INPUT OUTPUT  (--helpshort for flags)"
EXIT_USER_ERROR = 2
EXIT_VALIDATION_FAILED = 1
EXIT_INTERNAL_ERROR = 3


EXIT_INTERRUPTED = 128  # plus the signal's number: 130 for SIGINT, 143 for SIGTERM
_CONTROL_CHARACTERS = {i: f"\\x{i:02x}" for i in range(32)} | {ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}


def _line(message: str) -> str:
    """``message`` on one line: a newline in a path is shown as ``\\n``."""
    return message.translate(_CONTROL_CHARACTERS)


def _fail(message: str) -> None:
    print(_line(f"tfpolicy: error: {message}"), file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


class _Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: unwinds like KeyboardInterrupt, so every staging directory is removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_received: list[int] = []  # the interrupt that arrived, if one did


def _on_interrupt(signum: int, frame) -> None:  # noqa: ANN001  (signal handler protocol)
    for each in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the clean-up short
        signal.signal(each, signal.SIG_IGN)
    _received.append(signum)
    raise _Interrupted(signum)


def _report_interrupt(signum: int) -> None:
    """One line, and the shell's exit status for a death by that signal; nothing half-written is left."""
    from tfpolicy.core import staging  # noqa: PLC0415

    name = signal.Signals(signum).name
    staging.discard_all_mine()  # again: the interrupt may have cut a writer's own clean-up short
    kept = [path for path in staging.published if os.path.lexists(path)]  # not a scratch output removed since
    if kept:
        what = f"after writing '{kept[-1]}', which is complete"
    else:
        what = "nothing was written"
    print(_line(f"tfpolicy: interrupted by {name}; {what}"), file=sys.stderr, flush=True)
    sys.exit(EXIT_INTERRUPTED + signum)


def _progress(message: str) -> None:
    """A progress line: shown on an interactive stderr only (see _show_progress)."""
    import logging  # noqa: PLC0415

    logging.getLogger("tfpolicy").info(message)


def _summary(message: str) -> None:
    if not FLAGS.quiet:
        print(_line(f"tfpolicy: {message}"), file=sys.stderr, flush=True)


def _check_paths(positional: list[str]) -> None:
    """Every path the run reads or writes, before TensorFlow is imported: a mistyped one is answered at once."""
    from tfpolicy.core import paths  # noqa: PLC0415  (no TensorFlow)
    from tfpolicy.errors import TfPolicyError  # noqa: PLC0415

    try:
        with open(FLAGS.map, "rb"):
            pass
    except OSError as exc:
        _fail(f"cannot read policy map {FLAGS.map}: {exc.strerror}")
    try:
        paths.check_input_dir(positional[0])
        outputs: tuple[str, ...] = ()
        if FLAGS.serving_base:
            outputs = (FLAGS.serving_base,)
        elif not FLAGS.explain:
            paths.check_output_dir(positional[0], positional[1], FLAGS.overwrite)
            outputs = (positional[1],)
        for flag in ("report", "report_html"):
            paths.check_report_path(FLAGS[flag].value, positional[0], outputs, what=f"--{flag} file")
    except TfPolicyError as exc:
        _fail(str(exc))


def _check_flag_combinations(positional: list[str]) -> None:
    """Flags that need another flag, or exclude one; all before TensorFlow starts."""
    needs = [("max_error", "validate"), ("validation_data", "validate"), ("report_html", "validate"),
             ("serving_version", "serving_base"), ("warmup_data", "serving_base")]
    for flag, required in needs:
        if FLAGS[flag].present and not FLAGS[required].value:
            _fail(f"--{flag} needs --{required}")
    if FLAGS.max_error is not None and not FLAGS.max_error >= 0:
        _fail(f"--max_error must be a non-negative number, got {FLAGS.max_error}")
    if FLAGS.explain and (FLAGS.validate or FLAGS.serving_base):
        _fail("--explain writes nothing, so it cannot be combined with --validate or --serving_base")
    if FLAGS.serving_base is not None:
        if FLAGS.overwrite:
            _fail("--overwrite does not apply to --serving_base: a version is never replaced; omit --version for the next one")
        if FLAGS.serving_version is not None and FLAGS.serving_version < 0:
            _fail(f"--serving_version must be a non-negative integer, got {FLAGS.serving_version}")
        if len(positional) != 1:
            _fail(f"with --serving_base give only INPUT, got {len(positional)} argument(s); {USAGE}")


def main(argv: Sequence[str]) -> None:
    """The command: SIGINT and SIGTERM at any point end it with one line, nothing half-written left."""
    guarded(_main, argv)


def guarded(body: Callable[[Sequence[str]], None], argv: Sequence[str]) -> None:
    """Run a command's ``body``: an interrupt at any point ends it with one line (also ``tfpolicy.suggest``'s)."""
    try:
        body(argv)
    except (_Interrupted, KeyboardInterrupt):
        pass
    except (SystemExit, Exception):
        # An interrupt that an import turned into an ImportError (numpy's C
        # extension imports ``datetime`` through PyCapsule_Import, which reports
        # any exception so), or any other error it caused, is the interrupt.
        if not _received:
            raise
    # Also when TensorFlow swallowed the exception and the run went on: the user asked it to stop.
    if _received:
        _report_interrupt(_received[0])


def _main(argv: Sequence[str]) -> None:
    positional = list(argv[1:])
    if FLAGS.map is None:
        _fail(f"--map is required; {USAGE}")
    _check_flag_combinations(positional)
    wanted = 1 if FLAGS.explain or FLAGS.serving_base else 2
    if len(positional) != wanted and not (FLAGS.explain and len(positional) == 2):
        _fail(f"expected {'INPUT [OUTPUT]' if FLAGS.explain else 'INPUT OUTPUT'}, got {len(positional)} argument(s); {USAGE}")
    _check_paths(positional)
    _quiet_tensorflow()
    from tfpolicy import api  # noqa: PLC0415  (after the environment is set)
    from tfpolicy.errors import ValidationError  # noqa: PLC0415
    from tfpolicy.validation import compare  # noqa: PLC0415

    _show_progress()

    started = time.monotonic()
    validation = None
    try:
        if FLAGS.explain:
            report = api.explain(positional[0], FLAGS.map, signatures=FLAGS.signatures, strict=FLAGS.strict,
                                      target=FLAGS.target, int8_convolutions=FLAGS.int8_convolutions)
            _print_table(report.format_table())
        else:
            data = FLAGS.validation_data or FLAGS.calibration_data
            if FLAGS.validate and data is not None:
                from tfpolicy.validation import compare as validation_module  # noqa: PLC0415

                validation_module.check_data(positional[0], data, signatures=FLAGS.signatures)
            if FLAGS.serving_base:
                report, validation = _export(positional[0], started)
            else:
                report = _rewrite(positional[0], positional[1], started)
                if FLAGS.validate:
                    _progress("validating")
                    validation = compare.validate(positional[0], positional[1], data=data,
                                                   signatures=FLAGS.signatures, max_error=FLAGS.max_error)
                    report.validation = validation
        _write_reports(report, validation)
    except ValidationError as exc:
        validation = exc.validation
        if exc.report is not None:
            exc.report.validation = validation
        _write_reports(exc.report, validation)
        _fail_validation(validation)
    except Exception as exc:  # noqa: BLE001  (a user error, or a bug of ours: one line, not a traceback)
        fail_on(exc)
    if validation is not None and not validation.passed:
        _fail_validation(validation)


def fail_on(exc: Exception) -> NoReturn:
    """The one line for an exception that ends a command: a user error's message (exit 2), or an internal error (3).

    An error the interrupt caused (a write cut short, or the interrupt rewrapped
    by TensorFlow's C++ on its way up) is the interrupt.
    """
    from tfpolicy.errors import TfPolicyError, cause_line  # noqa: PLC0415

    if _received:
        raise _Interrupted(_received[0]) from exc
    if isinstance(exc, TfPolicyError):
        _fail(str(exc))
    if os.environ.get("TFPOLICY_DEBUG"):
        raise exc
    print(_line(f"tfpolicy: internal error: {type(exc).__name__}: {cause_line(str(exc))} (nothing was written;"
                " TFPOLICY_DEBUG=1 shows the traceback; please report it)"), file=sys.stderr)
    sys.exit(EXIT_INTERNAL_ERROR)


def _rewrite(input_dir: str, output_dir: str, started: float) -> Report:
    from tfpolicy import api  # noqa: PLC0415

    _progress(f"rewriting {input_dir} -> {output_dir}")
    batches, progress = _calibration_batches()
    report = api.rewrite(
        input_dir, output_dir, FLAGS.map,
        signatures=FLAGS.signatures, overwrite=FLAGS.overwrite, strict=FLAGS.strict,
        calibration_data=batches, calibration_batches=FLAGS.calibration_batches,
        calibration_progress=progress, target=FLAGS.target, serving_checks=FLAGS.serving_checks,
        int8_convolutions=FLAGS.int8_convolutions, calibrate_function=FLAGS.calibrate_function,
    )
    _summary(f"wrote {output_dir} in {time.monotonic() - started:.1f}s: " + _counts(report))
    if report.lowering is not None:
        _summary(report.lowering.note)
    if report.serving_checks is not None:
        _summary(report.serving_checks.summary())
    return report


def _export(input_dir: str, started: float) -> tuple[Report, Optional[ValidationReport]]:
    from tfpolicy import serving_export as serving  # noqa: PLC0415

    _progress(f"exporting {input_dir} -> {FLAGS.serving_base}/<version>")
    batches, progress = _calibration_batches()
    result = serving.export_with_report(
        input_dir, FLAGS.serving_base, FLAGS.map, version=FLAGS.serving_version, calibration_data=batches,
        calibration_batches=FLAGS.calibration_batches, calibration_progress=progress,
        warmup_examples=FLAGS.warmup_data, signatures=FLAGS.signatures, strict=FLAGS.strict, target=FLAGS.target,
        serving_checks=FLAGS.serving_checks, validate=FLAGS.validate, validation_data=FLAGS.validation_data,
        max_error=FLAGS.max_error, int8_convolutions=FLAGS.int8_convolutions,
        calibrate_function=FLAGS.calibrate_function,
    )
    warmup = f", {result.warmup_records} warmup requests" if result.warmup_records else ""
    _summary(f"exported version {result.version} to {result.path} in {time.monotonic() - started:.1f}s{warmup}: "
             + _counts(result.report))
    if result.report.lowering is not None:
        _summary(result.report.lowering.note)
    if result.report.serving_checks is not None:
        _summary(result.report.serving_checks.summary())
    result.report.validation = result.validation
    return result.report, result.validation


def _counts(report: Report) -> str:
    return (
        f"{sum(s.ops_retyped for s in report.signatures)} ops retyped, "
        f"{report.casts_inserted} casts inserted, {report.casts_reused} reused, "
        f"{len(report.variables_converted)} variables converted, "
        f"{sum(q.ops_quantized for q in report.quantization.values())} ops quantized"
        f"{_declined(report)}"
        f"{f' ({report.calibration_batches} calibration batches)' if report.calibration_batches else ''}; "
        f"{report.input_bytes / 1e6:.2f} MB -> {(report.output_bytes or 0) / 1e6:.2f} MB"
    )


def _declined(report: Report) -> str:
    declined = sum(sum(q.declined.values()) for q in report.quantization.values())
    return f" ({declined} declined: see --explain)" if declined else ""


def _write_reports(report: Optional[Report], validation: Optional[ValidationReport]) -> None:
    import pathlib  # noqa: PLC0415

    if validation is not None:
        _print_table(validation.format_table())
    from tfpolicy.validation import html_report  # noqa: PLC0415

    writers = []
    if FLAGS.report and report is not None:
        writers.append((FLAGS.report, report.write_json))
    if FLAGS.report_html and validation is not None:
        writers.append((FLAGS.report_html, lambda path: html_report.write(path, validation, report)))
    for path, write in writers:
        try:
            write(pathlib.Path(path))
        except OSError as exc:
            _fail(f"cannot write report '{path}': {exc.strerror}")


def _print_table(text: str) -> None:
    """``text`` on stdout; a reader that closed the pipe early (``| head``) ends the run quietly, as ``cat`` would."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit must not fail
        sys.exit(EXIT_INTERRUPTED + signal.SIGPIPE)


def _fail_validation(validation: ValidationReport) -> None:
    print(f"tfpolicy: {validation.failure_line()}", file=sys.stderr, flush=True)
    sys.exit(EXIT_VALIDATION_FAILED)


def _calibration_batches():
    """The --calibration_data batches (the first read now, so a bad file fails first) and a progress bar."""
    if FLAGS.calibration_data is None:
        return None, None
    from tfpolicy.core import inputs  # noqa: PLC0415

    batches = inputs.BatchStream(FLAGS.calibration_data, what="calibration data",
                                 batch_size=FLAGS.calibration_batch_size, max_batches=FLAGS.calibration_batches)
    if FLAGS.quiet or not sys.stderr.isatty():
        return batches, None
    import keras  # noqa: PLC0415

    bar = keras.utils.Progbar(batches.total, unit_name="batch")
    return batches, lambda done, total: bar.update(done)


def _quiet_tensorflow() -> None:
    """Import TensorFlow with its start-up chatter (C++ INFO lines) silenced.

    TensorFlow 2.21 writes those lines before its logging honours
    ``TF_CPP_MIN_LOG_LEVEL``, so stderr is pointed at /dev/null while it starts
    and initialises its devices; an import error is still reported.
    """
    import logging  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    from absl import logging as absl_logging  # noqa: PLC0415

    from tfpolicy.quiet import muted_stderr  # noqa: PLC0415

    # TensorFlow's and Keras's own deprecation chatter, not the user's or ours.
    for package in ("tensorflow", "keras", "tf_keras", "absl", "google.protobuf"):
        warnings.filterwarnings("ignore", module=package)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    absl_logging.set_verbosity(absl_logging.ERROR)
    with muted_stderr():
        import tensorflow as tf  # noqa: PLC0415

        import tfpolicy.api  # noqa: F401, PLC0415  (pulls in keras and tf_keras)

        tf.config.list_physical_devices()
    # Autograph loads the code it generates as modules from the temp directory and removes them at exit;
    # their bytecode would stay there, in __pycache__ (the package's own is written by now).
    sys.dont_write_bytecode = True
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
    if FLAGS.strict:  # a warning is then the error line, printed once
        handler.addFilter(lambda record: record.levelno != logging.WARNING)
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


def _version_flag(argv: list[str]) -> list[str]:
    """``--version`` alone prints tfpolicy's version; ``--version N`` is the old spelling of ``--serving_version N``."""
    args = list(argv)
    for i, arg in enumerate(args[1:], start=1):
        value = arg.partition("=")[2] if arg.startswith("--version=") else None
        if arg == "--version" and i + 1 < len(args) and args[i + 1].lstrip("-").isdigit():
            value = args.pop(i + 1)
        if arg == "--version" and value is None:
            from tfpolicy import __version__  # noqa: PLC0415

            print(f"tfpolicy {__version__}")
            sys.exit(0)
        if value is not None:
            print(f"tfpolicy: warning: --version {value} is deprecated (it will print tfpolicy's version in the next"
                  f" release); use --serving_version {value}", file=sys.stderr)
            args[i] = f"--serving_version={value}"
            break
    return args


def _parse_flags(argv: list[str]) -> list[str]:
    argv = _version_flag(argv)
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
    """Entry point of ``python -m tfpolicy.rewrite``, ``python -m tfpolicy`` and the ``tfpolicy-rewrite`` script."""
    for each in (signal.SIGINT, signal.SIGTERM):  # from the start: an interrupt while flags parse is one line too
        signal.signal(each, _on_interrupt)
    try:
        app.run(main, flags_parser=_parse_flags)
    except (_Interrupted, KeyboardInterrupt):
        _report_interrupt(_received[0] if _received else signal.SIGINT)

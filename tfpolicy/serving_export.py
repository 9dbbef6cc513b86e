"""The TF Serving export step: a rewritten model as a new version under a base path.

TF Serving watches a base directory and serves its numbered subdirectories::

    export_base/
        1/                      <- an earlier export
        2/                      <- export(..., version=None) writes the next one
            saved_model.pb
            variables/
            assets.extra/tf_serving_warmup_requests   (with warmup examples)
        .tfpolicy-export-4711@1a2b3c4d-k2j9/    <- staging (pid@host): a name the server ignores

Everything is written into a hidden staging directory inside ``export_base``
(same filesystem), checked, and only then renamed to ``export_base/<version>``,
so a server never sees a half-written version. A failure or an interrupt
removes the staging directory; one a killed process left behind is removed by
the next export (:mod:`tfpolicy.core.staging`), and never a version directory.

Warmup records are TF Serving's format: a TFRecord file of ``PredictionLog``
protos, each holding a ``PredictRequest`` for ``serving_default``, which the
server runs once before it marks the version available. The protos come from
the ``tensorflow-serving-api`` package (the ``serving`` extra).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tfpolicy import api
from tfpolicy.analysis.policy_map import PolicyMapSource
from tfpolicy.core import inputs, paths, staging
from tfpolicy.errors import InputDataError, MissingDependencyError, OutputError, ValidationError
from tfpolicy.report import Report
from tfpolicy.validation import compare

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

WARMUP_FILE = "tf_serving_warmup_requests"
ASSETS_EXTRA = "assets.extra"
WARMUP_SIGNATURE = "serving_default"
MAX_WARMUP_RECORDS = 1000
"""TF Serving refuses to load a version with more warmup records than this."""


@dataclasses.dataclass
class ExportResult:
    path: pathlib.Path  # export_base/<version>
    version: int
    report: Report
    warmup_records: int
    validation: Optional[Any] = None  # validation.ValidationReport


def export(input_dir: PathLike, export_base: PathLike, policy_map: PolicyMapSource, **options: Any) -> pathlib.Path:
    """Rewrite ``input_dir`` with ``policy_map`` into ``export_base/<version>``; return that path.

    ``options`` are :func:`export_with_report`'s: ``version`` defaults to one
    more than the highest numeric subdirectory of ``export_base`` (1 when
    there is none), and an existing version is refused; ``warmup_examples``
    (an npz path, a dict of arrays or an iterable of dicts) become
    ``assets.extra/tf_serving_warmup_requests``: an npz file or a dict gives
    one request per row, an iterable one request per element; the others
    (``calibration_data``, ``signatures``, ``strict``, ``target``,
    ``serving_checks``, ``int8_convolutions``, ``calibrate_function``, ...) are
    :func:`tfpolicy.rewrite`'s.
    """
    return export_with_report(input_dir, export_base, policy_map, **options).path


def export_with_report(
    input_dir: PathLike,
    export_base: PathLike,
    policy_map: PolicyMapSource,
    *,
    version: Optional[int] = None,
    calibration_data: Optional[Any] = None,
    warmup_examples: Optional[inputs.InputSource] = None,
    signatures: Optional[Sequence[str]] = None,
    strict: bool = False,
    target: Optional[str] = None,
    serving_checks: bool = True,
    calibration_batches: Optional[int] = None,
    calibration_progress: Optional[Callable[[int, int], None]] = None,
    validate: bool = False,
    validation_data: Optional[inputs.InputSource] = None,
    max_error: Optional[float] = None,
    int8_convolutions: bool = False,
    calibrate_function: bool = False,
) -> ExportResult:
    """:func:`export`, returning the report too; with ``validate``, validates before publishing.

    A validation error above ``max_error`` raises
    :class:`~tfpolicy.errors.ValidationError` and publishes nothing.
    """
    input_path, base = pathlib.Path(input_dir), pathlib.Path(export_base)
    paths.check_input_dir(input_path)
    _check_base(input_path, base)
    chosen = resolve_version(base, version)
    requests = _warmup_batches(warmup_examples) if warmup_examples is not None else []
    created_base = not base.exists()
    try:
        base.mkdir(exist_ok=True)
        staging_dir = staging.make(base, "export")
        staged = staging_dir / "model"
        options: dict[str, Any] = {}
        if calibration_data is not None:
            options["calibration_data"] = calibration_data
        if calibration_batches is not None:
            options["calibration_batches"] = calibration_batches
        if calibration_progress is not None:
            options["calibration_progress"] = calibration_progress
        report = api.rewrite(
            input_path, staged, policy_map, signatures=signatures, strict=strict, target=target,
            serving_checks=serving_checks, int8_convolutions=int8_convolutions,
            calibrate_function=calibrate_function, **options,
        )
        if requests:
            write_warmup_requests(staged, requests, model_name=base.resolve().name)
        validation = None
        if validate:
            data = validation_data if validation_data is not None else calibration_data
            validation = compare.validate(input_path, staged, data=data, signatures=signatures, max_error=max_error)
            if not validation.passed:
                raise ValidationError(validation.failure_line() + f"; version {chosen} not published", validation, report)
        final = base / str(chosen)
        try:
            staging.publish(staged, final, replace=False)
        except FileExistsError:  # another exporter got there first
            raise OutputError(f"version {chosen} appeared in '{base}' while exporting; nothing published") from None
        report.output_dir = str(final)
        logger.info("published %s", final)
        return ExportResult(final, chosen, report, len(requests), validation)
    except OSError as exc:
        staging.raise_if_write_failure(exc, base)
        raise
    finally:
        with staging.interrupts_held():  # an interrupt arriving now acts once the clean-up is done
            if base.is_dir():
                staging.discard_mine(base, "export")  # staging_dir, or one an interrupt made before it was assigned
            if created_base and base.is_dir() and not any(base.iterdir()):
                base.rmdir()


def existing_versions(base: pathlib.Path) -> list[int]:
    """Versions TF Serving would see: subdirectories named by a non-negative integer."""
    if not base.is_dir():
        return []
    return sorted(int(p.name) for p in base.iterdir() if p.name.isdigit() and p.is_dir())


def resolve_version(base: pathlib.Path, version: Optional[int]) -> int:
    """The version to write: ``version`` if free, else the next after the highest."""
    versions = existing_versions(base)
    following = (versions[-1] + 1) if versions else 1
    if version is None:
        return following
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise OutputError(f"version must be a non-negative integer, got {version!r}")
    if int(version) in versions:
        raise OutputError(
            f"version {version} already exists in '{base}'; choose another --version or omit it for the next one ({following})"
        )
    return int(version)


def _check_base(input_path: pathlib.Path, base: pathlib.Path) -> None:
    if base.exists() and not base.is_dir():
        raise OutputError(f"serving base '{base}' is not a directory")
    if not base.exists() and not base.resolve().parent.is_dir():
        raise OutputError(f"serving base's parent directory '{base.resolve().parent}' does not exist")
    src, dst = input_path.resolve(), base.resolve()
    if dst == src or src in dst.parents:
        raise OutputError(f"serving base '{base}' lies inside the input SavedModel '{input_path}'")
    if (base / "saved_model.pb").exists():
        raise OutputError(
            f"serving base '{base}' is itself a SavedModel; pass the directory that holds the numbered versions"
        )
    paths.check_writable_parent(base if base.exists() else base.resolve().parent, "serving base")


# ---------------------------------------------------------------------------
# Warmup requests
# ---------------------------------------------------------------------------


def _warmup_batches(examples: inputs.InputSource) -> list[dict[str, np.ndarray]]:
    _serving_protos()  # fail early, before anything is written, if the extra is missing
    batches = inputs.batches_from(
        examples, what="warmup examples", batch_size=1, max_batches=MAX_WARMUP_RECORDS + 1
    )
    if len(batches) > MAX_WARMUP_RECORDS:
        raise InputDataError(
            f"{_describe(examples)} give more than {MAX_WARMUP_RECORDS} warmup requests, the most TF Serving loads"
        )
    return batches


def _describe(examples: Any) -> str:
    return f"warmup examples '{examples}'" if isinstance(examples, (str, os.PathLike)) else "warmup examples"


def _serving_protos() -> tuple[Any, Any]:
    try:
        from tensorflow_serving.apis import predict_pb2, prediction_log_pb2  # noqa: PLC0415
    except ImportError as exc:
        raise MissingDependencyError(
            "warmup requests need the tensorflow-serving-api package: pip install 'tfpolicy[serving]'"
        ) from exc
    return predict_pb2, prediction_log_pb2


def write_warmup_requests(
    saved_model_dir: pathlib.Path, batches: list[dict[str, np.ndarray]], *, model_name: str = ""
) -> pathlib.Path:
    """Write ``assets.extra/tf_serving_warmup_requests`` into ``saved_model_dir``.

    Each batch, checked against the model's ``serving_default`` signature,
    becomes one ``PredictionLog`` whose ``predict_log.request`` is a
    ``PredictRequest`` with ``model_spec.signature_name = "serving_default"``.
    """
    predict_pb2, prediction_log_pb2 = _serving_protos()
    loaded = tf.saved_model.load(str(saved_model_dir))
    if WARMUP_SIGNATURE not in loaded.signatures:
        raise InputDataError(
            f"warmup requests are for signature '{WARMUP_SIGNATURE}', which the model lacks;"
            f" it has {', '.join(sorted(loaded.signatures.keys()))}"
        )
    signature = loaded.signatures[WARMUP_SIGNATURE]
    for batch in batches:
        inputs.check_inputs(batch, WARMUP_SIGNATURE, signature, what="warmup examples")
    path = saved_model_dir / ASSETS_EXTRA / WARMUP_FILE
    path.parent.mkdir(exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for batch in batches:
            request = predict_pb2.PredictRequest()
            request.model_spec.name = model_name
            request.model_spec.signature_name = WARMUP_SIGNATURE
            for name, array in sorted(batch.items()):
                request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
            log = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))
            writer.write(log.SerializeToString(deterministic=True))
    return path

"""The Python API: ``tfpolicy.rewrite`` and ``tfpolicy.explain``.

    SavedModel dir --load--> graphs + variables --index--> layer paths
        --plan--> per-layer policy (+ quantization sites) --passes--> float pass, quantize pass
        --assemble--> root object --calibrate (float8, optional)--> --save--> new dir
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
from typing import Callable, Optional, Sequence, Union

import tensorflow as tf

from tfpolicy.analysis import index_limits, layer_index, lowering, quant_sites
from tfpolicy.analysis.calls import call_chains
from tfpolicy.analysis.plan import Plan
from tfpolicy.analysis.plan import plan as make_plan
from tfpolicy.analysis.policy_map import PolicyMap, PolicyMapSource
from tfpolicy.core import assemble, checkpoints, paths, savedmodel_io, savedmodel_save, tf_names
from tfpolicy.core.assemble import NewVariable
from tfpolicy.errors import StrictModeError, UnsupportedPolicyError
from tfpolicy.passes import PassManager
from tfpolicy.passes.builder import CAPTURE_SCOPE
from tfpolicy.passes.calibration import CalibrationPass
from tfpolicy.passes.float_precision import FloatPrecisionPass, choose_variable_dtypes
from tfpolicy.passes.function_args import FunctionArgs
from tfpolicy.passes.quant_variables import build_variables
from tfpolicy.passes.quantize import CalibrationTaps, QuantizePass
from tfpolicy.passes.read_dtype import storable_in_read_dtype, store_in_read_dtype
from tfpolicy.passes.wide_kernels import WideKernelsPass
from tfpolicy.report import Report, SignatureReport, quantization_rows
from tfpolicy.serving import checks as serving
from tfpolicy.core import inputs

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
CALIBRATION_SIGNATURE = "serving_default"


def explain(
    input_dir: PathLike,
    policy_map: PolicyMapSource,
    *,
    signatures: Optional[Sequence[str]] = None,
    strict: bool = False,
    target: Optional[str] = None,
    int8_convolutions: bool = False,
) -> Report:
    """Everything :func:`rewrite` would do, without writing anything."""
    lowering.check_target_name(target)
    with StrictWarnings(strict) as warned:
        report = _run(pathlib.Path(input_dir), None, policy_map, signatures, target, int8_convolutions,
                      explaining=True).report
        warned.check()
    return report


def rewrite(
    input_dir: PathLike,
    output_dir: PathLike,
    policy_map: PolicyMapSource,
    *,
    signatures: Optional[Sequence[str]] = None,
    overwrite: bool = False,
    strict: bool = False,
    calibration_data: inputs.InputSource = None,
    calibration_batches: Optional[int] = None,
    calibration_batch_size: int = 32,
    calibration_progress: Optional[Callable[[int, int], None]] = None,
    target: Optional[str] = None,
    serving_checks: bool = True,
    int8_convolutions: bool = False,
    calibrate_function: bool = False,
) -> Report:
    """Write a copy of the SavedModel at ``input_dir`` with ``policy_map`` applied.

    ``policy_map`` is a JSON file path, a dict in either accepted form, a
    ``keras.dtype_policies.DTypePolicyMap`` or a :class:`PolicyMap`.

    ``calibration_data`` (float8 policies) is an ``.npz`` path (cut into
    batches of ``calibration_batch_size`` rows), one dict of arrays, an iterable
    of ``{input name: batch}`` dicts or a ``tf.data.Dataset``, for the
    ``serving_default`` signature. Batches are read one at a time as they
    run (the first before any model work); at most ``calibration_batches``
    are run, and ``calibration_progress(done, total)`` is called after each
    (``total`` is None when the data's length is unknown). With
    ``calibrate_function``, a float8 output also carries
    ``tfpolicy.calibrate(**inputs)``, to recalibrate it later (a second copy
    of the forward pass, with the updates: more to write and to load).

    ``target`` ("gpu", "tpu", "cpu") refuses dtypes the target cannot run (a
    TPU: float16, float8, float64). Unless ``serving_checks=False``, the saved
    output is loaded with the TF1 session loader and every signature lowered
    to XLA before it is renamed into place (see :mod:`tfpolicy.serving.checks`);
    ``report.serving_checks`` holds the outcome.

    The convolutions of an int8 layer stay in its source policy, as Keras's
    ``model.quantize`` leaves them (Keras has no int8 convolution), unless
    ``int8_convolutions``: then their kernels are stored in int8 and read
    dequantized, and their inputs quantize-dequantized. That saves storage, not
    time (TensorFlow has no integer convolution), and adds error.

    Raises a :class:`~tfpolicy.errors.TfPolicyError` for every user error,
    before anything is written. The input directory is never modified.
    """
    input_path, output_path = pathlib.Path(input_dir), pathlib.Path(output_dir)
    lowering.check_target_name(target)
    paths.check_input_dir(input_path)
    paths.check_output_dir(input_path, output_path, overwrite)
    batches = _calibration_batches(calibration_data, calibration_batch_size, calibration_batches)
    with StrictWarnings(strict) as warned:
        return _rewrite(input_path, output_path, policy_map, signatures, overwrite, warned, batches, calibration_data,
                        calibration_progress, target, serving_checks, int8_convolutions, calibrate_function)


@dataclasses.dataclass
class InMemory:
    """A rewrite kept in memory (:func:`rewrite_in_memory`): its signatures, ready to call."""

    report: Report
    signatures: dict[str, object]  # key -> function, called by keyword as a loaded signature is
    programs: dict[str, savedmodel_io.SignatureProgram]  # the rewritten graphs (aliases: under their first key)
    handles: dict[str, dict[str, object]]  # key -> capture placeholder -> bound handle
    variable_bytes: int  # of the variables the output would store


def rewrite_in_memory(
    input_dir: PathLike,
    policy_map: PolicyMapSource,
    *,
    signatures: Optional[Sequence[str]] = None,
    calibration_data: inputs.InputSource = None,
    calibration_batch_size: int = 32,
    target: Optional[str] = None,
    int8_convolutions: bool = False,
    loaded: Optional[savedmodel_io.LoadedModel] = None,
) -> InMemory:
    """What :func:`rewrite` would write, kept in memory: the same graphs and variables, every variable
    given its value, and nothing written (no serving checks either). ``tfpolicy suggest`` measures
    candidate maps this way before it writes the one it suggests.

    ``loaded``: ``savedmodel_io.load(input_dir, signatures)``, when one load serves several rewrites
    (each edits its own copy of the graphs).
    """
    input_path = pathlib.Path(input_dir)
    lowering.check_target_name(target)
    paths.check_input_dir(input_path)
    batches = _calibration_batches(calibration_data, calibration_batch_size, None)
    with StrictWarnings(False) as warned:
        state, built = _build(input_path, None, policy_map, signatures, warned, batches, calibration_data, None,
                              target, int8_convolutions, loaded.copy() if loaded is not None else None)
    built.materialize()
    state.report.quantization = _quantization(state, built)
    stored = sum(v.shape.num_elements() * v.dtype.size for v in built.root.tfpolicy_variables)
    return InMemory(state.report, built.signatures, dict(state.model.signatures), built.handles, stored)


def _build(input_path, output_path, policy_map, signatures, warned: StrictWarnings, batches, calibration_data,
           calibration_progress, target, int8_convolutions, model=None,
           calibrate_function: bool = False) -> tuple[_State, assemble.Assembled]:
    """Load (unless ``model`` is given), plan, run the passes, assemble and calibrate: everything before saving.

    The calibration function is built when there are batches to run it on or the output is to carry it.
    """
    state = _run(input_path, output_path, policy_map, signatures, target, int8_convolutions, model=model)
    warned.check()
    logger.info("rebuilding %d signature(s)", len(state.model.signatures))
    built = assemble.assemble(
        state.model, state.variable_dtypes, state.new_variables, state.passes.new_captures,
        state.passes.calibration if batches is not None or calibrate_function else None,
        xla_signatures=_xla_signatures(state), carry_calibrate=calibrate_function,
    )
    if state.qplan.float8_groups:
        _calibrate(built, state, state.report, batches, calibration_progress, calibrate_function)
    elif calibration_data is not None:
        state.report.warnings.append("calibration data given but no layer is float8; it was not used")
        logger.warning(state.report.warnings[-1])
    warned.check()
    return state, built


def _quantization(state: _State, built: assemble.Assembled) -> list:
    """The report's quantization rows, from the scales as written."""
    current = {name: variable.numpy() for name, variable in built.new_variables.items() if variable.is_initialized()}
    return quantization_rows(state.qplan, state.passes.quantized, _scales(state.new_variables) | current,
                             state.new_variables)


def _rewrite(input_path, output_path, policy_map, signatures, overwrite, warned: StrictWarnings, batches,
             calibration_data, calibration_progress, target, serving_checks, int8_convolutions,
             calibrate_function) -> Report:
    """:func:`rewrite` after its arguments are checked; ``warned.check()`` wherever --strict must stop it."""
    state, built = _build(input_path, output_path, policy_map, signatures, warned, batches, calibration_data,
                          calibration_progress, target, int8_convolutions, calibrate_function=calibrate_function)
    report = state.report
    logger.info("saving to %s", output_path)

    check_data = {state.passes.calibration[0]: batches.first} if batches and state.passes.calibration else None
    check_inputs = serving.CheckInputs(check_data or {}, state.integer_limits or {}, seed=0)
    # The XLA check traces the signatures now and lowers them on a second core during the TF1 check.
    xla_check = serving.XlaCheck(built.signatures, check_inputs) if serving_checks else contextlib.nullcontext()
    with xla_check as xla:

        def check(staged: pathlib.Path) -> None:
            if serving_checks:
                logger.info("serving checks: loading the output as TF Serving does, and lowering it to XLA")
                report.serving_checks = serving.run(
                    staged, target=target, data=check_data, integer_limits=state.integer_limits,
                    input_dir=input_path, shown_as=output_path, xla=xla,
                    cpu_only_ops=frozenset({lowering.ONEDNN_INT8_MATMUL}) if state.lowering.cpu_only else frozenset(),
                )
            warned.check()  # --strict has the last word, before the rename

        savedmodel_save.save_atomically(
            built.root, built.signatures, output_path, overwrite,
            fill=checkpoints.ValueWriter(built.root, built.value_of), check=check
        )
    report.quantization = _quantization(state, built)
    report.output_bytes = paths.directory_bytes(output_path)
    logger.debug("wrote %s", output_path)
    return report


class StrictWarnings(logging.Handler):
    """Every warning tfpolicy logs while it runs (any ``tfpolicy.*`` logger), for ``--strict`` to refuse.

    Under ``strict``, :meth:`check` raises :class:`StrictModeError` with the
    first one; the rewrite checks after planning, after calibration and last
    on the staged output, before the rename, so no warning comes after it.
    """

    def __init__(self, strict: bool) -> None:
        super().__init__(logging.WARNING)
        self.strict = strict
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.WARNING:
            self.messages.append(record.getMessage())

    def check(self) -> None:
        if self.strict and self.messages:
            raise StrictModeError(self.messages[0] + " (--strict)")

    def __enter__(self) -> "StrictWarnings":
        logging.getLogger("tfpolicy").addHandler(self)
        return self

    def __exit__(self, *exc_info) -> None:
        logging.getLogger("tfpolicy").removeHandler(self)


@dataclasses.dataclass
class _State:
    """What the pipeline has produced before assembling: plan, edited graphs, variables."""

    model: savedmodel_io.LoadedModel
    plan: Plan
    qplan: quant_sites.QuantPlan
    variable_dtypes: dict[int, int]
    new_variables: dict[str, NewVariable]
    passes: "_PassesDone"
    report: Report
    integer_limits: dict[str, dict[str, int]]  # signature -> input -> tables' smallest size
    lowering: lowering.Lowering


def _run(input_path, output_path, policy_map, signatures, target=None, int8_convolutions=False,
         explaining=False, model=None) -> _State:
    """Load (unless ``model`` is given), index, plan and run the passes (``explaining``: the report's
    scales are read now)."""
    policy = PolicyMap.load(policy_map)
    if model is None:
        logger.info("loading %s", input_path)
        model = savedmodel_io.load(input_path, signatures, streamed=True)
    logger.info("indexing layers of %d signature(s)", len(model.signatures))
    index = layer_index.build(model)
    outside = sum(1 for _ in index.nodes_of(None))
    the_plan = make_plan(policy, index, outside)
    lowering.check_target(the_plan, target)
    _refuse_unsupported_modes(the_plan)
    qplan = quant_sites.analyze(model, index, the_plan, int8_convolutions)
    chosen = lowering.choose(target)
    warnings = the_plan.unused_key_warnings()
    for name, count in sorted(index.shared_names.items()):
        warnings.append(
            f"{count} distinct variables share the TF name '{name}' (e.g. a subclassed model built by its first"
            f" call): they are kept apart, each with its own quantization variables, but their layers cannot be"
            f" told apart by path, so the map addresses them together as '{name.rsplit('/', 1)[0]}'"
        )
    if qplan.layers_without_sites:
        warnings.append(
            "quantized policy on layer(s) with no matmul-like op to quantize, which run in their source policy: "
            + ", ".join(path for path, _ in qplan.layers_without_sites)
        )
    if qplan.declined:
        reasons: dict[str, int] = {}
        for declined in qplan.declined:
            reasons[declined.reason] = reasons.get(declined.reason, 0) + 1
        warnings.append(
            f"{len(qplan.declined)} op(s) of quantized layers were declined and run in their source policy: "
            + "; ".join(f"{n} x {reason}" for reason, n in sorted(reasons.items()))
        )
    for message in warnings:
        logger.warning(message)
    values_by_uid = {id(v): v for v in model.variables}
    new_variables = build_variables(
        qplan, lambda uid: model.read(values_by_uid[uid]).numpy(), lambda uid: tuple(values_by_uid[uid].shape), chosen,
        model.derived,
    )
    variable_dtypes = choose_variable_dtypes(the_plan, index, skip=qplan.integer_kernels)

    limits = {key: index_limits.integer_limits(program, index) for key, program in model.signatures.items()}
    limits.update({alias: limits[key] for alias, key in model.aliases.items()})
    passes = _run_passes(model, index, the_plan, qplan, variable_dtypes, new_variables, chosen)
    # float32 variables read only as bfloat16 (float16) are stored so: the same bits, half the bytes, no Casts.
    replaced = {spec.replaces for spec in new_variables.values() if spec.replaces is not None}
    narrowed = storable_in_read_dtype(model, index, skip=set(variable_dtypes) | replaced)  # replaced: int8, int4, float8
    store_in_read_dtype(model, index, narrowed)
    variable_dtypes.update(narrowed)
    for program in model.signatures.values():  # each quantized site's shapes, axes and bounds, once per graph
        for graph in program.all_graphs():
            graph.share_constants(lambda name: CAPTURE_SCOPE in name.split("/"))
    for row in passes.signature_reports:  # the Casts the output has (a variable stored in bfloat16 needs none)
        inserted = [(graph, name) for graph, stats in passes.float_results[row.same_as or row.key] for name in stats.inserted]
        row.casts_inserted = sum(name in graph.nodes and graph.nodes[name].op == "Cast" for graph, name in inserted)
    clamped = sum(s.constants_clamped for s in passes.signature_reports)
    if clamped:
        warnings.append(
            f"{clamped} constant(s) beyond float16's range (e.g. an additive mask's -1e9) were clamped to"
            " +-65504 where float16 ops read them, instead of becoming inf"
        )
        logger.warning(warnings[-1])
    report = Report(
        input_dir=str(input_path),
        output_dir=str(output_path) if output_path else None,
        plan=the_plan,
        signatures=passes.signature_reports,
        retyped_by_layer=passes.retyped,
        declined_by_layer=passes.declined,
        variables_converted=_converted_rows(variable_dtypes, index),
        warnings=warnings,
        input_bytes=paths.directory_bytes(input_path),
        # A rewrite reads the scales once the kernels are written (quantized once); explain reads them now.
        quantization=quantization_rows(qplan, passes.quantized, _scales(new_variables) if explaining else {},
                                       new_variables),
        lowering=chosen if any(s.integer is not None for s in qplan.sites) or (chosen.xla_compile and qplan.sites) else None,
    )
    for message in report.coverage_warnings():
        warnings.append(message)
        logger.warning(message)
    return _State(model, the_plan, qplan, variable_dtypes, new_variables, passes, report, limits, chosen)


@dataclasses.dataclass
class _PassesDone:
    """What the passes did, over all signatures."""

    signature_reports: list[SignatureReport] = dataclasses.field(default_factory=list)
    retyped: dict = dataclasses.field(default_factory=dict)  # layer -> ops retyped
    declined: dict = dataclasses.field(default_factory=dict)  # layer -> {reason: count}
    new_captures: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)  # signature -> placeholders
    quantized: dict[str, int] = dataclasses.field(default_factory=dict)  # layer -> ops quantized
    calibration: Optional[tuple[str, dict]] = None  # (signature, calibrate outputs)
    float_results: dict[str, list] = dataclasses.field(default_factory=dict)  # signature -> [(graph, GraphStats)]


def _run_passes(model, index, the_plan: Plan, qplan, variable_dtypes, new_variables, chosen) -> _PassesDone:
    """Per signature: the float pass on every graph, the quantize pass, and calibration where float8 is.

    The report is built from the passes' results (``PassResult.stats``).
    """
    done = _PassesDone()
    calibration_target = _calibration_signature(qplan)
    for program in model.signatures.values():
        logger.info("rewriting signature %s (%d ops, %d functions)", program.key, len(program.graph.nodes), len(program.functions))
        graphs = program.all_graphs()
        float_passes = [FloatPrecisionPass(program.key, g, index, the_plan, variable_dtypes) for g in graphs]
        # XLA compiles each op its own way: there the slow bfloat16 CPU kernels never run
        wide_passes = [] if chosen.xla_compile else [WideKernelsPass(program.key, g) for g in graphs]
        taps = CalibrationTaps()
        function_args = FunctionArgs(program, call_chains(program.graph, program.functions.values()))
        quantize_passes = [
            QuantizePass(program.key, g, index, qplan, new_variables, constant_scales=g is not program.graph,
                         lowering=chosen, taps=taps, function_args=function_args)
            for g in (program.graph, *program.functions.values())
        ]
        calibration = (CalibrationPass(program.key, program.graph, new_variables, taps, function_args)
                       if program.key == calibration_target else None)
        results = PassManager([*float_passes, *wide_passes, *quantize_passes, *([calibration] if calibration else [])]).run()
        float_results = [(p.graph, results[p.name].stats) for p in float_passes]
        done.float_results[program.key] = float_results
        quantize_results = [results[p.name].stats for p in quantize_passes]
        captures = {placeholder: name for q in quantize_results for placeholder, name in q.new_captures.items()}
        if calibration is not None and results[calibration.name].modified:
            calibrated = results[calibration.name].stats
            captures.update(calibrated.new_captures)
            done.calibration = (program.key, calibrated.outputs)
        done.new_captures[program.key] = captures
        for layer, n in (item for q in quantize_results for item in q.quantized.items()):
            done.quantized[layer] = done.quantized.get(layer, 0) + n
        done.signature_reports.append(
            _signature_report(program, float_results, quantize_results[0], done.retyped, done.declined))
    rows = {row.key: row for row in done.signature_reports}
    for alias, key in model.aliases.items():
        done.signature_reports.append(dataclasses.replace(rows[key], key=alias, same_as=key))
    done.signature_reports.sort(key=lambda row: row.key)
    return done


def _converted_rows(variable_dtypes: dict[int, int], index) -> list[dict]:
    return [
        {
            "name": index.variables[uid].name,
            "layer": index.variables[uid].layer_path,
            "from": tf_names.dtype_name(index.variables[uid].dtype),
            "to": tf_names.dtype_name(dtype),
        }
        for uid, dtype in sorted(variable_dtypes.items(), key=lambda kv: index.variables[kv[0]].name)
    ]


def _signature_report(program, float_results, quantize_result, retyped, declined) -> SignatureReport:
    """One signature's row, from its passes' results: ``float_results`` as (graph, GraphStats).

    Its Casts are counted in :func:`_run`, once the steps after the passes have removed those no read needs.
    """
    sig_report = SignatureReport(program.key)
    changed = 0
    for graph, stats in float_results:
        sig_report.casts_reused += stats.casts_reused
        sig_report.casts_folded += stats.casts_folded
        sig_report.constants_clamped += stats.constants_clamped
        sig_report.ops_retyped += sum(stats.retyped.values())
        changed += int(stats.modified and graph.is_function)
        for layer, n in stats.retyped.items():
            retyped[layer] = retyped.get(layer, 0) + n
        for layer, reasons in stats.declined.items():
            bucket = declined.setdefault(layer, {})
            for reason, n in reasons.items():
                bucket[reason] = bucket.get(reason, 0) + n
    sig_report.functions_rewritten = changed
    sig_report.ops_quantized = sum(quantize_result.quantized.values())
    return sig_report


def _xla_signatures(state: _State) -> frozenset[str]:
    """The signatures to mark for XLA compilation: under --target gpu or tpu, those with quantized sites."""
    if not state.lowering.xla_compile:
        return frozenset()
    return frozenset(s.signature for s in state.qplan.sites)


def _refuse_unsupported_modes(the_plan: Plan) -> None:
    unsupported = [p for p in the_plan.quantized if p.quantization_mode not in quant_sites.SUPPORTED_MODES]
    if unsupported:
        layers = ", ".join(p.path or "(default)" for p in unsupported)
        raise UnsupportedPolicyError(
            f"quantized policy {unsupported[0].policy!r} (layers: {layers}) is not supported;"
            " tfpolicy applies int8_from_*, int4_from_*, int4/<block>_from_* and float8_from_* policies"
        )


def _calibration_signature(qplan: quant_sites.QuantPlan) -> Optional[str]:
    """serving_default when it has float8 sites, else the first signature that has."""
    keys = [s.signature for s in qplan.sites if s.mode == "float8"]
    return CALIBRATION_SIGNATURE if CALIBRATION_SIGNATURE in keys else (min(keys) if keys else None)


def _calibration_batches(data, batch_size: int, max_batches: Optional[int]) -> Optional[inputs.BatchStream]:
    """The calibration batches, streamed; the first is read before any model work (fails fast)."""
    if data is None or isinstance(data, inputs.BatchStream):
        return data
    return inputs.BatchStream(data, what="calibration data", batch_size=batch_size, max_batches=max_batches)


def _calibrate(built, state: _State, report: Report, batches: Optional[inputs.BatchStream], progress,
               carried: bool = False) -> None:
    groups = sorted(g.prefix for g in state.qplan.float8_groups.values())
    if batches is None:
        later = "" if carried else "; give --calibration_data, or --calibrate_function to calibrate the output later"
        report.warnings.append(
            f"float8 layers without calibration data keep input scale 1 (Keras's initial state{later}): "
            + ", ".join(groups)
        )
        logger.warning(report.warnings[-1])
        return
    signature = state.passes.calibration[0]
    function = state.model.signatures[signature].function
    logger.info("calibrating %d float8 layer group(s) on signature %s", len(groups), signature)
    built.materialize()
    non_finite = inputs.NonFiniteCount()
    for done, batch in enumerate(batches, start=1):
        batch = inputs.conform(batch, function)
        inputs.check_inputs(batch, signature, function, what=f"calibration data, batch {done}")
        non_finite.add(batch, done)
        built.calibrate(**{name: tf.constant(value) for name, value in batch.items()})
        if progress is not None:
            progress(done, batches.total)
    report.calibration_batches = done
    if non_finite:
        report.warnings.append(
            f"calibration data holds {non_finite.describe()}: the float8 input scales of the batches that hold them"
            " are NaN or lost (a NaN amax leaves scale 1); remove those rows"
        )
        logger.warning(report.warnings[-1])


def _scales(new_variables: dict[str, NewVariable]) -> dict:
    """The scale variables' values (computing a kernel's quantization if it was not yet)."""
    return {name: spec.value for name, spec in new_variables.items() if name.endswith("_scale")}



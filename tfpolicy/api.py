"""The Python API: ``tfpolicy.rewrite`` and ``tfpolicy.explain``.

    SavedModel dir --load--> graphs + variables --index--> layer paths
        --plan--> per-layer policy --passes--> retyped graphs --save--> new dir
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Optional, Sequence, Union

import tensorflow as tf
from tensorflow.core.framework import types_pb2

from tfpolicy import layer_index, savedmodel_io, tf_names
from tfpolicy.errors import StrictModeError, UnsupportedPolicyError
from tfpolicy.passes import PassResult, run_passes
from tfpolicy.passes.float_precision import FloatPrecisionPass, choose_variable_dtypes
from tfpolicy.plan import plan as make_plan
from tfpolicy.policy_map import PolicyMap, PolicyMapSource
from tfpolicy.report import Report, SignatureReport

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]


def explain(
    input_dir: PathLike,
    policy_map: PolicyMapSource,
    *,
    signatures: Optional[Sequence[str]] = None,
    strict: bool = False,
) -> Report:
    """Everything :func:`rewrite` would do, without writing anything."""
    report, _ = _run(pathlib.Path(input_dir), None, policy_map, signatures, strict, allow_quantized=True)
    return report


def rewrite(
    input_dir: PathLike,
    output_dir: PathLike,
    policy_map: PolicyMapSource,
    *,
    signatures: Optional[Sequence[str]] = None,
    overwrite: bool = False,
    strict: bool = False,
) -> Report:
    """Write a copy of the SavedModel at ``input_dir`` with ``policy_map`` applied.

    ``policy_map`` is a JSON file path, a dict in either accepted form, a
    ``keras.dtype_policies.DTypePolicyMap`` or a :class:`PolicyMap`. Raises a
    :class:`~tfpolicy.errors.TfPolicyError` for every user error, before anything
    is written. The input directory is never modified.
    """
    input_path, output_path = pathlib.Path(input_dir), pathlib.Path(output_dir)
    savedmodel_io.check_input_dir(input_path)
    savedmodel_io.check_output_dir(input_path, output_path, overwrite)
    report, state = _run(input_path, output_path, policy_map, signatures, strict, allow_quantized=False)
    model, variable_dtypes = state
    logger.info("rebuilding %d signature(s)", len(model.signatures))
    root, functions = _assemble(model, variable_dtypes)
    logger.info("saving to %s", output_path)
    savedmodel_io.save_atomically(root, functions, output_path, overwrite)
    report.output_bytes = _directory_bytes(output_path)
    logger.debug("wrote %s", output_path)
    return report


def _run(input_path, output_path, policy_map, signatures, strict, allow_quantized):
    """Load, index, plan and run the passes; returns the report and what saving needs."""
    policy = PolicyMap.load(policy_map)
    logger.info("loading %s", input_path)
    model = savedmodel_io.load(input_path, signatures)
    logger.info("indexing layers of %d signature(s)", len(model.signatures))
    index = layer_index.build(model)
    outside = sum(1 for _ in index.nodes_of(None))
    the_plan = make_plan(policy, index, outside)
    warnings = [f"policy map key '{key}' matches no layer" for key in the_plan.unused_keys]
    if strict and warnings:
        raise StrictModeError(warnings[0] + " (--strict)")
    for message in warnings:
        logger.warning(message)
    if not allow_quantized and the_plan.quantized:
        layers = ", ".join(p.path or "(default)" for p in the_plan.quantized)
        raise UnsupportedPolicyError(
            f"quantized policy {the_plan.quantized[0].policy!r} (layers: {layers}) is not supported yet;"
            " only float policies (float32, bfloat16, float16, mixed_bfloat16, mixed_float16) can be applied"
        )
    variable_dtypes = choose_variable_dtypes(the_plan, index)
    signature_reports, retyped, declined = [], {}, {}
    for program in model.signatures.values():
        logger.info("rewriting signature %s (%d ops, %d functions)", program.key, len(program.graph.nodes), len(program.functions))
        sig_report = SignatureReport(program.key)
        changed_functions: set[str] = set()
        passes = []
        for graph in program.all_graphs():
            float_pass = FloatPrecisionPass(program.key, graph, index, the_plan, variable_dtypes)
            passes.append((f"float_precision[{program.key}:{graph.name}]", _PassAdapter(float_pass, graph, changed_functions, program)))
        run_passes(passes)
        for _, result_holder in passes:
            stats = result_holder.stats  # type: ignore[attr-defined]
            sig_report.casts_inserted += stats.casts_inserted
            sig_report.casts_reused += stats.casts_reused
            sig_report.casts_folded += stats.casts_folded
            sig_report.ops_retyped += sum(stats.retyped.values())
            for layer, n in stats.retyped.items():
                retyped[layer] = retyped.get(layer, 0) + n
            for layer, reasons in stats.declined.items():
                bucket = declined.setdefault(layer, {})
                for reason, n in reasons.items():
                    bucket[reason] = bucket.get(reason, 0) + n
        sig_report.functions_rewritten = len(changed_functions)
        signature_reports.append(sig_report)
    converted = [
        {
            "name": index.variables[uid].name,
            "layer": index.variables[uid].layer_path,
            "from": tf_names.dtype_name(index.variables[uid].dtype),
            "to": tf_names.dtype_name(dtype),
        }
        for uid, dtype in sorted(variable_dtypes.items(), key=lambda kv: index.variables[kv[0]].name)
    ]
    report = Report(
        input_dir=str(input_path),
        output_dir=str(output_path) if output_path else None,
        plan=the_plan,
        signatures=signature_reports,
        retyped_by_layer=retyped,
        declined_by_layer=declined,
        variables_converted=converted,
        warnings=warnings,
        input_bytes=_directory_bytes(input_path),
    )
    return report, (model, variable_dtypes)


class _PassAdapter:
    """Adapts a FloatPrecisionPass to the pass manager's callable contract."""

    def __init__(self, float_pass: FloatPrecisionPass, graph, changed: set[str], program) -> None:
        self.float_pass, self.graph, self.changed, self.program = float_pass, graph, changed, program
        self.stats = float_pass.stats

    def __call__(self) -> PassResult:
        stats = self.float_pass.run()
        if stats.modified and self.graph.is_function:
            self.changed.add(self.graph.name)
        return PassResult(stats.modified)


def _assemble(model, variable_dtypes: dict[int, int]):
    """A fresh root tracking the rewritten signatures, their variables and resources."""
    from tensorflow.python.trackable import autotrackable  # noqa: PLC0415

    new_variables: dict[int, tf.Variable] = {}
    kept: dict[int, tf.Variable] = {}
    functions = {}
    for program in model.signatures.values():
        handles = {}
        for placeholder, capture in program.captures.items():
            variable = capture.variable
            if variable is not None and id(variable) in variable_dtypes:
                if id(variable) not in new_variables:
                    dtype = tf.dtypes.as_dtype(variable_dtypes[id(variable)])
                    new_variables[id(variable)] = tf.Variable(
                        tf.cast(variable, dtype), name=variable.name.split(":")[0], trainable=variable.trainable
                    )
                handles[placeholder] = new_variables[id(variable)].handle
                _retype_capture_placeholder(program, placeholder, variable_dtypes[id(variable)])
            else:
                if variable is not None:
                    kept[id(variable)] = variable
                handles[placeholder] = capture.handle
        graph_def = savedmodel_io.build_graph_def(program)
        functions[program.key] = savedmodel_io.rebuild_function(program, graph_def, handles)
    root = autotrackable.AutoTrackable()
    root.tfpolicy_variables = list(kept.values()) + list(new_variables.values())
    root.tfpolicy_resources = savedmodel_io.tracked_resources(model.root)
    for key, function in functions.items():
        setattr(root, _attribute_name(key), function)
    return root, functions


def _retype_capture_placeholder(program, placeholder: str, dtype: int) -> None:
    node = program.graph.nodes.get(placeholder)
    if node is None:
        return
    handle_dtypes = node.attrs.get("_handle_dtypes")
    if handle_dtypes is not None:
        handle_dtypes.list.type[:] = [dtype if t == types_pb2.DT_FLOAT else t for t in handle_dtypes.list.type]


def _attribute_name(key: str) -> str:
    safe = "".join(c if c.isalnum() or c == "_" else "_" for c in key)
    return f"signature_{safe}"


def _directory_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

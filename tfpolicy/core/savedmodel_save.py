"""The serde boundary, saving side: tfpolicy IR -> functions -> a SavedModel directory.

Each rewritten signature is rebuilt as a concrete function
(:func:`rebuild_function`: the graph back to a GraphDef with its library,
capture placeholders bound to the loaded or new variables), and the root is
written with ``tf.saved_model.save`` into a temporary directory beside the
output, its TF1 saver added as nodes (:mod:`tfpolicy.core.tf1_saver`), then
renamed into place (:func:`save_atomically`). Loading is
:mod:`tfpolicy.core.savedmodel_io`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shutil
import tempfile
from typing import Callable, Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2

from tfpolicy.core import checkpoints, staging, tf1_saver, tf_internals, tf_names
from tfpolicy.core.graph import Graph
from tfpolicy.core.savedmodel_io import SignatureProgram
from tfpolicy.core.tf_names import TensorRef
from tfpolicy.errors import OutputError, cause_line

logger = logging.getLogger(__name__)

# Function attributes a rewritten FunctionDef keeps: what the loader accepts,
# less the implementation-selector keys (the runtime could otherwise replace a
# rewritten body with a float32 alternative, e.g. tf-keras's cuDNN LSTM).
_KEPT_FUNCTION_ATTRS = frozenset(
    {"_noinline", "_disable_acd", "_implements", "time_major", "go_backwards", "_input_shapes"}
)

# Top-level node attributes not carried into the rebuilt function, as
# lift_to_graph drops them: colocation groups name nodes that inlining renamed
# or pruning removed, and the placer colocates resource users on its own.
_DROPPED_NODE_ATTRS = ("_class", "_tpu_replicate")


def graph_to_function_def(graph: Graph, original: function_pb2.FunctionDef, new_name: str) -> function_pb2.FunctionDef:
    """Inverse of :func:`tfpolicy.core.savedmodel_io.function_def_to_graph`, keeping the original signature."""
    fdef = function_pb2.FunctionDef()
    fdef.CopyFrom(original)
    fdef.signature.name = new_name
    for key in list(fdef.attr):
        if key not in _KEPT_FUNCTION_ATTRS:
            del fdef.attr[key]  # grappler's marks; api_implements would let the runtime swap bodies
    del fdef.node_def[:]
    for index, dtype in graph.arg_handle_dtypes.items():
        handle_dtypes = fdef.arg_attr[index].attr.get("_handle_dtypes")
        if handle_dtypes is not None:
            handle_dtypes.list.type[:] = [dtype]
    body = [n for n in graph.nodes.values() if n.op != "_Arg"]
    layout = {n.name: graph.output_slots(n) for n in body}
    arg_names = frozenset(n.name for n in graph.nodes.values() if n.op == "_Arg")
    for node in body:
        nd = fdef.node_def.add()
        nd.name, nd.op, nd.device = node.name, node.op, node.device
        nd.input.extend(tf_names.flat_to_function_input(t, layout, arg_names) for t in node.inputs)
        for k, v in node.attrs.items():
            nd.attr[k].CopyFrom(v)
    for key, ref in graph.outputs.items():
        fdef.ret[key] = tf_names.flat_to_function_input(str(ref), layout, arg_names)
    _extend_signature(graph, fdef)
    return fdef


def _extend_signature(graph: Graph, fdef: function_pb2.FunctionDef) -> None:
    """Arguments and results a pass added to the function (a value passed down a call) join its signature."""
    known = {arg.name for arg in fdef.signature.input_arg}
    args = sorted((n for n in graph.nodes.values() if n.op == "_Arg"), key=lambda n: n.attrs["index"].i)
    for node in args:
        if node.name not in known:
            fdef.signature.input_arg.add(name=node.name, type=node.attrs["T"].type)
    shapes = fdef.attr.get("_input_shapes")
    if shapes is not None:
        while len(shapes.list.shape) < len(args):
            shapes.list.shape.add()  # a scalar: a resource handle or a running maximum
    known = {arg.name for arg in fdef.signature.output_arg}
    for key, ref in graph.outputs.items():
        if key not in known:
            fdef.signature.output_arg.add(name=key, type=graph.tensor_dtype(ref))


# ---------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------


def _function_name(name: str, fdef: function_pb2.FunctionDef) -> str:
    """``name`` plus a digest of the body: equal bodies share a name, others never do."""
    digest = hashlib.sha256(fdef.SerializeToString(deterministic=True)).hexdigest()[:10]
    return f"{name}_tfpolicy_{digest}"


def build_graph_def(program: SignatureProgram, keep: Optional[set[str]] = None) -> graph_pb2.GraphDef:
    """The signature's GraphDef with its library (only the nodes in ``keep``, if given).

    Every library function gets a new name derived from its content: grappler
    may have changed even the functions no pass touched, and the runtime still
    holds the loaded model's functions under the original names.
    """
    fdefs = {
        name: graph_to_function_def(graph, program.function_defs[name], name)
        for name, graph in program.functions.items()
    }
    renames = {name: _function_name(name, fdef) for name, fdef in fdefs.items()}
    graph_def = graph_pb2.GraphDef()
    for name, fdef in fdefs.items():
        fdef.signature.name = renames[name]
        _rename_function_refs(fdef.node_def, renames)
        graph_def.library.function.append(fdef)
    for node in program.graph.nodes.values():
        if keep is not None and node.name not in keep:
            continue
        nd = graph_def.node.add()
        nd.name, nd.op, nd.device = node.name, node.op, node.device
        nd.input.extend(node.inputs)
        for k, v in node.attrs.items():
            if not k.startswith(_DROPPED_NODE_ATTRS):
                nd.attr[k].CopyFrom(v)
    _rename_function_refs(graph_def.node, renames)
    return graph_def


def _rename_function_refs(node_defs, renames: dict[str, str]) -> None:
    if not renames:
        return
    for nd in node_defs:
        if nd.op in renames:
            nd.op = renames[nd.op]
        for value in nd.attr.values():
            if value.HasField("func") and value.func.name in renames:
                value.func.name = renames[value.func.name]
            for func in value.list.func:
                if func.name in renames:
                    func.name = renames[func.name]


_FUNCTIONAL_CONTROL_FLOW = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase"})
LOWER_USING_SWITCH_MERGE = "_lower_using_switch_merge"


def _keep_functional_control_flow(graph_def) -> None:
    """Mark While/If/Case to stay functional ops, as XLA compiles them.

    TensorFlow lowers them to TF1's Switch/Merge/Enter/Exit when a graph runs
    (the TF1 session loader's path), unless the op says not to; XLA has no
    kernel for those, so a signature marked ``_XlaMustCompile`` with a
    decoding loop inside would stop running under TF Serving.
    """
    for node in [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]:
        if node.op in _FUNCTIONAL_CONTROL_FLOW:
            node.attr[LOWER_USING_SWITCH_MERGE].b = False


def rebuild_function(
    program: SignatureProgram,
    handles: dict[str, object],
    outputs: Optional[dict[str, TensorRef]] = None,
    xla_compile: bool = False,
    extra_inputs: Sequence[str] = (),
    positional: bool = False,
):
    """A ConcreteFunction from the edited graph, capture placeholders mapped to ``handles``.

    By default it returns the signature's outputs, structured as the original's;
    ``outputs`` asks for other tensors of the same graph instead, as a dict.
    The graph is pruned to what those outputs need (so a serving function
    never runs the calibration's assignments), imported into a FuncGraph, and
    the surviving capture placeholders are bound to ``handles``; this is
    ``function_from_graph_def`` without its op-by-op copy. ``xla_compile``
    marks it for XLA compilation (``_XlaMustCompile``), which TF Serving honours.
    ``positional`` makes a function called with the signature's input
    tensors in order, then ``extra_inputs`` (more placeholders' tensor names).
    """
    graph = program.graph
    wanted = graph.outputs if outputs is None else outputs
    fed = [*program.input_tensors, *extra_inputs]
    keep = graph.ancestors([ref.node for ref in wanted.values()] + [name.split(":")[0] for name in fed])
    graph_def = build_graph_def(program, keep)
    if xla_compile:
        _keep_functional_control_flow(graph_def)
    fn_graph = tf_internals.new_func_graph(f"tfpolicy_{program.key}", graph_def)
    feed_tensors = [fn_graph.get_tensor_by_name(name) for name in fed]
    fn_graph.inputs.extend(feed_tensors)
    for placeholder, handle in handles.items():
        if placeholder in keep:
            fn_graph.add_capture(handle, fn_graph.get_tensor_by_name(f"{placeholder}:0"))
    fetched = {key: fn_graph.get_tensor_by_name(f"{ref.node}:{ref.index}") for key, ref in wanted.items()}
    original = program.function
    if outputs is None:
        # Inlining and retyping lose static dimensions shape inference cannot
        # recover (a Reshape to a computed shape); the signature keeps the original's.
        for tensor, want in zip(fetched.values(), original.outputs):
            if tensor.shape.is_compatible_with(want.shape):
                tensor.set_shape(want.shape)
        fn_graph.structured_outputs = tf.nest.pack_sequence_as(
            original.graph.structured_outputs, list(fetched.values())  # graph.outputs is in flatten order
        )
    else:
        fn_graph.structured_outputs = fetched
    fn_graph.outputs.extend(tf.nest.flatten(fn_graph.structured_outputs, expand_composites=True))
    if not positional:
        fn_graph.structured_input_signature = original.structured_input_signature
    return tf_internals.concrete_function(fn_graph, feed_tensors, xla_compile, positional)


def save_atomically(
    root: object,
    signatures: dict[str, object],
    output_dir: pathlib.Path,
    overwrite: bool,
    check: Optional[Callable[[pathlib.Path], None]] = None,
    fill: Optional[checkpoints.ValueWriter] = None,
) -> None:
    """Save into a staging directory beside ``output_dir`` and rename it into place (:mod:`staging`).

    ``fill``, when given, writes the values of variables that had none (see
    :mod:`tfpolicy.core.checkpoints`): it starts before the save and finishes
    after it. ``check(staged_dir)`` runs on the finished copy before the
    rename. If anything raises, or the process is interrupted, nothing is left
    behind; a disk that refuses the write (full, read-only) is an
    :class:`OutputError`.
    """
    parent = output_dir.resolve().parent
    tmp = None
    try:
        tmp = staging.make(parent, "tmp", output_dir.name)
        if fill is not None:
            fill.start(tmp)
        # Serving never differentiates: custom gradients (Keras's SiLU, keras_hub's
        # ops) would be traced with captures of the original graph, which fail.
        # The TF1 saver is added after, as nodes (tf1_saver): tracing it is half the save.
        options = tf.saved_model.SaveOptions(experimental_custom_gradients=False, experimental_skip_saver=True)
        tf.saved_model.save(root, str(tmp), signatures=signatures, options=options)
        if fill is not None:
            fill.finish(tmp)
        if not tf1_saver.add_saver(tmp, root):
            _save_graph_with_tf_saver(root, signatures, tmp)
        if check is not None:
            check(tmp)
        staging.publish(tmp, output_dir, overwrite)
    except FileExistsError as exc:
        raise OutputError(f"output '{output_dir}' already exists; pass --overwrite to replace it") from exc
    except (OSError, tf.errors.OpError) as exc:
        staging.raise_if_write_failure(exc, output_dir)
        raise
    finally:
        with staging.interrupts_held():  # an interrupt arriving now acts once the clean-up is done
            if fill is not None:
                fill.cancel()
            staging.discard_mine(parent, "tmp", output_dir.name)  # tmp too, even if an interrupt beat its assignment


def _save_graph_with_tf_saver(root: object, signatures: dict[str, object], saved_model_dir: pathlib.Path) -> None:
    """Replace ``saved_model.pb`` with one whose saver TensorFlow traced (when :mod:`tf1_saver` cannot match names).

    The root is saved again beside it, and only the graph is kept: the object
    graph and so the checkpoint keys are the same, and the values are already in place.
    """
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="tf-saver-", dir=saved_model_dir))
    try:
        options = tf.saved_model.SaveOptions(experimental_custom_gradients=False)
        tf.saved_model.save(root, str(scratch), signatures=signatures, options=options)
        os.replace(scratch / tf1_saver.SAVED_MODEL_PB, saved_model_dir / tf1_saver.SAVED_MODEL_PB)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tf_internals.write_fingerprint(saved_model_dir)

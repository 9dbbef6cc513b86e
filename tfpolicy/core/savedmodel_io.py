"""The serde boundary: SavedModel directory <-> tfpolicy IR.

Only this module touches TensorFlow's SavedModel machinery and GraphDef /
FunctionDef protobufs.

Loading, per signature:

    serving_default graph:  x -> StatefulPartitionedCall(x, var handles...) -> y
      --grappler function inlining (control flow kept functional)-->
    flat Graph:  x -> ... ReadVariableOp(capture placeholder) ... -> y
                 + one Graph per remaining library function (While/If bodies)

Saving rebuilds each signature as a function (:func:`rebuild_function`),
maps capture placeholders to the loaded (or newly created) variables, tracks
them and every resource and asset the functions capture under a fresh root,
and writes with ``tf.saved_model.save`` into a temporary directory beside the
output, which is then renamed into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pathlib
import shutil
import tempfile
from typing import Callable, Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2

from tfpolicy.core import tf_internals, tf_names
from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.tf_names import TensorRef
from tfpolicy.errors import OutputError, SavedModelError, cause_line

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


@dataclasses.dataclass
class Capture:
    """A captured input of a signature: a variable or another resource."""

    placeholder: str
    handle: object  # the eager tensor captured by the loaded function
    variable: Optional[tf.Variable]


@dataclasses.dataclass
class SignatureProgram:
    """One signature, inlined into editable graphs."""

    key: str
    function: object  # the loaded ConcreteFunction
    graph: Graph
    functions: dict[str, Graph]
    function_defs: dict[str, function_pb2.FunctionDef]
    input_tensors: list[str]
    captures: dict[str, Capture]

    def all_graphs(self) -> list[Graph]:
        return [self.graph, *self.functions.values()]


@dataclasses.dataclass
class LoadedModel:
    path: pathlib.Path
    root: object
    signatures: dict[str, SignatureProgram]
    variables: list[tf.Variable]


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def check_input_dir(path: pathlib.Path) -> None:
    if not path.exists():
        raise SavedModelError(f"input SavedModel '{path}' does not exist")
    if not path.is_dir():
        raise SavedModelError(f"input '{path}' is not a directory")
    if not (path / "saved_model.pb").exists() and not (path / "saved_model.pbtxt").exists():
        raise SavedModelError(
            f"input '{path}' is not a SavedModel: it has no saved_model.pb"
        )


def load(path: pathlib.Path, signatures: Optional[Sequence[str]] = None) -> LoadedModel:
    check_input_dir(path)
    try:
        root = tf.saved_model.load(str(path))
    except Exception as exc:  # TensorFlow raises many types for a broken model
        first = cause_line(str(exc)) if str(exc).strip() else type(exc).__name__
        raise SavedModelError(f"cannot load SavedModel '{path}': {first}") from exc
    available = list(root.signatures.keys())
    if not available:
        raise SavedModelError(f"SavedModel '{path}' has no signatures to rewrite")
    if signatures:
        missing = [key for key in signatures if key not in available]
        if missing:
            raise SavedModelError(
                f"SavedModel '{path}' has no signature {', '.join(repr(m) for m in missing)};"
                f" it has {', '.join(repr(a) for a in sorted(available))}"
            )
        keys = list(signatures)
    else:
        keys = sorted(available)
    variables = _all_variables(root)
    by_handle = {id(v.handle): v for v in variables}
    programs = {key: _load_signature(key, root.signatures[key], by_handle) for key in keys}
    return LoadedModel(path, root, programs, variables)


def _all_variables(root: object) -> list[tf.Variable]:
    seen: dict[int, tf.Variable] = {}
    for obj in _descendants(root):
        if isinstance(obj, tf.Variable):
            seen.setdefault(id(obj), obj)
    return list(seen.values())


def _descendants(root: object) -> list[object]:
    return tf_internals.trackable_descendants(root)


def inline_functions(function: object) -> graph_pb2.GraphDef:
    """The signature graph with every function call inlined by grappler.

    While/If stay functional: lowering them to Switch/Merge would make the
    graph cyclic and is left to the runtime.
    """
    graph = function.graph
    meta_graph = tf.compat.v1.train.export_meta_graph(
        graph_def=graph.as_graph_def(add_shapes=True), graph=graph
    )
    fetches = meta_graph_pb2.CollectionDef()
    for tensor in function.outputs:
        fetches.node_list.value.append(tensor.name)
    meta_graph.collection_def["train_op"].CopyFrom(fetches)
    config = config_pb2.ConfigProto()
    config.experimental.use_tfrt = True  # keeps grappler from lowering control flow
    rewrite = config.graph_options.rewrite_options
    rewrite.optimizers.append("function")
    rewrite.min_graph_nodes = -1
    rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    return tf_internals.run_grappler(config, meta_graph)


def _load_signature(key: str, function: object, by_handle: dict[int, tf.Variable]) -> SignatureProgram:
    graph_def = inline_functions(function)
    library = tf_names.library_signatures(graph_def.library)
    graph = Graph(key, library=library)
    for node_def in graph_def.node:
        graph.nodes[node_def.name] = Node(
            node_def.name,
            node_def.op,
            list(node_def.input),
            {k: _copy_attr(v) for k, v in node_def.attr.items() if k != "_output_shapes"},
            node_def.device,
        )
    for name, tensor in zip(_output_keys(function), function.outputs):
        graph.outputs[name] = tf_names.parse_input(tensor.name)[0]
    captures = {}
    for external, internal in function.graph.captures:
        placeholder = internal.name.split(":")[0]
        captures[placeholder] = Capture(placeholder, external, by_handle.get(id(external)))
    capture_names = set(captures)
    inputs = [t.name for t in function.inputs if t.name.split(":")[0] not in capture_names]
    functions = {fdef.signature.name: function_def_to_graph(fdef, library) for fdef in graph_def.library.function}
    fdefs = {fdef.signature.name: fdef for fdef in graph_def.library.function}
    _specialize_call_sites(graph, functions, fdefs, library)
    return SignatureProgram(key, function, graph, functions, fdefs, inputs, captures)


def _specialize_call_sites(
    graph: Graph, functions: dict[str, Graph], fdefs: dict[str, function_pb2.FunctionDef], library: dict
) -> None:
    """Give each call of a shared function with a matmul or convolution its own copy.

    TensorFlow traces a ``tf.function`` once per input signature, so Keras's
    ``_conv_xla`` (an XLA-compiled depthwise convolution) is one function
    called by every layer of the same shape, each with its own kernel. A copy
    per call site lets each be attributed to its caller's layer and rewritten
    for that layer's policy::

        layer_a/PartitionedCall(f=_conv_xla_12), layer_b/PartitionedCall(f=_conv_xla_12)
        -> layer_a/PartitionedCall(f=_conv_xla_12), layer_b/PartitionedCall(f=_conv_xla_12_site1)
    """
    calls: dict[str, list[Node]] = {}
    for node in graph.nodes.values():
        value = node.attrs.get("f")
        if node.op in ("PartitionedCall", "StatefulPartitionedCall") and value is not None:
            calls.setdefault(value.func.name, []).append(node)
    for name, callers in calls.items():
        body = fdefs.get(name)
        if body is None or len(callers) < 2 or not any(nd.op in tf_names.CONTRACTION_OPS for nd in body.node_def):
            continue
        for site, caller in enumerate(sorted(callers, key=lambda n: n.name)[1:], start=1):
            clone_name = f"{name}_site{site}"
            clone = function_pb2.FunctionDef()
            clone.CopyFrom(body)
            clone.signature.name = clone_name
            fdefs[clone_name] = clone
            library[clone_name] = library[name]
            functions[clone_name] = function_def_to_graph(clone, library)
            caller.attrs["f"] = _copy_attr(caller.attrs["f"])
            caller.attrs["f"].func.name = clone_name


def _output_keys(function: object) -> list[str]:
    structure = function.structured_outputs
    flat_keys = tf_internals.flatten_with_joined_string_paths(structure)
    return [path or f"output_{i}" for i, (path, _) in enumerate(flat_keys)]


def _copy_attr(value):
    copy = type(value)()
    copy.CopyFrom(value)
    return copy


def function_def_to_graph(fdef: function_pb2.FunctionDef, library) -> Graph:
    """FunctionDef -> Graph: arguments become ``_Arg`` nodes, inputs go flat."""
    graph = Graph(fdef.signature.name, library=library, is_function=True)
    for index, arg in enumerate(fdef.signature.input_arg):
        attrs = {"T": tf.compat.v1.AttrValue(type=arg.type), "index": tf.compat.v1.AttrValue(i=index)}
        graph.nodes[arg.name] = Node(arg.name, "_Arg", [], attrs)
    layout = {
        nd.name: tf_names.output_slots(nd.op, nd.attr, library) for nd in fdef.node_def
    }
    arg_names = frozenset(arg.name for arg in fdef.signature.input_arg)
    for nd in fdef.node_def:
        inputs = [tf_names.function_input_to_flat(t, layout, arg_names) for t in nd.input]
        graph.nodes[nd.name] = Node(nd.name, nd.op, inputs, {k: _copy_attr(v) for k, v in nd.attr.items() if k != "_output_shapes"}, nd.device)
    for out in fdef.signature.output_arg:
        text = tf_names.function_input_to_flat(fdef.ret[out.name], layout, arg_names)
        graph.outputs[out.name] = tf_names.parse_input(text)[0]
    return graph


def graph_to_function_def(graph: Graph, original: function_pb2.FunctionDef, new_name: str) -> function_pb2.FunctionDef:
    """Inverse of :func:`function_def_to_graph`, keeping the original signature."""
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
    return fdef


# ---------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------


def check_output_dir(input_dir: pathlib.Path, output_dir: pathlib.Path, overwrite: bool) -> None:
    src = input_dir.resolve()
    dst = output_dir.resolve()
    if dst == src:
        raise OutputError(f"output '{output_dir}' is the input SavedModel; choose another directory")
    if src in dst.parents:
        raise OutputError(f"output '{output_dir}' lies inside the input SavedModel '{input_dir}'")
    if dst in src.parents:
        raise OutputError(f"output '{output_dir}' contains the input SavedModel '{input_dir}'")
    if output_dir.exists() and not overwrite:
        raise OutputError(f"output '{output_dir}' already exists; pass --overwrite to replace it")
    if not dst.parent.exists():
        raise OutputError(f"output's parent directory '{dst.parent}' does not exist")


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


def rebuild_function(
    program: SignatureProgram,
    handles: dict[str, object],
    outputs: Optional[dict[str, TensorRef]] = None,
):
    """A ConcreteFunction from the edited graph, capture placeholders mapped to ``handles``.

    By default it returns the signature's outputs, structured as the original's;
    ``outputs`` asks for other tensors of the same graph instead, as a dict.
    The graph is pruned to what those outputs need (so a serving function
    never runs the calibration's assignments), imported into a FuncGraph, and
    the surviving capture placeholders are bound to ``handles``; this is
    ``function_from_graph_def`` without its op-by-op copy.
    """
    graph = program.graph
    wanted = graph.outputs if outputs is None else outputs
    feeds = [name.split(":")[0] for name in program.input_tensors]
    keep = graph.ancestors([ref.node for ref in wanted.values()] + feeds)
    graph_def = build_graph_def(program, keep)
    fn_graph = tf_internals.new_func_graph(f"tfpolicy_{program.key}", graph_def)
    feed_tensors = [fn_graph.get_tensor_by_name(name) for name in program.input_tensors]
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
    fn_graph.structured_input_signature = original.structured_input_signature
    return tf_internals.concrete_function(fn_graph, feed_tensors)


def save_atomically(
    root: object,
    signatures: dict[str, object],
    output_dir: pathlib.Path,
    overwrite: bool,
    check: Optional[Callable[[pathlib.Path], None]] = None,
) -> None:
    """Save into a temporary directory beside ``output_dir`` and rename it into place.

    ``check(staged_dir)``, when given, runs on the saved copy before the rename;
    if it raises, nothing is left behind.
    """
    parent = output_dir.resolve().parent
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tfpolicy-tmp-", dir=parent))
    try:
        # Serving never differentiates: custom gradients (Keras's SiLU, keras_hub's
        # ops) would be traced with captures of the original graph, which fail.
        options = tf.saved_model.SaveOptions(experimental_custom_gradients=False)
        tf.saved_model.save(root, str(tmp), signatures=signatures, options=options)
        if check is not None:
            check(tmp)
        if output_dir.exists():
            if not overwrite:
                raise OutputError(f"output '{output_dir}' already exists; pass --overwrite to replace it")
            trash = pathlib.Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tfpolicy-old-", dir=parent))
            os.rename(output_dir, trash / "old")
            os.rename(tmp, output_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def tracked_resources(root: object) -> list[object]:
    """Non-variable resources and assets reachable from ``root`` (tables, files)."""
    kept = []
    for obj in _descendants(root):
        if tf_internals.is_resource_or_asset(obj) and not isinstance(obj, tf.Variable):
            kept.append(obj)
    return kept

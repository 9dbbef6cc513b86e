"""The serde boundary: SavedModel directory <-> tfpolicy IR.

Only this module and :mod:`tfpolicy.core.savedmodel_save` touch TensorFlow's
SavedModel machinery and GraphDef / FunctionDef protobufs.

Loading, per signature:

    serving_default graph:  x -> StatefulPartitionedCall(x, var handles...) -> y
      --grappler function inlining (control flow kept functional)-->
    flat Graph:  x -> ... ReadVariableOp(capture placeholder) ... -> y
                 + one Graph per remaining library function (While/If bodies)

Saving is :mod:`tfpolicy.core.savedmodel_save`.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2, saved_model_pb2

from tfpolicy.core import checkpoints, paths, tf_internals, tf_names
from tfpolicy.core.graph import Graph, Node
from tfpolicy.errors import SavedModelError, cause_line

logger = logging.getLogger(__name__)


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

    def copy(self) -> "SignatureProgram":
        """A copy to edit apart from this one: graphs copied; the loaded function, FunctionDefs (read
        only) and captures shared."""
        return dataclasses.replace(
            self, graph=self.graph.copy(self.graph.name),
            functions={name: graph.copy(graph.name) for name, graph in self.functions.items()},
            function_defs=dict(self.function_defs), input_tensors=list(self.input_tensors), captures=dict(self.captures))

    def add_function_copy(self, function: str, name: str) -> Graph:
        """A new library function ``name`` with ``function``'s body and signature, to edit apart from it."""
        fdef = function_pb2.FunctionDef()
        fdef.CopyFrom(self.function_defs[function])
        fdef.signature.name = name
        self.function_defs[name] = fdef
        self.functions[name] = self.functions[function].copy(name)
        return self.functions[name]


@dataclasses.dataclass
class LoadedModel:
    """A loaded SavedModel; with ``checkpoint`` set, its variables hold no values (see :func:`load`)."""

    path: pathlib.Path
    root: object
    signatures: dict[str, SignatureProgram]
    variables: list[tf.Variable]
    checkpoint: Optional[checkpoints.SavedModelCheckpoint] = None
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    """Signature key -> the key in ``signatures`` that computes the same (rewritten once, saved under both)."""
    derived: Optional[dict] = None
    """Where set (a dict), values derived from the variables (quantized kernels) are kept here once made
    and shared by every :meth:`copy`: several rewrites of one load quantize each kernel once. Unset
    (the default), a rewrite holds no value longer than it needs it."""

    def copy(self) -> "LoadedModel":
        """The same model with signature programs to edit apart from this one's (one load, several
        rewrites); variables and :attr:`derived` shared."""
        return dataclasses.replace(self, signatures={k: p.copy() for k, p in self.signatures.items()},
                                   aliases=dict(self.aliases))

    def read(self, variable: tf.Variable) -> tf.Tensor:
        """``variable``'s value: from the checkpoint, when the variables were not restored."""
        if self.checkpoint is not None and self.checkpoint.has(variable):
            return self.checkpoint.read(variable)
        return variable.read_value()


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def read_meta_graph(path: pathlib.Path, tag: str = "serve") -> Optional[meta_graph_pb2.MetaGraphDef]:
    """The MetaGraphDef of ``path``'s ``saved_model.pb`` tagged ``tag`` (graph, library, signatures), or None."""
    saved_model = saved_model_pb2.SavedModel()
    try:
        saved_model.ParseFromString((pathlib.Path(path) / "saved_model.pb").read_bytes())
    except (OSError, ValueError):
        return None
    return next((m for m in saved_model.meta_graphs if tag in m.meta_info_def.tags), None)


def load(path: pathlib.Path, signatures: Optional[Sequence[str]] = None, *, streamed: bool = False) -> LoadedModel:
    """The SavedModel at ``path``, its signatures inlined into editable graphs.

    ``streamed`` loads it without restoring the checkpoint: the variables
    take no memory, and :meth:`LoadedModel.read` reads one from disk when it
    is needed. A checkpoint whose keys the loaded objects do not all account
    for is restored as usual.
    """
    paths.check_input_dir(path)
    root = _load_root(path, streamed)
    if not checkpoints.has_checkpoint(path):
        count = len(_all_variables(root))
        if count:
            raise SavedModelError(
                f"SavedModel '{path}' has {count} variable(s) but no checkpoint: variables/variables.index is"
                " missing; copy the whole SavedModel directory, its variables/ folder included"
            )
    checkpoint = None
    if streamed and checkpoints.has_checkpoint(path):
        try:
            checkpoint = checkpoints.SavedModelCheckpoint(path, root)
        except Exception as exc:  # noqa: BLE001 - the usual restore then names what is wrong
            logger.debug("cannot read %s's checkpoint by object (%s); restoring it", path, exc)
        if checkpoint is None or checkpoint.unmatched:
            logger.debug("restoring %s as a whole: checkpoint keys without an object", path)
            root, checkpoint = _load_root(path, streamed=False), None
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
    programs: dict[str, SignatureProgram] = {}
    aliases: dict[str, str] = {}
    first_of: dict[bytes, str] = {}  # what a signature computes -> the first key that does
    for key in sorted(keys, key=lambda k: (k != DEFAULT_SIGNATURE, k)):
        function = root.signatures[key]
        graph_def = inline_functions(function)
        computes = _computation(graph_def, function)
        if computes in first_of:
            aliases[key] = first_of[computes]
            continue
        first_of[computes] = key
        programs[key] = _load_signature(key, function, by_handle, graph_def)
    return LoadedModel(path, root, dict(sorted(programs.items())), variables, checkpoint, aliases)


DEFAULT_SIGNATURE = "serving_default"


def _computation(graph_def: graph_pb2.GraphDef, function: object) -> bytes:
    """What a signature computes: its inlined graph, inputs, outputs and captured handles.

    Keras exports ``serve`` and ``serving_default`` as two wrappers of one
    function; their inlined graphs differ only in the ``_user_specified_name``
    of the capture placeholders.
    """
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(graph_def)
    for node in copy.node:
        node.attr.pop("_user_specified_name", None)
    parts = [
        copy.SerializeToString(deterministic=True),
        repr([t.name for t in function.inputs]).encode(),
        repr([(k, t.name) for k, t in zip(_output_keys(function), function.outputs)]).encode(),
        repr([(id(external), internal.name) for external, internal in function.graph.captures]).encode(),
        repr(function.structured_input_signature).encode(),
    ]
    return b"\0".join(parts)


def _load_root(path: pathlib.Path, streamed: bool) -> object:
    options = tf.saved_model.LoadOptions(experimental_skip_checkpoint=streamed)
    unreadable_fingerprint = _DroppedRecords("Fingerprint was found, but there was an error")
    absl_logger = logging.getLogger("absl")  # TensorFlow's loader logs it with absl, traceback and all
    absl_logger.addFilter(unreadable_fingerprint)
    try:
        return tf.saved_model.load(str(path), options=options)
    except Exception as exc:  # TensorFlow raises many types for a broken model
        first = cause_line(str(exc)) if str(exc).strip() else type(exc).__name__
        raise SavedModelError(f"cannot load SavedModel '{path}': {_asset_problem(path) or first}") from exc
    finally:
        absl_logger.removeFilter(unreadable_fingerprint)
        if unreadable_fingerprint.dropped:
            logger.warning("%s is unreadable; ignored (the output gets its own)", path / "fingerprint.pb")


class _DroppedRecords:
    """A logging filter that drops (and counts) records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.dropped = prefix, 0

    def filter(self, record) -> bool:  # logging.Filter protocol
        if str(record.msg).startswith(self.prefix):
            self.dropped += 1
            return False
        return True


def _asset_problem(path: pathlib.Path) -> Optional[str]:
    """The first asset file (a vocabulary) the SavedModel lists that is missing or empty, as a reason."""
    meta = read_meta_graph(path)
    for asset in meta.asset_file_def if meta is not None else ():
        file = path / "assets" / asset.filename
        if not file.is_file():
            return f"its asset file '{file}' is missing; copy the whole SavedModel directory, assets/ included"
        if file.stat().st_size == 0:
            return f"its asset file '{file}' is empty; restore it from the original export"
    return None


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


def _load_signature(
    key: str, function: object, by_handle: dict[int, tf.Variable], graph_def: graph_pb2.GraphDef
) -> SignatureProgram:
    library = tf_names.library_signatures(graph_def.library)
    graph = Graph(key, library=library)
    for node_def in graph_def.node:
        graph.nodes[node_def.name] = Node(
            node_def.name,
            node_def.op,
            list(node_def.input),
            {k: tf_names.copy_attr(v) for k, v in node_def.attr.items() if k != "_output_shapes"},
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
            caller.attrs["f"] = tf_names.renamed_func_attr(caller.attrs["f"], clone_name)


def _output_keys(function: object) -> list[str]:
    structure = function.structured_outputs
    flat_keys = tf_internals.flatten_with_joined_string_paths(structure)
    return [path or f"output_{i}" for i, (path, _) in enumerate(flat_keys)]


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
        graph.nodes[nd.name] = Node(nd.name, nd.op, inputs, {k: tf_names.copy_attr(v) for k, v in nd.attr.items() if k != "_output_shapes"}, nd.device)
    for out in fdef.signature.output_arg:
        text = tf_names.function_input_to_flat(fdef.ret[out.name], layout, arg_names)
        graph.outputs[out.name] = tf_names.parse_input(text)[0]
    return graph


def tracked_resources(root: object) -> list[object]:
    """Non-variable resources and assets reachable from ``root`` (tables, files)."""
    kept = []
    for obj in _descendants(root):
        if tf_internals.is_resource_or_asset(obj) and not isinstance(obj, tf.Variable):
            kept.append(obj)
    return kept

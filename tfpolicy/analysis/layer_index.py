"""Attribute every op and variable of a SavedModel to a layer path.

Keras layer paths (``dense_1``, ``mha/query``, ``seq/dense``) are what a policy
map is keyed on, but the graph carries uniquified name scopes instead::

    variable  dense_1/kernel:0                      -> layer dense_1
    op        StatefulPartitionedCall/mlp_1/dense_1_2/MatMul
                                     ^^^^^ ^^^^^^^^^  model scope, layer scope

Attribution follows the data first: an op that reads a variable (through a
captured resource, Identity chains and function arguments) belongs to the
variable's layer, and the scope it sits in is learnt as that layer's scope.
Other ops take the layer of the longest learnt scope that contains them; ops in
a While/If body take the layer of the op that calls the body; the last resort
is plain scope normalisation (:func:`normalize_scope`). Ops outside every layer
get ``None`` and so the map's default policy, as in Keras; except the ops a
Functional model runs between its layers (``x + 3.0`` on a layer's output: in
the model's own scope for Keras 3, in a ``tf.``-named TFOpLambda scope for
tf-keras), which Keras does not autocast: they compute in their inputs' dtype,
and :meth:`LayerIndex.between_layers` says which they are.

Keras sets ``layer.path`` when a layer builds, and the layers Keras marks
built at construction (Activation, Dropout, Softmax, Reshape, pooling: see
:func:`pathless_layer_names`) never get one, so no map key reaches them in
Keras. Their ops, found by a scope with the class's default name, take the
enclosing layer's policy or the default, and the scope is recorded in
:attr:`LayerIndex.pathless_scopes` so that a key naming it can be explained.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
from typing import Iterable, Optional

import tensorflow as tf

from tfpolicy.core import keras_internals, tf_names
from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.savedmodel_io import LoadedModel, SignatureProgram
from tfpolicy.core.tf_names import TensorRef

logger = logging.getLogger(__name__)

NORMALIZATION_VARIABLES = frozenset({"gamma", "beta", "moving_mean", "moving_variance"})
CALL_WRAPPER = re.compile(r"(Stateful)?PartitionedCall(_\d+)?")
_UNIQUIFIED = re.compile(r"(.*)_\d+")
CONTROL_FLOW_ARG_OFFSET = {"If": 1, "StatelessIf": 1, "Case": 1, "StatelessCase": 1}
FUNCTION_ATTRS = ("body", "cond", "then_branch", "else_branch", "f", "branches")


@dataclasses.dataclass(frozen=True)
class VariableInfo:
    name: str  # TF name without ":0"
    layer_path: str
    dtype: int
    shape: tuple[Optional[int], ...]
    uid: int  # id() of the loaded tf.Variable


@dataclasses.dataclass
class LayerInfo:
    path: str
    variables: list[VariableInfo] = dataclasses.field(default_factory=list)
    op_count: int = 0

    @property
    def is_normalization(self) -> bool:
        """LayerNormalization / BatchNormalization: Keras computes these in float32."""
        leaves = {v.name.rsplit("/", 1)[-1] for v in self.variables}
        leaves = {_strip_uniquifier(leaf) for leaf in leaves}
        return bool(leaves) and leaves <= NORMALIZATION_VARIABLES


def _strip_uniquifier(component: str) -> str:
    match = _UNIQUIFIED.fullmatch(component)
    return match.group(1) if match else component


def component_matches(component: str, name: str) -> bool:
    """Whether a scope component is ``name`` or ``name`` uniquified (``name_3``)."""
    return component == name or (
        component.startswith(name + "_") and component[len(name) + 1 :].isdigit()
    )


def find_layer_scope(op_name: str, layer_path: str) -> Optional[tuple[int, int]]:
    """Rightmost window of ``op_name``'s scope components that spells ``layer_path``.

    ``find_layer_scope("m_1/dense_1_2/Cast/ReadVariableOp", "dense_1") == (1, 2)``
    """
    components = op_name.split("/")[:-1]
    wanted = layer_path.split("/")
    for end in range(len(components), len(wanted) - 1, -1):
        start = end - len(wanted)
        if all(component_matches(c, w) for c, w in zip(components[start:end], wanted)):
            return start, end
    return None


def normalize_scope(
    op_name: str,
    model_prefixes: Iterable[tuple[str, ...]] = (),
    known_paths: frozenset[str] = frozenset(),
) -> Optional[str]:
    """Fallback: the layer path an op's scope suggests, or None.

    Drops the op's own name, call wrappers added by inlining and a known model
    scope, strips a trailing ``_N`` from each remaining component, then answers
    the longest known layer path (or ancestor of one) that prefixes the result,
    else its first component: ``lstm/zeros/packed`` -> ``lstm``. Stripping
    ``_N`` is ambiguous for layers whose own name ends in ``_N``; learnt scopes
    are consulted before this and win.
    """
    components = _scope_components(op_name)
    if not components or components[0] == "Func":  # inlining's argument plumbing
        return None
    for prefix in sorted(model_prefixes, key=len, reverse=True):
        if prefix and tuple(components[: len(prefix)]) == prefix:
            components = components[len(prefix) :]
            break
    if not components:
        return None
    normalized = [_strip_uniquifier(c) for c in components]
    for end in range(len(normalized), 0, -1):
        candidate = "/".join(normalized[:end])
        if candidate in known_paths:
            return candidate
    return normalized[0]


def _scope_components(op_name: str) -> list[str]:
    """The name scopes of ``op_name``, without the call wrappers inlining put in front."""
    components = op_name.split("/")[:-1]
    while components and CALL_WRAPPER.fullmatch(components[0]):
        components = components[1:]
    return components


def _with_ancestors(paths: Iterable[str]) -> frozenset[str]:
    found = set()
    for path in paths:
        parts = path.split("/")
        found.update("/".join(parts[:end]) for end in range(1, len(parts) + 1))
    return frozenset(found)


class LayerIndex:
    """Layer path of every op (per signature and graph) and every variable."""

    def __init__(self) -> None:
        self.layers: dict[str, LayerInfo] = {}
        self.variables: dict[int, VariableInfo] = {}
        self._node_layer: dict[tuple[str, str, str], Optional[str]] = {}
        self._resources: dict[tuple[str, str], dict[str, int]] = {}
        self.shared_names: dict[str, int] = {}  # TF variable name -> how many distinct variables bear it
        # Scopes of layers that have no path in Keras -> their op count.
        self.pathless_scopes: collections.Counter[str] = collections.Counter()
        self._between_layers: set[tuple[str, str, str]] = set()

    def layer_of(self, signature: str, graph: Graph, node: Node) -> Optional[str]:
        return self._node_layer.get((signature, graph.name, node.name))

    def between_layers(self, signature: str, graph: Graph, node: Node) -> bool:
        """Whether ``node`` is an op a Functional model runs between its layers (no autocast)."""
        return (signature, graph.name, node.name) in self._between_layers

    def variable_read_by(self, signature: str, graph: Graph, node: Node) -> Optional[VariableInfo]:
        """The variable a ReadVariableOp-like node reads, when it can be traced."""
        table = self._resources.get((signature, graph.name), {})
        for _, ref in node.data_inputs():
            uid = table.get(str(ref))
            if uid is not None:
                return self.variables[uid]
        return None

    def variable_of(self, signature: str, graph: Graph, ref: TensorRef) -> Optional[int]:
        """The uid of the variable whose resource ``ref`` carries, if traced."""
        return self._resources.get((signature, graph.name), {}).get(str(ref))

    def nodes_of(self, path: Optional[str]) -> list[tuple[str, str, str]]:
        return [key for key, value in self._node_layer.items() if value == path]

    @property
    def paths(self) -> list[str]:
        return sorted(self.layers)


def build(model: LoadedModel) -> LayerIndex:
    index = LayerIndex()
    named: dict[int, VariableInfo] = {}  # uid -> the variable as its TF name places it
    for program in model.signatures.values():
        for capture in program.captures.values():
            variable = capture.variable
            if variable is not None and id(variable) not in named:
                named[id(variable)] = _variable_info(variable)
    for program in model.signatures.values():
        _trace_signature_resources(index, program)
    placed = _paths_from_call_scopes(index, model, named)
    for uid, info in named.items():
        path = placed.get(uid, info.layer_path)
        if path != info.layer_path:
            info = dataclasses.replace(info, layer_path=path, name=f"{path}/{info.name.rsplit('/', 1)[-1]}")
        info = _unique_name(index, info)
        index.variables[info.uid] = info
        index.layers.setdefault(info.layer_path, LayerInfo(info.layer_path)).variables.append(info)
    known = _with_ancestors(index.layers)
    for program in model.signatures.values():
        _index_signature(index, program, known)
    for (_, _, _), path in index._node_layer.items():
        if path is not None:
            index.layers.setdefault(path, LayerInfo(path)).op_count += 1
    return index


def _trace_signature_resources(index: LayerIndex, program: SignatureProgram) -> None:
    """Which variable each resource tensor carries, in the signature's graph and every function it calls."""
    seeds = {name: id(c.variable) for name, c in program.captures.items() if c.variable is not None}
    queue: collections.deque[tuple[Graph, dict[str, int]]] = collections.deque([(program.graph, seeds)])
    while queue:
        graph, seeds = queue.popleft()
        if (program.key, graph.name) in index._resources:
            continue
        resources = _trace_resources(graph, seeds)
        index._resources[(program.key, graph.name)] = resources
        for node in graph.nodes.values():
            for callee, offset in _callees(node):
                if callee not in program.functions:
                    continue
                args = [n.name for n in program.functions[callee].nodes.values() if n.op == "_Arg"]
                callee_seeds = {}
                for position, ref in node.data_inputs():
                    uid = resources.get(str(ref))
                    if uid is not None and 0 <= position - offset < len(args):
                        callee_seeds[args[position - offset]] = uid
                queue.append((program.functions[callee], callee_seeds))


_READ_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd"})


@dataclasses.dataclass(frozen=True)
class _Read:
    """Where a variable is read: the scope of the layer call around the read, split at its TF name's window."""

    uid: int
    above: tuple[str, ...]  # scopes before the window (model scope, and any enclosing layers)
    below: tuple[str, ...]  # scopes after it (sublayers)
    above_are_calls: bool  # every scope above is uniquified, as Keras 3's layer calls are


def _paths_from_call_scopes(index: LayerIndex, model: LoadedModel, named: dict[int, VariableInfo]) -> dict[int, str]:
    """Layer paths that the call scopes around each variable's reads give, where they differ from the TF name's.

    A Keras 3 layer's path is the stack of layer scopes it was first opened in
    (``transformer_decoder_layer_0/cross_attention/key_projector``), which is
    also the stack of name scopes its call runs in, while its variables' TF
    names may hold only an enclosing layer (keras_hub's T5 names eleven kernels
    ``transformer_decoder_layer_0/kernel``). So each read of a variable in a
    graph whose layer scopes are uniquified (``name_1``, as Keras 3's traces
    are) is placed by its call scope: the TF name's window, the sublayers
    below it and the enclosing layers above it up to the model's own scope (the
    scope most reads sit under), each without its uniquifier. Only uniquified
    scopes count as layer calls, and not an op's own scope
    (:func:`_is_op_scope`): ``conv1d_1/convolution/ReadVariableOp`` is read by
    ``tf.nn.convolution`` inside layer ``conv1d``. The path most of a
    variable's reads agree on wins. Where scopes are not uniquified (tf-keras,
    whose TF names are the layer paths) or a read's scope does not hold the TF
    name (a While body traced apart), the TF name stands.
    """
    reads: list[_Read] = []
    trusted: set[int] = set()  # variables read where scopes are not uniquified: the TF name is the path
    for program in model.signatures.values():
        for graph in [program.graph, *program.functions.values()]:
            resources = index._resources.get((program.key, graph.name))
            if not resources:
                continue
            computing: Optional[set[str]] = None
            for node in graph.nodes.values():
                if node.op not in _READ_OPS:
                    continue
                uid = next((resources[str(ref)] for _, ref in node.data_inputs() if str(ref) in resources), None)
                if uid is None:
                    continue
                computing = _computing_scopes(graph) if computing is None else computing
                read = _read_of(graph, node, uid, named[uid].layer_path, computing)
                if read is None:
                    trusted.add(uid)
                else:
                    reads.append(read)
    if not reads:
        return {}
    model_scope = collections.Counter(read.above for read in reads).most_common(1)[0][0]
    votes: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for read in reads:
        if read.uid in trusted or read.above[: len(model_scope)] != model_scope:
            continue
        enclosing = read.above[len(model_scope):] if read.above_are_calls else ()
        path = [*enclosing, named[read.uid].layer_path, *read.below]
        votes[read.uid]["/".join(path)] += 1
    return {uid: counter.most_common(1)[0][0] for uid, counter in votes.items()}


def _is_op_scope(graph: Graph, scope: str, computing: set[str]) -> bool:
    """Whether ``scope`` is an op's own name scope rather than a layer's.

    ``tf.cast(variable)`` and ``tf.shape(variable)`` read the variable in a
    scope named after their op (``Cast/ReadVariableOp``; the op itself is
    ``Cast``, or no op at all when the cast is a no-op); a layer's scope holds
    the layer's computation, not only reads. ``computing``: the scopes of the
    graph that hold an op other than a read.
    """
    return scope in graph.nodes or scope not in computing


def _computing_scopes(graph: Graph) -> set[str]:
    found: set[str] = set()
    for name, node in graph.nodes.items():
        if node.op in _READ_OPS:
            continue
        parts = name.split("/")[:-1]
        found.update("/".join(parts[:end]) for end in range(1, len(parts) + 1))
    return found


def _read_of(graph: Graph, node: Node, uid: int, tf_path: str, computing: set[str]) -> Optional[_Read]:
    """The read's call scope around the TF name's window, or None where the TF name stands (see above)."""
    window = find_layer_scope(node.name, tf_path)
    if window is None:
        return None
    start, end = window
    components = node.name.split("/")[:-1]
    if all(c == w for c, w in zip(components[start:end], tf_path.split("/"))):
        return None  # scopes are not uniquified here
    below = []
    for depth in range(end, len(components)):  # sublayers: uniquified call scopes, up to an op's own scope
        if not _UNIQUIFIED.fullmatch(components[depth]) or _is_op_scope(graph, "/".join(components[: depth + 1]), computing):
            break
        below.append(_strip_uniquifier(components[depth]))
    enclosing = [c for c in components[:start] if not CALL_WRAPPER.fullmatch(c)]
    above = tuple(_strip_uniquifier(c) for c in enclosing)
    return _Read(uid, above, tuple(below), all(_UNIQUIFIED.fullmatch(c) for c in enclosing))


def _unique_name(index: "LayerIndex", info: VariableInfo) -> VariableInfo:
    """``info`` with a name no other variable has: ``net/kernel`` again becomes ``net/kernel_1``.

    TensorFlow lets distinct variables share a name (a Keras 3 subclassed model
    built by its first call names every kernel ``net/kernel``; eager
    ``tf.Module``s too). They stay distinct variables here, each with its own
    int8 scale or float8 variables; their layer path cannot be told apart, which
    :attr:`LayerIndex.shared_names` records for the report.
    """
    taken = {v.name for v in index.variables.values()}
    if info.name not in taken:
        return info
    index.shared_names[info.name] = index.shared_names.get(info.name, 1) + 1
    suffix = 1
    while f"{info.name}_{suffix}" in taken:
        suffix += 1
    return dataclasses.replace(info, name=f"{info.name}_{suffix}")


def _variable_info(variable: tf.Variable) -> VariableInfo:
    name = variable.name[:-2] if variable.name.endswith(":0") else variable.name
    layer_path = name.rsplit("/", 1)[0] if "/" in name else name
    shape = tuple(variable.shape.as_list()) if variable.shape.rank is not None else ()
    return VariableInfo(name, layer_path, variable.dtype.as_datatype_enum, shape, id(variable))


def _index_signature(index: LayerIndex, program: SignatureProgram, known: frozenset[str]) -> None:
    """Attribute the signature's ops to layers; what each resource carries is already traced
    (:func:`_trace_signature_resources`)."""
    key = program.key
    # Graphs in caller-before-callee order: (graph, the caller's layer, the caller's node name).
    queue: collections.deque[tuple[Graph, Optional[str], str]] = collections.deque()
    queue.append((program.graph, None, ""))
    visited: set[str] = set()
    learned: dict[str, str] = {}
    model_prefixes: set[tuple[str, ...]] = set()
    while queue:
        graph, caller_layer, caller = queue.popleft()
        if graph.name in visited:
            continue
        visited.add(graph.name)
        order = graph.topological_order()
        local: dict[str, str] = {}
        for node in order:
            # A call or While/If passes the handle on (its callee reads it): it is no read of that layer.
            info = index.variable_read_by(key, graph, node) if node.op != "_Arg" and not _callees(node) else None
            if info is None:
                continue
            index._node_layer[(key, graph.name, node.name)] = info.layer_path
            window = find_layer_scope(node.name, info.layer_path)
            if window is not None:
                components = node.name.split("/")
                local["/".join(components[: window[1]])] = info.layer_path
                model_prefixes.add(tuple(c for c in components[: window[0]] if not CALL_WRAPPER.fullmatch(c)))
        learned.update(local)
        scopes = sorted({**learned, **local}.items(), key=lambda kv: len(kv[0]), reverse=True)
        for node in order:
            slot = (key, graph.name, node.name)
            if slot not in index._node_layer:
                layer = _layer_for(node, scopes, caller_layer, caller, model_prefixes, known, graph)
                if layer is not None and layer not in known and _TRAILING_NUMBERS.sub("", layer) in pathless_layer_names():
                    index.pathless_scopes[layer] += 1
                    layer = None
                elif (layer is None and _in_model_scope(_owning_op_name(graph, node.name, model_prefixes), model_prefixes)) or (
                    layer is not None and layer not in known and layer.startswith(TF_OP_LAYER_PREFIX)
                ):
                    index._between_layers.add(slot)
                    layer = None
                index._node_layer[slot] = layer
            layer = index._node_layer[slot]
            queue.extend((program.functions[callee], layer, node.name)
                         for callee, _ in _callees(node) if callee in program.functions)


# tf-keras wraps a TensorFlow op called on Keras tensors in a TFOpLambda layer
# named after the op (``tf.math.multiply``, ``tf.__operators__.add``), which
# does not autocast: the op runs between layers, as in a Keras 3 Functional model.
TF_OP_LAYER_PREFIX = "tf."
_TRAILING_NUMBERS = re.compile(r"(_\d+)+$")


def pathless_layer_names() -> frozenset[str]:
    """Default names (``dropout``, ``activation``) of the Keras layers that never get a path (see keras_internals)."""
    return keras_internals.layers_built_at_init()


def _layer_for(node: Node, scopes, caller_layer, caller: str, model_prefixes, known, graph: Graph) -> Optional[str]:
    if node.op in ("Placeholder", "_Arg"):
        return caller_layer if graph.is_function else None
    for scope, path in scopes:
        if node.name.startswith(scope + "/"):
            return path
    if caller_layer is not None or (caller and node.name.startswith(caller + "/")):
        return caller_layer  # a body traced in its caller's scope (``while/cond/mul`` under If ``while/cond``)
    name = _owning_op_name(graph, node.name, model_prefixes)
    if name != node.name and not _scope_components(name):
        return None  # the helper of an op at the top of the graph (``while/maximum_iterations``)
    return normalize_scope(name, model_prefixes, known)


def _owning_op_name(graph: Graph, op_name: str, model_prefixes=frozenset()) -> str:
    """The op whose own name scope ``op_name`` sits in, else ``op_name``.

    A TensorFlow op's Python wrapper makes its helpers in a scope named as the
    op (``strided_slice/stack`` beside ``strided_slice``, ``zeros/Const`` beside
    ``zeros``, ``while/maximum_iterations`` beside ``while``), or names its
    scope after the op in CamelCase with no op of that name (``tf.nn.gelu``'s
    ``Gelu_1/mul``, not a model's scope): they belong where the op is, and
    their scope is no layer.
    """
    components = op_name.split("/")[:-1]
    owner = op_name
    while components and ("/".join(components) in graph.nodes or _TENSOR_ARRAY_SCOPE.fullmatch(components[-1])
                          or (_OP_WRAPPER_SCOPE.fullmatch(components[-1])
                              and tuple(c for c in components if not CALL_WRAPPER.fullmatch(c)) not in model_prefixes)):
        owner = "/".join(components)
        components = components[:-1]
    return owner


# tf.TensorArray's methods scope their ops without an op of that name (``TensorArrayV2Stack/TensorListStack``).
_TENSOR_ARRAY_SCOPE = re.compile(r"TensorArrayV2[A-Za-z]*(_\d+)?")
# TensorFlow's Python wrappers name their scope after the op in CamelCase, uniquified on reuse
# (``tf.nn.gelu`` -> ``Gelu``, ``Gelu_1``); Keras's layer names are snake_case.
_OP_WRAPPER_SCOPE = re.compile(r"[A-Z][a-z0-9]+([A-Z][a-z0-9]*)*(_\d+)?")


def _in_model_scope(op_name: str, model_prefixes) -> bool:
    """Whether ``op_name`` sits directly in a model scope that variable paths leave out.

    That is a Functional model's scope (its layers' paths do not name it), so
    the op is one the model runs between layers: ``MobileNetV3Small_1/Add``.
    """
    components = _scope_components(op_name)
    return bool(components) and tuple(components) in model_prefixes


def _callees(node: Node) -> list[tuple[str, int]]:
    """Library functions ``node`` calls, with the offset of their first argument."""
    found = []
    if tf_names.op_def(node.op) is None:
        found.append((node.op, 0))
    offset = CONTROL_FLOW_ARG_OFFSET.get(node.op, 0)
    for attr_name in FUNCTION_ATTRS:
        value = node.attrs.get(attr_name)
        if value is None:
            continue
        if value.HasField("func"):
            found.append((value.func.name, offset))
        found.extend((f.name, offset) for f in value.list.func)
    return found


def _trace_resources(graph: Graph, seeds: dict[str, int]) -> dict[str, int]:
    """Resource tensor -> variable uid, following Identity chains from the seeds."""
    table = {str(TensorRef(name)): uid for name, uid in seeds.items()}
    for node in graph.topological_order():
        if node.op in ("Identity", "IdentityN"):
            for position, ref in node.data_inputs():
                uid = table.get(str(ref))
                if uid is not None:
                    table[str(TensorRef(node.name, position))] = uid
    return table

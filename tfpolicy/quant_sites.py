"""Where int8, int4 and float8 apply: pattern and check, before any rewrite.

A **site** is a matmul-like op of a quantized layer whose kernel operand is a
read of one of that layer's variables, possibly through layout ops::

    x ---------------------------------------------> MatMul   (input operand)
    ReadVariableOp(kernel) -> Cast -> Reshape ------/         (kernel operand)

Each op type has a rule (:data:`RULES`) saying which operand can be the kernel
and which axes of each operand are contracted. The analysis traces the kernel
operand back to its variable through ``Identity``, ``Cast``, ``Reshape``, ``ExpandDims`` and
``Transpose`` and maps the contracted axes into the variable's own frame, so
that an int8 kernel gets one scale per output channel of the variable as
stored. An op that does not fit is **declined** with a reason, shown by
``--explain``.

int4 follows Keras's Dense, EinsumDense and Embedding: the kernel flattened
to ``(contracted, output)`` (the contracted axes must lead, as in those
layers), quantized per output channel or per block of rows with a zero point,
and packed two values to a byte along the output axis.

The result, :class:`QuantPlan`, is frozen: which sites, which variables become
int8 or int4 and which float8 variable groups exist. :mod:`tfpolicy.passes.quantize`
rewrites the graphs from it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Callable, Iterator, Optional

import numpy as np
from tensorflow.core.framework import types_pb2

from tfpolicy import tf_names
from tfpolicy.graph import Graph, Node
from tfpolicy.layer_index import LayerIndex, VariableInfo
from tfpolicy.plan import Plan
from tfpolicy.savedmodel_io import LoadedModel
from tfpolicy.tf_names import TensorRef
from tfpolicy.tf_names import FLOAT_DTYPES, TensorRef

logger = logging.getLogger(__name__)

SUPPORTED_MODES = ("int8", "int4", "float8")
INTEGER_MODES = frozenset({"int8", "int4"})  # kernels stored as integers, replacing the float variable
LAYOUT_OPS = frozenset({"Identity", "Cast", "Reshape", "Transpose", "ExpandDims"})
VARIABLE_READS = frozenset({"ReadVariableOp", "ResourceGather"})
# A called function (not a While/If body) reads the kernel it is passed; its
# reads are retyped to int8 like the signature's own.
CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})


@dataclasses.dataclass(frozen=True)
class Contraction:
    """How an op consumes its kernel and input operands.

    ``kernel_reduced`` are axes of the kernel operand (as the op sees it) that
    one int8 scale spans; ``input_reduced`` those of the input operand that one
    per-token scale spans. Negative axes count from the end.
    """

    kind: str  # "matmul" or "gather"
    kernel_position: int
    input_position: Optional[int]
    kernel_reduced: tuple[int, ...]
    input_reduced: tuple[int, ...]


# -- rules: op type -> candidate contractions ----------------------------------


def _attr_bool(node: Node, name: str) -> bool:
    value = node.attrs.get(name)
    return bool(value.b) if value is not None else False


def _matmul(node: Node) -> list[Contraction]:
    ta, tb = _attr_bool(node, "transpose_a"), _attr_bool(node, "transpose_b")
    a_k, b_k = (0 if ta else 1), (1 if tb else 0)
    return [
        Contraction("matmul", 1, 0, (b_k,), (a_k,)),
        Contraction("matmul", 0, 1, (a_k,), (b_k,)),
    ]


def _batch_matmul(node: Node) -> list[Contraction]:
    ax, ay = _attr_bool(node, "adj_x"), _attr_bool(node, "adj_y")
    x_k, y_k = (-2 if ax else -1), (-1 if ay else -2)
    return [
        Contraction("matmul", 1, 0, (y_k,), (x_k,)),
        Contraction("matmul", 0, 1, (x_k,), (y_k,)),
    ]


_EINSUM_TERM = re.compile(r"[A-Za-z]+")


def _einsum(node: Node) -> list[Contraction]:
    equation = node.attrs["equation"].s.decode().replace(" ", "")
    operands, arrow, output = equation.partition("->")
    terms = operands.split(",")
    if not arrow or len(terms) != 2 or not all(_EINSUM_TERM.fullmatch(t) for t in (*terms, output or "x")):
        return []  # ellipses, implicit output or not binary: not a kernel contraction
    reduced = [tuple(i for i, c in enumerate(t) if c not in output) for t in terms]
    return [
        Contraction("matmul", 1, 0, reduced[1], reduced[0]),
        Contraction("matmul", 0, 1, reduced[0], reduced[1]),
    ]


def _channel_axis(node: Node) -> int:
    data_format = node.attrs["data_format"].s.decode() if "data_format" in node.attrs else "NHWC"
    return data_format.index("C")


def _conv2d(node: Node) -> list[Contraction]:
    return [Contraction("matmul", 1, 0, (0, 1, 2), (_channel_axis(node),))]


def _conv2d_transpose(node: Node) -> list[Contraction]:
    """``Conv2DBackpropInput(input_sizes, filter (h, w, filters, in), x)``: one scale per filter."""
    return [Contraction("matmul", 1, 2, (0, 1, 3), (_channel_axis(node),))]


def _depthwise(node: Node) -> list[Contraction]:
    return [Contraction("matmul", 1, 0, (0, 1), (_channel_axis(node),))]


def _gather(node: Node) -> list[Contraction]:
    batch_dims = node.attrs.get("batch_dims")
    if batch_dims is not None and batch_dims.i != 0:
        return []
    return [Contraction("gather", 0, None, (), ())]  # per row: every axis but 0, set later


RULES: dict[str, Callable[[Node], list[Contraction]]] = {
    "MatMul": _matmul,
    "BatchMatMul": _batch_matmul,
    "BatchMatMulV2": _batch_matmul,
    "BatchMatMulV3": _batch_matmul,
    "Einsum": _einsum,
    "Conv2D": _conv2d,
    "DepthwiseConv2dNative": _depthwise,
    "Conv2DBackpropInput": _conv2d_transpose,
    "GatherV2": _gather,
    "ResourceGather": _gather,
}
assert set(RULES) == tf_names.CONTRACTION_OPS | {"GatherV2", "ResourceGather"}, "a rule per contraction op"
FLOAT8_KINDS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})


# -- plan records ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IntegerMatmul:
    """How an int8 site runs as one integer matmul, int8 x int8 -> int32.

    The input is quantized per token to int8 and multiplied with the int8
    kernel variable itself, as Keras's quantized Dense and EinsumDense do. An
    einsum ``<prefix><contracted>,<contracted><free>-><prefix><free>`` is
    that matmul with the contracted and free axes each flattened into one.
    """

    transpose_kernel: bool  # the kernel is (free, contracted): MatMul's transpose_b, adj_y
    contracted: tuple[int, ...]  # sizes of the kernel's contracted axes
    free: tuple[int, ...]  # sizes of its output axes
    prefix_rank: Optional[int]  # einsum: input axes before the contracted ones; None for a matmul
    # Matmuls: the Transpose/Reshape/ExpandDims steps from the variable to the operand,
    # replayed on the int8 kernel; and the order of the (flattened) channel scales
    # along the operand's columns when it is not the variable's own.
    kernel_layout: tuple[tuple[str, tuple[int, ...]], ...] = ()
    scale_order: Optional[tuple[int, ...]] = None

    @property
    def form(self) -> str:
        return "integer matmul"


@dataclasses.dataclass(frozen=True)
class Site:
    """One op to quantize, in one graph of one signature."""

    signature: str
    graph: str
    node: str
    op: str
    layer: str
    mode: str
    contraction: Contraction
    variable_uid: int
    read_node: str  # the ReadVariableOp (or the ResourceGather itself)
    kernel_reduced_axes: tuple[int, ...]  # in the variable's frame, non-negative
    integer: Optional[IntegerMatmul] = None  # int8 contractions that run on integers
    compute_dtype: int = types_pb2.DT_FLOAT  # the layer's
    simulated: str = ""  # why an int8 contraction is not integer: its kernel is dequantized before it
    # int4 per channel on a Dense matmul: Keras multiplies by the integer kernel and divides after.
    int4_rescaled: bool = False

    @property
    def form(self) -> str:
        """What the output runs at this site, for reports."""
        if self.mode == "int4":
            if self.contraction.kind == "gather":
                return "int4 rows gathered"
            if self.int4_rescaled:
                return "int4 kernel, divided by its scale after the matmul"
            return "int4 kernel dequantized before the contraction"
        if self.contraction.kind == "gather":
            return "int8 rows gathered"
        if self.integer is not None:
            return self.integer.form
        if self.mode == "int8":
            return f"dequantized kernel ({self.simulated})"
        return "float8 quantize-dequantize"


@dataclasses.dataclass(frozen=True)
class Declined:
    layer: str
    mode: str
    node: str
    op: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Int8Kernel:
    """A variable stored as int8 plus a float32 ``<name>_scale`` per output channel."""

    uid: int
    name: str
    layer: str
    reduced_axes: tuple[int, ...]

    @property
    def scale_name(self) -> str:
        return f"{self.name}_scale"


@dataclasses.dataclass(frozen=True)
class Int4Kernel:
    """A variable stored as packed int4 (two values a byte), as Keras stores it.

    The kernel is viewed as ``(rows, columns)``: for a matmul, its contracted
    axes flattened then its output axes; for an embedding table, ``(vocabulary,
    dim)``. Values are packed along ``columns``. Per channel, ``<name>_scale``
    has one float32 per column (matmul) or per row (embedding); with
    ``block_size``, ``<name>_scale`` and the int8 ``<name>_zero`` have one per
    block and column, as Keras's ``abs_max_quantize_grouped_with_zero_point``.
    """

    uid: int
    name: str
    layer: str
    shape: tuple[int, ...]  # the float variable's
    embedding: bool
    block_size: Optional[int]  # None: per channel
    reduced_rank: int = 1  # how many leading axes are contracted (the embedding's: its rows)

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[: self.reduced_rank]))

    @property
    def columns(self) -> int:
        return int(np.prod(self.shape[self.reduced_rank :]))

    @property
    def scale_name(self) -> str:
        return f"{self.name}_scale"

    @property
    def zero_name(self) -> str:
        return f"{self.name}_zero"


@dataclasses.dataclass(frozen=True)
class Float8Group:
    """The four float8 variables one layer (and kernel) owns."""

    layer: str
    kernel_uid: int
    prefix: str  # "<layer path>" or "<layer path>/<kernel leaf>" when a layer has several
    history_length: int

    def name(self, kind: str) -> str:
        return f"{self.prefix}/{kind}"


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    sites: tuple[Site, ...]
    declined: tuple[Declined, ...]
    int8_kernels: dict[int, Int8Kernel]
    float8_groups: dict[tuple[str, int], Float8Group]
    layers_without_sites: tuple[tuple[str, str], ...]  # (layer path, mode)
    int4_kernels: dict[int, Int4Kernel] = dataclasses.field(default_factory=dict)

    @property
    def integer_kernels(self) -> set[int]:
        """uids of the float variables int8 or int4 copies replace."""
        return set(self.int8_kernels) | set(self.int4_kernels)

    def sites_in(self, signature: str, graph: str) -> list[Site]:
        return [s for s in self.sites if s.signature == signature and s.graph == graph]

    @property
    def empty(self) -> bool:
        return not self.sites


# -- analysis ----------------------------------------------------------------------


def analyze(model: LoadedModel, index: LayerIndex, plan: Plan) -> QuantPlan:
    """Find every site of every quantized layer; decide variables; never edits."""
    sites: list[Site] = []
    declined: list[Declined] = []
    for program in model.signatures.values():
        bodies = control_flow_bodies(program.all_graphs())
        for graph in program.all_graphs():
            for node in graph.nodes.values():
                layer = index.layer_of(program.key, graph, node)
                layer_plan = plan.for_layer(layer)
                if layer is None or layer_plan.quantization_mode not in SUPPORTED_MODES or node.op not in RULES:
                    continue
                if node.op in ("GatherV2", "ResourceGather") and not _gathers_floats(node):
                    continue  # a shape or index lookup, not an embedding
                found = _match(program.key, graph, node, layer, layer_plan.quantization_mode, index, bodies)
                if isinstance(found, Site):
                    found = dataclasses.replace(found, compute_dtype=layer_plan.compute_enum,
                                                int4_rescaled=found.int4_rescaled and layer_plan.block_size is None)
                (sites if isinstance(found, Site) else declined).append(found)
    sites, more_declined = _check_variables(model, index, sites)
    declined.extend(more_declined)
    int8 = _int8_kernels(sites, index)
    int4 = _int4_kernels(sites, index, plan)
    groups = _float8_groups(sites, index, plan)
    with_sites = {s.layer for s in sites} | {d.layer for d in declined}
    quantized_layers = sorted(
        (p.path, p.quantization_mode) for p in plan.layers.values()
        if p.path is not None and p.quantization_mode in SUPPORTED_MODES and p.op_count
    )
    without = tuple((path, mode) for path, mode in quantized_layers if path not in with_sites)
    return QuantPlan(tuple(sites), tuple(declined), int8, groups, without, int4)


def _gathers_floats(node: Node) -> bool:
    dtype = node.attrs["Tparams" if node.op == "GatherV2" else "dtype"].type
    return dtype in FLOAT_DTYPES


CONTROL_FLOW_ATTRS = ("body", "cond", "then_branch", "else_branch", "branches")


def control_flow_bodies(graphs: list[Graph]) -> frozenset[str]:
    """Names of the functions that are While/If/Case bodies (not plain calls)."""
    found = set()
    for graph in graphs:
        for node in graph.nodes.values():
            for attr in CONTROL_FLOW_ATTRS:
                value = node.attrs.get(attr)
                if value is not None:
                    found.update([value.func.name] if value.HasField("func") else [f.name for f in value.list.func])
    return frozenset(found)


def _match(signature: str, graph: Graph, node: Node, layer: str, mode: str, index: LayerIndex,
           bodies: frozenset[str] = frozenset()):
    def decline(reason: str) -> Declined:
        return Declined(layer, mode, node.name, node.op, reason)

    if graph.is_function and graph.name in bodies:
        return decline("inside a While/If body, whose signature cannot take new variables")
    if graph.is_function and mode == "float8":
        return decline("float8 inside a called function, whose signature cannot take the calibrated scale variables")
    if graph.is_function and node.op in ("GatherV2", "ResourceGather"):
        return decline("an embedding lookup inside a called function, whose signature cannot take the scale variable")
    if mode == "float8" and node.op not in FLOAT8_KINDS:
        return decline(f"float8 applies to matmul and einsum ops, not {node.op}")
    if mode == "int4" and graph.is_function:
        return decline("int4 inside a called function, whose signature cannot take the packed kernel")
    if mode == "int4" and node.op not in FLOAT8_KINDS | {"GatherV2", "ResourceGather"}:
        return decline(f"Keras quantizes int4 in Dense, EinsumDense and Embedding layers; no int4 {node.op}")
    candidates = RULES[node.op](node)
    if not candidates:
        return decline(f"{node.op} form not supported ({_describe(node)})")
    inputs = dict(node.data_inputs())
    for contraction in candidates:
        operand = inputs.get(contraction.kernel_position)
        if operand is None:
            continue
        if contraction.kind == "gather":
            traced = _trace_gather_table(signature, graph, node, operand, index)
        else:
            if graph.tensor_dtype(operand) not in FLOAT_DTYPES:
                return decline(f"not a float {node.op}")
            traced = _trace_kernel(signature, graph, operand, contraction, index)
        if traced is None:
            continue
        info, read_node, axes = traced
        if info.layer_path != layer:
            return decline(f"its kernel '{info.name}' belongs to layer '{info.layer_path}'")
        if info.dtype != types_pb2.DT_FLOAT:
            return decline(f"kernel '{info.name}' is {tf_names.dtype_name(info.dtype)}, not float32")
        if axes is None:
            return decline(f"the kernel reaches {node.op} through a reshape that mixes contracted and output axes")
        site = Site(signature, graph.name, node.name, node.op, layer, mode, contraction, info.uid, read_node, axes)
        if mode == "int4":
            return _int4_site(graph, node, site, info.shape, decline)
        if mode == "int8" and contraction.kind == "matmul":
            integer = integer_matmul(graph, node, site, info.shape)
            site = dataclasses.replace(site, **(
                {"integer": integer} if isinstance(integer, IntegerMatmul) else {"simulated": integer}))
        return site
    return decline("kernel not a variable (no operand reads one of the layer's variables)")


MATMUL_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})


def _int4_site(graph: Graph, node: Node, site: Site, kernel_shape, decline) -> "Site | Declined":
    """An int4 site, or why Keras's int4 layout cannot hold its kernel."""
    if site.contraction.kind == "gather":
        if len(kernel_shape) != 2:
            return decline(f"an int4 embedding table must be 2-D (vocabulary, dim), not rank {len(kernel_shape)}")
        return site
    axes = site.kernel_reduced_axes
    if not axes or axes != tuple(range(len(axes))) or len(axes) >= len(kernel_shape):
        return decline("int4 packs kernels as (contracted axes, output axes), as Keras's Dense and EinsumDense;"
                       " this kernel's contracted axes do not come first")
    # Dense divides by the scale after its matmul (a MatMul op: tf.matmul of a 2-D input, or
    # Tensordot's); EinsumDense, which Keras's einsum lowers to Einsum or BatchMatMulV2,
    # divides the kernel before. The order decides the last bit.
    rescaled = (
        node.op == "MatMul"
        and len(kernel_shape) == 2
        and site.contraction.kernel_position == 1
        and not _attr_bool(node, "transpose_a")
        and not _attr_bool(node, "transpose_b")
        and _kernel_layout(graph, dict(node.data_inputs())[1], site.read_node) == ()
    )
    return dataclasses.replace(site, int4_rescaled=rescaled)


def integer_matmul(graph: Graph, node: Node, site: Site, kernel_shape) -> "IntegerMatmul | str":
    """The integer form of an int8 contraction, or why it has none."""
    if node.op not in MATMUL_OPS and node.op != "Einsum":
        return f"TensorFlow has no integer {node.op}"
    if site.contraction.kernel_position != 1:
        return "the kernel is the first operand"
    layout = _kernel_layout(graph, dict(node.data_inputs())[1], site.read_node)
    if isinstance(layout, str):
        return layout
    shape = tuple(int(d) for d in kernel_shape)
    if node.op == "Einsum":
        return _integer_einsum(node, shape) if not layout else "the einsum's kernel is reshaped"
    if _attr_bool(node, "transpose_a" if node.op == "MatMul" else "adj_x"):
        return "the input is transposed"
    transposed = _attr_bool(node, "transpose_b" if node.op == "MatMul" else "adj_y")
    # Follow each output channel's scale through the layout ops: ids[k, n] is the
    # channel (in the variable's frame) whose scale column n of the operand needs.
    free_shape = tuple(1 if a in site.kernel_reduced_axes else d for a, d in enumerate(shape))
    ids = np.broadcast_to(np.arange(int(np.prod(free_shape))).reshape(free_shape), shape)
    for op, operand in layout:
        ids = _apply_layout(ids, op, operand)
    if ids.ndim != 2:
        return f"a rank-{ids.ndim} kernel"
    ids = ids.T if transposed else ids
    if not (ids == ids[:1]).all():
        return "its per-channel scales do not follow the output columns"
    order = tuple(int(i) for i in ids[0])
    return IntegerMatmul(
        transposed, (ids.shape[0],), (ids.shape[1],), None, layout,
        None if order == tuple(range(len(order))) else order,
    )


def _kernel_layout(graph: Graph, operand: TensorRef, read_node: str):
    """The layout steps ``(op, operand)`` from the kernel's read to ``operand``, read first."""
    chain, end = _layout_chain(graph, operand)
    if end.name != read_node:
        return f"the kernel reaches it through {end.op}"
    steps = []
    for step in reversed(chain):
        if step.op in ("Transpose", "Reshape", "ExpandDims"):
            value = _const_input(graph, step, 1)
            if value is None:
                return f"the kernel reaches it through a {step.op} of computed shape"
            steps.append((step.op, tuple(int(v) for v in np.asarray(value).reshape(-1))))
    return tuple(steps)


def _apply_layout(array: np.ndarray, op: str, operand: tuple[int, ...]) -> np.ndarray:
    if op == "Transpose":
        return np.transpose(array, operand)
    if op == "Reshape":
        return np.reshape(array, operand)
    return np.expand_dims(array, operand[0])


def _integer_einsum(node: Node, shape: tuple[int, ...]) -> "IntegerMatmul | str":
    equation = node.attrs["equation"].s.decode().replace(" ", "")
    (x_term, k_term), output = equation.split("->")[0].split(","), equation.split("->")[1]
    contracted = "".join(c for c in k_term if c not in output)
    prefix, free = x_term[: len(x_term) - len(contracted)], k_term[len(contracted) :]
    if (
        not contracted
        or len(set(x_term)) != len(x_term)
        or len(set(k_term)) != len(k_term)
        or set(x_term) & set(k_term) != set(contracted)
        or not x_term.endswith(contracted)
        or not k_term.startswith(contracted)
        or output != prefix + free
        or len(shape) != len(k_term)
    ):
        return f"equation {equation!r} is not <batch><contracted>,<contracted><out>-><batch><out>"
    return IntegerMatmul(False, shape[: len(contracted)], shape[len(contracted) :], len(prefix))


def _describe(node: Node) -> str:
    if "equation" in node.attrs:
        return f"equation {node.attrs['equation'].s.decode()!r}"
    return node.op


def _trace_gather_table(signature, graph, node, operand, index):
    if node.op == "GatherV2":
        axis_node = graph.producer(list(dict(node.data_inputs()).values())[2])
        if axis_node.op != "Const" or int(np.asarray(_const_value(axis_node)).reshape(-1)[0]) != 0:
            return None
        read = graph.producer(operand)
        if read.op != "ReadVariableOp":
            return None
        info = index.variable_read_by(signature, graph, read)
        read_name = read.name
    else:  # ResourceGather reads the variable itself
        info = index.variable_read_by(signature, graph, node)
        read_name = node.name
    if info is None or len(info.shape) < 2:
        return None
    return info, read_name, tuple(range(1, len(info.shape)))


def _trace_kernel(signature, graph, operand: TensorRef, contraction: Contraction, index: LayerIndex):
    """Follow layout ops to a variable read; map the reduced axes into its frame.

    Returns ``(variable, read node, axes)`` with ``axes`` None when a reshape
    makes the per-channel scale inexpressible, or None when no variable is found.
    """
    chain, node = _layout_chain(graph, operand)
    if node.op != "ReadVariableOp":
        return None
    info = index.variable_read_by(signature, graph, node)
    if info is None:
        return None
    if any(d is None for d in info.shape):
        return info, node.name, None
    shape = tuple(int(d) for d in info.shape)
    back: list[Callable[[set[int]], Optional[set[int]]]] = []  # each step's axes mapped to its input's
    for step in reversed(chain):  # from the variable towards the op
        if step.op == "Transpose":
            perm = _const_input(graph, step, 1)
            if perm is None:
                return info, node.name, None
            perm = [int(p) for p in np.asarray(perm).reshape(-1)]
            back.append(lambda axes, perm=perm: {perm[a] for a in axes})
            shape = tuple(shape[p] for p in perm)
        elif step.op == "Reshape":
            target = _const_input(graph, step, 1)
            if target is None:
                return info, node.name, None
            target = _resolve_reshape(shape, [int(d) for d in np.asarray(target).reshape(-1)])
            back.append(lambda axes, source=shape, target=target: _reshape_axes_back(source, target, axes))
            shape = target
        elif step.op == "ExpandDims":  # Conv1D's kernel (k, in, out) -> (1, k, in, out)
            axis = _const_input(graph, step, 1)
            if axis is None:
                return info, node.name, None
            axis = int(np.asarray(axis).reshape(-1)[0])
            axis = axis + len(shape) + 1 if axis < 0 else axis
            back.append(lambda axes, axis=axis: {a - (a > axis) for a in axes if a != axis})
            shape = shape[:axis] + (1,) + shape[axis:]
    axes: Optional[set[int]] = {a % len(shape) for a in contraction.kernel_reduced} if shape else set()
    for step_back in reversed(back):
        axes = step_back(axes)
        if axes is None:
            return info, node.name, None
    return info, node.name, tuple(sorted(axes))


def _layout_chain(graph: Graph, operand: TensorRef) -> tuple[list[Node], Node]:
    """The layout ops (:data:`LAYOUT_OPS`) that produce ``operand``, nearest first, and the op before them."""
    chain: list[Node] = []
    node = graph.producer(operand)
    while node.op in LAYOUT_OPS and len(chain) < 16:
        chain.append(node)
        node = graph.producer(next(iter(node.data_inputs()))[1])
    return chain, node


def _const_input(graph: Graph, node: Node, position: int):
    ref = dict(node.data_inputs()).get(position)
    if ref is None:
        return None
    producer = graph.producer(ref)
    return _const_value(producer) if producer.op == "Const" else None


def _const_value(node: Node):
    import tensorflow as tf  # noqa: PLC0415

    return tf.make_ndarray(node.attrs["value"].tensor)


def _resolve_reshape(source: tuple[int, ...], target: list[int]) -> tuple[int, ...]:
    total = int(np.prod(source)) if source else 1
    if -1 in target:
        known = int(np.prod([d for d in target if d != -1])) or 1
        target = [total // known if d == -1 else d for d in target]
    return tuple(target)


def _reshape_groups(source: tuple[int, ...], target: tuple[int, ...]) -> Optional[list[tuple[list[int], list[int]]]]:
    """Pair runs of source and target axes with equal products (row-major order).

    ``(16, 2, 8) -> (16, 16)`` gives ``[([0], [0]), ([1, 2], [1])]``.
    """
    groups, i, j = [], 0, 0
    while i < len(source) or j < len(target):
        src, dst, ps, pt = [], [], 1, 1
        if i < len(source):
            ps, i = source[i], i + 1
            src.append(i - 1)
        if j < len(target):
            pt, j = target[j], j + 1
            dst.append(j - 1)
        while ps != pt:
            if ps < pt and i < len(source):
                ps, i = ps * source[i], i + 1
                src.append(i - 1)
            elif pt < ps and j < len(target):
                pt, j = pt * target[j], j + 1
                dst.append(j - 1)
            else:
                return None
        groups.append((src, dst))
    return groups


def _reshape_axes_back(source, target, axes: set[int]) -> Optional[set[int]]:
    groups = _reshape_groups(tuple(source), tuple(target))
    if groups is None:
        return None
    mapped: set[int] = set()
    for src, dst in groups:
        hit = [a in axes for a in dst]
        if any(hit) and not all(hit):
            return None
        if all(hit) and dst:
            mapped.update(src)
    return mapped


# -- variable decisions ----------------------------------------------------------------


def _variable_uses(model: LoadedModel, index: LayerIndex) -> Iterator[tuple[Graph, Node, int, bool]]:
    """Every (graph, node, uid, in a While/If body) where a node takes a variable's handle."""
    for program in model.signatures.values():
        bodies = control_flow_bodies(program.all_graphs())
        for graph in program.all_graphs():
            for node in graph.nodes.values():
                if node.op in ("Identity", "IdentityN"):
                    continue
                for _, ref in node.data_inputs():
                    uid = index.variable_of(program.key, graph, ref)
                    if uid is not None:
                        yield graph, node, uid, graph.name in bodies


def _check_variables(model: LoadedModel, index: LayerIndex, sites: list[Site]):
    """Decline int8 sites whose kernel cannot become an int8 variable.

    That is when the kernel is also used where no dequantized copy can be read
    (a While/If body, an op other than a read) or is contracted over different
    axes at two sites (one per-channel scale cannot serve both).
    """
    int8_axes: dict[int, set[tuple[int, ...]]] = {}
    int4 = {site.variable_uid for site in sites if site.mode == "int4"}
    for site in sites:
        if site.mode in INTEGER_MODES:
            int8_axes.setdefault(site.variable_uid, set()).add(site.kernel_reduced_axes)
    blocked = {uid: "its kernel is contracted over different axes at another op"
               for uid, axes in int8_axes.items() if len(axes) > 1}
    for graph, node, uid, in_body in _variable_uses(model, index):
        if uid not in int8_axes or uid in blocked:
            continue
        if uid in int4 and (graph.is_function or node.op not in VARIABLE_READS):
            where = f"called function '{graph.name}'" if graph.is_function else f"{node.op} '{node.name}'"
            blocked[uid] = f"its kernel is also used in {where}, which cannot read a packed int4 copy"
        elif in_body or (node.op not in VARIABLE_READS and node.op not in CALL_OPS):
            what = "a While/If body" if in_body else f"{node.op} '{node.name}'"
            blocked[uid] = f"its kernel is also used by {what}, which cannot read an int8 copy"
    kept, declined = [], []
    for site in sites:
        reason = blocked.get(site.variable_uid) if site.mode in INTEGER_MODES else None
        if reason:
            declined.append(Declined(site.layer, site.mode, site.node, site.op, reason))
        else:
            kept.append(site)
    return kept, declined


def _int8_kernels(sites: list[Site], index: LayerIndex) -> dict[int, Int8Kernel]:
    kernels = {}
    for site in sites:
        if site.mode == "int8" and site.variable_uid not in kernels:
            info: VariableInfo = index.variables[site.variable_uid]
            kernels[site.variable_uid] = Int8Kernel(info.uid, info.name, site.layer, site.kernel_reduced_axes)
    return kernels


def _int4_kernels(sites: list[Site], index: LayerIndex, plan: Plan) -> dict[int, Int4Kernel]:
    kernels = {}
    for site in sites:
        if site.mode == "int4" and site.variable_uid not in kernels:
            info: VariableInfo = index.variables[site.variable_uid]
            kernels[site.variable_uid] = Int4Kernel(
                info.uid, info.name, site.layer, tuple(int(d) for d in info.shape), site.contraction.kind == "gather",
                plan.for_layer(site.layer).block_size, 1 if site.contraction.kind == "gather" else len(site.kernel_reduced_axes))
    return kernels


def _float8_groups(sites: list[Site], index: LayerIndex, plan: Plan) -> dict[tuple[str, int], Float8Group]:
    keys = sorted({(s.layer, s.variable_uid) for s in sites if s.mode == "float8"},
                  key=lambda k: (k[0], index.variables[k[1]].name))
    per_layer: dict[str, int] = {}
    for layer, _ in keys:
        per_layer[layer] = per_layer.get(layer, 0) + 1
    groups = {}
    for layer, uid in keys:
        leaf = index.variables[uid].name.rsplit("/", 1)[-1]
        prefix = layer if per_layer[layer] == 1 else f"{layer}/{leaf}"
        length = plan.for_layer(layer).amax_history_length or 1024
        groups[(layer, uid)] = Float8Group(layer, uid, prefix, int(length))
    return groups

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
from typing import Iterator, Optional

import numpy as np

from tfpolicy.analysis.calls import CallChains, call_chains
from tfpolicy.analysis.kernel_trace import apply_layout, kernel_layout, trace_gather_table, trace_kernel
from tfpolicy.analysis.layer_index import LayerIndex, VariableInfo
from tfpolicy.analysis.plan import Plan
from tfpolicy.analysis.quant_records import (
    Declined,
    Float8Group,
    Int4Kernel,
    Int8Kernel,
    IntegerMatmul,
    QuantPlan,
    Site,
)
from tfpolicy.analysis.quant_rules import (
    CALL_OPS,
    CONVOLUTION_OPS,
    FLOAT8_KINDS,
    INTEGER_MODES,
    MATMUL_OPS,
    RULES,
    SUPPORTED_MODES,
    VARIABLE_READS,
    attr_bool,
)
from tfpolicy.core import tf_names
from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.savedmodel_io import LoadedModel
from tfpolicy.core.tf_names import DT_FLOAT, FLOAT_DTYPES, TensorRef

__all__ = [  # the records, for the passes and the report
    "Declined", "Float8Group", "Int4Kernel", "Int8Kernel", "IntegerMatmul", "QuantPlan", "SUPPORTED_MODES", "Site",
    "analyze", "control_flow_bodies",
]

logger = logging.getLogger(__name__)


# -- analysis ----------------------------------------------------------------------


def analyze(model: LoadedModel, index: LayerIndex, plan: Plan, int8_convolutions: bool = False) -> QuantPlan:
    """Find every site of every quantized layer; decide variables; never edits.

    An int8 convolution is declined, as Keras's ``model.quantize`` leaves
    convolutions in their source policy, unless ``int8_convolutions``.
    """
    sites: list[Site] = []
    declined: list[Declined] = []
    for program in model.signatures.values():
        chains = call_chains(program.graph, program.functions.values())
        for graph in program.all_graphs():
            for node in graph.nodes.values():
                layer = index.layer_of(program.key, graph, node)
                layer_plan = plan.for_layer(layer)
                if layer is None or layer_plan.quantization_mode not in SUPPORTED_MODES or node.op not in RULES:
                    continue
                if node.op in ("GatherV2", "ResourceGather") and not _gathers_floats(node):
                    continue  # a shape or index lookup, not an embedding
                found = _match(program.key, graph, node, layer, layer_plan.quantization_mode, index,
                               layer_plan.block_size, int8_convolutions, chains)
                if isinstance(found, Site):
                    found = dataclasses.replace(found, compute_dtype=layer_plan.compute_enum)
                (sites if isinstance(found, Site) else declined).append(found)
    sites, more_declined = _check_variables(model, index, sites)
    declined.extend(more_declined)
    int8 = _int8_kernels(sites, index, plan)
    int4 = _int4_kernels(sites, index, plan)
    groups = _float8_groups(sites, index, plan, _storable_float8_kernels(model, index, sites))
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
           block_size: "int | None" = None, int8_convolutions: bool = False, chains: Optional[CallChains] = None):
    def decline(reason: str) -> Declined:
        return Declined(layer, mode, node.name, node.op, reason)

    lookup = node.op in ("GatherV2", "ResourceGather")
    if graph.is_function and (mode in ("float8", "int4") or lookup):  # its scales are passed in as new arguments
        problem = chains.problem(graph.name) if chains is not None else "no call chain is known"
        if chains is not None and graph.name in chains.conditions and mode == "float8":
            problem = "a While loop's condition returns only its bool, so calibration cannot measure it"
        if problem is not None:
            return decline(f"{mode} inside a called function its scale variables cannot reach: {problem}")
    if mode == "float8" and node.op not in FLOAT8_KINDS:
        return decline(f"float8 applies to matmul and einsum ops, not {node.op}")
    if mode == "int4" and node.op not in FLOAT8_KINDS | {"GatherV2", "ResourceGather"}:
        return decline(f"Keras quantizes int4 in Dense, EinsumDense and Embedding layers; no int4 {node.op}")
    if mode == "int8" and node.op in CONVOLUTION_OPS and not int8_convolutions:
        return decline("Keras has no int8 convolution; int8_convolutions=True (--int8_convolutions)"
                       " stores the kernel in int8")
    candidates = RULES[node.op](node)
    if not candidates:
        return decline(f"{node.op} form not supported ({_describe(node)})")
    inputs = dict(node.data_inputs())
    for contraction in candidates:
        operand = inputs.get(contraction.kernel_position)
        if operand is None:
            continue
        if contraction.kind == "gather":
            traced = trace_gather_table(signature, graph, node, operand, index)
        else:
            if graph.tensor_dtype(operand) not in FLOAT_DTYPES:
                return decline(f"not a float {node.op}")
            traced = trace_kernel(signature, graph, operand, contraction, index)
        if traced is None:
            continue
        info, read_node, axes = traced
        if info.layer_path != layer:
            return decline(f"its kernel '{info.name}' belongs to layer '{info.layer_path}'")
        if info.dtype != DT_FLOAT:
            return decline(f"kernel '{info.name}' is {tf_names.dtype_name(info.dtype)}, not float32")
        if axes is None:
            return decline(f"the kernel reaches {node.op} through a reshape that mixes contracted and output axes")
        site = Site(signature, graph.name, node.name, node.op, layer, mode, contraction, info.uid, read_node, axes)
        if mode == "int4":
            return _int4_site(graph, node, site, info.shape, block_size, decline)
        if mode == "int8" and contraction.kind == "matmul":
            integer = integer_matmul(graph, node, site, info.shape)
            site = dataclasses.replace(site, **(
                {"integer": integer} if isinstance(integer, IntegerMatmul) else {"simulated": integer}))
        return site
    return decline("kernel not a variable (no operand reads one of the layer's variables)")




def _int4_site(graph: Graph, node: Node, site: Site, kernel_shape, block_size, decline) -> "Site | Declined":
    """An int4 site, or why Keras's int4 layout cannot hold its kernel."""
    if site.contraction.kind == "gather":
        if len(kernel_shape) != 2:
            return decline(f"an int4 embedding table must be 2-D (vocabulary, dim), not rank {len(kernel_shape)}")
        return site
    axes = site.kernel_reduced_axes
    if not axes or axes != tuple(range(len(axes))) or len(axes) >= len(kernel_shape):
        return decline("int4 packs kernels as (contracted axes, output axes), as Keras's Dense and EinsumDense;"
                       " this kernel's contracted axes do not come first")
    # Per channel, Dense divides by the scale after its matmul (a MatMul op: tf.matmul of a 2-D input, or
    # Tensordot's); EinsumDense, which Keras's einsum lowers to Einsum or BatchMatMulV2,
    # divides the kernel before. The order decides the last bit.
    rescaled = (
        block_size is None
        and node.op == "MatMul"
        and len(kernel_shape) == 2
        and site.contraction.kernel_position == 1
        and not attr_bool(node, "transpose_a")
        and not attr_bool(node, "transpose_b")
        and kernel_layout(graph, dict(node.data_inputs())[1], site.read_node) == ()
    )
    return dataclasses.replace(site, int4_rescaled=rescaled)


def integer_matmul(graph: Graph, node: Node, site: Site, kernel_shape) -> "IntegerMatmul | str":
    """The integer form of an int8 contraction, or why it has none."""
    if node.op not in MATMUL_OPS and node.op != "Einsum":
        return f"TensorFlow has no integer {node.op}"
    if site.contraction.kernel_position != 1:
        return "the kernel is the first operand"
    layout = kernel_layout(graph, dict(node.data_inputs())[1], site.read_node)
    if isinstance(layout, str):
        return layout
    shape = tuple(int(d) for d in kernel_shape)
    if node.op == "Einsum":
        return _integer_einsum(node, shape) if not layout else "the einsum's kernel is reshaped"
    if attr_bool(node, "transpose_a" if node.op == "MatMul" else "adj_x"):
        return "the input is transposed"
    transposed = attr_bool(node, "transpose_b" if node.op == "MatMul" else "adj_y")
    # Follow each output channel's scale through the layout ops: ids[k, n] is the
    # channel (in the variable's frame) whose scale column n of the operand needs.
    free_shape = tuple(1 if a in site.kernel_reduced_axes else d for a, d in enumerate(shape))
    ids = np.broadcast_to(np.arange(int(np.prod(free_shape))).reshape(free_shape), shape)
    for op, operand in layout:
        ids = apply_layout(ids, op, operand)
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


# -- variable decisions ----------------------------------------------------------------


def variable_uses(model: LoadedModel, index: LayerIndex) -> Iterator[tuple[Graph, Node, int, bool]]:
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


# Ops that hand a variable's handle to a function that reads it (whose reads are retyped like any other).
PASS_HANDLES = CALL_OPS | frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase"})


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
    for graph, node, uid, in_body in variable_uses(model, index):
        if uid not in int8_axes or uid in blocked:
            continue
        if node.op not in VARIABLE_READS and node.op not in PASS_HANDLES:
            what = "a While/If body" if in_body else f"{node.op} '{node.name}'"
            copy = "a packed int4 copy" if uid in int4 else "an int8 copy"
            blocked[uid] = f"its kernel is also used by {what}, which cannot read {copy}"
    kept, declined = [], []
    for site in sites:
        reason = blocked.get(site.variable_uid) if site.mode in INTEGER_MODES else None
        if reason:
            declined.append(Declined(site.layer, site.mode, site.node, site.op, reason))
        else:
            kept.append(site)
    return kept, declined


def _int8_kernels(sites: list[Site], index: LayerIndex, plan: Plan) -> dict[int, Int8Kernel]:
    kernels = {}
    for site in sites:
        if site.mode == "int8" and site.variable_uid not in kernels:
            info: VariableInfo = index.variables[site.variable_uid]
            kernels[site.variable_uid] = Int8Kernel(info.uid, info.name, site.layer, site.kernel_reduced_axes,
                                                    plan.for_layer(site.layer).variable_dtype)
    return kernels


def _int4_kernels(sites: list[Site], index: LayerIndex, plan: Plan) -> dict[int, Int4Kernel]:
    kernels = {}
    gathered = {site.variable_uid for site in sites if site.mode == "int4" and site.contraction.kind == "gather"}
    for site in sites:
        if site.mode == "int4" and site.variable_uid not in kernels:
            info: VariableInfo = index.variables[site.variable_uid]
            kernel = Int4Kernel(
                info.uid, info.name, site.layer, tuple(int(d) for d in info.shape), site.contraction.kind == "gather",
                plan.for_layer(site.layer).block_size, 1 if site.contraction.kind == "gather" else len(site.kernel_reduced_axes),
                plan.for_layer(site.layer).variable_dtype)
            # Gathered rows keep Keras's layout; a kernel unpacked whole unpacks faster from halves of rows.
            row_halves = info.uid not in gathered and kernel.rows % 2 == 0 and kernel.columns % 4 == 0
            kernels[site.variable_uid] = dataclasses.replace(kernel, row_halves=row_halves)
    return kernels


READ_THROUGH = frozenset({"Identity", "Cast", "Transpose", "Reshape", "ExpandDims"})


def _storable_float8_kernels(model: LoadedModel, index: LayerIndex, sites: list[Site]) -> dict[int, int]:
    """float8 kernels read only as the kernel operand of their own float8 sites: uid -> compute dtype.

    Every use of the variable must be a ReadVariableOp whose value reaches
    only such operands, through Identity, Cast and layout ops (which commute
    with an elementwise quantize-dequantize by a scalar), and all its sites
    must compute in one dtype.
    """
    operands = {(s.signature, s.graph, s.node, s.contraction.kernel_position): s for s in sites if s.mode == "float8"}
    dtypes: dict[int, set[int]] = {}
    for site in operands.values():
        dtypes.setdefault(site.variable_uid, set()).add(site.compute_dtype)
    bad = {uid for uid, found in dtypes.items() if len(found) > 1}
    for program in model.signatures.values():
        for graph in program.all_graphs():
            for node in graph.nodes.values():
                for _, ref in node.data_inputs():
                    uid = index.variable_of(program.key, graph, ref)
                    if uid not in dtypes or uid in bad or node.op == "Identity":  # the handle passed on (inlining)
                        continue
                    if node.op != "ReadVariableOp" or not _reaches_only(program.key, graph, node, uid, operands):
                        bad.add(uid)
    return {uid: next(iter(found)) for uid, found in dtypes.items() if uid not in bad}


def _reaches_only(signature: str, graph: Graph, read: Node, uid: int, operands: dict) -> bool:
    """Whether ``read``'s value reaches only float8 kernel operands of variable ``uid``."""
    stack = [TensorRef(read.name)]
    while stack:
        for consumer, position in graph.uses(stack.pop()):
            site = operands.get((signature, graph.name, consumer, position))
            if site is not None and site.variable_uid == uid:
                continue
            if graph.nodes[consumer].op in READ_THROUGH and position == 0:
                stack.append(TensorRef(consumer))
                continue
            return False
    return True


def _float8_groups(sites: list[Site], index: LayerIndex, plan: Plan,
                   storable: Optional[dict[int, int]] = None) -> dict[tuple[str, int], Float8Group]:
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
        groups[(layer, uid)] = Float8Group(layer, uid, prefix, int(length), index.variables[uid].name,
                                           (storable or {}).get(uid))
    return groups

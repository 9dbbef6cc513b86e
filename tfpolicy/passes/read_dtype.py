"""Variables stored in the dtype every read of them is cast to.

A ``mixed_bfloat16`` layer keeps float32 variables (Keras's policy: float32
master weights, for training) and casts each read to bfloat16 at every call.
A served model never trains: where every read of a float32 variable goes,
through layout ops, only into a Cast to one dtype, the variable is stored in
that dtype instead (its value cast once, at rewrite time, by the same
TensorFlow Cast) and the Casts go. The output computes the same bits, holds
half the bytes, and no call casts its kernels again::

    ReadVariableOp:f32 -> [Reshape, GatherV2, ...] -> Cast(bf16) -> op    becomes    ReadVariableOp:bf16 -> [...] -> op
"""

from __future__ import annotations

from tfpolicy.analysis.layer_index import LayerIndex
from tfpolicy.analysis.quant_sites import PASS_HANDLES, variable_uses
from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.savedmodel_io import LoadedModel
from tfpolicy.core.tf_names import DT_BFLOAT16, DT_FLOAT, DT_HALF, TensorRef
from tfpolicy.core.tf_names import type_attr as _type

# Ops a read's value may pass through on its way to the Cast: they move values, never compute on them.
READ_THROUGH = {"Identity": "T", "Transpose": "T", "Reshape": "T", "ExpandDims": "T", "GatherV2": "Tparams"}  # -> dtype attr
READS = frozenset({"ReadVariableOp", "ResourceGather"})
NARROWER = frozenset({DT_BFLOAT16, DT_HALF})


def storable_in_read_dtype(model: LoadedModel, index: LayerIndex, skip: set[int]) -> dict[int, int]:
    """float32 variables (not in ``skip``) whose every read is cast to one 16-bit float dtype: uid -> that dtype.

    Every node that takes the variable's handle (:func:`variable_uses`), in
    every signature and function outside While/If bodies (a variable used in
    one keeps its dtype), must hand it on (a call, a loop) or read it as
    float32 (``ReadVariableOp``, ``ResourceGather``), and every read's value
    must reach only Casts to the dtype, through :data:`READ_THROUGH` ops, and
    no graph output.
    """
    dtypes: dict[int, set[int]] = {}
    bad: set[int] = set(skip)
    for graph, node, uid, in_body in variable_uses(model, index):
        if uid in bad or (node.op in PASS_HANDLES and not in_body):
            continue
        read = node.op in READS and node.attrs["dtype"].type == DT_FLOAT and not in_body
        cast_to = _cast_to(graph, node) if read else None
        if cast_to is None:
            bad.add(uid)
        else:
            dtypes.setdefault(uid, set()).add(cast_to)
    return {uid: found.pop() for uid, found in dtypes.items()
            if uid not in bad and len(found) == 1 and index.variables[uid].dtype == DT_FLOAT}


def _cast_to(graph: Graph, read: Node):
    """The one narrower dtype every use of ``read``'s value is cast to, or None."""
    returned = {str(ref) for ref in graph.outputs.values()}
    found = set()
    stack = [TensorRef(read.name)]
    while stack:
        ref = stack.pop()
        if str(ref) in returned:
            return None
        for consumer, position in graph.uses(ref):
            node = graph.nodes[consumer]
            if node.op in READ_THROUGH and position == 0:
                stack.append(TensorRef(consumer))
            elif node.op == "Cast" and node.attrs["DstT"].type in NARROWER and not _truncates(node):
                found.add(node.attrs["DstT"].type)
            else:
                return None
    return found.pop() if len(found) == 1 else None


def _truncates(cast: Node) -> bool:
    truncate = cast.attrs.get("Truncate")
    return truncate is not None and truncate.b


def read_in(graph: Graph, read: Node, dtype: int) -> None:
    """``read`` (of a variable now stored in ``dtype``) reads ``dtype``: the ops after it carry it, and Casts
    to ``dtype`` after it go; a Cast to another dtype now casts from ``dtype``."""
    read.attrs["dtype"] = _type(dtype)
    stack = [TensorRef(read.name)]
    while stack:
        ref = stack.pop()
        for consumer, position in list(graph.uses(ref)):
            node = graph.nodes.get(consumer)
            if node is None or position != 0 or (node.op not in READ_THROUGH and node.op != "Cast"):
                continue
            if node.op == "Cast":
                node.attrs["SrcT"] = _type(dtype)
                if node.attrs["DstT"].type == dtype:  # now Cast(dtype -> dtype): bypass it
                    graph.replace_all_uses_with(TensorRef(node.name), ref)
                    graph.remove_if_unused(node.name)
                continue
            node.attrs[READ_THROUGH[node.op]] = _type(dtype)
            stack.append(TensorRef(node.name))


def store_in_read_dtype(model: LoadedModel, index: LayerIndex, stored: dict[int, int]) -> None:
    """Every read of each variable of ``stored`` (uid -> dtype) reads that dtype (:func:`read_in`), and called
    functions' resource arguments that carry one say so."""
    for program in model.signatures.values():
        for graph in program.all_graphs():
            for node in list(graph.nodes.values()):
                if node.op in READS:
                    uid = index.variable_of(program.key, graph, dict(node.data_inputs())[0])
                    if uid in stored:
                        read_in(graph, node, stored[uid])
                elif node.op == "_Arg":
                    uid = index.variable_of(program.key, graph, TensorRef(node.name))
                    if uid in stored:
                        graph.arg_handle_dtypes[node.attrs["index"].i] = stored[uid]

"""Which ops the float-precision pass retypes, and the float32 islands it keeps.

Op classes (:data:`FOLLOWER_OPS`, :data:`NEVER_RETYPED`, :data:`FLOAT32_OPS`,
...) and two graph analyses that find where Keras computes in float32 whatever
the policy says:

* :func:`position_math`: float math computed only from integers and constants
  (rotary and position embeddings, masks);
* :func:`scaled_attention_softmax`: the softmax of scaled attention logits
  (``Einsum -> Mul(const) -> [Add mask] -> Softmax``), kept float32 as
  Keras's MultiHeadAttention computes it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from tfpolicy.core import tf_names
from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.tf_names import DT_DOUBLE, DT_FLOAT, FLOAT_DTYPES

# Ops whose dtype attribute is the variable's: retyped only with the variable.
VARIABLE_READ_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd"})
# Ops that pass a value through: they take their (first) input's dtype wherever
# they are, through the named attribute. A gather follows its table, so that an
# embedding lookup casts the rows it gathers, never the whole table.
FOLLOWER_OPS = {
    "Identity": "T", "IdentityN": "T", "StopGradient": "T", "Snapshot": "T",
    "PreventGradient": "T", "EnsureShape": "T", "GatherV2": "Tparams",
}
NEVER_RETYPED = frozenset(
    {
        "Placeholder", "_Arg", "_Retval", "VarHandleOp", "While", "StatelessWhile", "If",
        "StatelessIf", "Case", "StatelessCase", "PartitionedCall", "StatefulPartitionedCall",
        "NoOp",
    }
)
# Ops computed in float32 inside any low-precision layer: exponentials and
# logarithms, which grappler's auto_mixed_precision keeps off its allow list,
# and Mean, which Keras's ``ops.mean`` computes in float32 for a low-precision
# input (global average pooling, squeeze-and-excite blocks).
# Softmax is not one: Keras's Softmax layer (MultiHeadAttention's, and so
# BERT's and GPT-2's) computes in the layer's dtype; the models that pin it to
# float32 (keras_hub's Llama and Gemma) cannot be told apart in a float32 export.
# Nor is Pow, which grappler keeps in float32 but Keras computes in the layer's
# dtype: ``gelu(approximate=True)`` (GPT-2's activation) cubes its input there,
# and only so is it Keras's bit for bit (tests/test_wide_kernels.py).
FLOAT32_OPS = frozenset(
    {
        "Mean", "LogSoftmax", "Exp", "Expm1", "Log", "Log1p", "L2Loss",
        "SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits",
    }
)
# The product of queries and keys: the op a scaled-attention softmax follows.
PRODUCT_OPS = frozenset({"Einsum", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
# What may sit between the scale and the softmax in Keras's dot_product_attention:
# a bias added, a mask applied with ``where``.
LOGIT_OPS = frozenset({"AddV2", "Add", "SelectV2", "Select"})
# Ops that make a layer a normalisation layer (its statistics in float32).
NORMALIZATION_OPS = frozenset({"Rsqrt", "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
# Float data enters a graph through these; other float tensors that descend
# only from integers and constants are position math.
FLOAT_SOURCES = frozenset({"Placeholder", "_Arg"}) | VARIABLE_READ_OPS
FLOAT16_MAX = float(np.finfo(np.float16).max)
# Attributes that stay float32 even when their op is retyped (Keras keeps
# normalisation statistics in float32).
FLOAT32_ATTRS = {"FusedBatchNorm": {"U"}, "FusedBatchNormV2": {"U"}, "FusedBatchNormV3": {"U"}}


PROMOTED = "promoted to float32 by a float32 or mixed-dtype sublayer output, as Keras promotes"

RESIDUAL_ADDS = frozenset({"Add", "AddV2"})
"""Adds that take a sublayer's output at the layer's own dtype, not the sublayer's.

A residual connection reaches its add through a layer of the block's dtype:
keras_hub's blocks pass the attention and feed-forward outputs through a
Dropout layer (no op at inference, so no op in a float32 export) and Keras's
Functional models add with an ``Add`` layer, both of which cast their input
to their own compute dtype. So a float16 projection's output is rounded to a
bfloat16 block's dtype before ``x + residual``, where Keras's type promotion
alone would add in float32.
"""


def within(path: Optional[str], layer: str) -> bool:
    """Whether layer ``path`` is ``layer`` or one of its sublayers."""
    return path is not None and (path == layer or path.startswith(layer + "/"))


def exact_cast(cast: Node) -> bool:
    """Whether a Cast keeps every value (from an integer, or to a wider float).

    Only then may a Cast of its output read its input instead: bfloat16 to
    float16 after float32 to bfloat16 rounds twice, and Keras does round twice.
    """
    source, target = cast.attrs["SrcT"].type, cast.attrs["DstT"].type
    return source not in FLOAT_DTYPES or source == target or wider(source, target) == target


def wider(a: int, b: int) -> int:
    """Keras's ``result_type`` of two float dtypes (bfloat16 with float16 is float32)."""
    if a == b:
        return a
    if DT_DOUBLE in (a, b):
        return DT_DOUBLE
    return DT_FLOAT


POSITION_MATH = "computed from integers and constants only (positions, masks), kept in float32"


def position_math(graph: Graph) -> frozenset[str]:
    """Ops with float outputs whose float inputs all descend from integers and constants.

    Float data enters through :data:`FLOAT_SOURCES` (inputs, arguments,
    variable reads) and flows along float edges; an op none of whose float
    inputs carries data, and that is not a Const itself, computes positions,
    rotary frequencies or masks, which Keras and keras_hub compute in float32.
    """
    carries_data: set[str] = set()
    found = set()
    for node in graph.topological_order():
        outputs = graph.output_dtypes(node)
        if not any(t in FLOAT_DTYPES for t in outputs):
            continue
        inputs = graph.input_dtypes(node)
        fed = any(
            ref.node in carries_data for position, ref in node.data_inputs()
            if position < len(inputs) and inputs[position] in FLOAT_DTYPES
        )
        if fed or node.op in FLOAT_SOURCES or node.op in NEVER_RETYPED or tf_names.op_def(node.op) is None:
            carries_data.add(node.name)
        elif node.op != "Const":
            found.add(node.name)
    return frozenset(found)


ATTENTION_SOFTMAX = (
    "softmax of scaled query-key logits kept in float32, as Keras's dot_product_attention computes it"
)


def scaled_attention_softmax(graph: Graph) -> dict[str, str]:
    """The ops of each softmax computed as Keras's ``dot_product_attention`` computes it.

    Keras's ``MultiHeadAttention`` (without dropout, so by default) and
    ``ops.dot_product_attention`` cast the query-key product to float32, scale
    it there, add the bias, apply the mask and take the softmax, all in
    float32, and cast the probabilities back to the key's dtype::

        Einsum(q, k) -> Mul(scale) -> [Add(bias)] -> [Select(mask)] -> Softmax

    The scale after the product tells this form apart from the explicit one
    (``MultiHeadAttention`` with dropout scales the query before the product,
    and takes its softmax in the layer's dtype). Answers each Mul, Add, Select
    and Softmax of such a chain -> the name of the product it scales.
    """
    found: dict[str, str] = {}
    for node in graph.nodes.values():
        if node.op == "Softmax":
            chain = scaled_logits(graph, node, depth=0)
            if chain:
                *ops, product = chain
                found.update(dict.fromkeys(ops, product))
    return found


def scaled_logits(graph: Graph, node: Node, depth: int) -> list[str]:
    """``node``, the ops back to a product scaled by a constant, then the product; or []."""
    if depth > len(LOGIT_OPS) + 1:
        return []
    producers = [
        graph.producer(ref) for _, ref in node.data_inputs() if graph.tensor_dtype(ref) in FLOAT_DTYPES
    ]
    if node.op == "Mul" and depth > 0:
        constants = [p for p in producers if p.op == "Const"]
        # The product itself, or its cast to float32 (a mixed-precision export).
        products = [p for p in (uncast(graph, q) for q in producers) if p.op in PRODUCT_OPS]
        return [node.name, products[0].name] if len(constants) == 1 and len(products) == 1 else []
    if node.op == "Softmax" or node.op in LOGIT_OPS:
        for producer in producers:
            if producer.op in LOGIT_OPS or producer.op == "Mul":
                chain = scaled_logits(graph, producer, depth + 1)
                if chain:
                    return [node.name, *chain]
    return []


def uncast(graph: Graph, node: Node) -> Node:
    """The producer of a Cast's input; any other node itself."""
    if node.op == "Cast":
        (_, source), = node.data_inputs()
        return graph.producer(source)
    return node

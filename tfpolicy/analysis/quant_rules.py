"""Op rules for quantization: which operand of each op can be a kernel, and which axes it contracts.

Each op type that contracts an input with a kernel has a rule in :data:`RULES`
returning its candidate :class:`Contraction`\ s (for ``MatMul`` either operand
may be the kernel). :mod:`tfpolicy.analysis.quant_sites` tries them in order.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

from tfpolicy.core import tf_names
from tfpolicy.core.graph import Node

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


def attr_bool(node: Node, name: str) -> bool:
    value = node.attrs.get(name)
    return bool(value.b) if value is not None else False


def _matmul(node: Node) -> list[Contraction]:
    ta, tb = attr_bool(node, "transpose_a"), attr_bool(node, "transpose_b")
    a_k, b_k = (0 if ta else 1), (1 if tb else 0)
    return [
        Contraction("matmul", 1, 0, (b_k,), (a_k,)),
        Contraction("matmul", 0, 1, (a_k,), (b_k,)),
    ]


def _batch_matmul(node: Node) -> list[Contraction]:
    ax, ay = attr_bool(node, "adj_x"), attr_bool(node, "adj_y")
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
CONVOLUTION_OPS = frozenset({"Conv2D", "DepthwiseConv2dNative", "Conv2DBackpropInput"})
assert CONVOLUTION_OPS | FLOAT8_KINDS == tf_names.CONTRACTION_OPS, "every contraction a matmul or a convolution"


MATMUL_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})

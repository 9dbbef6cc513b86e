"""Tracing a kernel operand back to its variable through layout ops.

A kernel reaches its matmul through ``Identity``, ``Cast``, ``Reshape``,
``ExpandDims`` and ``Transpose``::

    ReadVariableOp(kernel) -> Cast -> Reshape -> Transpose -> MatMul

:func:`trace_kernel` maps the axes the op contracts back into the variable's
own frame (so that an int8 scale is per output channel of the variable as
stored); :func:`kernel_layout` lists the layout steps, which the integer form
replays on the int8 kernel.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from tfpolicy.analysis.layer_index import LayerIndex
from tfpolicy.analysis.quant_rules import LAYOUT_OPS, Contraction
from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.tf_names import TensorRef


def kernel_layout(graph: Graph, operand: TensorRef, read_node: str):
    """The layout steps ``(op, operand)`` from the kernel's read to ``operand``, read first."""
    chain, end = layout_chain(graph, operand)
    if end.name != read_node:
        return f"the kernel reaches it through {end.op}"
    steps = []
    for step in reversed(chain):
        if step.op in ("Transpose", "Reshape", "ExpandDims"):
            value = const_input(graph, step, 1)
            if value is None:
                return f"the kernel reaches it through a {step.op} of computed shape"
            steps.append((step.op, tuple(int(v) for v in np.asarray(value).reshape(-1))))
    return tuple(steps)


def apply_layout(array: np.ndarray, op: str, operand: tuple[int, ...]) -> np.ndarray:
    if op == "Transpose":
        return np.transpose(array, operand)
    if op == "Reshape":
        return np.reshape(array, operand)
    return np.expand_dims(array, operand[0])


def trace_gather_table(signature, graph, node, operand, index):
    if node.op == "GatherV2":
        axis_node = graph.producer(list(dict(node.data_inputs()).values())[2])
        if axis_node.op != "Const" or int(np.asarray(const_value(axis_node)).reshape(-1)[0]) != 0:
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


def trace_kernel(signature, graph, operand: TensorRef, contraction: Contraction, index: LayerIndex):
    """Follow layout ops to a variable read; map the reduced axes into its frame.

    Returns ``(variable, read node, axes)`` with ``axes`` None when a reshape
    makes the per-channel scale inexpressible, or None when no variable is found.
    """
    chain, node = layout_chain(graph, operand)
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
            perm = const_input(graph, step, 1)
            if perm is None:
                return info, node.name, None
            perm = [int(p) for p in np.asarray(perm).reshape(-1)]
            back.append(lambda axes, perm=perm: {perm[a] for a in axes})
            shape = tuple(shape[p] for p in perm)
        elif step.op == "Reshape":
            target = const_input(graph, step, 1)
            if target is None:
                return info, node.name, None
            target = resolve_reshape(shape, [int(d) for d in np.asarray(target).reshape(-1)])
            back.append(lambda axes, source=shape, target=target: reshape_axes_back(source, target, axes))
            shape = target
        elif step.op == "ExpandDims":  # Conv1D's kernel (k, in, out) -> (1, k, in, out)
            axis = const_input(graph, step, 1)
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


def layout_chain(graph: Graph, operand: TensorRef) -> tuple[list[Node], Node]:
    """The layout ops (:data:`LAYOUT_OPS`) that produce ``operand``, nearest first, and the op before them."""
    chain: list[Node] = []
    node = graph.producer(operand)
    while node.op in LAYOUT_OPS and len(chain) < 16:
        chain.append(node)
        node = graph.producer(next(iter(node.data_inputs()))[1])
    return chain, node


def const_input(graph: Graph, node: Node, position: int):
    ref = dict(node.data_inputs()).get(position)
    if ref is None:
        return None
    producer = graph.producer(ref)
    return const_value(producer) if producer.op == "Const" else None


def const_value(node: Node):
    import tensorflow as tf  # noqa: PLC0415

    return tf.make_ndarray(node.attrs["value"].tensor)


def resolve_reshape(source: tuple[int, ...], target: list[int]) -> tuple[int, ...]:
    total = int(np.prod(source)) if source else 1
    if -1 in target:
        known = int(np.prod([d for d in target if d != -1])) or 1
        target = [total // known if d == -1 else d for d in target]
    return tuple(target)


def reshape_groups(source: tuple[int, ...], target: tuple[int, ...]) -> Optional[list[tuple[list[int], list[int]]]]:
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


def reshape_axes_back(source, target, axes: set[int]) -> Optional[set[int]]:
    groups = reshape_groups(tuple(source), tuple(target))
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

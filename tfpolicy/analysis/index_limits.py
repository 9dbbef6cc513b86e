"""How large the integers a signature input carries may be: the tables they index.

Generated inputs (serving checks, validation without data) must be valid for
the model: a token id beyond the vocabulary or a segment id beyond the segment
table makes the model fail where real requests would not. The limit of an
integer input is the smallest first dimension of the tables it indexes::

    token_ids -> Reshape -> GatherV2(params=ReadVariableOp(embeddings (1000, 64)), axis 0)   limit 1000
    segment_ids -> ResourceGather(segment_embedding/embeddings (2, 64))                      limit 2

followed from the input placeholder through ops that move indices without
changing them (Identity, Cast, Reshape, slicing, tiling, Select).
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np
import tensorflow as tf

from tfpolicy.analysis.layer_index import LayerIndex
from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.savedmodel_io import SignatureProgram
from tfpolicy.core.tf_names import TensorRef

# Ops through which an index keeps its value (input position 0 carries it).
INDEX_PRESERVING = frozenset(
    {
        "Identity", "Cast", "Reshape", "ExpandDims", "Squeeze", "StridedSlice", "Slice", "Transpose",
        "Tile", "BroadcastTo", "ConcatV2", "Pack", "EnsureShape", "Snapshot",
    }
)


def integer_limits(program: SignatureProgram, index: LayerIndex) -> dict[str, int]:
    """Input name -> exclusive upper bound of the valid values, for inputs that index tables."""
    graph = program.graph
    limits: dict[str, int] = {}
    for tensor_name in program.input_tensors:
        name = tensor_name.split(":")[0]
        limit = _smallest_table(program.key, graph, index, name)
        if limit is not None:
            limits[name] = limit
    return limits


def _smallest_table(signature: str, graph: Graph, index: LayerIndex, start: str) -> Optional[int]:
    found: list[int] = []
    queue = collections.deque([start])
    seen = {start}
    while queue:
        node = graph.nodes[queue.popleft()]
        for slot in range(max(1, len(graph.output_dtypes(node)))):
            for consumer_name, position in graph.uses(TensorRef(node.name, slot)):
                consumer = graph.nodes[consumer_name]
                if consumer.op in ("GatherV2", "ResourceGather") and position == 1:
                    rows = _table_rows(signature, graph, index, consumer)
                    if rows:
                        found.append(rows)
                elif _passes_index(consumer.op, position) and consumer_name not in seen:
                    seen.add(consumer_name)
                    queue.append(consumer_name)
    return min(found) if found else None


def _passes_index(op: str, position: int) -> bool:
    """Whether ``op`` forwards the index arriving at input ``position`` (Keras's ``take``
    wraps negative ids with ``SelectV2(ids < 0, ids + n, ids)``)."""
    if op in ("SelectV2", "Select"):
        return position in (1, 2)
    return op in INDEX_PRESERVING and position == 0


def _table_rows(signature: str, graph: Graph, index: LayerIndex, gather: Node) -> Optional[int]:
    inputs = dict(gather.data_inputs())
    if gather.op == "GatherV2" and not _is_zero(graph, inputs.get(2)):
        return None
    table = inputs[0]
    uid = index.variable_of(signature, graph, table)
    if uid is None:
        producer = graph.producer(table)
        if producer.op == "Const":
            shape = tf.make_ndarray(producer.attrs["value"].tensor).shape
            return int(shape[0]) if shape else None
        info = index.variable_read_by(signature, graph, producer) if producer.op == "ReadVariableOp" else None
    else:
        info = index.variables.get(uid)
    return int(info.shape[0]) if info is not None and info.shape and info.shape[0] else None


def _is_zero(graph: Graph, ref: Optional[TensorRef]) -> bool:
    if ref is None:
        return False
    producer = graph.producer(ref)
    return producer.op == "Const" and np.all(tf.make_ndarray(producer.attrs["value"].tensor) == 0)

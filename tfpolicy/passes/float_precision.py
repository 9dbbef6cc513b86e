"""The float-precision pass: retype each layer's ops to its compute dtype.

For a layer whose policy computes in bfloat16 (``mixed_bfloat16``)::

    before:  x:f32 -> MatMul(T=f32) <- ReadVariableOp(kernel):f32
    after:   x:f32 -> Cast(bf16) -> MatMul(T=bf16) <- Cast(bf16) <- ReadVariableOp:f32

Ops are retyped by changing their float type attributes; a Cast is inserted
wherever a tensor's dtype after the edit differs from what its consumer now
expects, at most one per (tensor, dtype), reusing a Cast the graph already has
and never casting the output of a Cast again (its input is cast instead).
Graph boundaries keep their dtypes: signature inputs and outputs, and the
arguments and results of While/If bodies, which are rewritten the same way.

Declined, with a reason in the result: ops with no kernel for the dtype,
normalisation layers (Keras keeps them in float32), ops on resources and
function calls. Integer, bool, string and resource tensors are never touched.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Optional

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, types_pb2

from tfpolicy import tf_names
from tfpolicy.graph import Graph, Node
from tfpolicy.layer_index import LayerIndex
from tfpolicy.plan import Plan
from tfpolicy.tf_names import FLOAT_DTYPES, TensorRef

logger = logging.getLogger(__name__)

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
# Attributes that stay float32 even when their op is retyped (Keras keeps
# normalisation statistics in float32).
FLOAT32_ATTRS = {"FusedBatchNorm": {"U"}, "FusedBatchNormV2": {"U"}, "FusedBatchNormV3": {"U"}}


@dataclasses.dataclass
class GraphStats:
    """What the pass did to one graph."""

    retyped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    declined: dict = dataclasses.field(default_factory=dict)  # layer -> {reason: count}
    casts_inserted: int = 0
    casts_reused: int = 0
    casts_folded: int = 0

    def decline(self, layer: Optional[str], reason: str) -> None:
        self.declined.setdefault(layer, collections.Counter())[reason] += 1

    @property
    def modified(self) -> bool:
        return bool(sum(self.retyped.values()) or self.casts_inserted or self.casts_folded)


class FloatPrecisionPass:
    """Retype one graph; ``variable_dtypes`` maps variable uid -> new dtype."""

    def __init__(
        self,
        signature: str,
        graph: Graph,
        index: LayerIndex,
        plan: Plan,
        variable_dtypes: dict[int, int],
    ) -> None:
        self.signature = signature
        self.graph = graph
        self.index = index
        self.plan = plan
        self.variable_dtypes = variable_dtypes
        self.stats = GraphStats()
        self._casts: dict[tuple[str, int], TensorRef] = {}

    # -- entry point -----------------------------------------------------------

    def run(self) -> GraphStats:
        graph = self.graph
        output_dtypes = {key: graph.tensor_dtype(ref) for key, ref in graph.outputs.items()}
        for node in graph.topological_order():
            self._retype(node)
            self._fix_inputs(node)
        for key, ref in list(graph.outputs.items()):
            want = output_dtypes[key]
            if graph.tensor_dtype(ref) != want:
                graph.outputs[key] = self._cast(ref, want)
        return self.stats

    # -- deciding a node's dtype -------------------------------------------------

    def _layer(self, node: Node) -> Optional[str]:
        return self.index.layer_of(self.signature, self.graph, node)

    def _target(self, node: Node) -> tuple[Optional[str], int, bool]:
        layer = self._layer(node)
        layer_plan = self.plan.for_layer(layer)
        return layer, layer_plan.compute_enum, layer_plan.is_normalization

    def _retype(self, node: Node) -> None:
        if node.op in VARIABLE_READ_OPS:
            self._retype_variable_read(node)
        elif node.op in FOLLOWER_OPS:
            self._follow_input(node)
        elif node.op == "Cast":
            self._retype_cast(node)
        elif node.op not in NEVER_RETYPED:
            self._retype_compute(node)

    def _retype_variable_read(self, node: Node) -> None:
        info = self.index.variable_read_by(self.signature, self.graph, node)
        if info is None or info.uid not in self.variable_dtypes:
            return
        new = self.variable_dtypes[info.uid]
        if node.attrs["dtype"].type != new:
            node.attrs["dtype"] = attr_value_pb2.AttrValue(type=new)
            self.stats.retyped[self._layer(node)] += 1

    def _follow_input(self, node: Node) -> None:
        inputs = [self.graph.tensor_dtype(ref) for _, ref in node.data_inputs()]
        attr_name = FOLLOWER_OPS[node.op]
        attr = node.attrs.get(attr_name)
        if attr is None:
            return
        if attr.HasField("list"):
            current = list(attr.list.type)
            new = [have if (have in FLOAT_DTYPES and old in FLOAT_DTYPES) else old for old, have in zip(current, inputs)]
            if new != current:
                node.attrs[attr_name] = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=new))
        elif inputs and attr.type in FLOAT_DTYPES and inputs[0] in FLOAT_DTYPES and inputs[0] != attr.type:
            node.attrs[attr_name] = attr_value_pb2.AttrValue(type=inputs[0])

    def _retype_cast(self, node: Node) -> None:
        layer, target, normalization = self._target(node)
        (_, source), = node.data_inputs()
        have = self.graph.tensor_dtype(source)
        src, dst = node.attrs["SrcT"].type, node.attrs["DstT"].type
        if src not in FLOAT_DTYPES and dst == types_pb2.DT_FLOAT and target != dst and not normalization:
            node.attrs["DstT"] = attr_value_pb2.AttrValue(type=target)  # e.g. a mask cast
            dst = target
            self.stats.retyped[layer] += 1
        if have != src and have in FLOAT_DTYPES and src in FLOAT_DTYPES:
            node.attrs["SrcT"] = attr_value_pb2.AttrValue(type=have)
            self.stats.casts_folded += 1
            if have == dst:  # the Cast became a no-op
                node.op = "Identity"
                node.attrs = {"T": attr_value_pb2.AttrValue(type=dst)}

    def _retype_compute(self, node: Node) -> None:
        layer, target, normalization = self._target(node)
        if target == types_pb2.DT_FLOAT or target not in FLOAT_DTYPES:
            return
        attrs = self._float_type_attrs(node)
        if not attrs:
            return
        if normalization:
            self.stats.decline(layer, "normalization layer kept in float32")
            return
        if tf_names.op_def(node.op) is None:
            self.stats.decline(layer, f"function call '{node.op}' keeps its signature")
            return
        if self._touches_resources(node):
            self.stats.decline(layer, f"{node.op} works on a resource or variant")
            return
        for attr_name in attrs:
            if not (tf_names.op_def_allows(node.op, attr_name, target) and tf_names.has_cpu_kernel(node.op, attr_name, target)):
                self.stats.decline(layer, f"no {tf_names.dtype_name(target)} kernel for {node.op}")
                return
        for attr_name in attrs:
            value = node.attrs[attr_name]
            if value.HasField("list"):
                new = [target if t == types_pb2.DT_FLOAT else t for t in value.list.type]
                node.attrs[attr_name] = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=new))
            else:
                node.attrs[attr_name] = attr_value_pb2.AttrValue(type=target)
        if node.op == "Const":
            node.attrs["value"] = _convert_tensor(node.attrs["value"], target)
        self.stats.retyped[layer] += 1

    def _float_type_attrs(self, node: Node) -> list[str]:
        """Type attributes of ``node`` that are float32 and type a data argument."""
        definition = tf_names.op_def(node.op)
        if definition is None:
            return ["<call>"] if any(t in FLOAT_DTYPES for t in self.graph.output_dtypes(node)) else []
        skip = FLOAT32_ATTRS.get(node.op, set())
        names = []
        for arg in (*definition.input_arg, *definition.output_arg):
            name = arg.type_attr or arg.type_list_attr
            if not name or name in skip or name in names or name not in node.attrs:
                continue
            value = node.attrs[name]
            if value.HasField("list"):
                if types_pb2.DT_FLOAT in value.list.type:
                    names.append(name)
            elif value.type == types_pb2.DT_FLOAT:
                names.append(name)
        if node.op == "Const" and node.attrs["dtype"].type == types_pb2.DT_FLOAT:
            names = ["dtype"]
        return names

    def _touches_resources(self, node: Node) -> bool:
        dtypes = self.graph.input_dtypes(node) + self.graph.output_dtypes(node)
        return types_pb2.DT_RESOURCE in dtypes or types_pb2.DT_VARIANT in dtypes

    # -- casts -------------------------------------------------------------------

    def _fix_inputs(self, node: Node) -> None:
        wants = self.graph.input_dtypes(node)
        for position, ref in list(node.data_inputs()):
            have = self.graph.tensor_dtype(ref)
            want = wants[position]
            if have != want and have in FLOAT_DTYPES and want in FLOAT_DTYPES:
                self.graph.replace_input(node, position, self._cast(ref, want))

    def _cast(self, ref: TensorRef, want: int) -> TensorRef:
        """``ref`` as ``want``: a cached, reused or new Cast, never Cast(Cast(x))."""
        key = (str(ref), want)
        if key in self._casts:
            return self._casts[key]
        producer = self.graph.producer(ref)
        if producer.op == "Cast":
            (_, source), = producer.data_inputs()
            self.stats.casts_folded += 1
            result = source if self.graph.tensor_dtype(source) == want else self._cast(source, want)
            self._casts[key] = result
            return result
        for consumer, _ in self.graph.uses(ref):
            existing = self.graph.nodes[consumer]
            if existing.op == "Cast" and existing.attrs["DstT"].type == want and existing.attrs["SrcT"].type == self.graph.tensor_dtype(ref):
                self.stats.casts_reused += 1
                self._casts[key] = TensorRef(existing.name)
                return self._casts[key]
        have = self.graph.tensor_dtype(ref)
        base = f"{ref.node}/tfpolicy/cast_{ref.index}_to_{tf_names.dtype_name(want)}" if ref.index else f"{ref.node}/tfpolicy/cast_to_{tf_names.dtype_name(want)}"
        cast = self.graph.add_node(
            "Cast",
            base,
            [str(ref)],
            {
                "SrcT": attr_value_pb2.AttrValue(type=have),
                "DstT": attr_value_pb2.AttrValue(type=want),
                "Truncate": attr_value_pb2.AttrValue(b=False),
            },
            device=producer.device,
        )
        self.stats.casts_inserted += 1
        self._casts[key] = TensorRef(cast.name)
        return self._casts[key]


def _convert_tensor(value: attr_value_pb2.AttrValue, dtype: int) -> attr_value_pb2.AttrValue:
    array = tf.make_ndarray(value.tensor)
    numpy_dtype = tf.dtypes.as_dtype(dtype).as_numpy_dtype
    converted = tf.make_tensor_proto(np.asarray(array, dtype=numpy_dtype), shape=array.shape)
    return attr_value_pb2.AttrValue(tensor=converted)


def choose_variable_dtypes(plan: Plan, index: LayerIndex, skip: frozenset[int] | set[int] = frozenset()) -> dict[int, int]:
    """Variables whose layer's policy stores them in another float dtype.

    ``skip`` holds the uids of variables another pass replaces (int8 kernels).
    """
    chosen = {}
    for info in index.variables.values():
        layer_plan = plan.for_layer(info.layer_path)
        target = layer_plan.variable_enum
        if info.uid not in skip and info.dtype == types_pb2.DT_FLOAT and target in FLOAT_DTYPES and target != info.dtype:
            chosen[info.uid] = target
    return chosen

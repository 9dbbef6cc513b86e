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

Declined, with a reason in the result, and so kept in float32 with Casts
around them (Keras's and keras_hub's float32 islands, which a float32 export
cannot show):

* normalisation layers (LayerNormalization, BatchNormalization, RMSNorm as
  keras_hub writes it: any layer whose own ops take an ``Rsqrt``);
* :data:`FLOAT32_OPS`, the exponentials and logarithms that grappler's
  auto_mixed_precision denies, and Mean, as Keras's ``ops.mean``, which also
  rounds its input and its result to the layer's dtype (not Softmax, which
  Keras computes in the layer's dtype);
* float math computed only from integer tensors and constants (rotary and
  position embeddings, masks: ``cast(positions) * inverse_frequency``);
* ops with no kernel for the dtype, ops on resources and function calls.

Constants are weakly typed, as Keras's Python scalars are: a Const is
converted to the dtype of the op that consumes it (a copy per dtype), and a
value outside float16's range is clamped to its largest finite value, not
turned into ``inf`` (the report counts them). Integer, bool, string and
resource tensors are never touched.

    before:  x:f32 -> Mul <- Const(-1e9)
    after:   x:f16 -> Mul <- Const(-65504, f16)
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Optional

from tfpolicy.analysis.layer_index import LayerIndex
from tfpolicy.analysis.plan import Plan
from tfpolicy.core import tf_names
from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.tf_names import DT_FLOAT, DT_RESOURCE, DT_VARIANT, FLOAT_DTYPES, TensorRef, type_attr, type_list_attr
from tfpolicy.passes import PassResult
from tfpolicy.passes.casts import CastBuilder
from tfpolicy.passes.wide_kernels import is_widened
from tfpolicy.passes.float_rules import (
    ATTENTION_SOFTMAX,
    FLOAT32_ATTRS,
    FLOAT32_OPS,
    FOLLOWER_OPS,
    NEVER_RETYPED,
    NORMALIZATION_OPS,
    POSITION_MATH,
    PROMOTED,
    RESIDUAL_ADDS,
    VARIABLE_READ_OPS,
    position_math,
    scaled_attention_softmax,
    wider,
    within,
)

logger = logging.getLogger(__name__)


GATHER_OPS = frozenset({"GatherV2", "ResourceGather"})  # an embedding lookup


@dataclasses.dataclass
class GraphStats:
    """What the pass did to one graph."""

    retyped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    declined: dict = dataclasses.field(default_factory=dict)  # layer -> {reason: count}
    inserted: list[str] = dataclasses.field(default_factory=list)  # the inserted Casts' names
    casts_reused: int = 0
    casts_folded: int = 0
    constants_clamped: int = 0

    @property
    def casts_inserted(self) -> int:
        return len(self.inserted)

    def decline(self, layer: Optional[str], reason: str) -> None:
        self.declined.setdefault(layer, collections.Counter())[reason] += 1

    @property
    def modified(self) -> bool:
        return bool(sum(self.retyped.values()) or self.casts_inserted or self.casts_folded)


class FloatPrecisionPass(CastBuilder):
    """Retype one graph; ``variable_dtypes`` maps variable uid -> new dtype."""

    def __init__(
        self,
        signature: str,
        graph: Graph,
        index: LayerIndex,
        plan: Plan,
        variable_dtypes: dict[int, int],
    ) -> None:
        self.name = f"float_precision[{signature}:{graph.name}]"
        self.signature = signature
        self.graph = graph
        self.index = index
        self.plan = plan
        self.variable_dtypes = variable_dtypes
        self.stats = GraphStats()
        self._init_casts()
        self._position_math: frozenset[str] = frozenset()
        self._attention_softmax: dict[str, str] = {}  # chain op -> the product it scales
        self._entry_dtypes: dict[str, int] = {}  # normalisation layer -> the dtype its input came in
        self._promoted: set[str] = set()
        self._normalization_layers: frozenset[Optional[str]] = frozenset()
        self._kept_means: dict[str, int] = {}  # Mean kept in float32 -> its layer's compute dtype

    # -- entry point -----------------------------------------------------------

    def run(self) -> PassResult[GraphStats]:
        """Retype the graph; ``stats`` is the :class:`GraphStats`."""
        graph = self.graph
        output_dtypes = {key: graph.tensor_dtype(ref) for key, ref in graph.outputs.items()}
        self._position_math = position_math(graph)
        self._attention_softmax = scaled_attention_softmax(graph)
        self._normalization_layers = frozenset(
            self._layer(node) for node in graph.nodes.values() if node.op in NORMALIZATION_OPS
        )
        for node in graph.topological_order():
            self._retype(node)
            self._fix_inputs(node)
        for key, ref in list(graph.outputs.items()):
            want = output_dtypes[key]
            for dtype in self._mean_roundings(ref) + self._normalization_returns(ref):  # Keras returns them rounded
                if graph.tensor_dtype(ref) != dtype:
                    ref = self._cast(ref, dtype)
            if graph.tensor_dtype(ref) != want:
                graph.outputs[key] = self._cast(ref, want)
        self._fold_constant_copies()
        return PassResult(self.stats.modified, stats=self.stats)

    # -- deciding a node's dtype -------------------------------------------------

    def _layer(self, node: Node) -> Optional[str]:
        return self.index.layer_of(self.signature, self.graph, node)

    def _target(self, node: Node) -> tuple[Optional[str], int, bool]:
        layer = self._layer(node)
        return layer, self.plan.for_layer(layer).compute_enum, self._is_normalization(layer)

    def _is_normalization(self, layer: Optional[str]) -> bool:
        """Whether ``layer`` computes in float32 as a normalisation layer (by its variables or its ops)."""
        return layer is not None and (self.plan.for_layer(layer).is_normalization or layer in self._normalization_layers)

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
            node.attrs["dtype"] = type_attr(new)
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
                node.attrs[attr_name] = type_list_attr(new)
        elif inputs and attr.type in FLOAT_DTYPES and inputs[0] in FLOAT_DTYPES and inputs[0] != attr.type:
            node.attrs[attr_name] = type_attr(inputs[0])

    def _retype_cast(self, node: Node) -> None:
        layer, target, normalization = self._target(node)
        (_, source), = node.data_inputs()
        have = self.graph.tensor_dtype(source)
        src, dst = node.attrs["SrcT"].type, node.attrs["DstT"].type
        if src not in FLOAT_DTYPES and dst == DT_FLOAT and target != dst:
            self.stats.decline(layer, POSITION_MATH)  # integers to float32: positions, masks
        if have != src and have in FLOAT_DTYPES and src in FLOAT_DTYPES:
            node.attrs["SrcT"] = type_attr(have)
            self.stats.casts_folded += 1
            if have == dst:  # the Cast became a no-op
                node.op = "Identity"
                node.attrs = {"T": type_attr(dst)}

    def _retype_compute(self, node: Node) -> None:
        layer, target, normalization = self._target(node)
        if layer is None and self.index.between_layers(self.signature, self.graph, node):
            target = self._inputs_dtype(node)
        if target in FLOAT_DTYPES and target != DT_FLOAT and not normalization:
            promoted = self._promote(node, layer, target)
            if promoted != target:
                self._promoted.add(node.name)
                if promoted == DT_FLOAT:
                    self.stats.decline(layer, PROMOTED)
                target = promoted
        if target == DT_FLOAT or target not in FLOAT_DTYPES:
            return
        attrs = self._float_type_attrs(node)
        if not attrs or node.op == "Const":  # constants follow their consumers (_cast)
            return
        if normalization:
            self.stats.decline(layer, "normalization layer kept in float32")
            return
        if node.op in FLOAT32_OPS:
            self.stats.decline(layer, f"{node.op} kept in float32, as grappler keeps it")
            if node.op == "Mean":
                self._kept_means[node.name] = target
            return
        if node.name in self._attention_softmax:
            self.stats.decline(layer, ATTENTION_SOFTMAX)
            return
        if node.name in self._position_math:
            self.stats.decline(layer, POSITION_MATH)
            return
        if tf_names.op_def(node.op) is None:
            self.stats.decline(layer, f"function call '{node.op}' keeps its signature")
            return
        if is_widened(self.graph, node):  # a bfloat16 op an earlier rewrite computes in float32
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
                new = [target if t == DT_FLOAT else t for t in value.list.type]
                node.attrs[attr_name] = type_list_attr(new)
            else:
                node.attrs[attr_name] = type_attr(target)
        self.stats.retyped[layer] += 1

    def _inputs_dtype(self, node: Node) -> int:
        """Keras's ``result_type`` of ``node``'s float inputs (constants are weak): float32 if none."""
        found = None
        for _, ref in node.data_inputs():
            have = self.graph.tensor_dtype(ref)
            if have in FLOAT_DTYPES and self.graph.producer(ref).op != "Const":
                have = self._returned_dtype(ref)
                found = have if found is None else wider(found, have)
        return DT_FLOAT if found is None else found

    def _promote(self, node: Node, layer: Optional[str], target: int) -> int:
        """The dtype Keras computes ``node`` in: ``result_type`` of its inputs as Keras sees them.

        Keras casts what enters a layer to its compute dtype, but not what the
        layer's own sublayers return to it: ``ops.einsum(scores, value)`` in a
        bfloat16 attention layer whose ``value`` projection is float32 runs in
        float32, and ``einsum(query, key)`` of two float16 projections in
        float16. Inputs from a sublayer count at that sublayer's compute dtype
        (not at a residual add: :data:`~tfpolicy.passes.float_rules.RESIDUAL_ADDS`),
        inputs this layer already promoted at theirs, attention probabilities at
        their product's (Keras casts them back to the key's dtype); everything
        else at ``target``.
        """
        if layer is None:
            return target
        prefix = layer + "/"
        wanted = None
        for _, ref in node.data_inputs():
            producer = self.graph.producer(ref)
            if producer.op == "Const" or self.graph.tensor_dtype(ref) not in FLOAT_DTYPES:
                continue
            source = self._layer(producer)
            if source is not None and source.startswith(prefix) and node.op not in RESIDUAL_ADDS:
                dtype = self.plan.for_layer(source).compute_enum
            elif producer.name in self._attention_softmax:
                product = self.graph.nodes[self._attention_softmax[producer.name]]
                dtype = self.graph.output_dtypes(product)[0]
            elif producer.name in self._promoted and source == layer:
                dtype = self.graph.tensor_dtype(ref)
            else:
                dtype = target
            wanted = dtype if wanted is None else wider(wanted, dtype)
        return target if wanted is None else wanted

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
                if DT_FLOAT in value.list.type:
                    names.append(name)
            elif value.type == DT_FLOAT:
                names.append(name)
        if node.op == "Const" and node.attrs["dtype"].type == DT_FLOAT:
            names = ["dtype"]
        return names

    def _touches_resources(self, node: Node) -> bool:
        dtypes = self.graph.input_dtypes(node) + self.graph.output_dtypes(node)
        return DT_RESOURCE in dtypes or DT_VARIANT in dtypes

    # -- casts -------------------------------------------------------------------

    def _fix_inputs(self, node: Node) -> None:
        wants = self.graph.input_dtypes(node)
        for position, ref in list(node.data_inputs()):
            have = self.graph.tensor_dtype(ref)
            want = wants[position]
            if have in FLOAT_DTYPES and want in FLOAT_DTYPES and (
                have != want or self._mean_roundings(ref, node) or self._normalization_returns(ref, node)
            ):
                self._note_entry(ref, node, have)
                for dtype in self._casts_on_the_way(ref, node):
                    if self.graph.tensor_dtype(ref) != dtype and dtype != DT_FLOAT:
                        ref = self._cast(ref, dtype)
                if self.graph.tensor_dtype(ref) != want:
                    ref = self._cast(ref, want)
                self.graph.replace_input(node, position, ref)

    def _note_entry(self, ref: TensorRef, consumer: Node, have: int) -> None:
        """Remember the dtype data entered a normalisation layer in (see :meth:`_normalization_returns`)."""
        layer = self._layer(consumer)
        producer = self.graph.producer(ref)
        if not self._is_normalization(layer) or layer == self._layer(producer):
            return
        if producer.op not in VARIABLE_READ_OPS and producer.op != "Const":
            self._entry_dtypes.setdefault(layer, self._returned_dtype(ref))

    def _casts_on_the_way(self, ref: TensorRef, consumer: Node) -> list[int]:
        """The dtypes Keras casts ``ref`` to before ``consumer``'s own layer casts it.

        A normalisation layer returns its compute dtype; then each enclosing
        layer the value enters autocasts it, outermost first: a float16 query
        projection inside a bfloat16 attention layer sees its input rounded to
        bfloat16 and then to float16. Rounding twice is not rounding once.
        """
        found = self._mean_roundings(ref, consumer) + self._normalization_returns(ref, consumer)
        inside = self._layer(consumer)
        if inside is None:
            return found
        source = self._layer(self.graph.producer(ref))
        parts = inside.split("/")
        for end in range(1, len(parts)):
            ancestor = "/".join(parts[:end])
            if within(source, ancestor):
                continue  # the value is already inside this layer
            if ancestor in self.plan.layers and not self.plan.for_layer(ancestor).is_normalization:
                found.append(self.plan.for_layer(ancestor).compute_enum)
        return found

    def _mean_roundings(self, ref: TensorRef, consumer: Optional[Node] = None) -> list[int]:
        """The roundings Keras's ``ops.mean`` makes around a Mean kept in float32.

        In a bfloat16 layer it averages in float32 what entered the layer
        autocast to bfloat16, and casts the mean back to bfloat16. Where the
        neighbour computes in float32 as well (a LayerNormalization after
        global average pooling, a float32 signature input or output), no
        retyped op rounds for it, so the casts are made explicit.
        """
        found = []
        producer = self.graph.producer(ref)
        if producer.name in self._kept_means:
            found.append(self._kept_means[producer.name])
        if consumer is not None and consumer.name in self._kept_means:
            layer = self._layer(consumer)
            if layer is not None and not within(self._layer(producer), layer):
                found.append(self._kept_means[consumer.name])
        return found

    def _normalization_returns(self, ref: TensorRef, consumer: Optional[Node] = None) -> list[int]:
        """The dtypes a normalisation layer casts ``ref`` to as it returns it.

        The layer computes in float32 but returns its compute dtype, and a
        LayerNormalization casts to the dtype its input had first (Keras's
        ``ops.layer_normalization`` does): a float16 LayerNormalization after
        a bfloat16 layer rounds to bfloat16, then float16. Empty when ``ref``
        does not leave such a layer.
        """
        layer = self._layer(self.graph.producer(ref))
        if layer is None or (consumer is not None and within(self._layer(consumer), layer)):
            return []
        if not self._is_normalization(layer):
            return self._embedding_returns(ref, layer)
        compute = self.plan.for_layer(layer).compute_enum
        if compute not in FLOAT_DTYPES or compute == self.graph.tensor_dtype(ref):
            return []
        entered = self._entry_dtypes.get(layer)
        if entered is not None and entered != compute and not self._has_moving_statistics(layer):
            return [entered, compute]
        return [compute]

    def _embedding_returns(self, ref: TensorRef, layer: str) -> list[int]:
        """``[compute dtype]`` when ``ref`` is the rows an embedding layer gathers from its float32 table.

        The gather follows its table (it casts rows, never the whole table), so
        the rows leave in float32 where Keras's ``Embedding`` returns them cast
        to its compute dtype: a float32 consumer (another layer, a signature
        output) must still see them rounded.
        """
        producer = self.graph.producer(ref)
        while producer.op in FOLLOWER_OPS and producer.op not in GATHER_OPS:
            inputs = list(producer.data_inputs())
            if not inputs:
                return []
            producer = self.graph.producer(inputs[0][1])
        if producer.op not in GATHER_OPS or self._layer(producer) != layer:
            return []
        table = self.graph.producer(dict(producer.data_inputs())[0])
        if table.op not in VARIABLE_READ_OPS and producer.op == "GatherV2":
            return []
        compute = self.plan.for_layer(layer).compute_enum
        if compute not in FLOAT_DTYPES or compute == self.graph.tensor_dtype(ref):
            return []
        return [compute]

    def _returned_dtype(self, ref: TensorRef) -> int:
        """The dtype a consumer outside ``ref``'s layer sees it in (see :meth:`_normalization_returns`)."""
        returned = self._normalization_returns(ref)
        return returned[-1] if returned else self.graph.tensor_dtype(ref)

    def _has_moving_statistics(self, layer: str) -> bool:
        """BatchNormalization (moving mean and variance) autocasts its input; LayerNormalization does not."""
        info = self.index.layers.get(layer)
        return info is not None and any(v.name.rsplit("/", 1)[-1].startswith("moving_") for v in info.variables)

def choose_variable_dtypes(plan: Plan, index: LayerIndex, skip: frozenset[int] | set[int] = frozenset()) -> dict[int, int]:
    """Variables whose layer's policy stores them in another float dtype.

    ``skip`` holds the uids of variables another pass replaces (int8 kernels).
    """
    chosen = {}
    for info in index.variables.values():
        layer_plan = plan.for_layer(info.layer_path)
        target = layer_plan.variable_enum
        if info.uid not in skip and info.dtype == DT_FLOAT and target in FLOAT_DTYPES and target != info.dtype:
            chosen[info.uid] = target
    return chosen

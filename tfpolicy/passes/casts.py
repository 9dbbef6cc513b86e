"""Casts and weakly typed constants for the float-precision pass.

:class:`CastBuilder` is mixed into :class:`tfpolicy.passes.float_precision.FloatPrecisionPass`:
one Cast per (tensor, dtype), a Cast the graph already has reused, a Cast of
a Cast folded into one from the source, and a Const converted (not cast) to
the dtype that reads it, clamped to float16's range::

    before:  x:f32 -> Mul <- Const(-1e9)
    after:   x:f16 -> Mul <- Const(-65504, f16)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import tensorflow as tf

from tfpolicy.core import tf_names
from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.tf_names import DT_HALF, FLOAT_DTYPES, TensorRef, bool_attr, numpy_dtype, tensor_attr, type_attr
from tfpolicy.passes.float_rules import FLOAT16_MAX, exact_cast

if TYPE_CHECKING:
    from tfpolicy.passes.float_precision import GraphStats


class CastBuilder:
    """The Cast and constant half of the float-precision pass (see the module doc).

    What it relies on, which the pass that mixes it in sets up (:meth:`_init_casts`
    and its own graph, statistics and layer attribution):
    """

    graph: Graph
    stats: "GraphStats"
    _casts: dict[tuple[str, int], TensorRef]  # (tensor, dtype) -> its cast
    _constant_copies: dict[str, list[str]]  # Const -> its converted copies

    def _init_casts(self) -> None:
        self._casts, self._constant_copies = {}, {}

    def _layer(self, node: Node) -> Optional[str]:
        raise NotImplementedError  # the pass's layer attribution

    def _cast(self, ref: TensorRef, want: int) -> TensorRef:
        """``ref`` as ``want``: a cached, reused or new Cast, never Cast(Cast(x))."""
        key = (str(ref), want)
        if key in self._casts:
            return self._casts[key]
        producer = self.graph.producer(ref)
        if producer.op == "Const" and want in FLOAT_DTYPES:
            self._casts[key] = self._converted_constant(producer, want)
            return self._casts[key]
        if producer.op == "Cast" and exact_cast(producer):
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
                "SrcT": type_attr(have),
                "DstT": type_attr(want),
                "Truncate": bool_attr(False),
            },
            device=producer.device,
        )
        self.stats.inserted.append(cast.name)
        self._casts[key] = TensorRef(cast.name)
        return self._casts[key]

    def _fold_constant_copies(self) -> None:
        """A Const whose only users now read one converted copy is converted in place.

            before:  w:f32 (no users left), w/tfpolicy/as_bfloat16:bf16 -> MatMul
            after:   w:bf16 -> MatMul
        """
        graph = self.graph
        outputs = {ref.node for ref in graph.outputs.values()}
        for name, made in self._constant_copies.items():
            original = TensorRef(name)
            if len(made) != 1 or name in outputs or graph.uses(original) or made[0] in outputs:
                continue
            copy = graph.nodes[made[0]]
            graph.redefine(graph.nodes[name], "Const", graph.nodes[name].inputs, copy.attrs)
            graph.replace_all_uses_with(TensorRef(copy.name), original)
            del graph.nodes[copy.name]

    def _converted_constant(self, const: Node, want: int) -> TensorRef:
        """A copy of the float Const ``const`` in dtype ``want`` (float16: clamped to its range)."""
        array = tf.make_ndarray(const.attrs["value"].tensor)
        if want == DT_HALF and array.size and np.abs(array).max() > FLOAT16_MAX:
            array = np.clip(array, -FLOAT16_MAX, FLOAT16_MAX)
            self.stats.constants_clamped += 1
        copy = self.graph.add_node(
            "Const",
            f"{const.name}/tfpolicy/as_{tf_names.dtype_name(want)}",
            [f"^{c}" for c in const.control_inputs()],
            {"dtype": type_attr(want), "value": tensor_attr(np.asarray(array, dtype=numpy_dtype(want)))},
            device=const.device,
        )
        self.stats.retyped[self._layer(const)] += 1
        self._constant_copies.setdefault(const.name, []).append(copy.name)
        return TensorRef(copy.name)

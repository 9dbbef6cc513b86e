"""bfloat16 ops whose CPU kernel is slow, computed in float32 where that gives the same bits.

TensorFlow's CPU kernels for some bfloat16 math run far slower than the
float32 kernel of the same op: on a (1024, 3072) tensor, ``Erfc`` (exact
GELU) takes 25 ms in bfloat16 and 5 ms in float32 plus 2 ms of Casts; ``Tanh``
(GELU's tanh form) 3.6 ms against 2.2 ms. Where the float32 kernel, rounded
to bfloat16, gives exactly the bfloat16 kernel's result, the op is computed
in float32 between two Casts::

    x:bf16 -> Erfc(T=bf16) -> y        becomes    x:bf16 -> Cast(f32) -> Erfc(T=f32) -> Cast(bf16) -> y

The output is then Keras's bit for bit. "Exactly" is checked, not assumed:
before an op type is widened, both kernels run on every one of the 65,536
bfloat16 values on this machine (:func:`computes_the_same`, a few
milliseconds once per process); ops whose kernels disagree somewhere
(``Sigmoid`` and ``Softplus`` do, by one bfloat16 step on some inputs) stay
as they are. Not under XLA (``--target gpu``/``tpu``), which compiles each
op its own way.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np

from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.tf_names import DT_BFLOAT16, DT_FLOAT, TensorRef, bool_attr, type_attr
from tfpolicy.passes import PassResult

logger = logging.getLogger(__name__)

WIDENED_OPS = ("Erfc", "Tanh", "Rsqrt")
"""Unary ops whose bfloat16 CPU kernel is at least 1.25x slower than float32's plus two Casts (measured, TF 2.21)."""


@functools.lru_cache(maxsize=None)
def computes_the_same(op: str) -> bool:
    """Whether ``op`` on bfloat16 equals ``op`` on float32 rounded to bfloat16, for every bfloat16 value.

    Each value is repeated so the kernels' vectorized paths run, as they do on
    real activations; NaN equals NaN whatever its payload.
    """
    import tensorflow as tf

    every = tf.bitcast(tf.constant(np.arange(2**16, dtype=np.uint16)), tf.bfloat16)
    x = tf.reshape(tf.tile(every, [16]), [1024, 1024])
    kernel = getattr(tf.raw_ops, op)
    narrow = tf.cast(kernel(x=x), tf.float32).numpy()
    wide = tf.cast(tf.cast(kernel(x=tf.cast(x, tf.float32)), tf.bfloat16), tf.float32).numpy()
    same = (narrow.view(np.uint32) == wide.view(np.uint32)) | (np.isnan(narrow) & np.isnan(wide))
    if not same.all():
        logger.debug("bfloat16 %s differs from float32 %s rounded on %d values: kept", op, op, int((~same).sum()))
    return bool(same.all())


def is_widened(graph: Graph, node: Node) -> bool:
    """Whether ``node`` is a :data:`WIDENED_OPS` op computed in float32 between a Cast from and one to bfloat16.

    What this pass writes, so a second rewrite of an output leaves it alone.
    """
    if node.op not in WIDENED_OPS or node.attrs["T"].type != DT_FLOAT:
        return False
    (_, x), = node.data_inputs()
    producer = graph.producer(x)
    users = graph.uses(TensorRef(node.name))
    return (producer.op == "Cast" and producer.attrs["SrcT"].type == DT_BFLOAT16 and len(users) == 1
            and graph.nodes[users[0][0]].op == "Cast" and graph.nodes[users[0][0]].attrs["DstT"].type == DT_BFLOAT16)


@dataclasses.dataclass
class WideKernelsStats:
    widened: dict[str, int] = dataclasses.field(default_factory=dict)  # op type -> ops computed in float32


class WideKernelsPass:
    """Compute :data:`WIDENED_OPS` of ``graph`` that run in bfloat16 in float32 (see the module doc)."""

    def __init__(self, signature: str, graph: Graph) -> None:
        self.signature, self.graph = signature, graph
        self.name = f"wide_kernels[{signature}:{graph.name}]"

    def run(self) -> PassResult[WideKernelsStats]:
        stats = WideKernelsStats()
        for node in list(self.graph.nodes.values()):
            if node.op not in WIDENED_OPS or node.attrs["T"].type != DT_BFLOAT16 or not computes_the_same(node.op):
                continue
            (_, x), = node.data_inputs()
            control = [f"^{c}" for c in node.control_inputs()]
            wide_x = self.graph.add_node("Cast", f"{node.name}/tfpolicy/wide_input", [str(x)], {
                "SrcT": type_attr(DT_BFLOAT16), "DstT": type_attr(DT_FLOAT), "Truncate": bool_attr(False)},
                device=node.device)
            wide = self.graph.add_node(node.op, f"{node.name}/tfpolicy/float32", [wide_x.name, *control],
                                       {**node.attrs, "T": type_attr(DT_FLOAT)}, device=node.device)
            self.graph.redefine(node, "Cast", [str(TensorRef(wide.name))], {
                "SrcT": type_attr(DT_FLOAT), "DstT": type_attr(DT_BFLOAT16), "Truncate": bool_attr(False)})
            stats.widened[node.op] = stats.widened.get(node.op, 0) + 1
        if stats.widened:
            logger.info("%s: bfloat16 ops computed in float32: %s", self.name,
                        ", ".join(f"{n} {op}" for op, n in sorted(stats.widened.items())))
        return PassResult(bool(stats.widened), stats)

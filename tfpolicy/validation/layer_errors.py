"""Per-layer error: compare each layer's output tensors in the float and the rewritten graph.

Used by :mod:`tfpolicy.validation.compare`. Both SavedModels are loaded through the
serde boundary (:func:`tfpolicy.core.savedmodel_io.load`: inlined signature graphs),
and the float model is indexed (:func:`tfpolicy.analysis.layer_index.build`) so that
every node has a layer path. A layer's output tensors are the float outputs of
its nodes that a node of another layer, or the signature's result, reads.

Three evaluations per batch, each a function built from a signature graph with
extra fetches (:func:`tfpolicy.core.savedmodel_save.rebuild_function`, as the rewrite rebuilds a signature)::

    float:       inputs -> every layer output tensor t           (the reference, ref[t])
    cumulative:  inputs -> rewritten t                           (errors accumulated up to t)
    local:       inputs, feed_t = ref[t] -> rewritten t           (feed_t replaces t for the
                                                                   readers in other layers)

so the local error of a layer is what the layer adds when its inputs are the
float model's. Nothing here mutates a graph it did not load itself.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import math
import pathlib
from typing import Any, Optional, Union

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2

from tfpolicy.analysis import layer_index
from tfpolicy.analysis.plan import OUTSIDE_LAYERS
from tfpolicy.core import savedmodel_io, savedmodel_save
from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.savedmodel_io import SignatureProgram
from tfpolicy.core.tf_names import FLOAT_DTYPES, TensorRef, parse_input

logger = logging.getLogger(__name__)

FEED_PREFIX = "tfpolicy_feed"
_SKIPPED_PRODUCERS = frozenset({"Placeholder", "Const", "VarHandleOp", "_Arg"})


@dataclasses.dataclass
class ErrorAccumulator:
    """Running sums over batches for one compared quantity."""

    sum_sq_diff: float = 0.0
    sum_sq_ref: float = 0.0
    sum_sq_out: float = 0.0
    sum_dot: float = 0.0
    max_abs_diff: float = 0.0
    max_abs_ref: float = 0.0
    count: int = 0
    mismatches: int = 0  # non-float values that differ

    def add(self, reference: np.ndarray, output: np.ndarray) -> None:
        if not _numeric(reference) or reference.dtype.kind == "b":
            self.mismatches += int(np.sum(reference != output))
            self.count += reference.size
            return
        ref = np.asarray(reference, dtype=np.float64).reshape(-1)
        out = np.asarray(output, dtype=np.float64).reshape(-1)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = out - ref
            # Sums of products as dot products (BLAS, no temporary arrays).
            squared_diff = float(np.dot(diff, diff))
            self.sum_sq_diff += squared_diff
            self.sum_sq_ref += float(np.dot(ref, ref))
            self.sum_sq_out += float(np.dot(out, out))
            self.sum_dot += float(np.dot(ref, out))
        if diff.size:
            finite = math.isfinite(squared_diff) or bool(np.all(np.isfinite(diff)))
            self.max_abs_diff = max(self.max_abs_diff, max(float(diff.max()), -float(diff.min())) if finite else math.inf)
            self.max_abs_ref = max(self.max_abs_ref, max(float(ref.max()), -float(ref.min())))
        self.count += ref.size

    def merge(self, other: "ErrorAccumulator") -> None:
        for field in dataclasses.fields(self):
            if field.name.startswith("max_"):
                setattr(self, field.name, max(getattr(self, field.name), getattr(other, field.name)))
            else:
                setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    @property
    def max_rel_error(self) -> float:
        return _ratio(self.max_abs_diff, self.max_abs_ref)

    @property
    def rel_rms_error(self) -> float:
        return _ratio(math.sqrt(self.sum_sq_diff), math.sqrt(self.sum_sq_ref)) if _finite(self.sum_sq_diff) else math.inf

    @property
    def cosine(self) -> float:
        norms = math.sqrt(self.sum_sq_ref) * math.sqrt(self.sum_sq_out)
        if not _finite(norms) or not _finite(self.sum_dot):
            return math.nan
        if norms == 0:
            return 1.0 if self.sum_sq_ref == self.sum_sq_out else 0.0
        return self.sum_dot / norms


def _numeric(array: np.ndarray) -> bool:
    return array.dtype.kind in "fciub" or array.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _ratio(num: float, den: float) -> float:
    if num == 0:
        return 0.0
    return num / den if den > 0 else math.inf


def _finite(value: float) -> bool:
    return math.isfinite(value)


def json_float(value: float) -> Union[float, str]:
    """Finite floats as numbers; inf/nan as strings, which every JSON parser accepts."""
    return float(value) if math.isfinite(value) else str(value)


@dataclasses.dataclass(frozen=True)
class LayerStats:
    layer: Optional[str]
    tensors: tuple[str, ...]
    rel_error: float  # local: what this layer adds, given the float model's inputs
    max_abs_error: float  # local
    cosine: float  # local
    cumulative_rel_error: float  # at the layer's outputs in the plain rewritten run
    shapes: tuple[tuple[int, ...], ...] = ()  # of ``tensors`` in the last batch (what a layer's work scales with)

    @property
    def label(self) -> str:
        return self.layer if self.layer is not None else OUTSIDE_LAYERS

    def to_json(self) -> dict:
        return {
            "layer": self.layer,
            "tensors": list(self.tensors),
            "rel_error": json_float(self.rel_error),
            "max_abs_error": json_float(self.max_abs_error),
            "cosine": json_float(self.cosine),
            "cumulative_rel_error": json_float(self.cumulative_rel_error),
        }



class Reference:
    """The float model's signature and its layer index (read only), and its layer outputs on batches.

    The float model's layer outputs on a batch are computed once: comparing
    several rewrites with one input (``tfpolicy suggest``) runs the float model once.
    """

    def __init__(self, program: SignatureProgram, index: layer_index.LayerIndex, optimized: bool = True) -> None:
        self.program = program
        self.index = index
        self.outputs = layer_outputs(program, index)  # tensor -> its layer
        self.optimized = optimized  # the comparison's functions run through grappler, as served (see optimizations)
        self._function: Any = None
        self._values: dict[bytes, dict[TensorRef, np.ndarray]] = {}

    def values(self, args: list[tf.Tensor]) -> dict[TensorRef, np.ndarray]:
        """Every layer output tensor's value (as float32) with the signature's inputs ``args``, in order."""
        key = b"".join(_fingerprint(a) for a in args)
        if key not in self._values:
            if self._function is None:
                self._function = _function(self.program, {_fetch_key(i): ref for i, ref in enumerate(self.outputs)}, [])
            with optimizations(self.optimized):
                values = _numpy(self._function(*args))
            self._values[key] = {ref: values[_fetch_key(i)] for i, ref in enumerate(self.outputs)}
        return self._values[key]


def load_reference(input_path: pathlib.Path, key: str) -> Reference:
    """The float model's signature ``key`` for :func:`compare_layers` and :func:`compare_programs`."""
    reference = savedmodel_io.load(input_path, [key])
    return Reference(reference.signatures[key], layer_index.build(reference))


def compare_layers(
    input_path: pathlib.Path, output_path: pathlib.Path, key: str, batches: list[dict[str, np.ndarray]],
    reference: Optional[Reference] = None, cumulative: bool = True,
) -> list[LayerStats]:
    """Local and cumulative error of every layer of signature ``key``, largest local first.

    ``reference``: :func:`load_reference` of ``input_path``, when the caller
    compares several outputs with one input (``tfpolicy suggest``).
    ``cumulative=False`` skips the plain rewritten run (its errors are NaN).
    """
    reference = reference or load_reference(input_path, key)
    rewritten_program = savedmodel_io.load(output_path, [key]).signatures[key]
    inline_calls(rewritten_program)
    handles = {placeholder: capture.handle for placeholder, capture in rewritten_program.captures.items()}
    return compare_programs(reference, rewritten_program, handles, batches, cumulative)


def compare_programs(
    reference: Reference, rewritten: SignatureProgram, handles: dict[str, Any], batches: list[dict[str, np.ndarray]],
    cumulative: bool = True,
) -> list[LayerStats]:
    """:func:`compare_layers` of a rewritten signature at hand (its graph is copied, not changed),
    its capture placeholders bound to ``handles``."""
    rewritten = dataclasses.replace(rewritten, graph=rewritten.graph.copy(rewritten.graph.name))
    float_program, index = reference.program, reference.index
    compared = _compared_tensors(reference, rewritten.graph)
    if not compared:
        return []
    rewritten_fetches = {_fetch_key(i): c.rewritten_ref for i, c in enumerate(compared)}
    cumulative_fn = _function(rewritten, rewritten_fetches, [], handles) if cumulative else None
    feeds = _cut_layer_boundaries(rewritten.graph, float_program, compared, index)
    local_fn = _function(rewritten, rewritten_fetches, [f"{name}:0" for name in feeds], handles)
    feed_dtypes = [tf.dtypes.as_dtype(rewritten.graph.tensor_dtype(c.rewritten_ref)) for c in compared]
    local = [ErrorAccumulator() for _ in compared]
    accumulated = [ErrorAccumulator() for _ in compared]
    shapes: list[tuple[int, ...]] = [() for _ in compared]
    names = _input_names(float_program)
    for batch in batches:
        args = [tf.constant(batch[name]) for name in names]
        every = reference.values(args)
        ref_values = [every[c.float_ref] for c in compared]
        fed = [tf.cast(tf.constant(value), dtype) for value, dtype in zip(ref_values, feed_dtypes)]
        with optimizations(reference.optimized):
            cumulative_values = _numpy(cumulative_fn(*args)) if cumulative_fn is not None else None
            local_values = _numpy(local_fn(*args, *fed))
        for i in range(len(compared)):
            fetched = _fetch_key(i)
            local[i].add(ref_values[i], local_values[fetched])
            if cumulative_values is not None:
                accumulated[i].add(ref_values[i], cumulative_values[fetched])
            shapes[i] = tuple(int(n) for n in np.shape(ref_values[i]))
    return _per_layer(compared, local, accumulated, shapes)


@contextlib.contextmanager
def optimizations(enabled: bool):
    """Grappler on (TensorFlow's default) or off for the functions first called inside.

    A comparison's functions fetch every layer output and are called once
    per batch: grappler's pass over such a graph at the first call costs
    more than the run. ``tfpolicy suggest`` (its per-layer errors are
    estimates that share out a measured error) turns it off; ``--validate``
    keeps it, so its numbers are those of the graph as served (grappler's
    fusions can round a bfloat16 layer differently).
    """
    if enabled:
        yield
        return
    before = tf.config.optimizer.get_experimental_options().get("disable_meta_optimizer", False)
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": before})


def _fingerprint(value: tf.Tensor) -> bytes:
    array = value.numpy()
    return hashlib.sha256(repr((array.dtype.str, array.shape)).encode() + array.tobytes()).digest()


@dataclasses.dataclass(frozen=True)
class _Compared:
    """One layer output tensor, by its name in each graph."""

    float_ref: TensorRef
    rewritten_ref: TensorRef
    layer: Optional[str]


def layer_outputs(program: SignatureProgram, index: layer_index.LayerIndex) -> dict[TensorRef, Optional[str]]:
    """Float tensors of the signature graph read by another layer or returned, -> their layer."""
    graph = program.graph
    returned = set(graph.outputs.values())
    found: dict[TensorRef, Optional[str]] = {}
    for node in graph.nodes.values():
        if node.op in _SKIPPED_PRODUCERS:
            continue
        layer = index.layer_of(program.key, graph, node)
        for position, dtype in enumerate(graph.output_dtypes(node)):
            if dtype not in FLOAT_DTYPES:
                continue
            ref = TensorRef(node.name, position)
            readers = [graph.nodes[name] for name, _ in graph.uses(ref)]
            if ref in returned or any(index.layer_of(program.key, graph, r) != layer for r in readers):
                found[ref] = layer
    return found


def inline_calls(program: SignatureProgram, depth: int = 3) -> None:
    """Inline the function calls grappler left in the signature graph, in place.

    Grappler declines to inline a body whose stateful ops (a table lookup) are
    not reachable from its control source; the comparison still needs the
    body's tensors at top level. A body node ``n`` of call ``c`` becomes
    ``c/n``, as grappler would name it; the call node stays, unread, and is
    pruned away when a function is built from the graph.

        c = StatefulPartitionedCall(x, table) {f: body}   y = Identity(c)
          -->  c/lookup = LookupTableFindV2(table, x) ...   y = Identity(c/out)
    """
    graph = program.graph
    for _ in range(depth):
        calls = [
            n for n in graph.nodes.values()
            if n.op in ("StatefulPartitionedCall", "PartitionedCall") and n.attrs["f"].func.name in program.functions
        ]
        if not calls:
            return
        for call in calls:
            _inline_call(graph, call, program.functions[call.attrs["f"].func.name])


def _inline_call(graph: Graph, call: Node, body: Graph) -> None:
    prefix = call.name + "/"
    arguments = [text for text in call.inputs if not text.startswith("^")]
    sources = {n.name: arguments[n.attrs["index"].i] for n in body.nodes.values() if n.op == "_Arg"}

    def remap(text: str) -> str:
        ref, control = parse_input(text)
        if ref is None:
            source = sources.get(control)
            return "^" + (parse_input(source)[0].node if source is not None else prefix + control)
        if ref.node in sources:
            return sources[ref.node]
        return str(TensorRef(prefix + ref.node, ref.index))

    for node in body.nodes.values():
        if node.op != "_Arg":
            graph.add_node(node.op, prefix + node.name, [remap(t) for t in node.inputs], node.attrs, node.device)
    for position, ref in enumerate(body.outputs.values()):
        graph.replace_all_uses_with(TensorRef(call.name, position), parse_input(remap(str(ref)))[0])


def name_prefix(float_names: list[str], rewritten: Graph) -> str:
    """The scope the rewritten graph puts before the float graph's node names.

    Saving wraps each rewritten signature in one more function call, so after
    loading and inlining ``a/MatMul`` is ``StatefulPartitionedCall/a/MatMul``;
    the prefix is found, not assumed: the one most float names have.
    """
    by_suffix: dict[str, list[str]] = {}
    for name in rewritten.nodes:
        parts = name.split("/")
        for start in range(len(parts)):
            by_suffix.setdefault("/".join(parts[start:]), []).append("".join(p + "/" for p in parts[:start]))
    counts = collections.Counter(prefix for name in float_names for prefix in by_suffix.get(name, ()))
    return counts.most_common(1)[0][0] if counts else ""


def _compared_tensors(reference: Reference, rewritten: Graph) -> list[_Compared]:
    """Layer outputs of the float graph that the rewritten graph still has, as a float tensor."""
    outputs = reference.outputs
    prefix = name_prefix([ref.node for ref in outputs], rewritten)
    compared = []
    for ref, layer in outputs.items():
        node = rewritten.nodes.get(prefix + ref.node)
        if node is None:
            continue
        dtypes = rewritten.output_dtypes(node)
        if ref.index < len(dtypes) and dtypes[ref.index] in FLOAT_DTYPES:
            compared.append(_Compared(ref, TensorRef(node.name, ref.index), layer))
    logger.debug("comparing %d of %d layer output tensors (prefix %r)", len(compared), len(outputs), prefix)
    return compared


def _cut_layer_boundaries(
    graph: Graph, float_program: SignatureProgram, compared: list[_Compared], index: layer_index.LayerIndex
) -> list[str]:
    """Give each compared tensor a placeholder that its readers in other layers read instead.

    ``graph`` is the rewritten signature graph, loaded for this comparison only.
    A reader the float graph lacks (a Cast the rewrite inserted) counts as
    another layer's. Returns the placeholder names, in ``compared`` order.
    """
    float_graph = float_program.graph
    prefix_length = len(compared[0].rewritten_ref.node) - len(compared[0].float_ref.node)
    feeds = []
    for item in compared:
        dtype = graph.tensor_dtype(item.rewritten_ref)
        placeholder = graph.add_node(
            "Placeholder",
            f"{FEED_PREFIX}/{item.float_ref.node}/{item.float_ref.index}",
            [],
            {
                "dtype": attr_value_pb2.AttrValue(type=dtype),
                "shape": attr_value_pb2.AttrValue(shape=tensor_shape_pb2.TensorShapeProto(unknown_rank=True)),
            },
        )
        feeds.append(placeholder.name)
        for reader_name, position in graph.uses(item.rewritten_ref):
            float_reader = float_graph.nodes.get(reader_name[prefix_length:])
            if float_reader is not None and index.layer_of(float_program.key, float_graph, float_reader) == item.layer:
                continue
            graph.replace_input(graph.nodes[reader_name], position, TensorRef(placeholder.name))
    return feeds


def _function(program: SignatureProgram, fetches: dict[str, TensorRef], extra_inputs: list[str],
              handles: Optional[dict[str, Any]] = None) -> Any:
    """A callable graph: the signature's inputs (+ ``extra_inputs``), positionally -> ``fetches``.

    Capture placeholders are bound to ``handles`` (default: the loaded program's own).
    """
    if handles is None:
        handles = {placeholder: capture.handle for placeholder, capture in program.captures.items()}
    return savedmodel_save.rebuild_function(program, handles, outputs=fetches, extra_inputs=extra_inputs,
                                           positional=True)


def _input_names(program: SignatureProgram) -> list[str]:
    """Signature input names in the order of ``program.input_tensors`` (nest's flat order)."""
    args, kwargs = program.function.structured_input_signature
    return [spec.name for spec in tf.nest.flatten(args)] + sorted(kwargs or {})


def _numpy(values: dict[str, tf.Tensor]) -> dict[str, np.ndarray]:
    return {name: np.asarray(tf.cast(value, tf.float32).numpy()) for name, value in values.items()}


def _fetch_key(position: int) -> str:
    return f"t{position:05d}"


def _per_layer(compared: list[_Compared], local: list[ErrorAccumulator], cumulative: list[ErrorAccumulator],
               shapes: list[tuple[int, ...]]) -> list[LayerStats]:
    grouped: dict[Optional[str], list[int]] = {}
    for i, item in enumerate(compared):
        grouped.setdefault(item.layer, []).append(i)
    stats = []
    for layer, positions in grouped.items():
        local_total, cumulative_total = ErrorAccumulator(), ErrorAccumulator()
        for i in positions:
            local_total.merge(local[i])
            cumulative_total.merge(cumulative[i])
        stats.append(
            LayerStats(
                layer=layer,
                tensors=tuple(str(compared[i].float_ref) for i in positions),
                rel_error=local_total.rel_rms_error,
                max_abs_error=local_total.max_abs_diff,
                cosine=local_total.cosine,
                cumulative_rel_error=cumulative_total.rel_rms_error,
                shapes=tuple(shapes[i] for i in positions),
            )
        )
    return sorted(stats, key=lambda s: (-_sortable(s.rel_error), s.layer or ""))


def _sortable(value: float) -> float:
    return math.inf if math.isnan(value) else value

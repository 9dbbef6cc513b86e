"""What ``tfpolicy suggest`` measures: errors, latencies and bytes of real rewrites.

Every number the search uses comes from running the rewrite's output (kept in
memory by :func:`tfpolicy.api.rewrite_in_memory`: the graphs and variables
:func:`tfpolicy.rewrite` would write) on the user's data, on this machine:

* a model's output error against the float input (:class:`Metric`: relative
  max error, relative RMS error, or top-1 disagreement);
* per layer, the error it adds when fed the float model's inputs (the
  per-layer report of ``--validate``, :func:`tfpolicy.validation.layer_errors.compare_programs`);
* latency: the fastest of a few calls of ``serving_default`` on one batch;
* bytes: the variables the rewrite stores for a layer, by policy.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfpolicy.analysis import layer_index
from tfpolicy.core import inputs, savedmodel_io, tf_internals
from tfpolicy.errors import InputDataError
from tfpolicy.validation.layer_errors import LayerStats, Reference, compare_programs

SIGNATURE = "serving_default"
METRICS = ("rel_max", "rel_rms", "top1")
TIMING_SECONDS = 0.5  # latency: calls are timed until their total passes this (see Model.latency)
TIMING_CALLS = 10  # and no more calls than this
Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Metric:
    """How far an output is from the float input's: ``rel_max`` max|y - y0| / max|y0|, ``rel_rms``
    ||y - y0|| / ||y0||, ``top1`` the share of rows whose argmax over the last axis differs."""

    name: str
    output: str

    def __call__(self, reference: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> float:
        ref = [np.asarray(r, np.float64) for r in reference]
        out = [np.asarray(g, np.float64) for g in got]
        if self.name == "top1":
            rows = sum(r[..., 0].size for r in ref)
            differ = sum(int(np.sum(np.argmax(r, -1) != np.argmax(o, -1))) for r, o in zip(ref, out))
            return differ / max(rows, 1)
        if not all(np.all(np.isfinite(o)) for o in out):
            return math.inf
        if self.name == "rel_max":
            top = max(float(np.max(np.abs(r))) for r in ref)
            return max(float(np.max(np.abs(o - r))) for r, o in zip(ref, out)) / (top or 1.0)
        num = sum(float(np.sum((o - r) ** 2)) for r, o in zip(ref, out))
        den = sum(float(np.sum(r * r)) for r in ref)
        return math.sqrt(num / (den or 1.0))


def choose_output(function: Any, requested: Optional[str]) -> str:
    """The output the metric reads: the only one, or the one the user named."""
    names = sorted(function.structured_outputs)
    if requested is not None:
        if requested not in names:
            raise InputDataError(f"--output '{requested}' is not an output of {SIGNATURE}; its outputs: {', '.join(names)}")
        return requested
    if len(names) != 1:
        raise InputDataError(f"{SIGNATURE} has {len(names)} outputs ({', '.join(names)}): name the one to measure"
                             " with --output")
    return names[0]


class Model:
    """A ``serving_default`` to run (of a loaded SavedModel, or of a rewrite kept in memory):
    outputs on batches, its latency, and the bytes its variables take."""

    def __init__(self, function: Any, variable_bytes: int, owner: Any = None) -> None:
        self.function = function
        self.variable_bytes = variable_bytes
        self._owner = owner  # what keeps the function's variables alive

    @classmethod
    def load(cls, path: pathlib.Path) -> "Model":
        return cls.of_root(tf.saved_model.load(str(path)))

    @classmethod
    def of_root(cls, root: Any) -> "Model":
        """``serving_default`` of a SavedModel loaded by ``tf.saved_model.load`` (its variables restored)."""
        variables = {id(v): v for v in tf_internals.trackable_descendants(root) if isinstance(v, tf.Variable)}
        return cls(root.signatures[SIGNATURE], sum(_bytes(v) for v in variables.values()), root)

    @classmethod
    def in_memory(cls, rewritten: Any) -> "Model":
        """``serving_default`` of :func:`tfpolicy.api.rewrite_in_memory`'s result."""
        return cls(rewritten.signatures[SIGNATURE], rewritten.variable_bytes, rewritten)

    def outputs(self, batches: Sequence[Batch], name: str, seconds: Optional[list[float]] = None) -> list[np.ndarray]:
        """Output ``name`` on each batch; ``seconds``, when given, receives each call's time."""
        found = []
        for batch in batches:
            feed = {k: tf.constant(v) for k, v in batch.items()}
            started = time.perf_counter()
            found.append(self.function(**feed)[name].numpy())
            if seconds is not None:
                seconds.append(time.perf_counter() - started)
        return found

    def latency(self, batch: Batch, samples: Sequence[float] = ()) -> float:
        """Seconds of the fastest call on ``batch`` (a graph call, as TF Serving makes it).

        ``samples``: calls on this batch already timed. Calls are made until
        there are two and their total passes :data:`TIMING_SECONDS` (at most
        :data:`TIMING_CALLS`), and a third when the two fastest differ by more
        than 5%: a depth-12 encoder takes two or three calls, a small model
        enough for its milliseconds to settle. No warm-up: suggest times a
        function after its first call (which optimizes the graph).
        """
        feed = {k: tf.constant(v) for k, v in batch.items()}
        taken = list(samples)
        while len(taken) < TIMING_CALLS:
            if len(taken) >= 2:
                first, second = sorted(taken)[:2]
                if sum(taken) >= TIMING_SECONDS and (second <= 1.05 * first or len(taken) >= 3):
                    break
            started = time.perf_counter()
            result = self.function(**feed)
            for value in result.values():
                value.numpy()
            taken.append(time.perf_counter() - started)
        return min(taken)


def _bytes(variable: tf.Variable) -> int:
    return int(variable.shape.num_elements() or 0) * variable.dtype.size


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """A layer the map can address, with what its work and storage scale with."""

    kernels: tuple[tuple[int, ...], ...]  # rank >= 2 variables: what int8/int4/float8 quantize
    other_elements: int  # biases, norms' scales
    kernel_names: tuple[str, ...]


def layer_shapes(index: layer_index.LayerIndex) -> dict[str, LayerShape]:
    """Every layer that owns variables, by its path (as the rewrite finds it, in the input's ``index``)."""
    found: dict[str, LayerShape] = {}
    for path, info in index.layers.items():
        kernels, names, other = [], [], 0
        for variable in info.variables:
            shape = tuple(int(n or 0) for n in variable.shape)
            if len(shape) >= 2:
                kernels.append(shape)
                names.append(variable.name)
            else:
                other += int(np.prod(shape)) if shape else 1
        if kernels or other:
            found[path] = LayerShape(tuple(kernels), other, tuple(names))
    return found


def multiply_adds(layer: LayerShape, stats: Optional[LayerStats]) -> float:
    """Multiply-adds per call of ``layer``'s kernels, from the shape of its output.

    A kernel's output features are its trailing dimensions that end the
    output's shape too (Dense ``(K, N)`` -> ``[..., N]``, EinsumDense ``(768,
    12, 64)`` -> ``[..., 12, 64]``, Conv2D ``(3, 3, C, N)`` -> ``[..., N]``);
    each output element costs the rest of the kernel. An embedding table is
    a lookup (no multiply-adds).
    """
    if stats is None or not stats.shapes:
        return 0.0
    output = max(stats.shapes, key=lambda s: int(np.prod(s)) if s else 0)
    elements = float(np.prod(output)) if output else 0.0
    total = 0.0
    for shape, name in zip(layer.kernels, layer.kernel_names):
        if name.rsplit("/", 1)[-1].split(":")[0] in ("embeddings", "embedding"):
            continue
        trailing = 0
        while trailing < min(len(shape), len(output)) and shape[-1 - trailing] == output[-1 - trailing]:
            trailing += 1
        features = int(np.prod(shape[len(shape) - max(trailing, 1):]))
        total += elements * (int(np.prod(shape)) / max(features, 1))
    return total


def reference_of(source: savedmodel_io.LoadedModel) -> Reference:
    """The float model's ``serving_default`` and layer index for :func:`local_errors` (read only).

    Its comparisons run without grappler (see :func:`tfpolicy.validation.layer_errors.optimizations`):
    the local errors are estimates, and grappler's pass costs more than the one run of each.
    """
    return Reference(source.signatures[SIGNATURE], layer_index.build(source), optimized=False)


def local_errors(reference: Reference, rewritten: Any, batches: Sequence[Batch]) -> dict[str, LayerStats]:
    """Per layer path: the error it adds fed the float model's inputs (``--validate``'s per-layer report).

    ``reference``: :func:`reference_of` the input, loaded once; ``rewritten``:
    :func:`tfpolicy.api.rewrite_in_memory`'s result.
    """
    stats = compare_programs(reference, rewritten.programs[SIGNATURE], rewritten.handles[SIGNATURE], list(batches),
                             cumulative=False)
    return {s.layer: s for s in stats if s.layer}


VARIABLE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def stored_bytes(layer: LayerShape, policy: Any, quantized: bool) -> float:
    """Bytes the rewrite stores for ``layer`` under ``policy`` (a Keras DTypePolicy).

    Variables take the policy's compute dtype (a float32 variable read only
    in bfloat16, as a ``mixed_bfloat16`` layer reads it, is stored in
    bfloat16: :mod:`tfpolicy.passes.read_dtype`); a quantized layer's kernels
    take int8 (one byte, a float32 scale per output channel) or int4 (half a
    byte, a scale per block); float8 keeps its kernel in the compute dtype
    (stored quantize-dequantized) and adds a few scalars.
    """
    per = VARIABLE_BYTES.get(policy.compute_dtype, VARIABLE_BYTES.get(policy.variable_dtype, 4))
    mode = getattr(policy, "quantization_mode", None) if quantized else None
    total = layer.other_elements * per
    for shape in layer.kernels:
        size = int(np.prod(shape))
        if mode == "int8":
            total += size + 4 * shape[-1]
        elif mode == "int4":
            block = getattr(policy, "block_size", None) or shape[0]
            total += size / 2 + 4 * shape[-1] * max(1, math.ceil(shape[0] / block))
        else:
            total += size * per + (12 * 4 if mode == "float8" else 0)
    return float(total)


def split_rows(batches: Sequence[Batch], held_out: float) -> tuple[list[Batch], list[Batch]]:
    """(search rows, held-out rows): the last ``held_out`` share of the rows, at least one, are held out."""
    rows = sum(inputs.batch_rows(b) for b in batches)
    if rows < 2:
        raise InputDataError(f"--data holds {rows} row(s); suggest needs at least 2 (some are held out to verify)")
    keep = rows - max(1, int(round(rows * held_out)))
    search, verify, seen = [], [], 0
    for batch in batches:
        n = inputs.batch_rows(batch)
        if seen + n <= keep:
            search.append(batch)
        elif seen >= keep:
            verify.append(batch)
        else:
            search.append(rows_of(batch, 0, keep - seen))
            verify.append(rows_of(batch, keep - seen, n))
        seen += n
    return search, verify


def rows_of(batch: Mapping[str, np.ndarray], start: int, stop: int) -> Batch:
    """Rows ``start:stop`` of every batch-first array; a scalar input goes with every slice."""
    return {k: v[start:stop] if np.ndim(v) else v for k, v in batch.items()}

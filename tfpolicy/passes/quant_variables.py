"""The variables quantization adds, and their initial values from the float weights.

int8 kernels and scales come from Keras's ``abs_max_quantize``; int4 kernels
from Keras's own ``quantize("int4")`` formulas, packed with ``pack_int4``;
float8 scales and amax histories from ``compute_float8_scale`` and
``compute_float8_amax_history``. :func:`build_variables` gives them by name,
for the quantize pass to read and :mod:`tfpolicy.core.assemble` to create.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import keras
import numpy as np
import tensorflow as tf

from tfpolicy.analysis.lowering import Lowering
from tfpolicy.analysis.quant_sites import Int4Kernel, QuantPlan
from tfpolicy.core.assemble import LazyValues, NewVariable
from tfpolicy.core.tf_names import DT_BFLOAT16, DT_FLOAT, DT_FLOAT8_E4M3FN, DT_INT8, DT_INT32, numpy_dtype

FLOAT8 = DT_FLOAT8_E4M3FN
INT8 = DT_INT8
F32 = DT_FLOAT
INT32 = DT_INT32
# The constants of Keras's formulas (``keras.quantizers``), read from Keras
# and TensorFlow's dtypes: int8 is symmetric in [-127, 127] (``abs_max_quantize``'s
# ``value_range``), with Keras's epsilon under the scale; float8 e4m3's
# largest finite value bounds ``compute_float8_scale``.
INT8_RANGE = float(np.iinfo(np.int8).max)
EPSILON = float(keras.config.epsilon())
FLOAT8_E4M3_MAX = float(tf.dtypes.experimental.float8_e4m3fn.max)
U8_SHIFT = 128
"""oneDNN's quantized matmul takes uint8 inputs: int8 values are shifted by 128 (see analysis/lowering.py)."""
FLOAT32_EXACT_INTEGER = 2**24
"""Integers up to 2^24 are exact in float32: the bound for oneDNN's float32 bias add and for float32 matmuls of int8 values."""
FLOAT_CHUNK_LIMIT = FLOAT32_EXACT_INTEGER // int(INT8_RANGE)
"""A float32 matmul of int8 values is exact while each column's sum of ``|w|`` over a chunk stays within this."""
U8_CHUNK_LIMIT = FLOAT32_EXACT_INTEGER // 255
"""oneDNN's u8 x s8 sums stay exact while each column's positive (and negative) weights sum within this."""


def build_variables(
    qplan: QuantPlan, read_value: Callable[[int], np.ndarray], shape_of: Callable[[int], tuple[int, ...]],
    lowering: Optional[Lowering] = None, derived: Optional[dict] = None,
) -> dict[str, NewVariable]:
    """Every variable the quantization adds, by name, with its shape and dtype now and its value when asked.

    int8: the kernel's int8 copy and its per-output-channel ``kernel_scale``
    (the reduced axes squeezed out: ``(units,)`` for a Dense kernel, as Keras).
    float8: ``inputs_scale`` 1 and a zero ``inputs_amax_history`` (Keras's
    initial state until calibration); the kernel's scale and history from
    its weights (``history[0] = max|W|``). ``read_value(uid)`` is called for
    a kernel only when one of its values is read (see :class:`LazyValues`).
    Under the oneDNN lowering, an int8 kernel that an integer matmul reads
    also gets ``<kernel>_u8_correction``, ``-128`` times its sums over the
    contracted axes (int32, one per output channel, in the scale's frame),
    whose companion is how many chunks the contraction is split into so that
    oneDNN's sums stay exact (:func:`u8_exact_chunks`); otherwise the int8
    kernel's companion is the chunks a float32 matmul of it needs
    (:func:`float_exact_chunks`), known from the shape where no column can
    reach the bound (a contraction of at most 1040), else counted on the int8
    kernel once, when the pass asks. ``derived``: a dict that keeps each
    kernel's quantized values once made, for later rewrites of the same load
    (:attr:`tfpolicy.core.savedmodel_io.LoadedModel.derived`).
    """
    variables: dict[str, NewVariable] = {}
    integer = {s.variable_uid for s in qplan.sites if s.integer is not None}
    for kernel in sorted(qplan.int8_kernels.values(), key=lambda k: k.name):
        shape = shape_of(kernel.uid)
        onednn = lowering is not None and lowering.int8_matmul == "onednn" and kernel.uid in integer
        in_order = all(not s.integer.kernel_layout and not s.integer.transpose_kernel
                       for s in qplan.sites if s.variable_uid == kernel.uid and s.integer is not None)
        values = LazyValues(_kept(derived, ("int8", kernel, onednn),
                                  functools.partial(_int8_values, read_value, kernel, onednn)))
        kept = [d for axis, d in enumerate(shape) if axis not in kernel.reduced_axes]
        if not onednn and _one_chunk_by_shape(shape, kernel.reduced_axes, FLOAT_CHUNK_LIMIT):
            chunks = functools.partial(np.int32, 1)  # known from the shape: the pass need not quantize the kernel
        else:
            chunks = _kept(derived, ("int8 chunks", kernel, onednn, in_order), functools.cache(
                functools.partial(_int8_chunks, values, kernel.reduced_axes, onednn, in_order)))
        variables[kernel.name] = NewVariable.part(kernel.name, shape, np.int8, values, 0, replaces=kernel.uid)
        variables[kernel.scale_name] = NewVariable.part(kernel.scale_name, kept, np.float32, values, 1)
        if onednn:
            variables[kernel.correction_name] = NewVariable.part(kernel.correction_name, kept, np.int32, values, 2)
        variables[kernel.correction_name if onednn else kernel.name].companion = chunks
    for kernel in sorted(qplan.int4_kernels.values(), key=lambda k: k.name):
        packed, scale = int4_shapes(kernel)
        values = LazyValues(_kept(derived, ("int4", kernel),
                                  lambda kernel=kernel: int4_values(read_value(kernel.uid), kernel)))
        variables[kernel.name] = NewVariable.part(kernel.name, packed, np.int8, values, 0, replaces=kernel.uid)
        variables[kernel.scale_name] = NewVariable.part(kernel.scale_name, scale, np.float32, values, 1)
        if kernel.block_size is not None:
            variables[kernel.zero_name] = NewVariable.part(kernel.zero_name, scale, np.int8, values, 2)
    for group in sorted(qplan.float8_groups.values(), key=lambda g: g.prefix):
        stored = lowering is not None and lowering.stores_float8_kernels and group.storable_dtype is not None
        values = LazyValues(functools.partial(_float8_values, read_value, group, stored))
        if stored:  # first, so that its one read of the kernel also makes the statistics below
            variables[group.kernel_name] = NewVariable.part(
                group.kernel_name, shape_of(group.kernel_uid), numpy_dtype(group.storable_dtype), values, 2,
                replaces=group.kernel_uid)
        variables[group.name("inputs_scale")] = NewVariable.of(group.name("inputs_scale"), np.float32(1.0).reshape(()))
        variables[group.name("kernel_scale")] = NewVariable.part(
            group.name("kernel_scale"), (), np.float32, values, 0, derived_from=group.kernel_uid)
        variables[group.name("inputs_amax_history")] = NewVariable.of(
            group.name("inputs_amax_history"), np.zeros((group.history_length,), np.float32))
        variables[group.name("kernel_amax_history")] = NewVariable.part(
            group.name("kernel_amax_history"), (group.history_length,), np.float32, values, 1, derived_from=group.kernel_uid)
    return variables


def _kept(derived: Optional[dict], key: tuple, compute: Callable[[], tuple]) -> Callable[[], tuple]:
    """``compute``, its result kept in ``derived`` under ``key`` (values that depend on the float
    variable and ``key`` alone), when ``derived`` is given."""
    if derived is None:
        return compute

    def kept() -> tuple:
        if key not in derived:
            derived[key] = compute()
        return derived[key]

    return kept


def _int8_values(read_value, kernel, onednn: bool = False) -> tuple[np.ndarray, ...]:
    """``(int8 kernel, scale)``: Keras's ``abs_max_quantize``; for the oneDNN lowering also the
    u8 correction, ``-128 x`` the kernel's channel sums."""
    # As Keras's ``quantize("int8")`` calls it: on the kernel as the layer stores it (a bfloat16
    # policy's kernel is bfloat16), in numpy arithmetic of that dtype. The scale is stored in float32,
    # which holds a bfloat16 or float16 scale exactly.
    stored = np.asarray(tf.cast(read_value(kernel.uid), kernel.variable_dtype))
    q, scale = abs_max_quantize(stored, kernel.reduced_axes)
    scale = np.squeeze(scale, axis=kernel.reduced_axes).astype(np.float32)
    if not onednn:
        return q, scale
    correction = np.int32(-U8_SHIFT) * q.astype(np.int32).sum(axis=kernel.reduced_axes, dtype=np.int32)
    return q, scale, correction.astype(np.int32)


def _int8_chunks(values: LazyValues, reduced_axes: tuple[int, ...], onednn: bool, in_order: bool) -> np.int32:
    """The chunks the graph splits the kernel's contraction into, counted on its int8 values:
    :func:`u8_exact_chunks` for the oneDNN lowering, else :func:`float_exact_chunks`."""
    exact_chunks = u8_exact_chunks if onednn else float_exact_chunks
    return np.int32(exact_chunks(values.get(0), reduced_axes, in_order))


def abs_max_quantize(values: np.ndarray, axes: tuple[int, ...],
                     value_range: tuple[int, int] = (-int(INT8_RANGE), int(INT8_RANGE))) -> tuple[np.ndarray, np.ndarray]:
    """Keras's ``abs_max_quantize(values, axes, value_range, to_numpy=True)``, bit for bit: ``(int8 values, scale)``.

    Keras computes in the values' dtype, and numpy's bfloat16 (and float16)
    arithmetic widens and rounds back one element at a time; this takes a few
    float32 passes. The scale comes from Keras's own arithmetic in the values'
    dtype (one value per channel, kept dims); each product of two values of a
    16-bit float dtype is exact in float32 (8 + 8 or 11 + 11 significant bits),
    and rounding it once to that dtype (to nearest, ties to even) is what the
    dtype's multiply gives; rounding, clipping and casting those values is
    exact in float32. Values that are not all finite, and other dtypes, go
    through Keras's function itself.
    """
    values = np.asarray(values)
    dtype = values.dtype
    low, high = value_range
    wide = values.astype(np.float32)  # a copy: the products are computed in it
    amax = np.max(np.abs(wide), axis=axes, keepdims=True)
    if dtype not in _ROUNDED_PRODUCTS or not np.isfinite(amax).all():
        q, scale = keras.quantizers.abs_max_quantize(values, axis=axes, value_range=value_range, to_numpy=True)
        return np.asarray(q), np.asarray(scale)
    scale = np.divide(high, np.add(amax.astype(dtype), EPSILON))  # Keras's expression, in the values' dtype
    np.multiply(wide, scale.astype(np.float32), out=wide)
    _ROUNDED_PRODUCTS[dtype](wide)
    np.rint(wide, out=wide)
    np.clip(wide, low, high, out=wide)
    return wide.astype(np.int8), scale


def _round_to_bfloat16(wide: np.ndarray) -> None:
    """Round finite float32 ``wide`` in place to the nearest bfloat16 (ties to even), as bfloat16 arithmetic rounds."""
    bits = wide.view(np.uint32)
    carry = bits >> np.uint32(16)
    carry &= np.uint32(1)
    carry += np.uint32(0x7FFF)
    bits += carry
    bits &= np.uint32(0xFFFF0000)


def _round_to_float16(wide: np.ndarray) -> None:
    """Round float32 ``wide`` in place to the nearest float16, by numpy's conversion (to nearest, ties to even)."""
    wide[...] = wide.astype(np.float16)


_ROUNDED_PRODUCTS: dict[np.dtype, Callable[[np.ndarray], None]] = {
    np.dtype(np.float32): lambda wide: None,  # float32's own products
    np.dtype(numpy_dtype(DT_BFLOAT16)): _round_to_bfloat16,
    np.dtype(np.float16): _round_to_float16,
}
"""Per dtype Keras may quantize in: how a float32 product of two of its values is rounded to it."""


def chunk_sizes(contracted: int, chunks: int) -> list[int]:
    """``contracted`` values in ``chunks`` contiguous parts, the first ones one longer where it does not divide."""
    return [contracted // chunks + (1 if i < contracted % chunks else 0) for i in range(chunks)]


def u8_exact_chunks(q: np.ndarray, reduced_axes: tuple[int, ...], in_order: bool = True) -> int:
    """How many chunks (:func:`chunk_sizes`) the contraction of ``q`` needs for oneDNN's u8 x s8 sums to stay exact.

    oneDNN sums ``u . w`` (``u = x + 128`` in [0, 255]) into int32, then converts
    the sum to float32 to add the bias: a sum past 2^24 would be rounded. A
    column's sum over a chunk is at most 255 times the larger of its positive
    weights' sum and its negative weights' magnitude there; the fewest chunks
    that keep that within 2^24 in every column. ``in_order``: the matmul
    contracts the kernel's reduced axes as they lie (leading, in order), so
    the chunks are those of the variable; else each chunk is bounded by the
    largest weights of a column wherever they lie. Most kernels need one; a
    long contraction of large weights of one sign needs more.
    """
    limit = U8_CHUNK_LIMIT
    if _one_chunk_by_shape(q.shape, reduced_axes, limit):
        return 1
    sums, magnitudes = _column_totals(q, reduced_axes)
    if max(int(np.max((magnitudes + sums) // 2, initial=0)), int(np.max((magnitudes - sums) // 2, initial=0))) <= limit:
        return 1  # the common case, without an int64 copy of the kernel
    columns = _columns(q, reduced_axes)
    signs = (np.maximum(columns, 0), np.maximum(-columns, 0))
    return _fewest_chunks(signs, limit, in_order and _leading(reduced_axes))


def float_exact_chunks(q: np.ndarray, reduced_axes: tuple[int, ...], in_order: bool = True) -> int:
    """How many chunks the contraction of ``q`` needs for a float32 matmul of int8 values to stay exact.

    The input's values lie in [-127, 127], so every partial sum a float32
    matmul forms of a column, in whatever order it adds (blocked, fused
    multiply-adds), is an integer of magnitude at most 127 times the sum of
    the column's ``|w|`` over the chunk: exact while that is at most 2^24.
    Keras's per-channel ``abs_max_quantize`` gives real kernels ``|w|`` well
    below 127 on average, so a 3072-long contraction is usually one matmul
    (the worst case, every ``|w| = 127``, needs chunks of 1040).
    ``in_order`` as for :func:`u8_exact_chunks`.
    """
    limit = FLOAT_CHUNK_LIMIT
    if _one_chunk_by_shape(q.shape, reduced_axes, limit):
        return 1
    if int(np.max(_column_totals(q, reduced_axes)[1], initial=0)) <= limit:
        return 1  # the common case, without an int64 copy of the kernel
    return _fewest_chunks((np.abs(_columns(q, reduced_axes)),), limit, in_order and _leading(reduced_axes))


def _contracted(shape: tuple[int, ...], reduced_axes: tuple[int, ...]) -> int:
    """How many values each column of a kernel of ``shape`` sums."""
    return int(np.prod([shape[a] for a in reduced_axes]))


def _one_chunk_by_shape(shape: tuple[int, ...], reduced_axes: tuple[int, ...], limit: int) -> bool:
    """Whether no column's sum of ``|q|`` (each at most 127) can pass ``limit``, whatever the values."""
    return _contracted(shape, reduced_axes) * int(INT8_RANGE) <= limit


def _column_totals(q: np.ndarray, reduced_axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per column (the axes not reduced): the sum of ``q`` and the sum of ``|q|``, int64, summed in buffered casts."""
    axes = tuple(reduced_axes)
    return q.sum(axis=axes, dtype=np.int64), np.absolute(q, dtype=np.int16).sum(axis=axes, dtype=np.int64)


def _leading(reduced_axes: tuple[int, ...]) -> bool:
    return tuple(reduced_axes) == tuple(range(len(reduced_axes)))


def _columns(q: np.ndarray, reduced_axes: tuple[int, ...]) -> np.ndarray:
    """``q`` as (contracted, columns), int32 (a sum over a contraction of int8 values fits)."""
    leading = np.moveaxis(q, reduced_axes, range(len(reduced_axes)))
    return leading.reshape(_contracted(q.shape, reduced_axes), -1).astype(np.int32)


_SUMMED_TRIES = 4
"""In-order chunk counts tried by summing each chunk (one pass each) before prefix sums (one slower pass, then any count)."""


def _fewest_chunks(parts: tuple[np.ndarray, ...], limit: int, in_order: bool) -> int:
    """The fewest chunks of the contraction in which every column's sum of each of ``parts`` stays within ``limit``."""
    contracted = parts[0].shape[0]
    total = max(int(part.sum(0, dtype=np.int64).max(initial=0)) for part in parts)
    if total <= limit:
        return 1
    if in_order:
        fewest = max(2, -(-total // limit))  # no fewer chunks can hold the largest column's sum
        prefix = None
        for chunks in range(fewest, contracted + 1):
            sizes = chunk_sizes(contracted, chunks)
            ends = np.cumsum(sizes)
            starts = ends - sizes
            if chunks < fewest + _SUMMED_TRIES:  # the usual case: each chunk summed, one pass
                sums = [np.add.reduceat(part, starts, axis=0) for part in parts]
            else:
                if prefix is None:
                    prefix = [np.concatenate([np.zeros((1, part.shape[1]), np.int32),
                                              np.cumsum(part, axis=0, dtype=np.int32)]) for part in parts]
                sums = [p[ends] - p[starts] for p in prefix]
            if all(chunk_sums.max() <= limit for chunk_sums in sums):
                return chunks
        return contracted
    # Wherever a chunk of n lies: each column's n largest values of a part, for every n.
    largest = np.maximum.reduce([np.cumsum(-np.sort(-part, axis=0), axis=0).max(axis=1) for part in parts])
    for chunks in range(2, contracted + 1):
        if largest[-(-contracted // chunks) - 1] <= limit:
            return chunks
    return contracted


def _float8_values(read_value, group, stored: bool = False) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """``(kernel scale, kernel amax history, stored kernel or None)`` from one read of the kernel.

    The scale and history from the kernel's ``max|W|``.

    Keras's ``compute_float8_scale(amax, 1, e4m3 max)`` and
    ``compute_float8_amax_history(W, zeros)``, computed in numpy's float32 (the
    same correctly rounded divisions; a test holds them equal to Keras's): the
    values are made on the writer's thread beside the save, where each of
    Keras's small eager ops would wait for the GIL.
    """
    kernel = read_value(group.kernel_uid)
    amax = np.max(np.abs(kernel)).astype(np.float32)
    history = np.zeros((group.history_length,), np.float32)
    history[0] = amax  # the zero history rolled by one, amax scattered into slot 0
    scale = float8_scale(amax)
    return scale, history, stored_float8_kernel(kernel, scale, group.storable_dtype) if stored else None


def stored_float8_kernel(kernel: np.ndarray, scale: np.ndarray, dtype: int) -> np.ndarray:
    """The kernel operand every call of a float8 layer computes, computed once: Keras's quantize-dequantize.

    ``Mul(Cast(Cast(ClipByValue(Cast(W, dtype) / Cast(scale, dtype), +-448), float8), dtype), Cast(scale, dtype))``
    in the layer's compute dtype, with TensorFlow's own kernels, so the stored
    values are the ones the graph computed.
    """
    w = tf.cast(tf.constant(kernel), dtype)
    s = tf.cast(tf.constant(scale, tf.float32), dtype)
    clipped = tf.raw_ops.ClipByValue(t=tf.raw_ops.RealDiv(x=w, y=s), clip_value_min=tf.constant(-FLOAT8_E4M3_MAX, dtype),
                                     clip_value_max=tf.constant(FLOAT8_E4M3_MAX, dtype))
    narrow = tf.cast(clipped, tf.dtypes.experimental.float8_e4m3fn).numpy()
    back = tf.constant(_float8_widened(dtype)[narrow.view(np.uint8)])  # Cast(.., dtype), by table
    return tf.raw_ops.Mul(x=back, y=s).numpy()


@functools.lru_cache(maxsize=None)
def _float8_widened(dtype: int) -> np.ndarray:
    """Each float8 e4m3fn value, indexed by its bits, cast to ``dtype`` by TensorFlow's own Cast.

    TensorFlow's CPU Cast from float8 converts one element at a time (3x its
    Cast to float8); a lookup in this table gives the same values.
    """
    every = np.arange(256, dtype=np.uint8).view(numpy_dtype(FLOAT8))
    return tf.cast(tf.constant(every), dtype).numpy()


def float8_scale(amax: np.float32) -> np.ndarray:
    """``keras.quantizers.compute_float8_scale(amax, 1.0, e4m3 max)``: 1 / (max / amax), or 1 where amax is 0 or not finite."""
    one = np.float32(1.0)
    if not (np.isfinite(amax) and amax > 0):
        return np.asarray(one)  # the reciprocal of the reciprocal of the current scale, 1
    with np.errstate(over="ignore"):  # a tiny amax: the factor is inf and the scale 0, as in Keras
        factor = np.float32(FLOAT8_E4M3_MAX) / amax
        return np.asarray(one / factor)


def int4_shapes(kernel: Int4Kernel) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(packed kernel shape, scale and zero point shape)``, as :func:`int4_values` makes them."""
    packed = (kernel.rows // 2, kernel.columns) if kernel.row_halves else (kernel.rows, (kernel.columns + 1) // 2)
    if kernel.block_size is None:
        return packed, (kernel.rows,) if kernel.embedding else (kernel.columns,)
    if kernel.embedding:
        return packed, (kernel.rows, -(-kernel.columns // kernel.block_size))
    return packed, (-(-kernel.rows // kernel.block_size), kernel.columns)


INT4_RANGE = (-8, 7)


def int4_values(value: np.ndarray, kernel: Int4Kernel) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """``(packed kernel, scale, zero point or None)`` by Keras's own ``quantize("int4")``.

    A matmul kernel is flattened to ``(rows, columns)`` and quantized per column
    (``abs_max_quantize`` over axis 0) or per block of rows with a zero point, as
    Dense and EinsumDense do; an embedding table per row or per block of
    columns, as Embedding does. Values are packed along the last axis, by
    Keras's ``pack_int4``, or in halves of rows (``kernel.row_halves``:
    :func:`pack_int4_row_halves`). As Keras quantizes it: the kernel as the
    layer stores it (in the policy's variable dtype), in numpy arithmetic of
    that dtype.
    """
    flat = np.asarray(tf.cast(value, kernel.variable_dtype)).reshape(kernel.rows, kernel.columns)
    zero = None
    if kernel.embedding and kernel.block_size is None:
        q, scale = abs_max_quantize(flat, (1,), INT4_RANGE)
        scale = np.squeeze(scale, axis=-1)
    elif kernel.embedding:
        q, scale, zero = (np.asarray(t).T for t in keras.quantizers.abs_max_quantize_grouped_with_zero_point(
            flat.T, block_size=kernel.block_size, value_range=INT4_RANGE, to_numpy=True))
    elif kernel.block_size is None:
        q, scale = abs_max_quantize(flat, (0,), INT4_RANGE)
        scale = np.squeeze(scale, axis=0)
    else:
        q, scale, zero = keras.quantizers.abs_max_quantize_grouped_with_zero_point(
            flat, block_size=kernel.block_size, value_range=INT4_RANGE, to_numpy=True)
    if kernel.row_halves:
        packed = pack_int4_row_halves(np.asarray(q, np.int8))
    else:
        packed, _, _ = keras.quantizers.pack_int4(np.asarray(q, np.int8), axis=-1)
    return (np.asarray(packed, np.int8), np.ascontiguousarray(scale, np.float32),
            None if zero is None else np.ascontiguousarray(zero, np.int8))


def pack_int4_row_halves(q: np.ndarray) -> np.ndarray:
    """int4 values ``q`` (rows, columns), rows even, as ``(rows / 2, columns)`` bytes: row ``i`` of the first half
    in the low nibble and row ``i`` of the second half in the high one, each as ``q + 8`` (0..15)."""
    offset = (q.astype(np.int16) + 8).astype(np.uint8)
    half = q.shape[0] // 2
    return (offset[:half] | (offset[half:] << 4)).view(np.int8)

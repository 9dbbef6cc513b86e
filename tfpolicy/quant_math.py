"""Keras's quantization formulas, in NumPy, for the values tfpolicy stores.

These are the specification of ``keras/src/quantizers/quantizers.py``
(``abs_max_quantize``, ``compute_float8_scale``, ``compute_float8_amax_history``)
re-stated for arrays read from a SavedModel's variables; the tests compare each
against Keras's own function. The graph-side counterparts (the ops tfpolicy
inserts) live in :mod:`tfpolicy.passes.quantize`.

Conventions, as in Keras:

* int8: the scale is a **multiplier**, ``127 / (max|w| + 1e-7)``; dequantize
  with ``q / scale``.
* float8: the scale is a **divisor**, ``amax / 448``; quantize-dequantize is
  ``cast(clip(x / scale)) * scale``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

INT8_RANGE = 127.0
EPSILON = 1e-7  # keras.backend.epsilon()
FLOAT8_E4M3_MAX = 448.0  # ml_dtypes.finfo(float8_e4m3fn).max


def abs_max_quantize(
    values: np.ndarray, reduced_axes: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 quantization with one scale per non-reduced position.

    Returns ``(q, scale)``: ``q`` int8 in [-127, 127] with the shape of
    ``values``; ``scale`` float32 with ``reduced_axes`` kept as size 1.
    Rounds half to even, like ``ops.round``.
    """
    values = np.asarray(values, dtype=np.float32)
    axes = tuple(int(a) % values.ndim for a in reduced_axes)
    amax = np.max(np.abs(values), axis=axes, keepdims=True)
    scale = np.float32(INT8_RANGE) / (amax + np.float32(EPSILON))
    scale = scale.astype(np.float32)
    q = np.clip(np.round(values * scale), -INT8_RANGE, INT8_RANGE).astype(np.int8)
    return q, scale


def float8_scale(amax: float, scale: float, dtype_max: float = FLOAT8_E4M3_MAX) -> np.float32:
    """``compute_float8_scale``: ``amax / dtype_max``, or ``scale`` when amax is 0 or not finite."""
    one = np.float32(1.0)
    amax32 = np.float32(amax)
    if not np.isfinite(amax32) or amax32 <= 0:
        return one / (one / np.float32(scale))  # Keras's reciprocal of the reciprocal
    return one / (np.float32(dtype_max) / amax32)


def roll_amax_history(history: np.ndarray, amax: float) -> np.ndarray:
    """``compute_float8_amax_history``: roll left by one, put ``amax`` in slot 0."""
    rolled = np.roll(np.asarray(history, dtype=np.float32), -1)
    rolled[0] = np.float32(amax)
    return rolled

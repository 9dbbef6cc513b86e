"""float8 rounding without float8 values: what the CPU lowering of float8 quantize-dequantize computes.

TensorFlow's CPU Cast to ``float8_e4m3fn`` converts one element at a time;
XLA's FP8 GEMMs need it, a CPU does not. :func:`clip_and_round_to_float8`
emits float32 and int32 ops that give exactly its values::

    x:f32 -> ClipByValue(+-448) -> Cast(f8e4m3fn) -> Cast(f32)    equals    x:f32 -> clip_and_round_to_float8 -> f32
"""

from __future__ import annotations

import numpy as np

from tfpolicy.core.tf_names import DT_FLOAT, TensorRef
from tfpolicy.core.tf_names import type_attr as _type
from tfpolicy.passes.builder import GraphBuilder
from tfpolicy.passes.quant_variables import FLOAT8_E4M3_MAX, INT32


def clip_and_round_to_float8(builder: GraphBuilder, x: TensorRef, base: str) -> TensorRef:
    """float32 ``x`` clipped to +-448 and rounded to float8 e4m3fn's nearest value (ties to even), in float32.

    What ``Cast(Cast(ClipByValue(x, -448, 448), float8_e4m3fn), float32)``
    computes, without TensorFlow's CPU float8 Cast (an element at a time)
    or a ClipByValue in bfloat16. On the magnitude: float8's step at ``x``
    is ``2**(e - 3)`` for ``x``'s exponent ``e`` (3 mantissa bits), and
    ``2**-9`` below ``2**-6`` (subnormals). Adding ``c = 1.5 * 2**(e + 20)``
    lands in a float32 binade whose step is exactly that, so float32's own
    round-to-nearest-even rounds the magnitude, and subtracting ``c`` is
    exact; the sign bit is put back (so -0.0 stays -0.0, and NaN stays NaN)::

        m = min(|x|, 448);  e = max(bits(m) & exponent, bits(2**-6));  c = as_float(e) * 1.5 * 2**20
        result = sign(x) | ((m + c) - c)
    """
    f32, i32 = _type(DT_FLOAT), _type(INT32)
    bits = builder.op("Bitcast", f"{base}/bits", [x], T=f32, type=i32)
    sign = builder.op("BitwiseAnd", f"{base}/sign", [bits, builder.const(f"{base}/sign_mask", -(2**31), INT32)], T=i32)
    magnitude = builder.op("Bitcast", f"{base}/magnitude", [builder.op("BitwiseAnd", f"{base}/magnitude_bits", [
        bits, builder.const(f"{base}/magnitude_mask", 2**31 - 1, INT32)], T=i32)], T=i32, type=f32)
    clipped = builder.op("Minimum", f"{base}/clipped", [magnitude, builder.const(f"{base}/max", FLOAT8_E4M3_MAX, DT_FLOAT)],
                         T=f32)  # Minimum(NaN, 448) is NaN, as ClipByValue keeps it
    exponent = builder.op("BitwiseAnd", f"{base}/exponent", [
        builder.op("Bitcast", f"{base}/clipped_bits", [clipped], T=f32, type=i32),
        builder.const(f"{base}/exponent_mask", 0x7F800000, INT32)], T=i32)
    floor = builder.op("Maximum", f"{base}/at_least_normal", [
        exponent, builder.const(f"{base}/smallest_normal", np.float32(2.0**-6).view(np.int32), INT32)], T=i32)
    magic = builder.op("Mul", f"{base}/magic", [builder.op("Bitcast", f"{base}/power", [floor], T=i32, type=f32),
                                                builder.const(f"{base}/shift", 1.5 * 2.0**20, DT_FLOAT)], T=f32)
    rounded = builder.op("Sub", f"{base}/rounded", [builder.op("AddV2", f"{base}/rounded_up", [clipped, magic], T=f32),
                                                    magic], T=f32)
    rounded_bits = builder.op("Bitcast", f"{base}/rounded_bits", [rounded], T=f32, type=i32)
    signed = builder.op("BitwiseOr", f"{base}/signed", [rounded_bits, sign], T=i32)
    return builder.op("Bitcast", base, [signed], T=i32, type=f32)

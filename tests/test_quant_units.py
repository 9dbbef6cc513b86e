"""Tier one for quantization: the formulas against Keras's own, and the op rules."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

import keras
from tfpolicy.analysis import kernel_trace, quant_rules, quant_sites
from tfpolicy.core.graph import Node
from tfpolicy.passes import quantize

def test_graph_constants_are_keras_defaults():
    """The constants the quantize pass writes into graphs are those of Keras's formulas."""
    defaults = inspect.signature(keras.quantizers.abs_max_quantize).parameters
    assert (-quantize.INT8_RANGE, quantize.INT8_RANGE) == tuple(defaults["value_range"].default)
    assert quantize.EPSILON == defaults["epsilon"].default == keras.config.epsilon()
    assert quantize.FLOAT8_E4M3_MAX == 448.0


@pytest.mark.parametrize(
    "source, target, groups",
    [
        ((16, 2, 8), (16, 16), [([0], [0]), ([1, 2], [1])]),
        ((2, 8, 16), (16, 16), [([0, 1], [0]), ([2], [1])]),
        ((4, 6), (24,), [([0, 1], [0])]),
        ((16, 1, 8), (16, 8), [([0], [0]), ([1, 2], [1])]),
        ((6, 4), (4, 6), [([0, 1], [0, 1])]),
    ],
)
def test_reshape_groups(source, target, groups):
    assert kernel_trace.reshape_groups(source, target) == groups


def test_reduced_axes_map_back_through_a_reshape():
    # MHA's query kernel (16, 2, 8) is reshaped to (16, 16) and contracted over axis 0.
    assert kernel_trace.reshape_axes_back((16, 2, 8), (16, 16), {0}) == {0}
    # attention_output's kernel (2, 8, 16) -> (16, 16), contracted over axis 0 = heads x dims.
    assert kernel_trace.reshape_axes_back((2, 8, 16), (16, 16), {0}) == {0, 1}
    # A reshape that splits a contracted axis from an output axis cannot carry a per-channel scale.
    assert kernel_trace.reshape_axes_back((6, 4), (4, 6), {0}) is None


def _node(op: str, **attrs) -> Node:
    values = {}
    for name, value in attrs.items():
        if isinstance(value, bool):
            values[name] = attr_value_pb2.AttrValue(b=value)
        else:
            values[name] = attr_value_pb2.AttrValue(s=value.encode())
    return Node("n", op, ["a", "b"], values)


@pytest.mark.parametrize(
    "node, kernel_reduced, input_reduced",
    [
        (_node("MatMul", transpose_a=False, transpose_b=False), (0,), (1,)),
        (_node("MatMul", transpose_a=False, transpose_b=True), (1,), (1,)),
        (_node("BatchMatMulV2", adj_x=False, adj_y=False), (-2,), (-1,)),
        (_node("Einsum", equation="abc,cde->abde"), (0,), (2,)),
        (_node("Einsum", equation="abcd,cde->abe"), (0, 1), (2, 3)),
        (_node("Conv2D", data_format="NHWC"), (0, 1, 2), (3,)),
        (_node("DepthwiseConv2dNative", data_format="NCHW"), (0, 1), (1,)),
    ],
)
def test_contraction_rules(node, kernel_reduced, input_reduced):
    first = quant_rules.RULES[node.op](node)[0]
    assert (first.kernel_position, first.input_position) == (1, 0)
    assert first.kernel_reduced == kernel_reduced and first.input_reduced == input_reduced


def test_einsum_with_ellipsis_is_not_a_kernel_contraction():
    assert quant_rules.RULES["Einsum"](_node("Einsum", equation="...c,cd->...d")) == []


@pytest.mark.parametrize(
    "amax",
    [0.0, 2e-38, 1e-30, 3.1e-3, 0.5, 1.0, 1.7, 447.9, 448.0, 1e5, 3.4e38, np.inf, np.nan],  # normal floats: TF flushes subnormals unevenly
)
def test_float8_kernel_statistics_are_kerass_formulas_bit_for_bit(amax):
    from tfpolicy.passes import quant_variables  # noqa: PLC0415

    amax = np.float32(amax)
    keras_scale = keras.quantizers.compute_float8_scale(
        amax, np.float32(1.0), np.float32(quant_variables.FLOAT8_E4M3_MAX)
    )
    ours = quant_variables.float8_scale(amax)
    assert ours.dtype == np.float32 and ours.shape == ()
    assert np.asarray(keras_scale, np.float32).tobytes() == ours.tobytes()

    class Group:
        kernel_uid, history_length = 0, 16

    kernel = np.array([[amax, -amax / 2]], np.float32) if np.isfinite(amax) else np.array([[amax]], np.float32)
    _, history, stored = quant_variables._float8_values(lambda uid: kernel, Group)  # noqa: SLF001
    assert stored is None  # asked only for the statistics
    keras_history = keras.quantizers.compute_float8_amax_history(kernel, np.zeros((16,), np.float32))
    assert np.asarray(keras_history, np.float32).tobytes() == history.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("value_range", [(-127, 127), (-8, 7)])
def test_abs_max_quantize_is_kerass_bit_for_bit(dtype, value_range):
    """The float32-pass abs_max_quantize gives Keras's numpy one's values and scales, in Keras's dtypes."""
    from tfpolicy.passes import quant_variables  # noqa: PLC0415

    rng = np.random.default_rng(7)
    np_dtype = np.dtype(tf.dtypes.as_dtype(dtype).as_numpy_dtype)
    cases = []
    for shape, axes in (((96, 40), (0,)), ((12, 5, 33), (0, 1)), ((33, 12, 4), (0,)), ((40, 96), (1,))):
        for magnitude in (0.02, 1.0, 300.0, 1e-3):
            values = rng.normal(size=shape).astype(np.float32) * magnitude
            values[..., 0] = 0.0  # a zero channel: the scale is value_range / epsilon
            values.flat[:64] = np.round(values.flat[:64] * 4) / 4  # products landing on .5: ties to even
            cases.append((values.astype(np_dtype), axes))
    for values, axes in cases:
        expected_q, expected_scale = (np.asarray(t) for t in keras.quantizers.abs_max_quantize(
            values, axis=axes, value_range=value_range, to_numpy=True))
        q, scale = quant_variables.abs_max_quantize(values, axes, value_range)
        assert q.dtype == expected_q.dtype == np.int8 and np.array_equal(q, expected_q)
        assert scale.dtype == expected_scale.dtype and scale.shape == expected_scale.shape
        assert scale.tobytes() == expected_scale.tobytes()
    not_finite = np.array([[1.0, np.nan], [np.inf, 2.0]], np.float32).astype(np_dtype)  # through Keras's own function
    with np.errstate(invalid="ignore"):
        q, scale = quant_variables.abs_max_quantize(not_finite, (0,), value_range)
    assert q.dtype == np.int8 and scale.shape == (1, 2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_stored_float8_kernel_is_tensorflows_cast_chain(dtype):
    """The stored float8 kernel (widened by table) equals the graph's Cast chain, NaN and infinities included."""
    from tfpolicy.passes import quant_variables  # noqa: PLC0415

    rng = np.random.default_rng(3)
    kernel = (rng.normal(size=(64, 48)) * 300.0).astype(np.float32)
    kernel[0, :6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-9]
    tf_dtype = tf.dtypes.as_dtype(dtype)
    for scale in (quant_variables.float8_scale(np.float32(300.0)), np.asarray(np.float32(1.0))):
        w, s = tf.cast(tf.constant(kernel), tf_dtype), tf.cast(tf.constant(scale, tf.float32), tf_dtype)
        clipped = tf.clip_by_value(w / s, tf.constant(-448.0, tf_dtype), tf.constant(448.0, tf_dtype))
        expected = (tf.cast(tf.cast(clipped, tf.dtypes.experimental.float8_e4m3fn), tf_dtype) * s).numpy()
        ours = quant_variables.stored_float8_kernel(kernel, scale, tf_dtype.as_datatype_enum)
        assert ours.dtype == expected.dtype and ours.tobytes() == expected.tobytes()

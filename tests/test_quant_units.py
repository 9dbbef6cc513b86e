"""Tier one for quantization: the formulas against Keras's own, and the op rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tensorflow.core.framework import attr_value_pb2

import keras
from keras.src.quantizers import quantizers as keras_quantizers
from tfpolicy import quant_math, quant_sites
from tfpolicy.graph import Node

FINITE = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=6), elements=FINITE),
       st.integers(0, 2))
def test_abs_max_quantize_equals_keras(values, axis):
    axis = axis % values.ndim
    q, scale = quant_math.abs_max_quantize(values, (axis,))
    keras_q, keras_scale = keras_quantizers.abs_max_quantize(values, axis=axis)
    np.testing.assert_array_equal(q, keras.ops.convert_to_numpy(keras_q))
    np.testing.assert_array_equal(scale, keras.ops.convert_to_numpy(keras_scale))
    assert q.dtype == np.int8 and np.abs(q.astype(int)).max() <= 127


@pytest.mark.parametrize("amax, scale", [(3.5, 1.0), (0.0, 0.25), (float("inf"), 0.5), (448.0, 2.0), (1e-6, 1.0)])
def test_float8_scale_equals_keras(amax, scale):
    expected = keras_quantizers.compute_float8_scale(np.float32(amax), np.float32(scale), np.float32(448.0))
    assert quant_math.float8_scale(amax, scale) == np.float32(keras.ops.convert_to_numpy(expected))


def test_amax_history_roll_equals_keras():
    history = np.array([1, 2, 3, 4], np.float32)
    ours = quant_math.roll_amax_history(history, 10.0)
    theirs = keras_quantizers.compute_float8_amax_history(np.float32([10.0]), history)
    np.testing.assert_array_equal(ours, keras.ops.convert_to_numpy(theirs))
    np.testing.assert_array_equal(ours, [10, 3, 4, 1])


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
    assert quant_sites._reshape_groups(source, target) == groups


def test_reduced_axes_map_back_through_a_reshape():
    # MHA's query kernel (16, 2, 8) is reshaped to (16, 16) and contracted over axis 0.
    assert quant_sites._reshape_axes_back((16, 2, 8), (16, 16), {0}) == {0}
    # attention_output's kernel (2, 8, 16) -> (16, 16), contracted over axis 0 = heads x dims.
    assert quant_sites._reshape_axes_back((2, 8, 16), (16, 16), {0}) == {0, 1}
    # A reshape that splits a contracted axis from an output axis cannot carry a per-channel scale.
    assert quant_sites._reshape_axes_back((6, 4), (4, 6), {0}) is None


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
    first = quant_sites.RULES[node.op](node)[0]
    assert (first.kernel_position, first.input_position) == (1, 0)
    assert first.kernel_reduced == kernel_reduced and first.input_reduced == input_reduced


def test_einsum_with_ellipsis_is_not_a_kernel_contraction():
    assert quant_sites.RULES["Einsum"](_node("Einsum", equation="...c,cd->...d")) == []

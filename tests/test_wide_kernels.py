"""Slow bfloat16 kernels computed in float32 (passes/wide_kernels.py): same bits as Keras, on real exports."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfpolicy
from tensorflow.core.protobuf import saved_model_pb2
from tfpolicy.passes import wide_kernels

pytestmark = pytest.mark.slow  # builds and exports a Keras model


@pytest.mark.parametrize("op", wide_kernels.WIDENED_OPS)
def test_each_widened_op_computes_the_same_bits_on_this_machine(op):
    assert wide_kernels.computes_the_same(op)


def test_an_op_whose_kernels_differ_is_found():
    """Sigmoid's bfloat16 kernel rounds differently on some inputs: the check must be able to say no."""
    assert not wide_kernels.computes_the_same("Sigmoid")


def _build() -> keras.Model:
    inputs = keras.Input(shape=(6, 16), name="x")
    h = keras.layers.Dense(64, activation="gelu", name="exact_gelu")(inputs)  # erfc
    h = keras.layers.Dense(32, name="tanh_gelu")(h)
    # GPT-2's activation: tanh, and a cube (Pow) that Keras computes in bfloat16
    h = keras.layers.Activation(lambda v: keras.activations.gelu(v, approximate=True), name="approx")(h)
    h = keras.layers.Dense(8, activation="tanh", name="head")(h)
    return keras.Model(inputs, h)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    keras.utils.set_random_seed(3)
    model = _build()
    directory = tmp_path_factory.mktemp("wide") / "float32"
    model.export(str(directory), verbose=False)
    return directory, [np.array(w) for w in model.get_weights()]


def _ops_by_dtype(saved_model_dir) -> set[tuple[str, str]]:
    proto = saved_model_pb2.SavedModel.FromString((saved_model_dir / "saved_model.pb").read_bytes())
    graph = proto.meta_graphs[0].graph_def
    nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    return {(n.op, tf.as_dtype(n.attr["T"].type).name) for n in nodes if n.op in wide_kernels.WIDENED_OPS}


def test_gelu_both_forms_and_tanh_equal_keras_bit_for_bit(exported, tmp_path):
    directory, weights = exported
    out = tmp_path / "bf16"
    tfpolicy.rewrite(directory, out, {"default_policy": "mixed_bfloat16"})
    assert _ops_by_dtype(out) == {("Erfc", "float32"), ("Tanh", "float32")}

    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = _build()
    finally:
        keras.config.set_dtype_policy("float32")
    model.set_weights(weights)
    x = np.random.RandomState(0).randn(4, 6, 16).astype(np.float32) * 3
    spec = tf.TensorSpec((None, 6, 16), tf.float32)
    y_keras = tf.function(lambda v: model(v, training=False), input_signature=[spec])(tf.constant(x))
    y_keras = np.asarray(y_keras, dtype=np.float32)
    (y_tool,) = tf.saved_model.load(str(out)).signatures["serving_default"](x=tf.constant(x)).values()
    (y_float32,) = tf.saved_model.load(str(directory)).signatures["serving_default"](x=tf.constant(x)).values()
    assert np.abs(y_tool.numpy() - y_float32.numpy()).max() > 0  # bfloat16 really happened
    np.testing.assert_array_equal(y_tool.numpy(), y_keras)


def test_under_xla_targets_the_ops_stay_bfloat16(exported, tmp_path):
    directory, _ = exported
    out = tmp_path / "gpu"
    tfpolicy.rewrite(directory, out, {"default_policy": "mixed_bfloat16"}, target="gpu")
    assert _ops_by_dtype(out) == {("Erfc", "bfloat16"), ("Tanh", "bfloat16")}

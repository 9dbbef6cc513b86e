"""int8 as integer arithmetic, exactly as Keras runs its quantized layers.

A Keras 3 Dense MLP, an EinsumDense stack and a transformer block are quantized natively
(``layer.dtype_policy = pm[layer.path]``) and by the rewrite from the same
float32 weights. Keras multiplies int8 by int8 into int32, casts to the compute
dtype and divides by ``inputs_scale * kernel_scale``; the rewrite emits that
sequence, so the outputs agree to the last bit, and every int8 site of the
output graph is an integer matmul that XLA lowers to an ``s8`` dot.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfpolicy
from model_zoo import QUANT_BUILDERS, apply_policy_map_natively

MATMUL_OPS = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"}


BUILDERS = QUANT_BUILDERS


class Case:
    def __init__(self, name: str, source: str, root) -> None:
        keras.utils.set_random_seed(5)
        self.build = BUILDERS[name]
        float_model = self.build()
        float_model.export(str(root / "in"), verbose=False)
        # Keras quantizes Dense and EinsumDense, not their containers (MultiHeadAttention).
        quantized = "mha/.+|ffn_.*|head" if name == "transformer_block" else ".*"
        self.policy = {"default_policy": source, "policy_map": {quantized: f"int8_from_{source}"}}
        self.report = tfpolicy.rewrite(root / "in", root / "out", self.policy)
        self.out = root / "out"
        self.weights = float_model.get_weights()
        shape = (5, *float_model.input_shape[1:])
        shape = tuple(6 if d is None else d for d in shape)
        self.x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
        self.y_fp32 = np.asarray(float_model(self.x), np.float32)

    def keras_output(self) -> np.ndarray:
        keras.config.set_dtype_policy(self.policy["default_policy"])
        try:
            native = self.build()
        finally:
            keras.config.set_dtype_policy("float32")
        native.set_weights(self.weights)
        apply_policy_map_natively(native, tfpolicy.PolicyMap.load(self.policy).to_keras())
        spec = tf.TensorSpec(native.input.shape, native.input.dtype)
        return np.asarray(tf.function(lambda t: native(t), input_signature=[spec])(tf.constant(self.x)), np.float32)

    def tool_output(self) -> np.ndarray:
        function = tf.saved_model.load(str(self.out)).signatures["serving_default"]
        (value,) = function(tf.constant(self.x)).values()
        return value.numpy().astype(np.float32)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    built = {}

    def get(name: str, source: str) -> Case:
        if (name, source) not in built:
            built[name, source] = Case(name, source, tmp_path_factory.mktemp(f"{name}_{source}"))
        return built[name, source]

    return get


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("source", ["float32", "mixed_bfloat16"])
def test_int8_outputs_equal_keras_bit_for_bit(cases, name, source):
    case = cases(name, source)
    y_tool, y_keras = case.tool_output(), case.keras_output()
    assert np.abs(y_tool - case.y_fp32).max() > 0  # quantization happened
    np.testing.assert_array_equal(y_tool, y_keras)


@pytest.mark.parametrize("name", sorted(set(BUILDERS) - {"transformer_block"}))  # attention's own products stay float
def test_every_int8_site_is_an_integer_matmul(cases, name):
    case = cases(name, "mixed_bfloat16")
    graph_def = tf.saved_model.load(str(case.out)).signatures["serving_default"].graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    contractions = [n for n in nodes if n.op in MATMUL_OPS]
    assert contractions
    for node in contractions:  # int8 x int8 -> int32, and no int8 kernel cast to float before it
        assert node.op == "BatchMatMulV3", node
        assert (node.attr["Ta"].type, node.attr["Tb"].type, node.attr["Tout"].type) == (
            tf.int8.as_datatype_enum, tf.int8.as_datatype_enum, tf.int32.as_datatype_enum)
    assert not [n for n in nodes if n.op == "Cast" and n.attr["SrcT"].type == tf.int8.as_datatype_enum]
    forms = {form for q in case.report.quantization.values() for form in q.forms}
    assert forms == {"integer matmul"}, forms


@pytest.mark.parametrize("name", ["dense_mlp", "einsum_dynamic"])
def test_xla_lowers_the_int8_sites_to_s8_dots(cases, name):
    case = cases(name, "mixed_bfloat16")
    loaded = tf.saved_model.load(str(case.out))  # keeps the variables alive while compiling
    function = loaded.signatures["serving_default"]
    (key,) = function.structured_input_signature[1]
    compiled = tf.function(lambda x: function(**{key: x}), jit_compile=True)
    hlo = compiled.experimental_get_compiler_ir(tf.constant(case.x))(stage="hlo")
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert dots and all("s32[" in line.split("=")[1] and "s8[" in line for line in dots), dots
    # The same integers; XLA may keep the bfloat16 rescale in float32 (one bfloat16 step).
    y_xla = compiled(tf.constant(case.x))[next(iter(function.structured_outputs))].numpy()
    np.testing.assert_allclose(y_xla, case.tool_output(), rtol=2**-7, atol=2**-8 * np.abs(y_xla).max())

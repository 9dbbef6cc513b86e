"""int8 as integer arithmetic, exactly as Keras runs its quantized layers, in each lowering.

A Keras 3 Dense MLP, an EinsumDense stack and a transformer block are quantized natively
(``layer.dtype_policy = pm[layer.path]``) and by the rewrite from the same
float32 weights. Keras multiplies int8 by int8 into int32, casts to the compute
dtype and divides by ``inputs_scale * kernel_scale``. The rewrite computes the
same int32 sums in the form ``--target`` picks (analysis/lowering.py): the
integers multiplied in float32 (no target), oneDNN's u8 x s8 kernel (``cpu``,
on CPUs where it is exact) or Keras's own int8 x int8 op, which XLA lowers to
an ``s8`` dot (``gpu``); the outputs agree with Keras to the last bit in all.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfpolicy
from model_zoo import QUANT_BUILDERS, apply_policy_map_natively
from tfpolicy.analysis import lowering
from tfpolicy.passes import quant_variables


MATMUL_OPS = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"}


BUILDERS = QUANT_BUILDERS


class Case:
    def __init__(self, name: str, source: str, root, target=None) -> None:
        keras.utils.set_random_seed(5)
        self.build = BUILDERS[name]
        float_model = self.build()
        float_model.export(str(root / "in"), verbose=False)
        # Keras quantizes Dense and EinsumDense, not their containers (MultiHeadAttention).
        quantized = "mha/.+|ffn_.*|head" if name == "transformer_block" else ".*"
        self.policy = {"default_policy": source, "policy_map": {quantized: f"int8_from_{source}"}}
        self.report = tfpolicy.rewrite(root / "in", root / "out", self.policy, target=target)
        self.out = root / "out"
        self.weights = float_model.get_weights()
        shape = (5, *float_model.input_shape[1:])
        shape = tuple(6 if d is None else d for d in shape)
        self.x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
        self.y_fp32 = np.asarray(float_model(self.x), np.float32)

    def keras_output(self, jit_compile: bool = False) -> np.ndarray:
        keras.config.set_dtype_policy(self.policy["default_policy"])
        try:
            native = self.build()
        finally:
            keras.config.set_dtype_policy("float32")
        native.set_weights(self.weights)
        apply_policy_map_natively(native, tfpolicy.PolicyMap.load(self.policy).to_keras())
        spec = tf.TensorSpec(native.input.shape, native.input.dtype)
        run = tf.function(lambda t: native(t), input_signature=[spec], jit_compile=jit_compile)
        return np.asarray(run(tf.constant(self.x)), np.float32)

    def tool_output(self) -> np.ndarray:
        function = tf.saved_model.load(str(self.out)).signatures["serving_default"]
        (value,) = function(tf.constant(self.x)).values()
        return value.numpy().astype(np.float32)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    built = {}

    def get(name: str, source: str, target=None) -> Case:
        if (name, source, target) not in built:
            built[name, source, target] = Case(name, source, tmp_path_factory.mktemp(f"{name}_{source}_{target}"), target)
        return built[name, source, target]

    return get


ONEDNN_EXACT = lowering.choose("cpu").int8_matmul == "onednn"
TARGETS = [None, "gpu", pytest.param("cpu", marks=pytest.mark.skipif(
    not ONEDNN_EXACT, reason="--target cpu lowers to the float form here (no oneDNN, or no VNNI/AMX)"))]


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("source", ["float32", "mixed_bfloat16", "bfloat16"])
@pytest.mark.parametrize("target", TARGETS)
def test_int8_outputs_equal_keras_bit_for_bit(cases, name, source, target):
    """Bit for bit in graph mode. --target gpu marks the signatures for XLA, so that output runs compiled: the
    same int32 sums, and XLA's own fusion of the rescale (it may keep a bfloat16 division in float32), so it
    is held to Keras's model compiled, within one bfloat16 step."""
    case = cases(name, source, target)
    y_tool, y_keras = case.tool_output(), case.keras_output(jit_compile=target == "gpu")
    assert np.abs(y_tool - case.y_fp32).max() > 0  # quantization happened
    if target == "gpu":
        np.testing.assert_allclose(y_tool, y_keras, rtol=2**-7, atol=2**-8 * np.abs(y_keras).max())
    else:
        np.testing.assert_array_equal(y_tool, y_keras)


def _graph_nodes(case: Case) -> list:
    graph_def = tf.saved_model.load(str(case.out)).signatures["serving_default"].graph.as_graph_def()
    return list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]


I8, I32, F32 = tf.int8.as_datatype_enum, tf.int32.as_datatype_enum, tf.float32.as_datatype_enum


@pytest.mark.parametrize("name", sorted(set(BUILDERS) - {"transformer_block"}))  # attention's own products stay float
@pytest.mark.parametrize("target", TARGETS)
def test_every_int8_site_multiplies_the_int8_kernel_itself(cases, name, target):
    """No int8 kernel is dequantized: each contraction reads it as int8 (gpu), its integer values (none), or qint8 (cpu)."""
    case = cases(name, "mixed_bfloat16", target)
    nodes = _graph_nodes(case)
    by_name = {n.name: n for n in nodes}
    form = lowering.choose(target).int8_matmul
    contractions = [n for n in nodes if n.op in MATMUL_OPS | {lowering.ONEDNN_INT8_MATMUL}]
    assert contractions
    for node in contractions:
        if form == "integer":  # int8 x int8 -> int32
            assert node.op == "BatchMatMulV3", node
            assert (node.attr["Ta"].type, node.attr["Tb"].type, node.attr["Tout"].type) == (I8, I8, I32)
        elif form == "onednn":
            assert node.op == lowering.ONEDNN_INT8_MATMUL, node
        else:  # float32 MatMul of integer values: the kernel operand is the int8 kernel cast, not divided by a scale
            assert node.op == "MatMul" and node.attr["T"].type == F32, node
            kernel = by_name[node.input[1].split(":")[0].lstrip("^")]
            while kernel.op == "SplitV":
                kernel = by_name[kernel.input[0].split(":")[0]]
            assert kernel.op == "Cast" and kernel.attr["SrcT"].type == I8, kernel
    dequantized = [n for n in nodes if n.op == "RealDiv" and any("dequantize" in i for i in n.input)]
    assert not dequantized
    forms = {form for q in case.report.quantization.values() for form in q.forms}
    assert forms == {"integer matmul"}, forms
    assert case.report.lowering.int8_matmul == form


@pytest.mark.parametrize(("contracted", "chunks"), [(2100, 3), (1500, 2)])
def test_float_form_sums_long_contractions_in_exact_chunks(tmp_path, contracted, chunks):
    """A contraction whose int8 sums could pass 2^24 is summed in float32 chunks: still Keras's, bit for bit.

    Every weight of the kernel has the same magnitude (all int8 values +-127),
    the worst case: 2100 contracted values need ceil(2100 / 1040) = 3 chunks,
    added in int32; 1500 need 2, added in float32 (two exact integers, one
    rounding: Keras's Cast of their int32 sum). The first row follows the
    first column's signs, so its sum passes 2^24 and is rounded.
    """
    keras.utils.set_random_seed(3)
    inputs = keras.Input((contracted,))
    model = keras.Model(inputs, keras.layers.Dense(8, name="wide")(inputs))
    signs = np.sign(np.random.default_rng(2).normal(size=(contracted, 8))).astype(np.float32)
    model.layers[-1].kernel.assign(signs * 0.05)
    model.export(str(tmp_path / "in"), verbose=False)
    tfpolicy.rewrite(tmp_path / "in", tmp_path / "out", {"default_policy": "int8_from_float32"})
    x = np.random.default_rng(1).normal(size=(4, contracted)).astype(np.float32) * 10
    x[0] = signs[:, 0] * (10 + np.arange(contracted) % 3)
    native = keras.Model(inputs, model.layers[-1](inputs))
    native.layers[-1].quantize("int8")
    y_keras = tf.function(lambda t: native(t))(tf.constant(x)).numpy()
    (y_tool,) = tf.saved_model.load(str(tmp_path / "out")).signatures["serving_default"](tf.constant(x)).values()
    np.testing.assert_array_equal(y_tool.numpy(), y_keras)
    nodes = tf.saved_model.load(str(tmp_path / "out")).signatures["serving_default"].graph.as_graph_def()
    ops = [n.op for f in nodes.library.function for n in f.node_def] + [n.op for n in nodes.node]
    assert ops.count("MatMul") == chunks
    assert ("AddN" in ops) == (chunks > 2)  # two chunks: one float32 AddV2


@pytest.mark.parametrize("name", ["dense_mlp", "einsum_dynamic"])
def test_xla_lowers_the_int8_sites_to_s8_dots(cases, name):
    case = cases(name, "mixed_bfloat16", "gpu")
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


def test_float_exact_chunks_follow_the_kernel():
    """A float32 matmul of int8 values is exact while 127 x a column's sum of |w| stays within 2^24."""
    rng = np.random.default_rng(0)
    gaussian = np.clip(np.round(rng.normal(size=(3072, 64)) * 127 / 4.5), -127, 127).astype(np.int8)
    assert quant_variables.float_exact_chunks(gaussian, (0,)) == 1  # a trained kernel's 3072-long contraction
    assert quant_variables.float_exact_chunks(np.full((3072, 4), -127, np.int8), (0,)) == 3  # the worst case
    assert quant_variables.float_exact_chunks(np.full((1040, 4), 127, np.int8), (0,)) == 1
    assert quant_variables.float_exact_chunks(np.full((1041, 4), 127, np.int8), (0,)) == 2


def test_u8_exact_chunks_keeps_every_column_sum_within_float32_integers():
    """oneDNN adds its bias in float32: a contraction whose u8 x s8 sums could pass 2^24 is split until none can."""
    rng = np.random.default_rng(0)
    assert quant_variables.u8_exact_chunks(rng.integers(-127, 128, (768, 64)).astype(np.int8), (0,)) == 1
    same_sign = np.full((768, 4), 127, np.int8)  # 255 * 127 * 768 > 2^24
    chunks = quant_variables.u8_exact_chunks(same_sign, (0,))
    assert chunks == 2 and 255 * 127 * 384 <= 2**24
    assert quant_variables.u8_exact_chunks(-same_sign, (0,)) == 2
    # Contracted axes first or last, several of them: the same count.
    assert quant_variables.u8_exact_chunks(np.full((4, 24, 32), 127, np.int8), (1, 2)) == 2
    assert quant_variables.u8_exact_chunks(np.full((3100, 2), 127, np.int8), (0,)) == 6  # 517 per chunk; 620 > 518
    # Uniform weights over 3072: half the sum each in two halves as they lie; wherever a chunk lies, five.
    uniform = rng.integers(-127, 128, (3072, 64)).astype(np.int8)
    assert quant_variables.u8_exact_chunks(uniform, (0,)) == 2
    assert quant_variables.u8_exact_chunks(uniform, (0,), in_order=False) == 5
    assert quant_variables.u8_exact_chunks(uniform.T, (1,)) == 5  # contracted axis not leading: any order


@pytest.mark.skipif(not ONEDNN_EXACT, reason="--target cpu lowers to the float form here (no oneDNN, or no VNNI/AMX)")
def test_onednn_form_stays_exact_where_its_sums_pass_two_to_the_24(tmp_path):
    """Near-constant positive weights and positive inputs: the u8 sums pass 2^24, where one oneDNN matmul
    (its bias added in float32) would be off by one; the chunked form is still Keras's, bit for bit."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((768,))
    layer = keras.layers.Dense(16, name="wide")
    model = keras.Model(inputs, layer(inputs))
    rng = np.random.default_rng(2)
    layer.kernel.assign(rng.uniform(0.9, 1.0, (768, 16)).astype(np.float32))
    model.export(str(tmp_path / "in"), verbose=False)
    tfpolicy.rewrite(tmp_path / "in", tmp_path / "out", {"default_policy": "int8_from_float32"}, target="cpu")
    x = rng.uniform(0.5, 1.0, (32, 768)).astype(np.float32)
    layer.quantize("int8")
    y_keras = tf.function(lambda t: model(t))(tf.constant(x)).numpy()
    function = tf.saved_model.load(str(tmp_path / "out")).signatures["serving_default"]
    (y_tool,) = function(tf.constant(x)).values()
    np.testing.assert_array_equal(y_tool.numpy(), y_keras)
    nodes = [n for f in function.graph.as_graph_def().library.function for n in f.node_def]
    matmuls = [n.name for n in nodes if n.op == lowering.ONEDNN_INT8_MATMUL]
    assert len([n for n in matmuls if "int8_dot_guard" not in n]) == 2, matmuls  # two chunks, after the guard's probe

"""int4 as Keras stores and runs it: packed kernels, Keras's scales and zero points, Keras's output.

Dense, EinsumDense, Embedding and transformer-block models are quantized by Keras itself (each
layer given the source policy, then ``layer.quantize("int4", config=
Int4QuantizationConfig(block_size=...))``, the same float32 weights) and by the
rewrite under ``int4/<block>_from_<source>``. Keras 3.15's int4 is weight-only:
the packed kernel is unpacked to int8, cast to the compute dtype, and divided
by its per-channel scale after a Dense matmul (before an EinsumDense einsum),
or dequantized per block with a zero point. The rewrite emits those same ops,
so outputs, packed bytes, scales and zero points agree to the last bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfpolicy
from keras.quantizers import Int4QuantizationConfig
from model_zoo import QUANT_BUILDERS



def _embedding():
    tokens = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(50, 13, name="embedding")(tokens)
    return keras.Model(tokens, keras.layers.Dense(4, name="out")(x))


def _short_last_block():
    """Kernels packed in halves of rows (even rows, columns a multiple of 4); 12 rows are a block of 8 and one of 4."""
    inputs = keras.Input((12,))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(x))


QUANTIZABLE = (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding)
BUILDERS = {**QUANT_BUILDERS, "embedding": _embedding, "short_last_block": _short_last_block}
BLOCKS = {"per_channel": -1, "block8": 8, "block4096": 4096}


class Case:
    def __init__(self, name: str, source: str, block: int, root) -> None:
        keras.utils.set_random_seed(3)
        self.build, self.source, self.block = BUILDERS[name], source, block
        float_model = self.build()
        float_model.export(str(root / "in"), verbose=False)
        self.weights = float_model.get_weights()
        self.policy = {"default_policy": source, "policy_map": {".*": f"int4/{block}_from_{source}"}}
        self.report = tfpolicy.rewrite(root / "in", root / "out", self.policy)
        self.out = root / "out"
        shape = tuple(6 if d is None else d for d in (3, *float_model.input_shape[1:]))
        rng = np.random.default_rng(0)
        self.x = rng.integers(0, 50, shape).astype(np.int32) if name == "embedding" else rng.normal(size=shape).astype(np.float32)
        self.y_fp32 = np.asarray(float_model(self.x), np.float32)
        self.keras_model = self._quantized_by_keras()

    def _quantized_by_keras(self) -> keras.Model:
        # The documented way (a float32 model given each layer's policy, then quantized), except for a
        # source whose variables are not float32 (bfloat16): a float32 layer given that policy keeps
        # float32 variables and computes in float32, so the model is built under the source policy
        # (its kernels bfloat16 variables, which quantize() reads) and the float weights set.
        stored = keras.dtype_policies.get(self.source).variable_dtype
        keras.config.set_dtype_policy(self.source if stored != "float32" else "float32")
        try:
            model = self.build()
        finally:
            keras.config.set_dtype_policy("float32")
        model.set_weights(self.weights)
        for layer in model._flatten_layers(include_self=False):
            if layer.path:
                layer.dtype_policy = self.source
        for layer in model._flatten_layers(include_self=False):
            if isinstance(layer, QUANTIZABLE):
                layer.quantize("int4", config=Int4QuantizationConfig(block_size=self.block))
        return model

    def keras_output(self) -> np.ndarray:
        spec = tf.TensorSpec(self.keras_model.input.shape, self.keras_model.input.dtype)
        run = tf.function(lambda t: self.keras_model(t), input_signature=[spec])
        return np.asarray(run(tf.constant(self.x)), np.float32)

    def tool_output(self) -> np.ndarray:
        (value,) = tf.saved_model.load(str(self.out)).signatures["serving_default"](tf.constant(self.x)).values()
        return value.numpy().astype(np.float32)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    built = {}

    def get(name: str, source: str, block: str) -> Case:
        key = (name, source, block)
        if key not in built:
            built[key] = Case(name, source, BLOCKS[block], tmp_path_factory.mktemp(f"{name}_{source}_{block}"))
        return built[key]

    return get


@pytest.mark.parametrize("block", ["per_channel", "block8"])
@pytest.mark.parametrize("source", ["float32", "mixed_bfloat16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_int4_outputs_equal_keras_bit_for_bit(cases, name, source, block):
    case = cases(name, source, block)
    y_tool, y_keras = case.tool_output(), case.keras_output()
    assert np.abs(y_tool - case.y_fp32).max() > 0  # quantization happened
    np.testing.assert_array_equal(y_tool, y_keras)


@pytest.mark.parametrize("block", ["per_channel", "block8"])
@pytest.mark.parametrize("name", ["dense_mlp", "einsum_static", "embedding"])
def test_int4_variables_are_kerass_packed_bytes_scales_and_zero_points(cases, name, block):
    case = cases(name, "mixed_bfloat16", block)
    stored = {v.name.split(":")[0]: v.numpy() for v in tf.saved_model.load(str(case.out)).tfpolicy.variables}
    expected = {v.path: np.asarray(v.numpy()) for v in case.keras_model.weights
                if v.path.rsplit("/", 1)[-1] in ("kernel", "embeddings", "kernel_scale", "embeddings_scale",
                                                  "kernel_zero", "embeddings_zero")}
    assert expected and set(expected) <= set(stored), (sorted(expected), sorted(stored))
    float_shapes = {w.path: tuple(w.shape) for w in keras.models.clone_model(case.build()).weights}
    halves = []
    for path, value in expected.items():
        assert stored[path].dtype == value.dtype, path
        if stored[path].size == value.size and np.array_equal(stored[path].reshape(value.shape), value):
            continue  # Keras's bytes
        # A matmul kernel packed in halves of rows, as q + 8: Keras's values all the same.
        assert path.endswith("/kernel"), path
        packed = stored[path].view(np.uint8)
        q = np.concatenate([packed & 0x0F, packed >> 4]).astype(np.int8) - 8
        columns = int(np.prod(float_shapes[path])) // value.shape[0]  # Keras packs (rows, columns) along columns
        kerass = np.asarray(keras.quantizers.unpack_int4(value, columns, axis=-1))
        np.testing.assert_array_equal(q, kerass.reshape(q.shape), err_msg=path)
        halves.append(path)
    # Every EinsumDense kernel here has even rows and columns a multiple of 4; an embedding table keeps Keras's layout.
    assert (len(halves) == 3) if name == "einsum_static" else all("embedding" not in p for p in halves), halves
    assert all(v.dtype == np.int8 for p, v in stored.items() if p.endswith(("/kernel", "/embeddings")))


@pytest.mark.parametrize("name", ["dense_mlp", "embedding"])
def test_a_block_longer_than_its_axis_is_one_zero_padded_block_as_keras_makes_it(cases, name):
    """``int4/4096`` on shorter axes: Keras pads the axis with zeros to one block (its range then holds 0)."""
    case = cases(name, "float32", "block4096")
    np.testing.assert_array_equal(case.tool_output(), case.keras_output())


def test_int4_kernels_take_an_eighth_of_their_float32_bytes(cases):
    case = cases("einsum_static", "float32", "per_channel")  # every output width even
    loaded = tf.saved_model.load(str(case.out))
    stored = {v.name.split(":")[0]: v for v in loaded.tfpolicy.variables}
    float_kernels = {w.path: w for w in keras.models.clone_model(case.build()).weights if w.path.endswith("/kernel")}
    for path, weight in float_kernels.items():
        assert stored[path].dtype == tf.int8
        assert 8 * np.asarray(stored[path]).nbytes == np.prod(weight.shape) * 4, path
    # No float32 copy of a kernel is left in the output.
    every_variable = [(v.name.split(":")[0], v.dtype) for v in loaded.tfpolicy_variables]
    assert [dtype for name, dtype in every_variable if name in float_kernels] == [tf.int8] * len(float_kernels)


@pytest.mark.parametrize("name", ["dense_mlp", "einsum_dynamic", "embedding"])
def test_int4_forms_are_reported_and_every_kernel_read_is_int8(cases, name):
    case = cases(name, "mixed_bfloat16", "block8")
    forms = {form for q in case.report.quantization.values() for form in q.forms}
    assert forms <= {"int4 kernel dequantized before the contraction", "int4 rows gathered"}, forms
    per_channel = cases(name, "mixed_bfloat16", "per_channel")
    forms = {form for q in per_channel.report.quantization.values() for form in q.forms}
    expected = {"dense_mlp": {"int4 kernel, divided by its scale after the matmul"},
                "einsum_dynamic": {"int4 kernel dequantized before the contraction"},
                "embedding": {"int4 rows gathered", "int4 kernel, divided by its scale after the matmul"}}[name]
    assert forms == expected
    graph_def = tf.saved_model.load(str(case.out)).signatures["serving_default"].graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    by_name = {n.name: n for n in nodes}
    # One unpack of packed bytes per kernel read: in Keras's layout (gathered rows) the bytes viewed as uint8
    # index the nibble-pair table; a kernel packed in halves of rows is viewed as uint32 words.
    unpacks = [n for n in nodes if n.op == "Bitcast" and n.name.endswith(("/bytes", "/words"))]
    assert not [n for n in nodes if n.op == "GatherV2" and "nibble" in n.input[0]] if name == "einsum_dynamic" else True
    assert len(unpacks) == len(case.report.quantization)
    assert not [n for n in nodes if n.op == "Pack" and n.attr["T"].type == tf.int8.as_datatype_enum]  # one element at a time
    for unpack in unpacks:
        source = by_name[unpack.input[0].split(":")[0]]
        if source.op == "Reshape":  # a kernel's bytes, two at a time
            source = by_name[source.input[0].split(":")[0]]
        dtype = source.attr["Tparams" if source.op == "GatherV2" else "dtype"].type
        assert source.op in ("ReadVariableOp", "ResourceGather", "GatherV2") and dtype == tf.int8.as_datatype_enum


@pytest.mark.parametrize("name", ["dense_mlp", "einsum_dynamic", "embedding"])
def test_int4_output_compiles_with_xla_and_runs_in_a_tf1_session(cases, name):
    case = cases(name, "mixed_bfloat16", "block8")
    loaded = tf.saved_model.load(str(case.out))
    function = loaded.signatures["serving_default"]
    (key,) = function.structured_input_signature[1]
    compiled = tf.function(lambda x: function(**{key: x}), jit_compile=True)
    y_xla = compiled(tf.constant(case.x))[next(iter(function.structured_outputs))].numpy().astype(np.float32)
    y_tool = case.tool_output()
    # XLA fuses the dequantization into the dot and rounds bfloat16 elsewhere than
    # TensorFlow's kernels: a few bfloat16 steps apart, and as far from float32.
    e_xla, e_tool = np.abs(y_xla - case.y_fp32).max(), np.abs(y_tool - case.y_fp32).max()
    assert e_xla <= 1.25 * e_tool, (e_xla, e_tool)
    np.testing.assert_allclose(y_xla, y_tool, atol=0.25 * e_tool)
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(case.out))
        signature = meta.signature_def["serving_default"]
        (input_info,) = signature.inputs.values()
        (output_info,) = signature.outputs.values()
        y_tf1 = session.run(output_info.name, {input_info.name: case.x})
    np.testing.assert_array_equal(np.asarray(y_tf1, np.float32), y_tool)


def test_int4_without_a_block_is_per_channel_as_keras_loads_it(tmp_path):
    """``int4_from_<source>`` (no block) is Keras's legacy per-channel int4: the same output as ``int4/-1_``."""
    keras.utils.set_random_seed(3)
    model = QUANT_BUILDERS["dense_mlp"]()
    model.export(str(tmp_path / "in"), verbose=False)
    x = np.random.default_rng(1).normal(size=(4, 20)).astype(np.float32)
    outputs = []
    for policy in ("int4_from_mixed_bfloat16", "int4/-1_from_mixed_bfloat16"):
        out = tmp_path / policy.replace("/", "_")
        tfpolicy.rewrite(tmp_path / "in", out, {"default_policy": "mixed_bfloat16", "policy_map": {".*": policy}})
        (value,) = tf.saved_model.load(str(out)).signatures["serving_default"](tf.constant(x)).values()
        outputs.append(value.numpy())
    np.testing.assert_array_equal(*outputs)


def test_nibble_pair_table_is_kerass_unpack_int4_for_every_byte():
    """The unpacking table, viewed as the graph views it, holds Keras's unpack_int4 of each of the 256 bytes."""
    from tfpolicy.passes.int4 import NIBBLE_PAIRS  # noqa: PLC0415

    every_byte = np.arange(-128, 128, dtype=np.int8).reshape(1, 256)
    keras_pairs = np.asarray(keras.quantizers.unpack_int4(every_byte, 512, axis=-1)).reshape(256, 2)
    as_graph = tf.bitcast(tf.gather(tf.constant(NIBBLE_PAIRS), tf.cast(tf.bitcast(every_byte[0], tf.uint8), tf.int32)), tf.int8)
    np.testing.assert_array_equal(as_graph.numpy(), keras_pairs)
    compiled = tf.function(lambda b: tf.bitcast(tf.gather(tf.constant(NIBBLE_PAIRS), tf.cast(tf.bitcast(b, tf.uint8), tf.int32)),
                                                tf.int8), jit_compile=True)
    np.testing.assert_array_equal(compiled(tf.constant(every_byte[0])).numpy(), keras_pairs)  # XLA moves the bits too


def test_nibble_quad_table_is_kerass_unpack_int4_for_every_pair_of_bytes():
    from tfpolicy.passes.int4 import nibble_quad_table  # noqa: PLC0415

    words = np.arange(65536, dtype=np.uint16)
    as_bytes = words.view(np.int8).reshape(1, 131072)  # little-endian byte pairs, every one
    keras_quads = np.asarray(keras.quantizers.unpack_int4(as_bytes, 262144, axis=-1)).reshape(65536, 4)
    table = tf.constant(nibble_quad_table())
    looked_up = tf.function(lambda w: tf.bitcast(tf.gather(table, tf.cast(w, tf.int32)), tf.int8), jit_compile=False)
    np.testing.assert_array_equal(looked_up(tf.constant(words)).numpy(), keras_quads)
    compiled = tf.function(lambda w: tf.bitcast(tf.gather(table, tf.cast(w, tf.int32)), tf.int8), jit_compile=True)
    np.testing.assert_array_equal(compiled(tf.constant(words)).numpy(), keras_quads)

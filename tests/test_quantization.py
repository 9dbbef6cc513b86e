"""int8 and float8: Keras as the oracle, calibration, XLA, and what the output carries.

Keras 3 applies the same map natively (``layer.dtype_policy = pm[layer.path]``
quantizes the layer); tfpolicy rewrites the float32 export. The bounds are the
issue's: int8 outputs, kernels and scales identical to Keras's, float8 within bf16 tolerance once both use the same scales.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfpolicy
from model_zoo import apply_policy_map_natively, run_signature
from tfpolicy.core import savedmodel_io

pytestmark = pytest.mark.slow  # quantized models against Keras, under XLA too

INT8 = "int8_from_mixed_bfloat16"
FLOAT8 = "float8_from_mixed_bfloat16"
INT8_MAP = {
    "default_policy": "mixed_bfloat16",
    "policy_map": {"embedding": INT8, "dense_in": INT8, "proj": INT8, "mix": INT8},
}
FLOAT8_MAP = {"default_policy": "mixed_bfloat16", "policy_map": {"dense_in|proj|mix": FLOAT8}}
CNN_MAP = {"default_policy": "mixed_bfloat16", "policy_map": {"conv|depthwise|head": INT8}}
# The value path and the feed-forward layers: float8 query and key projections make
# attention logits of ~1e5 flip under e4m3's 6% rounding, calibrated or not.
TRANSFORMER_FLOAT8 = {
    "default_policy": "mixed_bfloat16",
    "policy_map": {"mha/value|mha/attention_output|ffn_in|ffn_out": FLOAT8},
}


class Outputs:
    """Each (model, map, calibration) rewritten once per session."""

    def __init__(self, zoo, root) -> None:
        self.zoo, self.root, self.done = zoo, root, {}

    def get(self, name: str, policy_map: dict, tag: str, **kwargs):
        if tag not in self.done:
            out = self.root / tag
            report = tfpolicy.rewrite(self.zoo.get(name).saved_model_dir, out, policy_map, **kwargs)
            self.done[tag] = (out, report)
        return self.done[tag]


@pytest.fixture(scope="session")
def outputs(zoo, tmp_path_factory):
    return Outputs(zoo, tmp_path_factory.mktemp("quantized"))


def _variables(saved_model_dir) -> dict[str, np.ndarray]:
    loaded = tf.saved_model.load(str(saved_model_dir))
    return {v.name[:-2]: v.numpy() for v in loaded.tfpolicy.variables}


def _keras_quantized(zoo_model, policy_map: dict) -> "keras.Model":
    model = zoo_model.rebuild()
    apply_policy_map_natively(model, tfpolicy.PolicyMap.load(policy_map).to_keras())
    return model


def _single_output(zoo_model, saved_model_dir, inputs=None) -> np.ndarray:
    inputs = inputs if inputs is not None else zoo_model.sample_inputs["serving_default"]
    (value,) = run_signature(saved_model_dir, "serving_default", inputs).values()
    return value


def _token_batch(seed: int, rows: int = 64) -> dict[str, np.ndarray]:
    """Token ids of ``keras3_quantizable`` covering its whole vocabulary."""
    return {"tokens": np.random.default_rng(seed).integers(0, 20, (rows, 5)).astype(np.int32)}


def _transformer_inputs(seed: int, batch: int = 4) -> dict[str, np.ndarray]:
    """Tokens whose magnitudes spread over ~10..1000 (beyond float8's 448 at scale 1)."""
    rng = np.random.default_rng(seed)
    magnitude = 10.0 ** rng.uniform(1, 3, size=(batch, 5, 1))
    return {"tokens": (rng.standard_normal((batch, 5, 16)) * magnitude).astype(np.float32)}


# -- int8 -----------------------------------------------------------------------------


def test_int8_equals_keras_bit_for_bit(zoo, outputs):
    """Embedding, Dense and EinsumDense: Keras's op sequence (integer matmuls), Keras's output."""
    model = zoo.get("keras3_quantizable")
    out, report = outputs.get("keras3_quantizable", INT8_MAP, "int8")
    inputs = _token_batch(seed=0)
    y_fp32 = _single_output(model, model.saved_model_dir, inputs)
    y_tool = _single_output(model, out, inputs)
    y_keras = np.asarray(_keras_quantized(model, INT8_MAP)(inputs["tokens"]), np.float32)
    assert np.abs(y_tool - y_fp32).max() > 0
    np.testing.assert_array_equal(y_tool, y_keras)
    assert {path: q.ops_quantized for path, q in report.quantization.items()} == {
        "embedding": 1, "dense_in": 1, "proj": 1, "mix": 1}  # serve is serving_default, rewritten once


def test_int8_kernels_equal_keras_and_shrink_the_variables(zoo, outputs):
    model = zoo.get("keras3_quantizable")
    out, _ = outputs.get("keras3_quantizable", INT8_MAP, "int8")
    ours = _variables(out)
    keras_model = _keras_quantized(model, INT8_MAP)
    dense = keras_model.get_layer("dense_in")
    assert ours["dense_in/kernel"].dtype == np.int8
    np.testing.assert_array_equal(ours["dense_in/kernel"], dense._kernel.numpy())
    np.testing.assert_array_equal(ours["dense_in/kernel_scale"], dense.kernel_scale.numpy())
    embedding = keras_model.get_layer("embedding")
    np.testing.assert_array_equal(ours["embedding/embeddings"], embedding._embeddings.numpy())
    np.testing.assert_array_equal(ours["embedding/embeddings_scale"], embedding.embeddings_scale.numpy())
    proj = keras_model.get_layer("proj")  # EinsumDense: same values, scale kept squeezed
    np.testing.assert_array_equal(ours["proj/kernel"], proj._kernel.numpy())
    np.testing.assert_array_equal(ours["proj/kernel_scale"].reshape(-1), proj.kernel_scale.numpy().reshape(-1))
    assert ours["proj/kernel_scale"].shape == (2, 8)

    # Against the float-only rewrite (whose kernels read only as bfloat16 are stored so), the variables
    # shrink by what the int8 kernels save, less the scales: no float copy of a kernel is left behind.
    float_out, _ = outputs.get("keras3_quantizable", {"default_policy": "mixed_bfloat16"}, "bf16")
    names = ("embedding/embeddings", "dense_in/kernel", "proj/kernel", "mix/kernel")
    floats = {v.name[:-2]: v.numpy() for v in tf.saved_model.load(str(float_out)).tfpolicy_variables}
    every = {v.name[:-2]: v.numpy() for v in tf.saved_model.load(str(out)).tfpolicy_variables}
    assert floats["dense_in/kernel"].dtype == tf.bfloat16.as_numpy_dtype
    assert all(every[n].dtype == np.int8 for n in names)
    expected = sum(v.nbytes for v in floats.values()) - sum(v.nbytes for v in every.values())
    assert expected >= sum(k.size for k in (every[n] for n in names)) - sum(
        4 * every[f"{n}_scale"].size for n in names) - 64  # the other variables: bfloat16 in both
    saved = _variables_bytes(float_out) - _variables_bytes(out)
    assert 0.5 * expected <= saved <= expected + 512, (saved, expected)  # the checkpoint's own bytes per variable


def _variables_bytes(saved_model_dir) -> int:
    return sum(p.stat().st_size for p in (saved_model_dir / "variables").iterdir())


def test_int8_cnn_keeps_its_convolutions_in_the_source_policy_as_keras_does(zoo, tmp_path):
    """Keras's ``model.quantize("int8")`` warns and skips Conv2D/DepthwiseConv2D; so does the rewrite.

    The head is quantized, the convolutions compute in bfloat16 from float32
    variables, and the output is Keras's bit for bit (both run as graphs:
    grappler fuses Conv2D + BiasAdd + ReLU, which eager Keras rounds apart).
    """
    model = zoo.get("keras3_cnn")
    report = tfpolicy.rewrite(model.saved_model_dir, tmp_path / "out", CNN_MAP)
    declined = {d["op"]: d["reason"] for q in report.quantization.values() for d in q.declined_ops}
    assert sorted(declined) == ["Conv2D", "DepthwiseConv2dNative"]
    assert all(reason.startswith("Keras has no int8 convolution") for reason in declined.values())
    assert any("--int8_convolutions" in w for w in report.warnings)
    assert {path: q.ops_quantized for path, q in report.quantization.items()} == {"conv": 0, "depthwise": 0, "head": 1}
    ours = _variables(tmp_path / "out")  # the variables the rewrite made or retyped
    assert "head/kernel" in ours and not any(name.startswith(("conv/", "depthwise/")) for name in ours)

    keras_model = model.rebuild()
    apply_policy_map_natively(keras_model, keras.dtype_policies.DTypePolicyMap("mixed_bfloat16"))
    with pytest.warns(UserWarning, match="Conv2D does not have a `quantize"):
        keras_model.quantize("int8", filters=r"^(conv|depthwise|head)$")
    image = model.sample_inputs["serving_default"]["image"]
    spec = tf.TensorSpec((None, *image.shape[1:]), tf.float32)
    y_keras = tf.function(lambda t: keras_model(t), input_signature=[spec])(tf.constant(image)).numpy()
    y_tool = _single_output(model, tmp_path / "out")
    assert np.abs(y_tool - _single_output(model, model.saved_model_dir)).max() > 0
    np.testing.assert_array_equal(y_tool, y_keras.astype(np.float32))


def test_int8_convolutions_opt_in_stores_their_kernels_in_int8(zoo, outputs):
    model = zoo.get("keras3_cnn")
    out, report = _case(outputs, "cnn")
    y_fp32 = _single_output(model, model.saved_model_dir)
    y_tool = _single_output(model, out)
    error = float(np.abs(y_tool - y_fp32).max())
    print(f"int8 CNN: max|y - y_fp32| = {error:.4g} of max|y_fp32| = {np.abs(y_fp32).max():.4g}")
    assert 0 < error <= 0.03 * np.abs(y_fp32).max()
    ours = _variables(out)
    assert ours["conv/kernel"].dtype == np.int8 and ours["conv/kernel_scale"].shape == (8,)  # per output channel
    assert ours["depthwise/kernel"].dtype == np.int8 and ours["depthwise/kernel_scale"].shape == (8, 1)
    assert report.quantization["conv"].ops_quantized == 1  # serve is serving_default, rewritten once


def test_int8_resource_gather_embedding_of_tf_keras(zoo, tmp_path):
    model = zoo.get("tfkeras_embedding")
    out = tmp_path / "out"
    report = tfpolicy.rewrite(model.saved_model_dir, out, {"policy_map": {"embedding": "int8_from_float32"}})
    assert report.quantization["embedding"].ops_quantized > 0
    y_fp32 = _single_output(model, model.saved_model_dir)
    y_tool = _single_output(model, out)
    assert 0 < np.abs(y_tool - y_fp32).max() <= 0.02 * np.abs(y_fp32).max()
    assert _variables(out)["embedding/embeddings"].dtype == np.int8


# -- float8 ---------------------------------------------------------------------------


def test_float8_matches_keras_with_the_same_scales(zoo, outputs):
    model = zoo.get("keras3_quantizable")
    inputs = model.sample_inputs["serving_default"]
    calibration = [{"tokens": np.random.default_rng(i).integers(0, 20, (8, 5)).astype(np.int32)} for i in range(3)]
    out, report = outputs.get("keras3_quantizable", FLOAT8_MAP, "float8", calibration_data=calibration)
    assert report.calibration_batches == 3
    ours = _variables(out)
    keras_model = _keras_quantized(model, FLOAT8_MAP)
    for name in ("dense_in", "proj", "mix"):
        layer = keras_model.get_layer(name)
        assert ours[f"{name}/inputs_scale"] != 1.0
        layer.inputs_scale.assign(ours[f"{name}/inputs_scale"])
        layer.kernel_scale.assign(ours[f"{name}/kernel_scale"])
    # As a graph, as the export runs it (eager and graph bfloat16 kernels differ without oneDNN).
    y_keras = np.asarray(tf.function(keras_model)(tf.constant(inputs["tokens"])), np.float32)
    y_tool = _single_output(model, out)
    np.testing.assert_array_equal(y_tool, y_keras)


def test_float8_calibration_cuts_the_error_4x_on_a_transformer(zoo, outputs):
    block = zoo.get("keras3_transformer")
    calibration = [_transformer_inputs(seed, batch=16) for seed in range(1, 9)]
    plain, plain_report = outputs.get("keras3_transformer", TRANSFORMER_FLOAT8, "tf8_plain")
    calibrated, report = outputs.get("keras3_transformer", TRANSFORMER_FLOAT8, "tf8_cal", calibration_data=calibration)
    assert any("calibration data" in w and "mha/value" in w for w in plain_report.warnings)
    evaluation = _transformer_inputs(seed=100, batch=16)
    y_fp32 = _single_output(block, block.saved_model_dir, evaluation)
    plain_error = np.abs(_single_output(block, plain, evaluation) - y_fp32).max()
    calibrated_error = np.abs(_single_output(block, calibrated, evaluation) - y_fp32).max()
    print(f"float8 transformer: uncalibrated {plain_error:.4g}, calibrated {calibrated_error:.4g}")
    assert calibrated_error * 4 <= plain_error
    scales = _variables(calibrated)
    assert scales["mha/value/inputs_scale"] != 1.0
    assert scales["mha/value/inputs_amax_history"][0] > 448  # the inputs exceed float8's range
    assert _variables(plain)["mha/value/inputs_scale"] == 1.0
    assert any("--calibrate_function" in w for w in plain_report.warnings)
    for out in (plain, calibrated):  # not asked for: neither carries tfpolicy.calibrate
        loaded = tf.saved_model.load(str(out))
        assert loaded.tfpolicy.variables and not hasattr(loaded.tfpolicy, "calibrate")
        functions = savedmodel_io.read_meta_graph(out).graph_def.library.function
        assert not [n for f in functions for n in f.node_def if n.op == "AssignVariableOp"]  # no update ops at all


@pytest.mark.parametrize("length", [16, None], ids=["16", "default_1024"])
def test_amax_history_length_follows_the_policy(zoo, tmp_path, length):
    policy = {"name": FLOAT8} if length is None else {"name": FLOAT8, "amax_history_length": length}
    out = tmp_path / "out"
    tfpolicy.rewrite(zoo.get("keras3_mlp").saved_model_dir, out, {"policy_map": {"dense": policy}})
    ours = _variables(out)
    expected = 1024 if length is None else length
    assert ours["dense/inputs_amax_history"].shape == (expected,)
    assert ours["dense/kernel_amax_history"].shape == (expected,)
    # Off the GPU the kernel is stored quantize-dequantized, in the layer's compute dtype (bfloat16 here).
    assert sorted(ours) == [f"dense/{k}" for k in
                            ("inputs_amax_history", "inputs_scale", "kernel", "kernel_amax_history", "kernel_scale")]
    assert ours["dense/kernel"].dtype == tf.bfloat16.as_numpy_dtype


def test_float8_kernel_is_stored_quantize_dequantized_off_the_gpu(zoo, tmp_path):
    """The kernel operand every call computed (a constant in serving) is the stored value: no kernel rounding
    in the graph, half the bytes, the same outputs as Keras's layer, which computes it at every call."""
    model = zoo.get("keras3_mlp")
    policy_map = {"policy_map": {"dense": FLOAT8}}
    tfpolicy.rewrite(model.saved_model_dir, tmp_path / "stored", policy_map)
    tfpolicy.rewrite(model.saved_model_dir, tmp_path / "gpu", policy_map, target="gpu")
    assert "dense/kernel" not in _variables(tmp_path / "gpu")  # under XLA the kernel's rounding stays in the graph
    kernel = _variables(tmp_path / "stored")["dense/kernel"].astype(np.float32)
    scale = _variables(tmp_path / "stored")["dense/kernel_scale"]
    original = tf.saved_model.load(str(model.saved_model_dir))
    w = {v.name[:-2]: v.numpy() for v in original.variables}["dense/kernel"]
    w8 = tf.cast(tf.clip_by_value(tf.cast(w, tf.bfloat16) / tf.cast(scale, tf.bfloat16), -448, 448),
                 tf.dtypes.experimental.float8_e4m3fn)
    np.testing.assert_array_equal(kernel, (tf.cast(w8, tf.bfloat16) * tf.cast(scale, tf.bfloat16)).numpy().astype(np.float32))
    graph = tf.saved_model.load(str(tmp_path / "stored")).signatures["serving_default"].graph.as_graph_def()
    names = [n.name for f in graph.library.function for n in f.node_def] + [n.name for n in graph.node]
    assert not [n for n in names if "kernel_float8" in n] and [n for n in names if "inputs_float8" in n]
    inputs = model.sample_inputs["serving_default"]
    (y_stored,) = run_signature(tmp_path / "stored", "serving_default", inputs).values()
    keras_model = _keras_quantized(model, policy_map)
    keras_model.get_layer("dense").kernel_scale.assign(scale)  # Keras's starts at 1; the rewrite's is the weights'
    y_keras = tf.function(keras_model)(tf.constant(inputs["features"]))
    np.testing.assert_array_equal(y_stored, np.asarray(y_keras, np.float32))


def test_recalibration_survives_save_and_reload(zoo, outputs, tmp_path):
    """Asked for, the output carries tfpolicy.calibrate, and a model it recalibrates can be saved and reloaded."""
    block = zoo.get("keras3_transformer")
    out, report = outputs.get("keras3_transformer", TRANSFORMER_FLOAT8, "tf8_recalibratable", calibrate_function=True)
    assert not any("--calibrate_function" in w for w in report.warnings)
    loaded = tf.saved_model.load(str(out))
    before = {v.name: v.numpy() for v in loaded.tfpolicy.variables}
    new_scales = loaded.tfpolicy.calibrate(**{k: tf.constant(v) for k, v in _transformer_inputs(7).items()})
    assert new_scales["mha/value/inputs_scale"].numpy() != before["mha/value/inputs_scale:0"]
    resaved = tmp_path / "resaved"
    tf.saved_model.save(loaded, str(resaved), signatures=loaded.signatures)
    reloaded = tf.saved_model.load(str(resaved))
    after = {v.name: v.numpy() for v in reloaded.tfpolicy.variables}
    assert after["mha/value/inputs_scale:0"] == new_scales["mha/value/inputs_scale"].numpy()
    assert callable(reloaded.tfpolicy.calibrate)
    inputs = _transformer_inputs(8)
    y_fp32 = _single_output(block, block.saved_model_dir, inputs)
    y_recal = _single_output(block, resaved, inputs)
    assert np.abs(y_recal - y_fp32).max() < np.abs(_single_output(block, out, inputs) - y_fp32).max()


# -- serving: XLA, the FP8 GEMM pattern, TF1 loader ----------------------------------------


CASES = {
    "int8": ("keras3_quantizable", INT8_MAP, {}),
    "float8": ("keras3_quantizable", FLOAT8_MAP, {"calibration_data": [{"tokens": np.arange(40, dtype=np.int32).reshape(8, 5) % 20}]}),
    "cnn": ("keras3_cnn", CNN_MAP, {"int8_convolutions": True}),
}


def _case(outputs, tag: str):
    name, policy_map, kwargs = CASES[tag]
    return outputs.get(name, policy_map, {"float8": "float8_xla"}.get(tag, tag), **kwargs)


@pytest.mark.parametrize("tag", sorted(CASES))
def test_every_signature_runs_under_xla_with_the_same_results(zoo, outputs, tag):
    """XLA runs every signature, and at least as accurately as TensorFlow's own kernels.

    XLA accumulates bfloat16 contractions in float32 on every CPU; TensorFlow's
    CPU kernels do so only through oneDNN on CPUs with AVX512-BF16 (elsewhere
    its Einsum is 4x less accurate), so "the same results" is measured against
    the float32 model: with oneDNN the two agree to 1e-2, without it XLA is as
    close (float8: within its rounding step).
    """
    name = CASES[tag][0]
    out, _ = _case(outputs, tag)
    loaded = tf.saved_model.load(str(out))
    original = tf.saved_model.load(str(zoo.get(name).saved_model_dir))
    for key, inputs in zoo.get(name).sample_inputs.items():
        function = loaded.signatures[key]
        feeds = {k: tf.constant(v) for k, v in inputs.items()}
        eager = function(**feeds)
        compiled = tf.function(lambda **kw: function(**kw), jit_compile=True)(**feeds)
        reference = original.signatures[key](**feeds)
        for output in eager:
            want = reference[output].numpy().astype(np.float64)
            xla_error = np.abs(compiled[output].numpy() - want).max()
            tf_error = np.abs(eager[output].numpy() - want).max()
            # float8's e4m3 steps are 6%: where upstream bfloat16 kernels round
            # differently, some values land one step apart, either way.
            factor = 1.5 if tag == "float8" else 1.05
            assert xla_error <= tf_error * factor + 1e-6, (xla_error, tf_error)
            if abs(xla_error - tf_error) <= 0.01 * tf_error:  # equally accurate kernels: the same numbers
                np.testing.assert_allclose(compiled[output].numpy(), eager[output].numpy(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("target", ["gpu", None])
def test_float8_dot_operands_match_xla_fp8_gemm_pattern(zoo, outputs, target):
    """--target gpu: each float8 dot's operands are dequantized float8 values, the pattern of XLA's FP8 GEMMs.

    Without it the same rounding is float32 arithmetic (faster on CPUs), and no float8 value reaches XLA.
    """
    name, policy_map, kwargs = CASES["float8"]
    out, _ = outputs.get(name, policy_map, f"float8_xla_{target}", target=target, **kwargs)
    loaded = tf.saved_model.load(str(out))
    function = loaded.signatures["serving_default"]
    tokens = tf.constant(zoo.get("keras3_quantizable").sample_inputs["serving_default"]["tokens"])
    compiled = tf.function(lambda t: function(tokens=t), jit_compile=True)
    hlo = compiled.experimental_get_compiler_ir(tokens)(stage="hlo")
    instructions = _hlo_instructions(hlo)
    float8_dots = [i for i in instructions.values() if i.op == "dot" and re.search(r"/(dense_in|proj|mix)_\d+/", i.op_name)]
    assert len(float8_dots) == 3
    if target is None:
        assert "f8e4m3fn" not in hlo
        return
    for dot in float8_dots:
        for operand in dot.operands:
            _assert_float8_dequantized(instructions, operand)
    other_dots = [i for i in instructions.values() if i.op == "dot" and i not in float8_dots]
    assert other_dots and not any("f8e4m3fn" in instructions[o].shape for d in other_dots for o in d.operands)


class _Instruction:
    def __init__(self, name: str, shape: str, op: str, operands: list[str], op_name: str) -> None:
        self.name, self.shape, self.op, self.operands, self.op_name = name, shape, op, operands, op_name


_HLO_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+(?:\{[^}]*\})?)\s+([\w\-]+)\((.*?)\)")


def _hlo_instructions(hlo: str) -> dict[str, _Instruction]:
    found = {}
    for line in hlo.splitlines():
        match = _HLO_LINE.match(line)
        if not match:
            continue
        name, shape, op, args = match.groups()
        operands = re.findall(r"%([\w.\-]+)", args)
        op_name = re.search(r'op_name="([^"]*)"', line)
        found[name] = _Instruction(name, shape, op, operands, op_name.group(1) if op_name else "")
    return found


def _skip_layout(instructions, name: str) -> _Instruction:
    node = instructions[name]
    while node.op in ("bitcast", "copy", "reshape", "transpose"):
        node = instructions[node.operands[0]]
    return node


def _assert_float8_dequantized(instructions, operand: str) -> None:
    """``multiply(convert(f8e4m3fn convert(...)), broadcast(scalar))`` or its divide form."""
    node = _skip_layout(instructions, operand)
    assert node.op in ("multiply", "divide"), node.op
    kinds = sorted(instructions[o].op for o in node.operands)
    assert kinds == ["broadcast", "convert"], kinds
    convert = next(instructions[o] for o in node.operands if instructions[o].op == "convert")
    assert instructions[convert.operands[0]].shape.startswith("f8e4m3fn")
    broadcast = next(instructions[o] for o in node.operands if instructions[o].op == "broadcast")
    assert re.match(r"\w+\[\]", instructions[broadcast.operands[0]].shape), "the scale must be a scalar"


@pytest.mark.parametrize("tag", ["int8", "float8"])
def test_quantized_outputs_run_through_the_tf1_session_loader(zoo, outputs, tag):
    name = "keras3_quantizable"
    out, _ = _case(outputs, tag)
    inputs = zoo.get(name).sample_inputs["serving_default"]
    expected = _single_output(zoo.get(name), out)
    with tf.compat.v1.Session(graph=tf.Graph()) as session:
        meta_graph = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(out))
        signature = meta_graph.signature_def["serving_default"]
        (output,) = signature.outputs.values()
        got = session.run(output.name, {signature.inputs["tokens"].name: inputs["tokens"]})
    np.testing.assert_array_equal(got, expected)


# -- plan, report, errors -----------------------------------------------------------------


def test_explain_lists_quantized_declined_and_variables(zoo):
    report = tfpolicy.explain(zoo.get("keras3_transformer").saved_model_dir,
                              {"default_policy": "mixed_bfloat16", "policy_map": {"mha": INT8, "ffn_in": INT8}})
    mha = report.quantization["mha"]  # the attention einsums multiply activations, not weights
    assert mha.ops_quantized == 0 and mha.declined
    assert all("kernel not a variable" in reason for reason in mha.declined)
    ffn = report.quantization["ffn_in"]
    assert ffn.ops_quantized == 1 and ffn.variables == ["ffn_in/kernel", "ffn_in/kernel_scale"]
    low, high = ffn.scales["ffn_in/kernel_scale"]
    assert 0 < low <= high
    table = report.format_table()
    assert "kernel not a variable" in table and "int8: 1 op quantized (kernel_scale" in table
    as_json = report.to_json()["quantization"]
    assert as_json["ffn_in"]["ops_quantized"] == 1
    assert [op.split(":")[0] for op in as_json["ffn_in"]["quantized_ops"]] == ["serving_default"]  # serve: the same function
    assert {d["op"] for d in as_json["mha"]["declined_ops"]} == {"Einsum"}


def test_int8_from_mixed_float16_is_refused_in_one_line(zoo, tmp_path):
    with pytest.raises(tfpolicy.PolicyMapError) as raised:
        tfpolicy.rewrite(zoo.get("keras3_mlp").saved_model_dir, tmp_path / "out",
                         {"policy_map": {"head": "int8_from_mixed_float16"}})
    message = str(raised.value)
    assert "\n" not in message and "int8_from_mixed_float16" in message and "'head'" in message
    assert not (tmp_path / "out").exists()


def test_quantized_layer_without_a_matmul_warns_and_strict_refuses(zoo, tmp_path):
    saved_model = zoo.get("keras3_transformer").saved_model_dir
    policy_map = {"policy_map": {"ln_1": INT8}}
    report = tfpolicy.explain(saved_model, policy_map)
    assert any("ln_1" in w and "no matmul-like op" in w for w in report.warnings)
    with pytest.raises(tfpolicy.StrictModeError, match="ln_1"):
        tfpolicy.rewrite(saved_model, tmp_path / "out", policy_map, strict=True)
    assert not (tmp_path / "out").exists()


def test_bad_calibration_batches_are_input_errors(zoo, tmp_path):
    saved_model = zoo.get("keras3_mlp").saved_model_dir
    policy_map = {"policy_map": {"dense": FLOAT8}}
    with pytest.raises(tfpolicy.InputDataError, match="features"):
        tfpolicy.rewrite(saved_model, tmp_path / "a", policy_map, calibration_data=[{"wrong": np.zeros((2, 16))}])
    with pytest.raises(tfpolicy.InputDataError, match="no examples"):
        tfpolicy.rewrite(saved_model, tmp_path / "b", policy_map, calibration_data=[])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_tf_data_dataset_calibrates_like_a_list_of_batches(zoo, tmp_path):
    saved_model = zoo.get("keras3_mlp").saved_model_dir
    features = (np.random.default_rng(3).standard_normal((12, 16)) * 30).astype(np.float64)  # cast to float32
    dataset = tf.data.Dataset.from_tensor_slices({"features": features.astype(np.float32)}).batch(4)
    policy_map = {"policy_map": {"dense|dense_1": FLOAT8}}
    a = tfpolicy.rewrite(saved_model, tmp_path / "a", policy_map, calibration_data=dataset)
    b = tfpolicy.rewrite(saved_model, tmp_path / "b", policy_map,
                         calibration_data=[{"features": features[i:i + 4]} for i in range(0, 12, 4)],
                         calibration_batches=2)
    assert (a.calibration_batches, b.calibration_batches) == (3, 2)
    from_dataset, from_list = _variables(tmp_path / "a"), _variables(tmp_path / "b")
    # Histories roll left: after 3 batches [a3, 0, ..., a1, a2]; after 2 [a2, 0, ..., a1].
    dataset_history, list_history = from_dataset["dense/inputs_amax_history"], from_list["dense/inputs_amax_history"]
    assert (dataset_history[-2], dataset_history[-1]) == (list_history[-1], list_history[0]) and list_history[0] > 0
    assert from_dataset["dense/inputs_scale"] != 1.0


def _conv_zoo_model() -> "keras.Model":
    """Conv1D (its kernel reaches Conv2D through ExpandDims), a grouped Conv2D (Keras runs it in a called
    ``_conv_xla`` function) and Conv2DTranspose (Conv2DBackpropInput)."""
    signal = keras.Input(shape=(16, 4), name="signal")
    x = keras.layers.Conv1D(8, 3, padding="same", activation="relu", name="conv1d")(signal)
    x = keras.layers.Reshape((4, 4, 8), name="to_image")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", groups=2, name="grouped")(x)
    x = keras.layers.Conv2DTranspose(4, 3, strides=2, padding="same", name="up")(x)
    return keras.Model(signal, keras.layers.GlobalAveragePooling2D(name="pool")(x))


@pytest.mark.parametrize("int8_convolutions", [False, True])
def test_int8_convolution_kinds(tmp_path, int8_convolutions):
    """Declined by default; with int8_convolutions every kind stores an int8 kernel and still serves."""
    keras.utils.set_random_seed(7)
    model = _conv_zoo_model()
    model.export(str(tmp_path / "in"), verbose=False)
    layers = ("conv1d", "grouped", "up")
    policy = {"default_policy": "mixed_bfloat16", "policy_map": {"|".join(layers): INT8}}
    report = tfpolicy.rewrite(tmp_path / "in", tmp_path / "out", policy, int8_convolutions=int8_convolutions)
    assert all(s.tf1_ran and s.xla_compiles for s in report.serving_checks.signatures)
    quantized = {path: report.quantization[path].ops_quantized for path in layers}
    x = np.random.default_rng(0).normal(size=(3, 16, 4)).astype(np.float32)
    y_fp32 = run_signature(tmp_path / "in", "serving_default", {"signal": x})
    y_tool = run_signature(tmp_path / "out", "serving_default", {"signal": x})
    error = max(float(np.abs(y_tool[k] - y_fp32[k]).max()) for k in y_fp32)
    scale = max(float(np.abs(v).max()) for v in y_fp32.values())
    if not int8_convolutions:
        assert quantized == {"conv1d": 0, "grouped": 0, "up": 0}
        assert not hasattr(tf.saved_model.load(str(tmp_path / "out")), "tfpolicy")  # no variable made or retyped
        assert 0 < error <= 0.01 * scale  # bfloat16's error
        return
    assert all(n >= 1 for n in quantized.values()), quantized
    ours = _variables(tmp_path / "out")
    assert {ours[f"{path}/kernel"].dtype for path in layers} == {np.dtype(np.int8)}
    assert ours["conv1d/kernel"].shape == (3, 4, 8) and ours["conv1d/kernel_scale"].shape == (8,)
    assert 0 < error <= 0.05 * scale

"""Real architectures with the default settings, against Keras applying the same map.

The zoo is ``tools/realmodels.py``'s (keras_hub BERT, DistilBERT, GPT-2, Llama, T5, DeBERTa-v3, Gemma, Whisper;
keras.applications ResNet50, MobileNetV3Small, ConvNeXtTiny; tf-keras
MobileNetV2), each exported once per session with random weights, each under
five maps (``bf16``, ``int8``, ``int4``, ``float8`` calibrated, a per-layer ``mix``). For
every pair: tfpolicy exits cleanly with the serving checks on, both loaders
run every signature, signatures are unchanged to the static dimension, every
signature still compiles under XLA, and the error against float32 stays within
Keras's own (float maps 1.1x, quantized maps 1.25x; float8 with tfpolicy's
calibrated scales copied into Keras).
"""

from __future__ import annotations

import pathlib
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from cli_helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
import realmodels  # noqa: E402

import tfpolicy  # noqa: E402

pytestmark = pytest.mark.slow  # builds keras_hub and keras.applications architectures

FLOAT_BOUND = 1.1
QUANTIZED_BOUND = 1.25
# Every map on the transformers; the large CNNs (10-50 s a case on two cores)
# under bf16 and int8 here, all four in tools/realmodels.py's table.
# int4 applies to Dense/EinsumDense layers, of which these CNNs have none or one.
# int8 keeps the convolutions in bfloat16 as Keras does; int8conv quantizes them (int8_convolutions).
_CNN_MAPS = {"resnet50": ("bf16", "int8conv"), "mobilenetv3small": tuple(m for m in realmodels.MAPS if m != "int4"),
             "convnexttiny": ("bf16", "int8conv"), "tfkeras_mobilenetv2": ("bf16", "int8conv")}
# The second wave, within the suite's time: a float and a quantized map each (all maps in the README's table).
# Mixtral's random-weight router flips experts on the smallest rounding, so its errors measure chaos, not
# precision (int8 68% error, in Keras too; one batch's ratio says little of the next): the table only.
_SECOND_WAVE_MAPS = {"t5": ("bf16", "int8", "float8"), "deberta": ("bf16", "int8"), "gemma": ("bf16", "float8"),
                     "whisper": ("bf16", "mix"), "mixtral": (), "decoding_loop": ("bf16", "int8")}
_MAPS = {**_CNN_MAPS, **_SECOND_WAVE_MAPS}
CASES = [(model, which) for model in realmodels.MODELS for which in _MAPS.get(model, realmodels.MAPS)
         if (which != "int8conv" or model in _CNN_MAPS)
         and (model, which) not in {**realmodels.KERAS_CANNOT, **realmodels.UNSEEN_CASTS}]


Served = tuple[dict[str, tuple], dict[str, np.ndarray]]  # signature specs, serving_default's outputs


class RealZoo:
    """Exports each real model at most once per session, when a test first asks; and serves it once."""

    def __init__(self, root: pathlib.Path) -> None:
        self._root = root
        self._built: dict[str, realmodels.RealModel] = {}
        self._served: dict[str, Served] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> realmodels.RealModel:
        with self._lock:
            if name not in self._built:
                self._built[name] = realmodels.build(name, self._root / name)
            return self._built[name]

    def served(self, name: str) -> Served:
        """The float32 export's signature specs and its outputs on the model's inputs (every map compares with them)."""
        model = self.get(name)
        with self._lock:
            if name not in self._served:
                self._served[name] = _specs_and_outputs(model.saved_model_dir, model.inputs)
            return self._served[name]


@pytest.fixture(scope="session")
def real_zoo(tmp_path_factory: pytest.TempPathFactory) -> RealZoo:
    return RealZoo(tmp_path_factory.mktemp("real_zoo"))


def _specs_and_outputs(directory: pathlib.Path, inputs: dict[str, np.ndarray]) -> Served:
    """Every signature's specs, and ``serving_default``'s outputs on ``inputs`` (as float32), from one load."""
    loaded = tf.saved_model.load(str(directory))
    specs = {key: (fn.structured_input_signature, fn.structured_outputs)
             for key, fn in sorted(loaded.signatures.items())}
    return specs, realmodels.run_signature(loaded.signatures["serving_default"], inputs)


@pytest.mark.parametrize(("name", "which"), CASES, ids=[f"{m}-{w}" for m, w in CASES])
def test_rewrites_with_defaults_as_faithfully_as_keras(real_zoo, tmp_path, name, which):
    model = real_zoo.get(name)
    plain = realmodels.policy_map(model, which)
    out = tmp_path / "out"
    report = tfpolicy.rewrite(
        model.saved_model_dir, out, plain,
        calibration_data=model.calibration if which == "float8" else None, **realmodels.REWRITE_OPTIONS.get(which, {}),
    )

    # Served as TF Serving serves it, and compiled as XLA compiles it.
    checks = report.serving_checks
    assert checks is not None and checks.signatures
    assert all(s.tf1_ran for s in checks.signatures), checks.to_json()
    assert all(s.xla_compiles for s in checks.signatures), checks.to_json()
    specs_ref, y_ref = real_zoo.served(name)
    specs_tool, y_tool = _specs_and_outputs(out, model.inputs)
    assert specs_tool == specs_ref  # names, dtypes, static dimensions
    assert all(np.isfinite(v).all() for v in y_tool.values())
    e_tool = realmodels.relative_error(y_tool, y_ref)
    assert e_tool > 0  # the map changed something
    if which in ("int8", "int8conv", "int4"):
        quantized = sum(q.ops_quantized for q in report.quantization.values())
        declined = [d["op"] for q in report.quantization.values() for d in q.declined_ops]
        # MobileNetV3Small's int8 layers are all convolutions, which int8 (as Keras) declines.
        assert quantized > 0 or (which == "int8" and declined), (quantized, declined)
    if model.rebuild is None:  # tf-keras, tf.Module: no Keras 3 oracle; the error stays a precision error
        assert e_tool < 0.1, e_tool
        return
    scales = realmodels.float8_scales(out) if which == "float8" else None
    y_keras = realmodels.keras_native(model, plain, scales)
    e_keras = realmodels.relative_error(y_keras, y_ref)
    if realmodels.quantizes_convolutions(model, which):
        # Keras cannot quantize convolutions and keeps them in bfloat16: the two
        # figures are reported (README), and tfpolicy's stays an int8 error.
        print(f"{name} {which}: tfpolicy {e_tool:.3g}, Keras (convolutions in bfloat16) {e_keras:.3g}")
        assert e_keras <= e_tool < 0.1, (e_tool, e_keras)
        return
    assert_error_like_kerass(e_tool, e_keras, FLOAT_BOUND if which in ("bf16", "mix") else QUANTIZED_BOUND)


APPLIED_BOUND = 2.0
"""The rewrite may be more accurate than Keras (a float32 island Keras rounds around: BERT under
mixed_bfloat16 is 0.90x), but not by half: that is a map not (or only partly) applied."""


def assert_error_like_kerass(e_tool: float, e_keras: float, bound: float) -> None:
    """The rewrite's error against float32 is Keras's within ``bound`` above and :data:`APPLIED_BOUND`
    below, which an output whose map was not (or only partly) applied would fall under."""
    assert e_keras > 0, "Keras's own output equals float32's: the comparison says nothing"
    assert e_keras / APPLIED_BOUND <= e_tool <= bound * e_keras, (e_tool, e_keras)


@pytest.mark.parametrize("e_tool, fails", [(0.0, True), (0.0031, True), (0.012, True), (0.028, False), (0.032, False),
                                            (0.04, True)])
def test_the_comparison_fails_for_an_output_whose_map_was_not_applied(e_tool, fails):
    """Unapplied (0), mostly unapplied (a tenth, under half of Keras's error), Keras's, and worse than the bound."""
    if fails:
        with pytest.raises(AssertionError):
            assert_error_like_kerass(e_tool, 0.031, QUANTIZED_BOUND)
    else:
        assert_error_like_kerass(e_tool, 0.031, QUANTIZED_BOUND)


@pytest.mark.parametrize("name", ["mobilenetv3small", "resnet50"])
def test_mixed_bfloat16_is_keras_bit_for_bit(real_zoo, tmp_path, name):
    """Where tfpolicy's op sequence is Keras's, the outputs are Keras's exactly."""
    model = real_zoo.get(name)
    plain = realmodels.policy_map(model, "bf16")
    tfpolicy.rewrite(model.saved_model_dir, tmp_path / "out", plain, serving_checks=False)
    y_tool = realmodels.run_saved_model(tmp_path / "out", model.inputs)
    y_keras = realmodels.keras_native(model, plain)
    for key, got in y_tool.items():
        np.testing.assert_array_equal(got, y_keras[key])


WHISPER_KEYS = {
    # keras_hub applies GELU between layers, in TensorFlow's ``Gelu_1`` scope (no layer's call): after a
    # float32 convolution in a bfloat16 model it runs in float32.
    "gelu_between_layers": {"encoder_token_embedding_conv_layer_2": "float32"},
    # The float16 projection's output reaches the residual add through the block's Dropout (no op at
    # inference), which casts it to bfloat16: the add runs in bfloat16 (RESIDUAL_ADDS).
    "residual_add": {"transformer_encoder_layer_0/feedforward_output_dense": "mixed_float16"},
}


@pytest.mark.parametrize("case", sorted(WHISPER_KEYS))
def test_casts_keras_makes_between_layers_are_made_bit_for_bit(real_zoo, tmp_path, case):
    model = real_zoo.get("whisper")
    plain = {"default_policy": "mixed_bfloat16", "policy_map": WHISPER_KEYS[case]}
    tfpolicy.rewrite(model.saved_model_dir, tmp_path / "out", plain, serving_checks=False)
    y_tool = realmodels.run_saved_model(tmp_path / "out", model.inputs)
    y_keras = realmodels.keras_native(model, plain)
    for key, got in y_tool.items():
        np.testing.assert_array_equal(got, y_keras[key])


def test_bert_under_mixed_float16_with_a_padding_mask_stays_finite(real_zoo, tmp_path):
    model = real_zoo.get("bert")
    assert (model.inputs["padding_mask"] == 0).any()  # some tokens are hidden
    plain = {"default_policy": "mixed_float16"}
    tfpolicy.rewrite(model.saved_model_dir, tmp_path / "out", plain)
    y_ref = real_zoo.served("bert")[1]
    y_tool = realmodels.run_saved_model(tmp_path / "out", model.inputs)
    assert all(np.isfinite(v).all() for v in y_tool.values())
    e_keras = realmodels.relative_error(realmodels.keras_native(model, plain), y_ref)
    assert_error_like_kerass(realmodels.relative_error(y_tool, y_ref), e_keras, FLOAT_BOUND)


def test_every_layer_of_t5_with_variables_is_found_by_its_keras_path(real_zoo):
    """keras_hub's T5 names eleven kernels ``transformer_decoder_layer_0/kernel``: the call scopes place them."""
    model = real_zoo.get("t5")
    report = tfpolicy.explain(model.saved_model_dir, {"default_policy": "mixed_bfloat16"})
    found = {row.path for row in report.plan.rows() if row.variable_count}
    assert len(model.owners) == 51 and found == model.owners
    assert not [w for w in report.warnings if "share the TF name" in w]
    # A key on a sublayer reaches its ops alone: the cross-attention's key projection, quantized.
    key = "transformer_decoder_layer_0/cross_attention/key_projector"
    report = tfpolicy.explain(model.saved_model_dir, {"default_policy": "mixed_bfloat16",
                                                      "policy_map": {key: "int8_from_mixed_bfloat16"}})
    assert list(report.quantization) == [key] and report.quantization[key].ops_quantized == 1


def test_llama_keeps_rmsnorm_and_rotary_in_float32(real_zoo):
    report = tfpolicy.explain(real_zoo.get("llama").saved_model_dir, {"default_policy": "mixed_bfloat16"})
    table = report.format_table()
    norm_rows = [line for line in table.splitlines() if "layernorm" in line]
    assert norm_rows and all("normalization" in line and "kept" in line for line in norm_rows)
    assert "computed from integers and constants only" in table  # rotary positions


class _MaskedAttention(tf.Module):
    """A tf.Module attention with the common additive mask ``(1 - mask) * -1e9``."""

    def __init__(self, mask_dtype: tf.DType) -> None:
        super().__init__(name="attention")
        rng = np.random.default_rng(3)
        self.weights_ = {}
        for part in ("query", "key", "value"):
            with tf.name_scope(part):
                self.weights_[part] = tf.Variable(rng.standard_normal((16, 16)).astype("float32") * 0.3, name="kernel")
        self.__call__ = tf.function(
            self._call, input_signature=[tf.TensorSpec([None, 8, 16], tf.float32), tf.TensorSpec([None, 8], mask_dtype)]
        )

    def _call(self, x: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
        q, k, v = (tf.matmul(x, self.weights_[p]) for p in ("query", "key", "value"))
        scores = tf.einsum("bqd,bkd->bqk", q, k) / 4.0
        scores += (1.0 - tf.cast(mask, tf.float32)[:, None, :]) * -1e9
        return tf.einsum("bqk,bkd->bqd", tf.nn.softmax(scores), v)


@pytest.mark.parametrize("mask_dtype", [tf.int32, tf.float32], ids=["int_mask", "float_mask"])
def test_module_with_additive_mask_stays_finite_under_mixed_float16(tmp_path, mask_dtype):
    module = _MaskedAttention(mask_dtype)
    tf.saved_model.save(module, str(tmp_path / "in"), signatures=module.__call__.get_concrete_function())
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 8, 16)).astype("float32")
    mask = np.ones((3, 8), dtype=mask_dtype.as_numpy_dtype)
    mask[:, 5:] = 0  # the last three keys hidden
    report = tfpolicy.rewrite(tmp_path / "in", tmp_path / "out", {"default_policy": "mixed_float16"})
    assert report.casts_inserted > 0
    run = lambda d: next(iter(tf.saved_model.load(str(d)).signatures["serving_default"](  # noqa: E731
        x=tf.constant(x), mask=tf.constant(mask)).values())).numpy().astype(np.float32)
    y_ref, y_tool = run(tmp_path / "in"), run(tmp_path / "out")
    assert np.isfinite(y_tool).all()
    assert np.abs(y_tool - y_ref).max() <= 0.01 * np.abs(y_ref).max()

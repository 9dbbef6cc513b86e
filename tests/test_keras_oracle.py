"""Keras is the oracle: the same map applied natively in Keras 3 and by tfpolicy.

For each model: one copy is exported in float32 and rewritten by tfpolicy, a
second copy with the same weights gets ``layer.dtype_policy = pm[layer.path]``
(keras-semantics.md section 6), and both run on the same batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfpolicy
from model_zoo import apply_policy_map_natively, run_signature

pytestmark = pytest.mark.slow  # Keras applying every zoo map natively

MIXED_MAP = {
    "default_policy": "mixed_bfloat16",
    "policy_map": {"mha/.*": "mixed_float16", "ffn_out": "float32", "ln_2": "mixed_float16"},
}


def _keras_output(zoo_model, policy_map: dict) -> np.ndarray:
    model = zoo_model.rebuild()
    keras_map = tfpolicy.PolicyMap.load(policy_map).to_keras()
    apply_policy_map_natively(model, keras_map)
    (inputs,) = zoo_model.sample_inputs["serving_default"].values()
    # As a graph with the export's dynamic batch, as Keras's own export runs it:
    # TensorFlow's eager and graph kernels for bfloat16 differ on CPUs without
    # AVX512-BF16 (oneDNN off), and static shapes change Keras's einsums.
    spec = tf.TensorSpec((None, *inputs.shape[1:]), tf.as_dtype(inputs.dtype))
    outputs = tf.function(lambda x: model(x, training=False), input_signature=[spec])(tf.constant(inputs))
    return np.asarray(keras.ops.convert_to_numpy(outputs), dtype=np.float32)


def _rewritten_output(zoo_model, policy_map: dict, tmp_path) -> tuple[np.ndarray, np.ndarray, object]:
    out = tmp_path / "rewritten"
    report = tfpolicy.rewrite(zoo_model.saved_model_dir, out, policy_map)
    inputs = zoo_model.sample_inputs["serving_default"]
    (y_ref,) = run_signature(zoo_model.saved_model_dir, "serving_default", inputs).values()
    (y_tool,) = run_signature(out, "serving_default", inputs).values()
    return y_ref, y_tool, report


def _built_under(default_policy: str, build) -> "keras.Model":
    """``build()`` under Keras's global dtype policy ``default_policy``, as a model built with the map's default."""
    keras.config.set_dtype_policy(default_policy)
    try:
        return build()
    finally:
        keras.config.set_dtype_policy("float32")


def _run_single_input(saved_model_dir, x: np.ndarray) -> np.ndarray:
    """The single output of ``serving_default`` on its single input ``x``."""
    function = tf.saved_model.load(str(saved_model_dir)).signatures["serving_default"]
    (name,) = function.structured_input_signature[1]
    (y,) = function(**{name: tf.constant(x)}).values()
    return y.numpy()


def test_mlp_mixed_bfloat16_is_bit_identical_to_keras(zoo, tmp_path):
    mlp = zoo.get("keras3_mlp")
    policy = {"default_policy": "mixed_bfloat16"}
    y_ref, y_tool, _ = _rewritten_output(mlp, policy, tmp_path)
    y_keras = _keras_output(mlp, policy)
    assert y_tool.dtype == np.float32  # the signature keeps its output dtype
    assert np.abs(y_tool - y_ref).max() > 0  # bf16 really happened
    np.testing.assert_array_equal(y_tool, y_keras)


@pytest.mark.parametrize(
    "policy",
    [{"default_policy": "mixed_bfloat16"}, {"default_policy": "mixed_float16"}, MIXED_MAP],
    ids=["mixed_bfloat16", "mixed_float16", "per_layer_mix"],
)
def test_transformer_is_bit_identical_to_keras(zoo, tmp_path, policy):
    """Keras's op sequence, dtype for dtype: the float32 softmax of
    ``dot_product_attention``, LayerNormalization in float32 returning through
    its input's dtype, and the float16 projections of a bfloat16 attention layer
    seeing their input rounded to bfloat16 first."""
    block = zoo.get("keras3_transformer")
    y_ref, y_tool, report = _rewritten_output(block, policy, tmp_path)
    y_keras = _keras_output(block, policy)
    assert np.abs(y_tool - y_ref).max() > 0
    np.testing.assert_array_equal(y_tool, y_keras)
    assert report.casts_inserted > 0


def test_per_layer_mix_resolves_exact_and_regex_keys(zoo, tmp_path):
    report = tfpolicy.explain(zoo.get("keras3_transformer").saved_model_dir, MIXED_MAP)
    by_path = {row.path: row for row in report.plan.rows()}
    assert by_path["mha/query"].key == "mha/.*" and by_path["mha/query"].compute_dtype == "float16"
    assert by_path["ffn_out"].key == "ffn_out" and by_path["ffn_out"].compute_dtype == "float32"
    assert by_path["ffn_in"].key is None and by_path["ffn_in"].compute_dtype == "bfloat16"
    assert by_path["ln_1"].is_normalization


@pytest.mark.parametrize("name", ["keras3_mlp", "keras3_transformer", "tf_module", "tfkeras_lstm"])
def test_all_float32_map_reproduces_outputs_exactly(zoo, tmp_path, name):
    model = zoo.get(name)
    out = tmp_path / "f32"
    report = tfpolicy.rewrite(model.saved_model_dir, out, {"default_policy": "float32"})
    assert report.casts_inserted == 0
    assert sum(s.ops_retyped for s in report.signatures) == 0
    for key, inputs in model.sample_inputs.items():
        before = run_signature(model.saved_model_dir, key, inputs)
        after = run_signature(out, key, inputs)
        assert before.keys() == after.keys()
        for name_ in before:
            np.testing.assert_array_equal(after[name_], before[name_])


def test_a_key_naming_a_layer_without_a_path_follows_keras(tmp_path):
    """Keras gives a layer a path when it builds; an Activation is built at
    construction and has none, so a key naming it reaches nothing there, and the
    rewrite follows (and says so). An Add builds, has a path, and its key holds."""
    keras.utils.set_random_seed(3)

    def build():
        inputs = keras.Input((16,))
        x = keras.layers.Dense(16, name="d")(inputs)
        x = keras.layers.Activation("gelu")(keras.layers.Add()([x, inputs]))
        return keras.Model(inputs, keras.layers.Dense(8, name="e")(x))

    model = build()
    activation, add = (model.layers[i].name for i in (3, 2))
    model.export(str(tmp_path / "in"), verbose=False)
    policy = {"default_policy": "mixed_bfloat16", "policy_map": {activation: "float32", add: "float32"}}
    report = tfpolicy.rewrite(tmp_path / "in", tmp_path / "out", policy)
    assert [w for w in report.warnings if "a layer Keras builds at construction" in w and f"'{activation}'" in w]
    assert activation not in report.plan.layers and report.plan.layers[add].policy == "float32"

    # Built under the map's default, as a model built with ``dtype=pm`` is:
    # the path-less Activation keeps that policy.
    native = _built_under(policy["default_policy"], build)
    native.set_weights(model.get_weights())
    assert native.layers[3].path is None and native.layers[2].path == native.layers[2].name
    pm = tfpolicy.PolicyMap.load(policy).to_keras()
    for layer in native.layers:  # the names differ from the first copy's: map by position
        if layer.path:
            layer.dtype_policy = pm[model.get_layer(index=native.layers.index(layer)).name]
    x = np.random.default_rng(0).normal(size=(4, 16)).astype(np.float32)
    y_keras = tf.function(lambda t: native(t, training=False))(tf.constant(x))
    y_tool = _run_single_input(tmp_path / "out", x)
    np.testing.assert_array_equal(y_tool, np.asarray(y_keras, dtype=np.float32))


def test_ops_a_functional_model_runs_between_layers_keep_their_inputs_dtype(tmp_path):
    """Keras does not autocast the ops a Functional model runs between layers
    (``a + 3.0`` on a float16 layer's output stays float16, ``a + b`` of float16
    and bfloat16 promotes to float32, ``x * 2.0`` on the float32 input stays
    float32), so they are not put in the default policy: bit for bit."""
    keras.utils.set_random_seed(5)

    def build():
        inputs = keras.Input((16,))
        a = keras.layers.Dense(16, name="a")(inputs)
        b = keras.layers.Dense(16, name="b")(inputs)
        mixed = (a + 3.0) * (a + b) + inputs * 2.0
        return keras.Model(inputs, keras.layers.Dense(8, name="e")(mixed))

    model = build()
    model.export(str(tmp_path / "in"), verbose=False)
    policy = {"default_policy": "mixed_bfloat16", "policy_map": {"a": "mixed_float16"}}
    tfpolicy.rewrite(tmp_path / "in", tmp_path / "out", policy)

    native = _built_under(policy["default_policy"], build)
    native.set_weights(model.get_weights())
    apply_policy_map_natively(native, tfpolicy.PolicyMap.load(policy).to_keras())
    assert native.get_layer("a").compute_dtype == "float16"
    x = np.random.default_rng(0).normal(size=(4, 16)).astype(np.float32)
    y_keras = tf.function(lambda t: native(t, training=False))(tf.constant(x))
    y_ref, y_tool = _run_single_input(tmp_path / "in", x), _run_single_input(tmp_path / "out", x)
    assert np.abs(y_tool - y_ref).max() > 0
    np.testing.assert_array_equal(y_tool, np.asarray(y_keras, dtype=np.float32))


def test_tf_keras_op_layers_keep_their_inputs_dtype(tmp_path):
    """tf-keras wraps ``a + 3.0`` in a TFOpLambda layer (``tf.__operators__.add``)
    that does not autocast: it stays in the float16 of the layer before it."""
    import tf_keras  # noqa: PLC0415

    def build(policy, a_policy):
        tf_keras.mixed_precision.set_global_policy(policy)
        try:
            inputs = tf_keras.Input((16,))
            a = tf_keras.layers.Dense(16, name="a", dtype=a_policy)(inputs)
            outputs = tf_keras.layers.Dense(8, name="e")((a + 3.0) * a)
            return tf_keras.Model(inputs, outputs)
        finally:
            tf_keras.mixed_precision.set_global_policy("float32")

    tf_keras.utils.set_random_seed(5)
    model = build("float32", None)
    tf.saved_model.save(model, str(tmp_path / "in"))
    policy = {"default_policy": "mixed_bfloat16", "policy_map": {"a": "mixed_float16"}}
    tfpolicy.rewrite(tmp_path / "in", tmp_path / "out", policy)
    native = build("mixed_bfloat16", "mixed_float16")
    native.set_weights(model.get_weights())
    x = np.random.default_rng(0).normal(size=(4, 16)).astype(np.float32)
    y_keras = tf.function(lambda t: native(t, training=False))(tf.constant(x))
    y_tool = _run_single_input(tmp_path / "out", x)
    np.testing.assert_array_equal(y_tool, np.asarray(y_keras, dtype=np.float32))


@pytest.mark.parametrize("name", ["keras3_mlp", "keras3_transformer", "keras3_sequential", "keras3_subclassed",
                                  "keras3_nested", "keras3_string_lookup", "keras3_quantizable", "keras3_cnn"])
def test_explained_paths_are_kerass_layer_paths(zoo, name):
    """``explain()`` shows Keras's ``layer.path``s. Two known differences: a
    container with no op or variable of its own (a nested Sequential) has
    nothing to show, and a layer Keras builds at construction (no path) that
    the user renamed cannot be told from one that builds, so it shows."""
    model = zoo.get(name)
    native = model.rebuild()
    layers = list(native._flatten_layers(include_self=False))
    keras_paths = {layer.path for layer in layers if layer.path}
    containers = {layer.path for layer in layers if layer.path and layer._layers and not layer._trainable_variables}
    pathless_named = {layer.name for layer in layers if not layer.path and not layer.name.startswith("input")}
    shown = {row.path for row in tfpolicy.explain(model.saved_model_dir, {"default_policy": "float32"}).plan.rows() if row.path}
    assert keras_paths - containers <= shown
    assert shown - keras_paths <= pathless_named, shown - keras_paths


def _pooling_model() -> "keras.Model":
    """Global average pooling (Keras's ``ops.mean``: float32 inside, cast back) first, between two float32
    normalisation layers and last: where its neighbours compute in float32 too, its roundings show."""
    image = keras.Input(shape=(6, 6, 4), name="image")
    pooled = keras.layers.GlobalAveragePooling2D(keepdims=True, name="pool_in")(image)
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv")(keras.layers.Add(name="add")([image, pooled]))
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="ln")(x)
    x = keras.layers.Reshape((2, 4), name="rows")(keras.layers.Dense(8, name="head")(x))
    return keras.Model(image, keras.layers.GlobalAveragePooling1D(name="pool_out")(x))


@pytest.mark.parametrize("default_policy", ["mixed_bfloat16", "mixed_float16"])
def test_global_average_pooling_rounds_as_keras_does(tmp_path, default_policy):
    keras.utils.set_random_seed(3)
    model = _pooling_model()
    model.export(str(tmp_path / "in"), verbose=False)
    tfpolicy.rewrite(tmp_path / "in", tmp_path / "out", {"default_policy": default_policy})
    native = _built_under(default_policy, _pooling_model)
    native.set_weights(model.get_weights())
    x = np.random.default_rng(0).normal(size=(3, 6, 6, 4)).astype(np.float32)
    spec = tf.TensorSpec((None, 6, 6, 4), tf.float32)
    y_keras = tf.function(lambda t: native(t, training=False), input_signature=[spec])(tf.constant(x))
    y_tool = _run_single_input(tmp_path / "out", x)
    assert np.abs(y_tool - _run_single_input(tmp_path / "in", x)).max() > 0
    np.testing.assert_array_equal(y_tool, np.asarray(y_keras, dtype=np.float32))

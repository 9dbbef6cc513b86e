"""Sanity tests of the model zoo fixtures themselves (not of tfpolicy).

Each zoo model must export, load with both the TF2 loader and the TF1 session
loader, agree between the two on its sample inputs, and expose the layer paths
and variables that the rest of the suite relies on.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

import keras
from model_zoo import (
    ALL_BUILDERS,
    UNKNOWN_TOKEN,
    ZooModel,
    apply_policy_map_natively,
    run_signature,
)

pytestmark = pytest.mark.slow  # exports and loads every zoo model

ZOO_NAMES = sorted(ALL_BUILDERS)


def _read_saved_model(model: ZooModel) -> saved_model_pb2.SavedModel:
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((model.saved_model_dir / "saved_model.pb").read_bytes())
    return proto


def _op_types(model: ZooModel) -> set[str]:
    graph = _read_saved_model(model).meta_graphs[0].graph_def
    types = {node.op for node in graph.node}
    for function in graph.library.function:
        types.update(node.op for node in function.node_def)
    return types


def _signature_variable_names(saved_model_dir: object) -> set[str]:
    loaded = tf.saved_model.load(str(saved_model_dir))
    names: set[str] = set()
    for key in loaded.signatures:
        names.update(v.name for v in loaded.signatures[key].variables)
    return names


def _run_tf1(model: ZooModel, key: str) -> dict[str, np.ndarray]:
    with tf.compat.v1.Session(graph=tf.Graph()) as sess:
        meta_graph = tf.compat.v1.saved_model.loader.load(
            sess, ["serve"], str(model.saved_model_dir)
        )
        signature = meta_graph.signature_def[key]
        feed = {
            signature.inputs[name].name: value
            for name, value in model.sample_inputs[key].items()
        }
        assert set(feed) == {t.name for t in signature.inputs.values()}
        names = sorted(signature.outputs)
        values = sess.run([signature.outputs[n].name for n in names], feed_dict=feed)
        return dict(zip(names, values))


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_exports_and_loaders_agree(zoo, name: str) -> None:
    model = zoo.get(name)
    assert model.name == name
    assert (model.saved_model_dir / "saved_model.pb").is_file()

    loaded = tf.saved_model.load(str(model.saved_model_dir))
    assert set(model.sample_inputs) == set(loaded.signatures.keys())
    assert "serving_default" in model.sample_inputs

    for key, inputs in model.sample_inputs.items():
        _, spec = loaded.signatures[key].structured_input_signature
        assert set(inputs) == set(spec)
        for input_name, value in inputs.items():
            assert value.shape[0] == 3
            assert spec[input_name].shape.is_compatible_with(value.shape)

        tf2_out = run_signature(model.saved_model_dir, key, inputs)
        tf1_out = _run_tf1(model, key)
        assert set(tf2_out) == set(tf1_out)
        for out_name, value in tf2_out.items():
            assert np.all(np.isfinite(value)), (key, out_name)
            np.testing.assert_allclose(
                tf1_out[out_name], value, rtol=1e-5, atol=1e-6, err_msg=f"{key}/{out_name}"
            )


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_layer_paths_match_saved_variables(zoo, name: str) -> None:
    model = zoo.get(name)
    variable_names = _signature_variable_names(model.saved_model_dir)
    assert variable_names
    assert all(v.endswith(":0") for v in variable_names)
    owners = {v[: -len(":0")].rsplit("/", 1)[0] for v in variable_names}
    assert owners == set(model.layer_paths)
    assert len(set(model.layer_paths)) == len(model.layer_paths)


@pytest.mark.parametrize(
    "name", [n for n in ZOO_NAMES if n.startswith("keras3_")]
)
def test_rebuild_is_a_fresh_equal_copy(zoo, name: str) -> None:
    model = zoo.get(name)
    assert model.rebuild is not None
    first, second = model.rebuild(), model.rebuild()
    assert first is not second
    assert all(w.dtype == "float32" for w in first.weights)
    paths = {
        layer.path
        for layer in first._flatten_layers(include_self=False)
        if layer.path and layer._trainable_variables
    }
    assert paths == set(model.layer_paths)

    inputs = model.sample_inputs["serving_default"]
    (value,) = inputs.values()
    expected = run_signature(model.saved_model_dir, "serving_default", inputs)
    (expected_value,) = expected.values()
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(first(tf.constant(value))),
        expected_value,
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("name", [n for n in ZOO_NAMES if not n.startswith("keras3_")])
def test_non_keras3_models_have_no_rebuild(zoo, name: str) -> None:
    assert zoo.get(name).rebuild is None


def test_apply_policy_map_natively(zoo) -> None:
    model = zoo.get("keras3_mlp")
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="mixed_bfloat16")
    policy_map["head"] = "float32"
    rebuilt = apply_policy_map_natively(model.rebuild(), policy_map)
    policies = {
        layer.path: layer.dtype_policy.name
        for layer in rebuilt._flatten_layers(include_self=False)
        if layer.path
    }
    assert policies == {"dense": "mixed_bfloat16", "dense_1": "mixed_bfloat16", "head": "float32"}
    (value,) = model.sample_inputs["serving_default"].values()
    reference = run_signature(model.saved_model_dir, "serving_default", model.sample_inputs["serving_default"])
    (reference_value,) = reference.values()
    mixed = keras.ops.convert_to_numpy(rebuilt(tf.constant(value)))
    assert mixed.dtype == np.float32
    np.testing.assert_allclose(mixed, reference_value, atol=0.05)
    assert not np.array_equal(mixed, reference_value)


def test_tfkeras_lstm_lowers_to_a_while_loop(zoo) -> None:
    assert _op_types(zoo.get("tfkeras_lstm")) & {"While", "StatelessWhile"}


def test_string_lookup_carries_table_and_asset(zoo) -> None:
    model = zoo.get("keras3_string_lookup")
    assert {"HashTableV2", "LookupTableFindV2"} <= _op_types(model)
    assets = list((model.saved_model_dir / "assets").iterdir())
    assert len(assets) == 1
    (words,) = model.sample_inputs["serving_default"].values()
    assert words.dtype.kind == "S"
    assert UNKNOWN_TOKEN.encode() in words.reshape(-1).tolist()


def test_tf_module_has_two_signatures_with_different_inputs(zoo) -> None:
    model = zoo.get("tf_module")
    assert set(model.sample_inputs) == {"serving_default", "decode"}
    assert set(model.sample_inputs["serving_default"]) == {"x"}
    assert set(model.sample_inputs["decode"]) == {"code"}
    loaded = tf.saved_model.load(str(model.saved_model_dir))  # keeps the variables alive
    decode_vars = {v.name for v in loaded.signatures["decode"].variables}
    assert decode_vars == {"decoder/kernel:0", "decoder/bias:0"}


def test_builds_are_deterministic(tmp_path) -> None:
    first = ALL_BUILDERS["keras3_mlp"](tmp_path / "a")
    second = ALL_BUILDERS["keras3_mlp"](tmp_path / "b")
    inputs = first.sample_inputs["serving_default"]
    np.testing.assert_array_equal(inputs["features"], second.sample_inputs["serving_default"]["features"])
    out_a = run_signature(first.saved_model_dir, "serving_default", inputs)
    out_b = run_signature(second.saved_model_dir, "serving_default", inputs)
    np.testing.assert_array_equal(out_a["output_0"], out_b["output_0"])


def test_shipped_example_loads() -> None:
    import json
    import pathlib

    example = pathlib.Path(__file__).resolve().parent.parent / "examples" / "mlp"
    policy = json.loads((example / "policy.json").read_text())
    assert policy == {"default_policy": "mixed_bfloat16", "policy_map": {"head": "float32"}}
    outputs = run_signature(
        example / "saved_model", "serving_default", {"features": np.ones((3, 16), np.float32)}
    )
    assert outputs["output_0"].shape == (3, 4)

"""tfpolicy.core.inputs: npz loading, signature checks, batching, generated inputs.

Signatures come from real zoo SavedModels (``keras3_mlp``: features float32
(None, 16); ``keras3_string_lookup``: words string (None, 6); ``tf_module``:
serving_default x (None, 8), decode code (None, 16)).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import tensorflow as tf

import tfpolicy
from tfpolicy.errors import InputDataError
from tfpolicy.core import inputs


@pytest.fixture(scope="module")
def mlp_signature(zoo):
    loaded = tf.saved_model.load(str(zoo.get("keras3_mlp").saved_model_dir))
    yield loaded.signatures["serving_default"]


@pytest.fixture(scope="module")
def strings_signature(zoo):
    loaded = tf.saved_model.load(str(zoo.get("keras3_string_lookup").saved_model_dir))
    yield loaded.signatures["serving_default"]


def test_input_data_error_is_exported_and_a_tfpolicy_error():
    assert issubclass(tfpolicy.InputDataError, tfpolicy.TfPolicyError)
    assert tfpolicy.InputDataError is InputDataError


def test_load_npz_round_trips_numbers_and_strings(tmp_path: pathlib.Path):
    path = tmp_path / "data.npz"
    words = np.array([["the", "cat"], ["sat", "ünïcode"]])  # dtype <U: stored without pickle
    np.savez(path, features=np.ones((2, 16), np.float32), words=words, raw=np.array([b"a", b"b"]))
    arrays = inputs.load_npz(path)
    assert sorted(arrays) == ["features", "raw", "words"]
    assert arrays["features"].dtype == np.float32 and arrays["features"].shape == (2, 16)
    assert arrays["words"].dtype.kind == "S" and arrays["words"][1, 1] == "ünïcode".encode()
    assert arrays["raw"].dtype.kind == "S"


def _then(path: pathlib.Path, _written: object) -> pathlib.Path:
    return path


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: d / "absent.npz", ("absent.npz", "does not exist")),
        (lambda d: (d / "dir.npz").mkdir() or d / "dir.npz", ("dir.npz", "not a file")),
        (lambda d: _then(d / "text.npz", (d / "text.npz").write_text("hello\n")), ("text.npz", "not a readable .npz")),
        (lambda d: np.save(d / "one.npy", np.zeros(3)) or d / "one.npy", ("one.npy", "single .npy array")),
        (lambda d: np.savez(d / "obj.npz", x=np.array([{"a": 1}], dtype=object)) or d / "obj.npz", ("obj.npz", "'x'", "object array")),
        (lambda d: np.savez(d / "empty.npz") or d / "empty.npz", ("empty.npz", "holds no arrays")),
    ],
    ids=["missing", "directory", "not_npz", "npy", "object_array", "empty"],
)
def test_load_npz_errors_are_one_line_and_name_the_file(tmp_path, make, expected):
    path = make(tmp_path)
    with pytest.raises(InputDataError) as raised:
        inputs.load_npz(path, what="validation data")
    message = str(raised.value)
    assert "\n" not in message and message.startswith("validation data '")
    for part in expected:
        assert part in message, message


def test_check_inputs_accepts_fitting_arrays(mlp_signature):
    inputs.check_inputs({"features": np.zeros((5, 16), np.float32)}, "serving_default", mlp_signature, what="data")


@pytest.mark.parametrize(
    "arrays, expected",
    [
        ({}, ("input 'features'", "float32 of shape (None, 16)", "is missing")),
        ({"features": np.zeros((2, 16), np.float32), "extra": np.zeros(2)}, ("no input 'extra'", "takes 'features'")),
        ({"features": np.zeros((2, 16), np.float64)}, ("expects float32 of shape (None, 16)", "received float64 of shape (2, 16)")),
        ({"features": np.zeros((2, 15), np.float32)}, ("received float32 of shape (2, 15)",)),
        ({"features": np.zeros((2, 16, 1), np.float32)}, ("received float32 of shape (2, 16, 1)",)),
    ],
    ids=["missing", "extra", "dtype", "shape", "rank"],
)
def test_check_inputs_names_signature_input_expected_and_received(mlp_signature, arrays, expected):
    with pytest.raises(InputDataError) as raised:
        inputs.check_inputs(arrays, "serving_default", mlp_signature, what="validation data 'v.npz'")
    message = str(raised.value)
    assert message.startswith("validation data 'v.npz': signature 'serving_default'") and "\n" not in message
    for part in expected:
        assert part in message, message


def test_check_inputs_wants_bytes_for_strings(strings_signature):
    good = {"words": np.array([[b"the"] * 6], dtype="S")}
    inputs.check_inputs(good, "serving_default", strings_signature, what="data")
    with pytest.raises(InputDataError, match="expects string of shape"):
        inputs.check_inputs({"words": np.zeros((1, 6), np.int64)}, "serving_default", strings_signature, what="data")


def test_iter_batches_slices_rows_and_requires_equal_first_dims():
    arrays = {"a": np.arange(10).reshape(5, 2), "b": np.arange(5)}
    batches = list(inputs.iter_batches(arrays, 2))
    assert [len(b["b"]) for b in batches] == [2, 2, 1]
    np.testing.assert_array_equal(np.concatenate([b["a"] for b in batches]), arrays["a"])
    with pytest.raises(InputDataError, match="'a' has 5, 'b' has 4"):
        list(inputs.iter_batches({"a": np.zeros((5, 1)), "b": np.zeros(4)}, 2))
    with pytest.raises(InputDataError, match="at least 1"):
        list(inputs.iter_batches(arrays, 0))


def test_generate_inputs_fit_the_signature_and_are_seeded(zoo, mlp_signature, strings_signature):
    first = inputs.generate_inputs(mlp_signature, batch=3, seed=7)
    inputs.check_inputs(first, "serving_default", mlp_signature, what="generated")
    assert first["features"].shape == (3, 16)
    np.testing.assert_array_equal(first["features"], inputs.generate_inputs(mlp_signature, batch=3, seed=7)["features"])
    assert not np.array_equal(first["features"], inputs.generate_inputs(mlp_signature, batch=3, seed=8)["features"])
    words = inputs.generate_inputs(strings_signature)
    inputs.check_inputs(words, "serving_default", strings_signature, what="generated")
    assert words["words"].dtype.kind == "S" and words["words"].shape == (4, 6)
    # The model runs on them.
    assert strings_signature(words=tf.constant(words["words"]))["output_0"].shape == (4, 2)


def test_generate_for_specs_covers_ints_bools_and_unknown_dims():
    specs = {
        "ids": tf.TensorSpec((None, None), tf.int32),
        "mask": tf.TensorSpec((None,), tf.bool),
        "half": tf.TensorSpec((None, 2), tf.float16),
    }
    arrays = inputs.generate_for_specs(specs, batch=5)
    assert arrays["ids"].shape == (5, inputs.UNKNOWN_DIM) and arrays["ids"].min() >= 0 and arrays["ids"].max() < 4
    assert arrays["mask"].dtype == np.bool_ and arrays["half"].dtype == np.float16


def test_batches_from_accepts_paths_dicts_iterables_and_datasets(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.zeros((70, 3), np.float32))
    assert [len(b["x"]) for b in inputs.batches_from(tmp_path / "d.npz", what="d", batch_size=32)] == [32, 32, 6]
    assert len(inputs.batches_from({"x": np.zeros((4, 3))}, what="d", batch_size=2)) == 2
    listed = inputs.batches_from([{"x": np.zeros((2, 3))}] * 5, what="d", max_batches=3)
    assert len(listed) == 3
    dataset = tf.data.Dataset.from_tensor_slices(({"x": np.ones((6, 3), np.float32), "s": np.array([b"a"] * 6)}, np.zeros(6))).batch(4)
    from_dataset = inputs.batches_from(dataset, what="d")
    assert [len(b["x"]) for b in from_dataset] == [4, 2] and from_dataset[0]["s"].dtype.kind == "S"
    with pytest.raises(InputDataError, match="element 0 is a int"):
        inputs.batches_from([1, 2], what="d")
    with pytest.raises(InputDataError, match="holds no examples"):
        inputs.batches_from([], what="d")

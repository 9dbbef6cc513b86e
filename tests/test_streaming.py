"""Variables streamed, not held: the input's read one at a time, the output's written in shards.

Real SavedModels, real checkpoints: the rewrite loads the input without restoring
its checkpoint, reads each value when it needs it, and writes the output's values
shard by shard (``tfpolicy.core.checkpoints``). Peak memory is measured in a
fresh process on a model large enough that holding it would show.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tfpolicy
from tfpolicy.core import checkpoints, savedmodel_io, savedmodel_save, tf_internals
from tfpolicy.errors import SavedModelError

from model_zoo import run_signature

pytestmark = pytest.mark.slow  # measures peak memory on a large model in a fresh process

REPO = pathlib.Path(__file__).resolve().parent.parent


def _values(saved_model_dir: pathlib.Path) -> dict[str, np.ndarray]:
    """Checkpoint key -> value, the object graph left out."""
    reader = tf.train.load_checkpoint(checkpoints.checkpoint_prefix(saved_model_dir))
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map() if key != checkpoints.OBJECT_GRAPH_KEY}


def test_streamed_load_restores_nothing_and_reads_each_value_from_disk(zoo):
    model = zoo["keras3_transformer"]
    streamed = savedmodel_io.load(model.saved_model_dir, streamed=True)
    restored = tf.saved_model.load(str(model.saved_model_dir))
    assert streamed.checkpoint is not None and not streamed.checkpoint.unmatched
    assert streamed.variables and not any(v.is_initialized() for v in streamed.variables)
    by_name = {v.name: v.numpy() for v in restored.variables}
    for variable in streamed.variables:
        np.testing.assert_array_equal(streamed.read(variable).numpy(), by_name[variable.name], err_msg=variable.name)


@pytest.mark.parametrize("policy", ["bfloat16", "int8_from_float32"])
def test_output_values_written_in_shards_serve_as_a_whole(zoo, tmp_path, monkeypatch, policy):
    """Shards of one value each: the merged checkpoint loads in both loaders and matches a one-shard write."""
    model = zoo["keras3_transformer"]
    key, batch = "serving_default", model.sample_inputs["serving_default"]
    whole = tmp_path / "whole"
    tfpolicy.rewrite(model.saved_model_dir, whole, {"default_policy": policy})
    monkeypatch.setattr(checkpoints, "SHARD_BYTES", 1)
    sharded = tmp_path / "sharded"
    report = tfpolicy.rewrite(model.saved_model_dir, sharded, {"default_policy": policy})
    data_files = sorted(p.name for p in (sharded / "variables").iterdir() if ".data-" in p.name)
    values = _values(sharded)
    assert len(data_files) == len(values) + 1  # one per value, and the object graph's
    assert not (sharded / "tfpolicy-parts").exists() and not (sharded / "variables" / "tfpolicy-parts").exists()
    whole_values = _values(whole)
    assert sorted(values) == sorted(whole_values)
    for name, value in values.items():
        np.testing.assert_array_equal(value, whole_values[name], err_msg=name)
    assert any(str(v.dtype) == ("int8" if policy.startswith("int8") else "bfloat16") for v in values.values()), {str(v.dtype) for v in values.values()}
    np.testing.assert_array_equal(run_signature(sharded, key, batch)["output_0"], run_signature(whole, key, batch)["output_0"])
    assert report.serving_checks is not None and report.serving_checks.to_json()["tf1_loader"]


def test_kept_and_converted_values_equal_the_inputs(zoo, tmp_path):
    """float32 layers keep their bytes; bfloat16 ones are the input's, rounded by a Cast."""
    model = zoo["keras3_mlp"]
    out = tmp_path / "out"
    tfpolicy.rewrite(model.saved_model_dir, out, {"default_policy": "float32", "policy_map": {"dense_1": "bfloat16"}})
    source = {v.name.split(":")[0]: v.numpy() for v in tf.saved_model.load(str(model.saved_model_dir)).variables}
    written = {v.name.split(":")[0]: v.numpy() for v in tf.saved_model.load(str(out)).tfpolicy_variables}
    assert set(written) == set(source)
    for name, value in written.items():
        expected = source[name]
        if name.startswith("dense_1/"):
            assert value.dtype == tf.bfloat16.as_numpy_dtype, name
            expected = tf.cast(expected, tf.bfloat16).numpy()
        np.testing.assert_array_equal(value, expected, err_msg=name)


def test_unreadable_input_checkpoint_is_one_error_and_writes_nothing(zoo, tmp_path):
    source = tmp_path / "broken"
    shutil.copytree(zoo["keras3_mlp"].saved_model_dir, source)
    data = next((source / "variables").glob("variables.data-*"))
    data.write_bytes(data.read_bytes()[:64])
    out = tmp_path / "out"
    with pytest.raises(SavedModelError, match="broken") as raised:
        tfpolicy.rewrite(source, out, {"default_policy": "mixed_bfloat16"}, serving_checks=False)
    assert "\n" not in str(raised.value)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


# -- values written while tf.saved_model.save runs ---------------------------

def _root_without_values() -> tuple[tf.Module, dict[int, np.ndarray]]:
    """A root whose variables have no value, one reachable by two paths, and what makes each."""
    root = tf.Module()
    root.layer = tf.Module()
    root.layer.kernel = tf_internals.uninitialized_variable((3, 4), tf.float32, "kernel")
    root.parts = [tf_internals.uninitialized_variable((5,), tf.bfloat16, f"part_{i}") for i in range(3)]
    root.alias = root.parts[1]
    root.step = tf.Variable(7)  # has a value: the save writes it
    rng = np.random.default_rng(0)
    values = {id(v): rng.normal(size=v.shape).astype(v.dtype.as_numpy_dtype) for v in [root.layer.kernel, *root.parts]}
    return root, values


def _value_of(values):
    return lambda obj, attribute: (lambda: tf.constant(values[id(obj)])) if id(obj) in values else None


def _saved_with(writer: checkpoints.ValueWriter, root: tf.Module, out: pathlib.Path) -> dict[int, np.ndarray]:
    out.mkdir()
    writer.start(out)
    tf.saved_model.save(root, str(out))
    writer.finish(out)
    loaded = tf.saved_model.load(str(out))
    return {
        "kernel": loaded.layer.kernel.numpy(), "parts": [p.numpy() for p in loaded.parts],
        "alias": loaded.alias.numpy(), "step": loaded.step.numpy(),
    }


def test_values_written_while_saving_land_under_the_keys_the_save_gives(tmp_path):
    root, values = _root_without_values()
    writer = checkpoints.ValueWriter(root, _value_of(values))
    restored = _saved_with(writer, root, tmp_path / "m")
    assert writer.written_while_saving == 4  # every value, none left for after the save
    np.testing.assert_array_equal(restored["kernel"], values[id(root.layer.kernel)])
    for part, variable in zip(restored["parts"], root.parts):
        np.testing.assert_array_equal(part, values[id(variable)])
    np.testing.assert_array_equal(restored["alias"], values[id(root.parts[1])])
    assert restored["step"] == 7
    assert not (tmp_path / "m" / "tfpolicy-parts").exists()


def test_keys_predicted_wrong_are_written_again(tmp_path, monkeypatch):
    """If the save names a variable otherwise than predicted, no value lands under another's key."""
    root, values = _root_without_values()
    predicted = tf_internals.variable_checkpoint_keys(root)
    variables, keys = zip(*predicted)
    swapped = list(zip(variables, keys[1:] + keys[:1]))  # each value under its neighbour's key
    monkeypatch.setattr(tf_internals, "variable_checkpoint_keys", lambda _: swapped)
    writer = checkpoints.ValueWriter(root, _value_of(values))
    restored = _saved_with(writer, root, tmp_path / "m")
    assert writer.written_while_saving == 0
    np.testing.assert_array_equal(restored["kernel"], values[id(root.layer.kernel)])
    for part, variable in zip(restored["parts"], root.parts):
        np.testing.assert_array_equal(part, values[id(variable)])


def test_a_failed_save_stops_the_writer_and_leaves_nothing(tmp_path):
    root, values = _root_without_values()
    writer = checkpoints.ValueWriter(root, _value_of(values))
    out = tmp_path / "out"
    with pytest.raises((TypeError, ValueError)):  # the save fails while the writer runs
        savedmodel_save.save_atomically(root, {"serving_default": "not a function"}, out, overwrite=False, fill=writer)
    assert writer._thread is not None and not writer._thread.is_alive()  # noqa: SLF001
    assert not out.exists() and list(tmp_path.iterdir()) == []


# -- peak memory, in a fresh process each ------------------------------------

_LAYERS, _WIDTH = 64, 1024  # 64 Dense 1024x1024: 256 MiB of float32 kernels, 4 MiB the largest

_MEASURE = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    import tfpolicy

    def status_mb(field):  # VmHWM, not ru_maxrss: that one starts from the forking parent's RSS
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field)) / 1024

    tf.constant(1.0) + 1.0  # the runtime's own start-up, before the baseline
    baseline = status_mb("VmRSS")
    tfpolicy.rewrite(sys.argv[1], sys.argv[2], {"default_policy": sys.argv[3]}, serving_checks=False)
    print(json.dumps({"baseline": baseline, "peak": status_mb("VmHWM")}))
    """
)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> pathlib.Path:
    import keras

    keras.utils.set_random_seed(3)
    inputs = keras.Input((_WIDTH,), name="x")
    x = inputs
    for i in range(_LAYERS):
        x = keras.layers.Dense(_WIDTH, name=f"dense_{i}")(x)
    path = tmp_path_factory.mktemp("wide") / "model"
    keras.Model(inputs, x).export(str(path), verbose=False)
    return path


@pytest.mark.parametrize("policy, fraction", [("mixed_bfloat16", 0.5), ("int8_from_float32", 1.0)])
def test_peak_memory_stays_below_the_models_size(wide_model, tmp_path, policy, fraction):
    """Holding the input alone would add 256 MiB, and the output as much again or half.

    Streaming adds the graphs, a shard (:data:`checkpoints.SHARD_BYTES`) and one
    kernel's quantization temporaries, which do not grow with the model: this
    model's graphs and shard are a large part of its size, a 1.2B-parameter
    model's a small one (see the README's benchmark).
    """
    model_mb = _LAYERS * _WIDTH * _WIDTH * 4 / 2**20
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(wide_model), str(tmp_path / "out"), policy],
        capture_output=True, text=True, check=True, cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)},
    )
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    above = measured["peak"] - measured["baseline"]
    assert above < fraction * model_mb, f"{policy}: peak {above:.0f} MB above the baseline for a {model_mb:.0f} MB model"

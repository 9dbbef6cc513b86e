"""The output's TF1 saver, written as nodes (tfpolicy.core.tf1_saver), against TensorFlow's traced one."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from tfpolicy.core import savedmodel_save, tf1_saver, tf_internals

VALUES = {
    "kernel": np.arange(6, dtype=np.float32).reshape(2, 3),
    "half": np.array([1.5, -2.0, 3.25, 0.0], dtype=tf.bfloat16.as_numpy_dtype),
    "codes": np.array([[1, -2], [127, -127]], dtype=np.int8),
    "step": np.int32(7),
}


def _module(**extra) -> tf.Module:
    module = tf.Module()
    module.layer = tf.Module()
    module.layer.variables_ = [tf.Variable(value, name=f"layer/{name}") for name, value in VALUES.items()]
    for name, value in extra.items():
        setattr(module, name, value)
    kernel = module.layer.variables_[0]
    module.f = tf.function(lambda x: tf.matmul(x, kernel), input_signature=[tf.TensorSpec([None, 2])])
    return module


def _save(module: tf.Module, out: pathlib.Path) -> saved_model_pb2.SavedModel:
    savedmodel_save.save_atomically(module, {"serving_default": module.f.get_concrete_function()}, out, overwrite=False)
    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((out / "saved_model.pb").read_bytes())
    return saved_model


def _tf1_values(saved_model_dir: pathlib.Path) -> dict[str, np.ndarray]:
    """Every variable's value as the TF1 loader restores it, by VarHandleOp name."""
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
        tf.compat.v1.saved_model.loader.load(session, ["serve"], str(saved_model_dir))
        handles = {op.name: op.outputs[0] for op in graph.get_operations() if op.type == "VarHandleOp"}
        reads = {name: tf.raw_ops.ReadVariableOp(resource=h, dtype=h.op.get_attr("dtype")) for name, h in handles.items()}
        return session.run(reads)


def test_the_written_saver_restores_and_saves_every_value_as_tensorflows(tmp_path):
    saved_model = _save(_module(), tmp_path / "out")
    saver_def = saved_model.meta_graphs[0].saver_def
    assert saver_def.restore_op_name == "tfpolicy_saver/restore_all"  # ours, not TensorFlow's traced one
    values = _tf1_values(tmp_path / "out")
    for name, value in VALUES.items():
        np.testing.assert_array_equal(values[f"layer/{name}"], value)

    # TF1's Saver through the same saver_def: save from one session, restore in another.
    prefix = str(tmp_path / "tf1" / "ckpt")
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
        meta_graph = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(tmp_path / "out"))
        handle = graph.get_operation_by_name("layer/kernel").outputs[0]
        session.run(tf.raw_ops.AssignVariableOp(resource=handle, value=VALUES["kernel"] * 2))
        tf.compat.v1.train.Saver(saver_def=meta_graph.saver_def).save(session, prefix, write_meta_graph=False)
    written = tf.train.load_checkpoint(prefix).get_variable_to_dtype_map()
    saved = tf.train.load_checkpoint(str(tmp_path / "out" / "variables" / "variables")).get_variable_to_dtype_map()
    assert written == saved  # the same keys, the object graph's included, and dtypes
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
        meta_graph = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(tmp_path / "out"))
        tf.compat.v1.train.Saver(saver_def=meta_graph.saver_def).restore(session, prefix)
        handle = graph.get_operation_by_name("layer/kernel").outputs[0]
        np.testing.assert_array_equal(session.run(tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32)), VALUES["kernel"] * 2)

    # TF2's loader does not use the saver: the values come through the object graph.
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    np.testing.assert_array_equal(loaded.signatures["serving_default"](x=tf.ones([1, 2]))["output_0"], [[3.0, 5.0, 7.0]])


def test_the_fingerprint_is_that_of_the_finished_directory(tmp_path):
    _save(_module(), tmp_path / "out")
    shutil.copytree(tmp_path / "out", tmp_path / "again")
    tf_internals.write_fingerprint(tmp_path / "again")
    fields = ("saved_model_checksum", "graph_def_program_hash", "signature_def_hash", "saved_object_graph_hash", "checkpoint_hash")
    written, recomputed = (tf.saved_model.experimental.read_fingerprint(str(tmp_path / d)) for d in ("out", "again"))
    assert [getattr(written, f) for f in fields] == [getattr(recomputed, f) for f in fields]


def test_variables_that_names_cannot_tell_apart_get_tensorflows_saver(tmp_path):
    twins = [tf.Variable(1.0, name="twin"), tf.Variable(2.0, name="twin")]
    module = _module(twins=twins)
    options = tf.saved_model.SaveOptions(experimental_skip_saver=True)
    tf.saved_model.save(module, str(tmp_path / "bare"), options=options)
    assert not tf1_saver.add_saver(tmp_path / "bare", module)

    saved_model = _save(module, tmp_path / "out")
    assert not saved_model.meta_graphs[0].saver_def.restore_op_name.startswith("tfpolicy_saver")
    values = _tf1_values(tmp_path / "out")
    assert sorted(float(values[name]) for name in values if name.startswith("twin")) == [1.0, 2.0]
    np.testing.assert_array_equal(values["layer/codes"], VALUES["codes"])


def test_checkpointed_objects_other_than_variables_get_tensorflows_saver(tmp_path):
    table = tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, default_value=-1)
    table.insert(tf.constant(["a", "b"]), tf.constant([1, 2], tf.int64))
    saved_model = _save(_module(table=table), tmp_path / "out")
    assert not saved_model.meta_graphs[0].saver_def.restore_op_name.startswith("tfpolicy_saver")
    np.testing.assert_array_equal(_tf1_values(tmp_path / "out")["layer/kernel"], VALUES["kernel"])


def test_a_model_without_variables_keeps_tensorflows_saver(tmp_path):
    module = tf.Module()
    module.f = tf.function(lambda x: 2.0 * x, input_signature=[tf.TensorSpec([None])])
    options = tf.saved_model.SaveOptions(experimental_skip_saver=True)
    tf.saved_model.save(module, str(tmp_path / "bare"), options=options)
    assert not tf1_saver.add_saver(tmp_path / "bare", module)
    _save(module, tmp_path / "out")
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
        meta_graph = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(tmp_path / "out"))
        signature = meta_graph.signature_def["serving_default"]
        (output,) = signature.outputs.values()
        np.testing.assert_array_equal(session.run(output.name, {signature.inputs["x"].name: [1.0, 2.0]}), [2.0, 4.0])

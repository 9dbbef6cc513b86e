"""Variables read only as bfloat16 (float16) are stored so; any other use keeps them float32.

Plain ``tf.Module`` SavedModels whose signatures cast their own variables:
the float32 policy leaves every op as it is, so only the storage step acts.
Each output is run through ``tf.saved_model.load`` and the TF1 session loader
(TF Serving's path) and must give the input's outputs bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfpolicy

FLOAT32 = {"default_policy": "float32"}
W = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32) * 3
W[0, 0] = 1e6  # beyond float16: inf either way
W[0, 1] = np.float32(1 + 2**-9)  # a tie of bfloat16's rounding


class Module(tf.Module):
    def __init__(self, uses: str) -> None:
        super().__init__()
        self.w = tf.Variable(W, name="w")
        self.table = tf.Variable(W * 2, name="table")
        self.rows = tf.Variable(W * 4, name="rows")
        self.uses = uses

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None], tf.int32)])
    def serve(self, x, ids):
        # A gather moves values: a Cast after it is one before it (ResourceGather of the variable; GatherV2 of a read).
        rows = tf.cast(tf.gather(self.table, ids), tf.bfloat16) + tf.cast(tf.gather(self.rows.read_value(), ids), tf.bfloat16)
        y = tf.matmul(tf.cast(x, tf.bfloat16), tf.transpose(tf.cast(self.w, tf.bfloat16))) + rows[:, :1]
        out = {"y": tf.cast(y, tf.float32)}
        if self.uses == "float32_too":
            out["z"] = tf.reduce_sum(self.w) + x[:, 0]
        elif self.uses == "float16_too":
            out["z"] = tf.cast(tf.reduce_sum(tf.cast(self.w, tf.float16)), tf.float32) + x[:, 0]
        elif self.uses == "returned":
            value = self.w.read_value()  # one read, returned and cast
            out["w"], out["z"] = value, tf.cast(tf.cast(value, tf.bfloat16), tf.float32)
        return out


def _run(path, inputs: dict) -> dict:
    loaded = tf.saved_model.load(str(path))
    return {k: v.numpy() for k, v in loaded.signatures["serving_default"](**inputs).items()}


def _run_tf1(path, inputs: dict) -> dict:
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(path))
        signature = meta.signature_def["serving_default"]
        feed = {signature.inputs[k].name: v for k, v in inputs.items()}
        return session.run({k: t.name for k, t in signature.outputs.items()}, feed)


@pytest.mark.parametrize("uses, stored", [
    ("bfloat16_only", {"w": tf.bfloat16, "table": tf.bfloat16, "rows": tf.bfloat16}),
    ("float32_too", {"w": tf.float32, "table": tf.bfloat16, "rows": tf.bfloat16}),
    ("float16_too", {"w": tf.float32, "table": tf.bfloat16, "rows": tf.bfloat16}),
    ("returned", {"w": tf.float32, "table": tf.bfloat16, "rows": tf.bfloat16}),
])
def test_a_variable_is_stored_in_bfloat16_only_where_every_read_is_cast_to_it(tmp_path, uses, stored):
    module = Module(uses)
    tf.saved_model.save(module, str(tmp_path / "in"), signatures={"serving_default": module.serve})
    report = tfpolicy.rewrite(tmp_path / "in", tmp_path / "out", FLOAT32)
    variables = {v.name.split(":")[0]: v.dtype for v in tf.saved_model.load(str(tmp_path / "out")).tfpolicy_variables}
    assert variables == stored
    assert {row["name"] for row in report.variables_converted} == {n for n, d in stored.items() if d == tf.bfloat16}
    inputs = {"x": np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32),
              "ids": np.array([0, 7, 3], np.int32)}
    expected = _run(tmp_path / "in", inputs)
    for got in (_run(tmp_path / "out", inputs), _run_tf1(tmp_path / "out", inputs)):
        assert got.keys() == expected.keys()
        for key in expected:
            assert np.asarray(got[key]).tobytes() == expected[key].tobytes(), key
    if stored["w"] == tf.bfloat16:  # the Casts of its reads are gone
        graph_def = tf.saved_model.load(str(tmp_path / "out")).signatures["serving_default"].graph.as_graph_def()
        nodes = [n for f in graph_def.library.function for n in f.node_def] + list(graph_def.node)
        assert not [n for n in nodes if n.op == "Cast" and n.attr["SrcT"].type == tf.bfloat16.as_datatype_enum
                    and n.attr["DstT"].type == tf.bfloat16.as_datatype_enum]
        reads = [n for n in nodes if n.op == "ReadVariableOp"]
        assert reads and all(n.attr["dtype"].type == tf.bfloat16.as_datatype_enum for n in reads)

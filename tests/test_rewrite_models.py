"""Every zoo model rewritten, then checked as TF Serving and users would.

Each model is rewritten once per session under all-``mixed_bfloat16``; the
tests load the result with ``tf.saved_model.load``, with the TF1 session loader
(TF Serving's path) and with ``saved_model_cli``, and inspect its graphs.
"""

from __future__ import annotations

import hashlib
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

import tfpolicy
from model_zoo import ALL_BUILDERS, run_signature

pytestmark = pytest.mark.slow  # every zoo model through both loaders

MODELS = sorted(ALL_BUILDERS)
BF16_MAP = {"default_policy": "mixed_bfloat16"}
MATMUL_LIKE = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D"}


def _hash_tree(root: pathlib.Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class Rewritten:
    def __init__(self, zoo, tmp_root: pathlib.Path) -> None:
        self.zoo, self.root, self.done = zoo, tmp_root, {}

    def get(self, name: str):
        if name not in self.done:
            model = self.zoo.get(name)
            before = _hash_tree(model.saved_model_dir)
            out = self.root / name
            report = tfpolicy.rewrite(model.saved_model_dir, out, BF16_MAP)
            self.done[name] = (model, out, report, before, _hash_tree(model.saved_model_dir))
        return self.done[name]


@pytest.fixture(scope="session")
def rewritten(zoo, tmp_path_factory):
    return Rewritten(zoo, tmp_path_factory.mktemp("rewritten"))


def _node_defs(saved_model_dir: pathlib.Path):
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((saved_model_dir / "saved_model.pb").read_bytes())
    graph_def = proto.meta_graphs[0].graph_def
    yield "", list(graph_def.node)
    for fdef in graph_def.library.function:
        yield fdef.signature.name, list(fdef.node_def)


@pytest.mark.parametrize("name", MODELS)
def test_input_untouched_and_outputs_close(rewritten, name):
    model, out, report, before, after = rewritten.get(name)
    assert before == after, "the input SavedModel was modified"
    for key, inputs in model.sample_inputs.items():
        ref = run_signature(model.saved_model_dir, key, inputs)
        got = run_signature(out, key, inputs)
        assert ref.keys() == got.keys()
        for output in ref:
            assert got[output].dtype == ref[output].dtype
            scale = max(1.0, float(np.abs(ref[output]).max()))
            np.testing.assert_allclose(got[output], ref[output], atol=0.05 * scale)


@pytest.mark.parametrize("name", MODELS)
def test_signatures_keep_names_and_specs(rewritten, name):
    model, out, _, _, _ = rewritten.get(name)
    original, new = tf.saved_model.load(str(model.saved_model_dir)), tf.saved_model.load(str(out))
    assert sorted(original.signatures) == sorted(new.signatures)
    for key in original.signatures:
        a, b = original.signatures[key], new.signatures[key]
        assert a.structured_input_signature == b.structured_input_signature
        specs = lambda f: {k: (v.dtype, v.shape) for k, v in f.structured_outputs.items()}
        assert specs(b) == specs(a)  # dtypes and shapes, static dimensions included


@pytest.mark.parametrize("name", MODELS)
def test_tf1_session_loader_runs_signatures_by_tensor_name(rewritten, name):
    model, out, _, _, _ = rewritten.get(name)
    for key, inputs in model.sample_inputs.items():
        expected = run_signature(out, key, inputs)
        with tf.compat.v1.Session(graph=tf.Graph()) as sess:
            meta_graph = tf.compat.v1.saved_model.loader.load(sess, ["serve"], str(out))
            signature = meta_graph.signature_def[key]
            feed = {signature.inputs[k].name: v for k, v in inputs.items()}
            fetch = {k: t.name for k, t in signature.outputs.items()}
            got = sess.run(fetch, feed)
        for k in expected:
            np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_graph_structure(rewritten, name):
    _, out, report, _, _ = rewritten.get(name)
    matmuls = 0
    for function, nodes in _node_defs(out):
        by_name = {n.name: n for n in nodes}
        for node in nodes:
            if node.op in MATMUL_LIKE and "T" in node.attr:
                assert node.attr["T"].type == tf.bfloat16.as_datatype_enum, (function, node.name)
                matmuls += 1
            if node.op == "Cast":
                # A Cast of a Cast only after a rounding one (float32 -> bfloat16 -> float32,
                # as Keras rounds an embedding's output before its pooling's float32 mean).
                source = by_name.get(node.input[0].lstrip("^").split(":")[0])
                rounding = source is not None and source.op == "Cast" and (
                    source.attr["SrcT"].type, source.attr["DstT"].type) == (tf.float32.as_datatype_enum,
                                                                            tf.bfloat16.as_datatype_enum)
                assert source is None or source.op != "Cast" or rounding, f"Cast feeds Cast: {source.name} -> {node.name}"
    if name not in ("keras3_string_lookup",):
        assert matmuls > 0
    bfloat16_casts = sum(
        node.op == "Cast" and node.attr["DstT"].type == tf.bfloat16.as_datatype_enum
        for _, nodes in _node_defs(out) for node in nodes
    )
    # Casts of variable reads go where the variable is stored in bfloat16 (only those, in tfkeras_embedding).
    assert report.casts_inserted > 0 and (bfloat16_casts > 0 or report.variables_converted)


def test_saved_model_cli_shows_the_output(rewritten):
    _, out, _, _, _ = rewritten.get("tf_module")
    cli = shutil.which("saved_model_cli", path=str(pathlib.Path(sys.executable).parent))
    command = [cli] if cli else [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
    result = subprocess.run([*command, "show", "--all", "--dir", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "signature_def['decode']" in result.stdout and "signature_def['serving_default']" in result.stdout


def test_lookup_table_and_asset_survive(rewritten):
    model, out, _, _, _ = rewritten.get("keras3_string_lookup")
    assert list((out / "assets").iterdir()), "the vocabulary asset was not carried over"


def test_rewrite_is_idempotent(rewritten, tmp_path):
    _, out, _, _, _ = rewritten.get("keras3_transformer")
    again = tfpolicy.rewrite(out, tmp_path / "again", BF16_MAP)
    assert again.casts_inserted == 0
    assert sum(s.ops_retyped for s in again.signatures) == 0


def test_mixed_bfloat16_stores_variables_read_only_in_bfloat16_so(rewritten, zoo):
    """Keras keeps mixed_bfloat16's variables float32 and casts every read; a served model reads them as stored."""
    model = zoo.get("keras3_transformer")
    _, out, report, _, _ = rewritten.get("keras3_transformer")
    loaded = tf.saved_model.load(str(out))
    dtypes = {v.name.split(":")[0]: v.dtype for v in loaded.tfpolicy_variables}
    converted = {row["name"]: (row["from"], row["to"]) for row in report.variables_converted}
    assert converted and set(converted.values()) == {("float32", "bfloat16")}, converted
    assert {name for name, dtype in dtypes.items() if dtype == tf.bfloat16} == set(converted)
    assert all(dtypes[name] == tf.bfloat16 for name in dtypes if name.endswith("/kernel")), dtypes
    variables_bytes = lambda d: sum(f.stat().st_size for f in (d / "variables").iterdir())  # noqa: E731
    assert variables_bytes(out) < 0.6 * variables_bytes(model.saved_model_dir)
    # No read of a stored variable is cast any more.
    graph_def = loaded.signatures["serving_default"].graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    by_name = {n.name: n for n in nodes}
    reads = [n for n in nodes if n.op == "ReadVariableOp" and n.attr["dtype"].type == tf.bfloat16.as_datatype_enum]
    assert reads
    casts_of_reads = [n for n in nodes if n.op == "Cast" and n.input[0].split(":")[0] in by_name
                      and by_name[n.input[0].split(":")[0]].op == "ReadVariableOp"
                      and n.attr["DstT"].type == tf.bfloat16.as_datatype_enum]
    assert not casts_of_reads, [n.name for n in casts_of_reads]
    # The report counts the Casts the output has, not those a stored variable's reads no longer need.
    float_pass_casts = {n.name for n in nodes if n.op == "Cast" and re.search(r"/tfpolicy/cast_(\d+_)?to_", n.name)}
    row = next(s for s in report.signatures if s.key == "serving_default")
    assert row.casts_inserted == len(float_pass_casts) > 0, (row.casts_inserted, len(float_pass_casts))


def test_pure_bfloat16_stores_variables_in_bfloat16(zoo, tmp_path):
    model = zoo.get("keras3_transformer")
    report = tfpolicy.rewrite(model.saved_model_dir, tmp_path / "pure", {"default_policy": "bfloat16"})
    loaded = tf.saved_model.load(str(tmp_path / "pure"))
    dtypes = {v.name: v.dtype for v in loaded.tfpolicy_variables}
    assert dtypes and all(d == tf.bfloat16 for d in dtypes.values()), dtypes
    assert len(report.variables_converted) == len(dtypes)
    variables_bytes = lambda d: sum(f.stat().st_size for f in (d / "variables").iterdir())
    assert variables_bytes(tmp_path / "pure") < 0.6 * variables_bytes(model.saved_model_dir)
    inputs = model.sample_inputs["serving_default"]
    ref = run_signature(model.saved_model_dir, "serving_default", inputs)["output_0"]
    got = run_signature(tmp_path / "pure", "serving_default", inputs)["output_0"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=0.1 * max(1.0, np.abs(ref).max()))


def test_already_mixed_export_reuses_its_casts(tmp_path):
    import keras

    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        inputs = keras.Input((16,), name="x")
        hidden = keras.layers.Dense(8, activation="relu", name="a")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(4, name="b")(hidden))
    finally:
        keras.config.set_dtype_policy("float32")
    model.export(str(tmp_path / "mixed"), verbose=False)
    report = tfpolicy.rewrite(tmp_path / "mixed", tmp_path / "out", BF16_MAP)
    assert report.casts_inserted == 0


def test_signature_subset(zoo, tmp_path):
    model = zoo.get("tf_module")
    tfpolicy.rewrite(model.saved_model_dir, tmp_path / "one", BF16_MAP, signatures=["decode"])
    assert list(tf.saved_model.load(str(tmp_path / "one")).signatures) == ["decode"]

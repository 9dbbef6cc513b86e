"""--target chooses the lowering of int8 matmuls (analysis/lowering.py), and every output runs without oneDNN.

The choice is a pure function of the target and the machine, tested on
machines described by their flags; the outputs are real rewrites run here
and, with ``TF_ENABLE_ONEDNN_OPTS=0``, in a second process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfpolicy
from cli_helpers import REPO_ROOT, describe, run_cli
from tfpolicy.analysis import lowering
from tfpolicy.analysis.lowering import Machine, choose, this_machine
from tfpolicy.core import savedmodel_io
from tfpolicy.core.tf_names import type_attr
from tfpolicy.serving import device_kernels

pytestmark = pytest.mark.slow  # rewrites and serves models in each lowering, in subprocesses

VNNI = frozenset({"avx2", "avx512f", "avx512_vnni"})
AVX2 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize(("target", "machine", "form", "xla"), [
    (None, Machine(True, VNNI), "float", False),
    ("gpu", Machine(True, VNNI), "integer", True),
    ("tpu", Machine(False, frozenset()), "integer", True),
    ("cpu", Machine(True, VNNI), "onednn", False),
    ("cpu", Machine(True, frozenset({"amx_int8", "avx2"})), "onednn", False),
    ("cpu", Machine(True, frozenset({"avx_vnni", "avx2"})), "onednn", False),
    ("cpu", Machine(True, AVX2), "float", False),  # vpmaddubsw saturates: not exact
    ("cpu", Machine(True, frozenset({"avx512f", "avx512bw"})), "float", False),  # AVX-512 without VNNI too
    ("cpu", Machine(True, VNNI, int8_kernel=False), "float", False),  # a TensorFlow built without oneDNN
    ("cpu", Machine(False, frozenset({"asimd"})), "float", False),  # aarch64
    ("cpu", Machine(True, VNNI, isa_limit="AVX2"), "float", False),  # ONEDNN_MAX_CPU_ISA caps it
    ("cpu", Machine(True, VNNI, isa_limit="AVX512_CORE_VNNI"), "onednn", False),
])
def test_choose(target, machine, form, xla):
    chosen = choose(target, machine)
    assert (chosen.int8_matmul, chosen.xla_compile) == (form, xla)
    assert chosen.cpu_only == (form == "onednn")
    assert chosen.note and "\n" not in chosen.note


def test_choose_says_why_cpu_falls_back():
    assert "saturate" in choose("cpu", Machine(True, AVX2)).note
    assert "no CPU kernel of oneDNN's int8 matmul" in choose("cpu", Machine(True, VNNI, int8_kernel=False)).note
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in choose("cpu", Machine(True, VNNI, isa_limit="AVX2")).note
    assert "not an x86 CPU" in choose("cpu", Machine(False, frozenset({"asimd"}))).note


@pytest.mark.skipif(not this_machine().x86, reason="oneDNN's int8 matmul is an x86 kernel")
def test_this_tensorflow_has_onednns_int8_kernel_on_x86():
    """TensorFlow's x86 builds register oneDNN's u8 x s8 matmul, which --target cpu writes, oneDNN on or off."""
    assert this_machine().int8_kernel


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """A small Keras 3 MLP, exported, and its inputs."""
    root = tmp_path_factory.mktemp("lowering")
    keras.utils.set_random_seed(11)
    inputs = keras.Input((48,), name="features")
    x = keras.layers.Dense(64, activation="relu", name="d1")(inputs)
    outputs = keras.layers.Dense(16, name="d2")(x)
    keras.Model(inputs, outputs).export(str(root / "in"), verbose=False)
    np.save(root / "x.npy", np.random.default_rng(2).normal(size=(8, 48)).astype(np.float32))
    return root


RUN_OUTPUT = """
import sys, numpy as np, tensorflow as tf
f = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
(y,) = f(features=tf.constant(np.load(sys.argv[2]))).values()
np.save(sys.argv[3], y.numpy())
"""


def _run_elsewhere(output, x_path, out_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN_OUTPUT, str(output), str(x_path), str(out_path)],
                          env=dict(os.environ, **env), capture_output=True, text=True, timeout=300)


def test_default_output_computes_the_same_without_onednn(mlp):
    """The default lowering (float32 matmuls of int8 values) needs no oneDNN kernel and gives the same bits."""
    tfpolicy.rewrite(mlp / "in", mlp / "default", {"default_policy": "int8_from_float32"})
    with_onednn = _run_elsewhere(mlp / "default", mlp / "x.npy", mlp / "with.npy", TF_ENABLE_ONEDNN_OPTS="1")
    without = _run_elsewhere(mlp / "default", mlp / "x.npy", mlp / "without.npy", TF_ENABLE_ONEDNN_OPTS="0")
    assert with_onednn.returncode == 0 and without.returncode == 0, (with_onednn.stderr[-2000:], without.stderr[-2000:])
    np.testing.assert_array_equal(np.load(mlp / "with.npy"), np.load(mlp / "without.npy"))


def test_target_cpu_written_and_served_without_onednn_opts(mlp, tmp_path):
    """--target cpu with TF_ENABLE_ONEDNN_OPTS=0 picks as with it on, says why, and serves the same bits either way.

    oneDNN's int8 kernel does not need TensorFlow's oneDNN graph rewrites:
    on a VNNI or AMX CPU the oneDNN form is written and runs with them off; elsewhere the float form.
    """
    env_script = (f"import os, sys; os.environ['TF_ENABLE_ONEDNN_OPTS'] = '0'; sys.argv[0] = 'tfpolicy';"
                  f" sys.path.insert(0, {str(REPO_ROOT)!r}); from tfpolicy.cli import run_main; run_main()")
    (tmp_path / "map.json").write_text(json.dumps({"default_policy": "int8_from_float32"}))
    result = subprocess.run(
        [sys.executable, "-c", env_script, "--map", str(tmp_path / "map.json"), "--target", "cpu",
         "--report", str(tmp_path / "report.json"), str(mlp / "in"), str(tmp_path / "out")],
        env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, describe(result)
    expected = choose("cpu")
    assert expected.note in result.stderr, describe(result)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["lowering"]["int8_matmul"] == expected.int8_matmul
    assert report["serving_checks"]["signatures"][0]["xla_compiles"] is (expected.int8_matmul == "float")
    off = _run_elsewhere(tmp_path / "out", mlp / "x.npy", tmp_path / "off.npy", TF_ENABLE_ONEDNN_OPTS="0")
    on = _run_elsewhere(tmp_path / "out", mlp / "x.npy", tmp_path / "on.npy", TF_ENABLE_ONEDNN_OPTS="1")
    assert off.returncode == 0 and on.returncode == 0, (off.stderr[-2000:], on.stderr[-2000:])
    np.testing.assert_array_equal(np.load(tmp_path / "off.npy"), np.load(tmp_path / "on.npy"))


@pytest.mark.skipif(choose("cpu").int8_matmul != "onednn", reason="oneDNN's int8 dot is not exact on this machine")
def test_target_cpu_output_uses_onednn_says_so_and_is_allowed_not_to_compile(mlp, tmp_path):
    (tmp_path / "map.json").write_text(json.dumps({"default_policy": "int8_from_float32"}))
    result = run_cli(["--map", str(tmp_path / "map.json"), "--target", "cpu", "--report", str(tmp_path / "r.json"),
                      str(mlp / "in"), str(tmp_path / "out")], tmp_path)
    assert result.returncode == 0, describe(result)
    assert "runs only on x86 CPUs (with TF_ENABLE_ONEDNN_OPTS on or off)" in result.stderr, describe(result)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["lowering"]["int8_matmul"] == "onednn"
    assert not any(s["xla_compiles"] for s in report["serving_checks"]["signatures"])  # no XLA kernel for it
    variables = report["quantization"]["d1"]["variables"]
    assert "d1/kernel_u8_correction" in variables, variables
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    correction = {v.name.split(":")[0]: v for v in loaded.tfpolicy.variables}["d1/kernel_u8_correction"].numpy()
    kernel = {v.name.split(":")[0]: v for v in loaded.tfpolicy_variables}["d1/kernel"].numpy()
    np.testing.assert_array_equal(correction, -128 * kernel.astype(np.int32).sum(axis=0))


@pytest.mark.skipif(not this_machine().x86, reason="oneDNN's quantized matmul is an x86 kernel")
def test_target_cpu_output_refuses_to_serve_where_onednns_int8_dot_saturates(mlp, tmp_path, monkeypatch):
    """Written for a VNNI CPU, served where oneDNN adds 8-bit products into 16 bits: a clear failure, not other numbers.

    oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``, what an AVX2-only CPU
    runs) saturates; the output's guard probes the worst case and stops, with
    TensorFlow's oneDNN rewrites on or off (the kernel runs either way).
    """
    monkeypatch.setattr(lowering, "this_machine", lambda: Machine(True, VNNI))  # the machine it was written on
    tfpolicy.rewrite(mlp / "in", tmp_path / "out", {"default_policy": "int8_from_float32"}, target="cpu",
                     serving_checks=False)
    nodes = savedmodel_io.read_meta_graph(tmp_path / "out").graph_def
    ops = [n.op for f in nodes.library.function for n in f.node_def]
    assert lowering.ONEDNN_INT8_MATMUL in ops and "Assert" in ops
    for setting in ("1", "0"):
        served = _run_elsewhere(tmp_path / "out", mlp / "x.npy", tmp_path / "y.npy",
                                TF_ENABLE_ONEDNN_OPTS=setting, ONEDNN_MAX_CPU_ISA="AVX2")
        assert served.returncode != 0, describe(served)
        assert "on this CPU it saturates at 16 bits" in served.stderr, (setting, served.stderr[-3000:])
        assert not (tmp_path / "y.npy").exists()


def test_this_machine_reads_the_cpu_flags():
    machine = this_machine()
    if os.path.exists("/proc/cpuinfo") and machine.x86:
        assert "sse2" in machine.flags


def test_target_gpu_marks_quantized_signatures_for_xla_and_tf1_runs_them_compiled(mlp, tmp_path):
    """--target gpu: the FunctionDef carries _XlaMustCompile, and TF Serving's loader runs it as one XLA launch."""
    report = tfpolicy.rewrite(mlp / "in", tmp_path / "out", {"default_policy": "int8_from_float32"}, target="gpu")
    assert report.lowering.xla_compile and report.serving_checks.off_gpu == {}
    meta_graph = savedmodel_io.read_meta_graph(tmp_path / "out")
    marked = [f for f in meta_graph.graph_def.library.function if f.attr["_XlaMustCompile"].b]
    assert marked and any(n.op == "BatchMatMulV3" for f in marked for n in f.node_def)
    graph = tf.Graph()
    with tf.compat.v1.Session(graph=graph) as session:
        loaded = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(tmp_path / "out"))
        signature = loaded.signature_def["serving_default"]
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        metadata = tf.compat.v1.RunMetadata()
        session.run([o.name for o in signature.outputs.values()],
                    {signature.inputs["features"].name: np.load(mlp / "x.npy")}, options=options, run_metadata=metadata)
    ran = {n.timeline_label.split("=")[-1].split("(")[0].strip() for d in metadata.step_stats.dev_stats for n in d.node_stats}
    assert "StatefulPartitionedCall" in ran and not ran & {"BatchMatMulV3", "ReadVariableOp", "RealDiv"}, ran


def test_device_kernel_check_finds_int8_matmuls_outside_xla(tmp_path):
    """An int8 BatchMatMulV3 has no GPU kernel: outside an XLA function it is listed, inside one it is not."""
    class Module(tf.Module):
        def __init__(self):
            self.w = tf.Variable(np.ones((4, 3), np.int8))

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.int8)])
        def plain(self, x):
            return {"y": tf.raw_ops.BatchMatMulV3(x=x, y=self.w, Tout=tf.int32)}

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.int8)], jit_compile=True)
        def compiled(self, x):
            return {"y": tf.raw_ops.BatchMatMulV3(x=x, y=self.w, Tout=tf.int32)}

    module = Module()
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"plain": module.plain, "compiled": module.compiled})
    missing = device_kernels.missing_gpu_kernels(savedmodel_io.read_meta_graph(tmp_path / "m"))
    assert list(missing["plain"]) == ["BatchMatMulV3 (Ta=int8, Tb=int8, Tout=int32)"], missing
    assert not missing["compiled"]
    assert device_kernels.new_missing(missing, {}) == {"plain": ["BatchMatMulV3 (Ta=int8, Tb=int8, Tout=int32) x1"]}
    assert device_kernels.new_missing(missing, missing) == {}
    assert device_kernels.has_gpu_kernel("MatMul", {"T": type_attr(tf.float32.as_datatype_enum)})
    assert not device_kernels.has_gpu_kernel("MatMul", {"T": type_attr(tf.int32.as_datatype_enum)})

"""Serving checks run by every rewrite, and ``--target``.

TF1 session loader + run by tensor name, XLA compilation of every signature,
and the TPU target's refusals, on real zoo models.
"""

from __future__ import annotations

import json
import pathlib
import time
import shutil

import pytest
import tensorflow as tf

import tfpolicy
from tfpolicy.errors import ServingCheckError, TargetError
from tfpolicy.serving import checks as serving_checks
from cli_helpers import describe, run_cli, tree_digest

pytestmark = pytest.mark.slow  # the serving checks on zoo models

BF16 = {"default_policy": "mixed_bfloat16"}


def test_rewrite_runs_both_checks_and_reports_them(zoo, tmp_path):
    report = tfpolicy.rewrite(zoo.get("tf_module").saved_model_dir, tmp_path / "out", BF16)
    checks = report.serving_checks
    assert checks is not None and checks.target is None
    assert [(s.signature, s.tf1_ran, s.xla_compiles) for s in checks.signatures] == [
        ("decode", True, True),
        ("serving_default", True, True),
    ]
    document = json.loads(json.dumps(report.to_json()))["serving_checks"]
    assert document["tf1_loader"] is True and document["xla"] is True
    assert 0 < document["tf1_seconds"] < 60, document  # measured, and of a small model
    assert "TF1 session loader ran 2 signature(s)" in checks.summary()


def test_noserving_checks_skips_them(zoo, tmp_path):
    report = tfpolicy.rewrite(zoo.get("keras3_mlp").saved_model_dir, tmp_path / "out", BF16, serving_checks=False)
    assert report.serving_checks is None and report.to_json()["serving_checks"] is None


def test_xla_failure_names_the_op_and_is_only_listed_without_a_tpu_target(zoo, tmp_path):
    model = zoo.get("keras3_string_lookup")  # a string input: no XLA kernel for a string _Arg
    report = tfpolicy.rewrite(model.saved_model_dir, tmp_path / "out", BF16, target="gpu")
    failures = report.serving_checks.xla_failures
    assert {f.signature for f in failures} == {"serve", "serving_default"}
    assert all(f.tf1_ran and f.xla_unsupported == ("_Arg (words)",) for f in failures), failures
    assert "does not compile (_Arg (words))" in report.serving_checks.summary()
    with pytest.raises(ServingCheckError) as raised:
        tfpolicy.rewrite(model.saved_model_dir, tmp_path / "tpu", BF16, target="tpu")
    assert "--target tpu" in str(raised.value) and "_Arg (words)" in str(raised.value)
    assert "\n" not in str(raised.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing written, no temporary left


@pytest.mark.parametrize(
    "policy, dtype",
    [("mixed_float16", "float16"), ("float16", "float16"), ("float8_from_mixed_bfloat16", "float8"), ("float64", "float64")],
)
def test_tpu_target_refuses_dtypes_tpus_lack_with_one_line(zoo, tmp_path, policy, dtype):
    with pytest.raises(TargetError) as raised:
        tfpolicy.rewrite(zoo.get("keras3_mlp").saved_model_dir, tmp_path / "out", {"policy_map": {"head": policy}}, target="tpu")
    message = str(raised.value)
    assert "\n" not in message and message.startswith("--target tpu: ")
    assert f"'{policy}'" in message and "head" in message and dtype in message and "bfloat16" in message
    assert list(tmp_path.iterdir()) == []


def test_tpu_target_accepts_bfloat16_and_explain_checks_the_target_too(zoo, tmp_path):
    model = zoo.get("keras3_mlp")
    report = tfpolicy.rewrite(model.saved_model_dir, tmp_path / "out", BF16, target="tpu")
    assert report.serving_checks.target == "tpu" and not report.serving_checks.xla_failures
    with pytest.raises(TargetError, match="float16"):
        tfpolicy.explain(model.saved_model_dir, {"default_policy": "mixed_float16"}, target="tpu")
    with pytest.raises(TargetError, match="unknown target 'npu'"):
        tfpolicy.rewrite(model.saved_model_dir, tmp_path / "other", BF16, target="npu")


def test_tf1_check_fails_on_a_model_whose_variables_are_damaged(zoo, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(zoo.get("keras3_mlp").saved_model_dir, damaged)
    (damaged / "variables" / "variables.data-00000-of-00001").write_bytes(b"\0" * 8)
    with pytest.raises(ServingCheckError, match="TF1 session loader .* cannot load"):
        serving_checks.run_tf1(damaged)
    # The rewrite checks a staged copy; its errors name the output the user asked for.
    with pytest.raises(ServingCheckError, match="cannot load '/models/out'") as raised:
        serving_checks.run_tf1(damaged, shown_as=pathlib.Path("/models/out"))
    assert str(damaged) not in str(raised.value)


def test_cli_target_tpu_with_float8_fails_with_one_clear_line(zoo, tmp_path):
    (tmp_path / "map.json").write_text('{"default_policy": "mixed_bfloat16", "policy_map": {"head": "float8_from_mixed_bfloat16"}}')
    before = tree_digest(tmp_path)
    result = run_cli(["--map", "map.json", "--target", "tpu", str(zoo.get("keras3_mlp").saved_model_dir), "out"], tmp_path)
    assert result.returncode == 2, describe(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, describe(result)
    assert lines[0].startswith("tfpolicy: error: --target tpu: policy 'float8_from_mixed_bfloat16' (layers: head) uses float8")
    assert "use bfloat16" in lines[0]
    assert tree_digest(tmp_path) == before


def test_cli_unknown_target_is_a_flag_error(zoo, tmp_path):
    (tmp_path / "map.json").write_text('{"default_policy": "mixed_bfloat16"}')
    result = run_cli(["--map", "map.json", "--target", "npu", str(zoo.get("keras3_mlp").saved_model_dir), "out"], tmp_path)
    assert result.returncode == 2 and "npu" in result.stderr and not (tmp_path / "out").exists(), describe(result)


def test_timing_is_recorded_per_check(zoo, tmp_path):
    started = time.monotonic()
    checks = serving_checks.run(pathlib.Path(zoo.get("keras3_transformer").saved_model_dir))
    wall = time.monotonic() - started
    # Each check's own time, not the whole run's twice: together within the wall time.
    assert 0 < checks.tf1_seconds and 0 < checks.xla_seconds and checks.tf1_seconds + checks.xla_seconds <= wall
    assert all(s.xla_compiles for s in checks.signatures)


def _meta_graph(saved_model_dir: pathlib.Path):
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel.FromString((saved_model_dir / "saved_model.pb").read_bytes())
    return proto.meta_graphs[0]


def test_signatures_that_compute_the_same_are_checked_once(zoo, tmp_path, monkeypatch):
    out = tmp_path / "out"
    tfpolicy.rewrite(zoo.get("keras3_mlp").saved_model_dir, out, BF16, serving_checks=False)
    digests = serving_checks.computations(_meta_graph(out))
    assert digests["serve"] == digests["serving_default"]  # Keras's two wrappers of one function
    # tf.Module signatures that compute different things stay apart.
    distinct = serving_checks.computations(_meta_graph(pathlib.Path(zoo.get("tf_module").saved_model_dir)))
    assert distinct["decode"] != distinct["serving_default"]

    compiled = []
    original = serving_checks.prepare_xla
    monkeypatch.setattr(serving_checks, "prepare_xla", lambda *a, **k: compiled.append(a[0]) or original(*a, **k))
    checks = serving_checks.run(out)
    assert [(s.signature, s.tf1_ran, s.xla_compiles) for s in checks.signatures] == [
        ("serve", True, True), ("serving_default", True, True)]
    assert compiled == ["serve"]


def test_xla_check_lowers_functions_whose_variables_have_no_value_yet(zoo, monkeypatch):
    """What the rewrite does while it saves: the output's variables have no value, and none is made."""
    from tfpolicy.core import savedmodel_io  # noqa: PLC0415

    model = savedmodel_io.load(pathlib.Path(zoo.get("keras3_transformer").saved_model_dir), streamed=True)
    variables = [v for v in model.variables if not v.is_initialized()]
    assert variables, "a streamed load restores no value"
    function = model.root.signatures["serving_default"]
    prepared = []
    original = serving_checks.prepare_xla
    monkeypatch.setattr(serving_checks, "prepare_xla", lambda *a, **k: prepared.append(a[0]) or original(*a, **k))
    with serving_checks.XlaCheck({"serving_default": function, "alias": function}, serving_checks.CheckInputs({}, {}, 0)) as xla:
        outcomes = xla.outcomes()
    assert outcomes == {"alias": (True, (), ""), "serving_default": (True, (), "")}
    assert prepared == ["alias"]  # one function object, lowered once
    assert 0 < xla.seconds < 60, xla.seconds  # measured, once
    assert not any(v.is_initialized() for v in variables)


def test_an_unexpected_error_on_the_xla_thread_is_raised_on_the_callers(zoo, monkeypatch):
    from tfpolicy.core import tf_internals  # noqa: PLC0415

    def broken(*args, **kwargs):
        raise RuntimeError("lowering broke")

    monkeypatch.setattr(tf_internals, "lower_to_hlo", broken)
    loaded = tf.saved_model.load(zoo.get("keras3_mlp").saved_model_dir)
    with serving_checks.XlaCheck(dict(loaded.signatures), serving_checks.CheckInputs({}, {}, 0)) as xla:
        with pytest.raises(RuntimeError, match="lowering broke"):
            xla.outcomes()


def test_the_rewrite_lowers_to_xla_while_the_tf1_session_runs(zoo, tmp_path, monkeypatch):
    """The lowering holds the GIL: it starts once the TF1 loader's Python part is done, as the first signature runs."""
    events = []
    original_load, original_start = tf.compat.v1.saved_model.loader.load, serving_checks.XlaCheck.start
    monkeypatch.setattr(tf.compat.v1.saved_model.loader, "load", lambda *a, **k: events.append("tf1 loaded") or original_load(*a, **k))
    monkeypatch.setattr(serving_checks.XlaCheck, "start", lambda self: events.append("xla start") or original_start(self))
    report = tfpolicy.rewrite(zoo.get("keras3_mlp").saved_model_dir, tmp_path / "out", {"default_policy": "mixed_bfloat16"})
    assert events[:2] == ["tf1 loaded", "xla start"]  # outcomes() calls start() again, which does nothing
    assert all(check.xla_compiles and check.tf1_ran for check in report.serving_checks.signatures)

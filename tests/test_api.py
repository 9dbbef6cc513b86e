"""The Python API: accepted map types, typed errors, nothing written on error."""

from __future__ import annotations

import numpy as np
import pytest

import keras
import tfpolicy
from model_zoo import run_signature


def test_accepts_a_keras_dtype_policy_map_without_mutating_it(zoo, tmp_path):
    model = zoo.get("keras3_mlp")
    keras_map = keras.dtype_policies.DTypePolicyMap(default_policy="mixed_bfloat16")
    keras_map["head"] = "float32"
    report = tfpolicy.rewrite(model.saved_model_dir, tmp_path / "out", keras_map)
    rows = {row.path: row for row in report.plan.rows()}
    assert rows["head"].compute_dtype == "float32" and rows["dense"].compute_dtype == "bfloat16"
    assert keras_map["head"].name == "float32"
    inputs = model.sample_inputs["serving_default"]
    assert run_signature(tmp_path / "out", "serving_default", inputs)["output_0"].dtype == np.float32


@pytest.mark.parametrize(
    "policy_map, error",
    [
        ({"default_policy": "float32", "policy_map": {"dense.*": "bfloat16", "d.*": "float16"}}, tfpolicy.AmbiguousPathError),
        ({"default_policy": "float32", "policy_map": {"head": "gptq/4/128_from_float32"}}, tfpolicy.UnsupportedPolicyError),
        ({"default_policy": "float32", "policy_map": {"dense_(": "bfloat16"}}, tfpolicy.PolicyMapError),
    ],
    ids=["ambiguous", "quantized", "bad_regex"],
)
def test_user_errors_are_typed_and_write_nothing(zoo, tmp_path, policy_map, error):
    with pytest.raises(error) as raised:
        tfpolicy.rewrite(zoo.get("keras3_mlp").saved_model_dir, tmp_path / "out", policy_map)
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_explain_shows_quantized_layers_without_writing(zoo, tmp_path):
    report = tfpolicy.explain(zoo.get("keras3_mlp").saved_model_dir, {"policy_map": {"head": "int8_from_mixed_bfloat16"}})
    row = {r.path: r for r in report.plan.rows()}["head"]
    assert row.quantization_mode == "int8"
    assert report.change(row).startswith("int8: 1 op quantized (kernel_scale ")  # serve is serving_default, rewritten once
    assert report.quantization["head"].variables == ["head/kernel", "head/kernel_scale"]
    assert report.output_dir is None


def test_the_report_counts_what_each_key_changed(zoo):
    report = tfpolicy.explain(zoo.get("keras3_mlp").saved_model_dir,
                              {"default_policy": "mixed_bfloat16", "policy_map": {"head": "int8_from_mixed_bfloat16"}})
    coverage = {entry["key"]: entry for entry in report.to_json()["coverage"]}
    assert coverage["head"]["layers"] == 1 and coverage["head"]["ops_quantized"] == 1
    assert coverage[None]["layers"] >= 1 and coverage[None]["ops_retyped"] > 0
    assert not [w for w in report.warnings if "changes nothing" in w or "changed none" in w]


def test_a_map_that_changes_nothing_says_so_and_strict_refuses_it(zoo, tmp_path):
    model = zoo.get("keras3_mlp")
    unchanged = {"default_policy": "float32", "policy_map": {"head": "float32"}}
    report = tfpolicy.explain(model.saved_model_dir, unchanged)
    assert [w for w in report.warnings if w.startswith("the map changes nothing in this model")]
    with pytest.raises(tfpolicy.StrictModeError, match="changes nothing"):
        tfpolicy.rewrite(model.saved_model_dir, tmp_path / "out", unchanged, strict=True)
    assert not (tmp_path / "out").exists()

"""Layers inside a decoding loop: a ``tf.Module`` whose serving function runs a
``tf.while_loop`` with a ``tf.cond`` in its body, as sequence models are served.

The oracle is the same module unrolled: the same ops outside any loop, which
the rewrite handles everywhere else; a layer inside the While/If bodies must
come out the same, bit for bit.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import tensorflow as tf

import tfpolicy
from cli_helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
import realmodels  # noqa: E402

STEPS, WIDTH = realmodels.LOOP_STEPS, realmodels.LOOP_WIDTH


@pytest.fixture(scope="session")
def decoder(tmp_path_factory):
    module = realmodels.decoding_loop_module()
    directory = tmp_path_factory.mktemp("control_flow") / "decoder"
    tf.saved_model.save(module, str(directory), signatures={"serving_default": module.decode, "unrolled": module.unrolled})
    return directory


def _run(directory, state):
    loaded = tf.saved_model.load(str(directory))
    looped = loaded.signatures["serving_default"](state=tf.constant(state), steps=tf.constant(STEPS))
    unrolled = loaded.signatures["unrolled"](state=tf.constant(state))
    return {k: v.numpy() for k, v in looped.items()}, {k: v.numpy() for k, v in unrolled.items()}


STATE = np.random.default_rng(1).standard_normal((3, WIDTH)).astype("float32")


def test_explain_lists_only_layer_paths(decoder):
    report = tfpolicy.explain(decoder, {"default_policy": "mixed_bfloat16"})
    assert {row.path for row in report.plan.rows()} == {"embed", "cell", "head", None}


@pytest.mark.parametrize("target", [None, "cpu", "gpu"])
def test_an_int8_layer_inside_the_loop_is_quantized_as_outside_it(decoder, tmp_path, target):
    looped, unrolled = _run(decoder, STATE)
    np.testing.assert_array_equal(looped["state"], unrolled["state"])  # the oracle holds in float32
    plain = {"default_policy": "mixed_bfloat16", "policy_map": {
        "embed": "int8_from_mixed_bfloat16", "cell": "int8_from_mixed_bfloat16", "head": "int8_from_mixed_bfloat16"}}
    report = tfpolicy.rewrite(decoder, tmp_path / "out", plain, target=target)
    # Both signatures: each layer once in the While body, STEPS times unrolled; the embedding's row scales
    # are passed into the body as a variable.
    assert {path: q.ops_quantized for path, q in report.quantization.items()} == {
        "embed": 1 + STEPS, "cell": 1 + STEPS, "head": 1 + STEPS}
    assert not [w for w in report.warnings if "declined" in w]
    checks = report.serving_checks
    assert all(s.tf1_ran for s in checks.signatures)
    assert all(s.xla_compiles for s in checks.signatures) or target == "cpu"
    got_looped, got_unrolled = _run(tmp_path / "out", STATE)
    for key in ("logits", "state"):
        if target != "gpu":  # XLA fuses the unrolled and looped graphs differently
            np.testing.assert_array_equal(got_looped[key], got_unrolled[key])
        error = np.abs(got_looped[key] - looped[key]).max() / np.abs(looped[key]).max()
        assert 1e-4 < error < 0.05, (key, error)  # quantized, and still the model


def _scales(directory):
    loaded = tf.saved_model.load(str(directory))
    return {v.name: v.numpy() for v in loaded.tfpolicy.variables if "inputs_scale" in v.name}


@pytest.mark.parametrize("target", [None, "gpu"])
def test_a_float8_layer_inside_the_loop_is_quantized_and_calibrated_as_outside_it(decoder, tmp_path, target):
    """The scales reach the While body as new loop variables; calibration sees the body's inputs.

    A layer called in a loop takes one history entry per batch, the maximum
    over its calls, as the unrolled module's layer called at several places
    does: calibrating either signature gives the same scales, and the looped
    output is the unrolled one bit for bit.
    """
    rng = np.random.default_rng(2)
    states = [rng.standard_normal((4, WIDTH)).astype("float32") for _ in range(2)]
    float8 = {"default_policy": "mixed_bfloat16",
              "policy_map": {"cell": "float8_from_mixed_bfloat16", "head": "float8_from_mixed_bfloat16"}}
    report = tfpolicy.rewrite(decoder, tmp_path / "looped", float8, target=target, signatures=["serving_default"],
                              calibration_data=[{"state": s, "steps": np.int32(STEPS)} for s in states])
    assert {path: q.ops_quantized for path, q in report.quantization.items()} == {"cell": 1, "head": 1}
    assert not report.warnings, report.warnings  # no declined layer, no unused calibration data
    assert all(s.tf1_ran and s.xla_compiles for s in report.serving_checks.signatures)
    tfpolicy.rewrite(decoder, tmp_path / "unrolled", float8, target=target, signatures=["unrolled"],
                     calibration_data=[{"state": s} for s in states])
    looped_scales, unrolled_scales = _scales(tmp_path / "looped"), _scales(tmp_path / "unrolled")
    assert looped_scales == unrolled_scales and all(v != 1.0 for v in looped_scales.values()), looped_scales

    both = tfpolicy.rewrite(decoder, tmp_path / "both", float8, target=target,
                            calibration_data=[{"state": s, "steps": np.int32(STEPS)} for s in states])
    assert _scales(tmp_path / "both") == looped_scales
    assert both.quantization["head"].ops_quantized == 1 + STEPS
    got_looped, got_unrolled = _run(tmp_path / "both", STATE)
    reference, _ = _run(decoder, STATE)
    for key in ("logits", "state"):
        if target != "gpu":  # XLA fuses the unrolled and looped graphs differently
            np.testing.assert_array_equal(got_looped[key], got_unrolled[key])
        assert np.isfinite(got_looped[key]).all()
        # Quantized; no closer bound: float8's 3 mantissa bits flip argmax tokens, and the loop feeds them back.
        assert np.abs(got_looped[key] - reference[key]).max() > 1e-4 * np.abs(reference[key]).max(), key


@pytest.mark.parametrize("target", [None, "gpu"])
def test_int4_layers_inside_the_loop_are_quantized_as_outside_it(decoder, tmp_path, target):
    """The packed kernel takes the original's place, so the loop passes it as it passed the float one; its
    scales (and a blocked kernel's zero points) are passed in as variables: grappler would turn a division
    by a constant into a product with its reciprocal, which rounds differently."""
    int4 = {"default_policy": "mixed_bfloat16",
            "policy_map": {"cell": "int4/8_from_mixed_bfloat16", "head": "int4_from_mixed_bfloat16"}}
    report = tfpolicy.rewrite(decoder, tmp_path / "out", int4, target=target)
    assert {path: q.ops_quantized for path, q in report.quantization.items()} == {"cell": 1 + STEPS, "head": 1 + STEPS}
    assert not [w for w in report.warnings if "declined" in w]
    assert all(s.tf1_ran and s.xla_compiles for s in report.serving_checks.signatures)
    got_looped, got_unrolled = _run(tmp_path / "out", STATE)
    reference, _ = _run(decoder, STATE)
    for key in ("logits", "state"):
        if target != "gpu":  # XLA fuses the unrolled and looped graphs differently
            np.testing.assert_array_equal(got_looped[key], got_unrolled[key])
        assert np.abs(got_looped[key] - reference[key]).max() > 1e-4 * np.abs(reference[key]).max(), key


def test_call_chains_say_which_functions_a_new_input_can_reach(decoder):
    from tfpolicy.analysis.calls import WHILE_OPS, call_chains
    from tfpolicy.core import savedmodel_io

    program = savedmodel_io.load(decoder, ["serving_default"]).signatures["serving_default"]
    chains = call_chains(program.graph, program.functions.values())
    (loop,) = [n for n in program.graph.nodes.values() if n.op in WHILE_OPS]
    body, cond = loop.attrs["body"].func.name, loop.attrs["cond"].func.name
    branches = [f for f in program.functions if f not in (body, cond)]
    assert len(branches) == 2 and all(chains.problem(f) is None for f in (body, cond, *branches))
    assert chains.caller(body).node == loop.name and chains.conditions == {cond}
    program.graph.add_node(loop.op, "second_loop", list(loop.inputs), dict(loop.attrs))  # the body, called twice
    chains = call_chains(program.graph, program.functions.values())
    assert chains.problem(body) == f"function '{body}' has 2 callers"
    assert chains.problem(branches[0]) == f"function '{body}' has 2 callers"  # the If inside it cannot be reached

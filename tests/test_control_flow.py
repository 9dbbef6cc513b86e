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
    plain = {"default_policy": "mixed_bfloat16",
             "policy_map": {"cell": "int8_from_mixed_bfloat16", "head": "int8_from_mixed_bfloat16"}}
    report = tfpolicy.rewrite(decoder, tmp_path / "out", plain, target=target)
    # Both signatures: cell and head once each in the While body, STEPS times each unrolled.
    assert {path: q.ops_quantized for path, q in report.quantization.items()} == {"cell": 1 + STEPS, "head": 1 + STEPS}
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


def test_float8_inside_the_loop_is_declined_with_a_reason_and_calibration_takes_a_scalar_input(decoder, tmp_path):
    """Calibration batches carry the scalar step count as it is; the float8 layer in the body says why it is not."""
    rng = np.random.default_rng(2)
    batches = [{"state": rng.standard_normal((4, WIDTH)).astype("float32"), "steps": np.int32(STEPS)} for _ in range(2)]
    plain = {"default_policy": "mixed_bfloat16", "policy_map": {"head": {"name": "float8_from_mixed_bfloat16"}}}
    report = tfpolicy.rewrite(decoder, tmp_path / "out", plain, signatures=["serving_default"],
                              calibration_data=batches)
    declined = report.quantization["head"].declined
    assert list(declined) == ["inside a While/If body, whose signature cannot take new variables"]
    assert all(s.tf1_ran for s in report.serving_checks.signatures)

"""Layers inside a decoding loop: a ``tf.Module`` whose serving function runs a
``tf.while_loop`` with a ``tf.cond`` in its body, as sequence models are served.

The oracle is the same module unrolled: the same ops outside any loop, which
the rewrite handles everywhere else; a layer inside the While/If bodies must
come out the same, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfpolicy

STEPS = 4
WIDTH = 16
VOCABULARY = 50


class Decoder(tf.Module):
    """Greedy decoding: embed the last token, a tanh cell, a head; every other step halves the state."""

    def __init__(self) -> None:
        super().__init__(name="decoder")
        rng = np.random.default_rng(0)
        with tf.name_scope("embed"):
            self.embed = tf.Variable(rng.standard_normal((VOCABULARY, WIDTH)).astype("float32") * 0.3, name="embeddings")
        with tf.name_scope("cell"):
            self.cell = tf.Variable(rng.standard_normal((2 * WIDTH, WIDTH)).astype("float32") * 0.3, name="kernel")
        with tf.name_scope("head"):
            self.head = tf.Variable(rng.standard_normal((WIDTH, VOCABULARY)).astype("float32") * 0.3, name="kernel")

    def _step(self, i, state, token, halve):
        with tf.name_scope("embed"):
            e = tf.gather(self.embed, token)
        with tf.name_scope("cell"):
            h = tf.tanh(tf.matmul(tf.concat([state, e], -1), self.cell))
        h = halve(h)
        with tf.name_scope("head"):
            out = tf.matmul(h, self.head)
        return h, tf.argmax(out, -1, output_type=tf.int32), out

    @tf.function(input_signature=[tf.TensorSpec([None, WIDTH], tf.float32), tf.TensorSpec([], tf.int32)])
    def decode(self, state, steps):
        logits = tf.TensorArray(tf.float32, size=steps)
        token = tf.zeros([tf.shape(state)[0]], tf.int32)

        def body(i, state, token, logits):
            halve = lambda h: tf.cond(i % 2 == 0, lambda: h, lambda: h * 0.5)  # noqa: E731
            state, token, out = self._step(i, state, token, halve)
            return i + 1, state, token, logits.write(i, out)

        _, state, _, logits = tf.while_loop(lambda i, *_: i < steps, body, [0, state, token, logits])
        return {"logits": tf.transpose(logits.stack(), [1, 0, 2]), "state": state}

    @tf.function(input_signature=[tf.TensorSpec([None, WIDTH], tf.float32)])
    def unrolled(self, state):
        token = tf.zeros([tf.shape(state)[0]], tf.int32)
        logits = []
        for i in range(STEPS):
            state, token, out = self._step(i, state, token, lambda h, i=i: h if i % 2 == 0 else h * 0.5)
            logits.append(out)
        return {"logits": tf.stack(logits, 1), "state": state}


@pytest.fixture(scope="session")
def decoder(tmp_path_factory):
    module = Decoder()
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

"""``tfpolicy suggest``: the search on its own, then the whole command on a real Keras 3 encoder.

The search's tests need no TensorFlow: tables in, assignment and keys out.
The model's tests export a small transformer encoder (two blocks), suggest a
map under an error budget, and check it the way a user would: the map's own
rewrite is within the budget on held-out rows, it costs no more than the best
single policy that meets the budget, its Keras form loads in Keras, and Keras
applying it to the same model lands within 1.1x of the rewrite's error.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

import numpy as np
import pytest

from tfpolicy.analysis.policy_map import PolicyMap
from tfpolicy.suggestion import search
from cli_helpers import run_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUGGEST = "tfpolicy.suggest"
sys.path.insert(0, str(ROOT / "tools"))  # bench.py's encoder, realmodels.py's Keras application
PATHS = [f"block_{i}/{part}" for i in range(3) for part in ("attn", "ffn_in", "ffn_out", "norm")] + ["head"]


# -- the search -----------------------------------------------------------------------------------


def test_block_pattern_generalises_every_number_and_matches_only_its_own_paths():
    pattern = search.block_pattern("encoder_12/ffn.1/dense_3")
    assert pattern == r"encoder_\d+/ffn\.\d+/dense_\d+"
    assert re.fullmatch(pattern, "encoder_0/ffn.7/dense_30")
    assert not re.fullmatch(pattern, "encoder_0/ffnx7/dense_30")
    assert not re.fullmatch(pattern, "encoder_0/ffn.7/dense_3/extra")


def test_keys_group_blocks_that_agree_and_resolve_to_the_assignment_in_keras_lookup():
    assignment = {p: "mixed_bfloat16" for p in PATHS}
    for i in range(3):
        assignment[f"block_{i}/ffn_in"] = "int8_from_mixed_bfloat16"  # every block agrees: one regex key
    assignment["block_1/ffn_out"] = "float32"  # one block differs: an exact key
    assignment["head"] = "float32"
    keys = search.policy_map(assignment, PATHS, "mixed_bfloat16")
    assert keys == {r"block_\d+/ffn_in": "int8_from_mixed_bfloat16", "block_1/ffn_out": "float32", "head": "float32"}
    resolved = PolicyMap.load({"default_policy": "mixed_bfloat16", "policy_map": keys})
    for path in PATHS:
        assert resolved.lookup(path).policy.name == assignment[path], path


def test_a_pattern_that_only_some_of_its_layers_take_is_written_as_exact_keys():
    assignment = {p: "mixed_bfloat16" for p in PATHS}
    assignment["block_0/ffn_in"] = assignment["block_2/ffn_in"] = "float32"
    keys = search.policy_map(assignment, PATHS, "mixed_bfloat16")
    assert keys == {"block_0/ffn_in": "float32", "block_2/ffn_in": "float32"}


def tables(shares: dict[str, dict[str, float]], costs: dict[str, dict[str, float]]) -> search.Tables:
    return search.Tables(("float32", "mixed_bfloat16", "int8"), shares, costs, {})


def test_the_search_keeps_the_most_sensitive_layer_precise_and_the_rest_cheap():
    layers = ["a", "b", "c"]
    costs = {l: {"float32": 4.0, "mixed_bfloat16": 2.0, "int8": 1.0} for l in layers}
    shares = {l: {"float32": 0.0, "mixed_bfloat16": 0.001, "int8": 0.004} for l in layers}
    shares["b"] = {"float32": 0.0, "mixed_bfloat16": 0.002, "int8": 0.05}
    found = search.cheapest_within(tables(shares, costs), budget=0.012)
    assert found == {"a": "int8", "b": "mixed_bfloat16", "c": "int8"}
    assert tables(shares, costs).predicted_error(found, "int8") <= 0.012
    # Nothing fits a budget of zero but float32.
    assert set(search.cheapest_within(tables(shares, costs), budget=0.0).values()) == {"float32"}


def test_back_off_moves_the_layer_with_the_largest_share_one_step():
    layers = ["a", "b"]
    costs = {l: {"float32": 4.0, "mixed_bfloat16": 2.0, "int8": 1.0} for l in layers}
    shares = {"a": {"float32": 0.0, "mixed_bfloat16": 0.001, "int8": 0.01},
              "b": {"float32": 0.0, "mixed_bfloat16": 0.001, "int8": 0.02}}
    moved = search.back_off(tables(shares, costs), {"a": "int8", "b": "int8"})
    assert moved == {"a": "int8", "b": "mixed_bfloat16"}
    assert search.back_off(tables(shares, costs), {"a": "float32", "b": "float32"}) is None


# -- the command on a real model ------------------------------------------------------------------

SEQ, WIDTH = 16, 64


def build_encoder():
    import bench  # noqa: PLC0415

    return bench.build_encoder(depth=2, width=WIDTH, heads=4, seq=SEQ, ffn=4 * WIDTH)


@pytest.fixture(scope="session")
def encoder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("suggest")
    build_encoder().export(str(directory / "model"), verbose=False)
    data = {"tokens": np.random.default_rng(0).standard_normal((40, SEQ, WIDTH)).astype(np.float32)}
    np.savez(directory / "data.npz", **data)
    return directory / "model", directory / "data.npz", data


def held_out_error(model_dir, other_dir, data) -> float:
    import tensorflow as tf  # noqa: PLC0415

    rows = data["tokens"][30:]  # the last quarter of 40 rows, as suggest holds out
    ref = tf.saved_model.load(str(model_dir)).signatures["serving_default"](tokens=tf.constant(rows))
    got = tf.saved_model.load(str(other_dir)).signatures["serving_default"](tokens=tf.constant(rows))
    (ref,), (got,) = ref.values(), got.values()
    return float(np.max(np.abs(got.numpy() - ref.numpy())) / np.max(np.abs(ref.numpy())))


def keras_applied(build, policy_map):
    """The model ``build`` makes, with ``policy_map`` applied by Keras to its float weights
    (``tools/realmodels.py``'s ``keras_applied``)."""
    import realmodels  # noqa: PLC0415

    return realmodels.keras_applied(realmodels.rebuilder(build), policy_map)


@pytest.fixture(scope="session")
def suggested(encoder, tmp_path_factory):
    import tfpolicy  # noqa: PLC0415

    model_dir, data_path, data = encoder
    out = tmp_path_factory.mktemp("uniform")
    errors = {}
    for policy in ("bfloat16", "int8_from_bfloat16"):
        tfpolicy.rewrite(model_dir, out / policy, {"default_policy": policy}, serving_checks=False)
        errors[policy] = held_out_error(model_dir, out / policy, data)
    # Halfway between the two uniform maps' errors: bfloat16 everywhere fits, int8 everywhere does
    # not, and a map with int8 on some layers can (on any machine: the errors depend on its kernels).
    assert errors["int8_from_bfloat16"] > errors["bfloat16"] > 0, errors
    budget = (errors["bfloat16"] + errors["int8_from_bfloat16"]) / 2
    return tfpolicy.suggest(model_dir, data_path, budget, objective="bytes"), budget


@pytest.mark.slow
def test_the_suggested_map_is_within_budget_on_held_out_rows_and_smaller_than_any_single_policy(
        encoder, suggested, tmp_path):
    import tfpolicy  # noqa: PLC0415

    result, budget = suggested
    model_dir, _, data = encoder
    assert result.rows == {"search": 30, "held_out": 10}
    tfpolicy.rewrite(model_dir, tmp_path / "m", result.policy_map, serving_checks=False)
    assert held_out_error(model_dir, tmp_path / "m", data) == pytest.approx(result.chosen.error) and \
        result.chosen.error <= budget
    uniform = [t for t in result.tried if t.label.endswith("(every layer)")]
    assert len(uniform) == len(result.candidates)
    best_single = min(t.bytes for t in uniform if t.within_budget)
    assert result.chosen.bytes < best_single, result.format_table()  # a mix beats every single policy here
    assert result.policy_map.get("policy_map"), "a mixed map, with keys"


@pytest.mark.slow
def test_keras_applying_the_serialized_map_lands_within_1_1x_of_the_rewrite(encoder, suggested):
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    result, _ = suggested
    _, _, data = encoder
    policy_map = keras.saving.deserialize_keras_object(json.loads(json.dumps(result.keras_config())))
    assert isinstance(policy_map, keras.dtype_policies.DTypePolicyMap)
    reference, native = build_encoder(), keras_applied(build_encoder, policy_map)  # seeded: the same weights
    rows = tf.constant(data["tokens"][30:])
    y0 = tf.function(lambda x: reference(x, training=False))(rows).numpy()
    y = tf.function(lambda x: native(x, training=False))(rows).numpy().astype(np.float32)
    keras_error = float(np.max(np.abs(y - y0)) / np.max(np.abs(y0)))
    assert 0 < result.chosen.error <= 1.1 * keras_error and keras_error <= 1.1 * result.chosen.error


@pytest.mark.slow
def test_the_command_writes_both_forms_and_the_frontier(encoder, tmp_path):
    model_dir, data_path, _ = encoder
    out = tmp_path / "map.json"
    result = run_cli([str(model_dir), "--data", str(data_path), "--max_error", "0.05",
                      "--objective", "bytes", "--candidates", "float32,bfloat16,int8_from_bfloat16",
                      "--out", str(out), "--html", str(tmp_path / "f.html"), "--report", str(tmp_path / "r.json")], tmp_path, SUGGEST)
    assert result.returncode == 0, result.stderr
    plain = json.loads(out.read_text())
    PolicyMap.load(plain)  # the rewrite reads it
    keras_form = json.loads((tmp_path / "map.keras.json").read_text())
    assert keras_form["class_name"] == "DTypePolicyMap"
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["policy_map"] == plain and len(report["frontier"]) >= 3
    page = (tmp_path / "f.html").read_text()
    assert "<svg" in page and "budget 0.05" in page and "<script" not in page
    assert "int8_from_bfloat16 (every layer)" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--max_error", "-1"], "--max_error must be a non-negative number"),
    (["--max_error", "0.1", "--candidates", "float32,no_such_policy"], "--candidates: 'no_such_policy'"),
    (["--max_error", "0.1", "--output", "nope"], "--output 'nope' is not an output"),
])
@pytest.mark.slow
def test_bad_input_is_one_line_exit_2_and_nothing_written(encoder, tmp_path, args, message):
    model_dir, data_path, _ = encoder
    out = tmp_path / "map.json"
    result = run_cli([str(model_dir), "--data", str(data_path), "--out", str(out), *args], tmp_path, SUGGEST)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("tfpolicy: error:"), result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_missing_data_is_answered_before_tensorflow_starts(tmp_path):
    result = run_cli([str(ROOT / "examples/mlp/saved_model"), "--data",
                      str(tmp_path / "none.npz"), "--max_error", "0.1", "--out", str(tmp_path / "m.json")], tmp_path, SUGGEST)
    assert result.returncode == 2 and "cannot read --data" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_an_interrupt_mid_search_is_one_line_and_leaves_nothing(encoder, tmp_path):
    """The search's scratch rewrites are no output: SIGTERM says nothing was written, and nothing is."""
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    model_dir, data_path, _ = encoder
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    process = subprocess.Popen([sys.executable, "-m", SUGGEST, str(model_dir), "--data", str(data_path),
                                "--max_error", "0.05", "--out", str(tmp_path / "map.json")],
                               env=env, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:  # the first scratch rewrite is in place once the second candidate starts
        if "candidate 3/" in line:
            break
    process.send_signal(signal.SIGTERM)
    rest = process.stderr.read()
    assert process.wait(timeout=120) == 128 + signal.SIGTERM, rest
    assert rest.strip().splitlines()[-1] == "tfpolicy: interrupted by SIGTERM; nothing was written", rest
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("__autograph")] == []


def build_cnn():
    import keras  # noqa: PLC0415

    keras.utils.set_random_seed(7)
    inputs = keras.Input((8, 8, 3), name="images")
    x = keras.layers.Conv2D(8, 3, activation="relu", name="conv")(inputs)
    x = keras.layers.Flatten(name="flatten")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(x))


@pytest.mark.slow
def test_a_layer_the_rewrite_leaves_unquantized_is_written_in_the_policy_it_runs_in(tmp_path):
    """int8 on every layer quantizes the Dense head but not the convolution (no --int8_convolutions):
    the map says the convolution is float32, so it means what was measured under either flag."""
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    import tfpolicy  # noqa: PLC0415

    build_cnn().export(str(tmp_path / "cnn"), verbose=False)
    images = np.random.default_rng(1).standard_normal((16, 8, 8, 3)).astype(np.float32)
    result = tfpolicy.suggest(tmp_path / "cnn", {"images": images}, 1.0, objective="bytes",
                              candidates=["float32", "int8_from_float32"])
    assert result.policy_map == {"default_policy": "int8_from_float32", "policy_map": {"conv": "float32"}}
    held_out = tf.constant(images[12:])
    (y0,) = tf.saved_model.load(str(tmp_path / "cnn")).signatures["serving_default"](images=held_out).values()
    y0 = y0.numpy()
    for int8_convolutions in (False, True):
        out = tmp_path / f"int8conv_{int8_convolutions}"
        tfpolicy.rewrite(tmp_path / "cnn", out, result.policy_map, serving_checks=False,
                         int8_convolutions=int8_convolutions)
        (y,) = tf.saved_model.load(str(out)).signatures["serving_default"](images=held_out).values()
        assert float(np.max(np.abs(y.numpy() - y0)) / np.max(np.abs(y0))) == pytest.approx(result.chosen.error)
    policy_map = keras.saving.deserialize_keras_object(result.keras_config())
    native = keras_applied(build_cnn, policy_map)
    y = tf.function(lambda x: native(x, training=False))(held_out).numpy()
    assert float(np.max(np.abs(y - y0)) / np.max(np.abs(y0))) == pytest.approx(result.chosen.error, rel=0.1)

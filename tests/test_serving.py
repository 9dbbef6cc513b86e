"""The TF Serving export step: versions, atomic publishing, warmup records.

The test plays TF Serving's part with TensorFlow's own pieces, independently of
tfpolicy's serving checks: it loads ``<base>/<version>`` with the TF1 session
loader (tag ``serve``) in a fresh Graph, runs ``serving_default`` by the tensor
names of its SignatureDef, and reads ``assets.extra/tf_serving_warmup_requests``
back as TFRecords of ``PredictionLog`` whose requests it runs against the model.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import prediction_log_pb2

from tfpolicy.errors import InputDataError, OutputError
from tfpolicy import serving_export as serving
from cli_helpers import REPO_ROOT, describe, leftovers, run_cli, tree_digest

pytestmark = pytest.mark.slow  # exports and serves versions through the TF1 loader

MAP = {"default_policy": "mixed_bfloat16", "policy_map": {"head": "float32"}}
WARMUP_ROWS = 3


def versions(base: pathlib.Path) -> list[str]:
    return sorted((p.name for p in base.iterdir() if p.name.isdigit()), key=int) if base.exists() else []


def tf1_serve(model_dir: pathlib.Path, feeds_by_key: list[dict[str, np.ndarray]], signature: str = "serving_default"):
    """What TF Serving does: TF1 loader, then Session.run on the SignatureDef's tensor names."""
    results = []
    with tf.compat.v1.Session(graph=tf.Graph()) as session:
        meta_graph = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(model_dir))
        signature_def = meta_graph.signature_def[signature]
        fetches = {key: info.name for key, info in signature_def.outputs.items()}
        for feeds in feeds_by_key:
            assert set(feeds) == set(signature_def.inputs), (set(feeds), set(signature_def.inputs))
            results.append(session.run(fetches, {signature_def.inputs[k].name: v for k, v in feeds.items()}))
    return results


def read_warmup(model_dir: pathlib.Path) -> list[prediction_log_pb2.PredictionLog]:
    path = model_dir / "assets.extra" / "tf_serving_warmup_requests"
    logs = []
    for record in tf.data.TFRecordDataset(str(path)):
        log = prediction_log_pb2.PredictionLog()
        log.ParseFromString(record.numpy())
        logs.append(log)
    return logs


@pytest.fixture(scope="module")
def mlp(zoo):
    return zoo.get("keras3_mlp")


@pytest.fixture(scope="module")
def warmup_rows() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((WARMUP_ROWS, 16)).astype(np.float32)


@pytest.fixture(scope="module")
def two_exports(mlp, warmup_rows, tmp_path_factory):
    """Two exports in a row into a fresh base: the first with warmup examples."""
    base = tmp_path_factory.mktemp("serving") / "mlp"
    first = serving.export(mlp.saved_model_dir, base, MAP, warmup_examples={"features": warmup_rows})
    second = serving.export(mlp.saved_model_dir, base, MAP)
    return base, first, second


def test_two_exports_in_a_row_give_versions_1_and_2(two_exports):
    base, first, second = two_exports
    assert (first, second) == (base / "1", base / "2")
    assert versions(base) == ["1", "2"]
    assert [p.name for p in base.iterdir() if not p.name.isdigit()] == []  # no staging left behind


def test_tf_serving_loads_the_version_and_runs_serving_default_by_tensor_name(two_exports, mlp):
    base, first, _ = two_exports
    sample = mlp.sample_inputs["serving_default"]
    (served,) = tf1_serve(first, [sample])
    reference = tf.saved_model.load(str(mlp.saved_model_dir)).signatures["serving_default"](
        **{k: tf.constant(v) for k, v in sample.items()}
    )
    for key, value in reference.items():
        assert served[key].dtype == np.float32 and served[key].shape == value.shape
        np.testing.assert_allclose(served[key], value.numpy(), atol=0.05, rtol=0.05)  # bf16 dense layers


def test_every_warmup_record_parses_and_its_request_runs(two_exports, warmup_rows):
    base, first, second = two_exports
    logs = read_warmup(first)
    assert len(logs) == WARMUP_ROWS
    feeds = []
    for row, log in zip(warmup_rows, logs):
        assert log.WhichOneof("log_type") == "predict_log"
        request = log.predict_log.request
        assert request.model_spec.signature_name == "serving_default"
        assert request.model_spec.name == base.name
        arrays = {key: tf.make_ndarray(proto) for key, proto in request.inputs.items()}
        np.testing.assert_array_equal(arrays["features"], row[None, :])
        feeds.append(arrays)
    results = tf1_serve(first, feeds)
    assert all(r["output_0"].shape == (1, 4) and np.all(np.isfinite(r["output_0"])) for r in results)
    assert not (second / "assets.extra").exists()  # no examples, no warmup file


def test_warmup_from_npz_gives_one_request_per_row(mlp, tmp_path, warmup_rows):
    np.savez(tmp_path / "warm.npz", features=warmup_rows[:2])
    path = serving.export(mlp.saved_model_dir, tmp_path / "base", MAP, warmup_examples=tmp_path / "warm.npz",
                          serving_checks=False)
    assert len(read_warmup(path)) == 2


def test_explicit_version_then_the_next_follows_the_highest(mlp, tmp_path):
    base = tmp_path / "base"
    assert serving.export(mlp.saved_model_dir, base, MAP, version=7, serving_checks=False) == base / "7"
    assert serving.resolve_version(base, None) == 8
    (base / "not_a_version").mkdir()
    (base / ".tfpolicy-export-9-stale").mkdir()  # what a killed export leaves: ignored
    assert serving.resolve_version(base, None) == 8


@pytest.mark.parametrize("version", [1, -1, "3", True, 2.0], ids=["existing", "negative", "string", "bool", "float"])
def test_bad_or_existing_version_is_refused_and_nothing_written(two_exports, mlp, version):
    base = two_exports[0]
    before = tree_digest(base)
    with pytest.raises(OutputError) as raised:
        serving.export(mlp.saved_model_dir, base, MAP, version=version)
    assert "\n" not in str(raised.value)
    assert ("already exists" in str(raised.value)) == (type(version) is int and version == 1)
    assert tree_digest(base) == before


def test_warmup_examples_that_do_not_fit_write_nothing(mlp, tmp_path):
    base = tmp_path / "base"
    with pytest.raises(InputDataError, match="warmup examples: signature 'serving_default' input 'features' expects float32"):
        serving.export(mlp.saved_model_dir, base, MAP, warmup_examples={"features": np.zeros((2, 3), np.float32)})
    assert not base.exists() and list(tmp_path.iterdir()) == []


def test_base_that_is_a_file_or_a_saved_model_is_refused(mlp, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        serving.export(mlp.saved_model_dir, tmp_path / "file", MAP)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "saved_model.pb").write_bytes(b"")
    with pytest.raises(OutputError, match="itself a SavedModel"):
        serving.export(mlp.saved_model_dir, tmp_path / "model", MAP)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "model"]
    assert [p.name for p in (tmp_path / "model").iterdir()] == ["saved_model.pb"]


_EXPORT_SCRIPT = """
import sys, tfpolicy.serving_export as s
s.export(sys.argv[1], sys.argv[2], {"default_policy": "mixed_bfloat16"})
"""


def test_killed_export_leaves_no_version_directory(mlp, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    process = subprocess.Popen(
        [sys.executable, "-c", _EXPORT_SCRIPT, str(mlp.saved_model_dir), str(base)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    killed_while = None
    try:
        while time.monotonic() < deadline and process.poll() is None:
            staging = [p for p in base.iterdir() if p.name.startswith(".tfpolicy-export-")]
            written = [f for s in staging for f in s.rglob("*") if f.is_file()]
            if written:  # the model is being written: kill it now
                killed_while = sorted(str(f.relative_to(base)) for f in written)
                process.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
    finally:
        process.kill()
        process.wait()
    assert killed_while, "the export finished before any file was seen being written"
    assert process.returncode == -signal.SIGKILL
    assert versions(base) == [], f"killed while writing {killed_while}"
    # The next export is version 1: the hidden staging leftover is not a version, and it removes it.
    assert serving.export(mlp.saved_model_dir, base, MAP, serving_checks=False) == base / "1"
    assert [p.name for p in base.iterdir()] == ["1"]


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _write_map(directory: pathlib.Path) -> str:
    (directory / "map.json").write_text('{"default_policy": "mixed_bfloat16", "policy_map": {"head": "float32"}}\n')
    return "map.json"


def test_cli_serving_base_exports_next_version_with_warmup(mlp, tmp_path, warmup_rows):
    np.savez(tmp_path / "warm.npz", features=warmup_rows)
    (tmp_path / "base" / "4").mkdir(parents=True)
    result = run_cli(["--map", _write_map(tmp_path), "--serving_base", "base", "--warmup_data", "warm.npz",
                      "--report", "r.json", str(mlp.saved_model_dir)], tmp_path)
    assert result.returncode == 0, describe(result)
    assert "exported version 5 to base/5" in result.stderr, describe(result)
    assert "3 warmup requests" in result.stderr and "serving checks" in result.stderr, describe(result)
    assert len(read_warmup(tmp_path / "base" / "5")) == WARMUP_ROWS
    assert leftovers(tmp_path / "base") == [] and versions(tmp_path / "base") == ["4", "5"]
    assert '"serving_checks"' in (tmp_path / "r.json").read_text()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--serving_base", "base", "--serving_version", "1"], "version 1 already exists"),
        (["--serving_base", "base", "--serving_version", "-3"], "--serving_version must be a non-negative integer"),
        (["--serving_version", "3"], "--serving_version needs --serving_base"),
        (["--serving_base", "base", "--warmup_data", "absent.npz"], "warmup examples 'absent.npz' does not exist"),
        (["--serving_base", "base", "--overwrite"], "--overwrite does not apply to --serving_base"),
    ],
    ids=["existing_version", "negative_version", "version_without_base", "missing_warmup", "overwrite"],
)
def test_cli_serving_user_errors_exit_2_with_one_line_and_write_nothing(mlp, tmp_path, args, expected):
    (tmp_path / "base" / "1").mkdir(parents=True)
    map_name = _write_map(tmp_path)
    before = tree_digest(tmp_path)
    extra = [] if "--serving_base" in args else ["out"]
    result = run_cli(["--map", map_name, *args, str(mlp.saved_model_dir), *extra], tmp_path)
    assert result.returncode == 2, describe(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfpolicy: error: ") and expected in lines[0], describe(result)
    assert tree_digest(tmp_path) == before


def test_version_prints_the_program_version_and_the_old_serving_spelling_still_works(mlp, tmp_path):
    import tfpolicy  # noqa: PLC0415

    result = run_cli(["--version"], tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"tfpolicy {tfpolicy.__version__}\n", ""), describe(result)
    result = run_cli(["--map", _write_map(tmp_path), "--serving_base", "base", "--version", "7", "--noserving_checks",
                      str(mlp.saved_model_dir)], tmp_path)
    assert result.returncode == 0 and versions(tmp_path / "base") == ["7"], describe(result)
    assert "warning: --version 7 is deprecated" in result.stderr and "use --serving_version 7" in result.stderr


def test_cli_serving_base_with_output_is_refused(mlp, tmp_path):
    result = run_cli(["--map", _write_map(tmp_path), "--serving_base", "base", str(mlp.saved_model_dir), "out"], tmp_path)
    assert result.returncode == 2 and "give only INPUT" in result.stderr, describe(result)
    assert not (tmp_path / "base").exists() and not (tmp_path / "out").exists()

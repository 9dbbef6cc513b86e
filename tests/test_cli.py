"""End-to-end tests of the command line, ``python -m tfpolicy.rewrite``.

Every test runs the real CLI in a subprocess (``sys.executable -m
tfpolicy.rewrite``, ``PYTHONPATH`` = the repository root, cwd = a fresh
temporary directory) on a copy of the zoo's ``keras3_mlp`` SavedModel
(layers ``dense``, ``dense_1``, ``head``).

The contract checked for each user error (``rewrite.py``'s docstring): exit
status 2, one line on stderr naming the problem, no traceback, and nothing
written: neither the output directory nor a ``.tfpolicy-tmp-*`` leftover, and
the working directory and the input SavedModel byte-for-byte as before.

Each CLI run costs a TensorFlow import (~3 s), so each case is run once and
its result cached; several tests then check different properties of it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Callable

import numpy as np
import pytest
import tensorflow as tf

pytestmark = pytest.mark.slow  # runs the command line in a subprocess per case

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 180
EXIT_USER_ERROR = 2
LAYER_PATHS = ("dense", "dense_1", "head")

GOOD_MAP = {"default_policy": "mixed_bfloat16", "policy_map": {"head": "float32"}}

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def run_cli(args: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """Run ``python -m tfpolicy.rewrite *args`` as a user would."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # conftest sets it; a user's shell does not
    return subprocess.run(
        [sys.executable, "-m", "tfpolicy.rewrite", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )


def tree_digest(root: pathlib.Path) -> dict[str, str]:
    """``{relative path: sha256 of the file, or '<dir>'}`` for everything under root."""
    if not root.exists():
        return {}
    result = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        result[rel] = "<dir>" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return result


def leftovers(directory: pathlib.Path) -> list[str]:
    """Temporary directories tfpolicy's atomic save may leave beside its output."""
    return sorted(p.name for p in directory.iterdir() if ".tfpolicy-" in p.name)


def write_json(path: pathlib.Path, document: object) -> str:
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path.name


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stderr ---\n{result.stderr}\n--- stdout ---\n{result.stdout}"


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_dir(zoo, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A private copy of keras3_mlp's SavedModel (so the zoo's stays pristine)."""
    source = zoo.get("keras3_mlp").saved_model_dir
    target = tmp_path_factory.mktemp("cli_model") / "keras3_mlp"
    shutil.copytree(source, target)
    return target


# ---------------------------------------------------------------------------
# User errors
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ErrorCase:
    """A user error: how to provoke it and what its one line must say.

    ``setup(workspace, model_dir)`` prepares files in the (empty) working
    directory and returns the CLI arguments plus the output path that must not
    appear. ``expect`` are substrings (or compiled regexes) of the error line.
    """

    id: str
    setup: Callable[[pathlib.Path, pathlib.Path], tuple[list[str], pathlib.Path]]
    expect: tuple[object, ...]


def _good_map(ws: pathlib.Path) -> str:
    return write_json(ws / "good.json", GOOD_MAP)


def _missing_map(ws, model):
    return [str(model), "out"], ws / "out"


def _map_file_missing(ws, model):
    return ["--map", "absent_map.json", str(model), "out"], ws / "out"


def _map_is_directory(ws, model):
    (ws / "map_dir.json").mkdir()
    return ["--map", "map_dir.json", str(model), "out"], ws / "out"


def _invalid_json(ws, model):
    (ws / "broken.json").write_text('{"policy_map": {"head": "float32",\n')
    return ["--map", "broken.json", str(model), "out"], ws / "out"


def _bad_regex(ws, model):
    name = write_json(ws / "regex.json", {"policy_map": {"dense_(": "bfloat16"}})
    return ["--map", name, str(model), "out"], ws / "out"


def _ambiguous_path(ws, model):
    name = write_json(ws / "ambiguous.json", {"policy_map": {"dense.*": "bfloat16", "d.*": "float16"}})
    return ["--map", name, str(model), "out"], ws / "out"


def _unknown_policy(ws, model):
    name = write_json(ws / "unknown.json", {"policy_map": {"head": "bfloat17"}})
    return ["--map", name, str(model), "out"], ws / "out"


def _unsupported_quantized_policy(ws, model):
    name = write_json(ws / "quantized.json", {"policy_map": {"head": "gptq/4/128_from_float32"}})
    return ["--map", name, str(model), "out"], ws / "out"


def _missing_input(ws, model):
    return ["--map", _good_map(ws), "no_such_model", "out"], ws / "out"


def _not_a_saved_model(ws, model):
    (ws / "empty_dir").mkdir()
    return ["--map", _good_map(ws), "empty_dir", "out"], ws / "out"


def _output_exists(ws, model):
    existing = ws / "existing_out"
    existing.mkdir()
    (existing / "keep.txt").write_text("precious\n")
    (existing / "variables").mkdir()
    (existing / "variables" / "data").write_bytes(b"\x00\x01\x02")
    # The output exists on purpose; the digest of the workspace proves it untouched.
    return ["--map", _good_map(ws), str(model), "existing_out"], ws / "never_created"


def _output_is_input(ws, model):
    return ["--map", _good_map(ws), str(model), str(model)], ws / "never_created"


def _output_inside_input(ws, model):
    return ["--map", _good_map(ws), str(model), str(model / "inner_out")], model / "inner_out"


def _unknown_signature(ws, model):
    return ["--map", _good_map(ws), "--signatures", "no_such_sig", str(model), "out"], ws / "out"


def _unknown_flag(ws, model):
    return ["--map", _good_map(ws), "--no_such_flag", str(model), "out"], ws / "out"


def _strict_unused_key(ws, model):
    name = write_json(ws / "unused.json", {"policy_map": {"head": "float32", "no_such_layer": "bfloat16"}})
    return ["--map", name, "--strict", str(model), "out"], ws / "out"


FLOAT8_MAP = {"policy_map": {"dense": "float8_from_mixed_bfloat16"}}


def _calibration_file_missing(ws, model):
    name = write_json(ws / "float8.json", FLOAT8_MAP)
    return ["--map", name, "--calibration_data", "absent.npz", str(model), "out"], ws / "out"


def _calibration_not_npz(ws, model):
    name = write_json(ws / "float8.json", FLOAT8_MAP)
    (ws / "data.npz").write_text("not a zip archive\n")
    return ["--map", name, "--calibration_data", "data.npz", str(model), "out"], ws / "out"


def _calibration_wrong_input(ws, model):
    name = write_json(ws / "float8.json", FLOAT8_MAP)
    np.savez(ws / "data.npz", pixels=np.zeros((4, 16), np.float32))
    return ["--map", name, "--calibration_data", "data.npz", str(model), "out"], ws / "out"


def _int8_from_mixed_float16(ws, model):
    name = write_json(ws / "int8.json", {"policy_map": {"head": "int8_from_mixed_float16"}})
    return ["--map", name, str(model), "out"], ws / "out"


def _report_unwritable(ws, model):
    return ["--map", _good_map(ws), "--report", "no_such_dir/report.json", str(model), "out"], ws / "out"


ERROR_CASES = [
    ErrorCase("missing_map", _missing_map, ("--map", "required")),
    ErrorCase("map_file_missing", _map_file_missing, ("absent_map.json",)),
    ErrorCase("map_unreadable_directory", _map_is_directory, ("map_dir.json", "cannot read")),
    ErrorCase("map_invalid_json", _invalid_json, ("broken.json", "not valid JSON")),
    ErrorCase("map_bad_regex", _bad_regex, ("'dense_('", "regular expression")),
    ErrorCase(
        "map_ambiguous_path",
        _ambiguous_path,
        (re.compile(r"layer path 'dense(_1)?'"), "'dense.*'", "'d.*'"),
    ),
    ErrorCase("map_unknown_policy", _unknown_policy, ("bfloat17", "'head'")),
    ErrorCase("map_unsupported_quantized_policy", _unsupported_quantized_policy, ("gptq/4/128_from_float32", "head", "not supported")),
    ErrorCase("input_missing", _missing_input, ("no_such_model", "does not exist")),
    ErrorCase("input_not_a_saved_model", _not_a_saved_model, ("empty_dir", "not a SavedModel")),
    ErrorCase("output_exists", _output_exists, ("existing_out", "--overwrite")),
    ErrorCase("output_is_input", _output_is_input, ("keras3_mlp", "is the input")),
    ErrorCase("output_inside_input", _output_inside_input, ("inner_out", "inside the input")),
    ErrorCase("unknown_signature", _unknown_signature, ("'no_such_sig'", "serving_default")),
    ErrorCase("unknown_flag", _unknown_flag, ("no_such_flag",)),
    ErrorCase("strict_unused_key", _strict_unused_key, ("'no_such_layer'", "--strict")),
    ErrorCase("calibration_file_missing", _calibration_file_missing, ("absent.npz", "does not exist")),
    ErrorCase("calibration_not_npz", _calibration_not_npz, ("data.npz", "not a readable .npz")),
    ErrorCase("calibration_wrong_input", _calibration_wrong_input, ("'features'", "pixels")),
    ErrorCase("int8_from_mixed_float16", _int8_from_mixed_float16, ("int8_from_mixed_float16", "'head'", "float16")),
    ErrorCase(
        "report_path_unwritable",
        _report_unwritable,
        ("no_such_dir/report.json",),
    ),
]


@dataclasses.dataclass
class ErrorRun:
    result: subprocess.CompletedProcess
    workspace: pathlib.Path
    must_not_exist: pathlib.Path
    workspace_before: dict[str, str]
    workspace_after: dict[str, str]


@pytest.fixture(scope="session")
def error_runs(model_dir, tmp_path_factory, request):
    """Runs each error case once; returns ``get(case) -> ErrorRun``.

    On first use, every error case this session will ask for is started, two
    at a time: each run mostly waits on a TensorFlow import, so this halves the
    wall time on two cores.
    """
    wanted = [
        item.callspec.params["case"]
        for item in request.session.items
        if isinstance(getattr(getattr(item, "callspec", None), "params", {}).get("case"), ErrorCase)
    ]
    futures: dict[str, concurrent.futures.Future] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)

    def run_case(case: ErrorCase) -> ErrorRun:
        workspace = tmp_path_factory.mktemp(f"cli_{case.id}")
        args, must_not_exist = case.setup(workspace, model_dir)
        workspace_before = tree_digest(workspace)
        result = run_cli(args, workspace)
        return ErrorRun(result, workspace, must_not_exist, workspace_before, tree_digest(workspace))

    def submit(case: ErrorCase) -> None:
        if case.id not in futures:
            futures[case.id] = pool.submit(run_case, case)

    def get(case: ErrorCase) -> ErrorRun:
        if not futures:
            for other in [case, *wanted]:
                submit(other)
        submit(case)
        return futures[case.id].result()

    model_before = tree_digest(model_dir)
    yield get
    pool.shutdown(wait=True)
    # Undo what a buggy run may have written into the shared model copy.
    for future in futures.values():
        run = future.result() if future.exception() is None else None
        if run is not None and model_dir in run.must_not_exist.parents:
            shutil.rmtree(run.must_not_exist, ignore_errors=True)
    assert tree_digest(model_dir) == model_before, "an error case modified the input SavedModel"


ERROR_PARAMS = [pytest.param(case, id=case.id) for case in ERROR_CASES]


@pytest.mark.parametrize("case", ERROR_PARAMS)
def test_user_error_exits_2_names_problem_and_writes_nothing(case: ErrorCase, error_runs) -> None:
    run = error_runs(case)
    result = run.result
    assert result.returncode == EXIT_USER_ERROR, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    lines = result.stderr.strip().splitlines()
    assert lines, describe(result)
    line = lines[-1]
    assert line.startswith("tfpolicy: error: "), describe(result)
    for expected in case.expect:
        if isinstance(expected, re.Pattern):
            assert expected.search(line), f"{expected.pattern!r} not in {line!r}"
        else:
            assert expected in line, f"{expected!r} not in {line!r}"
    assert result.stdout == "", describe(result)
    # Nothing written: no output, no temporary leftovers, workspace and input as before.
    assert not run.must_not_exist.exists(), describe(result)
    assert leftovers(run.workspace) == [], describe(result)
    assert run.workspace_after == run.workspace_before, describe(result)


@pytest.mark.parametrize("case", ERROR_PARAMS)
def test_user_error_is_exactly_one_stderr_line(case: ErrorCase, error_runs) -> None:
    result = error_runs(case).result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, describe(result)
    assert lines[0].startswith("tfpolicy: error: "), describe(result)


# ---------------------------------------------------------------------------
# Successful runs
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class SuccessRun:
    result: subprocess.CompletedProcess
    workspace: pathlib.Path
    output: pathlib.Path
    report: pathlib.Path
    model_before: dict[str, str]
    model_after: dict[str, str]


@pytest.fixture(scope="session")
def rewritten(model_dir, tmp_path_factory, zoo) -> SuccessRun:
    """One successful ``--map good.json --report report.json MODEL out`` run."""
    workspace = tmp_path_factory.mktemp("cli_success")
    model_before = tree_digest(model_dir)
    result = run_cli(["--map", _good_map(workspace), "--report", "report.json", str(model_dir), "out"], workspace)
    return SuccessRun(
        result, workspace, workspace / "out", workspace / "report.json", model_before, tree_digest(model_dir)
    )


def test_rewrite_exits_0_and_writes_a_loadable_saved_model(rewritten: SuccessRun, zoo) -> None:
    result = rewritten.result
    assert result.returncode == 0, describe(result)
    assert "Traceback" not in result.stderr and "error" not in result.stderr, describe(result)
    assert "wrote out" in result.stderr, describe(result)
    assert (rewritten.output / "saved_model.pb").is_file()
    assert (rewritten.output / "variables").is_dir()
    assert leftovers(rewritten.workspace) == []
    loaded = tf.saved_model.load(str(rewritten.output))
    assert set(loaded.signatures) == {"serve", "serving_default"}
    sample = zoo.get("keras3_mlp").sample_inputs["serving_default"]
    outputs = loaded.signatures["serving_default"](**{k: tf.constant(v) for k, v in sample.items()})
    for value in outputs.values():
        assert value.dtype == tf.float32  # signatures keep their dtypes
        assert value.shape == (3, 4)
        assert np.all(np.isfinite(value.numpy()))


def test_rewrite_leaves_input_byte_identical(rewritten: SuccessRun) -> None:
    assert rewritten.result.returncode == 0, describe(rewritten.result)
    assert rewritten.model_before, "digest of the input is empty"
    assert any(name.startswith("variables/") for name in rewritten.model_before)
    assert rewritten.model_after == rewritten.model_before


def test_report_json_has_layers_signatures_and_casts(rewritten: SuccessRun) -> None:
    assert rewritten.result.returncode == 0, describe(rewritten.result)
    report = json.loads(rewritten.report.read_text())
    for key in ("layers", "signatures", "casts_inserted"):
        assert key in report
    by_path = {row["path"]: row for row in report["layers"]}
    assert set(LAYER_PATHS) <= set(by_path)
    assert by_path["head"]["key"] == "head" and by_path["head"]["policy"] == "float32"
    assert by_path["dense"]["policy"] == "mixed_bfloat16"
    assert {s["key"] for s in report["signatures"]} == {"serve", "serving_default"}
    assert report["casts_inserted"] > 0  # bf16 dense layers meet the float32 head and inputs


def test_overwrite_replaces_existing_output(model_dir, tmp_path: pathlib.Path) -> None:
    existing = tmp_path / "out"
    existing.mkdir()
    (existing / "stale.txt").write_text("old\n")
    result = run_cli(["--map", _good_map(tmp_path), "--overwrite", "--quiet", str(model_dir), "out"], tmp_path)
    assert result.returncode == 0, describe(result)
    assert result.stderr.strip() == "", describe(result)  # --quiet, and no warnings
    assert not (existing / "stale.txt").exists()
    assert (existing / "saved_model.pb").is_file()
    assert leftovers(tmp_path) == []


def test_explain_prints_plan_table_and_writes_nothing(model_dir, tmp_path: pathlib.Path) -> None:
    name = _good_map(tmp_path)
    before = tree_digest(tmp_path)
    result = run_cli(["--map", name, "--explain", str(model_dir), "out"], tmp_path)
    assert result.returncode == 0, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.strip()}
    for path in LAYER_PATHS:
        assert path in rows, result.stdout
    assert rows["head"][1:3] == ["head", "float32"], result.stdout  # matched key, policy
    assert rows["dense"][1:3] == ["(default)", "mixed_bfloat16"], result.stdout
    assert rows["dense_1"][1:3] == ["(default)", "mixed_bfloat16"], result.stdout
    assert not (tmp_path / "out").exists()
    assert tree_digest(tmp_path) == before


@pytest.fixture(scope="session")
def helpshort(tmp_path_factory) -> subprocess.CompletedProcess:
    return run_cli(["--helpshort"], tmp_path_factory.mktemp("cli_help"))


def test_helpshort_mentions_map(helpshort: subprocess.CompletedProcess) -> None:
    assert "--map" in helpshort.stdout + helpshort.stderr, describe(helpshort)
    assert "Traceback" not in helpshort.stderr, describe(helpshort)


def test_helpshort_exits_0(helpshort: subprocess.CompletedProcess) -> None:
    assert helpshort.returncode == 0, describe(helpshort)


def test_float8_calibration_from_an_npz_file(model_dir, tmp_path: pathlib.Path) -> None:
    name = write_json(tmp_path / "float8.json", FLOAT8_MAP)
    features = np.random.default_rng(0).standard_normal((10, 16)).astype(np.float32) * 50
    np.savez(tmp_path / "data.npz", features=features)
    result = run_cli(["--map", name, "--calibration_data", "data.npz", "--calibration_batch_size", "4",
                      "--calibration_batches", "2", "--report", "report.json", str(model_dir), "out"], tmp_path)
    assert result.returncode == 0, describe(result)
    assert "(2 calibration batches)" in result.stderr, describe(result)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["calibration_batches"] == 2
    scale = report["quantization"]["dense"]["scales"]["dense/inputs_scale"]
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    values = {v.name: v.numpy() for v in loaded.tfpolicy.variables}
    assert values["dense/inputs_scale:0"] == pytest.approx(scale[0]) and scale[0] != 1.0
    # Two batches of four rows, the amax of each rolled in (measured on the bf16 inputs).
    history = values["dense/inputs_amax_history:0"]
    np.testing.assert_allclose([history[0], history[-1]], [np.abs(features[4:8]).max(), np.abs(features[:4]).max()], rtol=1e-2)
    assert not history[1:-1].any()
    assert not hasattr(loaded.tfpolicy, "calibrate")  # not asked for


def test_calibrate_function_flag_writes_tfpolicy_calibrate(model_dir, tmp_path: pathlib.Path) -> None:
    name = write_json(tmp_path / "float8.json", FLOAT8_MAP)
    result = run_cli(["--map", name, "--calibrate_function", "--quiet", str(model_dir), "out"], tmp_path)
    assert result.returncode == 0, describe(result)
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    features = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32) * 50
    scales = loaded.tfpolicy.calibrate(features=tf.constant(features))
    assert scales["dense/inputs_scale"].numpy() != 1.0


def test_installed_console_script_runs_the_readme_example(tmp_path: pathlib.Path) -> None:
    """``tfpolicy-rewrite`` (pip's console script) is the same program as ``python -m``."""
    script = pathlib.Path(sys.executable).parent / "tfpolicy-rewrite"
    if not script.exists():
        pytest.skip(f"tfpolicy is not installed beside {sys.executable} (pip install -e .)")
    repo = pathlib.Path(__file__).resolve().parents[1]
    example = repo / "examples" / "mlp"
    result = subprocess.run(
        [str(script), "--map", str(example / "policy.json"), str(example / "saved_model"), str(tmp_path / "mlp_bf16")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    loaded = tf.saved_model.load(str(tmp_path / "mlp_bf16"))
    assert "serving_default" in loaded.signatures
    import tfpolicy  # noqa: PLC0415  (the API function, whatever entry point ran)

    report = tfpolicy.rewrite(example / "saved_model", tmp_path / "again", str(example / "policy.json"),
                              serving_checks=False)
    assert report.casts_inserted > 0

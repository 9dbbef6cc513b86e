"""The Python behind the Bazel rules, without Bazel: tools/bazel/compare.py
(tfpolicy_test's check) and tools/bazel/pytest_runner.py (the py_test main)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

import pytest

import tfpolicy

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "mlp"


def load_tool(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"bazel_{name}", REPO_ROOT / "tools" / "bazel" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


compare = load_tool("compare")
pytest_runner = load_tool("pytest_runner")


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    output = tmp_path_factory.mktemp("compare") / "mlp_bf16"
    tfpolicy.rewrite(EXAMPLE / "saved_model", output, EXAMPLE / "policy.json")
    return output


def test_measure_error_of_bf16_example(rewritten: pathlib.Path) -> None:
    result = compare.measure_error(EXAMPLE / "saved_model", rewritten, seed=0)
    assert 0.0 < result.max_abs_error < 0.05
    assert result.signatures == 2
    assert result.where in {"serve/output_0", "serving_default/output_0"}


def test_measure_error_of_a_model_against_itself_is_zero() -> None:
    result = compare.measure_error(EXAMPLE / "saved_model", EXAMPLE / "saved_model", seed=0)
    assert result.max_abs_error == 0.0


def test_same_seed_same_error(rewritten: pathlib.Path) -> None:
    first = compare.measure_error(EXAMPLE / "saved_model", rewritten, seed=3)
    second = compare.measure_error(EXAMPLE / "saved_model", rewritten, seed=3)
    assert first == second


def test_main_pass_and_fail_lines(rewritten: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    files = [str(p) for p in sorted((EXAMPLE / "saved_model").rglob("*")) if p.is_file()]
    common = ["--rewritten", str(rewritten), "--saved_model", *files]
    assert compare.main(["--max_error", "0.05", *common]) == 0
    passed = capsys.readouterr().out.strip()
    assert passed.startswith("tfpolicy_test: PASS: max abs error ") and "<= max_error 0.05 (" in passed
    assert compare.main(["--max_error", "1e-6", *common]) == compare.EXIT_FAIL
    failed = capsys.readouterr().out.strip()
    assert failed.startswith("tfpolicy_test: FAIL: max abs error ") and "> max_error 1e-06 (" in failed


@pytest.mark.parametrize(
    "saved_model, message",
    [
        ([], "saved_model has no files"),
        ([str(EXAMPLE / "policy.json")], "has no saved_model.pb"),
    ],
)
def test_main_user_errors_are_one_line(
    rewritten: pathlib.Path, saved_model: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    status = compare.main(["--max_error", "0.05", "--rewritten", str(rewritten), "--saved_model", *saved_model])
    assert status == compare.EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("tfpolicy_test: error: ") and message in err
    assert "\n" not in err


def test_validation_data_is_used_and_checked(rewritten: pathlib.Path, tmp_path: pathlib.Path, capsys) -> None:
    np = pytest.importorskip("numpy")
    features = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    np.savez(tmp_path / "data.npz", features=features)
    on_data = compare.measure_error(EXAMPLE / "saved_model", rewritten, seed=0, data=str(tmp_path / "data.npz"))
    assert 0.0 < on_data.max_abs_error < 0.05
    # The data is what is measured: the same rows 64x larger give a larger error
    # (comparing with generated inputs cannot tell, as bfloat16 errors are
    # coarse and the two maxima can coincide on some CPUs).
    np.savez(tmp_path / "large.npz", features=features * 64)
    on_large = compare.measure_error(EXAMPLE / "saved_model", rewritten, seed=0, data=str(tmp_path / "large.npz"))
    assert on_large.max_abs_error > 4 * on_data.max_abs_error
    np.savez(tmp_path / "wrong.npz", pixels=features)
    status = compare.main(["--max_error", "0.05", "--rewritten", str(rewritten), "--validation_data",
                           str(tmp_path / "wrong.npz"), "--saved_model", str(EXAMPLE / "saved_model")])
    assert status == compare.EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("tfpolicy_test: error: ") and "pixels" in err and "\n" not in err


def test_pytest_runner_args_under_bazel() -> None:
    args = pytest_runner.pytest_args(
        ["tests/test_units.py"], {"XML_OUTPUT_FILE": "/out/test.xml", "TEST_TMPDIR": "/tmp/t"}
    )
    assert args[0] == "tests/test_units.py"
    assert "--junitxml=/out/test.xml" in args
    assert "--basetemp=/tmp/t/pytest" in args
    assert args[args.index("-p") + 1] == "no:cacheprovider"


def test_pytest_runner_args_outside_bazel() -> None:
    args = pytest_runner.pytest_args(["tests/test_units.py"], {})
    assert not [a for a in args if a.startswith(("--junitxml", "--basetemp"))]

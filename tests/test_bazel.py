"""The Bazel rules of tools/defs.bzl, run by Bazel on the example workspace.

examples/bazel is copied to a temporary directory, with its
``local_repository`` pointed at this checkout, and built by its own Bazel
server (own output base, shut down at the end) on this interpreter
(``BAZEL_PYTHON``):

* ``tfpolicy_rewrite`` writes a SavedModel directory;
* ``tfpolicy_test`` passes with the example's bound, and fails (exit 3, one
  FAIL line) with a bound below the error it measured;
* a missing SavedModel fails the build with tfpolicy's one-line error;
* ``calibration_data`` reaches the CLI's ``--calibration_data``;
* ``target`` and ``int8_convolutions`` reach ``--target`` and
  ``--int8_convolutions`` (read from ``bazel aquery``), and ``target = "tpu"``
  refuses a float8 map with tfpolicy's one-line error.

This file is not a Bazel target (tests/BUILD leaves it out): a Bazel server
started from inside a Bazel test's sandbox is awkward and slow. pytest runs it;
.ci/run installs Bazel and sets TFPOLICY_REQUIRE_BAZEL=1, so that a missing
``bazel`` fails there instead of skipping.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "bazel"
BAZEL = shutil.which("bazel")
BAZEL_TIMEOUT_S = 600
EXIT_TESTS_FAILED = 3  # bazel test: the build succeeded, a test failed
SHIPPED_BOUND = 0.05  # max_error of :mlp_bf16_test in examples/bazel/BUILD

pytestmark = [
    pytest.mark.slow,  # starts Bazel on the example workspace
    pytest.mark.skipif(
        BAZEL is None and not os.environ.get("TFPOLICY_REQUIRE_BAZEL"),
        reason="no bazel binary on PATH (apt-get install bazel-bootstrap; .ci/run installs it)",
    ),
]

VERDICT = re.compile(
    r"tfpolicy_test: (?P<verdict>PASS|FAIL): max abs error (?P<error>\S+) (<=|>) max_error (?P<bound>\S+)"
)


class Workspace:
    """A copy of examples/bazel and the Bazel server that builds it."""

    def __init__(self, root: pathlib.Path, scratch: pathlib.Path) -> None:
        self.root = root
        self._startup = [
            f"--output_user_root={scratch / 'user_root'}",
            f"--output_base={scratch / 'output_base'}",
            "--nohome_rc",
            "--max_idle_secs=120",  # a safety net; close() shuts it down
        ]
        self._env = dict(os.environ, BAZEL_PYTHON=sys.executable)

    def bazel(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [BAZEL or "bazel", *self._startup, *args],
            cwd=self.root,
            env=self._env,
            capture_output=True,
            text=True,
            timeout=BAZEL_TIMEOUT_S,
        )

    def append_build(self, text: str) -> None:
        with open(self.root / "BUILD", "a") as build:
            build.write("\n" + text)

    def test_log(self, target: str) -> str:
        return (self.root / "bazel-testlogs" / target / "test.log").read_text()

    def close(self) -> None:
        self.bazel("shutdown")


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory):
    if BAZEL is None:
        pytest.fail("TFPOLICY_REQUIRE_BAZEL is set but there is no bazel binary on PATH")
    scratch = tmp_path_factory.mktemp("bazel")
    root = scratch / "example"
    shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns("bazel-*"))
    workspace_file = root / "WORKSPACE"
    text = workspace_file.read_text()
    assert 'path = "../.."' in text, "examples/bazel/WORKSPACE no longer points at ../.."
    workspace_file.write_text(text.replace('path = "../.."', f'path = "{REPO_ROOT}"'))
    ws = Workspace(root, scratch)
    yield ws
    ws.close()


@pytest.fixture(scope="module")
def shipped_run(workspace: Workspace) -> tuple[subprocess.CompletedProcess, str]:
    result = workspace.bazel("test", "//:mlp_bf16_test")
    return result, workspace.test_log("mlp_bf16_test")


def verdict_of(log: str) -> re.Match:
    match = VERDICT.search(log)
    assert match, f"no tfpolicy_test verdict line in the test log:\n{log[-4000:]}"
    return match


def test_rewrite_writes_a_saved_model(workspace: Workspace) -> None:
    result = workspace.bazel("build", "//:mlp_bf16")
    assert result.returncode == 0, describe(result)
    output = workspace.root / "bazel-bin" / "mlp_bf16"
    assert (output / "saved_model.pb").is_file()
    assert (output / "variables" / "variables.index").is_file()


def test_shipped_bound_passes(shipped_run: tuple[subprocess.CompletedProcess, str]) -> None:
    result, log = shipped_run
    assert result.returncode == 0, describe(result)
    verdict = verdict_of(log)
    assert verdict["verdict"] == "PASS"
    assert 0.0 < float(verdict["error"]) <= SHIPPED_BOUND  # bfloat16 is not float32
    assert float(verdict["bound"]) == SHIPPED_BOUND
    assert "Traceback" not in log


def test_bound_below_measured_error_fails(workspace: Workspace, shipped_run) -> None:
    measured = float(verdict_of(shipped_run[1])["error"])
    bound = measured / 2
    workspace.append_build(
        "tfpolicy_test(\n"
        '    name = "mlp_bf16_tight_test",\n'
        f"    max_error = {bound!r},\n"
        '    policy_map = "@tfpolicy//examples/mlp:policy.json",\n'
        '    saved_model = "@tfpolicy//examples/mlp:saved_model",\n'
        ")\n"
    )
    result = workspace.bazel("test", "//:mlp_bf16_tight_test")
    assert result.returncode == EXIT_TESTS_FAILED, describe(result)
    log = workspace.test_log("mlp_bf16_tight_test")
    verdict = verdict_of(log)
    assert verdict["verdict"] == "FAIL"
    assert float(verdict["error"]) == pytest.approx(measured, rel=1e-2)
    assert float(verdict["bound"]) == pytest.approx(bound, rel=1e-3)
    assert "Traceback" not in log


def test_missing_saved_model_is_tfpolicy_one_line_error(workspace: Workspace) -> None:
    workspace.append_build(
        'filegroup(name = "no_model", srcs = glob(["no_such_dir/**"]))\n\n'
        "tfpolicy_rewrite(\n"
        '    name = "no_model_bf16",\n'
        '    policy_map = "@tfpolicy//examples/mlp:policy.json",\n'
        '    saved_model = ":no_model",\n'
        ")\n"
    )
    result = workspace.bazel("build", "//:no_model_bf16")
    assert result.returncode != 0, describe(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("tfpolicy: error:")]
    assert errors == ["tfpolicy: error: input SavedModel 'no_model' does not exist"], describe(result)
    assert "Traceback" not in result.stderr


def test_calibration_data_reaches_the_cli(workspace: Workspace) -> None:
    np.savez(workspace.root / "calibration.npz", features=np.random.default_rng(0).standard_normal((64, 16)).astype("float32"))
    (workspace.root / "float8.json").write_text(
        '{"default_policy": "mixed_bfloat16", "policy_map": {"dense": "float8_from_mixed_bfloat16"}}\n'
    )
    (workspace.root / "broken.npz").write_bytes(b"not an npz")
    for name, data in (("mlp_float8", "calibration.npz"), ("mlp_float8_broken", "broken.npz")):
        workspace.append_build(
            "tfpolicy_rewrite(\n"
            f'    name = "{name}",\n'
            f'    calibration_data = "{data}",\n'
            '    policy_map = "float8.json",\n'
            '    saved_model = "@tfpolicy//examples/mlp:saved_model",\n'
            ")\n"
        )
    result = workspace.bazel("build", "//:mlp_float8")
    assert result.returncode == 0, describe(result)
    assert (workspace.root / "bazel-bin" / "mlp_float8" / "saved_model.pb").is_file()
    broken = workspace.bazel("build", "//:mlp_float8_broken")
    assert broken.returncode != 0, describe(broken)
    errors = [line for line in broken.stderr.splitlines() if line.startswith("tfpolicy: error:")]
    assert len(errors) == 1 and "broken.npz" in errors[0], describe(broken)
    assert "Traceback" not in broken.stderr


def test_target_and_int8_convolutions_reach_the_cli(workspace: Workspace) -> None:
    (workspace.root / "int8.json").write_text(
        '{"default_policy": "mixed_bfloat16", "policy_map": {"dense": "int8_from_mixed_bfloat16"}}\n'
    )
    (workspace.root / "float8_dense.json").write_text(
        '{"default_policy": "mixed_bfloat16", "policy_map": {"dense": "float8_from_mixed_bfloat16"}}\n'
    )
    for name, policy_map in (("mlp_int8_tpu", "int8.json"), ("mlp_float8_tpu", "float8_dense.json")):
        workspace.append_build(
            "tfpolicy_rewrite(\n"
            f'    name = "{name}",\n'
            '    int8_convolutions = True,\n'
            f'    policy_map = "{policy_map}",\n'
            '    saved_model = "@tfpolicy//examples/mlp:saved_model",\n'
            '    target = "tpu",\n'
            ")\n"
        )
    workspace.append_build(
        "tfpolicy_test(\n"
        '    name = "mlp_int8_tpu_test",\n'
        '    int8_convolutions = True,\n'
        "    max_error = 0.1,\n"
        '    policy_map = "int8.json",\n'
        '    saved_model = "@tfpolicy//examples/mlp:saved_model",\n'
        '    target = "tpu",\n'
        ")\n"
    )
    for target in ("//:mlp_int8_tpu", "//:mlp_int8_tpu_test_rewritten"):
        actions = workspace.bazel("aquery", f"mnemonic(TfPolicyRewrite, {target})")
        assert actions.returncode == 0, describe(actions)
        arguments = re.search(r"Command Line: \(exec (.*)\)", actions.stdout, re.DOTALL)
        assert arguments, describe(actions)
        words = arguments[1].replace("\\\n", " ").split()  # one argument per line, continued with "\\"
        assert words[words.index("--target") + 1] == "tpu" and "--int8_convolutions" in words, describe(actions)
    built = workspace.bazel("build", "//:mlp_int8_tpu")  # the CLI accepts both flags
    assert built.returncode == 0, describe(built)
    assert (workspace.root / "bazel-bin" / "mlp_int8_tpu" / "saved_model.pb").is_file()
    refused = workspace.bazel("build", "//:mlp_float8_tpu")  # a TPU has no float8
    assert refused.returncode != 0, describe(refused)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("tfpolicy: error:")]
    assert len(errors) == 1 and errors[0].startswith("tfpolicy: error: --target tpu:") and "float8" in errors[0], describe(refused)
    assert "Traceback" not in refused.stderr

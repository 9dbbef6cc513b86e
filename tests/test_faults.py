"""Faults: interrupted runs, full and read-only disks, damaged inputs, awkward paths, unusable data.

Each case runs the real command line in a subprocess, as a user (or ``docker
stop``) would meet it, and holds it to the contract: success with a complete
output, or one ``tfpolicy: error:`` / ``tfpolicy: interrupted`` line and a
non-zero exit, nothing left beside the output, no TensorFlow temporaries,
the input byte-identical.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from cli_helpers import REPO_ROOT, describe, leftovers, run_cli, tree_digest
from tfpolicy.core import staging

pytestmark = pytest.mark.slow  # runs the command line in a subprocess per case


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> pathlib.Path:
    """A Keras 3 MLP with a 1 MB kernel, exported."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,), name="features")
    hidden = keras.layers.Dense(1024, activation="relu", name="wide")(inputs)
    outputs = keras.layers.Dense(8, name="classification_head_for_the_final_scores")(hidden)
    path = tmp_path_factory.mktemp("faults") / "model"
    keras.Model(inputs, outputs).export(str(path), verbose=False)
    return path


@pytest.fixture()
def work(tmp_path, model) -> pathlib.Path:
    (tmp_path / "map.json").write_text(json.dumps({"default_policy": "mixed_bfloat16"}))
    return tmp_path


def _error_line(result: subprocess.CompletedProcess, code: int = 2) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1, describe(result)
    return lines[0]


def _env(tmpdir: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), TMPDIR=str(tmpdir))
    for unset in ("TF_CPP_MIN_LOG_LEVEL", "PYTHONDONTWRITEBYTECODE"):  # as a user's shell has them: unset
        env.pop(unset, None)
    return env


# ------------------------------------------------------------------ interrupts


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("moment", ["starting", "staged"])
def test_an_interrupt_before_the_rename_leaves_nothing_and_prints_one_line(work, model, signum, moment):
    """``starting``: while TensorFlow loads; ``staged``: once the staging directory beside the output exists."""
    before = tree_digest(model)
    tmpdir = work / "tmp"
    tmpdir.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "tfpolicy.rewrite", "--map", "map.json", str(model), "out"],
        cwd=work, env=_env(tmpdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    if moment == "starting":  # once the command's handlers are in (the kernel's caught-signal mask says so)
        while not _catches(process.pid, signal.SIGTERM):
            assert process.poll() is None and time.monotonic() < deadline, "the command never started"
            time.sleep(0.005)
        time.sleep(0.3)  # TensorFlow is being imported
    else:
        while not any(p.name.startswith(".out.tfpolicy-tmp-") for p in work.iterdir()):
            assert process.poll() is None and time.monotonic() < deadline, "the run never staged its output"
            time.sleep(0.005)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    result = subprocess.CompletedProcess(process.args, process.returncode, "", stderr)
    line = _error_line(result, code=128 + signum)
    assert line == f"tfpolicy: interrupted by {signal.Signals(signum).name}; nothing was written", describe(result)
    assert leftovers(work) == [] and not (work / "out").exists()
    assert list(tmpdir.iterdir()) == []  # autograph's generated files are removed at a normal exit
    assert tree_digest(model) == before


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux's /proc/<pid>/status SigCgt)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (signum - 1) & 1)


def test_a_killed_runs_staging_directory_is_removed_by_the_next_run(work, model):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # a process that has exited
    host = staging.owner_tag().split("@")[1]
    abandoned = work / f".out.tfpolicy-tmp-{dead_pid}@{host}-x1"
    alive = work / f".out.tfpolicy-tmp-{os.getpid()}@{host}-x2"  # a run still going (this test's process)
    other_host = work / f".out.tfpolicy-tmp-{dead_pid}@0000ffff-x3"  # only age can tell
    not_ours = work / ".out.something-else"
    for path in (abandoned, alive, other_host, not_ours):
        (path / "variables").mkdir(parents=True)
    result = run_cli(["--map", "map.json", str(model), "out"], cwd=work)
    assert result.returncode == 0, describe(result)
    assert not abandoned.exists() and alive.exists() and other_host.exists() and not_ours.exists()
    old = time.time() - staging.STALE_SECONDS - 60
    os.utime(other_host, (old, old))
    assert staging.remove_stale(work, "tmp", "out") == [other_host]


def test_an_interrupted_overwrite_gets_its_old_output_back(tmp_path):
    """SIGKILL between setting the old output aside and renaming the new one in: the next run restores it."""
    dead = tmp_path / ".out.tfpolicy-old-1@{}-x".format(staging.owner_tag().split("@")[1])
    (dead / "old").mkdir(parents=True)
    (dead / "old" / "saved_model.pb").write_bytes(b"previous")
    os.utime(dead, (0, 0))  # abandoned by age, whatever pid 1 is
    staging.remove_stale(tmp_path, "old", "out")
    assert (tmp_path / "out" / "saved_model.pb").read_bytes() == b"previous" and not dead.exists()


# ------------------------------------------------------------------ disks


def _limit_file_size(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_disk_that_refuses_the_write_is_a_user_error_naming_the_output(work, model):
    """A file size limit stops the checkpoint's write half-way (as a full disk would): exit 2, one line."""
    tmpdir = work / "tmp"
    tmpdir.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "tfpolicy.rewrite", "--map", "map.json", str(model), "out"], cwd=work,
        env=_env(tmpdir), capture_output=True, text=True, timeout=300, preexec_fn=_limit_file_size(300_000),
    )
    line = _error_line(result)
    assert line.startswith("tfpolicy: error: cannot write output 'out': File too large"), line
    assert leftovers(work) == [] and not (work / "out").exists()


@pytest.fixture()
def immutable(tmp_path):
    """A directory nobody, root included, may create entries in (``chattr +i``), where the filesystem allows it."""
    path = tmp_path / "locked"
    path.mkdir()
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    yield path
    subprocess.run(["chattr", "-i", str(path)], check=True)


def test_an_unwritable_output_location_is_refused_before_any_work(work, model, immutable):
    before = _child_cpu_seconds()
    result = run_cli(["--map", "map.json", str(model), str(immutable / "out")], cwd=work)
    line = _error_line(result)
    assert f"'{immutable}' is not writable" in line, line
    assert _child_cpu_seconds() - before < 1.0  # before TensorFlow is imported
    result = run_cli(["--map", "map.json", "--serving_base", str(immutable / "base"), str(model)], cwd=work)
    assert "is not writable" in _error_line(result)


# ------------------------------------------------------------------ permissions


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o027, 0o750)])
def test_outputs_get_the_mode_mkdir_would_give_them(work, model, umask, mode):
    env = _env(work)
    for args, written in ((["out"], work / "out"), (["--serving_base", "base"], work / "base" / "1")):
        positional = [str(model), *args] if args == ["out"] else [*args, str(model)]
        result = subprocess.run(
            [sys.executable, "-m", "tfpolicy.rewrite", "--map", "map.json", *positional], cwd=work, env=env,
            capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(umask),
        )
        assert result.returncode == 0, describe(result)
        assert written.stat().st_mode & 0o777 == mode, oct(written.stat().st_mode)


# ------------------------------------------------------------------ paths


def _child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_a_missing_input_is_answered_before_tensorflow_starts(work):
    """Under a second of the process's CPU time (wall time is the machine's load's): TensorFlow takes three."""
    before = _child_cpu_seconds()
    result = run_cli(["--map", "map.json", "no_such_model", "out"], cwd=work)
    spent = _child_cpu_seconds() - before
    assert _error_line(result) == "tfpolicy: error: input SavedModel 'no_such_model' does not exist"
    assert spent < 1.0, spent


@pytest.mark.parametrize("case", ["dangling_symlink", "parent_is_a_file", "current_directory", "report_is_the_output",
                                  "report_inside_the_input", "newline_in_path"])
def test_awkward_paths_are_refused_before_any_work(work, model, case):
    args = {
        "dangling_symlink": ["out_link"],
        "parent_is_a_file": ["a_file/out"],
        "current_directory": ["--overwrite", "."],
        "report_is_the_output": ["--report", "out", "out"],
        "report_inside_the_input": ["--report", str(model / "report.json"), "out"],
        "newline_in_path": ["bad\nname/out"],
    }[case]
    expected = {
        "dangling_symlink": "is a symbolic link to nothing",
        "parent_is_a_file": "is a file, not a directory",
        "current_directory": "is (or holds) the current directory",
        "report_is_the_output": "it is (or lies inside) the output 'out'",
        "report_inside_the_input": "lies inside the input SavedModel",
        "newline_in_path": "bad\\nname' does not exist",
    }[case]
    (work / "out_link").symlink_to(work / "nowhere")
    (work / "a_file").write_text("")
    cwd = work / "here"
    cwd.mkdir()
    before = tree_digest(model), sorted(os.listdir(work))
    flags, positional = args[:-1], args[-1]
    result = run_cli(["--map", str(work / "map.json"), *flags, str(model), positional],
                     cwd=cwd if case == "current_directory" else work)
    assert expected in _error_line(result)
    assert (tree_digest(model), sorted(os.listdir(work))) == before


def test_explain_into_a_closed_pipe_ends_quietly(work, model):
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "tfpolicy.rewrite", "--map", "map.json", "--explain", str(model)],
            cwd=work, env=_env(work), stdout=write, stderr=subprocess.PIPE, text=True, timeout=300,
        )
    finally:
        os.close(write)
    assert result.returncode == 128 + signal.SIGPIPE and result.stderr == "", describe(result)


# ------------------------------------------------------------------ damaged inputs


@pytest.mark.parametrize("damage", ["no_variables_index", "no_variables_folder", "garbage_fingerprint"])
def test_a_damaged_input_is_named_in_one_line(work, model, damage):
    copy = work / "damaged"
    shutil.copytree(model, copy)
    if damage == "no_variables_index":
        (copy / "variables" / "variables.index").unlink()
    elif damage == "no_variables_folder":
        shutil.rmtree(copy / "variables")
    else:
        (copy / "fingerprint.pb").write_bytes(b"garbage")
    result = run_cli(["--map", "map.json", "--quiet", str(copy), "out"], cwd=work)
    if damage == "garbage_fingerprint":  # TensorFlow ignores it; so do we, with one warning and no traceback
        assert result.returncode == 0, describe(result)
        assert result.stderr.strip() == f"tfpolicy: warning: {copy}/fingerprint.pb is unreadable; ignored (the output gets its own)"
        tf.saved_model.load(str(work / "out"))
        return
    assert "variables/variables.index is missing" in _error_line(result)
    assert leftovers(work) == [] and not (work / "out").exists()


@pytest.fixture(scope="session")
def vocabulary_model(tmp_path_factory) -> pathlib.Path:
    """A tf.Module whose lookup table reads a vocabulary asset."""
    root = tmp_path_factory.mktemp("vocabulary")
    vocabulary = root / "vocab.txt"
    vocabulary.write_text("a\nb\nc\n")

    class Lookup(tf.Module):
        def __init__(self) -> None:
            initializer = tf.lookup.TextFileInitializer(str(vocabulary), tf.string, 0, tf.int64, -1, delimiter=" ")
            self.table = tf.lookup.StaticHashTable(initializer, -1)
            self.embedding = tf.Variable(tf.ones([3, 4]))

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
        def serve(self, words):
            return {"y": tf.gather(self.embedding, tf.maximum(self.table.lookup(words), 0))}

    module = Lookup()
    tf.saved_model.save(module, str(root / "model"), signatures={"serving_default": module.serve})
    return root / "model"


@pytest.mark.parametrize("damage, expected", [("missing", "is missing"), ("emptied", "is empty")])
def test_a_missing_or_emptied_asset_is_named(work, vocabulary_model, damage, expected):
    copy = work / "damaged"
    shutil.copytree(vocabulary_model, copy)
    asset = copy / "assets" / "vocab.txt"
    asset.unlink() if damage == "missing" else asset.write_text("")
    line = _error_line(run_cli(["--map", "map.json", str(copy), "out"], cwd=work))
    assert f"its asset file '{asset}' {expected}" in line, line


# ------------------------------------------------------------------ data and maps


def test_non_finite_calibration_data_is_a_warning_and_an_error_under_strict(work, model):
    (work / "f8.json").write_text(json.dumps({"default_policy": "float32", "policy_map": {"wide": "float8_from_float32"}}))
    x = np.random.default_rng(0).normal(size=(64, 256)).astype(np.float32)
    x[3, 7], x[40, 1] = np.nan, np.inf
    (input_name,) = tf.saved_model.load(str(model)).signatures["serving_default"].structured_input_signature[1]
    np.savez(work / "calibration.npz", **{input_name: x})
    args = ["--map", "f8.json", "--calibration_data", "calibration.npz", str(model), "out"]
    result = run_cli(args, cwd=work)
    assert result.returncode == 0, describe(result)
    warning = next(line for line in result.stderr.splitlines() if "non-finite" in line)
    assert f"2 non-finite value(s) (NaN or Inf): 2 in input '{input_name}' (batches 1, 2)" in warning, warning
    line = _error_line(run_cli(["--strict", *args[:-1], "out_strict"], cwd=work))
    assert "non-finite" in line and line.endswith("(--strict)") and not (work / "out_strict").exists()


def test_a_backtracking_map_key_is_an_error_not_a_hang(work, model):
    (work / "hostile.json").write_text(json.dumps({"default_policy": "float32", "policy_map": {"(\\w+)+x": "float16"}}))
    started = time.monotonic()
    line = _error_line(run_cli(["--map", "hostile.json", str(model), "out"], cwd=work))
    assert "backtracks catastrophically" in line and time.monotonic() - started < 60, line

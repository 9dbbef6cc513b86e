"""Helpers the serving, validation and serving-check tests share: run the CLI, digest a tree.

Like ``test_cli.py``'s own: the real CLI in a subprocess (``sys.executable -m
tfpolicy.rewrite``, ``PYTHONPATH`` = the repository root, or the runfiles root
under Bazel), and a ``{path: sha256}`` digest that proves nothing was written.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 300


def run_cli(args: list[str], cwd: pathlib.Path, module: str = "tfpolicy.rewrite") -> subprocess.CompletedProcess:
    """Run ``python -m <module> *args`` (the rewrite command by default) as a user would."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # conftest sets it; a user's shell does not
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
    )


def tree_digest(root: pathlib.Path) -> dict[str, str]:
    """``{relative path: sha256 of the file, or '<dir>'}`` for everything under root."""
    if not root.exists():
        return {}
    return {
        path.relative_to(root).as_posix(): "<dir>" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
    }


def leftovers(directory: pathlib.Path) -> list[str]:
    """Temporary directories an atomic save may leave beside its output."""
    return sorted(p.name for p in directory.iterdir() if ".tfpolicy-" in p.name)


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stderr ---\n{result.stderr}\n--- stdout ---\n{result.stdout}"

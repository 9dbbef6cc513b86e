"""Silence what TensorFlow writes to stderr while it starts.

TensorFlow 2.21 writes its start-up lines (oneDNN, CUDA, CPU features) from
C++ before its logging honours ``TF_CPP_MIN_LOG_LEVEL``; the CLI and the Bazel
check import it inside :func:`muted_stderr` so that a user error stays the
only line on stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator


@contextlib.contextmanager
def muted_stderr() -> Iterator[None]:
    """File descriptor 2 points at /dev/null inside the block (C++ writes included)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)

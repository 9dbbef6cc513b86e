"""The paths a rewrite reads and writes, checked before any work starts.

Each check raises a :class:`~tfpolicy.errors.TfPolicyError` whose one line
names the path and what to do. No TensorFlow here: the command line runs these
before importing it, so a mistyped path is answered at once.
"""

from __future__ import annotations

import os
import pathlib
from typing import Optional

from tfpolicy.errors import OutputError, SavedModelError


def check_input_dir(path: pathlib.Path) -> None:
    """``path`` is a SavedModel directory (it holds ``saved_model.pb``)."""
    path = pathlib.Path(path)
    if not path.exists():
        raise SavedModelError(f"input SavedModel '{path}' does not exist")
    if not path.is_dir():
        raise SavedModelError(f"input '{path}' is not a directory")
    if not (path / "saved_model.pb").exists() and not (path / "saved_model.pbtxt").exists():
        raise SavedModelError(f"input '{path}' is not a SavedModel: it has no saved_model.pb")


def check_output_dir(input_dir: pathlib.Path, output_dir: pathlib.Path, overwrite: bool) -> None:
    """``output_dir`` can be written as a new directory (or replace one, with ``overwrite``) without touching the input."""
    input_dir, output_dir = pathlib.Path(input_dir), pathlib.Path(output_dir)
    if os.path.islink(output_dir) and not output_dir.exists():
        raise OutputError(f"output '{output_dir}' is a symbolic link to nothing ('{os.readlink(output_dir)}');"
                          " remove the link or choose another path")
    src, dst = input_dir.resolve(), output_dir.resolve()
    if dst == src:
        raise OutputError(f"output '{output_dir}' is the input SavedModel; choose another directory")
    if src in dst.parents:
        raise OutputError(f"output '{output_dir}' lies inside the input SavedModel '{input_dir}'")
    if dst in src.parents:
        raise OutputError(f"output '{output_dir}' contains the input SavedModel '{input_dir}'")
    if output_dir.exists() and not overwrite:
        raise OutputError(f"output '{output_dir}' already exists; pass --overwrite to replace it")
    if output_dir.exists():
        if not output_dir.is_dir():
            raise OutputError(f"output '{output_dir}' is a file, not a SavedModel directory; --overwrite replaces only"
                              " a directory: remove it or choose another path")
        cwd = pathlib.Path.cwd().resolve()
        if dst == cwd or dst in cwd.parents:
            raise OutputError(f"output '{output_dir}' is (or holds) the current directory, which cannot be replaced;"
                              " run from elsewhere or choose another path")
    check_writable_parent(dst.parent, "output")


def check_writable_parent(parent: pathlib.Path, what: str) -> None:
    """``parent`` is an existing directory this process may create entries in."""
    problem = _parent_problem(parent)
    if problem is not None:
        raise OutputError(f"cannot write the {what}: {problem}")


def _parent_problem(parent: pathlib.Path) -> Optional[str]:
    if not parent.exists():
        return f"directory '{parent}' does not exist"
    if not parent.is_dir():
        return f"'{parent}' is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory '{parent}' is not writable (read-only, or not yours); choose another location"
    return None


def check_report_path(path: Optional[str], input_dir: Optional[pathlib.Path],
                      outputs: tuple[pathlib.Path, ...] = (), what: str = "report") -> None:
    """A report file goes outside the input SavedModel and outside (and not onto) every output."""
    if not path:
        return
    report = pathlib.Path(path).resolve()
    if input_dir is not None:
        src = pathlib.Path(input_dir).resolve()
        if report == src or src in report.parents:
            raise OutputError(f"cannot write {what} '{path}': it lies inside the input SavedModel '{input_dir}',"
                              " which is never modified; write it elsewhere")
    for output in outputs:
        dst = pathlib.Path(output).resolve()
        if report == dst or dst in report.parents:
            raise OutputError(f"cannot write {what} '{path}': it is (or lies inside) the output '{output}';"
                              " write it beside the output instead")
    problem = "it is a directory" if report.is_dir() else _parent_problem(report.parent)
    if problem is not None:
        raise OutputError(f"cannot write {what} '{path}': {problem}")


def directory_bytes(path: pathlib.Path) -> int:
    """Bytes of every file under ``path`` (a SavedModel's size, or its ``variables/``)."""
    return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())

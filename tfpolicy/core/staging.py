"""Staging directories: where an output is written before it is renamed into place.

An output is written into a hidden directory beside it and renamed into place
when complete, so a reader never sees half a model::

    models/
        .net_bf16.tfpolicy-tmp-4711@1a2b3c4d-k2j9/   <- staging: pid 4711 on host 1a2b3c4d
        net_bf16/                                    <- renamed into place when complete

The name says whose it is: :func:`remove_stale` removes the staging
directories of runs that died without cleaning up (SIGKILL, a power cut) when
their process is gone from this host, or when they are a day old; a previous
output set aside while ``--overwrite`` replaces it is put back if the run died
before the new one took its place. :func:`publish` renames with SIGINT and
SIGTERM held back, so an interrupted replace never loses both copies.
:func:`output_mode` gives the output the permissions a plain ``mkdir`` would
(``mkdtemp`` makes them 0700, which a server running as another user cannot
read). No TensorFlow here: the command line calls these before importing it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import pathlib
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Iterator, Optional

from tfpolicy.errors import OutputError

logger = logging.getLogger(__name__)

STALE_SECONDS = 24 * 3600
"""A staging directory this old is an abandoned one, whatever host made it."""
_INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
published: list[pathlib.Path] = []
"""Every directory :func:`publish` renamed into place in this process (the CLI's account of an interrupt)."""
_made: set[tuple[pathlib.Path, str, str]] = set()
"""Where this process made staging directories: ``(parent, kind, name)``, for :func:`discard_all_mine`."""


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def owner_tag() -> str:
    """``<pid>@<host digest>``: which process on which host a staging directory belongs to."""
    return f"{os.getpid()}@{_host()}"


def output_mode() -> int:
    """The mode ``mkdir`` gives a directory under this process's umask (0755 under umask 022)."""
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o777 & ~mask


_umask_lock = threading.Lock()


def make(parent: pathlib.Path, kind: str, name: str = "") -> pathlib.Path:
    """A new staging directory ``.<name>.tfpolicy-<kind>-<owner>-XXXX`` in ``parent`` (stale ones removed first)."""
    remove_stale(parent, kind, name)
    if kind == "tmp":
        remove_stale(parent, "old", name)
    _made.add((parent, kind, name))  # before mkdtemp: an interrupt may come before it returns
    return pathlib.Path(tempfile.mkdtemp(prefix=f"{_prefix(kind, name)}{owner_tag()}-", dir=parent))


def _prefix(kind: str, name: str) -> str:
    return f".{name}.tfpolicy-{kind}-" if name else f".tfpolicy-{kind}-"


def _is_abandoned(path: pathlib.Path, prefix: str) -> bool:
    """Whether the run that made ``path`` is gone: its pid is not alive on this host, or the directory is old."""
    rest = path.name[len(prefix):]
    owner = rest.split("-", 1)[0] if "@" in rest.split("-", 1)[0] else ""
    try:
        age = time.time() - path.lstat().st_mtime
    except OSError:
        return False
    if age > STALE_SECONDS:
        return True
    pid, _, host = owner.partition("@")
    if not pid.isdigit() or host != _host():
        return False  # another host's, or an older tfpolicy's: only age tells
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def remove_stale(parent: pathlib.Path, kind: str, name: str = "") -> list[pathlib.Path]:
    """Remove this output's abandoned staging directories in ``parent``; returns what was removed or restored.

    ``kind`` is ``tmp`` (a rewrite's copy), ``old`` (a replaced output set
    aside) or ``export`` (a serving version). An abandoned ``old`` whose output
    no longer exists is put back in place instead: its run died between
    setting it aside and renaming the new one in.
    """
    prefix = _prefix(kind, name)
    handled = []
    try:
        entries = [p for p in parent.iterdir() if p.name.startswith(prefix) and p.is_dir() and not p.is_symlink()]
    except OSError:
        return handled
    for path in entries:
        if not _is_abandoned(path, prefix):
            continue
        output = parent / name if name else None
        if kind == "old" and output is not None and not os.path.lexists(output) and (path / "old").is_dir():
            os.rename(path / "old", output)
            logger.warning("restored %s from an interrupted --overwrite (%s)", output, path.name)
        shutil.rmtree(path, ignore_errors=True)
        handled.append(path)
        logger.info("removed %s, left by an interrupted run", path)
    return handled


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends, then act: a rename pair or a clean-up is not cut short.

    The signals' handlers are swapped for one that only records, and the
    first recorded signal is raised again once the handlers are back. Python
    runs signal handlers in the main thread whichever thread the kernel chose,
    so masking the signal in this thread alone would not hold it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {each: signal.getsignal(each) for each in _INTERRUPTS}
    for each in _INTERRUPTS:
        signal.signal(each, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)
        if arrived:
            signal.raise_signal(arrived[0])


def publish(staged: pathlib.Path, output: pathlib.Path, replace: bool) -> None:
    """Rename ``staged`` to ``output`` (set aside and remove an existing ``output`` when ``replace``).

    The staged directory gets :func:`output_mode` first. An existing output
    is refused unless ``replace``: FileExistsError.
    """
    os.chmod(staged, output_mode())
    parent = output.parent
    if not os.path.lexists(output):
        with interrupts_held():
            os.rename(staged, output)
            published.append(output)
        return
    if not replace:
        raise FileExistsError(errno.EEXIST, "exists", str(output))
    trash = make(parent, "old", output.name)
    with interrupts_held():
        os.rename(output, trash / "old")
        os.rename(staged, output)
        published.append(output)
    shutil.rmtree(trash, ignore_errors=True)


def discard_mine(parent: pathlib.Path, kind: str, name: str = "") -> None:
    """Remove this process's staging directories of ``kind`` in ``parent``.

    Also the one an interrupt made before its path was returned (between
    ``mkdtemp`` and the caller's assignment): found by its owner tag.
    """
    prefix = f"{_prefix(kind, name)}{owner_tag()}-"
    try:
        entries = [p for p in parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return
    for path in entries:
        shutil.rmtree(path, ignore_errors=True)


def discard_all_mine() -> None:
    """Remove every staging directory this process made and did not publish (the command's last word on an interrupt).

    The clean-up of each writer already does this; an interrupt that Python
    delivers inside that clean-up (a signal whose handler runs late, after the
    C++ it arrived in returns) would cut it short, so the command sweeps again.
    """
    for parent, kind, name in sorted(_made, key=str):
        discard_mine(parent, kind, name)


_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.EIO)
_DISK_HINTS = {
    errno.ENOSPC: "free some space or write elsewhere",
    errno.EDQUOT: "free some of your quota or write elsewhere",
    errno.EFBIG: "a file size limit (ulimit -f) stops it; raise the limit or write elsewhere",
    errno.EROFS: "choose a location on a writable filesystem",
    errno.EACCES: "choose a location you may write to",
    errno.EPERM: "choose a location you may write to",
    errno.EIO: "the device reported an I/O error; check the disk",
}


def write_failure(exc: BaseException, output: pathlib.Path) -> Optional[str]:
    """A one-line account of ``exc`` when it is the disk refusing a write (full, read-only, denied), else None.

    Python raises OSError with an errno; TensorFlow's file writers raise its own
    errors whose message holds the system's text (``No space left on device``).
    """
    number = exc.errno if isinstance(exc, OSError) else None
    if number not in _DISK_ERRNOS:
        text = str(exc)
        number = next((n for n in _DISK_ERRNOS if os.strerror(n) in text), None)
        if number is None:
            return None
    where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
    return f"cannot write output '{output}': {os.strerror(number)}{where}; {_DISK_HINTS[number]} (nothing was written)"


def raise_if_write_failure(exc: BaseException, output: pathlib.Path) -> None:
    """Raise :class:`~tfpolicy.errors.OutputError` (from ``exc``) when ``exc`` is the disk refusing a write.

    Writers call it in their ``except`` and re-raise ``exc`` when it returns: anything else is not the disk's.
    """
    line = write_failure(exc, output)
    if line is not None:
        raise OutputError(line) from exc

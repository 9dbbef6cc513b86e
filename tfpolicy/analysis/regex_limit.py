"""A time limit on matching the policy map's regex keys.

A key such as ``(a+)+`` backtracks catastrophically against a layer path like
``aaaa...ab``: ``re.fullmatch`` would run for ever. Python's regex engine
checks for signals while it matches, so a timer signal (``SIGALRM``) can stop
it; :func:`time_limit` arms one around a match and turns its expiry into
:class:`RegexTimeout`, which :mod:`tfpolicy.analysis.policy_map` reports as a
map error naming the key. Signals reach only the main thread: elsewhere (a
server calling the API from a worker thread), or while the caller's own
``SIGALRM`` timer runs, matching is not limited.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

SECONDS = 2.0
"""A real key matches a layer path in microseconds; this is far beyond any of them."""


class RegexTimeout(Exception):
    """A regex match ran past its time limit."""


def _expired(signum, frame) -> None:  # noqa: ANN001  (signal handler protocol)
    raise RegexTimeout()


@contextlib.contextmanager
def time_limit(seconds: float = SECONDS) -> Iterator[None]:
    """Raise :class:`RegexTimeout` in the block once ``seconds`` have passed (main thread only)."""
    usable = (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
              and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0))
    if not usable:
        yield
        return
    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

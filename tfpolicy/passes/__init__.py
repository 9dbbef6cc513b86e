"""Rewrite passes and the manager that runs them in order.

Every pass is one module with one entry point ``run(context) -> PassResult``;
the manager wraps a failure with the pass's name (:class:`~tfpolicy.errors.PassError`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

from tfpolicy.errors import PassError, TfPolicyError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PassResult:
    modified: bool
    notes: list[str] = dataclasses.field(default_factory=list)


def run_passes(passes: Sequence[tuple[str, Callable[[], PassResult]]]) -> list[PassResult]:
    results = []
    for name, run in passes:
        try:
            result = run()
        except TfPolicyError:
            raise
        except Exception as exc:  # a bug in a pass: keep the cause, name the pass
            raise PassError(name, f"{type(exc).__name__}: {exc}") from exc
        logger.debug("pass %s: modified=%s", name, result.modified)
        results.append(result)
    return results

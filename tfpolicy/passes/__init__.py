"""Rewrite passes and the manager that runs them in order.

Every pass is an object built over one graph and its context (signature,
layer index, plan, ...) with one entry point ``run() -> PassResult``:
whether it modified the graph, its statistics (which the report is built
from) and notes. The manager runs them in order, checks each graph a pass
modified with :meth:`~tfpolicy.core.graph.Graph.verify`, and wraps a failure
or a broken graph with the pass's name (:class:`~tfpolicy.errors.PassError`).

    float_precision   retype each layer's ops to its compute dtype, with Casts
    quantize          int8 / int4 / float8 at the quantization sites
    calibration       float8's delayed-scaling update, for tfpolicy.calibrate
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tfpolicy.errors import PassError, TfPolicyError

if TYPE_CHECKING:
    from tfpolicy.core.graph import Graph

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PassResult:
    """What one pass did to one graph: ``stats`` is the pass's own record (counts, outputs)."""

    modified: bool
    stats: Any = None
    notes: list[str] = dataclasses.field(default_factory=list)


def run_passes(passes: Sequence[tuple[str, "Graph", Callable[[], PassResult]]]) -> list[PassResult]:
    """Run ``(name, graph, run)`` steps in order; verify each graph a pass modified.

    A pass that raises, or leaves its graph broken (:meth:`Graph.verify`), is a
    :class:`PassError` naming the pass and the first problem.
    """
    results = []
    for name, graph, run in passes:
        try:
            result = run()
        except TfPolicyError:
            raise
        except Exception as exc:  # a bug in a pass: keep the cause, name the pass
            raise PassError(name, f"{type(exc).__name__}: {exc}") from exc
        if result.modified:
            problems = graph.verify()
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise PassError(name, f"left graph '{graph.name}' broken: {problems[0]}{more}")
        logger.debug("pass %s: modified=%s", name, result.modified)
        results.append(result)
    return results

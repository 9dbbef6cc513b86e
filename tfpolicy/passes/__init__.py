"""Rewrite passes and the manager that runs them in order.

A pass is an object built over one graph and its context (signature, layer
index, plan, ...) that satisfies :class:`Pass`: a ``name`` unique in its
pipeline (``quantize[serving_default:<graph>]``), the ``graph`` it edits, and
one entry point ``run() -> PassResult``, which says whether the graph changed
and carries the pass's own typed statistics (the report is built from them).
:class:`PassManager` runs passes in order, checks each graph a pass modified
with :meth:`~tfpolicy.core.graph.Graph.verify`, wraps a failure or a broken
graph with the pass's name (:class:`~tfpolicy.errors.PassError`), and returns
the results by pass name, so adding a pass moves nothing::

    results = PassManager([float_pass, quantize_pass, calibration_pass]).run()
    results[quantize_pass.name].stats      # a QuantizeResult

    float_precision   retype each layer's ops to its compute dtype, with Casts
    float_rules       which ops stay float32 (islands) and how constants convert
    casts             one Cast per tensor and dtype; constants converted, not cast
    wide_kernels      bfloat16 ops with slow CPU kernels (Erfc, Tanh) computed in
                      float32 between Casts where the bits agree (not under XLA)
    quantize          int8 / int4 / float8 at the quantization sites
    int4              int4 unpacking (table lookups) and dequantization
    float8_rounding   rounding to float8 in float32 bit arithmetic (off the GPU)
    quant_variables   the variables quantization adds, and their values
    builder           node helpers and reads of new variables, shared through the graph
    function_args     new variables passed down into While/If bodies; a maximum carried out
    calibration       float8's delayed-scaling update, for tfpolicy.calibrate,
                      from the taps the quantize pass declares (CalibrationTaps)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Generic, Mapping, Protocol, Sequence, TypeVar

from tfpolicy.errors import PassError, TfPolicyError

if TYPE_CHECKING:
    from tfpolicy.core.graph import Graph

logger = logging.getLogger(__name__)

Stats = TypeVar("Stats", covariant=True)


@dataclasses.dataclass(frozen=True)
class PassResult(Generic[Stats]):
    """What one pass did to one graph: whether it changed it, and the pass's own record (counts, outputs)."""

    modified: bool
    stats: Stats


class Pass(Protocol[Stats]):
    """One rewrite step over one graph."""

    @property
    def name(self) -> str:
        """Unique within a pipeline: the pass's kind and the signature and graph it edits."""
        ...

    @property
    def graph(self) -> "Graph":
        ...

    def run(self) -> PassResult[Stats]:
        ...


class PassManager:
    """Run passes in order; each graph a pass modified is verified; results by pass name."""

    def __init__(self, passes: Sequence[Pass]) -> None:
        names = [p.name for p in passes]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"pass names must be unique in a pipeline: {repeated}")
        self.passes = list(passes)

    def run(self) -> Mapping[str, PassResult]:
        """Run every pass; a pass that raises or leaves its graph broken is a :class:`PassError` naming it."""
        results: dict[str, PassResult] = {}
        for each in self.passes:
            try:
                result = each.run()
            except TfPolicyError:
                raise
            except Exception as exc:  # a bug in a pass: keep the cause, name the pass
                raise PassError(each.name, f"{type(exc).__name__}: {exc}") from exc
            if result.modified:
                problems = each.graph.verify()
                if problems:
                    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                    raise PassError(each.name, f"left graph '{each.graph.name}' broken: {problems[0]}{more}")
            logger.debug("pass %s: modified=%s", each.name, result.modified)
            results[each.name] = result
        return results

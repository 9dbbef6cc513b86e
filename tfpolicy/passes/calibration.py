"""float8 calibration: the ops of the output's ``tfpolicy.calibrate`` function.

The rewritten model carries ``tfpolicy.calibrate(**inputs)``: the serving
graph plus, for each float8 layer, Keras's delayed-scaling update from the
batch's input amax (``compute_float8_amax_history`` then
``compute_float8_scale`` over the history)::

    x (a float8 layer's input) -> Abs -> Max -> Cast(f32) -> [Maximum over call sites] = amax
    history' = TensorScatterUpdate(Roll(history, -1), [[0]], amax)      -> AssignVariableOp
    scale'   = 1 / where(finite(m) & m > 0, 448 / m, 1 / scale), m = Max(history')
                                                                           -> AssignVariableOp
    outputs: {"<layer>/inputs_scale": scale'}

Each assignment waits for the forward pass's read of the same variable.
``tfpolicy.rewrite`` feeds it the calibration batches (see :mod:`tfpolicy.core.inputs`).
The pass runs after the quantize pass, on the same graph (where its builder
finds the variable reads the quantize pass added), from the
:class:`~tfpolicy.passes.quantize.CalibrationTaps` the quantize pass filled.
"""

from __future__ import annotations

import logging
import dataclasses
from typing import Iterable, Optional, Sequence

from tfpolicy.core.assemble import NewVariable
from tfpolicy.core.graph import Graph
from tfpolicy.core.tf_names import TensorRef
from tfpolicy.core.tf_names import bool_attr as _bool
from tfpolicy.core.tf_names import type_attr as _type
from tfpolicy.passes import PassResult
from tfpolicy.passes.builder import CAPTURE_SCOPE, GraphBuilder
from tfpolicy.passes.function_args import FunctionArgs
from tfpolicy.passes.quant_variables import F32, FLOAT8_E4M3_MAX, INT32

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CalibrationResult:
    """The calibrate function's outputs (the new input scale per group), and the placeholders the pass added.

    The serving function never fetches the outputs, so pruning leaves it unchanged.
    """

    outputs: dict[str, TensorRef]
    new_captures: dict[str, str]


class CalibrationPass:
    """Add ``tfpolicy.calibrate``'s update ops to ``graph`` for the float8 inputs in ``taps``."""

    def __init__(self, signature: str, graph: Graph, variables: dict[str, NewVariable], taps: Iterable,
                 function_args: Optional[FunctionArgs] = None) -> None:
        self.name = f"calibration[{signature}]"
        self.graph, self.taps = graph, taps
        self.builder = GraphBuilder(graph, variables)
        self.function_args = function_args

    def run(self) -> PassResult[CalibrationResult]:
        outputs = add_calibration_outputs(self.builder, list(self.taps), self.function_args)
        return PassResult(bool(outputs), stats=CalibrationResult(outputs, dict(self.builder.new_captures)))


def add_calibration_outputs(qpass: GraphBuilder, taps: Sequence,
                            function_args: Optional[FunctionArgs] = None) -> dict[str, TensorRef]:
    """Add the update ops for every float8 group tapped in ``qpass``'s graph; the new scales by name.

    A tap inside a While/If body is measured in a copy of its calling chain
    and comes out as its maximum over the loop's iterations
    (:meth:`~tfpolicy.passes.function_args.FunctionArgs.lift_max`): a layer
    called in a loop rolls one history entry per batch, as one called at
    several places does.
    """
    by_group: dict[str, list] = {}
    for tap in taps:
        by_group.setdefault(tap.group.prefix, []).append(tap)
    outputs = {}
    for prefix in sorted(by_group):
        taps = by_group[prefix]
        group = taps[0].group
        base = f"{CAPTURE_SCOPE}/calibrate/{prefix}"
        amax = None
        for i, tap in enumerate(taps):
            if tap.graph is qpass.graph:
                one = _tensor_amax(qpass, tap.tensor, f"{base}/amax_{i}")
            else:
                def measure(where: Graph, tap=tap, i=i) -> TensorRef:
                    return _tensor_amax(GraphBuilder(where, qpass.variables), tap.tensor, f"{base}/amax_{i}")
                one = function_args.lift_max(tap.graph, measure)
            amax = one if amax is None else qpass.op("Maximum", f"{base}/amax_max_{i}", [amax, one], T=_type(F32))
        outputs[group.name("inputs_scale")] = _update(qpass, group.name("inputs_amax_history"),
                                                      group.name("inputs_scale"), amax, base)
    return outputs


def _tensor_amax(qpass: GraphBuilder, x: TensorRef, base: str) -> TensorRef:
    dtype = qpass.graph.tensor_dtype(x)
    T = _type(dtype)
    flat = qpass.op("Reshape", f"{base}/flatten", [qpass.op("Abs", f"{base}/abs", [x], T=T),
                                                   qpass.const(f"{base}/minus_one", [-1], INT32)],
                    T=T, Tshape=_type(INT32))
    amax = qpass.op("Max", f"{base}/max", [flat, qpass.const(f"{base}/axis", 0, INT32)],
                    T=T, Tidx=_type(INT32), keep_dims=_bool(False))
    return qpass.cast(amax, F32, f"{base}/to_float32")


def _update(qpass: GraphBuilder, history_name: str, scale_name: str, amax: TensorRef, base: str) -> TensorRef:
    f32 = _type(F32)
    history = qpass.read(history_name)
    rolled = qpass.op("Roll", f"{base}/roll", [history, qpass.const(f"{base}/shift", -1, INT32),
                                               qpass.const(f"{base}/roll_axis", 0, INT32)],
                      T=f32, Tshift=_type(INT32), Taxis=_type(INT32))
    slot = qpass.op("Reshape", f"{base}/amax_1d", [amax, qpass.const(f"{base}/one", [1], INT32)], T=f32, Tshape=_type(INT32))
    new_history = qpass.op("TensorScatterUpdate", f"{base}/history",
                           [rolled, qpass.const(f"{base}/slot", [[0]], INT32), slot], T=f32, Tindices=_type(INT32))
    assign_history = qpass.graph.add_node(
        "AssignVariableOp", f"{base}/assign_history",
        [qpass.handle(history_name), str(new_history), f"^{history.node}"],
        {"dtype": f32, "validate_shape": _bool(False)},
    )
    history_max = qpass.op("Max", f"{base}/history_max", [new_history, qpass.const(f"{base}/axis", 0, INT32)],
                           T=f32, Tidx=_type(INT32), keep_dims=_bool(False))
    old = qpass.read(scale_name)
    inverse_old = qpass.op("Reciprocal", f"{base}/inverse_old_scale", [old], T=f32)
    factor = qpass.op("RealDiv", f"{base}/factor", [qpass.const(f"{base}/dtype_max", FLOAT8_E4M3_MAX, F32), history_max], T=f32)
    positive = qpass.op("Greater", f"{base}/positive", [history_max, qpass.const(f"{base}/zero", 0.0, F32)], T=f32)
    finite = qpass.op("IsFinite", f"{base}/finite", [history_max], T=f32)
    factor = qpass.op("SelectV2", f"{base}/if_positive", [positive, factor, inverse_old], T=f32)
    factor = qpass.op("SelectV2", f"{base}/if_finite", [finite, factor, inverse_old], T=f32)
    new_scale = qpass.op("Reciprocal", f"{base}/scale", [factor], T=f32)
    handle = qpass.handle(scale_name)
    readers = sorted({old.node, *(consumer for consumer, _ in qpass.graph.uses(TensorRef(handle)))})
    assign_scale = qpass.graph.add_node(  # after every read, a loop's that reads it in its body too
        "AssignVariableOp", f"{base}/assign_scale",
        [handle, str(new_scale), *(f"^{name}" for name in readers)],
        {"dtype": f32, "validate_shape": _bool(False)},
    )
    after = qpass.graph.add_node(
        "ReadVariableOp", f"{base}/new_scale",
        [qpass.handle(scale_name), f"^{assign_scale.name}", f"^{assign_history.name}"], {"dtype": f32})
    return TensorRef(after.name)

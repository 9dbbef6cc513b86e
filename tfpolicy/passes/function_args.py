"""Passing a value into the functions a signature calls, and a maximum back out.

**Down** (:meth:`FunctionArgs.handle`): a new variable read inside a While/If
body (a float8 layer's input scale) needs its handle there. It becomes a new
argument of the function, passed by its one caller, whose own handle comes the
same way from further up, so the top-level graph's resource placeholder
reaches it::

    Placeholder tfpolicy/head/inputs_scale -> While(..., +handle)
        body(..., tfpolicy_head_inputs_scale) -> ReadVariableOp -> the layer's ops
        body returns the handle unchanged (a loop variable); cond takes it too

An If passes it to both branches, a call to its function.

**Up** (:meth:`FunctionArgs.lift_max`), for calibration: a float32 scalar
computed in a body, as its maximum over every run of the body in one call of
the signature. The calling chain is copied for the calibrate function only,
so the serving functions stay as they are: the top-level graph gets a second
While whose body (a copy) carries the running maximum as a loop variable
(starting at 0); an If's copy returns it from the branch that computes it and
0 from the other. The serving function never fetches the copies, so pruning
drops them from it.
"""

from __future__ import annotations

import re
from typing import Callable

from tfpolicy.analysis.calls import IF_OPS, WHILE_OPS, CallChains
import numpy as np

from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.savedmodel_io import SignatureProgram
from tfpolicy.core.tf_names import DT_FLOAT, DT_RESOURCE, TensorRef, copy_attr, int_attr, renamed_func_attr, type_attr
from tfpolicy.passes.builder import CAPTURE_SCOPE


class FunctionArgs:
    """Threads values through one signature's calls (see the module doc)."""

    def __init__(self, program: SignatureProgram, chains: CallChains) -> None:
        self.program, self.chains = program, chains
        self.top = program.graph
        self.graphs = {g.name: g for g in program.all_graphs()}
        self._handles: dict[tuple[str, str], str] = {}  # (graph, placeholder) -> node in that graph
        self._copies = 0

    # -- down ------------------------------------------------------------------

    def handle(self, graph: Graph, placeholder: str, make_placeholder: Callable[[], str]) -> str:
        """The node in ``graph`` that holds top-level ``placeholder``'s handle (made there by ``make_placeholder``)."""
        key = (graph.name, placeholder)
        if key not in self._handles:
            if not graph.is_function:
                self._handles[key] = make_placeholder()
            else:
                problem = self.chains.problem(graph.name)
                if problem is not None:
                    raise ValueError(f"cannot pass '{placeholder}' into '{graph.name}': {problem}")
                caller = self.chains.caller(graph.name)
                parent = self.graphs[caller.graph]
                outer = self.handle(parent, placeholder, make_placeholder)
                args = _pass_in(self.graphs, parent, parent.nodes[caller.node], TensorRef(outer), DT_RESOURCE, placeholder)
                for function, arg in args.items():
                    self._handles[(function, placeholder)] = arg
        return self._handles[key]

    # -- up --------------------------------------------------------------------

    def lift_max(self, graph: Graph, compute: Callable[[Graph], TensorRef]) -> TensorRef:
        """A top-level float32 scalar: the maximum of what ``compute`` adds to ``graph`` over all its runs.

        ``compute(g)`` adds its ops to ``g``, ``graph`` itself when that is the
        top-level graph, else a copy of it, and returns a float32 scalar there.
        """
        if not graph.is_function:
            return compute(graph)
        problem = self.chains.problem(graph.name)
        if problem is not None:
            raise ValueError(f"cannot return a value from '{graph.name}': {problem}")
        copy = self._copy(graph)
        value = compute(copy)
        caller = self.chains.caller(graph.name)
        parent = self.graphs[caller.graph]

        def in_parent(where: Graph) -> TensorRef:
            call = where.nodes[caller.node]
            if not where.is_function:  # the serving graph: a second call, for calibration only
                call = where.add_node(call.op, f"{CAPTURE_SCOPE}/calibrate/{call.name}",
                                      [i for i in call.inputs if not i.startswith("^")],
                                      {k: copy_attr(v) for k, v in call.attrs.items()}, call.device)
            return self._return_from(where, call, graph.name, copy, value)

        return self.lift_max(parent, in_parent)

    def _return_from(self, where: Graph, call: Node, original: str, copy: Graph, value: TensorRef) -> TensorRef:
        """``call`` (in ``where``) now calls ``copy`` for ``original`` and returns the maximum of ``value``."""
        key = f"tfpolicy_max_{len(copy.outputs)}"
        if call.op in WHILE_OPS:
            zero = where.add_const(f"{CAPTURE_SCOPE}/calibrate/zero", _zero())
            running = _add_arg(copy, "tfpolicy_running_max", DT_FLOAT)
            copy.outputs[key] = TensorRef(copy.add_node("Maximum", f"{CAPTURE_SCOPE}/running_max",
                                                        [running, str(value)], {"T": type_attr(DT_FLOAT)}).name)
            cond = self._copy(self.graphs[call.attrs["cond"].func.name])
            _add_arg(cond, "tfpolicy_running_max", DT_FLOAT)
            where.append_input(call, TensorRef(zero.name))
            call.attrs["T"].list.type.append(DT_FLOAT)
            _set_func(call, "cond", cond.name)
        else:
            copy.outputs[key] = value
            if call.op in IF_OPS:
                other_attr = "else_branch" if call.attrs["then_branch"].func.name == original else "then_branch"
                other = self._copy(self.graphs[call.attrs[other_attr].func.name])
                other.outputs[key] = TensorRef(other.add_const(f"{CAPTURE_SCOPE}/zero", _zero()).name)
                _set_func(call, other_attr, other.name)
            call.attrs["Tout"].list.type.append(DT_FLOAT)
        for attr in ("then_branch", "else_branch", "body", "f"):
            if attr in call.attrs and call.attrs[attr].func.name == original:
                _set_func(call, attr, copy.name)
        _grow_outputs(call)
        return TensorRef(call.name, _output_count(call) - 1)

    def _copy(self, graph: Graph) -> Graph:
        """A new function with ``graph``'s body, registered with the program (for calibration only)."""
        self._copies += 1
        copy = self.program.add_function_copy(graph.name, f"{graph.name}_tfpolicy_calibrate_{self._copies}")
        self.graphs[copy.name] = copy
        return copy


def _pass_in(graphs: dict[str, Graph], parent: Graph, call: Node, value: TensorRef, dtype: int,
             label: str) -> dict[str, str]:
    """``value`` becomes a new last input of ``call`` and a new argument of every function it calls.

    A While's body returns it unchanged (a loop variable). Returns the new
    argument's name in each function.
    """
    arg_name = "tfpolicy_" + re.sub(r"[^a-z0-9_]", "_", label.lower())
    parent.append_input(call, value)
    attr = "T" if call.op in WHILE_OPS else "Tin"
    call.attrs[attr].list.type.append(dtype)
    args = {}
    for function_attr in ("cond", "body", "then_branch", "else_branch", "f"):
        if function_attr in call.attrs:
            function = graphs[call.attrs[function_attr].func.name]
            args[function.name] = _add_arg(function, arg_name, dtype)
            if function_attr == "body":
                function.outputs[f"{args[function.name]}_out"] = TensorRef(args[function.name])
    if call.op in WHILE_OPS:
        _grow_outputs(call)
    return args


def _add_arg(function: Graph, base: str, dtype: int) -> str:
    name = function.unique_name(base)
    index = sum(1 for n in function.nodes.values() if n.op == "_Arg")
    function.add_node("_Arg", name, [], {"T": type_attr(dtype), "index": int_attr(index)})
    return name


def _grow_outputs(call: Node) -> None:
    """A call that now has one more output: its shapes and counts say so (a scalar)."""
    if "output_shapes" in call.attrs:
        call.attrs["output_shapes"].list.shape.add()  # a scalar
    if "_num_original_outputs" in call.attrs:
        call.attrs["_num_original_outputs"].i = _output_count(call)


def _output_count(call: Node) -> int:
    return len(call.attrs["T" if call.op in WHILE_OPS else "Tout"].list.type)


def _set_func(call: Node, attr: str, name: str) -> None:
    call.attrs[attr] = renamed_func_attr(call.attrs[attr], name)


def _zero() -> np.ndarray:
    return np.float32(0.0)

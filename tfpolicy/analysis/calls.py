"""Who calls each function of a signature, and whether a value can be passed down to it.

A While/If body or a called function has a fixed argument list: a new
variable read there (a float8 input scale) reaches it only as a new argument
that every call passes, from the signature's top-level graph down. That is
possible when each function on the way has exactly one caller, through an op
whose inputs map one to one onto the function's arguments::

    top-level graph --While(body=b, cond=c)--> b --If(then_branch=t, else_branch=e)--> t

:func:`call_chains` finds the callers; :meth:`CallChains.problem` says why a
function cannot be reached that way (``None`` when it can). The editing is
:mod:`tfpolicy.passes.function_args`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

from tfpolicy.core.graph import Graph, Node

# Ops that call functions by attribute, and the attributes naming them. Every
# function such an op calls takes the op's inputs (an If's after its condition).
CALLING_OPS: dict[str, tuple[str, ...]] = {
    "While": ("cond", "body"), "StatelessWhile": ("cond", "body"),
    "If": ("then_branch", "else_branch"), "StatelessIf": ("then_branch", "else_branch"),
    "PartitionedCall": ("f",), "StatefulPartitionedCall": ("f",),
}
WHILE_OPS = frozenset({"While", "StatelessWhile"})
IF_OPS = frozenset({"If", "StatelessIf"})
_OTHER_FUNCTION_ATTRS = ("branches",)  # Case: not threaded


@dataclasses.dataclass(frozen=True)
class Caller:
    graph: str  # the graph holding the call
    node: str


@dataclasses.dataclass
class CallChains:
    """Callers of each function of one signature (by function name)."""

    callers: dict[str, list[Caller]]
    unsupported: dict[str, str]  # function -> how it is called, where no argument can be added
    conditions: frozenset[str] = frozenset()  # While conditions: they return one bool, nothing else

    def caller(self, function: str) -> Caller:
        """The one caller of ``function`` (:meth:`problem` is ``None`` for it)."""
        return self.callers[function][0]

    def problem(self, function: str, _seen: frozenset[str] = frozenset()) -> Optional[str]:
        """Why a new argument cannot reach ``function`` from the top-level graph; ``None`` if it can."""
        if function in self.unsupported:
            return self.unsupported[function]
        found = self.callers.get(function, [])
        if len(found) != 1:
            return f"function '{function}' has {len(found)} callers"
        parent = found[0].graph
        if parent in _seen or parent == function:
            return f"function '{function}' is called recursively"
        if parent not in self.callers and parent not in self.unsupported:
            return None  # called from the top-level graph
        return self.problem(parent, _seen | {function})


def call_chains(top: Graph, functions: Iterable[Graph]) -> CallChains:
    callers: dict[str, list[Caller]] = {}
    unsupported: dict[str, str] = {}
    conditions: set[str] = set()
    for graph in (top, *functions):
        for node in graph.nodes.values():
            for name in _called(node, CALLING_OPS.get(node.op, ())):
                callers.setdefault(name, []).append(Caller(graph.name, node.name))
            if node.op in WHILE_OPS:
                conditions.update(_called(node, ("cond",)))
            for name in _called(node, _OTHER_FUNCTION_ATTRS) + _called_by_name(node, graph):
                unsupported[name] = f"function '{name}' is called by {node.op} '{node.name}'"
    return CallChains(callers, unsupported, frozenset(conditions))


def _called(node: Node, attrs: Iterable[str]) -> list[str]:
    names = []
    for attr in attrs:
        value = node.attrs.get(attr)
        if value is not None:
            names.extend([value.func.name] if value.HasField("func") else [f.name for f in value.list.func])
    return names


def _called_by_name(node: Node, graph: Graph) -> list[str]:
    return [node.op] if node.op in graph.library else []

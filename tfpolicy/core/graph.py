"""A small mutable graph view with automatic use-def information.

One :class:`Graph` holds either a signature's inlined top-level graph or the
body of one library function (a While/If body). Inputs are always in the flat
``node:idx`` form (see :mod:`tfpolicy.core.tf_names`); function arguments are nodes
of op ``_Arg`` and function results are listed in :attr:`Graph.outputs`, so that
passes treat both kinds of graph alike.

Consumers are never kept by hand: :meth:`Graph.uses` is derived from the inputs
and recomputed after any edit.

    g = savedmodel_io.load(path).signatures["serving_default"].graph   # or Graph(name), then add_node
    cast = g.add_node("Cast", "dense/tfpolicy/Cast", [str(ref)], {...})
    g.replace_input(consumer, 0, TensorRef(cast.name))
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable, Iterator, Mapping, Optional

from tensorflow.core.framework import attr_value_pb2, op_def_pb2

from tfpolicy.core import tf_names
from tfpolicy.core.tf_names import TensorRef

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Node:
    name: str
    op: str
    inputs: list[str]
    attrs: dict[str, attr_value_pb2.AttrValue]
    device: str = ""

    def data_inputs(self) -> Iterator[tuple[int, TensorRef]]:
        """``(position, TensorRef)`` for each data (non-control) input."""
        position = 0
        for text in self.inputs:
            ref, _ = tf_names.parse_input(text)
            if ref is not None:
                yield position, ref
                position += 1

    def control_inputs(self) -> list[str]:
        return [text[1:] for text in self.inputs if text.startswith("^")]


class Graph:
    """Nodes in insertion order, the graph's outputs, and a name authority."""

    def __init__(
        self,
        name: str,
        *,
        library: Mapping[str, op_def_pb2.OpDef] | None = None,
        is_function: bool = False,
    ) -> None:
        self.name = name
        self.is_function = is_function
        self.nodes: dict[str, Node] = {}
        # Output key -> tensor. Signature graphs: output tensor names in order;
        # function graphs: the FunctionDef's ret map.
        self.outputs: dict[str, TensorRef] = {}
        self.library: Mapping[str, op_def_pb2.OpDef] = library or {}
        # Function graphs: argument index -> the dtype its resource now holds
        # (an int8 kernel), for the FunctionDef's ``_handle_dtypes`` arg attribute.
        self.arg_handle_dtypes: dict[int, int] = {}
        self._uses: Optional[dict[str, list[tuple[str, int]]]] = None

    # -- construction --------------------------------------------------------

    def unique_name(self, base: str) -> str:
        """A node name not yet used in this graph, derived from ``base``."""
        if base not in self.nodes:
            return base
        suffix = 1
        while f"{base}_{suffix}" in self.nodes:
            suffix += 1
        return f"{base}_{suffix}"

    def add_node(
        self,
        op: str,
        name: str,
        inputs: Iterable[str],
        attrs: Mapping[str, attr_value_pb2.AttrValue],
        device: str = "",
    ) -> Node:
        node = Node(self.unique_name(name), op, list(inputs), dict(attrs), device)
        self.nodes[node.name] = node
        if self._uses is not None:
            for position, used in node.data_inputs():
                self._uses.setdefault(str(used), []).append((node.name, position))
        return node

    def copy(self, name: str) -> "Graph":
        """A graph with this one's nodes (attributes copied), outputs and arguments, named ``name``."""
        copy = Graph(name, library=self.library, is_function=self.is_function)
        for node in self.nodes.values():
            copy.nodes[node.name] = Node(node.name, node.op, list(node.inputs),
                                         {k: tf_names.copy_attr(v) for k, v in node.attrs.items()}, node.device)
        copy.outputs = dict(self.outputs)
        copy.arg_handle_dtypes = dict(self.arg_handle_dtypes)
        return copy

    # -- queries -------------------------------------------------------------

    def producer(self, ref: TensorRef) -> Node:
        return self.nodes[ref.node]

    def output_slots(self, node: Node) -> list[tf_names.ArgSlot]:
        return tf_names.output_slots(node.op, node.attrs, self.library)

    def output_dtypes(self, node: Node) -> list[int]:
        return tf_names.flat_dtypes(self.output_slots(node))

    def input_dtypes(self, node: Node) -> list[int]:
        return tf_names.flat_dtypes(tf_names.input_slots(node.op, node.attrs, self.library))

    def tensor_dtype(self, ref: TensorRef) -> int:
        return self.output_dtypes(self.producer(ref))[ref.index]

    def uses(self, ref: TensorRef) -> list[tuple[str, int]]:
        """``(consumer node, data input position)`` for each data use of ``ref``."""
        if self._uses is None:
            table: dict[str, list[tuple[str, int]]] = {}
            for node in self.nodes.values():
                for position, used in node.data_inputs():
                    table.setdefault(str(used), []).append((node.name, position))
            self._uses = table
        return list(self._uses.get(str(ref), ()))

    def ancestors(self, names: Iterable[str]) -> set[str]:
        """``names`` and every node they depend on, through data and control inputs."""
        found: set[str] = set()
        stack = [n for n in names if n in self.nodes]
        while stack:
            name = stack.pop()
            if name in found:
                continue
            found.add(name)
            for text in self.nodes[name].inputs:
                ref, control = tf_names.parse_input(text)
                dep = ref.node if ref is not None else control
                if dep in self.nodes and dep not in found:
                    stack.append(dep)
        return found

    def topological_order(self) -> list[Node]:
        """Nodes with every producer (data and control) before its consumers."""
        order: list[Node] = []
        state: dict[str, int] = {}
        for root in self.nodes:
            if root in state:
                continue
            stack = [(root, False)]
            while stack:
                name, done = stack.pop()
                if done:
                    state[name] = 2
                    order.append(self.nodes[name])
                    continue
                if state.get(name):
                    continue
                state[name] = 1
                stack.append((name, True))
                for text in reversed(self.nodes[name].inputs):
                    ref, control = tf_names.parse_input(text)
                    dep = ref.node if ref is not None else control
                    if dep in self.nodes and not state.get(dep):
                        stack.append((dep, False))
        return order

    def verify(self) -> list[str]:
        """Every broken invariant of the graph, first found first; [] when sound.

        Checks that each node is stored under its own name, that every data and
        control input names a node (and a data input one of its outputs), that
        each edge's dtype is the one its consumer expects, and that every
        graph output exists. Ops whose argument types cannot be worked out here
        (an unknown op) are checked for existence only.
        """
        problems: list[str] = []
        dtypes: dict[str, Optional[list[int]]] = {}

        def outputs_of(name: str) -> Optional[list[int]]:
            if name not in dtypes:
                try:
                    dtypes[name] = self.output_dtypes(self.nodes[name])
                except Exception:  # noqa: BLE001  (no signature to check against)
                    dtypes[name] = None
            return dtypes[name]

        for key, node in self.nodes.items():
            if node.name != key:
                problems.append(f"node '{node.name}' is stored as '{key}'")
            for control in node.control_inputs():
                if control not in self.nodes:
                    problems.append(f"'{node.name}' has a control input from missing node '{control}'")
            try:
                wants: Optional[list[int]] = self.input_dtypes(node)
            except Exception:  # noqa: BLE001
                wants = None
            for position, ref in node.data_inputs():
                if ref.node not in self.nodes:
                    problems.append(f"'{node.name}' input {position} reads missing node '{ref.node}'")
                    continue
                have = outputs_of(ref.node)
                if have is None:
                    continue
                if ref.index >= len(have):
                    problems.append(f"'{node.name}' input {position} reads '{ref}', which has {len(have)} outputs")
                elif wants is not None and position < len(wants) and wants[position] and have[ref.index] != wants[position]:
                    problems.append(
                        f"edge '{ref}' -> '{node.name}' input {position}: "
                        f"{tf_names.dtype_name(have[ref.index])} where {node.op} expects {tf_names.dtype_name(wants[position])}"
                    )
        for key, ref in self.outputs.items():
            if ref.node not in self.nodes:
                problems.append(f"output '{key}' reads missing node '{ref.node}'")
        return problems

    # -- edits ---------------------------------------------------------------

    def replace_input(self, consumer: Node, position: int, new: TensorRef) -> None:
        """Point data input ``position`` of ``consumer`` at ``new``."""
        seen = 0
        for i, text in enumerate(consumer.inputs):
            if text.startswith("^"):
                continue
            if seen == position:
                old = text
                consumer.inputs[i] = str(new)
                if self._uses is not None:  # keep the use table in step, O(uses of old)
                    old_key = str(tf_names.parse_input(old)[0])
                    self._uses[old_key] = [u for u in self._uses.get(old_key, []) if u != (consumer.name, position)]
                    self._uses.setdefault(str(new), []).append((consumer.name, position))
                return
            seen += 1
        raise IndexError(f"node '{consumer.name}' has no data input {position}")

    def append_input(self, consumer: Node, new: TensorRef) -> None:
        """A new last data input of ``consumer`` (before its control inputs)."""
        data = [text for text in consumer.inputs if not text.startswith("^")]
        controls = [text for text in consumer.inputs if text.startswith("^")]
        consumer.inputs[:] = [*data, str(new), *controls]
        if self._uses is not None:
            self._uses.setdefault(str(new), []).append((consumer.name, len(data)))

    def replace_all_uses_with(self, old: TensorRef, new: TensorRef) -> None:
        for consumer, position in self.uses(old):
            self.replace_input(self.nodes[consumer], position, new)
        for key, ref in self.outputs.items():
            if ref == old:
                self.outputs[key] = new

    def redefine(
        self,
        node: Node,
        op: str,
        inputs: Iterable[str],
        attrs: Mapping[str, attr_value_pb2.AttrValue],
    ) -> None:
        """Give ``node`` a new op, inputs and attributes, keeping its name.

        Its consumers keep reading it by name, so a tensor of the original
        graph keeps its name when what computes it changes.
        """
        if self._uses is not None:
            for position, used in node.data_inputs():
                key = str(used)
                self._uses[key] = [u for u in self._uses.get(key, []) if u != (node.name, position)]
        node.op, node.inputs, node.attrs = op, list(inputs), dict(attrs)
        if self._uses is not None:
            for position, used in node.data_inputs():
                self._uses.setdefault(str(used), []).append((node.name, position))

    def remove_if_unused(self, name: str) -> list[str]:
        """Delete node ``name`` if nothing reads it, then its producers likewise.

        A node is unused when no data or control input names it and it is not
        an output; stateful and argument nodes are kept. Returns the names removed.
        """
        removed: list[str] = []
        stack = [name]
        controlled: Optional[set[str]] = None  # read once per call
        while stack:
            node = self.nodes.get(stack.pop())
            if node is None or node.op in ("_Arg", "Placeholder") or tf_names.is_stateful(node.op):
                continue
            if any(ref.node == node.name for ref in self.outputs.values()):
                continue
            if any(self.uses(TensorRef(node.name, i)) for i in range(len(self.output_dtypes(node)))):
                continue
            if controlled is None:
                controlled = self._control_sources()
            if node.name in controlled:
                continue
            for position, used in node.data_inputs():
                key = str(used)
                if self._uses is not None:
                    self._uses[key] = [u for u in self._uses.get(key, []) if u != (node.name, position)]
                stack.append(used.node)
            del self.nodes[node.name]
            removed.append(node.name)
        return removed

    def _control_sources(self) -> set[str]:
        """The nodes some node waits on (names of its control inputs)."""
        return {name for node in self.nodes.values() for name in node.control_inputs()}

    def share_constants(self, removable: Callable[[str], bool]) -> int:
        """Make the nodes that read equal constants read one, and delete the copies; returns how many went.

        Two ``Const`` nodes are equal when their dtype, value and device are;
        the first in node order stays. Only nodes ``removable`` accepts go, and
        none that has or is a control input or is a graph output. (The
        rewrite builds a few constants per quantized site, the same few for
        every site: left to grappler's first passes, they cost every load of
        the output time.)
        """
        controlled = self._control_sources()
        outputs = {ref.node for ref in self.outputs.values()}
        first: dict[tuple, str] = {}
        copies: dict[str, str] = {}
        for node in self.nodes.values():
            if node.op != "Const" or node.inputs or node.name in controlled or node.name in outputs:
                continue
            key = (node.attrs["dtype"].type, node.attrs["value"].SerializeToString(deterministic=True), node.device)
            if key not in first:
                first[key] = node.name
            elif removable(node.name):
                copies[node.name] = first[key]
        for name, kept in copies.items():
            self.replace_all_uses_with(TensorRef(name), TensorRef(kept))
            del self.nodes[name]
        return len(copies)

    def add_const(self, name: str, value: "np.ndarray", device: str = "") -> Node:
        """A ``Const`` node holding ``value`` (its dtype and shape)."""
        import numpy as np  # noqa: PLC0415
        import tensorflow as tf  # noqa: PLC0415

        array = np.asarray(value)
        proto = tf.make_tensor_proto(array)
        return self.add_node(
            "Const",
            name,
            [],
            {
                "dtype": attr_value_pb2.AttrValue(type=proto.dtype),
                "value": attr_value_pb2.AttrValue(tensor=proto),
            },
            device,
        )

"""Building nodes in one graph, and reading the variables the rewrite adds.

A new variable gets one resource placeholder and one read per graph, whichever
pass asks first: they are named after the variable, so a builder finds what an
earlier pass's builder added to the graph (the graph is what passes share)::

    builder.read("dense/kernel_scale")
        -> Placeholder "tfpolicy/dense/kernel_scale" (resource, its dtype and shape)
        -> ReadVariableOp "tfpolicy/dense/kernel_scale/read"

``new_captures`` maps the placeholders this builder added to variable names;
saving binds each to the new ``tf.Variable``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from tfpolicy.core.assemble import NewVariable
from tfpolicy.core.graph import Graph
from tfpolicy.core.tf_names import DT_INT32, DT_RESOURCE, AttrValue, TensorRef, bool_attr, int_attr
from tfpolicy.core.tf_names import numpy_dtype, shape_attr, shape_list_attr, type_attr, type_list_attr

if TYPE_CHECKING:
    from tfpolicy.passes.function_args import FunctionArgs

CAPTURE_SCOPE = "tfpolicy"


class GraphBuilder:
    """Node helpers over ``graph``; ``variables`` are the new variables by name."""

    def __init__(self, graph: Graph, variables: dict[str, NewVariable], constant_scales: bool = False,
                 function_args: "FunctionArgs | None" = None) -> None:
        self.graph, self.variables = graph, variables
        self.constant_scales = constant_scales
        self.function_args = function_args
        self.new_captures: dict[str, str] = {}  # placeholder -> variable name
        self._reads: dict[str, TensorRef] = {}
        self._scales: dict[tuple[str, int], TensorRef] = {}

    def op(self, op: str, name: str, inputs: list[TensorRef], **attrs: AttrValue) -> TensorRef:
        node = self.graph.add_node(op, name, [str(i) for i in inputs], attrs)
        return TensorRef(node.name)

    def const(self, name: str, value, dtype: int) -> TensorRef:
        node = self.graph.add_const(name, np.asarray(value, dtype=numpy_dtype(dtype)))
        return TensorRef(node.name)

    def cast(self, ref: TensorRef, dtype: int, name: str) -> TensorRef:
        """``ref`` as ``dtype``: ``ref`` itself when it already is, else a new Cast ``name``."""
        have = self.graph.tensor_dtype(ref)
        if have == dtype:
            return ref
        return self.op("Cast", name, [ref], SrcT=type_attr(have), DstT=type_attr(dtype), Truncate=bool_attr(False))

    def take(self, params: TensorRef, indices: TensorRef, axis: int, name: str) -> TensorRef:
        """``GatherV2(params, indices, axis)`` with int32 ``indices`` and a constant axis."""
        return self.op("GatherV2", name, [params, indices, self.const(f"{name}/axis", axis, DT_INT32)],
                       Tparams=type_attr(self.graph.tensor_dtype(params)), Tindices=type_attr(DT_INT32),
                       Taxis=type_attr(DT_INT32), batch_dims=int_attr(0))

    def leading_dims(self, x: TensorRef, end: int, base: str) -> TensorRef:
        """``shape(x)[:end]``: x's leading (dynamic) dimensions, for a reshape target."""
        shape = self.op("Shape", f"{base}/shape", [x], T=type_attr(self.graph.tensor_dtype(x)), out_type=type_attr(DT_INT32))
        return self.op("StridedSlice", f"{base}/leading", [
            shape, self.const(f"{base}/begin", [0], DT_INT32), self.const(f"{base}/end", [end], DT_INT32),
            self.const(f"{base}/strides", [1], DT_INT32)],
            T=type_attr(DT_INT32), Index=type_attr(DT_INT32), begin_mask=int_attr(0), end_mask=int_attr(0),
            ellipsis_mask=int_attr(0), new_axis_mask=int_attr(0), shrink_axis_mask=int_attr(0))

    def reshape_target(self, leading: TensorRef, tail: list[int], base: str) -> TensorRef:
        """``concat(leading, tail)``: a shape that keeps the leading (dynamic) dimensions."""
        return self.op("ConcatV2", f"{base}/shape", [leading, self.const(f"{base}/tail", tail, DT_INT32),
                                                     self.const(f"{base}/axis", 0, DT_INT32)],
                       N=int_attr(2), T=type_attr(DT_INT32), Tidx=type_attr(DT_INT32))

    def handle(self, name: str) -> str:
        """The resource placeholder of new variable ``name`` in this graph.

        In a called function, the handle of the top-level graph's placeholder,
        passed down as a new argument (:mod:`tfpolicy.passes.function_args`).
        """
        placeholder = f"{CAPTURE_SCOPE}/{name}"

        def make(graph: Graph) -> str:
            if placeholder not in graph.nodes:
                variable = self.variables[name]
                graph.add_node("Placeholder", placeholder, [], {
                    "dtype": type_attr(DT_RESOURCE),
                    "shape": shape_attr([]),
                    "_handle_dtypes": type_list_attr([variable.dtype]),
                    "_handle_shapes": shape_list_attr([variable.shape]),
                })
                self.new_captures[placeholder] = name
            return placeholder

        if self.graph.is_function:
            if self.function_args is None:
                raise ValueError(f"new variable '{name}' read in function '{self.graph.name}' with no way to pass it in")
            top = self.function_args.top
            return self.function_args.handle(self.graph, placeholder, lambda: make(top))
        return make(self.graph)

    def read(self, name: str, constant_ok: bool = True) -> TensorRef:
        """One ``ReadVariableOp`` of new variable ``name`` per graph.

        In a called function (``constant_scales``), an int8 scale (fixed by the
        weights) is a Const instead, unless ``constant_ok`` is false (a float8
        input scale, which calibration sets after this graph is built; a
        divisor, which grappler would turn into a product with its reciprocal)
        and the variable's handle can be passed in.
        """
        if name in self._reads:
            return self._reads[name]
        constant, read = f"{CAPTURE_SCOPE}/{name}/value", f"{CAPTURE_SCOPE}/{name}/read"
        if constant in self.graph.nodes or read in self.graph.nodes:  # an earlier pass's
            self._reads[name] = TensorRef(constant if constant in self.graph.nodes else read)
        elif self.constant_scales and (constant_ok or not self._can_pass_in()):
            self._reads[name] = self.const(constant, self.variables[name].value, self.variables[name].dtype)
        else:
            handle = self.handle(name)
            node = self.graph.add_node("ReadVariableOp", read, [handle], {"dtype": type_attr(self.variables[name].dtype)})
            self._reads[name] = TensorRef(node.name)
        return self._reads[name]

    def _can_pass_in(self) -> bool:
        """Whether a new variable's handle can reach this graph (see :mod:`tfpolicy.passes.function_args`)."""
        args = self.function_args
        return not self.graph.is_function or (args is not None and args.chains.problem(self.graph.name) is None)

    def scale_as(self, name: str, dtype: int, constant_ok: bool = True) -> TensorRef:
        """A float32 scale variable's value in ``dtype`` (one Cast per graph and dtype)."""
        key = (name, dtype)
        if key not in self._scales:
            ref = self.read(name, constant_ok)
            cast = f"{ref.node}/to_{tf.dtypes.as_dtype(dtype).name}"
            self._scales[key] = TensorRef(cast) if cast in self.graph.nodes else self.cast(ref, dtype, cast)
        return self._scales[key]

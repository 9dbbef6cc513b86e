"""TensorFlow's edge-name and dtype-attribute rules, in one tested place.

Top-level GraphDefs name a node's outputs ``node`` (output 0) and ``node:3``;
FunctionDefs name them ``node:out_arg:idx`` and a function argument by its bare
name; control inputs are ``^node`` in both. tfpolicy's IR always uses the flat
top-level form (``node:idx``); the converters here translate FunctionDef input
strings to and from it, using each op's ``OpDef`` (or the called function's
signature) to lay out its output arguments.

The dtype rules live here as well: which attributes type which inputs and
outputs of an op, so that a pass can retype an op by changing attributes and then
ask for the resulting input and output dtypes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Optional, Sequence

from tensorflow.core.framework import attr_value_pb2, function_pb2, op_def_pb2, tensor_shape_pb2, types_pb2

from tfpolicy.core import tf_internals

# The DataType enums the passes name; passes use these and the attribute
# builders below, never the protobuf modules.
DT_FLOAT = types_pb2.DT_FLOAT
DT_HALF = types_pb2.DT_HALF
DT_BFLOAT16 = types_pb2.DT_BFLOAT16
DT_DOUBLE = types_pb2.DT_DOUBLE
DT_INT8 = types_pb2.DT_INT8
DT_INT32 = types_pb2.DT_INT32
DT_UINT8 = types_pb2.DT_UINT8
DT_UINT16 = types_pb2.DT_UINT16
DT_UINT32 = types_pb2.DT_UINT32
DT_QINT8 = types_pb2.DT_QINT8
DT_QUINT8 = types_pb2.DT_QUINT8
DT_QINT32 = types_pb2.DT_QINT32
DT_FLOAT8_E4M3FN = types_pb2.DT_FLOAT8_E4M3FN
DT_RESOURCE = types_pb2.DT_RESOURCE
DT_STRING = types_pb2.DT_STRING
DT_VARIANT = types_pb2.DT_VARIANT
DT_INVALID = types_pb2.DT_INVALID
AttrValue = attr_value_pb2.AttrValue  # for type hints

FLOAT_DTYPES = frozenset(
    {types_pb2.DT_FLOAT, types_pb2.DT_BFLOAT16, types_pb2.DT_HALF, types_pb2.DT_DOUBLE}
)
CONTRACTION_OPS = frozenset(
    {
        "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
        "Conv2D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
    }
)
"""Ops that contract an operand with a kernel: what int8 and float8 quantize
(:data:`tfpolicy.analysis.quant_sites.RULES` has one rule for each, plus the gathers)."""

DTYPE_NAMES = {
    types_pb2.DT_FLOAT: "float32",
    types_pb2.DT_BFLOAT16: "bfloat16",
    types_pb2.DT_HALF: "float16",
    types_pb2.DT_DOUBLE: "float64",
}
DTYPE_BY_NAME = {name: enum for enum, name in DTYPE_NAMES.items()}


def dtype_name(dtype: int) -> str:
    """Short name of a DataType enum (``float32``), else TensorFlow's enum name."""
    return DTYPE_NAMES.get(dtype) or types_pb2.DataType.Name(dtype)


def type_attr(dtype: int) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(type=dtype)


def bool_attr(value: bool) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(b=value)


def int_attr(value: int) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(i=value)


def string_attr(value: str) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(s=value.encode())


def type_list_attr(dtypes: Sequence[int]) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=list(dtypes)))


def string_list_attr(values: Sequence[str]) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(s=[v.encode() for v in values]))


def shape_attr(dims: Optional[Sequence[int]]) -> attr_value_pb2.AttrValue:
    """A shape attribute: ``dims`` (``-1`` unknown), or unknown rank for None."""
    return attr_value_pb2.AttrValue(shape=_shape_proto(dims))


def shape_list_attr(shapes: Sequence[Optional[Sequence[int]]]) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(shape=[_shape_proto(s) for s in shapes]))


def copy_attr(value: attr_value_pb2.AttrValue) -> attr_value_pb2.AttrValue:
    copy = attr_value_pb2.AttrValue()
    copy.CopyFrom(value)
    return copy


def renamed_func_attr(value: attr_value_pb2.AttrValue, name: str) -> attr_value_pb2.AttrValue:
    """A copy of function attribute ``value`` that names function ``name``."""
    copy = copy_attr(value)
    copy.func.name = name
    return copy


def numpy_dtype(dtype: int):
    """The numpy dtype of a DataType enum (``bfloat16`` and float8 through ml_dtypes)."""
    import tensorflow as tf  # noqa: PLC0415

    return tf.dtypes.as_dtype(dtype).as_numpy_dtype


def tensor_attr(array) -> attr_value_pb2.AttrValue:
    """A Const's ``value`` attribute holding numpy ``array``."""
    import tensorflow as tf  # noqa: PLC0415

    return attr_value_pb2.AttrValue(tensor=tf.make_tensor_proto(array, shape=array.shape))


def _shape_proto(dims: Optional[Sequence[int]]) -> tensor_shape_pb2.TensorShapeProto:
    if dims is None:
        return tensor_shape_pb2.TensorShapeProto(unknown_rank=True)
    return tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=int(d)) for d in dims])


@dataclasses.dataclass(frozen=True, order=True)
class TensorRef:
    """One output of one node: ``node:index`` in the flat form."""

    node: str
    index: int = 0

    def __str__(self) -> str:
        return self.node if self.index == 0 else f"{self.node}:{self.index}"


def parse_input(text: str) -> tuple[Optional[TensorRef], Optional[str]]:
    """Parse a flat (top-level GraphDef) input string.

    Returns ``(TensorRef, None)`` for a data input and ``(None, node)`` for a
    control input ``^node``.
    """
    if text.startswith("^"):
        return None, text[1:]
    node, sep, index = text.rpartition(":")
    if sep and index.isdigit():
        return TensorRef(node, int(index)), None
    return TensorRef(text, 0), None


# ---------------------------------------------------------------------------
# OpDef argument layout
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def op_def(op_type: str) -> Optional[op_def_pb2.OpDef]:
    """The registered OpDef, or None when ``op_type`` names a library function."""
    return tf_internals.op_def(op_type)


def is_stateful(op_type: str) -> bool:
    """Whether ``op_type`` has effects beyond its outputs (a stateful op, or a function call)."""
    definition = op_def(op_type)
    return definition is None or definition.is_stateful


@dataclasses.dataclass(frozen=True)
class ArgSlot:
    """How one OpDef argument expands into flat tensors."""

    name: str
    count: int
    dtypes: tuple[int, ...]
    type_attr: str  # the attribute that types it ("" for fixed or list types)
    type_list_attr: str


def _expand_args(
    args: Sequence[op_def_pb2.OpDef.ArgDef], attrs: Mapping[str, attr_value_pb2.AttrValue]
) -> list[ArgSlot]:
    slots = []
    for arg in args:
        if arg.type_list_attr:
            types = tuple(attrs[arg.type_list_attr].list.type)
            slots.append(ArgSlot(arg.name, len(types), types, "", arg.type_list_attr))
            continue
        count = attrs[arg.number_attr].i if arg.number_attr else 1
        dtype = attrs[arg.type_attr].type if arg.type_attr else arg.type
        slots.append(ArgSlot(arg.name, count, (dtype,) * count, arg.type_attr, ""))
    return slots


def _signature_of(op_type: str, library: Mapping[str, op_def_pb2.OpDef] | None) -> op_def_pb2.OpDef:
    """The OpDef of a registered op, else the signature of a library function."""
    definition = op_def(op_type)
    if definition is not None:
        return definition
    if library is None or op_type not in library:
        raise KeyError(f"unknown op or function '{op_type}'")
    return library[op_type]


def output_slots(
    op_type: str,
    attrs: Mapping[str, attr_value_pb2.AttrValue],
    library: Mapping[str, op_def_pb2.OpDef] | None = None,
) -> list[ArgSlot]:
    """Output arguments of an op (or of a called library function), expanded."""
    return _expand_args(_signature_of(op_type, library).output_arg, attrs)


def input_slots(
    op_type: str,
    attrs: Mapping[str, attr_value_pb2.AttrValue],
    library: Mapping[str, op_def_pb2.OpDef] | None = None,
) -> list[ArgSlot]:
    """Input arguments of an op (or of a called library function), expanded."""
    return _expand_args(_signature_of(op_type, library).input_arg, attrs)


def flat_dtypes(slots: Sequence[ArgSlot]) -> list[int]:
    return [dtype for slot in slots for dtype in slot.dtypes]


# ---------------------------------------------------------------------------
# FunctionDef <-> flat input strings
# ---------------------------------------------------------------------------


def function_input_to_flat(
    text: str, output_layout: Mapping[str, Sequence[ArgSlot]], arg_names: frozenset[str]
) -> str:
    """``node:out_arg:idx`` (or an argument name, or ``^node``) -> ``node:k``.

    ``output_layout`` maps each node of the function body to its output slots.
    """
    if text.startswith("^"):
        return text
    parts = text.split(":")
    if len(parts) == 1:
        if parts[0] in arg_names:
            return parts[0]
        return parts[0]
    if len(parts) == 2:  # argument with index, e.g. "x:0"
        return text if parts[1] != "0" else parts[0]
    node, arg, index = parts[0], parts[1], int(parts[2])
    offset = 0
    for slot in output_layout[node]:
        if slot.name == arg:
            return str(TensorRef(node, offset + index))
        offset += slot.count
    raise KeyError(f"node '{node}' has no output argument '{arg}'")


def flat_to_function_input(
    text: str, output_layout: Mapping[str, Sequence[ArgSlot]], arg_names: frozenset[str]
) -> str:
    """Inverse of :func:`function_input_to_flat`."""
    if text.startswith("^"):
        return text
    ref, _ = parse_input(text)
    assert ref is not None
    if ref.node in arg_names and ref.node not in output_layout:
        return ref.node if ref.index == 0 else f"{ref.node}:{ref.index}"
    offset = 0
    for slot in output_layout[ref.node]:
        if ref.index < offset + slot.count:
            return f"{ref.node}:{slot.name}:{ref.index - offset}"
        offset += slot.count
    raise KeyError(f"node '{ref.node}' has no output {ref.index}")


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


def has_cpu_kernel(op_type: str, attr_name: str, dtype: int) -> bool:
    """Whether a CPU kernel of ``op_type`` accepts ``dtype`` for ``attr_name``.

    tfpolicy only retypes an op when the result runs on the CPU as well as on
    accelerators, so that a rewritten SavedModel can always be checked on a CPU.
    Kernels without a constraint on ``attr_name`` accept any type.
    """
    return cpu_kernel_accepts(op_type, ((attr_name, dtype),))


@functools.lru_cache(maxsize=None)
def cpu_kernel_accepts(op_type: str, dtypes: tuple[tuple[str, int], ...]) -> bool:
    """Whether one CPU kernel of ``op_type`` accepts every ``(type attribute, dtype)`` of ``dtypes`` at once."""
    for kernel in tf_internals.registered_kernels(op_type):
        if kernel.device_type != "CPU":
            continue
        allowed = {c.name: c.allowed_values.list.type for c in kernel.constraint}
        if all(name not in allowed or dtype in allowed[name] for name, dtype in dtypes):
            return True
    return False


def op_def_allows(op_type: str, attr_name: str, dtype: int) -> bool:
    """Whether the OpDef's ``allowed_values`` for a type attribute include ``dtype``."""
    definition = op_def(op_type)
    if definition is None:
        return False
    for attr in definition.attr:
        if attr.name == attr_name:
            allowed = attr.allowed_values.list.type
            return not allowed or dtype in allowed
    return False


def library_signatures(
    library: function_pb2.FunctionDefLibrary,
) -> dict[str, op_def_pb2.OpDef]:
    return {fdef.signature.name: fdef.signature for fdef in library.function}

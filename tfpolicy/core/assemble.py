"""Rewritten graphs + variables -> a root object that ``tf.saved_model.save`` writes.

    root
    ├── signature_<key>          one ConcreteFunction per rewritten signature
    ├── tfpolicy_variables       every variable the signatures use
    ├── tfpolicy_resources       tables and assets of the input, kept alive
    └── tfpolicy                 (only when a policy quantizes)
        ├── variables            exactly the variables the quantization added
        └── calibrate(**inputs)  float8, on request: updates input histories and scales

Variables come in three kinds: kept (the loaded ones, unchanged), converted
(a float variable stored in another float dtype) and new (int8 and int4 kernels,
scales, zero points, amax histories: :class:`NewVariable`, which the quantize
pass fills).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2

from tfpolicy.core import checkpoints, savedmodel_io, savedmodel_save, tf_internals
from tfpolicy.core.savedmodel_io import LoadedModel, SignatureProgram
from tfpolicy.core.tf_names import TensorRef


class QuantizationModule(tf.Module):
    """The output's ``tfpolicy`` child.

    ``variables`` is a plain tracked list rather than ``tf.Module``'s property
    so that it is saved and comes back from ``tf.saved_model.load``.
    """

    variables = None  # shadows tf.Module.variables; set per instance

    def __init__(self, variables: list[tf.Variable]) -> None:
        super().__init__(name="tfpolicy")
        self.variables = list(variables)


SMALL_VALUE_BYTES = 1 << 20
"""Values at most this large (scales, histories) are kept once computed; larger ones are made when asked."""


class LazyValues:
    """Values computed together (a kernel's quantized copy and its scales) when first asked.

    ``compute()`` returns them all; the small ones are kept, a large one is
    returned to whoever asked and not kept, so that a rewrite never holds
    every quantized kernel at once.
    """

    def __init__(self, compute: Callable[[], tuple[np.ndarray, ...]]) -> None:
        self._compute = compute
        self._kept: Optional[dict[int, np.ndarray]] = None

    def get(self, index: int) -> np.ndarray:
        if self._kept is not None and index in self._kept:
            return self._kept[index]
        values = self._compute()
        self._kept = {i: v for i, v in enumerate(values) if v is not None and v.nbytes <= SMALL_VALUE_BYTES}
        return values[index]


@dataclasses.dataclass
class NewVariable:
    """A variable the rewrite creates; ``replaces`` is the uid of one it supersedes.

    Its shape and dtype are known at once, its value when :attr:`value` is read.
    ``derived_from`` is the uid of a variable the output keeps whose value
    makes this one's (a float8 kernel's statistics): it is written just after
    that variable, whose value is then read once. ``companion`` makes a
    small value derived from this one that the graph needs but the output
    does not store (see :func:`tfpolicy.passes.quant_variables.build_variables`).
    """

    name: str
    shape: tuple[int, ...]
    numpy_dtype: np.dtype
    make: Callable[[], np.ndarray]
    replaces: Optional[int] = None
    derived_from: Optional[int] = None
    companion: Optional[Callable[[], np.ndarray]] = None

    @classmethod
    def of(cls, name: str, value: np.ndarray, replaces: Optional[int] = None) -> "NewVariable":
        """A variable whose value is already at hand."""
        value = np.asarray(value)
        return cls(name, tuple(value.shape), value.dtype, lambda: value, replaces)

    @classmethod
    def part(cls, name: str, shape, numpy_dtype, values: LazyValues, index: int,
             replaces: Optional[int] = None, derived_from: Optional[int] = None) -> "NewVariable":
        """Value ``index`` of ``values``."""
        return cls(name, tuple(int(d) for d in shape), np.dtype(numpy_dtype), lambda: values.get(index), replaces,
                   derived_from)

    @property
    def value(self) -> np.ndarray:
        value = np.asarray(self.make())
        if value.shape != self.shape or value.dtype != self.numpy_dtype:
            raise AssertionError(f"{self.name}: made {value.dtype}{list(value.shape)},"
                                 f" declared {self.numpy_dtype}{list(self.shape)}")
        return value

    @property
    def dtype(self) -> int:
        return tf.dtypes.as_dtype(self.numpy_dtype).as_datatype_enum


@dataclasses.dataclass
class Assembled:
    """The root to save, and what makes the values of the variables that have none yet.

    Created and converted variables start without a value (no memory); the
    values are made one at a time as the checkpoint is written
    (:meth:`value_of`), or all at once by :meth:`materialize` when the
    functions must run first (calibration).
    """

    root: object
    signatures: dict[str, object]
    new_variables: dict[str, tf.Variable]
    calibrate: Optional[object]
    producers: dict[int, Callable[[], tf.Tensor]]  # id(variable) -> its value
    source: Optional[checkpoints.SavedModelCheckpoint]  # the input's, when its variables were not restored
    handles: dict[str, dict[str, object]] = dataclasses.field(default_factory=dict)
    """Signature key -> capture placeholder of its rewritten graph -> the handle bound to it."""

    def value_of(self, obj: object, attribute: str) -> Optional[Callable[[], tf.Tensor]]:
        """What makes ``obj``'s value in the output checkpoint (see :class:`checkpoints.ValueWriter`)."""
        if isinstance(obj, tf.Variable) and obj.is_initialized():
            return None  # tf.saved_model.save wrote it
        if id(obj) in self.producers:
            return self.producers[id(obj)]
        if self.source is not None and self.source.has(obj, attribute):
            return functools.partial(self.source.read, obj, attribute)  # kept as the input has it
        return None

    def materialize(self) -> None:
        """Give every variable of the root its value now."""
        for obj in tf_internals.trackable_descendants(self.root):
            if isinstance(obj, tf.Variable) and not obj.is_initialized():
                produce = self.value_of(obj, checkpoints.VARIABLE_VALUE)
                if produce is not None:
                    obj.assign(produce())


def assemble(
    model: LoadedModel,
    variable_dtypes: dict[int, int],
    new_variables: dict[str, NewVariable],
    new_captures: dict[str, dict[str, str]],
    calibration: Optional[tuple[str, dict[str, TensorRef]]] = None,
    xla_signatures: frozenset[str] = frozenset(),
    carry_calibrate: bool = False,
) -> Assembled:
    """Build the root; ``calibration`` is (signature key, calibrate outputs) or None.

    The functions of ``xla_signatures`` are marked for XLA compilation. The
    calibration function is built when ``calibration`` is given (to calibrate
    now, :attr:`Assembled.calibrate`) and saved with the root only when
    ``carry_calibrate``.
    """
    producers: dict[int, Callable[[], tf.Tensor]] = {}

    def deferred(shape, dtype, name: str, trainable: bool, produce: Callable[[], tf.Tensor]) -> tf.Variable:
        variable = tf_internals.uninitialized_variable(shape, dtype, name, trainable)
        producers[id(variable)] = produce
        return variable

    created = {
        name: deferred(spec.shape, tf.dtypes.as_dtype(spec.numpy_dtype), name, False, functools.partial(_made, spec))
        for name, spec in new_variables.items()
    }
    replaced = {spec.replaces: created[name] for name, spec in new_variables.items() if spec.replaces is not None}
    converted: dict[int, tf.Variable] = {}
    kept: dict[int, tf.Variable] = {}
    functions, calibrate, bound = {}, None, {}
    for program in model.signatures.values():
        handles = bound[program.key] = {}
        for placeholder, capture in program.captures.items():
            variable = capture.variable
            uid = id(variable) if variable is not None else None
            if uid in replaced:
                handles[placeholder] = replaced[uid].handle
                _retype_capture_placeholder(program, placeholder, replaced[uid].dtype.as_datatype_enum, replaced[uid].shape)
            elif uid in variable_dtypes:
                if uid not in converted:
                    dtype = tf.dtypes.as_dtype(variable_dtypes[uid])
                    converted[uid] = deferred(
                        variable.shape, dtype, variable.name.split(":")[0], variable.trainable,
                        functools.partial(_cast, model, variable, dtype),
                    )
                handles[placeholder] = converted[uid].handle
                _retype_capture_placeholder(program, placeholder, variable_dtypes[uid])
            else:
                if variable is not None:
                    kept[uid] = variable
                handles[placeholder] = capture.handle
        for placeholder, name in new_captures.get(program.key, {}).items():
            handles[placeholder] = created[name].handle
        functions[program.key] = savedmodel_save.rebuild_function(
            program, handles, xla_compile=program.key in xla_signatures)
        if calibration is not None and calibration[0] == program.key:
            calibrate = savedmodel_save.rebuild_function(program, handles, outputs=calibration[1])
    for alias, key in model.aliases.items():
        functions[alias] = functions[key]
    root = tf_internals.new_trackable_root()
    root.tfpolicy_variables = _in_writing_order(kept, converted, created, new_variables)
    root.tfpolicy_resources = savedmodel_io.tracked_resources(model.root)
    for key, function in functions.items():
        setattr(root, _attribute_name(key), function)
    if created:
        root.tfpolicy = QuantizationModule([created[name] for name in sorted(created)])
        if calibrate is not None and carry_calibrate:
            root.tfpolicy.calibrate = calibrate
    return Assembled(root, functions, created, calibrate, producers, model.checkpoint, bound)


def _in_writing_order(kept: dict, converted: dict, created: dict, specs: dict[str, NewVariable]) -> list[tf.Variable]:
    """The root's variables; each created one derived from a kept one right after it.

    The checkpoint's values are written in this order, and the input's
    checkpoint keeps the value it read last, so a kept kernel and the
    statistics taken from it share one read.
    """
    derived: dict[int, list[tf.Variable]] = {}
    for name, variable in created.items():
        if specs[name].derived_from in kept:
            derived.setdefault(specs[name].derived_from, []).append(variable)
    ordered = []
    for uid, variable in kept.items():
        ordered += [variable] + derived.pop(uid, [])
    placed = {id(v) for v in ordered}
    return ordered + list(converted.values()) + [v for v in created.values() if id(v) not in placed]


def _made(spec: NewVariable) -> tf.Tensor:
    return tf.constant(spec.value)


def _cast(model: LoadedModel, variable: tf.Variable, dtype: tf.DType) -> tf.Tensor:
    return tf.cast(model.read(variable), dtype)


def _retype_capture_placeholder(program: SignatureProgram, placeholder: str, dtype: int, shape=None) -> None:
    """The capture's handle data says the new variable's dtype (and shape, for a packed int4 kernel)."""
    node = program.graph.nodes.get(placeholder)
    if node is None:
        return
    handle_dtypes = node.attrs.get("_handle_dtypes")
    if handle_dtypes is not None:
        handle_dtypes.list.type[:] = [dtype if t == types_pb2.DT_FLOAT else t for t in handle_dtypes.list.type]
    handle_shapes = node.attrs.get("_handle_shapes")
    if shape is not None and handle_shapes is not None and len(handle_shapes.list.shape) == 1:
        handle_shapes.list.shape[0].CopyFrom(tf.TensorShape(shape).as_proto())


def _attribute_name(key: str) -> str:
    safe = "".join(c if c.isalnum() or c == "_" else "_" for c in key)
    return f"signature_{safe}"

"""Rewritten graphs + variables -> a root object that ``tf.saved_model.save`` writes.

    root
    ├── signature_<key>          one ConcreteFunction per rewritten signature
    ├── tfpolicy_variables       every variable the signatures use
    ├── tfpolicy_resources       tables and assets of the input, kept alive
    └── tfpolicy                 (only when a policy quantizes)
        ├── variables            exactly the variables the quantization added
        └── calibrate(**inputs)  float8 only: updates input histories and scales

Variables come in three kinds: kept (the loaded ones, unchanged), converted
(a float variable stored in another float dtype) and new (int8 and int4 kernels,
scales, zero points, amax histories: :class:`NewVariable`, which the quantize
pass fills).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2

from tfpolicy.core import savedmodel_io, savedmodel_save, tf_internals
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


@dataclasses.dataclass
class NewVariable:
    """A variable the rewrite creates; ``replaces`` is the uid of one it supersedes."""

    name: str
    value: np.ndarray
    replaces: Optional[int] = None

    @property
    def dtype(self) -> int:
        return tf.dtypes.as_dtype(self.value.dtype).as_datatype_enum


@dataclasses.dataclass
class Assembled:
    root: object
    signatures: dict[str, object]
    new_variables: dict[str, tf.Variable]
    calibrate: Optional[object]


def assemble(
    model: LoadedModel,
    variable_dtypes: dict[int, int],
    new_variables: dict[str, NewVariable],
    new_captures: dict[str, dict[str, str]],
    calibration: Optional[tuple[str, dict[str, TensorRef]]] = None,
) -> Assembled:
    """Build the root; ``calibration`` is (signature key, calibrate outputs) or None."""

    created = {name: tf.Variable(spec.value, name=name, trainable=False) for name, spec in new_variables.items()}
    replaced = {spec.replaces: created[name] for name, spec in new_variables.items() if spec.replaces is not None}
    converted: dict[int, tf.Variable] = {}
    kept: dict[int, tf.Variable] = {}
    functions, calibrate = {}, None
    for program in model.signatures.values():
        handles = {}
        for placeholder, capture in program.captures.items():
            variable = capture.variable
            uid = id(variable) if variable is not None else None
            if uid in replaced:
                handles[placeholder] = replaced[uid].handle
                _retype_capture_placeholder(program, placeholder, replaced[uid].dtype.as_datatype_enum, replaced[uid].shape)
            elif uid in variable_dtypes:
                if uid not in converted:
                    dtype = tf.dtypes.as_dtype(variable_dtypes[uid])
                    converted[uid] = tf.Variable(
                        tf.cast(variable, dtype), name=variable.name.split(":")[0], trainable=variable.trainable
                    )
                handles[placeholder] = converted[uid].handle
                _retype_capture_placeholder(program, placeholder, variable_dtypes[uid])
            else:
                if variable is not None:
                    kept[uid] = variable
                handles[placeholder] = capture.handle
        for placeholder, name in new_captures.get(program.key, {}).items():
            handles[placeholder] = created[name].handle
        functions[program.key] = savedmodel_save.rebuild_function(program, handles)
        if calibration is not None and calibration[0] == program.key:
            calibrate = savedmodel_save.rebuild_function(program, handles, outputs=calibration[1])
    root = tf_internals.new_trackable_root()
    root.tfpolicy_variables = list(kept.values()) + list(converted.values()) + list(created.values())
    root.tfpolicy_resources = savedmodel_io.tracked_resources(model.root)
    for key, function in functions.items():
        setattr(root, _attribute_name(key), function)
    if created:
        root.tfpolicy = QuantizationModule([created[name] for name in sorted(created)])
        if calibrate is not None:
            root.tfpolicy.calibrate = calibrate
    return Assembled(root, functions, created, calibrate)


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

"""The output's TF1 saver (the MetaGraphDef's ``saver_def``), written as graph nodes instead of traced.

TF1 loaders (TF Serving, ``saved_model_cli run``, ``tf.compat.v1.saved_model.load``)
restore a SavedModel's variables through its ``saver_def``: a string placeholder
for the checkpoint prefix, an op that restores every variable from it, a tensor
that saves them all. ``tf.saved_model.save`` builds these by tracing a save and a
restore function over every variable, creating Python ops one by one: for a
model of a few hundred variables that is more than half of the save (the
depth-12 float8 encoder of ``tools/bench.py``, 486 variables: 1.7 s of 3 s).
The rewrite saves with ``SaveOptions(experimental_skip_saver=True)`` and
:func:`add_saver` then writes the same saver straight into ``saved_model.pb``,
as nodes of its top-level graph::

    tfpolicy_saver/filename         Placeholder(string): the checkpoint prefix
    tfpolicy_saver/restore_all      NoOp after one AssignVariableOp per variable,
                                    fed by one RestoreV2 of every checkpoint key
    tfpolicy_saver/saved            the prefix, after one SaveV2 of every
                                    variable and the object graph

Each checkpoint key's variable is found by name. The exported graph names a
variable's ``VarHandleOp`` after the variable's shared name, with a suffix
only when that name is taken; suffixes only lengthen names, so when every
variable's shared name is the name of a distinct ``VarHandleOp`` and there are
as many of them as variables, each is its own variable's. Otherwise (names
that collide, checkpointed objects other than variables, such as mutable
tables) :func:`add_saver` writes nothing and returns False, and the caller
saves with TensorFlow's own saver.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any, Optional

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.core.protobuf import saved_model_pb2, saver_pb2

from tfpolicy.core import checkpoints, tf_internals, tf_names

logger = logging.getLogger(__name__)

SAVED_MODEL_PB = "saved_model.pb"
_SCOPE = "tfpolicy_saver"


def add_saver(saved_model_dir: pathlib.Path, root: object) -> bool:
    """Give the SavedModel at ``saved_model_dir``, saved from ``root`` without a saver, TF1's saver.

    Its checkpoint must be complete. Returns False, writing nothing, when
    the variables cannot all be matched to their graph nodes (see the module
    docstring). The fingerprint is written again, as the save writes it.
    """
    saved = checkpoints.SavedModelCheckpoint(saved_model_dir, root)
    variables = _checkpointed_variables(saved)
    if not variables or saved.unmatched:  # RestoreV2 needs one key at least; every key needs its variable
        return False
    path = pathlib.Path(saved_model_dir) / SAVED_MODEL_PB
    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString(path.read_bytes())
    (meta_graph,) = saved_model.meta_graphs
    handles = _handle_nodes(meta_graph.graph_def, variables, saved.dtypes)
    if handles is None:
        return False
    scope = _free_scope(meta_graph.graph_def)
    keys = list(handles)
    nodes = _saver_nodes(scope, keys, handles, [saved.dtypes[key] for key in keys], saved.object_graph.SerializeToString())
    meta_graph.graph_def.node.extend(nodes)
    meta_graph.saver_def.CopyFrom(
        saver_pb2.SaverDef(
            filename_tensor_name=f"{scope}/filename:0",
            save_tensor_name=f"{scope}/saved:0",
            restore_op_name=f"{scope}/restore_all",
            version=saver_pb2.SaverDef.V2,
        )
    )
    listed = {op.name for op in meta_graph.meta_info_def.stripped_op_list.op}
    for op_type in sorted({node.op for node in nodes} - listed):
        meta_graph.meta_info_def.stripped_op_list.op.append(tf_names.op_def(op_type))
    path.write_bytes(saved_model.SerializeToString())
    tf_internals.write_fingerprint(saved_model_dir)
    logger.debug("wrote the TF1 saver of %d variables into %s", len(keys), path)
    return True


def _checkpointed_variables(saved: checkpoints.SavedModelCheckpoint) -> Optional[dict[str, Any]]:
    """Checkpoint key -> variable, for every value the checkpoint holds; None if one is not a variable's."""
    variables: dict[str, Any] = {}
    for node_id, node in enumerate(saved.object_graph.nodes):
        for attribute in node.attributes:
            obj = saved.found.get(node_id)
            if attribute.name != checkpoints.VARIABLE_VALUE or not isinstance(obj, tf.Variable):
                logger.debug("checkpoint key %s is not a variable's value", attribute.checkpoint_key)
                return None
            variables[attribute.checkpoint_key] = obj
    return variables


def _handle_nodes(graph_def: graph_pb2.GraphDef, variables: dict[str, Any], dtypes: dict[str, tf.DType]) -> Optional[dict[str, str]]:
    """Checkpoint key -> the name of its variable's VarHandleOp, or None when names do not settle it."""
    handle_dtypes = {node.name: node.attr["dtype"].type for node in graph_def.node if node.op == "VarHandleOp"}
    handles = {key: tf_internals.exported_variable_name(variable) for key, variable in variables.items()}
    names = set(handles.values())
    if len(names) != len(handles) or len(handle_dtypes) != len(handles) or not names <= handle_dtypes.keys():
        logger.debug("variables and VarHandleOps are not matched by name; TensorFlow's saver is used")
        return None
    if any(handle_dtypes[name] != dtypes[key].as_datatype_enum for key, name in handles.items()):
        logger.debug("a VarHandleOp's dtype is not its checkpoint value's; TensorFlow's saver is used")
        return None
    return handles


def _free_scope(graph_def: graph_pb2.GraphDef) -> str:
    taken = {node.name.split("/")[0] for node in graph_def.node}
    scope, suffix = _SCOPE, 0
    while scope in taken:
        suffix += 1
        scope = f"{_SCOPE}_{suffix}"
    return scope


def _saver_nodes(scope: str, keys: list[str], handles: dict[str, str], dtypes: list[tf.DType], object_graph: bytes) -> list[Any]:
    """The restore and save nodes of ``keys`` (see the module docstring)."""
    enums = [dtype.as_datatype_enum for dtype in dtypes]
    all_keys = keys + [checkpoints.OBJECT_GRAPH_KEY]
    nodes = [
        _node(f"{scope}/filename", "Placeholder", [], dtype=tf_names.type_attr(tf_names.DT_STRING), shape=tf_names.shape_attr([])),
        _strings(f"{scope}/restore_keys", keys),
        _strings(f"{scope}/restore_slices", [""] * len(keys)),
        _node(
            f"{scope}/restore", "RestoreV2",
            [f"{scope}/filename", f"{scope}/restore_keys", f"{scope}/restore_slices"],
            dtypes=tf_names.type_list_attr(enums),
        ),
    ]
    for index, (key, dtype) in enumerate(zip(keys, enums)):
        nodes.append(_node(
            f"{scope}/assign_{index}", "AssignVariableOp", [handles[key], f"{scope}/restore:{index}"],
            dtype=tf_names.type_attr(dtype),
        ))
    nodes.append(_node(f"{scope}/restore_all", "NoOp", [f"^{scope}/assign_{index}" for index in range(len(keys))]))
    for index, (key, dtype) in enumerate(zip(keys, enums)):
        nodes.append(_node(f"{scope}/read_{index}", "ReadVariableOp", [handles[key]], dtype=tf_names.type_attr(dtype)))
    nodes += [
        _strings(f"{scope}/object_graph", object_graph),
        _strings(f"{scope}/save_keys", all_keys),
        _strings(f"{scope}/save_slices", [""] * len(all_keys)),
        _node(
            f"{scope}/save", "SaveV2",
            [f"{scope}/filename", f"{scope}/save_keys", f"{scope}/save_slices"]
            + [f"{scope}/read_{index}" for index in range(len(keys))] + [f"{scope}/object_graph"],
            dtypes=tf_names.type_list_attr(enums + [tf_names.DT_STRING]),
        ),
        _node(f"{scope}/saved", "Identity", [f"{scope}/filename", f"^{scope}/save"], T=tf_names.type_attr(tf_names.DT_STRING)),
    ]
    return nodes


def _node(name: str, op: str, inputs: list[str], **attrs: Any) -> Any:
    # On the CPU, as TensorFlow places its saver: RestoreV2 and SaveV2 have no other kernel.
    device = "" if op in ("AssignVariableOp", "ReadVariableOp", "NoOp") else "/device:CPU:0"
    node = node_def_pb2.NodeDef(name=name, op=op, input=inputs, device=device)
    for key, value in attrs.items():
        node.attr[key].CopyFrom(value)
    return node


def _strings(name: str, value: list[str] | bytes) -> Any:
    """A string Const: a vector of ``value``'s items, or one scalar of bytes."""
    array = np.array(value, dtype=object)
    return _node(name, "Const", [], dtype=tf_names.type_attr(tf_names.DT_STRING), value=tf_names.tensor_attr(array))

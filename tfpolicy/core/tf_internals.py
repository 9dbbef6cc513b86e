"""Every private TensorFlow API tfpolicy relies on, in one room.

No other tfpolicy module imports ``tensorflow.python``. Each function wraps one
private API and says why no public one serves; ``tests/test_tf_internals.py``
checks the behaviour each is relied on for, so that a TensorFlow upgrade that
changes it fails there, by name, and not somewhere deep in a rewrite.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, kernel_def_pb2, op_def_pb2
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, trackable_object_graph_pb2
from tensorflow.python.checkpoint import trackable_view
from tensorflow.python.eager import context, wrap_function
from tensorflow.python.eager.polymorphic_function import compiler_ir
from tensorflow.python.framework import func_graph, kernels, op_def_registry
from tensorflow.python.grappler import tf_optimizer
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.saved_model import fingerprinting_utils
from tensorflow.python.trackable import asset, autotrackable, resource, trackable_utils
from tensorflow.python.util import deprecation, nest


def op_def(op_type: str) -> Optional[op_def_pb2.OpDef]:
    """The registered OpDef of ``op_type``, or None (a library function's name).

    Public TensorFlow exposes ops as Python functions (``tf.raw_ops``), not
    their OpDefs with argument types and allowed dtypes.
    """
    return op_def_registry.get(op_type)


def registered_kernels(op_type: str) -> Sequence[kernel_def_pb2.KernelDef]:
    """The kernels registered for ``op_type`` (device and type constraints).

    No public API lists kernels; it is how tfpolicy knows a bfloat16 op will run.
    """
    return kernels.get_registered_kernels_for_op(op_type).kernel


def run_grappler(config: config_pb2.ConfigProto, meta_graph: meta_graph_pb2.MetaGraphDef) -> graph_pb2.GraphDef:
    """Grappler's meta-optimizer on ``meta_graph`` (used to inline function calls).

    Grappler runs publicly only inside ``tf.function`` execution, never on a
    graph handed to it.
    """
    return tf_optimizer.OptimizeGraph(config, meta_graph)


def trackable_descendants(root: object) -> list[object]:
    """Every object reachable from a loaded SavedModel's root.

    Public TensorFlow lists variables of a ``tf.Module`` but not the
    resources, assets and variables of an object ``tf.saved_model.load`` gave.
    """
    return list(trackable_view.TrackableView(root).descendants())


def is_resource_or_asset(obj: object) -> bool:
    """Whether ``obj`` is a lookup table or other captured resource, or an asset file.

    ``tf.saved_model.Asset`` is public but the resource base class is not.
    """
    return isinstance(obj, (resource.CapturableResource, asset.Asset))


def new_trackable_root() -> Any:
    """An empty root to attach the new SavedModel's objects to.

    It is the class of what ``tf.saved_model.load`` returns; a ``tf.Module``
    would add its own attributes and name scope to the saved object graph.
    """
    return autotrackable.AutoTrackable()


@contextlib.contextmanager
def deprecation_warnings_silenced() -> Iterator[None]:
    """The TF1 session loader's deprecation warnings off, as TF Serving never prints them.

    ``tf.get_logger`` cannot silence them: they go through a private switch.
    ``deprecation.silence()`` restores that switch only when its block ends
    normally; a failing signature run would leave every later deprecation
    warning of the process silenced, so the switch is restored here either way.
    """
    saved = deprecation._PRINT_DEPRECATION_WARNINGS  # noqa: SLF001
    try:
        with deprecation.silence():
            yield
    finally:
        deprecation._PRINT_DEPRECATION_WARNINGS = saved  # noqa: SLF001


def flatten_with_joined_string_paths(structure: Any) -> list[tuple[str, Any]]:
    """``[(path, leaf)]`` with ``/``-joined paths, as signature output keys are made.

    ``tf.nest`` has no public form of this; it is how SavedModel names outputs.
    """
    return nest.flatten_with_joined_string_paths(structure)


def new_func_graph(name: str, graph_def: graph_pb2.GraphDef) -> Any:
    """A ``FuncGraph`` holding ``graph_def``, ready for captures, inputs and outputs.

    A ``FuncGraph`` is the graph a ConcreteFunction is made of; it has no
    public constructor.
    """
    graph = func_graph.FuncGraph(name)
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return graph


XLA_MUST_COMPILE = "_XlaMustCompile"
"""The function attribute ``tf.function(jit_compile=True)`` sets: TensorFlow (TF Serving's session too) runs
such a function as one XLA computation."""


def concrete_function(graph: Any, inputs: Sequence[Any], xla_compile: bool = False, positional: bool = False) -> Any:
    """A ConcreteFunction over a finished ``FuncGraph``, callable with ``inputs`` by keyword.

    ``WrappedFunction`` is what ``tf.compat.v1.wrap_function`` returns; built
    here directly, it skips that function's op-by-op graph copy. The two
    argument attributes are what ``WrappedFunction.prune`` sets. With
    ``xla_compile`` its FunctionDef carries ``_XlaMustCompile``, as
    ``jit_compile=True`` would set: a function from a graph has no public way to get it.
    ``positional``: called with the input tensors in order, straight to the
    flat call (no argument keywords: binding hundreds of positional tensors to
    a structured signature first fails, and its error message prints every one).
    """
    attrs = {XLA_MUST_COMPILE: True} if xla_compile else None
    # A signature makes the flat call take its arguments as a list (without one it adds a tuple to a list).
    signature = [tf.TensorSpec(t.shape, t.dtype) for t in inputs] if positional else None
    function = wrap_function.WrappedFunction(graph, variable_holder=wrap_function.VariableHolder(), attrs=attrs,
                                             signature=signature)
    function._num_positional_args = len(inputs)  # noqa: SLF001
    function._arg_keywords = None if positional else [tensor.op.name for tensor in inputs]  # noqa: SLF001
    return function


def checkpointed_objects(root: object, object_graph: trackable_object_graph_pb2.TrackableObjectGraph) -> dict[int, Any]:
    """Node id of a checkpoint's object graph -> the object of ``root``'s graph it names.

    The walk TensorFlow's own restore makes: from the root (node 0), each
    child by its local name (``Trackable._lookup_dependency``). A SavedModel's
    checkpoint names its variables by node, so this is how a loaded object
    finds its value's key; no public API says which key belongs to which
    object. Children that are not found (functions, signature maps) are left out.
    """
    found = {0: root}
    queue = [0]
    for node_id in queue:
        parent = found[node_id]
        for child in object_graph.nodes[node_id].children:
            if child.node_id in found:
                continue
            obj = parent._lookup_dependency(child.local_name)  # noqa: SLF001
            if obj is not None:
                found[child.node_id] = obj
                queue.append(child.node_id)
    return found


def variable_checkpoint_keys(root: object) -> list[tuple[tf.Variable, str]]:
    """Every variable reachable from ``root``, with the key a checkpoint of ``root`` will give its value.

    The key is the variable's shortest path of local names from the root, as
    TensorFlow's breadth-first walk finds it (``tfpolicy_variables/3/.ATTRIBUTES/VARIABLE_VALUE``),
    known before ``tf.saved_model.save`` runs so that values can be written
    while it does. A SavedModel's walk also lists functions; callers compare
    these keys with the saved object graph's (:func:`checkpointed_objects`).
    No public API gives a key before saving.
    """
    _, paths = trackable_view.TrackableView(root)._descendants_with_paths()  # noqa: SLF001
    return [
        (obj, trackable_utils.checkpoint_key(trackable_utils.object_path_to_string(path), "VARIABLE_VALUE"))
        for obj, path in paths.items()
        if isinstance(obj, tf.Variable)
    ]


def uninitialized_variable(shape: Any, dtype: tf.DType, name: str, trainable: bool = False) -> tf.Variable:
    """A variable with a shape and a dtype and no value, so no memory.

    ``tf.Variable`` needs an initial value; this is the class
    ``tf.saved_model.load`` creates when it skips the checkpoint. Saved, it
    enters the object graph and no value is written (the checkpoint's values
    are then written by :mod:`tfpolicy.core.checkpoints`).
    """
    return resource_variable_ops.UninitializedVariable(shape=shape, dtype=dtype, name=name, trainable=trainable)


def value_free_stand_in(handle: tf.Tensor) -> Optional[tf.Variable]:
    """For the handle of a variable that has no value yet: a variable of its dtype and shape whose memory is never written.

    XLA lowering reads a variable's dtype and shape, never its value, but
    TensorFlow refuses to lower a function that captures an uninitialized
    variable. ``Empty(init=False)`` allocates without writing, so a stand-in
    for a 1 GB kernel adds next to nothing to the resident memory. None when
    ``handle`` is not an uninitialized variable's (a table's, or a variable
    that has its value). The handle's dtype and shape come from its handle
    data, which has no public accessor.
    """
    if handle.dtype != tf.resource or bool(tf.raw_ops.VarIsInitializedOp(resource=handle)):
        return None
    handle_data = resource_variable_ops.get_eager_safe_handle_data(handle)
    if handle_data is None or len(handle_data.shape_and_type) != 1:  # a table's handle
        return None
    shape_and_type = handle_data.shape_and_type
    shape = tf.TensorShape(shape_and_type[0].shape)
    dtype = tf.dtypes.as_dtype(shape_and_type[0].dtype)
    if not shape.is_fully_defined():
        return None
    stand_in = resource_variable_ops.UninitializedVariable(shape=shape, dtype=dtype, name="stand_in")
    try:
        stand_in.assign(tf.raw_ops.Empty(shape=shape.as_list(), dtype=dtype, init=False))
    except tf.errors.NotFoundError:  # no Empty kernel for the dtype (float8): small variables, zeros
        stand_in.assign(tf.zeros(shape, dtype))
    return stand_in


def lower_to_hlo(function: Any, args: Sequence[tf.Tensor], captured_inputs: Sequence[tf.Tensor]) -> str:
    """The XLA HLO text of ``function`` (traced with ``jit_compile=True``) on ``args``, its captures replaced.

    ``tf.function.experimental_get_compiler_ir`` lowers with the function's own
    captures; this is the call it makes, given other captures (stand-ins of
    the same dtypes and shapes, see :func:`value_free_stand_in`). The lowering
    holds the GIL all along (measured: a Python loop on another thread stalls
    for all but a few milliseconds of it), so it overlaps only work that
    releases the GIL, such as a session's ``run``.
    """
    device = compiler_ir.maybe_get_device_name(None)
    return context.context().get_compiler_ir(
        device_name=device, platform_name=None, function_name=function.name,
        flat_args=list(args), captured_inputs=list(captured_inputs), stage="hlo",
    ).decode("utf-8")


def restore_object(obj: Any, tensors: Mapping[str, Any]) -> None:
    """Give ``obj`` (a variable, a table) its checkpointed values, by attribute name.

    ``Trackable._restore_from_tensors`` is what a checkpoint restore calls
    per object; there is no public per-object restore.
    """
    obj._restore_from_tensors(dict(tensors))  # noqa: SLF001


def exported_variable_name(variable: tf.Variable) -> str:
    """The name ``tf.saved_model.save`` gives ``variable``'s VarHandleOp, unless another node took it first.

    The save copies each variable into the exported graph under its shared
    name (``copy_to_graph_uninitialized``), which the graph makes unique by
    adding a suffix. No public API gives the shared name or the copy.
    """
    return variable._shared_name  # noqa: SLF001


def write_fingerprint(saved_model_dir: Any) -> None:
    """Write ``fingerprint.pb`` from the directory's ``saved_model.pb`` and checkpoint, as the save does.

    The save writes it before the rewrite completes the checkpoint and the
    saver; ``tf.saved_model.experimental`` only reads fingerprints.
    """
    fingerprinting_utils.write_fingerprint(str(saved_model_dir))

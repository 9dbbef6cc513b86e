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
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
from tensorflow.python.checkpoint import trackable_view
from tensorflow.python.eager import wrap_function
from tensorflow.python.framework import func_graph, kernels, op_def_registry
from tensorflow.python.grappler import tf_optimizer
from tensorflow.python.trackable import asset, autotrackable, resource
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


def function_from_graph_def(
    graph_def: graph_pb2.GraphDef, inputs: Sequence[str], outputs: Any, captures: Mapping[str, Any]
) -> Any:
    """A callable over a GraphDef with its capture placeholders bound to live handles.

    ``tf.compat.v1.wrap_function`` wraps a Python function, not a GraphDef.
    """
    return wrap_function.function_from_graph_def(graph_def, list(inputs), outputs, captures)


def new_func_graph(name: str, graph_def: graph_pb2.GraphDef) -> Any:
    """A ``FuncGraph`` holding ``graph_def``, ready for captures, inputs and outputs.

    A ``FuncGraph`` is the graph a ConcreteFunction is made of; it has no
    public constructor.
    """
    graph = func_graph.FuncGraph(name)
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return graph


def concrete_function(graph: Any, inputs: Sequence[Any]) -> Any:
    """A ConcreteFunction over a finished ``FuncGraph``, callable with ``inputs`` by keyword.

    ``WrappedFunction`` is what ``tf.compat.v1.wrap_function`` returns; built
    here directly, it skips that function's op-by-op graph copy. The two
    argument attributes are what ``WrappedFunction.prune`` sets.
    """
    function = wrap_function.WrappedFunction(graph, variable_holder=wrap_function.VariableHolder())
    function._num_positional_args = len(inputs)  # noqa: SLF001
    function._arg_keywords = [tensor.op.name for tensor in inputs]  # noqa: SLF001
    return function

"""What tfpolicy relies on in TensorFlow's private APIs (tfpolicy/core/tf_internals.py).

Each test pins one behaviour; a TensorFlow upgrade that changes it fails here,
by name, before it fails a rewrite in some less obvious way.
"""

from __future__ import annotations

import logging
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from tfpolicy.core import savedmodel_io, tf_internals


def test_op_defs_and_kernels_are_read_from_the_registry():
    matmul = tf_internals.op_def("MatMul")
    assert matmul is not None and [a.name for a in matmul.input_arg] == ["a", "b"]
    assert tf_internals.op_def("__inference_not_an_op") is None
    cpu = [k for k in tf_internals.registered_kernels("MatMul") if k.device_type == "CPU"]
    allowed = {t for k in cpu for c in k.constraint if c.name == "T" for t in c.allowed_values.list.type}
    assert tf.bfloat16.as_datatype_enum in allowed


def _saved_loop(tmp_path: pathlib.Path) -> pathlib.Path:
    class Loop(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(np.eye(4, dtype=np.float32), name="w")

        @tf.function(input_signature=[tf.TensorSpec((None, 4), tf.float32)])
        def __call__(self, x):
            return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, tf.matmul(y, self.w)), (0, x))[1]

    model = Loop()
    tf.saved_model.save(model, str(tmp_path / "loop"), signatures=model.__call__)
    return tmp_path / "loop"


def test_grappler_inlines_calls_and_leaves_while_bodies_as_functions(tmp_path):
    loaded = tf.saved_model.load(str(_saved_loop(tmp_path)))
    inlined = savedmodel_io.inline_functions(loaded.signatures["serving_default"])
    ops = {n.op for n in inlined.node}
    assert "StatefulPartitionedCall" not in ops and "PartitionedCall" not in ops  # calls inlined
    assert ops & {"While", "StatelessWhile"}  # control flow kept functional (no Switch/Merge)
    assert not ops & {"Switch", "Merge", "Enter", "Exit"}
    assert len(inlined.library.function) >= 2  # cond and body


def test_a_loaded_models_variables_are_found_among_its_descendants(tmp_path):
    loaded = tf.saved_model.load(str(_saved_loop(tmp_path)))
    found = [obj for obj in tf_internals.trackable_descendants(loaded) if isinstance(obj, tf.Variable)]
    assert [v.name for v in found] == ["w:0"]
    table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(["a"], [1]), default_value=0)
    assert tf_internals.is_resource_or_asset(table) and not tf_internals.is_resource_or_asset(found[0])


def test_a_graph_def_becomes_a_function_called_by_keyword():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (None, 2), name="x")
        tf.identity(x * 2.0, name="y")
    fn_graph = tf_internals.new_func_graph("doubled", graph.as_graph_def())
    feed = fn_graph.get_tensor_by_name("x:0")
    fn_graph.inputs.append(feed)
    fn_graph.structured_outputs = {"y": fn_graph.get_tensor_by_name("y:0")}
    fn_graph.outputs.append(fn_graph.structured_outputs["y"])
    fn_graph.structured_input_signature = ((), {"x": tf.TensorSpec((None, 2), tf.float32, name="x")})
    function = tf_internals.concrete_function(fn_graph, [feed])
    np.testing.assert_array_equal(function(x=tf.ones((1, 2)))["y"].numpy(), [[2.0, 2.0]])

    # Without a structured input signature it is called positionally (the per-layer comparison's functions).
    positional_graph = tf_internals.new_func_graph("doubled_positional", graph.as_graph_def())
    positional_graph.inputs.append(positional_graph.get_tensor_by_name("x:0"))
    positional_graph.structured_outputs = {"y": positional_graph.get_tensor_by_name("y:0")}
    positional_graph.outputs.append(positional_graph.structured_outputs["y"])
    positional = tf_internals.concrete_function(positional_graph, list(positional_graph.inputs), positional=True)
    np.testing.assert_array_equal(positional(tf.ones((1, 2)))["y"].numpy(), [[2.0, 2.0]])


def test_output_keys_are_joined_paths():
    assert [p for p, _ in tf_internals.flatten_with_joined_string_paths({"a": 1, "b": {"c": 2}})] == ["a", "b/c"]


def test_deprecation_warnings_are_silenced_and_come_back_after_a_failure():
    from tensorflow.python.util import deprecation  # noqa: PLC0415  (to make a deprecated function)

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel(logging.WARNING)  # the CLI's tests quiet TensorFlow's logger for the process
    logger.addHandler(handler)
    try:
        def old_api():
            return 1

        silenced = deprecation.deprecated(None, "use something else")(old_api)
        with pytest.raises(ValueError):  # a failing run inside the block
            with tf_internals.deprecation_warnings_silenced():
                silenced()
                raise ValueError("the signature failed")
        assert not records
        loud = deprecation.deprecated(None, "use something else")(lambda: 2)
        loud()
        assert any("deprecated" in r.getMessage() for r in records)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_checkpointed_objects_walk_a_saved_models_object_graph_to_its_values(tmp_path):
    """Node ids -> objects by TensorFlow's restore walk; an uninitialized variable saves no value; restore_object fills one."""
    module = tf.Module()
    module.layer = tf.Module()
    module.layer.kernel = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    module.empty = tf_internals.uninitialized_variable((4,), tf.bfloat16, "empty")
    assert not module.empty.is_initialized()
    tf.saved_model.save(module, str(tmp_path / "m"))
    reader = tf.train.load_checkpoint(str(tmp_path / "m" / "variables" / "variables"))
    from tensorflow.core.protobuf import trackable_object_graph_pb2  # noqa: PLC0415

    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    found = tf_internals.checkpointed_objects(module, graph)
    keys = {id(found[i]): [a.checkpoint_key for a in node.attributes] for i, node in enumerate(graph.nodes) if i in found}
    assert found[0] is module
    kernel_key, = keys[id(module.layer.kernel)]
    empty_key, = keys[id(module.empty)]
    saved = reader.get_variable_to_shape_map()
    assert kernel_key in saved and empty_key not in saved  # recorded in the graph, no value written
    target = tf_internals.uninitialized_variable((2, 3), tf.float32, "target")
    tf_internals.restore_object(target, {"VARIABLE_VALUE": reader.get_tensor(kernel_key)})
    np.testing.assert_array_equal(target.numpy(), module.layer.kernel.numpy())


def test_variable_checkpoint_keys_are_the_keys_a_save_gives(tmp_path):
    """Known before saving: each variable's key, by its shortest path (an alias sorted first wins, as in the save)."""
    module = tf.Module()
    module.layer = tf.Module()
    module.layer.kernel = tf.Variable(np.ones((2, 3), np.float32))
    module.items = [tf.Variable(1.0), tf_internals.uninitialized_variable((4,), tf.bfloat16, "empty")]
    module.again = module.layer.kernel
    predicted = {id(v): key for v, key in tf_internals.variable_checkpoint_keys(module)}
    assert predicted[id(module.layer.kernel)] == "again/.ATTRIBUTES/VARIABLE_VALUE"
    tf.saved_model.save(module, str(tmp_path / "m"))
    reader = tf.train.load_checkpoint(str(tmp_path / "m" / "variables" / "variables"))
    from tensorflow.core.protobuf import trackable_object_graph_pb2  # noqa: PLC0415

    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    found = tf_internals.checkpointed_objects(module, graph)
    saved = {id(found[i]): a.checkpoint_key for i, node in enumerate(graph.nodes) if i in found for a in node.attributes}
    assert predicted == saved


def test_a_saved_variables_handle_op_takes_its_exported_name_and_the_fingerprint_is_rewritten(tmp_path):
    """What tf1_saver relies on: the save names a variable's VarHandleOp after its shared name."""
    module = tf.Module()
    module.v = tf.Variable(np.ones((2,), np.float32), name="block/kernel")
    tf.saved_model.save(module, str(tmp_path / "m"), options=tf.saved_model.SaveOptions(experimental_skip_saver=True))
    from tensorflow.core.protobuf import saved_model_pb2  # noqa: PLC0415

    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((tmp_path / "m" / "saved_model.pb").read_bytes())
    handles = [n.name for n in saved_model.meta_graphs[0].graph_def.node if n.op == "VarHandleOp"]
    assert handles == [tf_internals.exported_variable_name(module.v)] == ["block/kernel"]
    (tmp_path / "m" / "fingerprint.pb").unlink()
    tf_internals.write_fingerprint(tmp_path / "m")
    assert tf.saved_model.experimental.read_fingerprint(str(tmp_path / "m")).saved_model_checksum


def test_a_function_reading_variables_without_values_lowers_to_hlo_through_stand_ins():
    """TensorFlow refuses to lower a function whose variables have no value; stand-ins of their dtype and shape do."""
    kernel = tf_internals.uninitialized_variable((4, 3), tf.bfloat16, "kernel")
    table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(["a"], [1]), default_value=0)
    valued = tf.Variable(np.ones((3,), np.float32))

    @tf.function(jit_compile=True)
    def forward(x):
        return tf.cast(tf.matmul(tf.cast(x, tf.bfloat16), kernel), tf.float32) + valued

    x = tf.ones((2, 4))
    with pytest.raises(ValueError, match="uninitialized"):
        forward.experimental_get_compiler_ir(x)(stage="hlo")
    stand_in = tf_internals.value_free_stand_in(kernel.handle)
    assert (stand_in.dtype, stand_in.shape) == (tf.bfloat16, tf.TensorShape((4, 3)))
    assert tf_internals.value_free_stand_in(valued.handle) is None  # has its value: lowered as it is
    assert tf_internals.value_free_stand_in(table.resource_handle) is None  # not a variable
    traced = forward.get_concrete_function(x)
    captured = [stand_in.handle if h is kernel.handle else h for h in traced.captured_inputs]
    hlo = tf_internals.lower_to_hlo(traced, [x], captured)
    assert "bf16[4,3]" in hlo and "dot(" in hlo
    assert not kernel.is_initialized()  # nothing was given a value


PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tfpolicy"


def _imports(path: pathlib.Path) -> set[str]:
    import ast  # noqa: PLC0415

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_only_tf_internals_imports_private_tensorflow_and_no_pass_imports_protobufs():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 20
    private = {p.relative_to(PACKAGE).as_posix() for p in modules if any(m.startswith("tensorflow.python") for m in _imports(p))}
    assert private == {"core/tf_internals.py"}
    protobuf_in_passes = {p.name: sorted(m for m in _imports(p) if m.endswith("_pb2"))
                          for p in (PACKAGE / "passes").glob("*.py")}
    assert not any(protobuf_in_passes.values()), protobuf_in_passes


def test_only_keras_internals_imports_private_keras_and_the_built_at_init_list_is_kerass():
    modules = sorted(PACKAGE.rglob("*.py"))
    private = {p.relative_to(PACKAGE).as_posix() for p in modules if any(m.startswith("keras.src") for m in _imports(p))}
    assert private == {"core/keras_internals.py"}
    readers = {p.relative_to(PACKAGE).as_posix() for p in modules if "getsource" in p.read_text()}
    assert readers == {"core/keras_internals.py"}
    from tfpolicy.core import keras_internals  # noqa: PLC0415

    # The list read from Keras's source is the one pinned for installs without it.
    assert keras_internals.layers_built_at_init() == keras_internals.KERAS_3_15_BUILT_AT_INIT
    assert {"dropout", "activation"} <= keras_internals.KERAS_3_15_BUILT_AT_INIT
    assert keras_internals.to_snake_case("MultiHeadAttention") == "multi_head_attention"


# Bottom to top: a module may import from its own floor and those below, never above.
FLOORS = (
    ("errors", "quiet"),
    ("core",),
    ("analysis",),
    ("passes",),
    ("validation", "serving", "report"),
    ("api",),
    ("serving_export",),
    ("cli", "rewrite", "__main__"),
)


def _floor(module: str) -> int:
    """The floor of ``tfpolicy.<part>...`` (the package itself, with its lazy API names, is above every floor)."""
    part = module.split(".")[1] if "." in module else ""
    for level, names in enumerate(FLOORS):
        if part in names:
            return level
    return len(FLOORS)


def _tfpolicy_imports(path: pathlib.Path, submodules: set[str]) -> set[str]:
    """The tfpolicy modules ``path`` imports; ``tfpolicy`` itself for the package's lazy API names."""
    import ast  # noqa: PLC0415

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update("tfpolicy" if a.name == "tfpolicy" else a.name for a in node.names if a.name.startswith("tfpolicy"))
        elif isinstance(node, ast.ImportFrom) and node.module == "tfpolicy":
            for alias in node.names:
                name = f"tfpolicy.{alias.name}"
                if name in submodules:
                    found.add(name)
                elif alias.name != "__version__":
                    found.add("tfpolicy")  # a lazy API name: the API
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tfpolicy."):
            found.add(node.module)
    return found


def test_no_module_imports_from_a_floor_above_it():
    """Through the package's lazy names too: ``import tfpolicy`` / ``from tfpolicy import rewrite`` reach the API."""
    submodules = set()
    for p in PACKAGE.rglob("*.py"):
        name = p.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")
        submodules.add(name[: -len(".__init__")] if name.endswith(".__init__") else name)
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue
        module = path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")
        for imported in _tfpolicy_imports(path, submodules):
            if _floor(imported) > _floor(module):
                upward.append(f"{module} -> {imported}")
    assert not upward, upward


def test_every_warning_is_logged_through_a_tfpolicy_logger_which_strict_sees():
    """--strict refuses every warning the rewrite logs (api.StrictWarnings listens on the 'tfpolicy' logger):
    so each warning site must log through a module logger of the package, not print or warn by other means."""
    import ast  # noqa: PLC0415

    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        has_module_logger = "logger = logging.getLogger(__name__)" in path.read_text()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warning":
                owner = ast.unparse(node.func.value)
                sites.append((path.relative_to(PACKAGE).as_posix(), node.lineno, owner, has_module_logger))
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("warnings.warn", "print"):
                # The two command lines print their own output (tables, summaries, one-line errors).
                assert path.as_posix().endswith(("tfpolicy/cli.py", "tfpolicy/suggest.py")), \
                    f"{path.name}:{node.lineno} reports outside the logger"
    assert len(sites) >= 8
    stray = [s for s in sites if s[2] != "logger" or not s[3]]
    assert not stray, stray

"""Tier one: tiny graphs and names built in code, structural asserts only."""

from __future__ import annotations

import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, types_pb2

from tfpolicy.analysis import layer_index
from tfpolicy.analysis.layer_index import LayerIndex, find_layer_scope, normalize_scope
from tfpolicy.analysis.plan import LayerPlan, Plan
from tfpolicy.core import tf_names
from tfpolicy.core.graph import Graph
from tfpolicy.core.tf_names import TensorRef
from tfpolicy.passes.float_precision import FloatPrecisionPass

F32, BF16 = types_pb2.DT_FLOAT, types_pb2.DT_BFLOAT16


def _type(t):
    return attr_value_pb2.AttrValue(type=t)


# -- edge names ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text, ref, control",
    [("a", TensorRef("a", 0), None), ("a/b:2", TensorRef("a/b", 2), None), ("^c", None, "c"), ("x:y", TensorRef("x:y", 0), None)],
)
def test_parse_input(text, ref, control):
    assert tf_names.parse_input(text) == (ref, control)


def test_function_input_names_round_trip():
    attrs = {"T": _type(F32), "num_split": attr_value_pb2.AttrValue(i=3)}
    layout = {
        "split": tf_names.output_slots("Split", attrs),
        "bn": tf_names.output_slots("FusedBatchNormV3", {"T": _type(F32), "U": _type(F32)}),
    }
    args = frozenset({"x"})
    for text, flat in [("split:output:2", "split:2"), ("bn:batch_variance:0", "bn:2"), ("x", "x"), ("^split", "^split")]:
        assert tf_names.function_input_to_flat(text, layout, args) == flat
        assert tf_names.flat_to_function_input(flat, layout, args) == text


def test_dtype_slots_follow_attributes():
    assert tf_names.flat_dtypes(tf_names.output_slots("Cast", {"SrcT": _type(F32), "DstT": _type(BF16)})) == [BF16]
    identity_n = {"T": attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=[F32, types_pb2.DT_INT32]))}
    assert tf_names.flat_dtypes(tf_names.input_slots("IdentityN", identity_n)) == [F32, types_pb2.DT_INT32]


def test_kernel_lookup():
    assert tf_names.has_cpu_kernel("MatMul", "T", BF16)
    # Cholesky's CPU kernels are float32/float64 (and complex) only: a bfloat16
    # Cholesky would not run, and the float pass keeps it in float32.
    assert tf_names.has_cpu_kernel("Cholesky", "T", F32) and not tf_names.has_cpu_kernel("Cholesky", "T", BF16)
    assert not tf_names.has_cpu_kernel("NoSuchOp", "T", F32)


# -- layer scopes ---------------------------------------------------------------


def test_find_layer_scope_handles_names_ending_in_suffix():
    assert find_layer_scope("StatefulPartitionedCall/mlp_1/dense_1_2/Cast/ReadVariableOp", "dense_1") == (2, 3)
    assert find_layer_scope("StatefulPartitionedCall/mlp_1/dense_1/Cast/ReadVariableOp", "dense") == (2, 3)
    assert find_layer_scope("tfm_1/mha_1/query_1/MatMul/ReadVariableOp", "mha/query") == (1, 3)
    assert find_layer_scope("m2/encoder_dense/MatMul/ReadVariableOp", "encoder_dense") == (1, 2)
    assert find_layer_scope("a/b/c", "zzz") is None


def test_normalize_scope_fallback():
    known = frozenset({"lstm", "lstm/lstm_cell"})
    assert normalize_scope("StatefulPartitionedCall/m/lstm/zeros/packed/x", {("m",)}, known) == "lstm"
    assert normalize_scope("Func/StatefulPartitionedCall/input/_0") is None
    assert normalize_scope("StatefulPartitionedCall/Func/StatefulPartitionedCall/input/_0") is None
    assert normalize_scope("Identity") is None
    assert normalize_scope("postprocess_1/Mul") == "postprocess"


# -- the pass on a hand-built graph ------------------------------------------------


def _plan(compute: dict) -> Plan:
    def row(path, dtype, normalization=False):
        return LayerPlan(path, None, dtype, dtype, "float32", None, None, normalization, 0, 0)

    layers = {path: row(path, dtype) for path, dtype in compute.items()}
    layers.setdefault(None, row(None, "float32"))
    return Plan(layers, ())


def _tiny_graph() -> Graph:
    """x -> MatMul(x, w) -> Relu -> out, with Const w, all in layer 'dense'."""
    graph = Graph("g")
    graph.add_node("Placeholder", "x", [], {"dtype": _type(F32)})
    weight = tf.make_tensor_proto([[1.0, 2.0], [3.0, 4.0]], dtype=tf.float32)
    graph.add_node("Const", "dense/w", [], {"dtype": _type(F32), "value": attr_value_pb2.AttrValue(tensor=weight)})
    graph.add_node("MatMul", "dense/MatMul", ["x", "dense/w"], {"T": _type(F32), "transpose_a": attr_value_pb2.AttrValue(b=False), "transpose_b": attr_value_pb2.AttrValue(b=False)})
    graph.add_node("Relu", "dense/Relu", ["dense/MatMul"], {"T": _type(F32)})
    graph.add_node("Identity", "out", ["dense/Relu"], {"T": _type(F32)})
    graph.outputs["y"] = TensorRef("out")
    return graph


def _index_for(graph: Graph) -> LayerIndex:
    index = LayerIndex()
    for node in graph.nodes.values():
        path = "dense" if node.name.startswith("dense/") else None
        index._node_layer[("sig", graph.name, node.name)] = path
    return index


def test_pass_retypes_layer_and_casts_at_boundaries():
    graph = _tiny_graph()
    stats = FloatPrecisionPass("sig", graph, _index_for(graph), _plan({"dense": "bfloat16"}), {}).run().stats
    assert graph.nodes["dense/MatMul"].attrs["T"].type == BF16
    assert graph.nodes["dense/Relu"].attrs["T"].type == BF16
    assert graph.nodes["dense/w"].attrs["dtype"].type == BF16  # constants converted
    casts = [n for n in graph.nodes.values() if n.op == "Cast"]
    assert {(n.attrs["SrcT"].type, n.attrs["DstT"].type) for n in casts} == {(F32, BF16), (BF16, F32)}
    assert stats.casts_inserted == 2
    assert graph.tensor_dtype(graph.outputs["y"]) == F32  # the output keeps its dtype
    assert all(graph.producer(TensorRef(n.inputs[0].split(":")[0])).op != "Cast" for n in casts)


def test_pass_is_a_no_op_under_float32_and_idempotent():
    graph = _tiny_graph()
    stats = FloatPrecisionPass("sig", graph, _index_for(graph), _plan({"dense": "float32"}), {}).run().stats
    assert not stats.modified and len(graph.nodes) == 5
    graph = _tiny_graph()
    FloatPrecisionPass("sig", graph, _index_for(graph), _plan({"dense": "bfloat16"}), {}).run()
    count = len(graph.nodes)
    again = FloatPrecisionPass("sig", graph, _index_for(graph), _plan({"dense": "bfloat16"}), {}).run().stats
    assert again.casts_inserted == 0 and len(graph.nodes) == count


def test_pass_shares_one_cast_per_tensor_and_dtype():
    graph = _tiny_graph()
    graph.add_node("Tanh", "dense/Tanh", ["x"], {"T": _type(F32)})
    graph.outputs["z"] = TensorRef("dense/Tanh")
    FloatPrecisionPass("sig", graph, _index_for(graph), _plan({"dense": "bfloat16"}), {}).run()
    casts_of_x = [n for n in graph.nodes.values() if n.op == "Cast" and n.inputs == ["x"]]
    assert len(casts_of_x) == 1


def test_normalization_layers_are_declined():
    graph = _tiny_graph()
    plan = _plan({"dense": "bfloat16"})
    plan.layers["dense"] = LayerPlan("dense", None, "mixed_bfloat16", "bfloat16", "float32", None, None, True, 0, 0)
    stats = FloatPrecisionPass("sig", graph, _index_for(graph), plan, {}).run().stats
    assert graph.nodes["dense/MatMul"].attrs["T"].type == F32
    assert stats.declined["dense"]["normalization layer kept in float32"] >= 2


def test_layer_info_recognises_normalization():
    info = layer_index.LayerInfo("ln", [layer_index.VariableInfo("ln/gamma", "ln", F32, (4,), 1), layer_index.VariableInfo("ln/beta", "ln", F32, (4,), 2)])
    assert info.is_normalization
    assert not layer_index.LayerInfo("d", [layer_index.VariableInfo("d/kernel", "d", F32, (4, 4), 3)]).is_normalization


def test_remove_if_unused_deletes_a_dead_chain_and_keeps_what_is_read():
    graph = _tiny_graph()
    graph.add_node("Cast", "dense/dead_cast", ["dense/w"], {"SrcT": _type(F32), "DstT": _type(types_pb2.DT_HALF)})
    graph.add_node("Identity", "dense/dead", ["dense/dead_cast"], {"T": _type(types_pb2.DT_HALF)})
    assert graph.remove_if_unused("dense/dead") == ["dense/dead", "dense/dead_cast"]
    assert "dense/w" in graph.nodes  # still read by the MatMul
    assert graph.remove_if_unused("dense/Relu") == []  # read by the output
    assert graph.remove_if_unused("x") == []  # a graph input stays


def test_share_constants_keeps_one_of_each_value_and_what_must_stay():
    import numpy as np  # noqa: PLC0415

    graph = Graph("tiny")
    graph.add_node("Placeholder", "x", [], {"dtype": _type(F32)})
    for name, value in (("a/tfpolicy/eps", 1e-7), ("b/tfpolicy/eps", 1e-7), ("c/tfpolicy/eps", 2e-7),
                        ("d/tfpolicy/eps", 1e-7), ("e/tfpolicy/eps", 1e-7), ("user_eps", 1e-7), ("f/tfpolicy/eps", 1e-7)):
        graph.add_const(name, np.float32(value))
    graph.add_const("g/tfpolicy/eps_half", np.float16(1e-7))  # another dtype: another value
    for i, name in enumerate(("a/tfpolicy/eps", "b/tfpolicy/eps", "c/tfpolicy/eps", "user_eps", "f/tfpolicy/eps")):
        graph.add_node("AddV2", f"add_{i}", ["x", name], {"T": _type(F32)})
    graph.add_node("NoOp", "after_d", ["^d/tfpolicy/eps"], {})  # a control input: kept
    graph.outputs["e"] = TensorRef("e/tfpolicy/eps")  # a graph output: kept

    removed = graph.share_constants(lambda name: "tfpolicy" in name.split("/"))

    assert removed == 2  # b and f (user_eps is not the rewrite's own)
    assert "b/tfpolicy/eps" not in graph.nodes and "f/tfpolicy/eps" not in graph.nodes
    assert {"a/tfpolicy/eps", "c/tfpolicy/eps", "d/tfpolicy/eps", "e/tfpolicy/eps", "user_eps",
            "g/tfpolicy/eps_half"} <= set(graph.nodes)
    reads = {name: graph.nodes[name].inputs[1] for name in ("add_0", "add_1", "add_2", "add_3", "add_4")}
    assert reads == {"add_0": "a/tfpolicy/eps", "add_1": "a/tfpolicy/eps", "add_2": "c/tfpolicy/eps",
                     "add_3": "user_eps", "add_4": "a/tfpolicy/eps"}
    assert graph.verify() == []


# -- graph verification and the pass manager --------------------------------------


def _relu_graph() -> Graph:
    graph = Graph("tiny")
    graph.add_node("Placeholder", "x", [], {"dtype": _type(F32)})
    graph.add_node("Relu", "relu", ["x"], {"T": _type(F32)})
    graph.outputs["y"] = TensorRef("relu")
    return graph


def test_verify_finds_each_kind_of_broken_graph():
    graph = _relu_graph()
    assert graph.verify() == []
    graph.nodes["relu"].attrs["T"] = _type(BF16)  # retyped without a Cast
    assert graph.verify() == ["edge 'x' -> 'relu' input 0: float32 where Relu expects bfloat16"]
    graph = _relu_graph()
    graph.nodes["relu"].inputs = ["gone:0", "^also_gone"]
    graph.outputs["z"] = TensorRef("nowhere")
    problems = graph.verify()
    assert any("missing node 'gone'" in p for p in problems)
    assert any("control input from missing node 'also_gone'" in p for p in problems)
    assert any("output 'z' reads missing node 'nowhere'" in p for p in problems)
    graph = _relu_graph()
    graph.nodes["relu"].inputs = ["x:1"]
    assert graph.verify() == ["'relu' input 0 reads 'x:1', which has 1 outputs"]


class _Step:
    """A pass in the :class:`tfpolicy.passes.Pass` shape, doing what it is told."""

    def __init__(self, name: str, graph, edit=None) -> None:
        self.name, self.graph, self.edit = name, graph, edit

    def run(self):
        from tfpolicy.passes import PassResult  # noqa: PLC0415

        if self.edit is not None:
            self.edit()
        return PassResult(modified=self.edit is not None, stats=self.name.upper())


def test_the_pass_manager_names_the_pass_that_broke_an_edge():
    from tfpolicy.errors import PassError  # noqa: PLC0415
    from tfpolicy.passes import PassManager  # noqa: PLC0415

    graph = _relu_graph()

    def retype_without_cast() -> None:
        graph.nodes["relu"].attrs["T"] = _type(BF16)

    with pytest.raises(PassError, match=r"pass 'careless\[tiny\]' failed: left graph 'tiny' broken: edge 'x' -> 'relu'"):
        PassManager([_Step("fine", graph), _Step("careless[tiny]", graph, retype_without_cast)]).run()


def test_the_pass_manager_gives_results_by_name_wherever_a_pass_is_added():
    from tfpolicy.passes import PassManager  # noqa: PLC0415

    graph = _relu_graph()
    results = PassManager([_Step("a", graph), _Step("b", graph)]).run()
    more = PassManager([_Step("first", graph), _Step("a", graph), _Step("b", graph)]).run()
    assert results["b"].stats == more["b"].stats == "B" and not results["a"].modified
    with pytest.raises(ValueError, match="unique"):
        PassManager([_Step("a", graph), _Step("a", graph)])

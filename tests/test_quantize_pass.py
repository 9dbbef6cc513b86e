"""The quantization analysis, the quantize pass and the calibration pass on hand-built graphs.

One Dense-like layer: ``x -> MatMul(x, ReadVariableOp(kernel)) -> y``. Each
test builds the graph in code, finds the site, rewrites it and checks the
structure: which ops, which dtypes, which new variables, and that the graph
still verifies. (Keras as the oracle for the numbers is in test_int8_integer,
test_int4 and test_quantization.)
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tfpolicy.analysis import quant_sites
from tfpolicy.analysis.lowering import ONEDNN_INT8_MATMUL, Lowering
from tfpolicy.analysis.layer_index import LayerIndex, VariableInfo
from tfpolicy.analysis.plan import LayerPlan, Plan
from tfpolicy.core.graph import Graph
from tfpolicy.core.tf_names import DT_FLOAT, DT_INT8, DT_INT32, DT_RESOURCE, TensorRef, bool_attr, type_attr
from tfpolicy.passes.calibration import CalibrationPass
from tfpolicy.passes.float8_rounding import clip_and_round_to_float8
from tfpolicy.passes.quantize import QuantizePass, build_variables

KERNEL = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0 - 0.5
UID = 7


def _graph() -> Graph:
    graph = Graph("g")
    graph.add_node("Placeholder", "x", [], {"dtype": type_attr(DT_FLOAT)})
    graph.add_node("Placeholder", "kernel_handle", [], {"dtype": type_attr(DT_RESOURCE)})
    graph.add_node("ReadVariableOp", "dense/MatMul/ReadVariableOp", ["kernel_handle"], {"dtype": type_attr(DT_FLOAT)})
    graph.add_node("MatMul", "dense/MatMul", ["x", "dense/MatMul/ReadVariableOp"],
                   {"T": type_attr(DT_FLOAT), "transpose_a": bool_attr(False), "transpose_b": bool_attr(False)})
    graph.add_node("Identity", "y", ["dense/MatMul"], {"T": type_attr(DT_FLOAT)})
    graph.outputs["y"] = TensorRef("y")
    return graph


def _index(graph: Graph) -> LayerIndex:
    index = LayerIndex()
    index.variables[UID] = VariableInfo("dense/kernel", "dense", DT_FLOAT, KERNEL.shape, UID)
    index._resources[("sig", graph.name)] = {"kernel_handle": UID}
    for name in graph.nodes:
        index._node_layer[("sig", graph.name, name)] = "dense" if name.startswith("dense/") else None
    return index


def _plan(policy: str, mode: str, block_size=None) -> Plan:
    row = LayerPlan("dense", "dense", policy, "float32", "float32", mode, 16 if mode == "float8" else None,
                    False, 1, 2, block_size)
    return Plan({"dense": row, None: LayerPlan(None, None, "float32", "float32", "float32", None, None, False, 0, 0)}, ())


INTEGER = Lowering("gpu", "integer", True, "Keras's int8 x int8 -> int32", float8_rounding="cast")


def _rewrite(mode: str, policy: str, block_size=None, lowering: Lowering = INTEGER):
    graph = _graph()
    index = _index(graph)
    plan = _plan(policy, mode, block_size)
    site = quant_sites._match("sig", graph, graph.nodes["dense/MatMul"], "dense", mode, index, block_size=block_size)
    assert isinstance(site, quant_sites.Site), site
    sites = [site]
    qplan = quant_sites.QuantPlan(tuple(sites), (), quant_sites._int8_kernels(sites, index, plan),
                                  quant_sites._float8_groups(sites, index, plan), (),
                                  quant_sites._int4_kernels(sites, index, plan))
    variables = build_variables(qplan, lambda uid: KERNEL, lambda uid: KERNEL.shape, lowering)
    quantize = QuantizePass("sig", graph, index, qplan, variables, lowering=lowering)
    return graph, qplan, variables, quantize


def _ops(graph: Graph) -> list[str]:
    return sorted(n.op for n in graph.nodes.values())


def test_int8_site_becomes_an_integer_matmul_on_the_int8_variable():
    graph, qplan, variables, quantize = _rewrite("int8", "int8_from_float32")
    assert qplan.sites[0].form == "integer matmul"
    result = quantize.run()
    assert result.modified and result.stats.quantized == {"dense": 1}
    assert graph.verify() == []
    (matmul,) = [n for n in graph.nodes.values() if n.op == "BatchMatMulV3"]
    assert (matmul.attrs["Ta"].type, matmul.attrs["Tb"].type, matmul.attrs["Tout"].type) == (DT_INT8, DT_INT8, DT_INT32)
    assert graph.producer(TensorRef(matmul.inputs[1])).name == "dense/MatMul/ReadVariableOp"
    assert graph.nodes["dense/MatMul/ReadVariableOp"].attrs["dtype"].type == DT_INT8  # reads the int8 kernel itself
    assert graph.nodes["dense/MatMul"].op == "RealDiv"  # the site's node now rescales, its consumers unchanged
    assert "MatMul" not in _ops(graph)
    assert result.stats.new_captures == {"tfpolicy/dense/kernel_scale": "dense/kernel_scale"}
    q, scale = variables["dense/kernel"].value, variables["dense/kernel_scale"].value
    assert q.dtype == np.int8 and scale.shape == (3,)
    np.testing.assert_allclose(q / scale, KERNEL, atol=np.abs(KERNEL).max() / 127)


def test_int8_site_in_the_float_form_multiplies_the_int8_values_in_float32():
    graph, _, variables, quantize = _rewrite("int8", "int8_from_float32", lowering=Lowering(None, "float", False, "-"))
    assert quantize.run().modified and graph.verify() == []
    (matmul,) = [n for n in graph.nodes.values() if n.op == "MatMul"]
    assert matmul.attrs["T"].type == DT_FLOAT
    kernel = graph.producer(TensorRef(matmul.inputs[1]))
    assert (kernel.op, kernel.attrs["SrcT"].type) == ("Cast", DT_INT8)  # the int8 values themselves, not dequantized
    assert "BatchMatMulV3" not in _ops(graph) and "dense/kernel_u8_correction" not in variables


def test_int8_site_in_the_onednn_form_adds_the_shift_correction():
    graph, _, variables, quantize = _rewrite("int8", "int8_from_float32", lowering=Lowering("cpu", "onednn", False, "-"))
    result = quantize.run()
    assert result.modified and graph.verify() == []
    matmuls = [n for n in graph.nodes.values() if n.op == ONEDNN_INT8_MATMUL]
    (matmul,) = [n for n in matmuls if "int8_dot_guard" not in n.name]
    assert matmul.attrs["T1"].type == tf.quint8.as_datatype_enum and matmul.attrs["Tbias"].type == tf.qint32.as_datatype_enum
    # the bias fused, int32 out, and the kernel kept in oneDNN's layout between calls
    assert [s.decode() for s in matmul.attrs["fused_ops"].list.s] == ["BiasAdd"] and matmul.attrs["is_weight_const"].b
    assert matmul.attrs["Tout"].type == tf.qint32.as_datatype_enum
    # ... after the guard, whose probe (the other matmul) must be exact on the serving CPU
    (guard,) = [n for n in graph.nodes.values() if n.op == "Assert"]
    assert f"^{guard.name}" in matmul.inputs and len(matmuls) == 2
    correction, q = variables["dense/kernel_u8_correction"].value, variables["dense/kernel"].value
    np.testing.assert_array_equal(correction, -128 * q.astype(np.int32).sum(axis=0))
    assert "tfpolicy/dense/kernel_u8_correction" in result.stats.new_captures


@pytest.mark.parametrize("block_size, form", [(None, "int4 kernel, divided by its scale after the matmul"),
                                              (2, "int4 kernel dequantized before the contraction")])
def test_int4_site_unpacks_the_packed_kernel(block_size, form):
    graph, qplan, variables, quantize = _rewrite("int4", "int4_from_float32", block_size)
    assert qplan.sites[0].form == form
    kernel = qplan.int4_kernels[UID]
    assert (kernel.rows, kernel.columns, kernel.block_size) == (4, 3, block_size)
    assert variables["dense/kernel"].value.shape == (4, 2)  # 3 columns packed two to a byte, padded
    assert ("dense/kernel_zero" in variables) == (block_size is not None)
    quantize.run()
    assert graph.verify() == []
    ops = _ops(graph)
    # Keras's unpack_int4, by a lookup of each pair of packed bytes, then the padding column cut
    assert {"Bitcast", "GatherV2", "StridedSlice"} <= set(ops) and "tfpolicy/int4_nibble_quads" in graph.nodes
    assert graph.nodes["dense/MatMul/ReadVariableOp"].attrs["dtype"].type == DT_INT8
    matmuls = [n for n in graph.nodes.values() if n.op == "MatMul"]
    assert len(matmuls) == 1 and matmuls[0].attrs["T"].type == DT_FLOAT
    if block_size is None:
        assert graph.nodes["dense/MatMul"].op == "RealDiv"
    else:
        assert graph.nodes["dense/MatMul"].op == "MatMul" and "ExpandDims" in ops  # a scale and zero per block, broadcast


def test_float8_site_and_its_calibration_update():
    graph, qplan, variables, quantize = _rewrite("float8", "float8_from_float32")
    (group,) = qplan.float8_groups.values()
    assert (group.prefix, group.history_length) == ("dense", 16)
    quantize.run()
    assert [str(t.tensor) for t in quantize.taps] == ["x"]
    matmul = graph.nodes["dense/MatMul"]
    for position in (0, 1):  # both operands go through float8 and back
        dequantize = graph.producer(TensorRef(matmul.inputs[position]))
        assert dequantize.op == "Mul"
    casts = [n for n in graph.nodes.values() if n.op == "Cast"]
    assert sum(n.attrs["DstT"].type == tf.dtypes.experimental.float8_e4m3fn.as_datatype_enum for n in casts) == 2
    calibrated = CalibrationPass("serving_default", graph, variables, quantize.taps).run()
    assert calibrated.modified and list(calibrated.stats.outputs) == ["dense/inputs_scale"]
    # The only placeholder calibration adds is its history's; the others are the quantize pass's.
    assert calibrated.stats.new_captures == {"tfpolicy/dense/inputs_amax_history": "dense/inputs_amax_history"}
    assigns = sorted(n.name for n in graph.nodes.values() if n.op == "AssignVariableOp")
    assert assigns == ["tfpolicy/calibrate/dense/assign_history", "tfpolicy/calibrate/dense/assign_scale"]
    assert graph.verify() == []
    # The calibration finds the quantize pass's placeholders and reads in the graph: one each.
    placeholders = [n.name for n in graph.nodes.values() if n.name.startswith("tfpolicy/") and n.op == "Placeholder"]
    assert sorted(placeholders) == sorted(f"tfpolicy/dense/{k}" for k in ("inputs_scale", "kernel_scale", "inputs_amax_history"))


def test_float8_site_rounds_in_float32_bits_off_the_gpu():
    """Without --target gpu/tpu the float8 round trip is float32 arithmetic: no float8 Cast for the CPU to run."""
    graph, _, _, quantize = _rewrite("float8", "float8_from_float32", lowering=Lowering(None, "float", False, "-"))
    assert quantize.run().modified and graph.verify() == []
    float8 = tf.dtypes.experimental.float8_e4m3fn.as_datatype_enum
    assert not [n for n in graph.nodes.values() if n.op == "Cast" and float8 in (n.attrs["SrcT"].type, n.attrs["DstT"].type)]
    assert sum(n.op == "BitwiseOr" for n in graph.nodes.values()) == 2  # one rounding per operand


def test_a_kernel_of_another_layer_is_declined_with_the_reason():
    graph = _graph()
    index = _index(graph)
    index.variables[UID] = VariableInfo("other/kernel", "other", DT_FLOAT, KERNEL.shape, UID)
    declined = quant_sites._match("sig", graph, graph.nodes["dense/MatMul"], "dense", "int8", index)
    assert isinstance(declined, quant_sites.Declined)
    assert declined.reason == "its kernel 'other/kernel' belongs to layer 'other'"


def test_float8_rounding_in_bits_equals_tensorflows_float8_cast():
    """The CPU form of float8 quantize-dequantize: exactly Cast(Cast(ClipByValue(x, +-448), float8_e4m3fn), float32).

    Every bfloat16 value (what mixed_bfloat16 layers feed it), float32 values at
    and beside each midpoint between float8 neighbours (ties go to even), NaN
    (kept), -0.0 (kept) and +-inf (clipped).
    """
    from tensorflow.core.framework import graph_pb2

    graph = Graph("g")
    graph.add_node("Placeholder", "x", [], {"dtype": type_attr(DT_FLOAT)})
    qpass = QuantizePass("sig", graph, LayerIndex(), quant_sites.QuantPlan((), (), {}, {}, ()), {},
                         lowering=Lowering(None, "float", False, "-"))
    out = clip_and_round_to_float8(qpass, TensorRef("x"), "rounded")
    assert graph.verify() == []
    graph_def = graph_pb2.GraphDef()
    for node in graph.nodes.values():
        node_def = graph_def.node.add(name=node.name, op=node.op, input=node.inputs)
        for key, value in node.attrs.items():
            node_def.attr[key].CopyFrom(value)

    bf16 = np.arange(2**16, dtype=np.uint32).astype(np.uint32) << 16
    values = bf16.view(np.float32)
    values = values[~np.isnan(values)]
    f8 = np.unique(tf.cast(tf.constant(values[np.abs(values) <= 448]), tf.dtypes.experimental.float8_e4m3fn).numpy().astype(np.float32))
    mids = (f8[1:] + f8[:-1]) / 2
    edges = np.concatenate([mids, np.nextafter(mids, np.inf, dtype=np.float32), np.nextafter(mids, -np.inf, dtype=np.float32)])
    x = np.concatenate([values, edges[np.abs(edges) <= 448], [np.nan, -0.0]]).astype(np.float32)

    def run(feed):
        tf.graph_util.import_graph_def(graph_def, name="")
        return tf.compat.v1.get_default_graph().get_tensor_by_name(f"{out.node}:0")

    with tf.Graph().as_default() as g, tf.compat.v1.Session(graph=g) as session:
        result = session.run(run(None), {"x:0": x})
    clipped = tf.clip_by_value(tf.constant(x), -448.0, 448.0)
    expected = tf.cast(tf.cast(clipped, tf.dtypes.experimental.float8_e4m3fn), tf.float32).numpy()
    np.testing.assert_array_equal(result.view(np.uint32)[:-2], expected.view(np.uint32)[:-2])
    assert np.isnan(result[-2]) and np.signbit(result[-1]) and result[-1] == 0

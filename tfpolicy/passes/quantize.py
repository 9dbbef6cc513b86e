"""The quantization pass: int8 and float8 quantize-dequantize at each site.

Runs after the float pass, on each signature's graph and the functions it
calls (While/If bodies included, where a site needs no new variable), from a
frozen :class:`~tfpolicy.analysis.quant_sites.QuantPlan`. Every new op computes in the
dtype its operand already has (the layer's compute dtype), as Keras's
quantized layers do.

int8, kernel stored as int8 and dequantized where it is read::

    ReadVariableOp(kernel):f32 -> ...          becomes
    ReadVariableOp(kernel):int8 -> Cast(f32) -> RealDiv(kernel_scale) -> ...

int8 matmuls and einsums run on integers, as Keras's quantized Dense and
EinsumDense do (``s`` the per-token multiplier, ``k`` the kernel's per-channel one)::

    x -> MatMul(kernel)    becomes
    x -> Mul(s) -> Round -> ClipByValue(+-127) -> Cast(int8) -+
                              ReadVariableOp(kernel):int8 ----+-> BatchMatMulV3(int32) -> Cast -> RealDiv(k * s)
         s = 127 / (Max(Abs(x), contracted axes, keep_dims) + 1e-7)

An einsum ``<batch><contracted>,<contracted><out>`` flattens its contracted
and output axes around that matmul. Other int8 contractions (convolutions,
for which TensorFlow has no integer kernel) read the dequantized kernel and a
quantize-dequantized input::

    x -> Conv2D    becomes    x -> Mul(s) -> Round -> ClipByValue(+-127) -> RealDiv(s) -> Conv2D

int8 embedding lookups gather int8 rows and their scales, then divide.

float8, on both operands of the op (``s`` a divisor, a scalar variable), the
pattern XLA's FP8 GEMM rewriter matches (``--target gpu``/``tpu``)::

    x -> MatMul    becomes    x -> RealDiv(s) -> ClipByValue(+-448) -> Cast(f8e4m3fn) -> Cast -> Mul(s) -> MatMul

and elsewhere the same rounding to float8 in float32 bit arithmetic
(:func:`tfpolicy.passes.float8_rounding.clip_and_round_to_float8`), which gives the same values and is
faster than TensorFlow's CPU float8 Cast.

New variables enter each signature graph as resource placeholders named
``tfpolicy/<variable name>``; saving maps them to the new ``tf.Variable``s.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import numpy as np

from tfpolicy.analysis.layer_index import LayerIndex
from tfpolicy.analysis.lowering import ONEDNN_INT8_MATMUL, Lowering
from tfpolicy.analysis.lowering import choose as choose_lowering
from tfpolicy.analysis.quant_records import IntegerMatmul
from tfpolicy.analysis.quant_sites import Float8Group, Int8Kernel, QuantPlan, Site
from tfpolicy.core.graph import Graph, Node
from tfpolicy.core.tf_names import DT_BFLOAT16, DT_FLOAT, DT_QINT8, DT_QINT32, DT_QUINT8, DT_STRING, DT_UINT8
from tfpolicy.core.tf_names import TensorRef
from tfpolicy.core.tf_names import bool_attr as _bool
from tfpolicy.core.tf_names import int_attr as _int
from tfpolicy.core.tf_names import string_attr as _str
from tfpolicy.core.tf_names import string_list_attr as _strs
from tfpolicy.core.tf_names import type_attr as _type
from tfpolicy.core.tf_names import type_list_attr as _types
from tfpolicy.passes import PassResult
from tfpolicy.passes.float8_rounding import clip_and_round_to_float8
from tfpolicy.passes.function_args import FunctionArgs
from tfpolicy.passes.int4 import Int4Rewrites
from tfpolicy.passes.quant_variables import (  # noqa: F401  (re-exported: the formulas' constants, the variables)
    EPSILON,
    F32,
    FLOAT8,
    FLOAT8_E4M3_MAX,
    INT8,
    INT8_RANGE,
    INT32,
    U8_SHIFT,
    NewVariable,
    build_variables,
    chunk_sizes,
)
from tfpolicy.passes.read_dtype import read_in

logger = logging.getLogger(__name__)



# -- per-graph rewriting ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CalibrationTap:
    """A float8 input operand whose amax calibration rolls into its group's history."""

    group: Float8Group
    tensor: TensorRef
    graph: Graph  # the top-level graph, or the function the tensor is in


class CalibrationTaps:
    """The float8 inputs whose amax calibration measures: the quantize pass adds them, the calibration pass
    reads them (the artefact the two share, rather than each other)."""

    def __init__(self) -> None:
        self._taps: dict[tuple[str, str], CalibrationTap] = {}

    def add(self, group: Float8Group, tensor: TensorRef, graph: Graph) -> None:
        self._taps.setdefault((group.prefix, graph.name, str(tensor)), CalibrationTap(group, tensor, graph))

    def __iter__(self):
        return iter(list(self._taps.values()))

    def __len__(self) -> int:
        return len(self._taps)


@dataclasses.dataclass
class QuantizeResult:
    quantized: dict[str, int] = dataclasses.field(default_factory=dict)  # layer -> ops
    new_captures: dict[str, str] = dataclasses.field(default_factory=dict)  # placeholder -> variable name

    @property
    def modified(self) -> bool:
        return bool(self.quantized)


class QuantizePass(Int4Rewrites):
    """Rewrite the sites of one graph of a signature (its top-level graph, or a function it calls).

    ``taps``, when given, collects the float8 inputs for the calibration pass.
    """

    def __init__(
        self,
        signature: str,
        graph: Graph,
        index: LayerIndex,
        qplan: QuantPlan,
        variables: dict[str, NewVariable],
        constant_scales: bool = False,
        lowering: Optional[Lowering] = None,
        taps: Optional[CalibrationTaps] = None,
        function_args: Optional[FunctionArgs] = None,
    ) -> None:
        super().__init__(graph, variables, constant_scales, function_args)
        self.name = f"quantize[{signature}:{graph.name}]"
        self.signature, self.index, self.qplan = signature, index, qplan
        self.taps = taps if taps is not None else CalibrationTaps()
        self.lowering = lowering or choose_lowering(None)
        self.result = QuantizeResult(new_captures=self.new_captures)
        self._qdq: dict[tuple, TensorRef] = {}
        self._tokens: dict[str, tuple[TensorRef, TensorRef]] = {}  # input -> (integer values, scale)
        self._token_forms: dict[tuple[str, str], TensorRef] = {}  # (integer values, form) -> int8/float32/quint8
        self._int8_consumers: set[str] = set()  # nodes that read an int8 (or packed int4) kernel as such
        self._unpacked: dict[tuple[str, int], TensorRef] = {}  # (int4 kernel read, offset) -> its int8 values
        self._int8_dot_guard: Optional[str] = None  # the Assert that oneDNN's int8 dot is exact here (onednn form)

    def run(self) -> PassResult[QuantizeResult]:
        """Rewrite every site of this graph; ``stats`` is the :class:`QuantizeResult`."""
        result = self._rewrite()
        return PassResult(result.modified, stats=result)

    def _rewrite(self) -> QuantizeResult:
        sites = sorted(self.qplan.sites_in(self.signature, self.graph.name), key=lambda s: s.node)
        self._int8_consumers.update(s.node for s in sites if s.contraction.kind == "gather")
        reads: dict[int, list[Node]] = {}
        stored = self._stored_float8_kernels()
        for node in list(self.graph.nodes.values()):
            info = self.index.variable_read_by(self.signature, self.graph, node) if node.op == "ReadVariableOp" else None
            if info is not None and (info.uid in self.qplan.integer_kernels or info.uid in stored):
                reads.setdefault(info.uid, []).append(node)
        # Integer sites first, so that the float reads of their kernels fall unused.
        for site in sites:
            if site.integer is not None:
                self._integer_matmul(site)
            elif site.int4_rescaled:
                self._int4_matmul(site)
        for kernel in sorted(self.qplan.int8_kernels.values(), key=lambda k: k.name):
            self._store_int8(kernel, reads.get(kernel.uid, []), self._int8_consumers)
        compute = {s.variable_uid: s.compute_dtype for s in sites}
        for kernel in sorted(self.qplan.int4_kernels.values(), key=lambda k: k.name):
            self._store_int4(kernel, reads.get(kernel.uid, []), compute.get(kernel.uid, F32))
        for uid, group in sorted(stored.items(), key=lambda item: item[1].kernel_name):
            self._store_float8_kernel(group, reads.get(uid, []))
        self._retype_kernel_arguments()
        for site in sites:
            if site.integer is not None or site.int4_rescaled:
                pass  # rewritten above
            elif site.contraction.kind == "gather" and site.mode == "int4":
                self._int4_gather(site, self.qplan.int4_kernels[site.variable_uid])
            elif site.contraction.kind == "gather":
                self._gather(site, self.qplan.int8_kernels[site.variable_uid])
            elif site.mode == "int4":
                pass  # its kernel is dequantized where it is read
            elif site.mode == "int8":
                self._int8_input(site)
            else:
                self._float8(site)
            self.result.quantized[site.layer] = self.result.quantized.get(site.layer, 0) + 1
        return self.result

    # -- variables -------------------------------------------------------------------

    def _retype_kernel_arguments(self) -> None:
        """A called function's resource arguments that now carry int8 (or stored float8) kernels say so."""
        stored = self._stored_float8_kernels()
        for node in self.graph.nodes.values():
            if node.op == "_Arg":
                uid = self.index.variable_of(self.signature, self.graph, TensorRef(node.name))
                if uid in self.qplan.int8_kernels or uid in self.qplan.int4_kernels:
                    self.graph.arg_handle_dtypes[node.attrs["index"].i] = INT8
                elif uid in stored:
                    self.graph.arg_handle_dtypes[node.attrs["index"].i] = stored[uid].storable_dtype

    # -- int8 ------------------------------------------------------------------------

    def _store_int8(self, kernel: Int8Kernel, reads: list[Node], int8_consumers: set[str]) -> None:
        """Every read of the kernel reads int8; consumers other than ``int8_consumers`` read it dequantized."""
        for read in reads:
            read.attrs["dtype"] = _type(INT8)
            users = [(c, p) for c, p in self.graph.uses(TensorRef(read.name)) if c not in int8_consumers]
            if not users:
                continue
            value = self._dequantize(TensorRef(read.name), kernel, f"{read.name}/tfpolicy/dequantize")
            for consumer, position in users:
                self.graph.replace_input(self.graph.nodes[consumer], position, value)

    def _integer_matmul(self, site: Site) -> None:
        """The site becomes int8 x int8 -> int32 in the lowering's form, then Keras's rescale (see the module doc)."""
        node = self.graph.nodes[site.node]
        form = site.integer
        inputs = dict(node.data_inputs())
        x, old_kernel = inputs[0], inputs[1]
        dtype = self.graph.tensor_dtype(x)
        T = _type(dtype)
        base = f"{site.node}/tfpolicy/int8"
        contracted, free = int(np.prod(form.contracted)), int(np.prod(form.free))
        reshaped = form.prefix_rank is not None and (len(form.contracted) > 1 or len(form.free) > 1)
        leading = self.leading_dims(inputs[0], form.prefix_rank, base) if reshaped else None  # einsum's batch dims
        if form.prefix_rank is not None and len(form.contracted) > 1:  # einsum: flatten the contracted axes
            x = self.op("Reshape", f"{base}/flatten_input", [x, self.reshape_target(leading, [contracted], f"{base}/input")],
                        T=T, Tshape=_type(INT32))
        values, input_scale = self._quantize_per_token(x, dtype)
        kernel = TensorRef(site.read_node)  # the int8 variable itself, in the op's layout
        for step, (op, operand) in enumerate(form.kernel_layout):
            attrs = {"Transpose": {"Tperm": _type(INT32)}, "Reshape": {"Tshape": _type(INT32)}}.get(op, {"Tdim": _type(INT32)})
            operand = operand[0] if op == "ExpandDims" else list(operand)
            kernel = self.op(op, f"{base}/kernel_{step}", [kernel, self.const(f"{base}/kernel_{step}_operand", operand, INT32)],
                             T=_type(INT8), **attrs)
        if reshaped or self.lowering.int8_matmul != "integer":
            kernel = self.op("Reshape", f"{base}/kernel_2d", [kernel, self.const(f"{base}/kernel_2d_shape", [contracted, free], INT32)],
                             T=_type(INT8), Tshape=_type(INT32))
        product = {"integer": self._integer_product, "float": self._float_product, "onednn": self._onednn_product}[
            self.lowering.int8_matmul](values, dtype, kernel, site, base)
        self._int8_consumers.update(c for c, _ in self.graph.uses(TensorRef(site.read_node)) if c.startswith(f"{base}/"))
        as_float = self.cast(product, dtype, f"{base}/cast")
        scale_name = self.qplan.int8_kernels[site.variable_uid].scale_name
        kernel_scale = self._in_columns(self.scale_as(scale_name, dtype), scale_name, form, f"{base}/kernel_scale")
        output_scale = self.op("Mul", f"{base}/output_scale", [kernel_scale, input_scale], T=T)
        if len(form.free) > 1:  # einsum: unflatten the output axes
            divided = self.op("RealDiv", f"{base}/rescale", [as_float, output_scale], T=T)
            shape = self.reshape_target(leading, list(form.free), f"{base}/output")
            self.graph.redefine(node, "Reshape", [str(divided), str(shape)], {"T": T, "Tshape": _type(INT32)})
        else:
            self.graph.redefine(node, "RealDiv", [str(as_float), str(output_scale)], {"T": T})
        self.graph.remove_if_unused(old_kernel.node)

    def _in_columns(self, per_channel: TensorRef, variable: str, form: IntegerMatmul, name: str) -> TensorRef:
        """A new variable's value per output channel (a scale, a correction), in the matmul's column order."""
        dtype = self.graph.tensor_dtype(per_channel)
        value = per_channel
        if len(self.variables[variable].shape) != 1:
            value = self.op("Reshape", f"{name}", [value, self.const(f"{name}/free", [int(np.prod(form.free))], INT32)],
                            T=_type(dtype), Tshape=_type(INT32))
        if form.scale_order is not None:
            value = self.take(value, self.const(f"{name}/columns", list(form.scale_order), INT32), 0, f"{name}_columns")
        return value

    def _integer_product(self, values: TensorRef, dtype: int, kernel: TensorRef, site: Site, base: str) -> TensorRef:
        """Keras's op: ``BatchMatMulV3(int8, int8) -> int32`` (an XLA s8 dot)."""
        xq = self._token_values(values, "int8", dtype)
        return self.op("BatchMatMulV3", f"{base}/matmul", [xq, kernel], Ta=_type(INT8), Tb=_type(INT8),
                       Tout=_type(INT32), adj_x=_bool(False), adj_y=_bool(site.integer.transpose_kernel))

    def _float_product(self, values: TensorRef, dtype: int, kernel: TensorRef, site: Site, base: str) -> TensorRef:
        """The same integers multiplied in float32, exactly: in as many chunks as the kernel's sums need.

        (:func:`~tfpolicy.passes.quant_variables.float_exact_chunks`: usually
        one; never more than chunks of 1040 contracted values.) Returns float32
        when one matmul holds the sum; for two chunks in a float32 layer, their
        float32 sum (two exact integers added with one rounding: what Keras's
        Cast of the int32 sum gives); else the chunks' int32 sum. The int8
        kernel is split before it is widened (a quarter of the bytes copied).
        """
        form = site.integer
        transpose, contracted, free = form.transpose_kernel, int(np.prod(form.contracted)), int(np.prod(form.free))
        rows, restore = self._as_rows(self._token_values(values, "float32", dtype), contracted, free, DT_FLOAT, base)
        chunks = int(self.variables[self.qplan.int8_kernels[site.variable_uid].name].companion())

        def matmul(r: TensorRef, w: TensorRef, name: str) -> TensorRef:
            return self.op("MatMul", name, [r, self.cast(w, DT_FLOAT, f"{name}/kernel_float32")], T=_type(DT_FLOAT),
                           transpose_a=_bool(False), transpose_b=_bool(transpose))

        if chunks == 1:
            return restore(matmul(rows, kernel, f"{base}/matmul"))
        sizes = chunk_sizes(contracted, chunks)
        row_parts = self._split(rows, sizes, 1, f"{base}/input_chunks")
        weight_parts = self._split(kernel, sizes, 1 if transpose else 0, f"{base}/kernel_chunks")
        parts = [matmul(r, w, f"{base}/matmul_{i}") for i, (r, w) in enumerate(zip(row_parts, weight_parts))]
        if chunks == 2 and dtype == DT_FLOAT:
            return restore(self.op("AddV2", f"{base}/sum", parts, T=_type(DT_FLOAT)))
        sums = [self.cast(part, INT32, f"{part.node}_int32") for part in parts]
        return restore(self.op("AddN", f"{base}/sum", sums, N=_int(len(sums)), T=_type(INT32)))

    def _onednn_product(self, values: TensorRef, dtype: int, kernel: TensorRef, site: Site, base: str) -> TensorRef:
        """oneDNN's int8 matmul (:meth:`_onednn_matmul`): ``(x + 128) . W`` plus the int32 bias ``-128 . sum(W)``.

        oneDNN adds the bias in float32: where a kernel's sums could pass 2^24
        (:func:`u8_exact_chunks`), the contraction is split into chunks without
        a bias, summed and corrected in int32.
        """
        form = site.integer
        transpose, contracted, free = form.transpose_kernel, int(np.prod(form.contracted)), int(np.prod(form.free))
        rows, restore = self._as_rows(self._token_values(values, "quint8", dtype), contracted, free, DT_QUINT8, base)
        name = self.qplan.int8_kernels[site.variable_uid].correction_name
        correction = self._in_columns(self.read(name), name, form, f"{base}/correction")
        chunks = int(self.variables[name].companion())
        if chunks == 1:
            return restore(self._onednn_matmul(rows, kernel, correction, transpose, f"{base}/matmul"))
        sizes = chunk_sizes(contracted, chunks)
        row_parts = self._split(rows, sizes, 1, f"{base}/input_chunks")
        weight_parts = self._split(kernel, sizes, 1 if transpose else 0, f"{base}/kernel_chunks")
        no_bias = self.const(f"{base}/no_bias", np.zeros(free, np.int32), INT32)
        sums = [self._onednn_matmul(r, w, no_bias, transpose, f"{base}/matmul_{i}")
                for i, (r, w) in enumerate(zip(row_parts, weight_parts))]
        total = self.op("AddN", f"{base}/sum", sums, N=_int(len(sums)), T=_type(INT32))
        return restore(self.op("AddV2", f"{base}/corrected", [total, correction], T=_type(INT32)))

    def _onednn_matmul(self, rows: TensorRef, kernel: TensorRef, bias: TensorRef, transpose: bool, name: str,
                       guarded: bool = True) -> TensorRef:
        """``rows (quint8) . kernel (int8) + bias (int32)`` in int32, by oneDNN; after :meth:`_int8_dot_guard_node`.

        TensorFlow's ``_QuantizedMatMul`` with its bias fused (``fused_ops``
        ``["BiasAdd"]``, int32 in and out): with ``is_weight_const`` it
        reorders the kernel into the layout oneDNN's int8 kernel wants (AMX's
        blocked tiles) once, at the first call, and keeps it, where
        ``QuantizedMatMulWithBias`` reorders it at every call under oneDNN 3.
        Its kernel is registered whether or not oneDNN's graph rewrites are on
        (``TF_ENABLE_ONEDNN_OPTS=0``). The kernel variables it reads are never
        assigned in serving. Inputs ``[0, 255]`` and weights ``[-127, 127]``
        make every scale oneDNN derives 1: it adds the bias to the float32 of
        the int32 sum and rounds back (exact below ``2**24``: see the chunks).
        """
        weights = self.op("Bitcast", f"{name}/kernel_qint8", [kernel], T=_type(INT8), type=_type(DT_QINT8))
        bias = self.op("Bitcast", f"{name}/bias_qint32", [bias], T=_type(INT32), type=_type(DT_QINT32))
        bounds = [self.const(f"{name}/{n}", v, DT_FLOAT) for n, v in
                  (("min_input", 0.0), ("max_input", 255.0), ("min_kernel", -INT8_RANGE), ("max_kernel", INT8_RANGE))]
        product = self.op(ONEDNN_INT8_MATMUL, name, [rows, weights, bias, *bounds],
                          Tdevice_inputs=_types([DT_QUINT8, DT_QINT8, DT_QINT32] + [DT_FLOAT] * 4),
                          Thost_inputs=_types([]), Thost_outputs=_types([]),
                          Tdevice_outputs=_types([DT_QINT32, DT_FLOAT, DT_FLOAT]),
                          T1=_type(DT_QUINT8), T2=_type(DT_QINT8), Tbias=_type(DT_QINT32), Tout=_type(DT_QINT32),
                          U=_type(DT_FLOAT), transpose_a=_bool(False), transpose_b=_bool(transpose),
                          fused_ops=_strs(["BiasAdd"]), input_quant_mode=_str("MIN_FIRST"),
                          is_weight_const=_bool(True), is_bias_const=_bool(True))
        if guarded:
            self.graph.nodes[product.node].inputs.append(f"^{self._int8_dot_guard_node()}")
        return self.op("Bitcast", f"{name}_int32", [product], T=_type(DT_QINT32), type=_type(INT32))

    def _int8_dot_guard_node(self) -> str:
        """An Assert, run before this graph's oneDNN int8 matmuls, that they do not saturate on this CPU.

        On a CPU without AVX512-VNNI, AVX-VNNI or AMX-INT8 oneDNN adds pairs of
        8-bit products into saturating 16-bit sums, and a ``--target cpu``
        output would silently compute other numbers than Keras's. The probe is
        the worst case (every input 255, every weight 127, 64 long): exact,
        it is ``64 * 255 * 127``; saturated, ``32 * 32767``. One tiny matmul
        per call; the output then fails with a message saying why instead.
        """
        if self._int8_dot_guard is None:
            base = "tfpolicy/int8_dot_guard"
            depth, width = 64, 8
            rows = self.op("Bitcast", f"{base}/rows", [self.const(f"{base}/rows_uint8", np.full((8, depth), 255, np.uint8),
                                                                  DT_UINT8)], T=_type(DT_UINT8), type=_type(DT_QUINT8))
            kernel = self.const(f"{base}/kernel", np.full((depth, width), INT8_RANGE, np.int8), INT8)
            sums = self._onednn_matmul(rows, kernel, self.const(f"{base}/bias", np.zeros(width, np.int32), INT32),
                                       False, f"{base}/matmul", guarded=False)
            exact = self.op("Equal", f"{base}/exact", [sums, self.const(f"{base}/expected", depth * 255 * 127, INT32)],
                            T=_type(INT32), incompatible_shape_error=_bool(True))
            every = self.op("All", f"{base}/all_exact", [exact, self.const(f"{base}/axes", [0, 1], INT32)],
                            Tidx=_type(INT32), keep_dims=_bool(False))
            message = self.const(f"{base}/message", np.array(
                "tfpolicy: this output was written with --target cpu for CPUs whose oneDNN int8 matmul is exact"
                " (AVX512-VNNI, AVX-VNNI or AMX-INT8); on this CPU it saturates at 16 bits and would change the"
                " model's numbers: serve it on such a CPU, or rewrite the model without --target cpu", dtype=object),
                DT_STRING)
            assert_node = self.graph.add_node("Assert", f"{base}/assert", [str(every), str(message)],
                                              {"T": _types([DT_STRING]), "summarize": _int(1)})
            self._int8_dot_guard = assert_node.name
        return self._int8_dot_guard

    def _as_rows(self, x: TensorRef, contracted: int, free: int, dtype: int, base: str):
        """``x`` as a matrix of rows ``(-1, contracted)``, and how to give a product its leading axes back."""
        leading = self.leading_dims(x, -1, f"{base}/rows")
        rows = self.op("Reshape", f"{base}/rows", [x, self.const(f"{base}/rows_shape", [-1, contracted], INT32)],
                       T=_type(dtype), Tshape=_type(INT32))

        def restore(product: TensorRef) -> TensorRef:
            shape = self.reshape_target(leading, [free], f"{base}/product")
            return self.op("Reshape", f"{base}/product", [product, shape],
                           T=_type(self.graph.tensor_dtype(product)), Tshape=_type(INT32))

        return rows, restore

    def _split(self, x: TensorRef, sizes: list[int], axis: int, name: str) -> list[TensorRef]:
        node = self.graph.add_node("SplitV", name, [str(x), str(self.const(f"{name}/sizes", sizes, INT32)),
                                                    str(self.const(f"{name}/axis", axis, INT32))],
                                   {"T": _type(self.graph.tensor_dtype(x)), "Tlen": _type(INT32),
                                    "num_split": _int(len(sizes))})
        return [TensorRef(node.name, i) for i in range(len(sizes))]

    def _quantize_per_token(self, x: TensorRef, dtype: int) -> tuple[TensorRef, TensorRef]:
        """Keras's ``abs_max_quantize`` along the last axis: ``(integer values in dtype, scale)``, shared per input."""
        key = str(x)
        if key not in self._tokens:
            base = f"{x.node}/tfpolicy/int8_tokens"
            if dtype == DT_BFLOAT16 and self.lowering.int8_matmul != "integer":  # under XLA: Keras's own ops
                self._tokens[key] = self._abs_max_bfloat16_in_float32(x, base)
            else:
                self._tokens[key] = self._abs_max(x, (-1,), dtype, base)
        return self._tokens[key]

    def _abs_max_bfloat16_in_float32(self, x: TensorRef, base: str) -> tuple[TensorRef, TensorRef]:
        """:meth:`_abs_max` of a bfloat16 ``x`` along the last axis, its full-size steps in float32: the same values.

        TensorFlow's CPU bfloat16 elementwise ops compute in float32 and round,
        slower than float32's own. So ``x`` is widened once (not under XLA,
        which may drop a bfloat16 rounding between float32 ops: there the
        integer lowering keeps Keras's own bfloat16 ops); ``max|x|`` is exact
        in either; the per-token scale (a column) stays bfloat16, as Keras
        computes it; ``x * s``, exact in float32 (8-bit by 8-bit significands),
        is rounded to bfloat16 as Keras's product is; round and clip are exact::

            x:bf16 -> Cast(f32) -> max|x| -> Cast(bf16) -> s = 127 / (amax + eps)       (bfloat16, one per token)
                      Cast(f32) -> Mul(Cast(s, f32)) -> Cast(bf16) -> Cast(f32) -> Round -> Clip(+-127)  (float32 values)
        """
        f32, bf16 = _type(DT_FLOAT), _type(DT_BFLOAT16)
        wide = self.cast(x, DT_FLOAT, f"{base}/wide")
        amax = self._max_magnitude(wide, (-1,), DT_FLOAT, base)
        scale = self.op("RealDiv", f"{base}/scale", [
            self.const(f"{base}/range", INT8_RANGE, DT_BFLOAT16),
            self.op("AddV2", f"{base}/amax_eps", [self.cast(amax, DT_BFLOAT16, f"{base}/amax_bf16"),
                                                  self.const(f"{base}/epsilon", EPSILON, DT_BFLOAT16)], T=bf16),
        ], T=bf16)
        product = self.op("Mul", f"{base}/scaled_wide", [wide, self.cast(scale, DT_FLOAT, f"{base}/scale_wide")], T=f32)
        rounded_bf16 = self.cast(self.cast(product, DT_BFLOAT16, f"{base}/scaled"), DT_FLOAT, f"{base}/scaled_wide_again")
        clipped = self.op("ClipByValue", f"{base}/clip", [
            self.op("Round", f"{base}/round", [rounded_bf16], T=f32),
            self.const(f"{base}/min", -INT8_RANGE, DT_FLOAT), self.const(f"{base}/max", INT8_RANGE, DT_FLOAT)], T=f32)
        return clipped, scale

    def _token_values(self, values: TensorRef, form: str, dtype: int) -> TensorRef:
        """The quantized input's integer values as ``int8``, ``float32`` or ``quint8`` (shifted by 128)."""
        key = (str(values), form)
        if key not in self._token_forms:
            base = values.node.rsplit("/", 1)[0]  # .../int8_tokens
            if form == "int8":
                ref = self.cast(values, INT8, f"{base}/to_int8")
            elif form == "float32":
                ref = self.cast(values, DT_FLOAT, f"{base}/to_float32")
            else:
                have = self.graph.tensor_dtype(values)
                shifted = self.op("AddV2", f"{base}/shift", [values, self.const(f"{base}/u8_shift", U8_SHIFT, have)],
                                  T=_type(have))
                as_uint8 = self.cast(shifted, DT_UINT8, f"{base}/to_uint8")
                ref = self.op("Bitcast", f"{base}/to_quint8", [as_uint8], T=_type(DT_UINT8), type=_type(DT_QUINT8))
            self._token_forms[key] = ref
        return self._token_forms[key]

    def _abs_max(self, x: TensorRef, axes: tuple[int, ...], dtype: int, base: str) -> tuple[TensorRef, TensorRef]:
        """``(clip(round(x * s), +-127), s)``, ``s = 127 / (max|x| over axes + 1e-7)``, in ``dtype``.

        In float32 the clip is left out: it never changes a finite value. With
        ``a = max|x|``, ``a + 1e-7`` rounds to at least ``a``, so ``|x * s| <=
        a * 127 / a`` up to two roundings, ``127 * (1 + 2**-24)**2 < 127.5``,
        which rounds to at most 127 (TensorFlow's CPU ClipByValue costs as much
        as the quantization's multiply and round together). In bfloat16 and
        float16 a rounded product can reach 127.5 or 128, and the clip stays.
        """
        T = _type(dtype)
        amax = self._max_magnitude(x, axes, dtype, base)
        scale = self.op("RealDiv", f"{base}/scale", [
            self.const(f"{base}/range", INT8_RANGE, dtype),
            self.op("AddV2", f"{base}/amax_eps", [amax, self.const(f"{base}/epsilon", EPSILON, dtype)], T=T),
        ], T=T)
        rounded = self.op("Round", f"{base}/round", [self.op("Mul", f"{base}/scaled", [x, scale], T=T)], T=T)
        if dtype == DT_FLOAT:
            return rounded, scale
        clipped = self.op("ClipByValue", f"{base}/clip", [
            rounded, self.const(f"{base}/min", -INT8_RANGE, dtype),
            self.const(f"{base}/max", INT8_RANGE, dtype)], T=T)
        return clipped, scale

    def _max_magnitude(self, x: TensorRef, axes: tuple[int, ...], dtype: int, base: str) -> TensorRef:
        """``max|x|`` over ``axes`` (kept), as ``max(max x, -min x)``: the same value as Keras's ``max(abs(x))``.

        Two reductions read ``x`` where ``Abs`` would first write a copy of it
        (on a CPU a quarter less time for a 1024 x 3072 float32 input).
        """
        T, axes_ref = _type(dtype), self.const(f"{base}/axes", list(axes), INT32)
        largest = self.op("Max", f"{base}/amax_largest", [x, axes_ref], T=T, Tidx=_type(INT32), keep_dims=_bool(True))
        smallest = self.op("Min", f"{base}/amax_smallest", [x, axes_ref], T=T, Tidx=_type(INT32), keep_dims=_bool(True))
        negated = self.op("Neg", f"{base}/amax_smallest_negated", [smallest], T=T)
        return self.op("Maximum", f"{base}/amax", [largest, negated], T=T)

    def _dequantize(self, q: TensorRef, kernel: Int8Kernel, name: str) -> TensorRef:
        keepdims = list(self.variables[kernel.name].shape)
        for axis in kernel.reduced_axes:
            keepdims[axis] = 1
        as_float = self.cast(q, F32, f"{name}/cast")
        shape = self.const(f"{name}/scale_shape", keepdims, INT32)
        # A variable even in a function: grappler turns a division by a constant into a product with its reciprocal.
        scale = self.op("Reshape", f"{name}/scale", [self.read(kernel.scale_name, constant_ok=False), shape],
                        T=_type(F32), Tshape=_type(INT32))
        return self.op("RealDiv", name, [as_float, scale], T=_type(F32))

    def _gather(self, site: Site, kernel: Int8Kernel) -> None:
        """Gather int8 rows and their scales; the lookup's node becomes the division."""
        node = self.graph.nodes[site.node]
        base = f"{node.name}/tfpolicy"
        rows = self.lookup_rows(node, None, INT8, f"{base}/int8_rows")
        scales = self.lookup_rows(node, kernel.scale_name, F32, f"{base}/row_scales")
        # In the layer's compute dtype, as Keras's int8 Embedding divides.
        output_dtype, dtype = self.graph.output_dtypes(node)[0], site.compute_dtype
        T = _type(dtype)
        as_float = self.cast(rows, dtype, f"{base}/cast")
        scales = self.cast(scales, dtype, f"{base}/row_scales_cast")
        trailing = len(self.variables[kernel.name].shape) - 1
        for i in range(trailing):
            axis = self.const(f"{base}/expand_axis_{i}", -1, INT32)
            scales = self.op("ExpandDims", f"{base}/row_scales_expanded_{i}", [scales, axis], T=T, Tdim=_type(INT32))
        if dtype == output_dtype:
            self.graph.redefine(node, "RealDiv", [str(as_float), str(scales)], {"T": T})
        else:  # the lookup's consumers read its original dtype
            divided = self.op("RealDiv", f"{base}/divide", [as_float, scales], T=T)
            self.graph.redefine(node, "Cast", [str(divided)],
                                {"SrcT": T, "DstT": _type(output_dtype), "Truncate": _bool(False)})

    def lookup_rows(self, lookup: Node, variable: Optional[str], dtype: int, name: str) -> TensorRef:
        """The rows embedding ``lookup`` (GatherV2 or ResourceGather) selects.

        From its own table, read as ``dtype`` (``variable`` None), or from the
        same rows of new variable ``variable`` (its scales, its zero points).
        """
        inputs = [ref for _, ref in lookup.data_inputs()]
        if lookup.op == "GatherV2":
            table = inputs[0] if variable is None else self.read(variable, constant_ok=False)
            return self.op("GatherV2", name, [table, *inputs[1:]], **{**lookup.attrs, "Tparams": _type(dtype)})
        handle = inputs[0] if variable is None else TensorRef(self.handle(variable))
        return self.op("ResourceGather", name, [handle, *inputs[1:]], **{**lookup.attrs, "dtype": _type(dtype)})

    def _int8_input(self, site: Site) -> None:
        node = self.graph.nodes[site.node]
        position = site.contraction.input_position
        x = dict(node.data_inputs())[position]
        axes = site.contraction.input_reduced
        key = ("int8", str(x), axes)
        if key not in self._qdq:
            dtype = self.graph.tensor_dtype(x)
            base = f"{site.node}/tfpolicy/input_int8"
            clipped, scale = self._abs_max(x, axes, dtype, base)
            self._qdq[key] = self.op("RealDiv", f"{base}/dequantize", [clipped, scale], T=_type(dtype))
        self.graph.replace_input(node, position, self._qdq[key])

    # -- float8 ----------------------------------------------------------------------

    def _stored_float8_kernels(self) -> dict[int, Float8Group]:
        """The float8 kernels stored quantize-dequantized (see :func:`build_variables`), by uid."""
        if not self.lowering.stores_float8_kernels:
            return {}
        return {g.kernel_uid: g for g in self.qplan.float8_groups.values()
                if g.storable_dtype is not None and g.kernel_name in self.variables}

    def _store_float8_kernel(self, group: Float8Group, reads: list[Node]) -> None:
        """Reads of a stored float8 kernel read its quantize-dequantized value, in the compute dtype.

        The variable now holds what every call computed (``Mul(Cast(Cast(clip(W / s))), s)``,
        elementwise, so it commutes with the layout ops between the read and
        the op)::

            ReadVariableOp:f32 -> Cast(bf16) -> [Reshape] -> MatMul    becomes    ReadVariableOp:bf16 -> [Reshape] -> MatMul
        """
        for read in reads:
            read_in(self.graph, read, group.storable_dtype)

    def _float8(self, site: Site) -> None:
        node = self.graph.nodes[site.node]
        group = self.qplan.float8_groups[(site.layer, site.variable_uid)]
        operands = dict(node.data_inputs())
        stored = site.variable_uid in self._stored_float8_kernels()
        for kind, position in (("inputs", site.contraction.input_position), ("kernel", site.contraction.kernel_position)):
            if kind == "kernel" and stored:
                continue  # the variable holds its quantize-dequantized value
            x = operands[position]
            scale_name = group.name(f"{kind}_scale")
            key = ("float8", str(x), scale_name)
            if key not in self._qdq:
                self._qdq[key] = self._float8_qdq(x, scale_name, f"{site.node}/tfpolicy/{kind}_float8")
                if kind == "inputs":  # kernel scales come from the weights
                    self.taps.add(group, x, self.graph)
            self.graph.replace_input(node, position, self._qdq[key])

    def _float8_qdq(self, x: TensorRef, scale_name: str, base: str) -> TensorRef:
        dtype = self.graph.tensor_dtype(x)
        T = _type(dtype)
        scale = self.scale_as(scale_name, dtype, constant_ok=False)
        divided = self.op("RealDiv", f"{base}/divide", [x, scale], T=T)
        if self.lowering.float8_rounding == "cast":
            clipped = self.op("ClipByValue", f"{base}/clip", [
                divided, self.const(f"{base}/min", -FLOAT8_E4M3_MAX, dtype),
                self.const(f"{base}/max", FLOAT8_E4M3_MAX, dtype)], T=T)
            back = self.cast(self.cast(clipped, FLOAT8, f"{base}/to_float8"), dtype, f"{base}/from_float8")
        else:
            rounded = clip_and_round_to_float8(self, self.cast(divided, DT_FLOAT, f"{base}/to_float32"), f"{base}/round")
            back = self.cast(rounded, dtype, f"{base}/from_float32")
        return self.op("Mul", f"{base}/dequantize", [back, scale], T=T)

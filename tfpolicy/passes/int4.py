"""int4 rewrites of the quantize pass, as Keras 3.15's int4 layers run (weight-only).

A packed kernel (two int4 values a byte) is unpacked in the graph to the
values Keras's ``unpack_int4`` gives: a matmul's kernel, stored in halves of
rows, by masks on 32-bit words (:meth:`Int4Rewrites._unpack_row_halves`),
with a zero point as ``q + 8`` and ``zero + 8``; gathered rows and kernels
of odd shapes, stored as Keras packs them, by a table lookup
(:meth:`Int4Rewrites._nibble_pairs`); then::

    Dense, per channel:         x -> MatMul(Cast(unpacked)) -> RealDiv(kernel_scale)
    EinsumDense, any blocked:   Cast(unpacked) -> RealDiv(scale) or (q - zero[g]) * scale[g]
                                -> Reshape(kernel shape) -> the layer's Einsum / MatMul
    Embedding:                  gather packed rows -> unpack -> RealDiv(row scale) or (q - zero) * scale

:class:`Int4Rewrites` is mixed into :class:`tfpolicy.passes.quantize.QuantizePass`,
whose node helpers (:class:`~tfpolicy.passes.builder.GraphBuilder`: ``op``,
``const``, ``cast``, ``take``, ``read``, ``scale_as``) it uses.
"""

from __future__ import annotations

import functools
import sys
from typing import Optional

import numpy as np

from tfpolicy.analysis.quant_sites import Int4Kernel, QuantPlan, Site
from tfpolicy.core.graph import Node
from tfpolicy.core.tf_names import DT_FLOAT, DT_HALF, DT_UINT8, DT_UINT16, DT_UINT32, TensorRef
from tfpolicy.core.tf_names import bool_attr as _bool
from tfpolicy.core.tf_names import int_attr as _int
from tfpolicy.core.tf_names import type_attr as _type
from tfpolicy.passes.builder import CAPTURE_SCOPE, GraphBuilder
from tfpolicy.passes.quant_variables import F32, INT8, INT32


def _nibble_pair_table() -> np.ndarray:
    """For each byte ``b`` (0..255), its sign-extended low and high nibbles as two int8s in 16 bits, as float16 bits."""
    byte = np.arange(256, dtype=np.int32)
    low = ((byte & 0x0F) ^ 8) - 8
    high = (((byte >> 4) & 0x0F) ^ 8) - 8
    pairs = np.stack([low, high], axis=-1).astype(np.int8)  # little-endian: [low, high] in memory
    return pairs.view(np.uint16).reshape(256).view(np.float16)


NIBBLE_PAIRS = _nibble_pair_table()


@functools.lru_cache(maxsize=1)
def nibble_quad_table() -> np.ndarray:
    """For each little-endian pair of bytes (a uint16), their four sign-extended nibbles as int8s, as float32 bits."""
    pairs = NIBBLE_PAIRS.view(np.int16).view(np.uint8).reshape(256, 2)  # byte -> (low, high) as uint8 bits
    words = np.arange(65536, dtype=np.uint32)
    quads = np.concatenate([pairs[words & 0xFF], pairs[words >> 8]], axis=-1)  # (65536, 4) bytes
    return np.ascontiguousarray(quads).view(np.float32).reshape(65536)


class Int4Rewrites(GraphBuilder):
    """The int4 half of the quantize pass (see the module doc); the pass sets up what is declared here."""

    qplan: QuantPlan
    _unpacked: dict[tuple[str, int], TensorRef]  # (int4 kernel read, offset) -> its int8 values
    _int8_consumers: set[str]  # nodes that read an int8 (or packed int4) kernel as such

    def _unpack_int4(self, packed: TensorRef, columns: int, base: str, shape: Optional[tuple[int, ...]] = None) -> TensorRef:
        """Keras's ``unpack_int4`` along the last axis: each byte's low nibble, then its high one, sign-extended.

        ``shape`` is the packed tensor's when static (a kernel), else it is read
        at run time (gathered rows).
        """
        I8 = _type(INT8)
        if sys.byteorder == "little" and shape is not None and shape[-1] % 2 == 0:
            pairs = self._nibble_quads(packed, shape, base)
        elif sys.byteorder == "little":
            pairs = self._nibble_pairs(packed, base)
        else:
            mask, eight = self.const(f"{base}/mask", 0x0F, INT8), self.const(f"{base}/eight", 8, INT8)
            high = self.op("RightShift", f"{base}/shift", [packed, self.const(f"{base}/four", 4, INT8)], T=I8)
            self._int8_consumers.update({high.node})
            nibbles = []
            for half, source in (("low", packed), ("high", high)):
                nibble = self.op("BitwiseAnd", f"{base}/{half}", [source, mask], T=I8)
                flipped = self.op("BitwiseXor", f"{base}/{half}_xor", [nibble, eight], T=I8)
                nibbles.append(self.op("Sub", f"{base}/{half}_signed", [flipped, eight], T=I8))
                self._int8_consumers.add(nibble.node)
            pairs = self.op("Pack", f"{base}/pairs", nibbles, T=I8, N=_int(2), axis=_int(-1))
        if shape is not None:
            target = self.const(f"{base}/shape", [*shape[:-1], 2 * shape[-1]], INT32)
            packed_columns = shape[-1]
        else:
            packed_columns = (columns + 1) // 2
            leading = self.leading_dims(packed, -1, f"{base}/packed")  # gathered rows: not a kernel read
            target = self.reshape_target(leading, [2 * packed_columns], base)
        unpacked = self.op("Reshape", f"{base}/unpacked", [pairs, target], T=I8, Tshape=_type(INT32))
        if 2 * packed_columns == columns:
            return unpacked
        return self.op("StridedSlice", f"{base}/unpadded", [  # [..., :columns]
            unpacked, self.const(f"{base}/slice_begin", [0, 0], INT32), self.const(f"{base}/slice_end", [0, columns], INT32),
            self.const(f"{base}/slice_strides", [1, 1], INT32)],
            T=I8, Index=_type(INT32), begin_mask=_int(0), end_mask=_int(0), ellipsis_mask=_int(1),
            new_axis_mask=_int(0), shrink_axis_mask=_int(0))

    def _nibble_pairs(self, packed: TensorRef, base: str) -> TensorRef:
        """Each packed byte's two sign-extended nibbles, ``[..., P] -> [..., P, 2]`` int8, by one table lookup.

        The same values as Keras's ``unpack_int4`` ops (shift, mask, xor, sub,
        then a ``Pack`` along the last axis, which TensorFlow runs an element at
        a time), in three passes: the byte as an index into a 256-entry table
        whose entries hold the two int8 values side by side in 16 bits, then
        those 16 bits viewed as two bytes (little-endian: the low nibble first).
        The table is float16 only as a 16-bit container, for which TensorFlow
        has a GPU gather; the bits are moved, never computed on::

            packed:int8 -> Bitcast(uint8) -> Cast(int32) -> GatherV2(table) -> Bitcast(int8) -> [..., P, 2]
        """
        as_bytes = self.op("Bitcast", f"{base}/bytes", [packed], T=_type(INT8), type=_type(DT_UINT8))
        self._int8_consumers.add(as_bytes.node)
        index = self.op("Cast", f"{base}/index", [as_bytes], SrcT=_type(DT_UINT8), DstT=_type(INT32), Truncate=_bool(False))
        table = self.const(f"{base}/nibble_pairs", NIBBLE_PAIRS, DT_HALF)
        pairs16 = self.take(table, index, 0, f"{base}/lookup")
        return self.op("Bitcast", f"{base}/pairs", [pairs16], T=_type(DT_HALF), type=_type(INT8))

    def _nibble_quads(self, packed: TensorRef, shape: tuple[int, ...], base: str) -> TensorRef:
        """:meth:`_nibble_pairs` two bytes at a time: ``[..., P] -> [..., P/2, 4]``, half the lookups.

        Each pair of bytes, as a uint16, indexes a 65536-entry table of their four
        nibbles (float32 as a 32-bit container, one table per graph, 256 KB)::

            packed -> Reshape(..., P/2, 2) -> Bitcast(uint16) -> Cast(int32) -> GatherV2(table) -> Bitcast(int8)
        """
        pairs_of_bytes = self.op("Reshape", f"{base}/byte_pairs", [
            packed, self.const(f"{base}/byte_pairs_shape", [*shape[:-1], shape[-1] // 2, 2], INT32)],
            T=_type(INT8), Tshape=_type(INT32))
        self._int8_consumers.add(pairs_of_bytes.node)
        words = self.op("Bitcast", f"{base}/bytes", [pairs_of_bytes], T=_type(INT8), type=_type(DT_UINT16))
        index = self.op("Cast", f"{base}/index", [words], SrcT=_type(DT_UINT16), DstT=_type(INT32), Truncate=_bool(False))
        table_name = f"{CAPTURE_SCOPE}/int4_nibble_quads"
        table = TensorRef(table_name) if table_name in self.graph.nodes else self.const(table_name, nibble_quad_table(), DT_FLOAT)
        quads = self.take(table, index, 0, f"{base}/lookup")
        return self.op("Bitcast", f"{base}/quads", [quads], T=_type(DT_FLOAT), type=_type(INT8))

    def _unpack_row_halves(self, packed: TensorRef, kernel: Int4Kernel, base: str, signed: bool) -> TensorRef:
        """A kernel packed in halves of rows (:func:`~tfpolicy.passes.quant_variables.pack_int4_row_halves`)
        as ``(rows, columns)`` int8: ``q + 8``, or ``q`` when ``signed``.

        Four bytes at a time, as a uint32 word: the low nibbles are the first
        half's rows, the high nibbles the second half's, and ``(u + 0x78) ^
        0x80`` is ``u - 8`` in every byte (no carry leaves a byte). A third of
        the time of the table lookup that Keras's layout needs::

            packed (rows/2, columns) -> Bitcast(uint32) -> [And(0x0F0F0F0F), And(Shift(4), 0x0F0F0F0F)]
                -> ConcatV2(rows) -> [Xor(Add(0x78787878), 0x80808080)] -> Bitcast(int8) -> (rows, columns)
        """
        I8, U32 = _type(INT8), _type(DT_UINT32)
        words_shape = [kernel.rows // 2, kernel.columns // 4]
        grouped = self.op("Reshape", f"{base}/word_bytes", [packed, self.const(f"{base}/word_bytes_shape", [*words_shape, 4], INT32)],
                          T=I8, Tshape=_type(INT32))
        self._int8_consumers.add(grouped.node)
        words = self.op("Bitcast", f"{base}/words", [grouped], T=I8, type=U32)
        nibbles = self.const(f"{base}/nibbles", 0x0F0F0F0F, DT_UINT32)
        first = self.op("BitwiseAnd", f"{base}/first_half", [words, nibbles], T=U32)
        shifted = self.op("RightShift", f"{base}/high_nibbles", [words, self.const(f"{base}/four", 4, DT_UINT32)], T=U32)
        second = self.op("BitwiseAnd", f"{base}/second_half", [shifted, nibbles], T=U32)
        values = self.op("ConcatV2", f"{base}/rows", [first, second, self.const(f"{base}/row_axis", 0, INT32)],
                         T=U32, N=_int(2), Tidx=_type(INT32))
        if signed:
            biased = self.op("AddV2", f"{base}/biased", [values, self.const(f"{base}/bias", 0x78787878, DT_UINT32)], T=U32)
            values = self.op("BitwiseXor", f"{base}/signed", [biased, self.const(f"{base}/sign_bits", 0x80808080, DT_UINT32)],
                             T=U32)
        as_bytes = self.op("Bitcast", f"{base}/values", [values], T=U32, type=I8)
        return self.op("Reshape", f"{base}/unpacked", [as_bytes, self.const(f"{base}/shape", [kernel.rows, kernel.columns], INT32)],
                       T=I8, Tshape=_type(INT32))

    def _unpacked_kernel(self, read: str, kernel: Int4Kernel, offset_ok: bool = False) -> tuple[TensorRef, int]:
        """The values ``(rows, columns)`` of an int4 kernel read as int8, and the offset they carry.

        The offset is 8 (the values are ``q + 8``) when ``offset_ok`` and the
        kernel is packed in halves of rows (the caller subtracts it with its
        zero point), else 0. Once per read and form.
        """
        offset = 8 if offset_ok and kernel.row_halves else 0
        if (read, offset) not in self._unpacked:
            base = f"{read}/tfpolicy/int4" if offset == 0 else f"{read}/tfpolicy/int4_offset"
            if kernel.row_halves:
                values = self._unpack_row_halves(TensorRef(read), kernel, base, signed=offset == 0)
            else:
                values = self._unpack_int4(TensorRef(read), kernel.columns, base, tuple(self.variables[kernel.name].shape))
            self._unpacked[(read, offset)] = values
        return self._unpacked[(read, offset)], offset

    def _int4_matmul(self, site: Site) -> None:
        """Keras's per-channel int4 Dense: ``matmul(x, cast(unpacked)) / kernel_scale``."""
        node = self.graph.nodes[site.node]
        inputs = dict(node.data_inputs())
        x, old_kernel = inputs[0], inputs[1]
        dtype = self.graph.tensor_dtype(x)
        T = _type(dtype)
        kernel = self.qplan.int4_kernels[site.variable_uid]
        base = f"{site.node}/tfpolicy/int4"
        values = self.cast(self._unpacked_kernel(site.read_node, kernel)[0], dtype, f"{base}/kernel")
        product = self.op(node.op, f"{base}/matmul", [x, values], **node.attrs)
        self.graph.redefine(node, "RealDiv", [str(product), str(self.scale_as(kernel.scale_name, dtype, constant_ok=False))], {"T": T})
        self.graph.remove_if_unused(old_kernel.node)

    def _dequantized_int4(self, read: str, kernel: Int4Kernel, dtype: int) -> TensorRef:
        """The kernel in ``dtype`` and its own shape, dequantized as Keras's int4 EinsumDense (and blocked Dense) do."""
        T = _type(dtype)
        base = f"{read}/tfpolicy/int4_dequantize"
        # With a zero point, the values may carry an offset: q - zero = (q + 8) - (zero + 8), small integers, exact.
        unpacked, offset = self._unpacked_kernel(read, kernel, offset_ok=kernel.block_size is not None)
        values = self.cast(unpacked, dtype, f"{base}/cast")
        if kernel.block_size is not None:
            zero = self.read(kernel.zero_name, constant_ok=False)
            if offset:
                zero = self.op("AddV2", f"{base}/zeros_offset", [zero, self.const(f"{base}/offset", offset, INT8)], T=_type(INT8))
        if kernel.block_size is None:
            value = self.op("RealDiv", f"{base}/divide", [values, self.scale_as(kernel.scale_name, dtype, constant_ok=False)], T=T)
        elif kernel.rows % kernel.block_size == 0:  # (blocks, block, columns) against (blocks, 1, columns): broadcast
            blocks = kernel.rows // kernel.block_size
            grouped = self.op("Reshape", f"{base}/blocks", [
                values, self.const(f"{base}/blocks_shape", [blocks, kernel.block_size, kernel.columns], INT32)],
                T=T, Tshape=_type(INT32))
            one = self.const(f"{base}/block_axis", 1, INT32)
            scales = self.op("ExpandDims", f"{base}/scales", [self.scale_as(kernel.scale_name, dtype, constant_ok=False), one], T=T, Tdim=_type(INT32))
            zeros = self.op("ExpandDims", f"{base}/zeros", [self.cast(zero, dtype, f"{base}/zeros_cast"), one], T=T, Tdim=_type(INT32))
            value = self.op("Mul", f"{base}/multiply", [self.op("Sub", f"{base}/subtract", [grouped, zeros], T=T), scales], T=T)
            value = self.op("Reshape", f"{base}/rows", [value, self.const(f"{base}/rows_shape", [kernel.rows, kernel.columns], INT32)],
                            T=T, Tshape=_type(INT32))
        else:  # a last, shorter block: each row's scale and zero gathered
            groups = self.const(f"{base}/groups", np.arange(kernel.rows) // kernel.block_size, INT32)
            scales = self.take(self.scale_as(kernel.scale_name, dtype, constant_ok=False), groups, 0, f"{base}/scales")
            zeros = self.cast(self.take(zero, groups, 0, f"{base}/zeros_int8"), dtype, f"{base}/zeros")
            value = self.op("Mul", f"{base}/multiply", [self.op("Sub", f"{base}/subtract", [values, zeros], T=T), scales], T=T)
        if tuple(kernel.shape) != (kernel.rows, kernel.columns):
            value = self.op("Reshape", f"{base}/reshape", [value, self.const(f"{base}/shape", list(kernel.shape), INT32)],
                            T=T, Tshape=_type(INT32))
        return value

    def _store_int4(self, kernel: Int4Kernel, reads: list[Node], dtype: int) -> None:
        """Every read of the kernel reads the packed bytes; float consumers read it dequantized in ``dtype``."""
        for read in reads:
            read.attrs["dtype"] = _type(INT8)
            users = [(c, p) for c, p in self.graph.uses(TensorRef(read.name)) if c not in self._int8_consumers]
            if not users:
                continue
            value = self._dequantized_int4(read.name, kernel, dtype)
            as_float32 = None
            for consumer, position in users:
                node = self.graph.nodes[consumer]
                if node.op == "Cast" and node.attrs["DstT"].type == dtype:  # the float pass's cast to the compute dtype
                    self.graph.replace_all_uses_with(TensorRef(node.name), value)
                    self.graph.remove_if_unused(node.name)
                elif dtype == F32:
                    self.graph.replace_input(node, position, value)
                else:
                    as_float32 = as_float32 or self.cast(value, F32, f"{read.name}/tfpolicy/int4_float32")
                    self.graph.replace_input(node, position, as_float32)

    def _int4_gather(self, site: Site, kernel: Int4Kernel) -> None:
        """Gather packed rows, unpack them, and dequantize them as Keras's int4 Embedding does."""
        node = self.graph.nodes[site.node]
        base = f"{node.name}/tfpolicy/int4"
        packed = self.lookup_rows(node, None, INT8, f"{base}/packed_rows")
        gathered = lambda name, dtype: self.lookup_rows(node, name, dtype, f"{base}/row_{name}")  # noqa: E731
        dtype = site.compute_dtype  # as the int8 lookup (see _gather)
        T = _type(dtype)
        values = self.cast(self._unpack_int4(packed, kernel.columns, f"{base}/unpack"), dtype, f"{base}/cast")
        scales = self.cast(gathered(kernel.scale_name, F32), dtype, f"{base}/row_scales_cast")
        if kernel.block_size is None:
            scales = self.op("ExpandDims", f"{base}/row_scales_expanded", [scales, self.const(f"{base}/last", -1, INT32)],
                             T=T, Tdim=_type(INT32))
            value = self.op("RealDiv", f"{base}/divide", [values, scales], T=T)
        else:
            groups = self.const(f"{base}/groups", np.arange(kernel.columns) // kernel.block_size, INT32)
            scales = self.take(scales, groups, -1, f"{base}/scales")
            zeros = self.cast(self.take(gathered(kernel.zero_name, INT8), groups, -1, f"{base}/zeros_int8"), dtype, f"{base}/zeros")
            value = self.op("Mul", f"{base}/multiply", [self.op("Sub", f"{base}/subtract", [values, zeros], T=T), scales], T=T)
        output_dtype = self.graph.output_dtypes(node)[0]
        if dtype == output_dtype:
            self.graph.redefine(node, "Identity", [str(value)], {"T": T})
        else:  # the lookup's consumers read its original dtype
            self.graph.redefine(node, "Cast", [str(value)], {"SrcT": T, "DstT": _type(output_dtype), "Truncate": _bool(False)})

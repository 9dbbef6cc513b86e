"""The frozen records of the quantization analysis: sites, declined ops, new kernels and groups.

:func:`tfpolicy.analysis.quant_sites.analyze` builds a :class:`QuantPlan`;
:mod:`tfpolicy.passes.quantize` rewrites the graphs from it and the report reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from tfpolicy.analysis.quant_rules import Contraction
from tfpolicy.core.tf_names import DT_FLOAT


@dataclasses.dataclass(frozen=True)
class IntegerMatmul:
    """How an int8 site runs as one integer matmul, int8 x int8 -> int32.

    The input is quantized per token to int8 and multiplied with the int8
    kernel variable itself, as Keras's quantized Dense and EinsumDense do. An
    einsum ``<prefix><contracted>,<contracted><free>-><prefix><free>`` is
    that matmul with the contracted and free axes each flattened into one.
    """

    transpose_kernel: bool  # the kernel is (free, contracted): MatMul's transpose_b, adj_y
    contracted: tuple[int, ...]  # sizes of the kernel's contracted axes
    free: tuple[int, ...]  # sizes of its output axes
    prefix_rank: Optional[int]  # einsum: input axes before the contracted ones; None for a matmul
    # Matmuls: the Transpose/Reshape/ExpandDims steps from the variable to the operand,
    # replayed on the int8 kernel; and the order of the (flattened) channel scales
    # along the operand's columns when it is not the variable's own.
    kernel_layout: tuple[tuple[str, tuple[int, ...]], ...] = ()
    scale_order: Optional[tuple[int, ...]] = None

    @property
    def form(self) -> str:
        return "integer matmul"


@dataclasses.dataclass(frozen=True)
class Site:
    """One op to quantize, in one graph of one signature."""

    signature: str
    graph: str
    node: str
    op: str
    layer: str
    mode: str
    contraction: Contraction
    variable_uid: int
    read_node: str  # the ReadVariableOp (or the ResourceGather itself)
    kernel_reduced_axes: tuple[int, ...]  # in the variable's frame, non-negative
    integer: Optional[IntegerMatmul] = None  # int8 contractions that run on integers
    compute_dtype: int = DT_FLOAT  # the layer's
    simulated: str = ""  # why an int8 contraction is not integer: its kernel is dequantized before it
    # int4 per channel on a Dense matmul: Keras multiplies by the integer kernel and divides after.
    int4_rescaled: bool = False

    @property
    def form(self) -> str:
        """What the output runs at this site, for reports."""
        if self.mode == "int4":
            if self.contraction.kind == "gather":
                return "int4 rows gathered"
            if self.int4_rescaled:
                return "int4 kernel, divided by its scale after the matmul"
            return "int4 kernel dequantized before the contraction"
        if self.contraction.kind == "gather":
            return "int8 rows gathered"
        if self.integer is not None:
            return self.integer.form
        if self.mode == "int8":
            return f"dequantized kernel ({self.simulated})"
        return "float8 quantize-dequantize"


@dataclasses.dataclass(frozen=True)
class Declined:
    layer: str
    mode: str
    node: str
    op: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Int8Kernel:
    """A variable stored as int8 plus a float32 ``<name>_scale`` per output channel."""

    uid: int
    name: str
    layer: str
    reduced_axes: tuple[int, ...]
    variable_dtype: str = "float32"  # the layer's policy's: Keras quantizes the kernel as stored in it

    @property
    def scale_name(self) -> str:
        return f"{self.name}_scale"

    @property
    def correction_name(self) -> str:
        """``-128 x`` the kernel's sums per output channel: the int32 bias of the oneDNN lowering."""
        return f"{self.name}_u8_correction"


@dataclasses.dataclass(frozen=True)
class Int4Kernel:
    """A variable stored as packed int4 (two values a byte), as Keras stores it.

    The kernel is viewed as ``(rows, columns)``: for a matmul, its contracted
    axes flattened then its output axes; for an embedding table, ``(vocabulary,
    dim)``. Values are packed along ``columns``. Per channel, ``<name>_scale``
    has one float32 per column (matmul) or per row (embedding); with
    ``block_size``, ``<name>_scale`` and the int8 ``<name>_zero`` have one per
    block and column, as Keras's ``abs_max_quantize_grouped_with_zero_point``.

    A matmul kernel that no gather reads, with even rows and columns a
    multiple of 4 (``row_halves``), is packed for fast unpacking instead:
    ``(rows / 2, columns)``, each byte holding a row of the first half in its
    low nibble and the same row of the second half in its high one, as ``q +
    8`` (0..15), so that unpacking is two masks and a concatenation on 32-bit
    words (:meth:`tfpolicy.passes.int4.Int4Rewrites._unpack_row_halves`).
    """

    uid: int
    name: str
    layer: str
    shape: tuple[int, ...]  # the float variable's
    embedding: bool
    block_size: Optional[int]  # None: per channel
    reduced_rank: int = 1  # how many leading axes are contracted (the embedding's: its rows)
    variable_dtype: str = "float32"  # the layer's policy's: Keras quantizes the kernel as stored in it
    row_halves: bool = False  # packed in halves of rows, as q + 8 (see above); else as Keras packs it

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[: self.reduced_rank]))

    @property
    def columns(self) -> int:
        return int(np.prod(self.shape[self.reduced_rank :]))

    @property
    def scale_name(self) -> str:
        return f"{self.name}_scale"

    @property
    def zero_name(self) -> str:
        return f"{self.name}_zero"


@dataclasses.dataclass(frozen=True)
class Float8Group:
    """The four float8 variables one layer (and kernel) owns."""

    layer: str
    kernel_uid: int
    prefix: str  # "<layer path>" or "<layer path>/<kernel leaf>" when a layer has several
    history_length: int
    kernel_name: str = ""
    # The compute dtype the kernel is read in when only this group's sites read it (through casts and
    # layout ops): its quantize-dequantize can then be stored instead of computed at every call.
    storable_dtype: Optional[int] = None

    def name(self, kind: str) -> str:
        return f"{self.prefix}/{kind}"


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    sites: tuple[Site, ...]
    declined: tuple[Declined, ...]
    int8_kernels: dict[int, Int8Kernel]
    float8_groups: dict[tuple[str, int], Float8Group]
    layers_without_sites: tuple[tuple[str, str], ...]  # (layer path, mode)
    int4_kernels: dict[int, Int4Kernel] = dataclasses.field(default_factory=dict)

    @property
    def integer_kernels(self) -> set[int]:
        """uids of the float variables int8 or int4 copies replace."""
        return set(self.int8_kernels) | set(self.int4_kernels)

    def sites_in(self, signature: str, graph: str) -> list[Site]:
        return [s for s in self.sites if s.signature == signature and s.graph == graph]

    @property
    def empty(self) -> bool:
        return not self.sites

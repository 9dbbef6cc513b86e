"""How the quantized sites are lowered for the serving target: the fastest form that keeps Keras's numbers.

A pure choice from ``--target`` and the machine the rewrite runs on, made
once per rewrite and handed to the quantize pass and the save::

    target    int8 matmul (x int8 per token, kernel int8, exact int32 sums)      signatures
    --------  ------------------------------------------------------------------  -------------------
    none      "float":   the integers multiplied in float32 (runs everywhere)     as they are
    cpu       "onednn":  oneDNN's u8 x s8 kernel, x + 128 and -128 x column sums  as they are
              (only on x86 CPUs whose int8 dot cannot saturate; else "float")
    gpu, tpu  "integer": Keras's int8 x int8 -> int32 BatchMatMulV3, XLA's s8 dot  marked for XLA

All three give the same int32 sums, so the output equals Keras's bit for bit:

* **integer** is Keras's own op. TensorFlow has a generic CPU kernel for it
  and no GPU kernel, so it is only worth serving under XLA, where it becomes
  an ``s8`` GEMM (GPU int8 tensor cores, TPU MXU): the signatures that hold
  such sites are marked for XLA compilation.
* **float** multiplies the same integers as float32 values. Every product is
  exact and every partial sum of a column is an integer of magnitude at most
  ``127 * sum(|w|)`` over the contraction, exact in float32 up to ``2**24``:
  a kernel whose columns stay within that (most: Keras's per-channel scales
  leave trained weights' ``|w|`` far below 127 on average) is one matmul,
  others are cut into the fewest chunks that do, whose int32 results are
  added (never more than chunks of 1040, every ``|w| = 127``). It runs on
  any CPU and GPU, with or without oneDNN, and under XLA, at float32 matmul
  speed.
* **onednn** shifts the int8 input by 128 to uint8 and adds ``-128 * column
  sums`` of the kernel (an int32 variable, ``<kernel>_u8_correction``) as the
  int32 bias of oneDNN's u8 x s8 matmul (TensorFlow's ``_QuantizedMatMul``):
  ``(x + 128) . W - 128 . sum(W) = x . W``. oneDNN runs it on VNNI or AMX
  integer units, and reorders each kernel into the layout its int8 kernel
  wants once, at the first call. Without VNNI, oneDNN multiplies 8-bit pairs
  into saturating 16-bit sums (``vpmaddubsw``), which changes the result, so
  it is chosen only on CPUs with AVX512-VNNI, AVX-VNNI or AMX-INT8. oneDNN
  converts its int32 sum to float32 to add the bias, so a kernel whose sums
  could pass ``2**24`` (many large weights of one sign) is contracted in chunks
  without a bias, added and corrected in int32
  (``quant_variables.u8_exact_chunks``). The op has no GPU or XLA kernel; its
  CPU kernel is in TensorFlow's x86 builds and runs with oneDNN's graph
  rewrites on or off (``TF_ENABLE_ONEDNN_OPTS``). Served on a CPU whose
  oneDNN saturates, a guard in front of the matmuls (a worst-case probe,
  ``QuantizePass._int8_dot_guard_node``) fails the call with a message saying
  why, instead of returning other numbers than Keras's.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import platform
from typing import Any, Optional

from tfpolicy.analysis.plan import OUTSIDE_LAYERS, Plan
from tfpolicy.core import tf_names
from tfpolicy.errors import TargetError

INT8_FORMS = ("integer", "float", "onednn")
ONEDNN_INT8_MATMUL = "_QuantizedMatMul"
"""TensorFlow's op for oneDNN's int8 matmul with a fused bias, which keeps the kernel reordered between calls."""
EXACT_INT8_DOT_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")
"""CPU flags under which oneDNN's u8 x s8 dot accumulates into int32 without a saturating 16-bit step."""


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the lowering depends on in the machine the rewrite runs on."""

    x86: bool
    flags: frozenset[str]
    isa_limit: str = ""  # ONEDNN_MAX_CPU_ISA, which caps the instructions oneDNN uses
    int8_kernel: bool = True  # this TensorFlow build has oneDNN's u8 x s8 -> s32 CPU kernel (ONEDNN_INT8_MATMUL)

    @property
    def exact_int8_dot(self) -> tuple[str, ...]:
        """The CPU flags that give oneDNN an exact int8 dot (empty: it may saturate)."""
        if self.isa_limit and not _isa_has_int8_dot(self.isa_limit):
            return ()
        return tuple(f for f in EXACT_INT8_DOT_FLAGS if f in self.flags)


def _isa_has_int8_dot(isa: str) -> bool:
    """Whether oneDNN capped at ``isa`` (ONEDNN_MAX_CPU_ISA) keeps a 32-bit int8 dot (VNNI, AMX)."""
    isa = isa.upper()
    return isa == "ALL" or any(word in isa for word in ("VNNI", "AMX", "BF16", "FP16", "AVX10"))


@functools.lru_cache(maxsize=1)
def this_machine() -> Machine:
    """This machine: its architecture, its CPU flags (Linux's ``/proc/cpuinfo``), its TensorFlow's int8 kernel."""
    flags: frozenset[str] = frozenset()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = frozenset(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
    isa_limit = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return Machine(x86=x86, flags=flags, isa_limit=isa_limit, int8_kernel=_has_int8_kernel())


def _has_int8_kernel() -> bool:
    """Whether this TensorFlow registers a CPU kernel of ONEDNN_INT8_MATMUL for uint8 x int8 (+ int32) -> int32."""
    return tf_names.cpu_kernel_accepts(ONEDNN_INT8_MATMUL, (
        ("T1", tf_names.DT_QUINT8), ("T2", tf_names.DT_QINT8), ("Tbias", tf_names.DT_QINT32), ("Tout", tf_names.DT_QINT32)))


@dataclasses.dataclass(frozen=True)
class Lowering:
    """The forms the rewrite emits, and what the output then needs to run."""

    target: Optional[str]
    int8_matmul: str  # one of INT8_FORMS
    xla_compile: bool  # mark signatures that hold quantized sites for XLA compilation
    note: str  # what was chosen and why, one sentence for the report and the CLI
    # float8 quantize-dequantize: "cast" (Keras's Casts to float8 and back: the pattern XLA's FP8 GEMM
    # rewriter matches) or "bits" (the same rounding in float32 bit arithmetic, without the slow CPU Cast)
    float8_rounding: str = "bits"

    def __post_init__(self) -> None:
        if self.int8_matmul not in INT8_FORMS:
            raise ValueError(f"unknown int8 matmul form {self.int8_matmul!r}; expected one of {INT8_FORMS}")

    @property
    def stores_float8_kernels(self) -> bool:
        """A float8 kernel's quantize-dequantize (a constant in serving) is stored, not computed at every call.

        Under XLA (``gpu``, ``tpu``) it stays in the graph: it is half of the
        pattern XLA turns into an FP8 GEMM.
        """
        return self.float8_rounding == "bits"

    @property
    def cpu_only(self) -> bool:
        """The output runs only on x86 CPUs (oneDNN's int8 kernel), and does not compile under XLA."""
        return self.int8_matmul == "onednn"

    @property
    def int8_form(self) -> str:
        """How an integer int8 matmul runs, for reports."""
        return {
            "integer": "int8 x int8 -> int32 (XLA s8 GEMM)",
            "float": "int8 values multiplied exactly in float32",
            "onednn": "oneDNN u8 x s8 -> int32 kernel",
        }[self.int8_matmul]

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"int8_form": self.int8_form}


def choose(target: Optional[str], machine: Optional[Machine] = None) -> Lowering:
    """The lowering for ``target`` ("cpu", "gpu", "tpu" or None) on ``machine`` (default: this one)."""
    if target in ("gpu", "tpu"):
        return Lowering(target, "integer", True, float8_rounding="cast", note=
                        f"--target {target}: signatures with quantized layers are marked for XLA compilation, which"
                        " TF Serving honours: int8 matmuls, kept as Keras writes them (int8 x int8 -> int32), become"
                        " s8 GEMMs and float8 quantize-dequantize pairs FP8 GEMMs where the device has them")
    if target != "cpu":
        return Lowering(target, "float", False,
                        "no --target: int8 matmuls multiply their int8 values exactly in float32, which runs on"
                        " every CPU and GPU and under XLA (--target cpu, gpu or tpu picks a faster form)")
    machine = machine or this_machine()
    if not machine.x86:
        why = "this is not an x86 CPU, where oneDNN's int8 matmul runs"
    elif not machine.int8_kernel:
        why = f"this TensorFlow build has no CPU kernel of oneDNN's int8 matmul ({ONEDNN_INT8_MATMUL})"
    elif not machine.exact_int8_dot:
        limit = f"ONEDNN_MAX_CPU_ISA={machine.isa_limit} keeps oneDNN off" if machine.isa_limit else "this CPU has no"
        why = (f"{limit} AVX512-VNNI, AVX-VNNI or AMX-INT8, without which oneDNN's 8-bit multiply-adds"
               " saturate at 16 bits and change the result")
    else:
        return Lowering(target, "onednn", False,
                        f"--target cpu: int8 matmuls run on oneDNN's u8 x s8 kernel (exact on this CPU's"
                        f" {', '.join(machine.exact_int8_dot)}); the output runs only on x86 CPUs (with"
                        " TF_ENABLE_ONEDNN_OPTS on or off), computes Keras's numbers only on CPUs with AVX512-VNNI,"
                        " AVX-VNNI or AMX-INT8 (elsewhere a guard stops it), and its int8 signatures do not compile"
                        " under XLA")
    return Lowering(target, "float", False,
                    f"--target cpu: int8 matmuls multiply their int8 values exactly in float32, because {why}")


# ---------------------------------------------------------------------------
# What a target refuses (a plan rule, before any rewrite)
# ---------------------------------------------------------------------------

TARGETS = ("gpu", "tpu", "cpu")
# dtype -> why a TPU refuses it. Keras policy names that produce each dtype are
# listed in the message; bfloat16 is what TPUs compute in.
_TPU_REFUSED = {
    "float16": "TPUs have no float16 arithmetic",
    "float64": "TPUs have no float64 arithmetic",
    "float8": "TPUs have no float8 matrix units",
}

def check_target_name(target: Optional[str]) -> None:
    if target is not None and target not in TARGETS:
        raise TargetError(f"unknown target '{target}'; choose one of {', '.join(TARGETS)}")


def check_target(plan: Plan, target: Optional[str]) -> None:
    """Refuse a plan whose dtypes ``target`` cannot run (TPU: float16, float8, float64)."""
    check_target_name(target)
    if target != "tpu":
        return
    for dtype, reason in _TPU_REFUSED.items():
        layers = [
            layer for layer in plan.rows()
            if (layer.op_count or layer.variable_count) and dtype in _dtypes_of(layer)
        ]
        if layers:
            names = ", ".join(layer.path or OUTSIDE_LAYERS for layer in layers[:5])
            more = f" and {len(layers) - 5} more" if len(layers) > 5 else ""
            raise TargetError(
                f"--target tpu: policy '{layers[0].policy}' (layers: {names}{more}) uses {dtype}, and {reason};"
                " use bfloat16 instead (mixed_bfloat16 or bfloat16)"
            )


def _dtypes_of(layer: Any) -> set[str]:
    found = {layer.compute_dtype, layer.variable_dtype}
    if layer.quantization_mode and "float8" in layer.quantization_mode:
        found.add("float8")
    return found

"""Compile and time exported XLA HLO on a GPU with JAX's XLA, no TensorFlow needed.

    python tools/gpu_check.py --export_hlo hlo/      # where TensorFlow is (any machine, no GPU)
    python tools/xla_gpu_run.py hlo/ [--json out.json] [--dump_hlo opt/] [--iters 50]

``gpu_check.py --export_hlo`` writes, for each variant (fp32, mixed_bfloat16,
float8, int8 rewrites of the ``tools/bench.py`` encoder, written with
``--target gpu``), the HLO module TensorFlow's XLA bridge builds for
``serving_default`` under ``jit_compile=True`` (what TF Serving compiles for a
function marked for XLA), as a serialized ``HloModuleProto``, and
``manifest.json`` with each module's parameters. This script, on a machine
with a GPU and jaxlib (which carries the same XLA compiler TensorFlow does,
at its own version), converts each module to StableHLO, compiles it for the
GPU, counts in the optimized HLO the GEMMs on float8 operands (cuBLASLt FP8
matmuls or Triton GEMM fusions) and on int8 operands (``s8`` dots), and
times it on random parameters (the model's variables are parameters of the
module; their values do not change which kernels run).

It imports only numpy and jax: the HLO helpers below are shared with
``gpu_check.py``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time
from typing import Any, Optional

GEMM_CALL = re.compile(r'custom_call_target="(__cublas\$[^"]*|__cudnn\$[^"]*)"')
FP8_GEMM = "__cublas$lt$matmul$f8"
FLOAT8_TYPES = ("f8e4m3fn[", "f8e5m2[", "f8e4m3fnuz[", "f8e5m2fnuz[")


def _instructions(hlo: str):
    """(result type by name within its computation, name, type, rest of line) for each instruction."""
    types: dict[str, str] = {}
    for line in hlo.splitlines():
        if line and not line.startswith(" "):  # a new computation
            types = {}
        match = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = (\S+)", line)
        if match:
            types[match.group(1)] = match.group(2)
            yield types, match.group(1), match.group(2), line[match.end():]


GEMM_OPERANDS = re.compile(r"\b(?:dot|custom-call)\(([^)]*)\)")


def _gemm_operands(call: str) -> Optional[list[str]]:
    """The operands of a dot or a cuBLAS/cuDNN GEMM custom call (whatever its result type), else None."""
    if not (re.match(r"\s*dot\(", call) or GEMM_CALL.search(call)):
        # a tuple-typed result leaves "... s8[...]{0}) custom-call(" in ``call``
        if not re.search(r"\)\s*dot\(", call):
            return None
    match = GEMM_OPERANDS.search(call)
    return re.findall(r"%[\w.-]+", match.group(1)) if match else None


def typed_gemms(hlo: str, prefixes: tuple[str, ...]) -> int:
    """Dots and GEMM custom calls whose two first operands both have one of the types ``prefixes``.

    Optimized HLO names operands without their types, so each instruction's
    type is looked up within its computation. A dot inside a fused
    computation (a Triton GEMM fusion) is counted there, once.
    """
    count = 0
    for types, _name, _type, call in _instructions(hlo):
        operands = _gemm_operands(call)
        if operands and len(operands) >= 2 and all(types.get(o, "").startswith(prefixes) for o in operands[:2]):
            count += 1
    return count


def int8_gemms(hlo: str) -> int:
    """GEMMs multiplying int8 by int8 (``s8`` dots, cuBLAS calls or Triton fusions)."""
    return typed_gemms(hlo, ("s8[",))


def float8_gemms(hlo: str) -> int:
    """GEMMs multiplying float8 by float8: XLA's FP8 GEMM rewrite of a dequantized float8 dot."""
    return typed_gemms(hlo, FLOAT8_TYPES)


def gemm_calls(hlo: str) -> dict[str, int]:
    """How many custom calls of each cuBLAS/cuDNN GEMM target the HLO has."""
    counts: dict[str, int] = {}
    for target in GEMM_CALL.findall(hlo):
        counts[target] = counts.get(target, 0) + 1
    return counts


def all_dots(hlo: str) -> int:
    return sum(1 for _t, _n, _ty, call in _instructions(hlo) if _gemm_operands(call) is not None)


# -- running on the device (jax) --------------------------------------------------------------


def _random_parameter(np: Any, rng: Any, shape: list[int], dtype: str):
    if dtype.startswith("int") or dtype.startswith("uint"):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -127), min(info.max, 127) + 1, size=shape).astype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with numpy)

    values = rng.standard_normal(shape).astype(np.float32) * 0.05 + 1.0
    return values.astype(dtype if dtype != "bfloat16" else ml_dtypes.bfloat16)


def _compile(jax: Any, xc: Any, stablehlo: bytes, device: Any):
    backend = device.client
    options = xc.CompileOptions()
    devices = xc.DeviceList((device,)) if hasattr(xc, "DeviceList") else [device]
    if hasattr(backend, "compile_and_load"):
        return backend.compile_and_load(stablehlo, devices, options)
    return backend.compile(stablehlo, devices, options)


def run_module(path: pathlib.Path, parameters: list[dict], iters: int, device: Any) -> dict:
    import jax
    import numpy as np
    from jax._src.lib import xla_client as xc

    stablehlo = xc._xla.mlir.hlo_to_stablehlo(path.read_bytes())
    started = time.perf_counter()
    executable = _compile(jax, xc, stablehlo, device)
    compile_s = time.perf_counter() - started
    hlo = executable.hlo_modules()[0].to_string()
    rng = np.random.default_rng(0)
    args = [jax.device_put(_random_parameter(np, rng, p["shape"], p["dtype"]), device) for p in parameters]

    def call():
        outputs = executable.execute(args)
        for out in outputs:
            out.block_until_ready()
        return outputs

    first = call()
    for _ in range(3):
        call()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    times.sort()
    output = np.asarray(first[0]).astype(np.float32)
    return {
        "compile_s": compile_s,
        "ms_min": 1000 * times[0],
        "ms_median": 1000 * times[len(times) // 2],
        "float8_gemms": float8_gemms(hlo),
        "int8_gemms": int8_gemms(hlo),
        "gemms": all_dots(hlo),
        "gemm_calls": gemm_calls(hlo),
        "finite": bool(np.all(np.isfinite(output))),
        "hlo": hlo,
    }


def format_table(rows: dict[str, dict]) -> str:
    header = ("module", "compile s", "ms min", "ms median", "vs fp32", "GEMMs", "FP8 GEMMs", "int8 GEMMs", "note")
    lines = []
    for name, row in rows.items():
        if "ms_min" not in row:
            lines.append((name, "-", "-", "-", "-", "-", "-", "-", row.get("note", "")[:100]))
            continue
        base = rows.get(row.get("baseline", ""), {}).get("ms_min")
        ratio = f"{row['ms_min'] / base:.2f}x" if base else "-"
        lines.append((name, f"{row['compile_s']:.1f}", f"{row['ms_min']:.2f}", f"{row['ms_median']:.2f}", ratio,
                      str(row["gemms"]), str(row["float8_gemms"]), str(row["int8_gemms"]), row.get("note", "")[:100]))
    widths = [max(len(r[i]) for r in (header, *lines)) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=pathlib.Path, help="what gpu_check.py --export_hlo wrote")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--dump_hlo", type=pathlib.Path, help="write each module's optimized HLO here")
    parser.add_argument("--only", default="", help="comma-separated module names to run (default: all)")
    parser.add_argument("--platform", default="gpu", help="jax platform to run on (cpu checks the script, not a GPU)")
    args = parser.parse_args(argv)
    import jax

    devices = [d for d in jax.devices() if d.platform == args.platform]
    if not devices:
        print(f"xla_gpu_run: no {args.platform} device visible to jax ({jax.devices()})", file=sys.stderr)
        return 2
    device = devices[0]
    print(f"jax {jax.__version__} on {getattr(device, 'device_kind', device)}", flush=True)
    manifest = json.loads((args.directory / "manifest.json").read_text())
    wanted = set(filter(None, args.only.split(",")))
    rows: dict[str, dict] = {}
    for name, entry in manifest["modules"].items():
        if wanted and name not in wanted:
            continue
        rows[name] = {"baseline": entry.get("baseline", ""), "note": entry.get("note", "")}
        try:
            rows[name].update(run_module(args.directory / entry["file"], entry["parameters"], args.iters, device))
        except Exception as exc:  # noqa: BLE001  (one module failing is a finding; the others still run)
            rows[name]["note"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        row = rows[name]
        print(f"  {name}: " + (f"{row['ms_min']:.2f} ms, {row['float8_gemms']} FP8 / {row['int8_gemms']} int8 of "
                               f"{row['gemms']} GEMMs" if "ms_min" in row else row["note"]), flush=True)
        if args.dump_hlo and "hlo" in row:
            args.dump_hlo.mkdir(parents=True, exist_ok=True)
            (args.dump_hlo / f"{name}.optimized_hlo.txt").write_text(row["hlo"])
    print(format_table(rows))
    if args.json:
        clean = {name: {k: v for k, v in row.items() if k != "hlo"} for name, row in rows.items()}
        args.json.write_text(json.dumps({"jax": jax.__version__, "device": str(getattr(device, "device_kind", device)),
                                         "source": manifest.get("source", {}), "modules": clean}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

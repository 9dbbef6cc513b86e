"""GPU check: fp32 vs mixed_bfloat16 vs float8 vs int8 rewrites of a Keras 3 encoder under XLA.

    pip install -e '.[gpu]'            # TensorFlow with its CUDA wheels
    python tools/gpu_check.py          # depth 4, width 1024, seq 256, batch 32: a few minutes
    python tools/gpu_check.py --json out.json --dump_hlo hlo/ --require_fp8

Builds the transformer encoder of ``tools/bench.py`` (Keras 3, float32,
``model.export``), rewrites it with tfpolicy three times::

    fp32             the exported model itself
    mixed_bfloat16   {"default_policy": "mixed_bfloat16"}
    float8           mixed_bfloat16, with every Dense and attention projection
                     float8_from_mixed_bfloat16
    int8             the same layers int8_from_mixed_bfloat16 (integer matmuls)

and runs each ``serving_default`` under ``tf.function(jit_compile=True)`` on
the GPU. It prints compile time, latency and throughput of each, and, from the
optimized HLO XLA produced, how many GEMMs became cuBLASLt FP8 matmuls (custom
call ``__cublas$lt$matmul$f8``): XLA's GEMM rewriter turns a dot whose operands
are dequantized float8 into one on GPUs that have FP8 tensor cores (compute
capability 8.9 and later: Ada, Hopper, Blackwell), and how many GEMMs multiply
int8 by int8 (an ``s8`` dot, cuBLAS custom call or Triton GEMM fusion): the
int8 tensor-core path of tfpolicy's integer matmuls.

A variant tfpolicy refuses (a policy this version cannot apply) is reported as
skipped, one XLA cannot run as failed; neither stops the others. Without a GPU
the script stops with advice, unless ``--allow_cpu`` (used by the test suite
with ``--smoke``).

Exit status: 0; 1 with ``--require_fp8`` when the float8 variant ran without
any FP8 GEMM; 2 when no GPU is visible (and ``--allow_cpu`` was not given).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import tempfile
import time
from typing import Any, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tools"))

from xla_gpu_run import int8_gemms  # noqa: E402  (tools/xla_gpu_run.py: HLO counting shared with the jax runner)

FP8_GEMM = "__cublas$lt$matmul$f8"
GEMM_TARGETS = ("__cublas$lt$matmul$f8", "__cublas$lt$matmul", "__cublas$gemm")
FLOAT8 = "float8_from_mixed_bfloat16"
INT8 = "int8_from_mixed_bfloat16"
PROJECTIONS = (r"block_\d+_ffn_(in|out)", r"block_\d+_mha/(query|key|value|attention_output)")
VARIANTS: dict[str, Optional[dict]] = {
    "fp32": None,
    "mixed_bfloat16": {"default_policy": "mixed_bfloat16"},
    "float8": {
        "default_policy": "mixed_bfloat16",
        "policy_map": {pattern: FLOAT8 for pattern in PROJECTIONS},
    },
    "int8": {
        "default_policy": "mixed_bfloat16",
        "policy_map": {pattern: INT8 for pattern in PROJECTIONS},
    },
}
SMOKE = {"depth": 1, "width": 64, "heads": 2, "seq": 16, "ffn": 128, "batch": 4, "iters": 3}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iters", type=int, default=50, help="timed calls per variant after the compiling one")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and 3 calls: checks the script, not the GPU")
    parser.add_argument("--allow_cpu", action="store_true", help="run without a GPU (numbers mean nothing)")
    parser.add_argument("--require_fp8", action="store_true", help="exit 1 unless the float8 variant has FP8 GEMMs")
    parser.add_argument("--json", type=pathlib.Path, help="also write the results as JSON")
    parser.add_argument("--dump_hlo", type=pathlib.Path, help="write each variant's optimized HLO here")
    parser.add_argument("--workdir", type=pathlib.Path, help="keep the SavedModels here (default: a temporary dir)")
    parser.add_argument("--target", default="gpu", choices=["gpu", "none"],
                        help="the --target the variants are written with (default gpu; none: the portable forms)")
    parser.add_argument("--export_hlo", type=pathlib.Path, metavar="DIR",
                        help="no GPU needed: write each variant's XLA HLO (as TF Serving would compile it) and a"
                             " manifest to DIR, for tools/xla_gpu_run.py on a GPU machine with jax")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def device_report(tf: Any) -> tuple[Optional[str], str]:
    """(device to run on or None, one line describing the machine)."""
    gpus = tf.config.list_physical_devices("GPU")
    build = tf.sysconfig.get_build_info()
    cuda = f"CUDA {build.get('cuda_version', '?')}, cuDNN {build.get('cudnn_version', '?')}" if build.get("is_cuda_build") else "CPU-only build"
    if not gpus:
        return None, f"TensorFlow {tf.__version__} ({cuda}): no GPU visible"
    details = tf.config.experimental.get_device_details(gpus[0])
    capability = details.get("compute_capability")
    fp8 = capability is not None and tuple(capability) >= (8, 9)
    name = details.get("device_name", "GPU")
    return "/GPU:0", (
        f"TensorFlow {tf.__version__} ({cuda}); {len(gpus)} GPU(s), using {name}, compute capability"
        f" {'.'.join(map(str, capability)) if capability else '?'} ({'has' if fp8 else 'no'} FP8 tensor cores)"
    )


def export_encoder(args: argparse.Namespace, workdir: pathlib.Path) -> pathlib.Path:
    from bench import build_encoder  # tools/bench.py

    model = build_encoder(args.depth, args.width, args.heads, args.seq, args.ffn)
    path = workdir / "fp32"
    model.export(str(path), verbose=False)
    return path


def make_variant(name: str, fp32_dir: pathlib.Path, workdir: pathlib.Path,
                 target: Optional[str] = "gpu") -> tuple[Optional[pathlib.Path], str]:
    """(SavedModel dir or None, note): the variant written for ``target`` (default ``--target gpu``)."""
    import tfpolicy

    policy_map = VARIANTS[name]
    if policy_map is None:
        return fp32_dir, ""
    out = workdir / name
    started = time.perf_counter()
    try:
        tfpolicy.rewrite(fp32_dir, out, policy_map, overwrite=True, serving_checks=False, target=target)
    except tfpolicy.TfPolicyError as exc:
        return None, f"skipped: {exc}"
    return out, f"rewritten in {time.perf_counter() - started:.1f}s"


def measure(tf: Any, saved_model: pathlib.Path, device: str, args: argparse.Namespace) -> dict:
    import numpy as np

    loaded = tf.saved_model.load(str(saved_model))  # keep: the signature reads its variables
    signature = loaded.signatures["serving_default"]
    (name,) = signature.structured_input_signature[1]
    tokens = np.random.default_rng(0).standard_normal((args.batch, args.seq, args.width)).astype(np.float32)
    with tf.device(device):
        x = tf.constant(tokens)
        run = tf.function(lambda t: signature(**{name: t}), jit_compile=True)
        started = time.perf_counter()
        first = run(x)
        list(first.values())[0].numpy()
        compile_s = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(args.iters):
            result = run(x)
        output = list(result.values())[0].numpy()
        elapsed = time.perf_counter() - started
        hlo = run.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    return {
        "compile_s": compile_s,
        "ms_per_batch": 1000 * elapsed / max(args.iters, 1),
        "examples_per_s": args.batch * args.iters / elapsed if elapsed > 0 else float("nan"),
        "gemm_calls": {target: hlo.count(f'custom_call_target="{target}"') for target in GEMM_TARGETS},
        "int8_gemms": int8_gemms(hlo),
        "f8_in_hlo": "f8e4m3fn" in hlo or "f8e5m2" in hlo,
        "finite": bool(np.all(np.isfinite(output))),
        "hlo": hlo,
    }


HLO_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "s8": "int8", "u8": "uint8", "s32": "int32",
              "s64": "int64", "pred": "bool", "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2", "f64": "float64"}


def hlo_parameters(hlo: str) -> list[dict]:
    """The entry computation's parameters, in order: ``[{"shape": [...], "dtype": numpy name}]``."""
    entry = hlo[hlo.index("\nENTRY "):]
    found = {}
    for match in re.finditer(r"= (\w+)\[([\d,]*)\](?:\{[^}]*\})? parameter\((\d+)\)", entry):
        dims = [int(d) for d in match.group(2).split(",") if d]
        found[int(match.group(3))] = {"shape": dims, "dtype": HLO_DTYPES[match.group(1)]}
    return [found[i] for i in sorted(found)]


def export_hlo(tf: Any, saved_model: pathlib.Path, args: argparse.Namespace, name: str, out: pathlib.Path) -> dict:
    """Write ``serving_default``'s HLO under ``jit_compile=True`` to ``out/name.hlo.pb``; its manifest entry."""
    import numpy as np

    loaded = tf.saved_model.load(str(saved_model))
    signature = loaded.signatures["serving_default"]
    (input_name,) = signature.structured_input_signature[1]
    x = tf.constant(np.zeros((args.batch, args.seq, args.width), np.float32))
    run = tf.function(lambda t: signature(**{input_name: t}), jit_compile=True)
    ir = run.experimental_get_compiler_ir(x)
    (out / f"{name}.hlo.pb").write_bytes(ir(stage="hlo_serialized"))
    return {"file": f"{name}.hlo.pb", "parameters": hlo_parameters(ir(stage="hlo")), "baseline": "fp32"}


def export_all(tf: Any, args: argparse.Namespace, workdir: pathlib.Path) -> int:
    """``--export_hlo``: every variant's HLO and a manifest, for tools/xla_gpu_run.py."""
    args.export_hlo.mkdir(parents=True, exist_ok=True)
    fp32_dir = export_encoder(args, workdir)
    shape = {k: getattr(args, k) for k in ("depth", "width", "heads", "seq", "ffn", "batch")}
    modules = {}
    target = None if args.target == "none" else args.target
    for name in VARIANTS:
        path, note = make_variant(name, fp32_dir, workdir, target)
        if path is None:
            print(f"  {name}: {note}", flush=True)
            continue
        modules[name] = export_hlo(tf, path, args, name, args.export_hlo) | {"note": note}
        print(f"  {name}: {len(modules[name]['parameters'])} parameters", flush=True)
    manifest = {"source": {"tensorflow": tf.__version__, "encoder": shape, "target": args.target}, "modules": modules}
    (args.export_hlo / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {len(modules)} HLO modules to {args.export_hlo}; on the GPU machine: python tools/xla_gpu_run.py {args.export_hlo}")
    return 0


def _error_line(exc: BaseException) -> str:
    """The informative line of a TensorFlow error (not its "in user code:" header)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if "Error" in line or "error" in line] or lines or [type(exc).__name__]
    return useful[0][:300]


def format_table(rows: dict[str, dict]) -> str:
    base = rows.get("fp32", {}).get("examples_per_s")
    header = ("variant", "compile s", "ms/batch", "examples/s", "vs fp32", "FP8 GEMMs", "int8 GEMMs", "other GEMMs", "note")
    lines = []
    for name, row in rows.items():
        if "examples_per_s" not in row:
            lines.append((name, "-", "-", "-", "-", "-", "-", "-", _short(row.get("note", ""))))
            continue
        calls = row["gemm_calls"]
        other = sum(n for t, n in calls.items() if t != FP8_GEMM)
        speedup = f"{row['examples_per_s'] / base:.2f}x" if base else "-"
        lines.append((name, f"{row['compile_s']:.1f}", f"{row['ms_per_batch']:.2f}", f"{row['examples_per_s']:.0f}",
                      speedup, str(calls[FP8_GEMM]), str(row["int8_gemms"]), str(other), _short(row.get("note", ""))))
    widths = [max(len(r[i]) for r in (header, *lines)) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]
    return "\n".join(out)


def _short(note: str, limit: int = 90) -> str:
    return note if len(note) <= limit else note[: limit - 3] + "..."


def verdict(rows: dict[str, dict], device: str = "/GPU:0") -> tuple[str, bool]:
    """(one line about FP8 GEMMs, whether the float8 variant got any)."""
    row = rows.get("float8", {})
    if "examples_per_s" not in row:
        return f"float8: not run ({row.get('note', 'unknown')})", False
    if device.startswith("/CPU"):
        return "float8: ran on the CPU, where XLA has no FP8 GEMM; run this on a GPU with compute capability 8.9+", False
    n = row["gemm_calls"][FP8_GEMM]
    if n:
        return f"float8: XLA turned {n} dot(s) into FP8 GEMMs ({FP8_GEMM})", True
    reason = "float8 values reach XLA, but no dot was rewritten" if row["f8_in_hlo"] else "no float8 values in the optimized HLO"
    return f"float8: NO FP8 GEMM in the optimized HLO ({reason})", False


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import tensorflow as tf

    if args.export_hlo:
        with tempfile.TemporaryDirectory(prefix="tfpolicy-gpu-check-") as tmp:
            return export_all(tf, args, args.workdir or pathlib.Path(tmp))
    device, machine = device_report(tf)
    print(machine, flush=True)
    if device is None:
        if not args.allow_cpu:
            print("gpu_check: no GPU visible to TensorFlow. On an NVIDIA machine install TensorFlow's CUDA wheels"
                  " (pip install -e '.[gpu]', i.e. tensorflow[and-cuda]) and check nvidia-smi.", file=sys.stderr)
            return 2
        device = "/CPU:0"
    shape = {k: getattr(args, k) for k in ("depth", "width", "heads", "seq", "ffn", "batch", "iters")}
    print(f"encoder {shape}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tfpolicy-gpu-check-") as tmp:
        workdir = args.workdir or pathlib.Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        fp32_dir = export_encoder(args, workdir)
        rows: dict[str, dict] = {}
        for name in VARIANTS:
            path, note = make_variant(name, fp32_dir, workdir, None if args.target == "none" else args.target)
            rows[name] = {"note": note}
            if path is None:
                continue
            try:
                rows[name].update(measure(tf, path, device, args))
            except Exception as exc:  # noqa: BLE001  (a variant XLA cannot run is a finding, not a crash)
                rows[name]["note"] = f"failed under XLA: {_error_line(exc)}"
            print(f"  {name}: done", flush=True)
        if args.dump_hlo:
            args.dump_hlo.mkdir(parents=True, exist_ok=True)
            for name, row in rows.items():
                if "hlo" in row:
                    (args.dump_hlo / f"{name}.optimized_hlo.txt").write_text(row["hlo"])
    print(format_table(rows))
    line, has_fp8 = verdict(rows, device)
    print(line)
    int8 = rows.get("int8", {})
    print(f"int8: {int8['int8_gemms']} GEMM(s) with int8 operands" if "int8_gemms" in int8
          else f"int8: not run ({int8.get('note', 'unknown')})")
    if args.json:
        clean = {name: {k: v for k, v in row.items() if k != "hlo"} for name, row in rows.items()}
        args.json.write_text(json.dumps({"machine": machine, "shape": shape, "variants": clean, "verdict": line}, indent=2) + "\n")
    if args.require_fp8 and not has_fp8:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tools/gpu_check.py stays runnable: its smoke mode on this machine's CPU.

The real check needs an NVIDIA GPU (see the README); here it runs a tiny
encoder on the CPU so that the script, its variants and its output do not rot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from cli_helpers import REPO_ROOT

pytestmark = pytest.mark.slow  # runs the GPU check script's CPU smoke mode

SCRIPT = REPO_ROOT / "tools" / "gpu_check.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


def test_smoke_run_measures_fp32_and_bf16_and_reports_float8(tmp_path):
    result = run_script("--smoke", "--allow_cpu", "--json", str(tmp_path / "out.json"), "--dump_hlo", str(tmp_path / "hlo"))
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "out.json").read_text())
    variants = document["variants"]
    assert list(variants) == ["fp32", "mixed_bfloat16", "float8", "int8"]
    for name in ("fp32", "mixed_bfloat16"):
        assert variants[name]["examples_per_s"] > 0 and variants[name]["finite"] is True, variants[name]
        assert (tmp_path / "hlo" / f"{name}.optimized_hlo.txt").read_text().startswith("HloModule")
    float8 = variants["float8"]
    assert "examples_per_s" in float8 or float8["note"].startswith("skipped:"), float8
    assert document["verdict"].startswith("float8: ")
    # The smoke encoder's six projections (q, k, v, output, two FFN) are s8 x s8 dots in XLA's optimized HLO.
    assert variants["int8"]["int8_gemms"] == 6 and variants["mixed_bfloat16"]["int8_gemms"] == 0, variants["int8"]
    assert "int8: 6 GEMM(s) with int8 operands" in result.stdout
    assert "variant" in result.stdout and "FP8 GEMMs" in result.stdout


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="this machine has a GPU")
def test_without_a_gpu_it_stops_with_advice():
    result = run_script("--smoke")
    assert result.returncode == 2
    assert "no GPU visible" in result.stderr and "tensorflow[and-cuda]" in result.stderr


def test_export_hlo_writes_modules_and_manifest_for_the_jax_runner(tmp_path):
    """--export_hlo needs no GPU: each variant's HLO proto and its parameters, for tools/xla_gpu_run.py."""
    result = run_script("--smoke", "--export_hlo", str(tmp_path / "hlo"))
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((tmp_path / "hlo" / "manifest.json").read_text())
    assert list(manifest["modules"]) == ["fp32", "mixed_bfloat16", "float8", "int8"]
    for name, entry in manifest["modules"].items():
        assert (tmp_path / "hlo" / entry["file"]).stat().st_size > 0
        first = entry["parameters"][0]
        assert first == {"shape": [4, 16, 64], "dtype": "float32"}, (name, first)
    int8_dtypes = {p["dtype"] for p in manifest["modules"]["int8"]["parameters"]}
    assert "int8" in int8_dtypes and "int8" not in {p["dtype"] for p in manifest["modules"]["fp32"]["parameters"]}


def test_hlo_counters_read_tuple_typed_gemm_calls_and_fused_dots():
    """Optimized GPU HLO: cuBLASLt calls return (result, workspace) tuples; Triton GEMMs are dots in fusions."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import xla_gpu_run

    hlo = "\n".join([
        "%triton_gemm (p0: s8[8,16], p1: s8[16,4]) -> s32[8,4] {",
        "  %p0 = s8[8,16]{1,0} parameter(0)",
        "  %p1 = s8[16,4]{1,0} parameter(1)",
        "  ROOT %dot.1 = s32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "}",
        "",
        "ENTRY %main (a: f8e4m3fn[16,16], b: f8e4m3fn[16,16], c: bf16[16,16]) -> bf16[16,16] {",
        "  %a = f8e4m3fn[16,16]{1,0} parameter(0)",
        "  %b = f8e4m3fn[16,16]{1,0} parameter(1)",
        "  %c = bf16[16,16]{1,0} parameter(2)",
        '  %cublas-lt-matmul = (bf16[16,16]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"',
        '  %gemm.2 = (bf16[16,16]{1,0}, s8[4194304]{0}) custom-call(%c, %c), custom_call_target="__cublas$lt$matmul"',
        "  ROOT %r = bf16[16,16]{1,0} get-tuple-element(%cublas-lt-matmul), index=0",
        "}",
    ])
    assert xla_gpu_run.float8_gemms(hlo) == 1
    assert xla_gpu_run.int8_gemms(hlo) == 1
    assert xla_gpu_run.all_dots(hlo) == 3
    assert xla_gpu_run.gemm_calls(hlo) == {"__cublas$lt$matmul$f8": 1, "__cublas$lt$matmul": 1}

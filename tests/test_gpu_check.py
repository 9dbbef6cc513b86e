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

"""tools/onednn_trace.py: oneDNN's own log of a served SavedModel, counted per call."""

from __future__ import annotations

import pathlib
import platform
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tools"))

import onednn_trace  # noqa: E402

EXAMPLE = REPO_ROOT / "examples" / "mlp" / "saved_model"


def test_parse_groups_each_calls_primitives_by_kind_implementation_and_types():
    log = "\n".join([
        "onednn_verbose,v1,info,oneDNN v3.7",  # before the first call: not counted
        f"{onednn_trace.MARK} 0",
        "onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:s8::blocked:ba::f0 dst:s8::blocked:ab::f0,,,3072x768,0.5",
        "onednn_verbose,v1,primitive,exec,cpu,inner_product,brgemm:avx512_core_amx,forward_inference,"
        "src:u8::blocked:ab::f0 wei:s8:a:blocked:BA16a64b4a::f0 bia:f32:a:blocked:a::f0 dst:s32::blocked:ab::f0,,,mb8ic768oc3072,2.0",
        "onednn_verbose,v1,primitive,exec,cpu,inner_product,brgemm:avx512_core_amx,forward_inference,"
        "src:u8::blocked:ab::f0 wei:s8:a:blocked:BA16a64b4a::f0 bia:f32:a:blocked:a::f0 dst:s32::blocked:ab::f0,,,mb8ic3072oc768,1.5",
        f"{onednn_trace.MARK} 1",
        "onednn_verbose,v1,primitive,exec,cpu,inner_product,brgemm:avx512_core_amx,forward_inference,"
        "src:u8::blocked:ab::f0 wei:s8:a:blocked:BA16a64b4a::f0 bia:f32:a:blocked:a::f0 dst:s32::blocked:ab::f0,,,mb8ic768oc3072,1.0",
        "some other line",
        f"{onednn_trace.MARK} end",
        "onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:f32 dst:f32,,,8,0.1",  # after the last call
    ])
    calls = onednn_trace.parse(log)
    assert sorted(calls) == [0, 1]
    (product, reorder) = calls[0]
    assert (product.kind, product.implementation, product.types) == (
        "inner_product", "brgemm:avx512_core_amx", "src:u8 wei:s8 bia:f32 dst:s32")
    assert (product.count, product.ms) == (2, 3.5)
    assert (reorder.kind, reorder.types, reorder.count) == ("reorder", "src:s8 dst:s8", 1)
    assert [(r.kind, r.count, r.ms) for r in calls[1]] == [("inner_product", 1, 1.0)]


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="oneDNN's CPU kernels: x86")
def test_the_example_served_with_onednn_on_shows_its_float32_matmuls_in_every_call(capsys):
    calls = onednn_trace.main(["--calls", "2", "--batch", "4", "--onednn_opts", "1", str(EXAMPLE)])
    assert sorted(calls) == [0, 1]
    for rows in calls.values():
        assert any(r.kind in ("matmul", "inner_product") and "src:f32" in r.types and r.count for r in rows), rows
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| call | primitive |") and any(line.startswith("| 1 |") for line in table)


def test_a_model_that_does_not_run_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^onednn_trace: .* did not run \(exit [0-9]+\): "):
        onednn_trace.trace(str(tmp_path / "missing"), calls=1, batch=1)

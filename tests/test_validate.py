"""Validation: per-output and per-layer error between the float and the rewritten model.

Real zoo models rewritten with float policies whose error is measurable
(mixed_float16, bfloat16). The per-layer ranking is checked on maps where the
answer is known: one layer in a coarser dtype than all the others.
"""

from __future__ import annotations

import html.parser
import json
import math
import pathlib

import numpy as np
import pytest

import tfpolicy
from tfpolicy.errors import InputDataError
from tfpolicy.validation import html_report
from cli_helpers import describe, run_cli, tree_digest

pytestmark = pytest.mark.slow  # runs models before and after, layer by layer


UPSTREAM_OF_FFN_IN = ("mha/query", "mha/key", "mha/value", "mha", "mha/attention_output", "add_1", "ln_1")


def rewrite(zoo_model, tmp_path: pathlib.Path, policy_map: dict, name: str = "out") -> pathlib.Path:
    tfpolicy.rewrite(zoo_model.saved_model_dir, tmp_path / name, policy_map, serving_checks=False)
    return tmp_path / name


@pytest.fixture(scope="module")
def transformer(zoo):
    return zoo.get("keras3_transformer")


@pytest.fixture(scope="module")
def ffn_in_bf16(transformer, tmp_path_factory):
    """Everything float32 but ffn_in, which computes and stores in bfloat16."""
    out = rewrite(transformer, tmp_path_factory.mktemp("val"), {"default_policy": "float32", "policy_map": {"ffn_in": "bfloat16"}})
    return tfpolicy.validate(transformer.saved_model_dir, out)


def test_float32_map_validates_to_zero_error(zoo, tmp_path):
    model = zoo.get("keras3_mlp")
    out = rewrite(model, tmp_path, {"default_policy": "float32"})
    report = tfpolicy.validate(model.saved_model_dir, out, max_error=0.0)
    assert report.passed and {o.signature for o in report.outputs} == {"serve", "serving_default"}
    for output in report.outputs:
        assert output.max_abs_error == 0.0 and output.max_rel_error == 0.0 and output.cosine == pytest.approx(1.0)
    assert {s.layer for s in report.layers} >= {"dense", "dense_1", "head"}
    assert all(s.rel_error == 0.0 and s.cumulative_rel_error == 0.0 for s in report.layers)


def test_output_metrics_match_numpy_on_the_same_inputs(zoo, tmp_path):
    model = zoo.get("keras3_mlp")
    out = rewrite(model, tmp_path, {"default_policy": "mixed_float16"})
    data = {"features": np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)}
    report = tfpolicy.validate(model.saved_model_dir, out, data=data, signatures=["serving_default"], layers=False)
    from model_zoo import run_signature

    ref = run_signature(model.saved_model_dir, "serving_default", data)["output_0"].astype(np.float64)
    got = run_signature(out, "serving_default", data)["output_0"].astype(np.float64)
    (stats,) = report.outputs
    assert stats.max_abs_error == pytest.approx(np.max(np.abs(got - ref)))
    assert stats.max_rel_error == pytest.approx(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    cosine = float(np.sum(ref * got) / np.linalg.norm(ref) / np.linalg.norm(got))
    assert stats.cosine == pytest.approx(cosine)
    assert 0 < stats.max_abs_error < 0.05  # float16 arithmetic: measurable, small
    assert report.inputs == {"serving_default": "validation data"} and report.examples == {"serving_default": 40}
    assert report.layers == []


def test_the_one_bfloat16_layer_is_named_first_and_float32_layers_before_it_add_nothing(ffn_in_bf16):
    layers = {s.layer: s for s in ffn_in_bf16.layers}
    assert ffn_in_bf16.layers[0].layer == "ffn_in", ffn_in_bf16.format_table(top=20)
    assert layers["ffn_in"].rel_error > 1e-4
    for path in UPSTREAM_OF_FFN_IN:  # float32 and fed exact float inputs: bit-identical
        assert layers[path].rel_error == 0.0 and layers[path].cumulative_rel_error == 0.0, path
    # Downstream float32 layers add little themselves but carry ffn_in's error.
    assert layers["head"].cumulative_rel_error > 10 * layers["head"].rel_error


def test_coarser_layer_ranks_first_among_low_precision_layers(transformer, tmp_path):
    out = rewrite(transformer, tmp_path, {"default_policy": "mixed_float16", "policy_map": {"ffn_out": "bfloat16"}})
    report = tfpolicy.validate(transformer.saved_model_dir, out)
    assert report.layers[0].layer == "ffn_out", report.format_table(top=20)
    assert report.layer_signature == "serving_default"
    ranked = [s.rel_error for s in report.layers]
    assert ranked == sorted(ranked, reverse=True)


def test_max_error_decides_pass_or_fail(ffn_in_bf16):
    measured = max(o.max_abs_error for o in ffn_in_bf16.outputs)
    assert measured > 0
    assert ffn_in_bf16.exceeded(measured) == [] and len(ffn_in_bf16.exceeded(measured / 2)) == len(ffn_in_bf16.outputs)
    ffn_in_bf16.max_error = measured / 2
    try:
        assert not ffn_in_bf16.passed and "exceeds --max_error" in ffn_in_bf16.failure_line()
    finally:
        ffn_in_bf16.max_error = None


def test_report_json_is_strict_json(ffn_in_bf16):
    document = json.loads(json.dumps(ffn_in_bf16.to_json(), allow_nan=False))
    assert document["layers"][0]["layer"] == "ffn_in"
    assert {"max_abs_error", "max_rel_error", "cosine"} <= set(document["outputs"][0])


def test_signatures_the_data_does_not_fit_run_on_generated_inputs(zoo, tmp_path):
    model = zoo.get("tf_module")  # serving_default takes x (None, 8); decode takes code (None, 16)
    out = rewrite(model, tmp_path, {"default_policy": "bfloat16"})
    report = tfpolicy.validate(model.saved_model_dir, out, data={"x": np.ones((5, 8), np.float32)})
    assert report.inputs["serving_default"] == "validation data" and report.examples["serving_default"] == 5
    assert report.inputs["decode"].startswith("generated inputs")
    assert all(0 < o.max_abs_error < 0.5 for o in report.outputs)
    with pytest.raises(InputDataError, match="signature 'serving_default' input 'x' .* is missing; received 'y'"):
        tfpolicy.validate(model.saved_model_dir, out, data={"y": np.ones((5, 8), np.float32)})
    with pytest.raises(InputDataError, match="input 'x' expects float32 of shape \\(None, 8\\), received float64"):
        tfpolicy.validate(model.saved_model_dir, out, data={"x": np.ones((5, 8))})


def test_string_model_validates_with_generated_strings(zoo, tmp_path):
    model = zoo.get("keras3_string_lookup")
    out = rewrite(model, tmp_path, {"default_policy": "mixed_bfloat16"})
    report = tfpolicy.validate(model.saved_model_dir, out)
    assert {s.layer for s in report.layers} >= {"embedding", "head"}
    assert all(math.isfinite(o.max_abs_error) for o in report.outputs)


# ---------------------------------------------------------------------------
# HTML report
# ---------------------------------------------------------------------------


class _Collector(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def test_html_report_is_self_contained_with_one_bar_per_layer(ffn_in_bf16, tmp_path):
    path = tmp_path / "report.html"
    html_report.write(path, ffn_in_bf16)
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    parsed = _Collector()
    parsed.feed(page)
    tags = [tag for tag, _ in parsed.tags]
    assert "script" not in tags and "link" not in tags and "img" not in tags  # works offline, nothing fetched
    assert not [a for _, attrs in parsed.tags for a in attrs.values() if a and a.startswith(("http:", "https:", "//"))
                and not a.startswith("http://www.w3.org/2000/svg")]
    assert sum(1 for tag, attrs in parsed.tags if tag == "svg" and attrs.get("class") == "layer-chart") == 1
    bars = [attrs for tag, attrs in parsed.tags if tag == "g" and attrs.get("class") == "bar"]
    assert [b["data-layer"] for b in bars] == [s.label for s in ffn_in_bf16.layers]
    widths = [float(attrs["width"]) for tag, attrs in parsed.tags if tag == "rect"]
    assert widths[0] == max(widths) == html_report.CHART_WIDTH  # the largest error is the longest bar
    assert tags.count("table") == 2 and "ffn_in" in "".join(parsed.text)


def test_html_escapes_layer_names(ffn_in_bf16):
    import dataclasses

    odd = dataclasses.replace(ffn_in_bf16.layers[0], layer="<b>&evil")
    page = html_report.render(dataclasses.replace(ffn_in_bf16, layers=[odd]))
    assert "<b>&evil" not in page and "&lt;b&gt;&amp;evil" in page


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _map(directory: pathlib.Path, document: dict) -> str:
    (directory / "map.json").write_text(json.dumps(document))
    return "map.json"


def test_cli_validate_over_max_error_exits_1_with_table_json_and_html(transformer, tmp_path):
    name = _map(tmp_path, {"default_policy": "mixed_float16", "policy_map": {"ffn_out": "bfloat16"}})
    result = run_cli(["--map", name, "--validate", "--max_error", "1e-6", "--report", "r.json", "--report_html", "r.html",
                      str(transformer.saved_model_dir), "out"], tmp_path)
    assert result.returncode == 1, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    assert result.stderr.strip().splitlines()[-1].startswith("tfpolicy: validation failed: "), describe(result)
    rows = [line.split() for line in result.stdout.splitlines()]
    first_layer = next(row for row in rows if row and row[0] == "1")
    assert first_layer[1] == "ffn_out", result.stdout
    assert (tmp_path / "out" / "saved_model.pb").exists()  # a plain OUTPUT is kept for inspection
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["validation"]["passed"] is False and report["validation"]["layers"][0]["layer"] == "ffn_out"
    assert report["serving_checks"]["tf1_loader"] is True
    assert 'class="layer-chart"' in (tmp_path / "r.html").read_text()


def test_cli_validate_with_data_under_the_bound_exits_0(zoo, tmp_path):
    model = zoo.get("keras3_mlp")
    np.savez(tmp_path / "val.npz", features=np.random.default_rng(1).standard_normal((10, 16)).astype(np.float32))
    name = _map(tmp_path, {"default_policy": "mixed_bfloat16"})
    result = run_cli(["--map", name, "--validate", "--validation_data", "val.npz", "--max_error", "0.5",
                      str(model.saved_model_dir), "out"], tmp_path)
    assert result.returncode == 0, describe(result)
    assert "10 examples from validation data" in result.stdout, describe(result)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--max_error", "0.1"], "--max_error needs --validate"),
        (["--report_html", "r.html"], "--report_html needs --validate"),
        (["--validate", "--max_error", "-1"], "--max_error must be a non-negative number"),
        (["--validate", "--validation_data", "bad.npz"], "validation data 'bad.npz' is not a readable .npz file"),
        (["--validate", "--validation_data", "wrong.npz"], "input 'features' expects float32 of shape (None, 16), received float64"),
    ],
    ids=["max_error_alone", "html_alone", "negative_bound", "not_npz", "wrong_dtype"],
)
def test_cli_validation_user_errors_exit_2_and_write_nothing(zoo, tmp_path, args, expected):
    (tmp_path / "bad.npz").write_text("not a zip\n")
    np.savez(tmp_path / "wrong.npz", features=np.zeros((2, 16)))
    name = _map(tmp_path, {"default_policy": "mixed_bfloat16"})
    before = tree_digest(tmp_path)
    result = run_cli(["--map", name, *args, str(zoo.get("keras3_mlp").saved_model_dir), "out"], tmp_path)
    assert result.returncode == 2, describe(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfpolicy: error: ") and expected in lines[0], describe(result)
    assert tree_digest(tmp_path) == before


# ---------------------------------------------------------------------------
# Quantized transformer (runs once the quantization issue is merged)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy_map, worst",
    [
        ({"default_policy": "float32", "policy_map": {"ffn_in": "int8_from_mixed_bfloat16"}}, "ffn_in"),
        ({"default_policy": "mixed_bfloat16", "policy_map": {"ffn_out": "float8_from_mixed_bfloat16"}}, "ffn_out"),
    ],
    ids=["int8", "float8"],
)
def test_quantized_transformer_names_the_quantized_layer_first(transformer, tmp_path, policy_map, worst):
    out = rewrite(transformer, tmp_path, policy_map)
    report = tfpolicy.validate(transformer.saved_model_dir, out)
    assert report.layers[0].layer == worst, report.format_table(top=20)


def test_cli_validate_on_quantized_transformer_exits_1_below_measured_error(transformer, tmp_path):
    name = _map(tmp_path, {"default_policy": "float32", "policy_map": {"ffn_in": "int8_from_mixed_bfloat16"}})
    args = ["--map", name, "--validate", "--report", "r.json", str(transformer.saved_model_dir)]
    first = run_cli([*args, "out"], tmp_path)
    assert first.returncode == 0, describe(first)
    validation = json.loads((tmp_path / "r.json").read_text())["validation"]
    assert validation["layers"][0]["layer"] == "ffn_in"
    measured = max(float(o["max_abs_error"]) for o in validation["outputs"])
    second = run_cli([*args, "--max_error", f"{measured / 2:.3g}", "out2"], tmp_path)
    assert second.returncode == 1, describe(second)
    assert "validation failed" in second.stderr.strip().splitlines()[-1]

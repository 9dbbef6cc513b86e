"""``--report_html FILE``: the validation as one self-contained HTML page.

    <h1>, a summary line, the outputs table, an inline SVG bar chart of every
    layer's local error (largest first), and the per-layer table.

No scripts, no external stylesheets or fonts: the file opens offline in any
browser. All text from the model (layer paths, signature names) is escaped.
"""

from __future__ import annotations

import html
import math
import pathlib
from typing import Any, Optional

BAR_HEIGHT = 22
LABEL_WIDTH = 260
CHART_WIDTH = 520
VALUE_WIDTH = 90

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.fail td { background: #fde2e2; }
.pass { color: #1a7f37; font-weight: bold; } .fail { color: #cf222e; font-weight: bold; }
svg text { font-family: system-ui, sans-serif; font-size: 12px; }
p.note { color: #555; font-size: 0.9em; max-width: 60em; }
"""


def render(validation: Any, report: Optional[Any] = None, *, title: str = "tfpolicy validation report") -> str:
    """The page for a :class:`~tfpolicy.validation.compare.ValidationReport` (and the rewrite's report)."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        _summary(validation, report),
        "<h2>Outputs</h2>",
        _outputs_table(validation),
        f'<h2 id="layers">Per-layer error (signature {_e(validation.layer_signature or "-")})</h2>',
        '<p class="note">Local relative error: what each layer adds when it is fed the float model\'s inputs,'
        " ||rewritten - float|| / ||float|| over its output tensors. Largest first.</p>",
        layer_chart(validation.layers),
        _layers_table(validation),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def write(path: pathlib.Path, validation: Any, report: Optional[Any] = None) -> None:
    path.write_text(render(validation, report), encoding="utf-8")


def layer_chart(layers: list[Any]) -> str:
    """Horizontal bars, one per layer, length proportional to its local relative error."""
    if not layers:
        return '<p class="note">No layer outputs to compare.</p>'
    finite = [s.rel_error for s in layers if math.isfinite(s.rel_error)]
    top = max(finite, default=0.0) or 1.0
    height = BAR_HEIGHT * len(layers) + 10
    width = LABEL_WIDTH + CHART_WIDTH + VALUE_WIDTH
    rows = [
        f'<svg class="layer-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" role="img" aria-label="local relative error per layer">'
    ]
    for i, stats in enumerate(layers):
        y = 5 + i * BAR_HEIGHT
        value = stats.rel_error
        length = CHART_WIDTH if not math.isfinite(value) else CHART_WIDTH * value / top
        colour = "#cf222e" if i == 0 else "#4c78a8"
        rows.append(
            f'<g class="bar" data-layer="{_e(stats.label)}" data-value="{_number(value)}">'
            f'<text x="{LABEL_WIDTH - 6}" y="{y + 15}" text-anchor="end">{_e(_short(stats.label))}</text>'
            f'<rect x="{LABEL_WIDTH}" y="{y + 3}" width="{max(length, 1.0):.1f}" height="{BAR_HEIGHT - 6}" fill="{colour}">'
            f"<title>{_e(stats.label)}: {_number(value)}</title></rect>"
            f'<text x="{LABEL_WIDTH + max(length, 1.0) + 6:.1f}" y="{y + 15}">{_number(value)}</text></g>'
        )
    rows.append("</svg>")
    return "\n".join(rows)


def _summary(validation: Any, report: Optional[Any]) -> str:
    status = (
        '<span class="pass">passed</span>' if validation.passed else '<span class="fail">failed</span>'
    )
    bound = f" (max abs error bound {validation.max_error:g})" if validation.max_error is not None else ""
    sources = "; ".join(
        f"{_e(key)}: {validation.examples.get(key, 0)} examples from {_e(source)}" for key, source in validation.inputs.items()
    )
    lines = [
        f"<p>Input <code>{_e(validation.input_dir)}</code> vs rewritten <code>{_e(validation.output_dir)}</code>.</p>",
        f"<p>Validation {status}{bound}. Inputs: {sources}.</p>",
    ]
    if report is not None and getattr(report, "plan", None) is not None:
        policies = sorted({row.policy for row in report.plan.rows()})
        lines.append(f"<p>Policies applied: {_e(', '.join(policies))}.</p>")
    return "\n".join(lines)


def _outputs_table(validation: Any) -> str:
    failing = set(id(o) for o in validation.exceeded())
    rows = [
        "<table class=\"outputs\"><tr><th>signature</th><th>output</th><th>dtype</th><th>max abs error</th>"
        "<th>max rel error</th><th>cosine</th><th>status</th></tr>"
    ]
    for o in validation.outputs:
        bad = id(o) in failing
        rows.append(
            f'<tr class="{"fail" if bad else "ok"}"><td>{_e(o.signature)}</td><td>{_e(o.output)}</td><td>{_e(o.dtype)}</td>'
            f'<td class="num">{_number(o.max_abs_error)}</td><td class="num">{_number(o.max_rel_error)}</td>'
            f'<td class="num">{_number(o.cosine, 6)}</td><td>{"FAIL" if bad else "ok"}</td></tr>'
        )
    rows.append("</table>")
    return "\n".join(rows)


def _layers_table(validation: Any) -> str:
    rows = [
        '<table class="layers"><tr><th>#</th><th>layer</th><th>local rel error</th><th>local max abs error</th>'
        "<th>local cosine</th><th>cumulative rel error</th><th>tensors</th></tr>"
    ]
    for i, s in enumerate(validation.layers):
        rows.append(
            f"<tr><td>{i + 1}</td><td>{_e(s.label)}</td><td class=\"num\">{_number(s.rel_error)}</td>"
            f'<td class="num">{_number(s.max_abs_error)}</td><td class="num">{_number(s.cosine, 6)}</td>'
            f'<td class="num">{_number(s.cumulative_rel_error)}</td><td>{len(s.tensors)}</td></tr>'
        )
    rows.append("</table>")
    return "\n".join(rows)


def _number(value: float, digits: int = 3) -> str:
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}" if digits > 3 else f"{value:.{digits}g}"


def _short(label: str, limit: int = 38) -> str:
    return label if len(label) <= limit else "…" + label[-(limit - 1):]


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)

"""``--html FILE`` of ``tfpolicy suggest``: the frontier as one self-contained page.

    <h1>, the chosen map, an inline SVG scatter of every map measured (cost
    across, error up, the budget as a dashed line, the chosen map ringed),
    the table of maps, and the suggested map as JSON.

No scripts or external files; the page opens offline. Layer paths are escaped.
"""

from __future__ import annotations

import json
from typing import Any

from tfpolicy.validation.html_report import _STYLE, _e

WIDTH, HEIGHT, PAD = 640, 360, 56


def render(suggestion: Any) -> str:
    """The page for a :class:`~tfpolicy.suggestion.run.Suggestion`."""
    chosen = suggestion.chosen
    title = "tfpolicy suggest: frontier"
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f"<p>Chosen: <b>{_e(chosen.label)}</b>, {_e(suggestion.metric)} of '{_e(suggestion.output)}'"
        f" {chosen.error:.3g} within {suggestion.budget:g} on {suggestion.rows['held_out']} held-out rows;"
        f" objective {_e(suggestion.objective)}; target {_e(suggestion.target or 'none')}.</p>",
        chart(suggestion),
        _table(suggestion),
        "<h2>The suggested map</h2>",
        f"<pre>{_e(json.dumps(suggestion.policy_map, indent=2))}</pre>",
        "</body></html>",
    ]) + "\n"


def chart(suggestion: Any) -> str:
    """Error against cost (ms or MB, by the objective), one point per map measured."""
    by_bytes = suggestion.objective == "bytes"
    unit = "MB" if by_bytes else "ms"
    points = [((t.bytes / 1e6) if by_bytes else t.latency_s * 1e3, t.error, t) for t in suggestion.tried]
    finite = [p for p in points if p[1] == p[1] and p[1] != float("inf")]
    x_max = max([p[0] for p in points] + [1e-9]) * 1.1
    y_max = max([p[1] for p in finite] + [suggestion.budget]) * 1.15 or 1.0

    def sx(x: float) -> float:
        return PAD + (WIDTH - 2 * PAD) * x / x_max

    def sy(y: float) -> float:
        return HEIGHT - PAD - (HEIGHT - 2 * PAD) * min(y, y_max) / y_max

    parts = [f'<svg width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="error against {unit}">',
             f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="#444"/>',
             f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="#444"/>',
             f'<text x="{WIDTH / 2:.0f}" y="{HEIGHT - 14}" text-anchor="middle">{unit}</text>',
             f'<text x="14" y="{HEIGHT / 2:.0f}" transform="rotate(-90 14 {HEIGHT / 2:.0f})" text-anchor="middle">'
             f'{_e(suggestion.metric)}</text>',
             f'<line x1="{PAD}" y1="{sy(suggestion.budget):.1f}" x2="{WIDTH - PAD}" y2="{sy(suggestion.budget):.1f}"'
             ' stroke="#cf222e" stroke-dasharray="5,4"/>',
             f'<text x="{WIDTH - PAD}" y="{sy(suggestion.budget) - 4:.1f}" text-anchor="end" fill="#cf222e">budget'
             f' {suggestion.budget:g}</text>',
             f'<text x="{PAD - 4}" y="{HEIGHT - PAD + 14}" text-anchor="end">0</text>',
             f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 14}" text-anchor="end">{x_max:.3g}</text>']
    for x, y, tried in points:
        colour = "#1a7f37" if tried.within_budget else "#888"
        parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="{colour}"/>')
        if tried is suggestion.chosen:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="9" fill="none" stroke="#0969da"'
                         ' stroke-width="2"/>')
        parts.append(f'<text x="{sx(x) + 8:.1f}" y="{sy(y) - 6:.1f}">{_e(tried.label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _table(suggestion: Any) -> str:
    rows = ["<table><tr><th>map</th><th>error</th><th>latency ms</th><th>MB</th><th>within budget</th></tr>"]
    for t in suggestion.tried:
        mark = " (chosen)" if t is suggestion.chosen else ""
        rows.append(f"<tr><td>{_e(t.label + mark)}</td><td class=\"num\">{t.error:.3g}</td>"
                    f"<td class=\"num\">{t.latency_s * 1e3:.1f}</td><td class=\"num\">{t.bytes / 1e6:.2f}</td>"
                    f"<td>{'yes' if t.within_budget else 'no'}</td></tr>")
    rows.append("</table>")
    return "\n".join(rows)

"""The report: the plan and what the passes did, as JSON and as a table.

``--explain`` prints :meth:`Report.format_table`; ``--report FILE`` writes
:meth:`Report.to_json`. Both come from the same data.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Mapping, Optional

from tfpolicy.analysis.plan import OUTSIDE_LAYERS, LayerPlan, Plan
from tfpolicy.analysis.quant_sites import QuantPlan



@dataclasses.dataclass
class SignatureReport:
    key: str
    casts_inserted: int = 0
    casts_reused: int = 0
    casts_folded: int = 0
    ops_retyped: int = 0
    functions_rewritten: int = 0
    ops_quantized: int = 0
    constants_clamped: int = 0  # float16 constants clamped to +-65504 instead of inf
    same_as: str = ""  # the signature computing the same, rewritten once for both (Keras's serve/serving_default)


@dataclasses.dataclass
class QuantizedLayer:
    """What quantization did to one layer: ops, declines, variables, scale ranges."""

    path: str
    mode: str
    ops_quantized: int
    declined: dict[str, int]  # reason -> count
    variables: list[str]
    scales: dict[str, tuple[float, float]]  # variable name -> (min, max)
    quantized_ops: list[str] = dataclasses.field(default_factory=list)  # "signature: node (op, form)"
    forms: dict[str, int] = dataclasses.field(default_factory=dict)  # what the ops run as -> count
    declined_ops: list[dict] = dataclasses.field(default_factory=list)  # node, op, reason

    def summary(self) -> str:
        if not self.ops_quantized:
            text = f"{self.mode}: no matmul-like op quantized"
        else:
            ranges = ", ".join(f"{name.rsplit('/', 1)[-1]} {lo:.3g}..{hi:.3g}" if lo != hi
                               else f"{name.rsplit('/', 1)[-1]} {lo:.3g}" for name, (lo, hi) in self.scales.items())
            ops = "op" if self.ops_quantized == 1 else "ops"
            text = f"{self.mode}: {self.ops_quantized} {ops} quantized ({ranges})"
            text += "; " + ", ".join(f"{form} x{n}" for form, n in sorted(self.forms.items()))
        if self.declined:
            text += "; declined: " + "; ".join(f"{n} x {reason}" for reason, n in sorted(self.declined.items()))
        return text


def quantization_rows(qplan: QuantPlan, quantized: dict[str, int], values: Mapping[str, Any],
                      added: Mapping[str, Any] = ()) -> dict[str, QuantizedLayer]:
    """One :class:`QuantizedLayer` per layer with a site, a declined op or no op at all.

    ``values`` maps the added variables' names to their current values; only
    the scales are read from it, and a scale it lacks is left out. ``added``
    holds the names of the variables the rewrite adds (a kernel's oneDNN
    correction is listed when it is one of them).
    """
    layers: dict[str, QuantizedLayer] = {}

    def row(path: str, mode: str) -> QuantizedLayer:
        return layers.setdefault(path, QuantizedLayer(path, mode, quantized.get(path, 0), {}, [], {}))

    for site in qplan.sites:
        entry = row(site.layer, site.mode)
        entry.quantized_ops.append(f"{site.signature}: {site.node} ({site.op}, {site.form})")
        entry.forms[site.form] = entry.forms.get(site.form, 0) + 1
    for declined in qplan.declined:
        entry = row(declined.layer, declined.mode)
        entry.declined[declined.reason] = entry.declined.get(declined.reason, 0) + 1
        entry.declined_ops.append({"node": declined.node, "op": declined.op, "reason": declined.reason})
    for path, mode in qplan.layers_without_sites:
        row(path, mode)
    for kernel in qplan.int8_kernels.values():
        entry = row(kernel.layer, "int8")
        entry.variables += [kernel.name, kernel.scale_name] + ([kernel.correction_name] if kernel.correction_name in added else [])
        _add_scale(entry, kernel.scale_name, values)
    for kernel in qplan.int4_kernels.values():
        entry = row(kernel.layer, "int4")
        entry.variables += [kernel.name, kernel.scale_name] + ([kernel.zero_name] if kernel.block_size else [])
        _add_scale(entry, kernel.scale_name, values)
    for group in qplan.float8_groups.values():
        entry = row(group.layer, "float8")
        entry.variables += [group.name(k) for k in ("inputs_scale", "kernel_scale", "inputs_amax_history", "kernel_amax_history")]
        for kind in ("inputs_scale", "kernel_scale"):
            _add_scale(entry, group.name(kind), values)
    return dict(sorted(layers.items()))


def _add_scale(entry: QuantizedLayer, name: str, values: Mapping[str, Any]) -> None:
    if name in values:  # absent until the values are made
        entry.scales[name] = _range(values[name])


def _range(value) -> tuple[float, float]:
    import numpy as np  # noqa: PLC0415

    array = np.asarray(value, dtype=np.float64)
    return float(array.min()), float(array.max())


@dataclasses.dataclass
class Report:
    input_dir: str
    output_dir: Optional[str]
    plan: Plan
    signatures: list[SignatureReport]
    retyped_by_layer: dict[Optional[str], int]
    declined_by_layer: dict[Optional[str], dict[str, int]]
    variables_converted: list[dict]
    warnings: list[str]
    input_bytes: int = 0
    output_bytes: Optional[int] = None
    quantization: dict[str, QuantizedLayer] = dataclasses.field(default_factory=dict)
    calibration_batches: int = 0
    serving_checks: Optional[Any] = None  # serving_checks.ServingChecks, when they ran
    validation: Optional[Any] = None  # validation.ValidationReport, with --validate
    lowering: Optional[Any] = None  # analysis.lowering.Lowering, when int8 matmuls were lowered

    @property
    def casts_inserted(self) -> int:
        return sum(s.casts_inserted for s in self.signatures)

    @property
    def casts_reused(self) -> int:
        return sum(s.casts_reused for s in self.signatures)

    def change(self, layer: LayerPlan) -> str:
        """One phrase: what the rewrite does to this layer."""
        quantized = self.quantization.get(layer.path) if layer.path is not None else None
        base = self._float_change(layer)
        if quantized is None:
            return base
        return f"{quantized.summary()}; {base}"

    def _float_change(self, layer: LayerPlan) -> str:
        retyped = self.retyped_by_layer.get(layer.path, 0)
        declined = self.declined_by_layer.get(layer.path, {})
        if layer.compute_dtype == "float32" and not retyped:
            return "unchanged (float32)"
        if layer.is_normalization:
            return f"kept in float32 (normalization), output to {layer.compute_dtype} consumers"
        parts = [f"{retyped} ops to {layer.compute_dtype}"]
        if layer.variable_dtype != "float32" and layer.variable_count:
            parts.append(f"variables stored as {layer.variable_dtype}")
        if declined:
            parts.append("kept float32: " + "; ".join(f"{n} x {reason}" for reason, n in sorted(declined.items())))
        return ", ".join(parts)

    def coverage(self) -> list[dict]:
        """Per key of the map (and the default): the layers it reaches, their ops, and how many were changed."""
        by_key: dict[Optional[str], dict] = {}
        for row in self.plan.rows():
            entry = by_key.setdefault(row.key, {"key": row.key, "policy": row.policy, "layers": 0, "ops": 0,
                                                "ops_retyped": 0, "ops_quantized": 0})
            entry["layers"] += 1 if row.path is not None else 0
            entry["ops"] += row.op_count
            entry["ops_retyped"] += self.retyped_by_layer.get(row.path, 0)
            quantized = self.quantization.get(row.path) if row.path is not None else None
            entry["ops_quantized"] += quantized.ops_quantized if quantized is not None else 0
        return sorted(by_key.values(), key=lambda e: (e["key"] is None, e["key"] or ""))

    def coverage_warnings(self) -> list[str]:
        """Where the map does not reach what it names, one line each (see :meth:`coverage`).

        A layer with variables to which no op could be attributed; a key whose
        layers compute in a lower precision or are quantized, yet none of whose
        ops changed; a map that changes nothing at all.
        """
        lines = []
        by_key: dict[Optional[str], list] = {}
        for row in self.plan.rows():
            if row.path is not None and row.variable_count and not row.op_count:
                lines.append(f"layer '{row.path}' owns {row.variable_count} variable(s) but none of the model's ops"
                             f" could be attributed to it, so its policy ({row.policy}) reaches nothing")
            if row.path is not None:
                by_key.setdefault(row.key, []).append(row)
        for entry in self.coverage():
            # Layers whose ops were kept for a stated reason (normalization, position math) are not misses.
            changes = any(r.compute_dtype != "float32" or r.quantization_mode for r in by_key.get(entry["key"], [])
                          if not r.is_normalization and not self.declined_by_layer.get(r.path))
            if entry["key"] is not None and changes and not (entry["ops_retyped"] or entry["ops_quantized"]):
                lines.append(f"policy map key '{entry['key']}' ({entry['policy']}) reaches {entry['layers']} layer(s)"
                             f" with {entry['ops']} op(s), but changed none of them")
        changed = self.casts_inserted + sum(s.ops_retyped + s.ops_quantized for s in self.signatures)
        if not changed:
            lines.append("the map changes nothing in this model: no op was retyped or quantized and no cast inserted")
        return lines

    def to_json(self) -> dict:
        return {
            "input": self.input_dir,
            "output": self.output_dir,
            "layers": [
                {
                    **row.to_json(),
                    "path": row.path,
                    "ops_retyped": self.retyped_by_layer.get(row.path, 0),
                    "declined": dict(self.declined_by_layer.get(row.path, {})),
                    "change": self.change(row),
                }
                for row in self.plan.rows()
            ],
            "signatures": [dataclasses.asdict(s) for s in self.signatures],
            "casts_inserted": self.casts_inserted,
            "casts_reused": self.casts_reused,
            "variables_converted": self.variables_converted,
            "quantization": {path: dataclasses.asdict(q) for path, q in self.quantization.items()},
            "coverage": self.coverage(),
            "calibration_batches": self.calibration_batches,
            "unused_keys": list(self.plan.unused_keys),
            "warnings": self.warnings,
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
            "serving_checks": self.serving_checks.to_json() if self.serving_checks else None,
            "validation": self.validation.to_json() if self.validation else None,
            "lowering": self.lowering.to_json() if self.lowering else None,
        }

    def write_json(self, path: pathlib.Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def format_table(self) -> str:
        header = ("layer path", "matched key", "policy", "ops", "vars", "change")
        rows = [
            (
                row.path if row.path is not None else OUTSIDE_LAYERS,
                row.key if row.key is not None else "(default)",
                row.policy,
                str(row.op_count),
                str(row.variable_count),
                self.change(row),
            )
            for row in self.plan.rows()
        ]
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header) - 1)]
        lines = []
        for cells in (header, *rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)) + "  " + cells[-1])
        lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
        for s in self.signatures:
            lines.append(
                f"signature {s.key}: {s.ops_retyped} ops retyped, {s.casts_inserted} casts inserted,"
                f" {s.casts_reused} reused, {s.casts_folded} folded"
                + (f", {s.ops_quantized} ops quantized" if s.ops_quantized else "")
                + (f" (the same function as {s.same_as}, rewritten once)" if s.same_as else "")
            )
        for path, quantized in self.quantization.items():
            if quantized.variables:
                lines.append(f"variables added for {path}: {', '.join(quantized.variables)}")
        if self.lowering is not None:
            lines.append(f"lowering: {self.lowering.note}")
        if self.calibration_batches:
            lines.append(f"calibrated on {self.calibration_batches} batches")
        lines.extend(f"warning: {line}" for line in self.plan.unused_key_warnings())
        return "\n".join(lines)

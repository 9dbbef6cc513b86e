"""Validation: run the float and the rewritten SavedModel on the same inputs.

Per signature output: max abs error, max relative error (max abs error over
max |reference|) and cosine similarity. Per layer, which layers *add* the most
error, the way TFLite's quantization debugger and ONNX Runtime's
``qdq_loss_debug`` compare a layer's output tensors across the two models::

    float graph:      x -> [dense] -a-> [dense_1] -b-> [head] -> y
    rewritten graph:  x -> [dense'] -a'-> [dense_1'] -b'-> [head'] -> y'
    local run:        x -> [dense'] -a'       a -> [dense_1'] -b'     b -> [head'] -> y'

A layer's output tensors are the outputs of its nodes that a node of another
layer (or the signature's result) reads. The *cumulative* error of ``dense_1``
compares ``b'`` of the plain rewritten run with ``b``; its *local* error feeds
``dense_1'`` the float model's ``a`` (a placeholder replaces ``a'`` for the
other layers' readers), so it measures what ``dense_1`` itself adds. Layers are
ranked by local relative RMS error ``||out - ref|| / ||ref||``.

The rewrite keeps node names, so a tensor found in both graphs is compared;
retyped tensors (bfloat16, float16) are cast to float32 first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from typing import Any, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tfpolicy.core import paths
from tfpolicy.errors import InputDataError
from tfpolicy.core import inputs
from tfpolicy.validation.layer_errors import ErrorAccumulator, LayerStats, compare_layers, json_float

logger = logging.getLogger(__name__)

GENERATED_BATCH = 4
VALIDATION_BATCH = 32
MAX_BATCHES = 64

PathLike = Union[str, "os.PathLike[str]"]


# ---------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OutputStats:
    signature: str
    output: str
    dtype: str
    max_abs_error: float
    max_rel_error: float
    cosine: float
    mismatches: int

    def to_json(self) -> dict:
        return {
            "signature": self.signature,
            "output": self.output,
            "dtype": self.dtype,
            "max_abs_error": json_float(self.max_abs_error),
            "max_rel_error": json_float(self.max_rel_error),
            "cosine": json_float(self.cosine),
            "mismatches": self.mismatches,
        }


@dataclasses.dataclass
class ValidationReport:
    input_dir: str
    output_dir: str
    inputs: dict[str, str]  # signature -> where its inputs came from
    examples: dict[str, int]  # signature -> examples run
    outputs: list[OutputStats]
    layers: list[LayerStats]  # largest local error first
    layer_signature: Optional[str]
    max_error: Optional[float] = None

    def exceeded(self, max_error: Optional[float] = None) -> list[OutputStats]:
        """Outputs whose max abs error is above ``max_error`` (or differ, for non-floats)."""
        bound = self.max_error if max_error is None else max_error
        if bound is None:
            return []
        return [o for o in self.outputs if o.mismatches or not (o.max_abs_error <= bound)]

    @property
    def passed(self) -> bool:
        return not self.exceeded()

    def failure_line(self) -> str:
        worst = max(self.exceeded(), key=lambda o: o.max_abs_error)
        return (
            f"validation failed: signature '{worst.signature}' output '{worst.output}' max abs error"
            f" {worst.max_abs_error:.6g} exceeds --max_error {self.max_error:g}"
            f" ({len(self.exceeded())} output(s) over the bound)"
        )

    def to_json(self) -> dict:
        return {
            "input": self.input_dir,
            "output": self.output_dir,
            "inputs": dict(self.inputs),
            "examples": dict(self.examples),
            "max_error": self.max_error,
            "passed": self.passed,
            "outputs": [o.to_json() for o in self.outputs],
            "layer_signature": self.layer_signature,
            "layers": [layer.to_json() for layer in self.layers],
        }

    def format_table(self, top: int = 10) -> str:
        """The outputs table, then the ``top`` layers that add the most error."""
        rows = [
            (o.signature, o.output, f"{o.max_abs_error:.3g}", f"{o.max_rel_error:.3g}", f"{o.cosine:.6f}",
             "FAIL" if o in self.exceeded() else "ok")
            for o in self.outputs
        ]
        lines = _table(("signature", "output", "max abs err", "max rel err", "cosine", "status"), rows)
        for key, source in self.inputs.items():
            lines.append(f"signature {key}: {self.examples.get(key, 0)} examples from {source}")
        if self.layers:
            lines.append("")
            lines.append(f"layers adding the most error (signature {self.layer_signature}; local = given the float inputs):")
            layer_rows = [
                (str(i + 1), s.label, f"{s.rel_error:.3g}", f"{s.max_abs_error:.3g}", f"{s.cosine:.6f}",
                 f"{s.cumulative_rel_error:.3g}")
                for i, s in enumerate(self.layers[:top])
            ]
            lines.extend(_table(("#", "layer", "local rel err", "local max abs", "local cosine", "cumulative rel err"), layer_rows))
            if len(self.layers) > top:
                lines.append(f"... {len(self.layers) - top} more layers in the JSON report")
        return "\n".join(lines)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    return lines


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def validate(
    input_dir: PathLike,
    output_dir: PathLike,
    *,
    data: Optional[inputs.InputSource] = None,
    signatures: Optional[Sequence[str]] = None,
    max_error: Optional[float] = None,
    layers: bool = True,
    seed: int = 0,
    what: str = "validation data",
) -> ValidationReport:
    """Compare the SavedModels at ``input_dir`` (float) and ``output_dir`` (rewritten).

    ``data`` is an npz path, a dict of arrays or an iterable of dicts (see
    :func:`tfpolicy.core.inputs.batches_from`). A signature whose input names are
    exactly the data's runs on it; every other signature (and all of them when
    ``data`` is None) runs on generated inputs. ``layers=False`` skips the
    per-layer comparison. Never raises for a large error: see
    :meth:`ValidationReport.exceeded`.
    """
    input_path, output_path = pathlib.Path(input_dir), pathlib.Path(output_dir)
    paths.check_input_dir(input_path)
    paths.check_input_dir(output_path)
    reference = tf.saved_model.load(str(input_path))
    rewritten = tf.saved_model.load(str(output_path))
    keys = sorted(signatures) if signatures else sorted(rewritten.signatures.keys())
    batches = inputs.batches_from(data, what=what, batch_size=VALIDATION_BATCH, max_batches=MAX_BATCHES) if data is not None else None
    runs = _inputs_per_signature(keys, rewritten, batches, what, seed)
    outputs: list[OutputStats] = []
    for key in keys:
        outputs.extend(_compare_outputs(key, reference.signatures[key], rewritten.signatures[key], runs[key][1]))
    layer_key = "serving_default" if "serving_default" in keys else (keys[0] if keys else None)
    layer_stats = compare_layers(input_path, output_path, layer_key, runs[layer_key][1]) if layers and layer_key else []
    return ValidationReport(
        input_dir=str(input_path),
        output_dir=str(output_path),
        inputs={key: runs[key][0] for key in keys},
        examples={key: sum(inputs.batch_rows(b) for b in runs[key][1]) for key in keys},
        outputs=outputs,
        layers=layer_stats,
        layer_signature=layer_key if layer_stats else None,
        max_error=max_error,
    )


def check_data(
    input_dir: PathLike,
    data: inputs.InputSource,
    *,
    signatures: Optional[Sequence[str]] = None,
    what: str = "validation data",
) -> None:
    """Raise :class:`InputDataError` now if ``data`` cannot validate ``input_dir``.

    The CLI calls this before it writes anything, so that a bad validation file
    is a user error with nothing written.
    """
    model = tf.saved_model.load(str(pathlib.Path(input_dir)))
    keys = sorted(signatures) if signatures else sorted(model.signatures.keys())
    batches = inputs.batches_from(data, what=what, batch_size=VALIDATION_BATCH, max_batches=MAX_BATCHES)
    _inputs_per_signature(keys, model, batches, what, seed=0)


def _inputs_per_signature(
    keys: Sequence[str], model: Any, batches: Optional[list[dict[str, np.ndarray]]], what: str, seed: int
) -> dict[str, tuple[str, list[dict[str, np.ndarray]]]]:
    """Signature -> (where its inputs come from, its batches)."""
    runs = {}
    names = set(batches[0]) if batches else None
    for key in keys:
        function = model.signatures[key]
        if names is not None and names == set(inputs.input_specs(function)):
            for batch in batches:
                inputs.check_inputs(batch, key, function, what=what)
            runs[key] = (what, batches)
        else:
            generated = inputs.generate_inputs(function, batch=GENERATED_BATCH, seed=seed)
            runs[key] = (f"generated inputs (seed {seed})", [generated])
    if names is not None and all(source != what for source, _ in runs.values()):
        # The data fits no signature: report against the main one.
        key = "serving_default" if "serving_default" in keys else keys[0]
        inputs.check_inputs(batches[0], key, model.signatures[key], what=what)
        raise InputDataError(f"{what} fits no signature")  # unreachable: check_inputs raised
    return runs


def _call(function: Any, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    result = function(**{name: tf.constant(value) for name, value in batch.items()})
    return {name: np.asarray(value.numpy()) for name, value in result.items()}


def _compare_outputs(key: str, reference: Any, rewritten: Any, batches: list[dict[str, np.ndarray]]) -> list[OutputStats]:
    stats: dict[str, ErrorAccumulator] = {}
    dtypes: dict[str, str] = {}
    for batch in batches:
        ref, out = _call(reference, batch), _call(rewritten, batch)
        for name in sorted(ref):
            stats.setdefault(name, ErrorAccumulator()).add(ref[name], out[name])
            dtypes[name] = ref[name].dtype.name if ref[name].dtype.kind != "S" else "string"
    return [
        OutputStats(key, name, dtypes[name], acc.max_abs_diff, acc.max_rel_error, acc.cosine, acc.mismatches)
        for name, acc in stats.items()
    ]

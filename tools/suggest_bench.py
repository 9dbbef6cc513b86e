"""Benchmark of ``tfpolicy suggest``: the acceptance runs, one model at a time.

For each model (the depth-12 ``tools/bench.py`` encoder, and BERT, Llama and
ResNet50 of ``tools/realmodels.py``): export it, write its data (the encoder:
16 rows of random tokens; the real models: their test batch and calibration
batches, 20 rows), measure the error of ``mixed_bfloat16`` on the rows
suggest holds out, and run ``tfpolicy.suggest`` with ``--max_error`` twice
that, for each objective asked. A row says the suggested map's held-out
error; the error of Keras applying the map natively (its serialized form,
loaded with ``keras.saving.deserialize_keras_object``, run as a graph, against
Keras's float32 model run the same way) and the larger of the two over the
smaller; the map's measured latency and
bytes, those of the best single policy that meets the budget, and the
search's time against one default rewrite (``mixed_bfloat16``, serving
checks on) of the same model.

    python tools/suggest_bench.py --models encoder12,bert,llama,resnet50 --target cpu --markdown
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

ENCODER_ROWS = 16


def _encoder(name: str) -> Any:
    import bench  # noqa: PLC0415

    return bench.build_encoder(int(name[len("encoder"):] or 12), 768, 12, 128, 3072)  # seeded: the same weights


def prepare(name: str, workdir: pathlib.Path) -> tuple[pathlib.Path, dict[str, np.ndarray], Any]:
    """The exported model, its data (all rows, in the order suggest reads them), and the
    ``realmodels.RealModel`` (None for the encoder)."""
    if name.startswith("encoder"):
        directory = workdir / name
        _encoder(name).export(str(directory), verbose=False)
        rng = np.random.default_rng(0)
        return directory, {"tokens": rng.normal(size=(ENCODER_ROWS, 128, 768)).astype(np.float32)}, None
    import realmodels  # noqa: PLC0415

    model = realmodels.build(name, workdir / name)
    batches = [model.inputs, *model.calibration]
    return model.saved_model_dir, {k: np.concatenate([b[k] for b in batches]) for k in model.inputs}, model


def keras_error(name: str, real: Any, keras_config: dict, rows: dict[str, np.ndarray], output: str) -> float:
    """The metric's error of Keras applying the suggested map natively (its serialized form, loaded with
    ``keras.saving.deserialize_keras_object``; ``realmodels.keras_native``: built, given each layer's
    policy, run as a graph) on the held-out ``rows``, against Keras's float32 model run the same way
    (so that a float32 map's error is 0, as the rewrite's is: Keras's graph and its export's differ
    by float32 roundoff)."""
    import keras  # noqa: PLC0415
    import realmodels  # noqa: PLC0415

    policy_map = keras.saving.deserialize_keras_object(json.loads(json.dumps(keras_config)))
    if real is None:  # the encoder: seeded, so a float32 build has the exported weights
        real = realmodels.RealModel(name, pathlib.Path(), rows, [], {}, realmodels.rebuilder(lambda: _encoder(name)))
        output = "output_0"
    float32 = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
    got, reference = (
        np.asarray(realmodels.keras_native(dataclasses.replace(real, inputs=rows),
                                           {"default_policy": pm.default_policy.name}, policy_map=pm)[output],
                   np.float64)
        for pm in (policy_map, float32))
    return float(np.max(np.abs(got - reference)) / np.max(np.abs(reference)))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="encoder12,bert,llama,resnet50")
    parser.add_argument("--objectives", default="latency,bytes")
    parser.add_argument("--target", default="cpu", choices=["none", "cpu", "gpu", "tpu"])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import tensorflow as tf  # noqa: PLC0415

    import tfpolicy  # noqa: PLC0415
    from tfpolicy.suggestion import measure  # noqa: PLC0415

    target = None if args.target == "none" else args.target
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        workdir = pathlib.Path(scratch)
        for name in args.models.split(","):
            model_dir, data, real = prepare(name, workdir)
            np.savez(workdir / f"{name}.npz", **data)
            function = tf.saved_model.load(str(model_dir)).signatures["serving_default"]
            outputs = sorted(function.structured_outputs)
            output = next((o for o in outputs if "sequence_output" in o), outputs[0])
            started = time.monotonic()
            tfpolicy.rewrite(model_dir, workdir / f"{name}_bf16", {"default_policy": "mixed_bfloat16"}, overwrite=True)
            rewrite_s = time.monotonic() - started
            batches = [{k: v[i:i + 16] for k, v in data.items()} for i in range(0, len(next(iter(data.values()))), 16)]
            _, held_out = measure.split_rows(batches, 0.25)
            metric = measure.Metric("rel_max", output)
            ref = measure.Model.load(model_dir).outputs(held_out, output)
            bf16 = measure.Model.load(workdir / f"{name}_bf16").outputs(held_out, output)
            budget = 2 * metric(ref, bf16)
            for objective in args.objectives.split(","):
                result = tfpolicy.suggest(model_dir, workdir / f"{name}.npz", budget, output=output, target=target,
                                          objective=objective, progress=lambda m: print(f"  {name}: {m}", file=sys.stderr))
                uniform = [t for t in result.tried if t.label.endswith("(every layer)") and t.within_budget]
                key = (lambda t: t.latency_s) if objective == "latency" else (lambda t: t.bytes)
                best = min(uniform, key=key)
                chosen = result.chosen
                held_rows = {k: np.concatenate([b[k] for b in held_out]) for k in held_out[0]}
                native = keras_error(name, real, result.keras_config(), held_rows, output)
                rows.append({
                    "model": name, "objective": objective, "budget": budget, "chosen": chosen.label,
                    "error": chosen.error, "latency_ms": chosen.latency_s * 1e3, "mb": chosen.bytes / 1e6,
                    "best_single": best.label.replace(" (every layer)", ""), "single_error": best.error,
                    "single_latency_ms": best.latency_s * 1e3, "single_mb": best.bytes / 1e6,
                    "keras_error": native, "search_s": result.seconds, "rewrite_s": rewrite_s, "map": result.policy_map,
                    "frontier": [t.to_json() for t in result.tried],
                })
                print(_line(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))
    print(_table(rows, args.markdown))
    return 0


def _line(row: dict) -> str:
    return (f"{row['model']} {row['objective']}: {row['chosen']} err {row['error']:.3g} (budget {row['budget']:.3g};"
            f" Keras {row['keras_error']:.3g}, {_keras_ratio(row)})"
            f" {row['latency_ms']:.1f} ms {row['mb']:.2f} MB; best single {row['best_single']} {row['single_latency_ms']:.1f}"
            f" ms {row['single_mb']:.2f} MB; search {row['search_s']:.0f}s = {row['search_s'] / row['rewrite_s']:.1f}x rewrite")


def _keras_ratio(row: dict) -> str:
    """The larger of the two errors over the smaller (1.00 when both are 0)."""
    low, high = sorted((row["error"], row["keras_error"]))
    if high == 0:
        return "1.00"
    return f"{high / low:.2f}" if low > 0 else "inf"


def _table(rows: list[dict], markdown: bool) -> str:
    header = ["model", "objective", "budget", "suggested: error", "Keras", "x", "ms", "MB", "best single policy", "ms",
              "MB", "search s", "x rewrite"]
    lines = [[r["model"], r["objective"], f"{r['budget']:.3g}", f"{r['error']:.3g}", f"{r['keras_error']:.3g}",
              _keras_ratio(r), f"{r['latency_ms']:.1f}",
              f"{r['mb']:.2f}", r["best_single"], f"{r['single_latency_ms']:.1f}", f"{r['single_mb']:.2f}",
              f"{r['search_s']:.0f}", f"{r['search_s'] / r['rewrite_s']:.1f}"] for r in rows]
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)] if lines else []
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in [header, *lines])


if __name__ == "__main__":
    sys.exit(main())

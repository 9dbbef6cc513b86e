"""Benchmark tfpolicy.rewrite against a TensorFlow-only load/save floor on a transformer encoder.

    python tools/bench.py [--depth 12] [--depths 2,4,8,12] [--large]
                          [--policy mixed_bfloat16,int8_from_mixed_bfloat16,float8_from_mixed_bfloat16]
                          [--routes default,alone] [--calibration 8] [--no_peer]
                          [--width 768] [--heads 12] [--seq 128] [--ffn 3072]
                          [--workdir DIR] [--json OUT] [--markdown] [--repeat N] [--profile DEPTH]
                          [--serving [POLICIES] [--serving_batches 1,8,32] [--serving_targets default,cpu]]

For each depth in ``--depths`` (plus ``--depth``) it builds, once and in its own
subprocess, a float32 Keras 3 Functional transformer encoder and exports it
with ``model.export(dir)``::

    Input "tokens" (seq, width)
    per block i: MultiHeadAttention "block_{i}_mha" -> + residual
                 -> LayerNormalization "block_{i}_ln1"
                 -> Dense "block_{i}_ffn_in" (ffn, gelu) -> Dense "block_{i}_ffn_out" (width)
                 -> + residual -> LayerNormalization "block_{i}_ln2"
    Dense "head" (width)

(about 85M parameters at depth 12, width 768; ``--large`` adds depth 24,
width 2048, ffn 8192: 1.2B parameters, 4.8 GB). Then, each in a fresh
subprocess so that peak RSS belongs to one measurement, it measures the wall
time and peak RSS of these routes:

  floor     ``tf.saved_model.load(dir)`` + ``tf.saved_model.save(loaded, out,
            signatures=loaded.signatures)``, TensorFlow alone;
  POLICY default   ``tfpolicy.rewrite(dir, out, {"default_policy": POLICY})``,
            as a user runs it (serving checks on), for each ``--policy``;
  POLICY alone     the same with ``serving_checks=False``;
  TF quantize_saved_model   TensorFlow's own post-training quantization,
            dynamic-range int8 with its defaults (at the main depth only: at
            depth 12 it peaks at 7x the model's size; ``--no_peer`` skips it).

At the main depth, each float8 policy is also calibrated on ``--calibration``
batches of 8 (``serving_checks=False``): the median seconds per batch (from the
second) against one forward pass of the rewritten output on the same batch.

Only the work after the imports is timed. Peak RSS is reported above the
RSS after the imports (TensorFlow's own ~550 MB), against the floor's and as a
share of the model's float32 size. ``--repeat N`` runs each case N times,
alternating, and keeps the fastest wall time (and the largest peak RSS).
Exports are kept in ``--workdir`` (keyed by the model's shape) and reused on
later runs with the same workdir; outputs are deleted after each measurement.

``--serving [POLICIES]`` measures what the outputs cost to serve instead: each
policy's output (with no ``--target`` and with ``--target cpu``), Keras's own
export of the policy, grappler's bfloat16 AMP and TF's static int8, in graph
mode and under XLA at batch 1, 8 and 32, each in a fresh process, beside the
float32 input; see ``tools/serving_bench.py``.

``--profile DEPTH`` also runs ``tfpolicy.rewrite`` under cProfile at that depth
in a subprocess and prints the top functions by cumulative time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import serving_bench  # noqa: E402  (tools/serving_bench.py: --serving)

RESULT_MARKER = "BENCH_RESULT "
DEFAULT_POLICY = "mixed_bfloat16"
DEFAULT_POLICIES = ("mixed_bfloat16", "int8_from_mixed_bfloat16", "float8_from_mixed_bfloat16")
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------
# Child side: each function runs in its own process and returns a JSON dict.
# --------------------------------------------------------------------------


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM on Linux (ru_maxrss there starts from the forking parent's RSS)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):  # not Linux: ru_maxrss is in bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def build_encoder(depth: int, width: int, heads: int, seq: int, ffn: int):
    """The float32 Functional transformer encoder described in the module docstring."""
    import keras

    keras.utils.set_random_seed(1234)
    inputs = keras.Input(shape=(seq, width), dtype="float32", name="tokens")
    x = inputs
    for i in range(depth):
        attn = keras.layers.MultiHeadAttention(num_heads=heads, key_dim=width // heads, name=f"block_{i}_mha")(x, x)
        x = keras.layers.Add(name=f"block_{i}_add1")([x, attn])
        x = keras.layers.LayerNormalization(name=f"block_{i}_ln1")(x)
        h = keras.layers.Dense(ffn, activation="gelu", name=f"block_{i}_ffn_in")(x)
        h = keras.layers.Dense(width, name=f"block_{i}_ffn_out")(h)
        x = keras.layers.Add(name=f"block_{i}_add2")([x, h])
        x = keras.layers.LayerNormalization(name=f"block_{i}_ln2")(x)
    outputs = keras.layers.Dense(width, name="head")(x)
    return keras.Model(inputs, outputs, name=f"encoder_d{depth}")


def child_export(args) -> dict:
    t0 = time.perf_counter()
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = build_encoder(args.depth, args.width, args.heads, args.seq, args.ffn)
    params = int(model.count_params())
    out = pathlib.Path(args.out)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.export(str(tmp), verbose=False)
    (tmp / "bench_meta.json").write_text(json.dumps({"params": params}))
    tmp.rename(out)
    return {"params": params, "seconds": time.perf_counter() - t0, "import_seconds": t_import,
            "peak_rss_mb": _peak_rss_mb()}


def child_floor(args) -> dict:
    t0 = time.perf_counter()
    import tensorflow as tf

    t_import = time.perf_counter() - t0
    rss_after_import = _peak_rss_mb()
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    loaded = tf.saved_model.load(args.input)
    t_load = time.perf_counter() - t0
    tf.saved_model.save(loaded, args.out, signatures=loaded.signatures)
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    return {"seconds": seconds, "cpu_seconds": cpu, "load_seconds": t_load, "import_seconds": t_import,
            "peak_rss_mb": _peak_rss_mb(), "rss_after_import_mb": rss_after_import,
            "output_bytes": _directory_bytes(pathlib.Path(args.out))}


def child_tfpolicy(args) -> dict:
    t0 = time.perf_counter()
    import tensorflow  # noqa: F401

    import tfpolicy
    import tfpolicy.api  # tfpolicy's exports are lazy: import the real module before timing

    t_import = time.perf_counter() - t0
    rss_after_import = _peak_rss_mb()
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    report = tfpolicy.rewrite(args.input, args.out, {"default_policy": args.policy},
                              serving_checks=bool(args.serving_checks))
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    return {"seconds": seconds, "cpu_seconds": cpu, "import_seconds": t_import, "peak_rss_mb": _peak_rss_mb(),
            "rss_after_import_mb": rss_after_import, "casts_inserted": report.casts_inserted,
            "signatures": [s.key for s in report.signatures],
            "input_bytes": report.input_bytes, "output_bytes": report.output_bytes}


def child_profile(args) -> dict:
    import cProfile
    import io
    import pstats

    import tensorflow  # noqa: F401

    import tfpolicy
    import tfpolicy.api

    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    tfpolicy.rewrite(args.input, args.out, {"default_policy": args.policy})
    profiler.disable()
    seconds = time.perf_counter() - t0
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(args.top)
    tf_text = io.StringIO()
    pstats.Stats(profiler, stream=tf_text).sort_stats("cumulative").print_stats("tfpolicy", args.top)
    tot_text = io.StringIO()
    pstats.Stats(profiler, stream=tot_text).sort_stats("tottime").print_stats(args.top)
    if args.pstats:
        stats.dump_stats(args.pstats)
    return {"seconds": seconds, "cumulative": text.getvalue(), "tfpolicy_cumulative": tf_text.getvalue(),
            "tottime": tot_text.getvalue()}


def _encoder_batch(function, batch: int):
    import numpy as np

    (name, spec), = function.structured_input_signature[1].items()
    shape = [batch if d is None else d for d in spec.shape]
    return name, np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def child_calibrate(args) -> dict:
    """A float8 rewrite calibrated on ``--batches`` batches: seconds per batch, against one forward pass of the output."""
    import statistics

    import tensorflow as tf

    import tfpolicy
    import tfpolicy.api

    name, batch = _encoder_batch(tf.saved_model.load(args.input).signatures["serving_default"], args.batch)
    stamps: list[float] = []
    t0 = time.perf_counter()
    tfpolicy.rewrite(args.input, args.out, {"default_policy": args.policy}, serving_checks=bool(args.serving_checks),
                     calibration_data=({name: batch} for _ in range(args.batches)),
                     calibration_progress=lambda done, total: stamps.append(time.perf_counter()))
    seconds = time.perf_counter() - t0
    steps = [b - a for a, b in zip(stamps, stamps[1:])]  # from the second batch: the first includes tracing
    function = tf.saved_model.load(args.out).signatures["serving_default"]
    x = tf.constant(batch)
    function(**{name: x})
    forward = []
    for _ in range(3):
        t1 = time.perf_counter()
        next(iter(function(**{name: x}).values())).numpy()
        forward.append(time.perf_counter() - t1)
    return {"seconds": seconds, "batches": len(stamps), "batch_seconds": statistics.median(steps),
            "first_batch_seconds": stamps[0] - t0 if stamps else None, "forward_seconds": min(forward),
            "peak_rss_mb": _peak_rss_mb()}


def child_peer(args) -> dict:
    """TensorFlow's own post-training quantization, dynamic-range int8, with its defaults."""
    t0 = time.perf_counter()
    import tensorflow  # noqa: F401
    from tensorflow.compiler.mlir.quantization.tensorflow import quantization_options_pb2 as options_pb2
    from tensorflow.compiler.mlir.quantization.tensorflow.python import quantize_model

    t_import = time.perf_counter() - t0
    rss_after_import = _peak_rss_mb()
    method = options_pb2.QuantizationMethod(
        preset_method=options_pb2.QuantizationMethod.PresetMethod.METHOD_DYNAMIC_RANGE_INT8)
    options = options_pb2.QuantizationOptions(quantization_method=method, tags={"serve"},
                                              signature_keys=["serving_default"])
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    quantize_model.quantize(args.input, args.out, options)
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    return {"seconds": seconds, "cpu_seconds": cpu, "import_seconds": t_import, "peak_rss_mb": _peak_rss_mb(),
            "rss_after_import_mb": rss_after_import, "output_bytes": _directory_bytes(pathlib.Path(args.out))}


CHILDREN = {"export": child_export, "calibrate": child_calibrate, "peer": child_peer, "floor": child_floor,
            "tfpolicy": child_tfpolicy, "profile": child_profile, **serving_bench.CHILDREN}


def child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.py --child")
    parser.add_argument("mode", choices=sorted(CHILDREN))
    parser.add_argument("--input")
    parser.add_argument("--out", required=True)
    for name in ("depth", "width", "heads", "seq", "ffn"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--pstats")
    parser.add_argument("--policy", default=DEFAULT_POLICY)
    parser.add_argument("--serving_checks", type=int, default=1)
    parser.add_argument("--policies", default="")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--batches", type=int, default=8)
    serving_bench.add_child_arguments(parser)
    args = parser.parse_args(argv)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    result = CHILDREN[args.mode](args)
    sys.stdout.write(RESULT_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------
# Parent side: no TensorFlow here.
# --------------------------------------------------------------------------


def _directory_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_child(mode: str, **kwargs) -> dict:
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", mode]
    for key, value in kwargs.items():
        if value is not None:
            cmd += [f"--{key}", str(value)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wall = time.perf_counter() - t0
    results = [line[len(RESULT_MARKER):] for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not results:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"bench: child '{mode}' failed (exit {proc.returncode})")
    result = json.loads(results[-1])
    result["process_seconds"] = wall
    return result


def ensure_export(workdir: pathlib.Path, depth: int, shape: dict) -> tuple[pathlib.Path, int]:
    name = "encoder_d{depth}_w{width}_h{heads}_s{seq}_f{ffn}".format(depth=depth, **shape)
    path = workdir / "exports" / name
    meta = path / "bench_meta.json"
    if meta.exists() and (path / "saved_model.pb").exists():
        params = json.loads(meta.read_text())["params"]
        _progress(f"depth {depth}: reusing export {path} ({params:,} params)")
        return path, params
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        shutil.rmtree(path)
    _progress(f"depth {depth}: building and exporting the encoder ...")
    result = run_child("export", out=path, depth=depth, **shape)
    _progress(f"depth {depth}: exported {result['params']:,} params in {result['seconds']:.1f}s")
    return path, result["params"]


def measure(mode: str, export: pathlib.Path, workdir: pathlib.Path, label: str, run: str = "", **options) -> dict:
    out = workdir / "out" / f"{mode}_{label}"
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    what = f"{mode} {options.get('policy', '')}".strip() + ("" if options.get("serving_checks", 1) else " (alone)")
    _progress(f"{label}: {what}{run} ...")
    result = run_child(mode, input=export, out=out, **options)
    _progress(f"{label}: {what}{run} {result['seconds']:.1f}s, peak RSS {result['peak_rss_mb']:.0f} MB")
    shutil.rmtree(out, ignore_errors=True)
    return result


def best_of(runs: list[dict]) -> dict:
    """The run with the least wall time, with every run's times and peak RSS alongside."""
    best = dict(min(runs, key=lambda r: r["seconds"]))
    best["all_seconds"] = [r["seconds"] for r in runs]
    best["all_peak_rss_mb"] = [r["peak_rss_mb"] for r in runs]
    best["peak_rss_mb"] = max(best["all_peak_rss_mb"])
    return best


def _progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def render(lines: list[tuple[str, ...]], markdown: bool = False) -> str:
    """A header row and rows as aligned text, or as a Markdown table (for the README)."""
    if markdown:
        header, *rows = lines
        out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
        return "\n".join(out + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def _above_import(result: dict) -> float:
    return result["peak_rss_mb"] - result.get("rss_after_import_mb", 0.0)


def format_table(models: list[dict], markdown: bool = False) -> str:
    """One row per model and route: seconds and peak RSS above the import, each against the floor's."""
    lines = [("model", "params", "route", "s", "x floor", "MB above import", "RSS x floor", "% of float32 size")]
    for model in models:
        floor = model["routes"]["floor"]
        for route, r in model["routes"].items():
            above = _above_import(r)
            lines.append((
                model["label"], f"{model['params'] / 1e6:,.0f}M", route, f"{r['seconds']:.1f}",
                f"{r['seconds'] / floor['seconds']:.2f}", f"{above:.0f}", f"{above / _above_import(floor):.2f}",
                f"{100 * above / (model['params'] * 4 / 2**20):.0f}%",
            ))
    return render(lines, markdown)


def format_calibration(rows: list[dict], markdown: bool = False) -> str:
    lines = [("model", "policy", "batches", "s per batch", "forward s", "x forward", "rewrite s")]
    for r in rows:
        lines.append((r["label"], r["policy"], str(r["batches"]), f"{r['batch_seconds']:.2f}",
                      f"{r['forward_seconds']:.2f}", f"{r['batch_seconds'] / r['forward_seconds']:.2f}",
                      f"{r['seconds']:.1f}"))
    return render(lines, markdown)


LARGE = {"depth": 24, "width": 2048, "heads": 16, "ffn": 8192}
"""``--large``: about 1.2B parameters, 4.8 GB of float32."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=12, help="main depth (default 12)")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=None, help="FFN width (default 4*width)")
    parser.add_argument("--depths", default="2,4,8,12", help="comma-separated depths (default 2,4,8,12)")
    parser.add_argument("--large", action="store_true",
                        help="also the large encoder: depth 24, width 2048, 16 heads, ffn 8192 (1.2B parameters)")
    parser.add_argument("--workdir", type=pathlib.Path, default=None,
                        help="where exports (reused) and outputs go (default: a fresh temp dir, removed at exit)")
    parser.add_argument("--json", type=pathlib.Path, default=None, metavar="OUT", help="also write results as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown (for the README)")
    parser.add_argument("--profile", type=int, default=None, metavar="DEPTH",
                        help="also profile tfpolicy.rewrite at DEPTH with cProfile")
    parser.add_argument("--top", type=int, default=30, help="rows of the cProfile listing (default 30)")
    parser.add_argument("--policy", default=",".join(DEFAULT_POLICIES),
                        help="comma-separated default policies of the maps (default: %(default)s)")
    parser.add_argument("--routes", default="default,alone",
                        help="default (serving checks on, as a user runs it) and/or alone (serving_checks=False)")
    parser.add_argument("--calibration", type=int, default=8, metavar="N",
                        help="at the main depth, calibrate each float8 policy on N batches (0: skip; default 8)")
    parser.add_argument("--no_peer", action="store_true",
                        help="skip TensorFlow's quantize_saved_model (dynamic-range int8) at the main depth (it is not run"
                             " on --large: at depth 12 it peaks at 7x the model's size)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure each case N times, alternating, and keep the fastest (default 1)")
    parser.add_argument("--serving", default=None, metavar="POLICIES", nargs="?", const="default",
                        help="instead of timing the rewrite, time serving the depth --depth outputs of these"
                             " comma-separated policies (default: " + ",".join(serving_bench.DEFAULT_POLICIES) + ")"
                             " beside the float32 input and the peers, in graph mode and under XLA; see"
                             " tools/serving_bench.py")
    parser.add_argument("--serving_batches", default="1,8,32", help="with --serving: batch sizes (default 1,8,32)")
    parser.add_argument("--serving_targets", default="default,cpu",
                        help="with --serving: --target values to write each policy with (default: none, and cpu)")
    parser.add_argument("--serving_peers", default="keras,amp,tfquant",
                        help="with --serving: keras (Keras's own export), amp (grappler's bfloat16 AMP), tfquant (TF"
                             " quantize_saved_model static int8); comma-separated, empty for none")
    parser.add_argument("--serving_runs", type=int, default=6, help="with --serving: timed calls after 3 warm-ups")
    parser.add_argument("--no_xla", action="store_true", help="with --serving: graph mode only")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.width % args.heads:
        parser.error("--width must be a multiple of --heads")
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    if not routes or set(routes) - {"default", "alone"}:
        parser.error(f"--routes: expected default and/or alone, got {args.routes!r}")
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    shape = {"width": args.width, "heads": args.heads, "seq": args.seq, "ffn": args.ffn or 4 * args.width}
    try:
        depths = sorted({int(d) for d in args.depths.split(",") if d.strip()} | {args.depth})
    except ValueError:
        parser.error(f"--depths: expected comma-separated integers, got {args.depths!r}")

    temp = None
    if args.workdir is None:
        temp = tempfile.TemporaryDirectory(prefix="tfpolicy_bench_")
        workdir = pathlib.Path(temp.name)
    else:
        workdir = args.workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
    _progress(f"policies {policies}; workdir {workdir}; depths {depths}; width {shape['width']} heads {shape['heads']}"
              f" seq {shape['seq']} ffn {shape['ffn']}{'; and the large encoder' if args.large else ''};"
              f" {os.cpu_count()} CPUs")
    started = time.perf_counter()
    if args.serving:
        try:
            return _serving(args, workdir, shape, started)
        finally:
            if temp is not None:
                temp.cleanup()
    try:
        plans = [(f"depth {d}", d, shape, d == args.depth) for d in depths]
        if args.large:
            large = dict(shape, **{k: v for k, v in LARGE.items() if k != "depth"})
            plans.append((f"depth {LARGE['depth']}, width {LARGE['width']}", LARGE["depth"], large, False))
        models, calibrations = [], []
        for label, depth, model_shape, peer in plans:
            export, params = ensure_export(workdir, depth, model_shape)
            tag = label.replace(" ", "").replace(",", "_")
            cases = [("floor", "floor", {})]
            for policy in policies:
                for route in routes:
                    cases.append((f"{policy} {route}", "tfpolicy",
                                  {"policy": policy, "serving_checks": int(route == "default")}))
            if peer and not args.no_peer:
                cases.append(("TF quantize_saved_model (dynamic-range int8)", "peer", {}))
            results: dict[str, list[dict]] = {name: [] for name, _, _ in cases}
            for i in range(args.repeat):  # alternate, so that all see the same background load
                run = f" (run {i + 1}/{args.repeat})" if args.repeat > 1 else ""
                for name, mode, options in cases:
                    results[name].append(measure(mode, export, workdir, tag, run, **options))
            models.append({"label": label, "params": params, "export": str(export), "shape": model_shape,
                           "routes": {name: best_of(runs) for name, runs in results.items()}})
            if depth == args.depth and model_shape is shape and args.calibration:
                for policy in (p for p in policies if p.startswith("float8")):
                    result = measure("calibrate", export, workdir, tag, policy=policy, batches=args.calibration,
                                     serving_checks=0)
                    calibrations.append(dict(result, label=label, policy=policy))
        profile = None
        if args.profile is not None:
            export, _ = ensure_export(workdir, args.profile, shape)
            out = workdir / "out" / f"profile_d{args.profile}"
            shutil.rmtree(out, ignore_errors=True)
            _progress(f"depth {args.profile}: profiling tfpolicy.rewrite ...")
            profile = run_child("profile", input=export, out=out, top=args.top, policy=policies[0])
            shutil.rmtree(out, ignore_errors=True)
            profile["depth"] = args.profile

        print()
        print(format_table(models, args.markdown))
        if calibrations:
            print()
            print(format_calibration(calibrations, args.markdown))
        if profile is not None:
            print()
            print(f"cProfile of tfpolicy.rewrite at depth {profile['depth']} ({profile['seconds']:.1f}s),"
                  f" top {args.top} by cumulative time:")
            print(profile["cumulative"])
            print("tfpolicy functions only, by cumulative time:")
            print(profile["tfpolicy_cumulative"])
            print(f"top {args.top} by own time:")
            print(profile["tottime"])
        if args.json:
            args.json.write_text(json.dumps({
                "depths": depths, "main_depth": args.depth, "cpus": os.cpu_count(), "policies": policies,
                "total_seconds": time.perf_counter() - started, "models": models, "calibration": calibrations,
                "profile": profile,
            }, indent=2) + "\n")
            _progress(f"wrote {args.json}")
    finally:
        if temp is not None:
            temp.cleanup()
    return 0


def _serving(args, workdir: pathlib.Path, shape: dict, started: float) -> int:
    export, params = ensure_export(workdir, args.depth, shape)
    result = serving_bench.run(args, workdir, export, params, shape, run_child, _progress, render)
    if args.json:
        serving_bench.json_dump(args.json, dict(result, total_seconds=time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())

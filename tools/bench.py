"""Benchmark tfpolicy.rewrite against a TensorFlow-only load/save floor on a transformer encoder.

    python tools/bench.py [--depth 12] [--width 768] [--heads 12] [--seq 128]
                          [--ffn 3072] [--depths 2,4,8,12] [--workdir DIR]
                          [--json OUT] [--repeat N] [--profile DEPTH]
                          [--policy mixed_bfloat16] [--no_serving_checks]
                          [--serving float32,int8_from_float32,...]

For each depth in ``--depths`` (plus ``--depth``) it builds, once and in its own
subprocess, a float32 Keras 3 Functional transformer encoder and exports it
with ``model.export(dir)``::

    Input "tokens" (seq, width)
    per block i: MultiHeadAttention "block_{i}_mha" -> + residual
                 -> LayerNormalization "block_{i}_ln1"
                 -> Dense "block_{i}_ffn_in" (ffn, gelu) -> Dense "block_{i}_ffn_out" (width)
                 -> + residual -> LayerNormalization "block_{i}_ln2"
    Dense "head" (width)

(about 85M parameters at depth 12, width 768). Then, each in a fresh
subprocess so that peak RSS belongs to one measurement, it measures the wall
time and peak RSS (``ru_maxrss`` of the child) of

  floor     ``tf.saved_model.load(dir)`` + ``tf.saved_model.save(loaded, out,
            signatures=loaded.signatures)``, TensorFlow alone;
  tfpolicy  ``tfpolicy.rewrite(dir, out, {"default_policy": POLICY})``, POLICY
            from ``--policy`` (default ``mixed_bfloat16``; e.g.
            ``int8_from_mixed_bfloat16`` or ``float8_from_mixed_bfloat16`` to
            time the quantization, float8 without calibration), with the
            serving checks unless ``--no_serving_checks``.

Only the work after the imports is timed; import time is reported apart.
``--repeat N`` runs each case N times, alternating floor and tfpolicy, and
keeps the fastest wall time (and the largest peak RSS); "cpu x" is the ratio
of user+system CPU seconds of the timed work in those fastest runs.
Peak RSS includes the imported libraries in both cases. Exports are kept in
``--workdir`` (keyed by the model's shape) and reused on later runs with the
same workdir; rewritten outputs are deleted after each measurement.

``--serving POLICIES`` measures what the outputs cost to serve instead: for
each policy (``float32`` is the input itself), the output's size and its
best-of-5 latency on one batch under ``jit_compile=True``, all in one process,
and the dot and convolution ops of its XLA HLO, counting those on ``s8``
(int8) operands.

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

RESULT_MARKER = "BENCH_RESULT "
DEFAULT_POLICY = "mixed_bfloat16"
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------
# Child side: each function runs in its own process and returns a JSON dict.
# --------------------------------------------------------------------------


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux, bytes on macOS.
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


def child_serving(args) -> dict:
    """Each policy's output: its size, its XLA latency on one batch, and its HLO's dots by operand type."""
    import re

    import numpy as np
    import tensorflow as tf

    import tfpolicy
    import tfpolicy.api

    rng = np.random.default_rng(0)
    rows = []
    for policy in args.policies.split(","):
        out = pathlib.Path(args.out) / policy
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        if policy == "float32":
            directory = pathlib.Path(args.input)
        else:
            tfpolicy.rewrite(args.input, out, {"default_policy": policy}, serving_checks=False)
            directory = out
        loaded = tf.saved_model.load(str(directory))
        function = loaded.signatures["serving_default"]
        (name, spec), = function.structured_input_signature[1].items()
        shape = [args.batch if d is None else d for d in spec.shape]
        x = tf.constant(rng.standard_normal(shape).astype(np.float32))
        compiled = tf.function(lambda t: function(**{name: t}), jit_compile=True)
        hlo = compiled.experimental_get_compiler_ir(x)(stage="hlo")
        dots = [line for line in hlo.splitlines() if re.search(r" (dot|convolution)\(", line)]
        compiled(x)  # compile once
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            next(iter(compiled(x).values())).numpy()
            times.append(time.perf_counter() - t0)
        rows.append({
            "policy": policy, "output_bytes": _directory_bytes(directory),
            "variables_bytes": _directory_bytes(directory / "variables"),
            "xla_seconds": min(times), "all_xla_seconds": times,
            "dots": len(dots), "s8_dots": sum(1 for line in dots if "s8[" in line.split("=", 1)[1]),
        })
        del loaded, function, compiled
        shutil.rmtree(out, ignore_errors=True)
    return {"rows": rows}


CHILDREN = {"export": child_export, "floor": child_floor, "tfpolicy": child_tfpolicy, "profile": child_profile,
            "serving": child_serving}


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
    parser.add_argument("--runs", type=int, default=5)
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


def measure(mode: str, export: pathlib.Path, workdir: pathlib.Path, depth: int, run: str = "",
            policy: str = DEFAULT_POLICY, serving_checks: bool = True) -> dict:
    out = workdir / "out" / f"{mode}_d{depth}"
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _progress(f"depth {depth}: {mode}{run} ...")
    tool = mode == "tfpolicy"
    result = run_child(mode, input=export, out=out, policy=policy if tool else None,
                       serving_checks=None if serving_checks or not tool else 0)
    _progress(f"depth {depth}: {mode}{run} {result['seconds']:.1f}s (cpu {result['cpu_seconds']:.1f}s),"
              f" peak RSS {result['peak_rss_mb']:.0f} MB (import {result['import_seconds']:.1f}s)")
    shutil.rmtree(out, ignore_errors=True)
    return result


def best_of(runs: list[dict]) -> dict:
    """The run with the least wall time, with every run's times and peak RSS alongside."""
    best = dict(min(runs, key=lambda r: r["seconds"]))
    best["all_seconds"] = [r["seconds"] for r in runs]
    best["all_cpu_seconds"] = [r["cpu_seconds"] for r in runs]
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


def format_table(rows: list[dict], markdown: bool = False) -> str:
    header = ("depth", "params", "floor s", "floor MB", "tfpolicy s", "tfpolicy MB", "time x", "RSS x", "cpu x")
    lines = [header]
    for r in rows:
        lines.append((
            str(r["depth"]), f"{r['params']:,}",
            f"{r['floor']['seconds']:.1f}", f"{r['floor']['peak_rss_mb']:.0f}",
            f"{r['tfpolicy']['seconds']:.1f}", f"{r['tfpolicy']['peak_rss_mb']:.0f}",
            f"{r['time_ratio']:.2f}", f"{r['rss_ratio']:.2f}",
            f"{r['tfpolicy']['cpu_seconds'] / r['floor']['cpu_seconds']:.2f}",
        ))
    return render(lines, markdown)


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
    parser.add_argument("--depths", default="2,4,8,12", help="comma-separated depths for the growth table")
    parser.add_argument("--workdir", type=pathlib.Path, default=None,
                        help="where exports (reused) and outputs go (default: a fresh temp dir, removed at exit)")
    parser.add_argument("--json", type=pathlib.Path, default=None, metavar="OUT", help="also write results as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown (for the README)")
    parser.add_argument("--profile", type=int, default=None, metavar="DEPTH",
                        help="also profile tfpolicy.rewrite at DEPTH with cProfile")
    parser.add_argument("--top", type=int, default=30, help="rows of the cProfile listing (default 30)")
    parser.add_argument("--policy", default=DEFAULT_POLICY,
                        help="the map's default policy (default mixed_bfloat16; try int8_from_mixed_bfloat16)")
    parser.add_argument("--no_serving_checks", action="store_true",
                        help="time tfpolicy.rewrite(..., serving_checks=False): no TF1 load or XLA lowering of the output")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure each case N times, alternating, and keep the fastest (default 1)")
    parser.add_argument("--serving", default=None, metavar="POLICIES",
                        help="instead of timing the rewrite, serve the depth --depth output of each comma-separated"
                             " policy (float32 = the input) under jit_compile=True: size, best-of-5 latency on one"
                             " batch of 8, and the dots of its XLA HLO (s8 = integer)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.width % args.heads:
        parser.error("--width must be a multiple of --heads")
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
    _progress(f"policy {args.policy}; workdir {workdir}; depths {depths}; width {shape['width']} heads {shape['heads']}"
              f" seq {shape['seq']} ffn {shape['ffn']}; {os.cpu_count()} CPUs")
    started = time.perf_counter()
    if args.serving:
        try:
            return _serving(args, workdir, shape, started)
        finally:
            if temp is not None:
                temp.cleanup()
    try:
        rows = []
        for depth in depths:
            export, params = ensure_export(workdir, depth, shape)
            floors, tfps = [], []
            for i in range(args.repeat):  # alternate, so both see the same background load
                run = f" (run {i + 1}/{args.repeat})" if args.repeat > 1 else ""
                floors.append(measure("floor", export, workdir, depth, run))
                tfps.append(measure("tfpolicy", export, workdir, depth, run, args.policy, not args.no_serving_checks))
            floor, tfp = best_of(floors), best_of(tfps)
            rows.append({
                "depth": depth, "params": params, "export": str(export), "floor": floor, "tfpolicy": tfp,
                "time_ratio": tfp["seconds"] / floor["seconds"],
                "rss_ratio": tfp["peak_rss_mb"] / floor["peak_rss_mb"],
            })
        profile = None
        if args.profile is not None:
            export, _ = ensure_export(workdir, args.profile, shape)
            out = workdir / "out" / f"profile_d{args.profile}"
            shutil.rmtree(out, ignore_errors=True)
            _progress(f"depth {args.profile}: profiling tfpolicy.rewrite ...")
            profile = run_child("profile", input=export, out=out, top=args.top, policy=args.policy)
            shutil.rmtree(out, ignore_errors=True)
            profile["depth"] = args.profile

        print()
        print(format_table(rows, args.markdown))
        main_row = next(r for r in rows if r["depth"] == args.depth)
        print()
        print(f"depth {args.depth} ({main_row['params']:,} params): tfpolicy {main_row['tfpolicy']['seconds']:.1f}s"
              f" / floor {main_row['floor']['seconds']:.1f}s = {main_row['time_ratio']:.2f}x time,"
              f" {main_row['tfpolicy']['peak_rss_mb']:.0f} / {main_row['floor']['peak_rss_mb']:.0f} MB"
              f" = {main_row['rss_ratio']:.2f}x peak RSS,"
              f" cpu {main_row['tfpolicy']['cpu_seconds']:.1f}s / {main_row['floor']['cpu_seconds']:.1f}s"
              f" (imports: tensorflow {main_row['floor']['import_seconds']:.1f}s,"
              f" tensorflow+tfpolicy {main_row['tfpolicy']['import_seconds']:.1f}s)")
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
                "shape": shape, "depths": depths, "main_depth": args.depth, "cpus": os.cpu_count(),
                "total_seconds": time.perf_counter() - started, "rows": rows, "profile": profile,
            }, indent=2) + "\n")
            _progress(f"wrote {args.json}")
    finally:
        if temp is not None:
            temp.cleanup()
    return 0


def _serving(args, workdir: pathlib.Path, shape: dict, started: float) -> int:
    export, params = ensure_export(workdir, args.depth, shape)
    _progress(f"depth {args.depth}: serving {args.serving} under XLA ...")
    result = run_child("serving", input=export, out=workdir / "out" / "serving", policies=args.serving)
    lines = [("policy", "output MB", "variables MB", "XLA ms (batch 8)", "dots", "s8 dots")]
    for r in result["rows"]:
        lines.append((r["policy"], f"{r['output_bytes'] / 1e6:.0f}", f"{r['variables_bytes'] / 1e6:.0f}",
                      f"{r['xla_seconds'] * 1e3:.0f}", str(r["dots"]), str(r["s8_dots"])))
    print(f"\ndepth {args.depth} ({params:,} params), {os.cpu_count()} CPUs:\n" + render(lines, args.markdown))
    if args.json:
        args.json.write_text(json.dumps({"shape": shape, "depth": args.depth, "params": params, "cpus": os.cpu_count(),
                                         "total_seconds": time.perf_counter() - started, **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

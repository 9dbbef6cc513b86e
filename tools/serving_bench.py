"""What the outputs cost to serve: ``tools/bench.py --serving``.

    python tools/bench.py --serving [POLICIES] [--serving_batches 1,8,32] [--serving_targets default,cpu]
                          [--serving_peers keras,amp,tfquant] [--depth 12] [--markdown] [--json OUT]

For each policy (default: mixed_bfloat16, int8_from_float32, int8_from_mixed_bfloat16,
float8_from_mixed_bfloat16, int4/128_from_mixed_bfloat16) it writes the depth
``--depth`` encoder of ``tools/bench.py`` with ``{"default_policy": POLICY}``
once per ``--serving_targets`` entry (``default`` = no ``--target``), and
beside them:

  float32        the input itself;
  keras          Keras's own export of the same policy (the encoder built
                 under the policy's source dtype policy, ``model.quantize``
                 for int8/int4/float8, ``model.export``);
  amp            the float32 input run with grappler's
                 ``auto_mixed_precision_onednn_bfloat16`` (TensorFlow's
                 bfloat16 rewrite at run time);
  tfquant        TensorFlow's ``quantize_saved_model``, static-range int8 for
                 the XLA op set, calibrated on 4 batches.

Each is then timed in a fresh process: ``serving_default`` called as a graph
(what TF Serving runs) and wrapped in ``tf.function(jit_compile=True)``, at
each batch size, the minimum of ``--serving_runs`` calls after 3 warm-ups.
Every latency is also given as a ratio to the float32 input's graph latency
at the same batch. The CPU flags that decide the figures (AMX, VNNI,
AVX512-BF16) are printed first.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time

DEFAULT_POLICIES = ("mixed_bfloat16", "int8_from_float32", "int8_from_mixed_bfloat16",
                    "float8_from_mixed_bfloat16", "int4/128_from_mixed_bfloat16")
CPU_FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512_vnni", "avx512_bf16", "avx_vnni", "avx512f", "avx2")
WARMUP = 3


def cpu_flags() -> str:
    """The CPU model and which of :data:`CPU_FLAGS` it has, from ``/proc/cpuinfo``."""
    model, flags = "unknown CPU", set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = [f for f in CPU_FLAGS if f in flags]
    lacks = [f for f in CPU_FLAGS[:6] if f not in flags]
    return f"{model}, {os.cpu_count()} CPUs; has {' '.join(have) or '-'}; lacks {' '.join(lacks) or '-'}"


# -- children (each in a fresh process, see bench.run_child) ------------------------------------


def child_serving_make(args) -> dict:
    """Write one served variant to ``args.out``: a tfpolicy rewrite, Keras's own export, or TF's quantizer."""
    import tensorflow as tf

    t0 = time.perf_counter()
    kind, policy = args.kind, args.policy
    out = pathlib.Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    if kind == "tfpolicy":
        import tfpolicy

        target = None if args.target in ("", "default") else args.target
        report = tfpolicy.rewrite(args.input, out, {"default_policy": policy}, target=target, serving_checks=False)
        note = report.lowering.int8_form if report.lowering is not None else ""
    elif kind == "keras":
        note = _keras_export(args, policy, out)
    elif kind == "tfquant":
        note = _tf_static_int8(args.input, out, args)
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    del tf
    return {"seconds": time.perf_counter() - t0, "note": note,
            "output_bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file())}


def _keras_export(args, policy: str, out: pathlib.Path) -> str:
    """The encoder as Keras itself applies ``policy`` to every layer, exported with ``model.export``."""
    import keras
    from bench import build_encoder

    mode, _, source = policy.partition("_from_")
    source = source or policy
    keras.config.set_dtype_policy(source)
    try:
        model = build_encoder(args.depth, args.width, args.heads, args.seq, args.ffn)  # the same seed: the same weights
    finally:
        keras.config.set_dtype_policy("float32")
    if source != policy:
        mode, _, block = mode.partition("/")
        if mode == "int4" and block:
            config = keras.quantizers.Int4QuantizationConfig(block_size=int(block))
            model.quantize("int4", config=config)
        else:
            model.quantize(mode)
    model.export(str(out), verbose=False)
    return f"keras {keras.__version__}"


def _tf_static_int8(input_dir: str, out: pathlib.Path, args) -> str:
    """TensorFlow's quantize_saved_model: static-range int8, XLA op set, calibrated on 4 batches of 8."""
    import numpy as np
    from tensorflow.compiler.mlir.quantization.tensorflow import quantization_options_pb2 as options_pb2
    from tensorflow.compiler.mlir.quantization.tensorflow.python import quantize_model

    method = options_pb2.QuantizationMethod(
        preset_method=options_pb2.QuantizationMethod.PresetMethod.METHOD_STATIC_RANGE_INT8)
    options = options_pb2.QuantizationOptions(quantization_method=method, op_set=options_pb2.OpSet.XLA,
                                              tags={"serve"}, signature_keys=["serving_default"])
    rng = np.random.default_rng(0)
    data = [{"tokens": rng.standard_normal((8, args.seq, args.width)).astype(np.float32)} for _ in range(4)]
    quantize_model.quantize(input_dir, str(out), options, representative_dataset=data)
    return "static-range int8, XLA op set"


def child_serving_time(args) -> dict:
    """Graph and XLA latency of ``serving_default`` at each batch size (``args.amp``: grappler's bfloat16 AMP on)."""
    import numpy as np
    import tensorflow as tf

    if args.amp:
        tf.config.optimizer.set_experimental_options({"auto_mixed_precision_onednn_bfloat16": True})
    loaded = tf.saved_model.load(args.input)
    function = loaded.signatures["serving_default"]
    (name, spec), = function.structured_input_signature[1].items()
    rng = np.random.default_rng(0)
    rows = {}
    for batch in (int(b) for b in args.serving_batches.split(",")):
        shape = [batch if d is None else d for d in spec.shape]
        x = tf.constant(rng.standard_normal(shape).astype(np.float32))
        row = {"graph_ms": _best_ms(lambda: _fetch(function(**{name: x})), args.runs)}
        if args.xla:
            compiled = tf.function(lambda t: function(**{name: t}), jit_compile=True)
            try:
                row["xla_ms"] = _best_ms(lambda: _fetch(compiled(x)), args.runs)
            except (tf.errors.OpError, ValueError) as exc:  # a CPU-only kernel, a string op: not compilable
                row["xla_error"] = str(exc).strip().splitlines()[0][:160]
        rows[str(batch)] = row
    return {"batches": rows}


def _fetch(outputs) -> None:
    for value in outputs.values():
        value.numpy()


SLOW_CALL_S = 20.0
"""A call slower than this is timed once more and no further (TF's XLA-op-set quantizer in graph mode)."""


def _best_ms(call, runs: int) -> float:
    started = time.perf_counter()
    call()
    if time.perf_counter() - started > SLOW_CALL_S:
        runs, warmup = 1, 0
    else:
        warmup = WARMUP - 1
    for _ in range(warmup):
        call()
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


CHILDREN = {"serving_make": child_serving_make, "serving_time": child_serving_time}


def add_child_arguments(parser) -> None:
    parser.add_argument("--kind", default="tfpolicy")
    parser.add_argument("--target", default="")
    parser.add_argument("--amp", type=int, default=0)
    parser.add_argument("--xla", type=int, default=1)
    parser.add_argument("--serving_batches", default="1,8,32")


# -- parent -------------------------------------------------------------------------------------


def variants(policies: list[str], targets: list[str], peers: list[str]) -> list[dict]:
    """The rows to measure, in table order."""
    rows = [{"label": "float32 (the input)", "kind": "input"}]
    if "amp" in peers:
        rows.append({"label": "grappler auto_mixed_precision_onednn_bfloat16", "kind": "input", "amp": 1})
    for policy in policies:
        for target in targets:
            tag = "" if target == "default" else f" --target {target}"
            rows.append({"label": f"tfpolicy {policy}{tag}", "kind": "tfpolicy", "policy": policy, "target": target})
        if "keras" in peers:
            rows.append({"label": f"Keras export, {policy}", "kind": "keras", "policy": policy})
    if "tfquant" in peers:
        rows.append({"label": "TF quantize_saved_model, static int8 (XLA op set)", "kind": "tfquant", "policy": "int8"})
    return rows


def run(args, workdir: pathlib.Path, export: pathlib.Path, params: int, shape: dict, run_child, progress, render) -> dict:
    """Make and time every variant; print the table; return the results."""
    policies = [p for p in (args.serving.split(",") if args.serving != "default" else DEFAULT_POLICIES) if p]
    targets = [t for t in args.serving_targets.split(",") if t]
    peers = [p for p in args.serving_peers.split(",") if p]
    machine = cpu_flags()
    progress(f"serving benchmark on {machine}")
    results = []
    for variant in variants(policies, targets, peers):
        path, note, size = export, "", None
        if variant["kind"] != "input":
            path = workdir / "out" / "serving" / variant["label"].replace(" ", "_").replace("/", "-")
            progress(f"{variant['label']}: writing ...")
            try:
                made = run_child("serving_make", input=export, out=path, kind=variant["kind"], policy=variant["policy"],
                                 target=variant.get("target", ""), depth=args.depth, **shape)
            except SystemExit as exc:
                results.append(dict(variant, note=f"failed: {exc}"))
                continue
            note, size = made["note"], made["output_bytes"]
        progress(f"{variant['label']}: timing ...")
        try:
            timed = run_child("serving_time", input=path, out=path, amp=variant.get("amp", 0), xla=int(not args.no_xla),
                              serving_batches=args.serving_batches, runs=args.serving_runs)
        except SystemExit as exc:
            timed, note = {}, f"{note}; timing failed: {exc}"
        results.append(dict(variant, note=note, output_bytes=size, **timed))
        progress(f"{variant['label']}: {_summary(timed)}")
        if variant["kind"] != "input":
            shutil.rmtree(path, ignore_errors=True)
    print(f"\ndepth {args.depth} ({params:,} params), seq {shape['seq']}; {machine}")
    print(render(table(results, args.serving_batches.split(",")), args.markdown))
    return {"machine": machine, "depth": args.depth, "params": params, "shape": shape, "rows": results}


def _summary(timed: dict) -> str:
    parts = []
    for batch, row in timed.get("batches", {}).items():
        xla = f"{row['xla_ms']:.0f}" if "xla_ms" in row else "-"
        parts.append(f"b{batch} graph {row['graph_ms']:.0f} ms, XLA {xla} ms")
    return "; ".join(parts) or "not timed"


def table(results: list[dict], batches: list[str]) -> list[tuple[str, ...]]:
    """ms and x float32-graph per batch size, graph and XLA."""
    base = results[0].get("batches", {})
    header = ["output"]
    for b in batches:
        header += [f"graph b{b}", "x", f"XLA b{b}", "x"]
    lines = [tuple(header + ["note"])]
    for row in results:
        cells = [row["label"]]
        for b in batches:
            timed = row.get("batches", {}).get(b, {})
            ref = base.get(b, {}).get("graph_ms")
            for key in ("graph_ms", "xla_ms"):
                value = timed.get(key)
                cells += [f"{value:.0f}" if value else "-", f"{value / ref:.2f}" if value and ref else "-"]
        errors = {t.get("xla_error") for t in row.get("batches", {}).values() if t.get("xla_error")}
        note = row.get("note", "") + (f"; XLA: {sorted(errors)[0][:60]}" if errors else "")
        lines.append(tuple(cells + [note]))
    return lines


def json_dump(path: pathlib.Path, result: dict) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")

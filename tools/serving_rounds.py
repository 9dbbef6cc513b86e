"""Serving latency of several SavedModels in rounds, one call of each per round: fair on a machine that drifts.

    python tools/serving_rounds.py [--rounds 12] [--batch 8] [--seq 128] [--signature serving_default] MODEL...

Each MODEL is loaded with the TF1 session loader (TF Serving's path) in this
one process; ``amp:MODEL`` loads MODEL with grappler's
``auto_mixed_precision_onednn_bfloat16`` on (TensorFlow's own bfloat16
rewrite at run time). After 3 warm-up calls each, every round calls every
model once, in turn, on the same inputs (random, of shape ``batch`` x ``seq``
for dynamic dimensions; integers in [0, 1000)). Printed per model: the
fastest and the median call, and the fastest as a ratio to the first
model's.

``tools/bench.py --serving`` times each output in a fresh process, one after
another: on a shared VM whose speed drifts by 20-30% within minutes, its
ratios then compare different moments. Here every model sees the same
moments; the table in the README says which figures came from which.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def load(spec: str, signature: str, batch: int, seq: int):
    """A call of signature ``signature`` of SavedModel ``spec`` (``amp:DIR``: with AMP) on fixed random inputs."""
    import tensorflow as tf
    from tensorflow.core.protobuf import rewriter_config_pb2

    tf1 = tf.compat.v1
    path, config = spec, tf1.ConfigProto()
    if spec.startswith("amp:"):
        path = spec[len("amp:"):]
        config.graph_options.rewrite_options.auto_mixed_precision_onednn_bfloat16 = rewriter_config_pb2.RewriterConfig.ON
    graph = tf.Graph()
    with graph.as_default():
        session = tf1.Session(graph=graph, config=config)
        meta = tf1.saved_model.loader.load(session, ["serve"], path)
    signature_def = meta.signature_def[signature]
    rng = np.random.RandomState(0)
    feeds = {}
    for tensor in signature_def.inputs.values():
        shape = [d.size if d.size > 0 else (batch if i == 0 else seq) for i, d in enumerate(tensor.tensor_shape.dim)]
        dtype = tf.as_dtype(tensor.dtype)
        values = rng.randint(0, 1000, shape) if dtype.is_integer else rng.standard_normal(shape)
        feeds[tensor.name] = values.astype(dtype.as_numpy_dtype)
    fetches = [tensor.name for tensor in signature_def.outputs.values()]
    return lambda: session.run(fetches, feeds)


def main(argv=None) -> list[tuple[str, float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", metavar="MODEL", help="SavedModel directories (amp:DIR for grappler's AMP)")
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds (default 12)")
    parser.add_argument("--batch", type=int, default=8, help="size of each input's first dynamic dimension (default 8)")
    parser.add_argument("--seq", type=int, default=128, help="size of the other dynamic dimensions (default 128)")
    parser.add_argument("--signature", default="serving_default")
    args = parser.parse_args(argv)
    calls = [load(model, args.signature, args.batch, args.seq) for model in args.models]
    for call in calls:
        for _ in range(3):
            call()
    seconds: list[list[float]] = [[] for _ in calls]
    for _ in range(args.rounds):
        for call, times in zip(calls, seconds):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    rows = [(model, min(times) * 1e3, statistics.median(times) * 1e3) for model, times in zip(args.models, seconds)]
    print(f"| model | fastest ms | median ms | x {args.models[0]} |")
    print("|---|---:|---:|---:|")
    for model, fastest, median in rows:
        print(f"| {model} | {fastest:.0f} | {median:.0f} | {fastest / rows[0][1]:.2f} |")
    return rows


if __name__ == "__main__":
    main()

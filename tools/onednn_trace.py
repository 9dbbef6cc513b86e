"""Which oneDNN primitives a SavedModel's signature runs, call by call: oneDNN's own log, counted.

    python tools/onednn_trace.py [--calls 3] [--batch 8] [--seq 128] [--signature serving_default]
        [--onednn_opts 1|0] [--max_isa ISA] MODEL

MODEL runs with the TF1 session loader (TF Serving's path, as
``tools/serving_rounds.py`` loads it) in a child process with
``ONEDNN_VERBOSE=1`` (and ``TF_ENABLE_ONEDNN_OPTS`` / ``ONEDNN_MAX_CPU_ISA``
when given). Printed, for the first and the last call: each kind of
primitive oneDNN executed, with its implementation and data types, how many
ran and their milliseconds. This is what shows that a ``--target cpu``
output's int8 sites run oneDNN's integer kernels (``inner_product`` with
``src:u8 wei:s8 bia:f32 dst:s32``), on which instructions
(``brgemm:avx512_core_amx``, ``gemm_s8u8s32`` ...), and that their kernels
are reordered into oneDNN's layout only at the first call (no ``reorder`` of
``s8`` weights in later calls).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import subprocess
import sys

TOOLS = pathlib.Path(__file__).resolve().parent
MARK = "tfpolicy-onednn-trace call"

_CHILD = f"""
import sys
sys.path.insert(0, {str(TOOLS)!r})
from serving_rounds import load
path, signature, batch, seq, calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
call = load(path, signature, batch, seq)
for i in range(calls):
    print("{MARK}", i, flush=True)
    call()
print("{MARK} end", flush=True)
"""

Row = collections.namedtuple("Row", "kind implementation types count ms")


def _types(descriptors: str) -> str:
    """``src:u8::blocked:ab::f0 wei:s8:a:blocked:ba::f0`` -> ``src:u8 wei:s8``."""
    return " ".join(":".join(d.split(":")[:2]) for d in descriptors.split())


def parse(log: str) -> dict[int, list[Row]]:
    """Call index -> the primitives oneDNN executed in it, grouped, from the child's stdout."""
    groups: dict[int, dict[tuple[str, str, str], list[float]]] = {}
    call = None
    for line in log.splitlines():
        if line.startswith(MARK):
            word = line[len(MARK):].strip()
            call = None if word == "end" else int(word)
            if call is not None:
                groups[call] = collections.defaultdict(list)
            continue
        parts = line.split(",")
        if call is None or not line.startswith("onednn_verbose") or "exec" not in parts[:5]:
            continue
        at = parts.index("exec")
        try:
            kind, implementation, descriptors, ms = parts[at + 2], parts[at + 3], parts[at + 5], float(parts[-1])
        except (IndexError, ValueError):  # a line of another layout: not counted
            continue
        groups[call][(kind, implementation, _types(descriptors))].append(ms)
    return {call: sorted((Row(*key, len(times), sum(times)) for key, times in found.items()), key=lambda r: -r.ms)
            for call, found in groups.items()}


def trace(model: str, *, calls: int = 3, batch: int = 8, seq: int = 128, signature: str = "serving_default",
          onednn_opts: str | None = None, max_isa: str | None = None) -> dict[int, list[Row]]:
    env = dict(os.environ, ONEDNN_VERBOSE="1", TF_CPP_MIN_LOG_LEVEL="2")
    if onednn_opts is not None:
        env["TF_ENABLE_ONEDNN_OPTS"] = onednn_opts
    if max_isa:
        env["ONEDNN_MAX_CPU_ISA"] = max_isa
    done = subprocess.run([sys.executable, "-c", _CHILD, model, signature, str(batch), str(seq), str(calls)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no message)"]
        raise SystemExit(f"onednn_trace: {model} did not run (exit {done.returncode}): {tail[0]}")
    return parse(done.stdout)


def main(argv=None) -> dict[int, list[Row]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", metavar="MODEL", help="a SavedModel directory")
    parser.add_argument("--calls", type=int, default=3, help="calls of the signature (default 3)")
    parser.add_argument("--batch", type=int, default=8, help="size of each input's first dynamic dimension (default 8)")
    parser.add_argument("--seq", type=int, default=128, help="size of the other dynamic dimensions (default 128)")
    parser.add_argument("--signature", default="serving_default")
    parser.add_argument("--onednn_opts", choices=("1", "0"), help="TF_ENABLE_ONEDNN_OPTS for the run (default: as set)")
    parser.add_argument("--max_isa", help="ONEDNN_MAX_CPU_ISA for the run, e.g. AVX2 (what an AVX2-only CPU runs)")
    args = parser.parse_args(argv)
    found = trace(args.model, calls=args.calls, batch=args.batch, seq=args.seq, signature=args.signature,
                  onednn_opts=args.onednn_opts, max_isa=args.max_isa)
    print("| call | primitive | implementation | data types | count | ms |")
    print("|---:|---|---|---|---:|---:|")
    for call in sorted({0, args.calls - 1} & set(found)):
        for row in found[call] or [Row("(none)", "", "", 0, 0.0)]:
            print(f"| {call} | {row.kind} | {row.implementation} | {row.types} | {row.count} | {row.ms:.1f} |")
    return found


if __name__ == "__main__":
    main()

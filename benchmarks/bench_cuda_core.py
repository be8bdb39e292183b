"""cuda.core allocations through emmpool's memory resource, against cuda.core's default one.

    python benchmarks/bench_cuda_core.py --out DIR [--rounds 5]

A child process per round times, at 4 KiB and 64 MiB, a Numba kernel launched over a NumPy array
(``launch``), ``Device.allocate`` + ``Buffer.close`` (``allocate``) and ``cuda.device_array`` +
``del`` (``memalloc``), the Device's memory resource swapped between blocks: benchmarks/README.md
says more. Writes DIR/bench_cuda_core.json and DIR/bench_cuda_core.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import cpus
import harness

SIZES = [4 << 10, 64 << 20]

CHILD = r"""
import gc, json, statistics, sys, time
import numpy as np
from numba import cuda
from cuda.core import DeviceMemoryResource, Stream
import emmpool

sizes, turns = [int(n) for n in sys.argv[1].split(",")], int(sys.argv[2])
ctx = cuda.current_context()
dev = ctx.device._dev
ours = dev.memory_resource                         # the plugin installed it at the bind
assert isinstance(ours, emmpool.cuda_core.EmmPoolMemoryResource), ours
theirs = DeviceMemoryResource(dev.device_id)       # cuda.core's default
stream = Stream.from_handle(0)                     # Numba's default stream, as numba passes it

@cuda.jit
def inc(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] += 1

def ops(n):
    host = np.zeros(n // 8)
    grid = max(1, (host.size + 255) // 256)
    def launch():
        inc[grid, 256](host)
    def allocate():
        dev.allocate(n, stream=stream).close()
    def memalloc():
        a = cuda.device_array(n, dtype=np.uint8); del a
    return {"launch": launch, "allocate": allocate, "memalloc": memalloc}

def block(op, reps):
    gc.disable()
    t = time.perf_counter_ns()
    for _ in range(reps):
        op()
    cuda.synchronize()
    dt = (time.perf_counter_ns() - t) / reps
    gc.enable()
    return dt

out = {}
for n in sizes:
    for name, op in ops(n).items():
        resources = [("emmpool", ours), ("default", theirs)]
        for _, mr in resources:             # warm both up, and size a block to ~20 ms
            dev.memory_resource = mr
            for _ in range(20):
                op()
        cuda.synchronize()
        one = block(op, 20)
        reps = max(5, min(2000, int(20e6 / max(one, 1))))
        times = {"emmpool": [], "default": []}
        for turn in range(turns):
            order = resources if turn % 2 == 0 else resources[::-1]
            for label, mr in order:
                dev.memory_resource = mr
                times[label].append(block(op, reps))
        dev.memory_resource = ours
        ratios = [a / b for a, b in zip(times["emmpool"], times["default"])]
        out[f"{name}:{n}"] = {"emmpool_ns": statistics.median(times["emmpool"]),
                              "default_ns": statistics.median(times["default"]),
                              "ratio": statistics.median(ratios), "reps": reps}
print(json.dumps(out))
"""


def run_round(turns: int) -> dict:
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="emmpool.plugin",
               NUMBA_CUDA_WARN_ON_IMPLICIT_COPY="0")
    return harness.run_code(CHILD, ",".join(map(str, SIZES)), turns, env=env)


def merge(rounds: list[dict]) -> dict:
    """Per case: the median over rounds of each round's ratio (with the lowest and highest)
    and of each resource's time."""
    merged = {}
    for case in rounds[0]:
        ratios = [r[case]["ratio"] for r in rounds]
        merged[case] = {
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "emmpool_us": statistics.median(r[case]["emmpool_ns"] for r in rounds) / 1e3,
            "default_us": statistics.median(r[case]["default_ns"] for r in rounds) / 1e3,
        }
    return merged


def table(merged: dict, rounds: int) -> str:
    lines = [
        "# bench_cuda_core: emmpool's cuda.core memory resource vs cuda.core's default",
        "",
        f"Median over {rounds} rounds (one process each; blocks of the two resources take turns "
        "in each). Ratio = emmpool / default (below 1: emmpool faster); the range is the "
        "lowest and highest round's ratio. `memalloc` is Numba's EMM path through the plugin "
        "(both columns time the same op: its ratio shows the run's noise).",
        "",
        "| op | size | emmpool µs | default µs | ratio | range |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for case, m in merged.items():
        op, n = case.split(":")
        size = f"{int(n) >> 10} KiB" if int(n) < 1 << 20 else f"{int(n) >> 20} MiB"
        lines.append(f"| {op} | {size} | {m['emmpool_us']:.2f} | {m['default_us']:.2f} | "
                     f"{m['ratio']:.3f} | {m['ratio_min']:.3f}-{m['ratio_max']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--turns", type=int, default=8, help="blocks per resource and case, per round")
    ap.add_argument("--cpus", type=int, default=4, help="CPUs near the GPU to pin to (0: none)")
    args = ap.parse_args(argv)
    pinned = cpus.pin_near_gpu(args.cpus)
    rounds = [run_round(args.turns) for _ in range(args.rounds)]
    merged = merge(rounds)
    harness.write_results(args.out, "bench_cuda_core",
                          {"cpus": pinned, "rounds": rounds, "merged": merged},
                          table(merged, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())

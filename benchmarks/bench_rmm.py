"""RMM allocating through emmpool's native resource, against RMM's own resources (GPU).

    python benchmarks/bench_rmm.py --out DIR [--rounds 3]

Resources, in one process per round, their blocks taking turns: emmpool's native resource
(``emmpool.rmm_resource``), emmpool's pool through RMM's Python ``CallbackMemoryResource`` (what
serves where the native one cannot be built), RMM's pool (``PoolMemoryResource`` over
``cudaMalloc``, 1 GiB to start), RMM's async resource (the driver's own pool,
``cudaMallocAsync``) and plain ``cudaMalloc``. Cases: ``rmm.DeviceBuffer(size=n, stream=s)``
allocated and freed from Python (4 KiB, 64 MiB), with ``DeviceBuffer(size=0)`` as the floor
(RMM's own cost, nothing allocated); and 8 C++ threads each allocating and freeing
``rmm::device_buffer``s of 4 KiB on a stream of its own through the device's resource, as
libcudf's do (benchmarks/rmm_threads.cpp; the caller holds the GIL throughout, but for the
callback resource, which needs it). Writes DIR/bench_rmm.json and DIR/bench_rmm.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import cpus
import harness

SIZES = [4 << 10, 64 << 20]
RESOURCES = ["emmpool", "callback", "rmm-pool", "rmm-async", "cudaMalloc"]
THREADS, THREAD_ITERATIONS, THREAD_BYTES = 8, 2000, 4 << 10

CHILD = r"""
import gc, json, sys, time
sys.path.insert(0, sys.argv[3])
import rmm, rmm.mr
import emmpool
from emmpool import _core, hooks
import rmm_threads

sizes, turns, cache = [int(n) for n in sys.argv[1].split(",")], int(sys.argv[2]), sys.argv[4]
emmpool.configure()
resources = {
    "emmpool": emmpool.rmm_resource(0),
    "callback": rmm.mr.CallbackMemoryResource(*hooks._rmm_callbacks(lambda: _core.pool(0))),
    "rmm-pool": rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=1 << 30),
    "rmm-async": rmm.mr.CudaAsyncMemoryResource(),
    "cudaMalloc": rmm.mr.CudaMemoryResource(),
}
assert type(resources["emmpool"]).__name__ == "EmmpoolMemoryResource", resources["emmpool"]
stream = rmm.pylibrmm.stream.Stream()

def block(n, mr, reps):
    gc.disable()
    t = time.perf_counter_ns()
    for _ in range(reps):
        b = rmm.DeviceBuffer(size=n, stream=stream, mr=mr)
        del b
    stream.synchronize()
    dt = (time.perf_counter_ns() - t) / reps
    gc.enable()
    return dt

out = {}
for n in [0, *sizes]:
    for mr in resources.values():
        block(n, mr, 50)                   # warm up
    reps = max(20, min(5000, int(20e6 / max(block(n, resources["rmm-pool"], 50), 1))))
    times = {name: [] for name in resources}
    for turn in range(turns):
        names = list(resources) if turn % 2 == 0 else list(resources)[::-1]
        for name in names:
            times[name].append(block(n, resources[name], reps))
    out[f"buffer:{n}"] = {name: min(t) for name, t in times.items()}

holding, free = rmm_threads.load(cache, hold_gil=True), rmm_threads.load(cache, hold_gil=False)
threads, iterations, nbytes = (int(x) for x in sys.argv[5].split(","))
per = {}
for name, mr in resources.items():
    rmm.mr.set_per_device_resource(0, mr)
    f = free if name == "callback" else holding
    rmm_threads.run(f, 0, threads, max(1, iterations // 10), nbytes, buffers=True)   # warm up
    seconds = [rmm_threads.run(f, 0, threads, iterations, nbytes, buffers=True)
               for _ in range(turns)]
    per[name] = threads * iterations / min(seconds)          # allocations per second
rmm.mr.set_per_device_resource(0, resources["emmpool"])
out["threads"] = per
print(json.dumps(out))
"""


def run_round(turns: int, cache: str) -> dict:
    here = str(Path(__file__).resolve().parent)
    return harness.run_code(CHILD, ",".join(map(str, SIZES)), turns, here, cache,
                            f"{THREADS},{THREAD_ITERATIONS},{THREAD_BYTES}")


def merge(rounds: list[dict]) -> dict:
    """Per case and resource, the median over rounds."""
    return {case: {name: statistics.median(r[case][name] for r in rounds)
                   for name in rounds[0][case]}
            for case in rounds[0]}


def table(merged: dict, rounds: int) -> str:
    lines = [
        "# bench_rmm: RMM through emmpool's native resource, against RMM's own resources",
        "",
        f"Median over {rounds} rounds (one process each) of each round's best block. "
        "`rmm.DeviceBuffer` allocate + free from Python, µs (size 0: RMM's own cost, nothing "
        "allocated); then 8 C++ threads allocating and freeing 4 KiB `rmm::device_buffer`s, "
        "each on a stream of its own, millions per second (the callback resource's caller lets "
        "the GIL go; the others' holds it). Ratios: emmpool's native resource against RMM's "
        "async resource (the driver's pool) and its pool.",
        "",
        "| case | " + " | ".join(RESOURCES) + " | ÷ async | ÷ pool |",
        "|---|" + "---:|" * (len(RESOURCES) + 2),
    ]
    for case, m in merged.items():
        if case == "threads":
            cells = [f"{m[r] / 1e6:.2f}" for r in RESOURCES]
            label = f"{THREADS} C++ threads (M/s)"
        else:
            n = int(case.split(":")[1])
            cells = [f"{m[r] / 1e3:.2f}" for r in RESOURCES]
            label = f"DeviceBuffer {n >> 10} KiB (µs)" if n < 1 << 20 else \
                f"DeviceBuffer {n >> 20} MiB (µs)"
        to_async, to_pool = m["emmpool"] / m["rmm-async"], m["emmpool"] / m["rmm-pool"]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {to_async:.2f} | {to_pool:.2f} |")
    threads = merged["threads"]
    lines += ["", f"8 threads: the native resource moves "
              f"{threads['emmpool'] / threads['callback']:.1f}× the callback resource's "
              f"allocations per second."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", type=int, default=5, help="blocks per resource and case, per round")
    ap.add_argument("--cpus", type=int, default=8, help="CPUs near the GPU to pin to (0: none)")
    args = ap.parse_args(argv)
    pinned = cpus.pin_near_gpu(args.cpus)
    with tempfile.TemporaryDirectory() as cache:
        os.environ.setdefault("EMMPOOL_RMM_CACHE", os.path.join(cache, "emmpool"))
        rounds = [run_round(args.turns, cache) for _ in range(args.rounds)]
    merged = merge(rounds)
    harness.write_results(args.out, "bench_rmm", {"cpus": pinned, "rounds": rounds,
                                                  "merged": merged}, table(merged, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())

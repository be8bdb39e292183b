"""cupy.empty and torch.empty + del through emmpool, against each library's own allocator.

    python benchmarks/bench_shared.py --out DIR [--rounds R] [--cpus N]

One child process per configuration and round (an allocator is fixed at a library's first
allocation): own, floor, emmpool, emmpool@NAME and, for CuPy, emmpool-direct. benchmarks/README.md
says what each is and what the table quotes. Writes DIR/bench_shared.json and DIR/bench_shared.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import baselines
import cpus
import harness

HERE = str(Path(__file__).resolve().parent)

SIZES = [256, 1 << 16, 1 << 22, 1 << 26]

CHILD = r"""
import ctypes, statistics, sys, time
lib, alloc, sizes = sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3].split(",")]
libc = ctypes.CDLL("libc.so.6")
if alloc.startswith("emmpool"):
    import baselines; baselines.check_imported()  # emmpool@NAME: the earlier build, or fail
if lib == "cupy":
    import cupy
    if alloc.startswith("emmpool"):
        import emmpool; emmpool.use_for_cupy()
        if alloc == "emmpool-direct":
            from emmpool import hooks
            cupy.cuda.set_allocator(hooks._installed[-1].malloc)
    elif alloc == "floor":
        dummy = ctypes.create_string_buffer(64)
        memset = ctypes.cast(libc.memset, ctypes.c_void_p).value
        floor = cupy.cuda.memory.CFunctionAllocator(ctypes.addressof(dummy), memset, memset, None)
        cupy.cuda.set_allocator(floor.malloc)
    def op(n):
        a = cupy.empty(n, dtype=cupy.uint8); del a
    sync = cupy.cuda.Device().synchronize
else:
    import torch
    if alloc.startswith("emmpool") and alloc != "emmpool-direct":
        import emmpool; emmpool.use_for_torch()
    elif alloc == "floor":
        # alloc: memset(ptr = size, c = device, n = stream), free: memset(ptr, c = size,
        # n = device): they write nothing on device 0 with the default stream (0), which is what
        # this child uses (checked once the allocator is in place: asking torch.cuda first
        # would initialize its own allocator, which then cannot be swapped).
        floor = torch.cuda.memory.CUDAPluggableAllocator("libc.so.6", "memset", "memset")
        torch.cuda.memory.change_current_allocator(floor)
        assert torch.cuda.current_device() == 0 and torch.cuda.current_stream().cuda_stream == 0
    def op(n):
        a = torch.empty(n, dtype=torch.uint8, device="cuda"); del a
    sync = torch.cuda.synchronize
out = {}
for n in sizes:
    for _ in range(2000):
        op(n)
    sync()
    blocks = []
    for _ in range(9):
        t = time.perf_counter()
        for _ in range(5000):
            op(n)
        blocks.append((time.perf_counter() - t) / 5000 * 1e9)
    sync()
    out[str(n)] = statistics.median(blocks)
if alloc.startswith("emmpool"):
    import emmpool
    s = emmpool.stats(0)
    out["stats"] = {k: s[k] for k in ("same_stream_reuses", "batches_closed", "allocations")}
import harness; harness.emit(out)
"""

CONFIGS = {
    "cupy": ("own", "floor", "emmpool", "emmpool-direct"),
    "torch": ("own", "floor", "emmpool"),
}


def _merge(rounds: list) -> dict:
    """Per size, the best of the rounds that succeeded (the host's noise comes per process:
    on the two-H200 host a whole child ran at the speed of the others or at half of it, the
    library's own pool included); the median and every round's figure are kept."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[-1]
    merged = dict(ok[-1])
    for size in [k for k in ok[-1] if k.isdigit()]:
        merged[size] = min(r[size] for r in ok)
        merged[f"{size}_median"] = statistics.median(r[size] for r in ok)
        merged[f"{size}_rounds"] = [r[size] for r in ok]
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--cpus", type=int, default=4,
                    help="pin every process to this many CPUs near the GPU; 0: no pinning "
                         "(default 4)")
    args = ap.parse_args()
    pinned = cpus.pin_near_gpu(args.cpus)  # the children inherit it
    # Interleaved rounds (own, floor, emmpool, ... then again): a drift of clocks or host load
    # over the minute lands on every configuration alike; each cell is the best round.
    rounds: dict = {}
    earlier = {f"emmpool@{name}": baselines.child_env(path)
               for name, path in baselines.baselines()}  # EMMCI_BENCH_BASELINES
    for rnd in range(args.rounds):
        order = ",".join(str(n) for n in SIZES[rnd % len(SIZES):] + SIZES[:rnd % len(SIZES)])
        for lib, allocs in CONFIGS.items():
            for alloc in (*allocs, *earlier):
                env = {**os.environ, **earlier.get(alloc, {})}
                env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")  # baselines.py
                p = subprocess.run([sys.executable, "-c", CHILD, lib, alloc, order],
                                   capture_output=True, text=True, timeout=300, env=env)
                rounds.setdefault(f"{lib}/{alloc}", []).append(
                    harness.result_of(p.stdout) or {"error": p.stderr[-500:]})
    results = {key: _merge(rs) for key, rs in rounds.items()}
    sizes = [str(n) for n in SIZES]
    rows = ["| allocator | 256 B | 64 KiB | 4 MiB | 64 MiB | emmpool stats |",
            "|---|---:|---:|---:|---:|---|"]
    for key, r in results.items():
        if "error" in r:
            rows.append(f"| {key} | error: {r['error'][-120:]!r} | | | | |")
            continue
        own = results[key.split("/")[0] + "/own"]
        cells = [f"{r[s]:.0f} ns" + (f" ({r[s] / own[s]:.2f}×)" if "error" not in own else "")
                 for s in sizes]
        stats = ", ".join(f"{k} {v}" for k, v in r.get("stats", {}).items())
        rows.append(f"| {key} | " + " | ".join(cells) + f" | {stats} |")
    where = f"CPUs {pinned} (near the GPU)" if pinned else "CPUs not pinned"
    table = (f"empty()+del, ns per op: the best of {args.rounds} interleaved rounds (one process "
             f"each; medians in the JSON) of the median of 9 timed blocks; {where}. In "
             "parentheses: ratio to the library's own pool.\n\n")
    table += "\n".join(rows) + "\n"
    harness.write_results(args.out, "bench_shared",
                          {"cpus": pinned, "rounds": args.rounds, **results}, table)


if __name__ == "__main__":
    main()

"""Where the time of a PyTorch training step goes, with PyTorch's allocator and with emmpool.

    python benchmarks/profile_torch_step.py [--model transformer] [--compile reduce-overhead]
                                            [--steps 60] [--out DIR]

One child process per allocator (``--configs``, in that order, repeats allowed) runs
bench_torch_train's model, compiled in the child as there; benchmarks/README.md says what it
reports. A diagnostic, not a benchmark: bench_torch_train.py and bench_torch_compile.py give the
comparable figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_torch_train
import cpus
import harness

# What cudagraph trees and torch.cuda.graph call on the allocator (torch._C, looked up per call).
ALLOCATOR_CALLS = ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_beginAllocateToPool",
                   "_cuda_endAllocateToPool", "_cuda_releasePool", "_cuda_getCheckpointState",
                   "_cuda_setCheckpointPoolState", "_cuda_checkPoolLiveAllocations")
POOL_COUNTS = ("allocations", "segment_allocations", "segment_releases", "batches_closed",
               "same_stream_reuses")
PAIR_SIZES = (512, 1 << 16, 1 << 22)


def count_calls(torch, counts: collections.Counter) -> None:
    for name in ALLOCATOR_CALLS:
        fn = getattr(torch._C, name, None)
        if fn is None:
            continue

        def wrapped(*a, _fn=fn, _name=name, **k):
            counts[_name] += 1
            return _fn(*a, **k)

        setattr(torch._C, name, wrapped)
    graph = torch.cuda.CUDAGraph
    for method in ("capture_begin", "replay"):
        original = getattr(graph, method)

        def wrapped(self, *a, _orig=original, _name=method, **k):
            counts["graph." + _name] += 1
            return _orig(self, *a, **k)

        setattr(graph, method, wrapped)


def child(config: str, model: str, compile_mode: str | None, warmup: int, steps: int,
          profiled: int) -> dict:
    import torch

    if config == "emmpool":
        import emmpool

        emmpool.use_for_torch("extension")

    def pool_counts() -> dict:
        if config != "emmpool":
            return {}
        s = emmpool.stats(0)
        return {k: s.get(k, 0) for k in POOL_COUNTS}

    counts: collections.Counter = collections.Counter()
    count_calls(torch, counts)
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    step = bench_torch_train.MAKERS[model](torch, bench_torch_train.compiler(torch, compile_mode))

    def one(i):
        if compile_mode is not None:
            torch.compiler.cudagraph_mark_step_begin()
        return step(i)

    rows = []
    for i in range(warmup + steps):
        before, pool_before = counts.copy(), pool_counts()
        t0 = time.perf_counter()
        loss = one(i)
        t_host = time.perf_counter()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.item()
        pool_after = pool_counts()
        rows.append({"step": i, "warmup": i < warmup, "ms": (t1 - t0) * 1e3,
                     "host_ms": (t_host - t0) * 1e3,
                     "calls": {k: v - before.get(k, 0) for k, v in counts.items()
                               if v != before.get(k, 0)},
                     "pool": {k: pool_after[k] - pool_before[k] for k in pool_after}})

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(profiled):
            one(warmup + steps + i)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    ops = sorted(((e.key, e.self_cpu_time_total, e.count) for e in averages),
                 key=lambda t: -t[1])[:25]
    device_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                    for e in averages)
    host_us = sum(e.self_cpu_time_total for e in averages)

    pairs = {size: float("inf") for size in PAIR_SIZES}
    for _ in range(5):  # the best of 5 blocks of each size, the sizes taking turns
        for size in PAIR_SIZES:
            n = 10000
            for _ in range(1000):
                torch.empty(size, dtype=torch.uint8, device="cuda")
            t0 = time.perf_counter()
            for _ in range(n):
                torch.empty(size, dtype=torch.uint8, device="cuda")
            pairs[size] = min(pairs[size], (time.perf_counter() - t0) / n * 1e9)
    torch.cuda.synchronize()
    return {"config": config, "rows": rows, "ops": ops, "profiled_steps": profiled,
            "device_us_per_step": device_us / profiled, "host_us_per_step": host_us / profiled,
            "pair_ns": pairs}


def report(results: list[dict], args) -> str:
    lines = [f"# profile_torch_step: {args.model}, compile {args.compile or 'off'}, "
             f"{args.warmup} warm-up + {args.steps} steps", ""]
    for n, r in enumerate(results, 1):
        timed = [x for x in r["rows"] if not x["warmup"]]
        ms = sorted(x["ms"] for x in timed)
        lines += [f"## {n}. {r['config']}", "",
                  f"step ms: min {ms[0]:.3f}, median {statistics.median(ms):.3f}, "
                  f"p90 {ms[int(0.9 * (len(ms) - 1))]:.3f}, max {ms[-1]:.3f}; host time to the "
                  f"synchronize: median {statistics.median(x['host_ms'] for x in timed):.3f} ms",
                  f"profiled ({r['profiled_steps']} steps): host {r['host_us_per_step']:.0f} us "
                  f"per step, device {r['device_us_per_step']:.0f} us per step",
                  "allocate + free pair: " + ", ".join(
                      f"{int(k)} B {v:.0f} ns" for k, v in r["pair_ns"].items()), "",
                  "steps (ms, host ms, allocator calls, pool counts):", "```"]
        for x in r["rows"]:
            lines.append(f"{x['step']:3d}{'w' if x['warmup'] else ' '} {x['ms']:8.3f} "
                         f"{x['host_ms']:8.3f} {json.dumps(x['calls'])} {json.dumps(x['pool'])}")
        lines += ["```", "", "top operators by self host time (us, calls):", "```"]
        lines += [f"{us:10.0f} {n:6d}  {name}" for name, us, n in r["ops"]]
        lines += ["```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--compile", default="reduce-overhead", help="'' for eager")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--profiled", type=int, default=3)
    ap.add_argument("--configs", default="native,emmpool")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        harness.emit(child(args.child, args.model, args.compile or None, args.warmup,
                           args.steps, args.profiled))
        return
    cpus.pin_near_gpu(8)
    results = []
    for config in args.configs.split(","):
        cmd = [sys.executable, __file__, "--child", config, "--model", args.model, "--compile",
               args.compile, "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--profiled", str(args.profiled)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                           env={**os.environ, **bench_torch_train.compile_env()})
        result = harness.result_of(p.stdout)
        if result is None:
            print(f"{config} failed:\n{(p.stdout + p.stderr)[-3000:]}", flush=True)
            continue
        results.append(result)
    text = report(results, args)
    print(text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_torch_step.md").write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Where the time goes in the allocate-output + launch + free loop, phase by phase.

    python benchmarks/profile_kernel_loop.py [--manager emmpool|nothing|cupy-pool] [--n 3000]

Runs bench_numba's alloc_axpy loop (its kernel, each manager installed as bench_numba does) in
this process and reports the mean host time of each phase (allocation, launch, free) and, for
emmpool, the driver work the pool did (segments, batches). A diagnostic, not a benchmark:
bench_numba.py gives the comparable figures.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import numpy as np

import numba_cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--manager", default="emmpool")
    ap.add_argument("--n", type=int, default=3000)
    args = ap.parse_args()

    from numba import cuda

    manager = numba_cases._load_manager(args.manager)  # as bench_numba's children install it
    if manager is not None:  # numba-default: Numba's own
        cuda.set_memory_manager(manager)
    n = numba_cases.AXPY_N
    x = cuda.to_device(np.ones(n))
    y = cuda.to_device(np.ones(n))
    launch = numba_cases._axpy[(n + 255) // 256, 256]
    for _ in range(200):  # warm-up and compile
        out = cuda.device_array(n, np.float64)
        launch(out, 2.0, x, y)
        del out
    cuda.synchronize()
    stats0 = _stats(args.manager)
    t_alloc = t_launch = t_free = 0.0
    pc = time.perf_counter
    t_start = pc()
    for _ in range(args.n):
        t0 = pc()
        out = cuda.device_array(n, np.float64)
        t1 = pc()
        launch(out, 2.0, x, y)
        t2 = pc()
        del out
        t3 = pc()
        t_alloc += t1 - t0
        t_launch += t2 - t1
        t_free += t3 - t2
    t_loop = pc() - t_start
    cuda.synchronize()
    t_total = pc() - t_start
    us = 1e6 / args.n
    print(
        f"{args.manager}: per op {t_total * us:.1f} us (host loop {t_loop * us:.1f}); "
        f"alloc {t_alloc * us:.1f}, launch {t_launch * us:.1f}, free {t_free * us:.1f}"
    )
    stats1 = _stats(args.manager)
    if stats1:
        keys = ("segment_allocations", "segment_releases", "batches_closed", "allocations")
        print("  pool:", {k: stats1[k] - stats0[k] for k in keys}, "segments", stats1["segments"])
    gc.collect()


def _stats(manager):
    if manager != "emmpool":
        return None
    import emmpool

    return emmpool.stats(0)


if __name__ == "__main__":
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
    main()

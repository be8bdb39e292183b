#!/usr/bin/env python
"""The Python-visible cost of one Numba allocation through emmpool, without a GPU.

    python benchmarks/bench_plugin_path.py [--rounds 7] [--ops 2000] [--blocks 15] [--json FILE]

ns per allocation + free (one op: ``m = mgr.memalloc(n); del m``) over the host driver
(``_core.HostDriver``, events complete at once: an idle GPU). Numba's ``MemoryPointer`` needs no
GPU to be made, so every variant makes the very objects Numba makes on a GPU (``MemoryPointer`` +
``weakref.finalize``); only the array around it is left out. The variants (``floor``,
``pybind11``, ``emmpool``, and the pool's calls alone: ``pybind11 pair``, ``entry pair``) and
what the table quotes: benchmarks/README.md. Ratios matter: this runs on a CPU, not the GPU hosts
of bench_numba.py.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
import types
import weakref

SIZES = [("256B", 256), ("64KiB", 64 << 10), ("4MiB", 4 << 20), ("64MiB", 64 << 20)]


def _setup():
    try:
        from emmpool import _core
    except ImportError:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "python"))
        from emmpool import _core
    host = _core.HostDriver(devices=1, capacity=1 << 40)
    host.set_auto_complete(True)  # every event has completed when asked: an idle GPU
    _core._use_driver_for_all_pools(host)

    from emmpool import _numba_packages as packages
    from emmpool import plugin

    pkg = packages.installed()[0]
    emm = packages.emm_api(pkg)
    ctx = emm.Context.__new__(emm.Context)  # no CUDA: only what memalloc reads
    ctx.device = types.SimpleNamespace(id=0)
    mgr = plugin.manager_for(pkg.name)(context=ctx)
    mgr.initialize()
    return _core, plugin, emm, ctx, mgr, pkg


def _variants(_core, plugin, emm, ctx, mgr):
    MemoryPointer = emm.MemoryPointer
    pool = mgr.pool
    legacy = _core.LEGACY_STREAM
    tag = _core.LIBRARIES.index("numba")
    generation = pool.generation
    noop = lambda: None  # noqa: E731
    floor_ptr = 1 << 40

    class Floor:
        def __init__(self):
            self._ctx = weakref.proxy(ctx)

        def memalloc(self, size):
            return MemoryPointer(self._ctx, floor_ptr, size, finalizer=noop)

    class Pybind11:  # emmpool.plugin's memalloc over pybind11, not the C entry points
        def __init__(self):
            self._pool = pool
            self._ctx = weakref.proxy(ctx)
            self._allocate = pool.allocate
            self._free = pool.deallocate
            self._generation = generation
            self._emm = emm

        def memalloc(self, size):
            if type(size) is not int:
                size = plugin._as_size(size)
            if size < 0:
                raise ValueError(f"cannot allocate a negative number of bytes ({size})")
            try:
                if self._pool is None:
                    raise AssertionError
                ptr = self._allocate(size, legacy, tag)
            except (_core.OutOfMemoryError, _core.CudaError) as e:
                raise plugin._as_numba_error(self._emm, e) from None
            finalizer = functools.partial(self._free, ptr, legacy, self._generation)
            return self._emm.MemoryPointer(self._ctx, ptr, size, finalizer=finalizer)

    def loop(memalloc):
        def run(n, size):
            for _ in range(n):
                m = memalloc(size)
                del m
        return run

    def pybind_pair(n, size):
        allocate, free, partial = pool.allocate, pool.deallocate, functools.partial
        for _ in range(n):
            partial(free, allocate(size, legacy, tag), legacy, generation)()

    variants = {
        "floor": loop(Floor().memalloc),
        "pybind11": loop(Pybind11().memalloc),
        "emmpool": loop(mgr.memalloc),
        "pybind11 pair": pybind_pair,
    }
    entry = getattr(mgr, "_entry", None)  # the C entry points, where the plugin has them
    if entry is not None:
        def entry_pair(n, size):
            allocate = entry.allocate
            for _ in range(n):
                allocate(size)()
        variants["entry pair"] = entry_pair
    return variants


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ops", type=int, default=2000, help="ops per timed block")
    p.add_argument("--blocks", type=int, default=15,
                   help="timed blocks per variant, size and round; a round's figure is its "
                        "fastest block (CPU-bound code: the host's noise only ever adds)")
    p.add_argument("--json", help="write every round here")
    args = p.parse_args(argv)

    _core, plugin, emm, ctx, mgr, pkg = _setup()
    variants = _variants(_core, plugin, emm, ctx, mgr)
    names = list(variants)
    rounds = {(v, s): [] for v in names for s, _ in SIZES}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for label, size in SIZES:
            for v in order:
                run = variants[v]
                run(2000, size)  # warm-up
                gc.collect()
                blocks = []
                for _ in range(args.blocks):
                    t0 = time.perf_counter_ns()
                    run(args.ops, size)
                    blocks.append((time.perf_counter_ns() - t0) / args.ops)
                rounds[(v, label)].append(min(blocks))

    stats = mgr.pool.stats()
    assert stats["blocks_in_use"] == 0, stats  # every finalizer freed its block
    lines = [f"ns per op (memalloc + del), {pkg.name}, Python {platform.python_version()}, "
             f"{args.rounds} interleaved rounds (a round: the fastest of {args.blocks} blocks of "
             f"{args.ops} ops): median of rounds (best round); +ns over the floor's median of "
             "the same size",
             "",
             "| variant | " + " | ".join(s for s, _ in SIZES) + " |",
             "|---|" + "---:|" * len(SIZES)]
    for v in names:
        cells = []
        for label, _ in SIZES:
            vals = rounds[(v, label)]
            med = statistics.median(vals)
            floor = statistics.median(rounds[("floor", label)])
            extra = "" if v == "floor" or "pair" in v else f" +{med - floor:.0f}"
            cells.append(f"{med:.0f} ({min(vals):.0f}){extra}")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": platform.python_version(), "package": pkg.name,
                       "rounds": {f"{v} {s}": vals for (v, s), vals in rounds.items()}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Numba allocation benchmark: emmpool against anchor EMM plugins.

    python benchmarks/bench_numba.py --out DIR [--quick] [--pairing in-process|process]

Numba's EMM plugin is installed once per process, before its CUDA context exists, so the
parent spawns child processes: by default one per round, in which emmpool is installed and
the other managers are swapped in beside it block by block (--pairing in-process: ratios to
the floor taken within the process), or one per manager and round (--pairing process). Each
child prints a single ``BENCH_RESULT {json}`` line; the parent writes ``DIR/bench_numba.json``
and ``.md`` (``bench_numba_process.*`` for the process pairing) and prints the markdown table.
See benchmarks/README.md for what each case measures and why the pairing.
"""

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import numpy as np
from numba import cuda  # importing creates no CUDA context

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

RESULT_MARKER = "BENCH_RESULT "

# (name, extra environment for the child).  Run and tabulated in this order.
MANAGERS = [
    ("numba-default", {}),
    ("cudamalloc", {}),
    ("cupy-pool", {}),
    ("nothing", {}),
    ("emmpool", {"EMMPOOL_MODE": "pool"}),
    ("emmpool-passthrough", {"EMMPOOL_MODE": "passthrough"}),
    # The default puts Numba's blocks above 1 MiB on the growable segment: what fixed segments
    # (cuMemAlloc, legacy IPC handles) would cost instead.
    ("emmpool-fixed", {"EMMPOOL_MODE": "pool", "EMMPOOL_SEGMENTS": "fixed"}),
]
FLOOR = "nothing"
# Managers timed in every round; the others (anchors) in the first --anchor-rounds only.
ALL_ROUNDS = {FLOOR, "emmpool"}

ALLOC_FREE_SIZES = [
    ("256B", 256),
    ("64KiB", 64 << 10),
    ("4MiB", 4 << 20),
    ("64MiB", 64 << 20),
]
CASES = [f"alloc_free_{label}" for label, _ in ALLOC_FREE_SIZES] + [
    "churn",
    "alloc_axpy",
]

# The pinned-host suite (benchmarks/bench_pinned.py runs it): cuda.pinned_array /
# cuda.mapped_array + del, i.e. the plugin's memhostalloc and its free.
PINNED_MANAGERS = [
    ("numba-default", {}),
    ("cupy-pinned-pool", {}),
    ("nothing", {}),
    ("emmpool", {"EMMPOOL_MODE": "pool", "EMMPOOL_PINNED": "pool"}),
]
PINNED_SIZES = [("4KiB", 4 << 10), ("1MiB", 1 << 20), ("64MiB", 64 << 20)]
PINNED_CASES = [f"{kind}_{label}" for kind in ("pinned", "mapped") for label, _ in PINNED_SIZES]
PINNED_CASES.append("pinned_copy_1MiB")

CHURN_SLOTS = 64
CHURN_MIN_BYTES = 256
CHURN_MAX_BYTES = 16 << 20
CHURN_SEED = 12345
CHURN_SCHEDULE = 1 << 14  # precomputed (size, slot) pairs, replayed cyclically

AXPY_N = 1 << 20  # float64 elements (8 MiB per array)
AXPY_TPB = 256

# Timing knobs: (per-case time budget s, timed blocks, warm-up ops (at least, and per warm-up
# chunk), warm-up s (at least), minimum calibration block s, min ops per block).
FULL = dict(budget=1.0, repeats=7, warmup_ops=200, warmup_s=0.5, calib_s=0.02, min_ops=50)
QUICK = dict(budget=0.15, repeats=3, warmup_ops=20, warmup_s=0.05, calib_s=0.01, min_ops=10)
MAX_OPS_PER_BLOCK = 200_000


@cuda.jit
def _axpy(out, a, x, y):
    # Compiled lazily on first launch, i.e. only in a child process.
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i] + y[i]


# --------------------------------------------------------------------------
# Child: one manager, all cases
# --------------------------------------------------------------------------


def _import_emmpool_plugin():
    try:
        import emmpool.plugin
    except ImportError:
        # Not installed: fall back to the in-tree package (python/emmpool),
        # e.g. after an in-place build of the extension.
        sys.path.insert(0, os.path.join(REPO, "python"))
        import emmpool.plugin
    return emmpool.plugin.EmmPoolManager


def _load_manager(name):
    """Return the plugin class for *name*, or None for Numba's built-in one.

    Must not create a CUDA context (that would pin Numba's default manager).
    """
    if name == "numba-default":
        return None
    if name.startswith("emmpool"):
        manager = _import_emmpool_plugin()
        sys.path.insert(0, HERE)
        import baselines

        baselines.check_imported()  # emmpool@NAME: the earlier build, or fail
        return manager
    sys.path.insert(0, HERE)
    import anchors

    return anchors.ANCHORS[name]


def _versions():
    out = {"python": sys.version.split()[0]}
    for dist in ("numba-cuda", "numba", "numpy", "cuda-bindings",
                 "cupy-cuda13x", "cupy-cuda12x", "cupy", "emmpool"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _warm_up_and_calibrate(run, sync, knobs):
    """Run the op for knobs['warmup_s'] seconds, then find how many ops make a timed block
    (about knobs['budget'] / knobs['repeats'] seconds); returns that count."""
    end = time.perf_counter() + knobs["warmup_s"]
    while True:
        run(knobs["warmup_ops"])
        sync()
        if time.perf_counter() >= end:
            break
    n = 8
    while True:  # calibration, doubling as extra warm-up
        t0 = time.perf_counter()
        run(n)
        sync()
        dt = time.perf_counter() - t0
        if dt >= knobs["calib_s"] or n >= MAX_OPS_PER_BLOCK:
            break
        n = min(4 * n, MAX_OPS_PER_BLOCK)
    per_op = dt / n
    ops = int(knobs["budget"] / knobs["repeats"] / max(per_op, 1e-9))
    return max(knobs["min_ops"], min(ops, MAX_OPS_PER_BLOCK))


def _measure(run, sync, knobs, counters=None):
    """Median over blocks of the mean time per op, in seconds.

    The op count per block adapts to the operation's cost so that every case
    takes about knobs['budget'] seconds whatever the manager.  The device is
    synchronised before each block (untimed) and at its end (timed), so work
    the op queued on the GPU is charged to it.

    The op runs for knobs['warmup_s'] seconds before anything is timed. With a
    fixed 200 ops (a few ms), churn's first two to four timed blocks (~0.15 s
    each) ran 2-3x slower than the rest, for the floor and the pools alike (a
    fresh process settling), so the median of 7 blocks fell inside or outside
    that transient by chance: without the warm-up, the floor's churn moved
    13-31 us between rounds on one H100 (results/H100/bench_numba.json).

    counters: None, or a function returning a dict of counters (emmpool's pool statistics):
    their change over the timed blocks, per op, is reported as "pool_per_op".
    """
    ops = _warm_up_and_calibrate(run, sync, knobs)
    means = []
    before = counters() if counters else None
    for _ in range(knobs["repeats"]):
        sync()
        t0 = time.perf_counter()
        run(ops)
        sync()
        means.append((time.perf_counter() - t0) / ops)
    out = {
        "us_per_op": statistics.median(means) * 1e6,
        "block_means_us": [m * 1e6 for m in means],
        "ops_per_block": ops,
        "blocks": len(means),
    }
    if counters:
        after, total = counters(), ops * len(means)
        out["pool_per_op"] = {k: (after[k] - before[k]) / total for k in before}
    return out


def _measure_paired(runs, switch, sync, knobs, counters=None):
    """_measure for several managers in one process, their timed blocks interleaved.

    runs: {manager: run}, the floor first. switch(manager) makes Numba allocate with that
    manager. Each manager is warmed up and calibrated as in _measure; then come
    knobs['repeats'] turns of one block per manager, in the order of `runs` and then reversed
    (A B C, C B A, ...), so that a block of the floor is next to a block of every manager and
    a drift over the run lands on both alike. Returns {manager: _measure's dict}, plus for
    each manager but the floor "block_ratios" (its block over the floor's block of the same
    turn) and "ratio_to_floor", their median.

    Why: on the GPU hosts used, the host's speed changes over seconds, within a process as
    much as between processes (on one H200 the floor's figure moved 10-19 us between rounds,
    and between cases of one round), so two processes timed a minute apart cannot resolve a
    10% difference. Blocks a fraction of a second apart can.

    counters: {manager: function} as in _measure, for the managers that have them.
    """
    counters = counters or {}
    names = list(runs)
    ops = {}
    for name in names:
        switch(name)
        ops[name] = _warm_up_and_calibrate(runs[name], sync, knobs)
    means = {name: [] for name in names}
    before = {name: f() for name, f in counters.items()}
    for r in range(knobs["repeats"]):
        for name in (names if r % 2 == 0 else names[::-1]):
            switch(name)
            sync()
            t0 = time.perf_counter()
            runs[name](ops[name])
            sync()
            means[name].append((time.perf_counter() - t0) / ops[name])
    out = {}
    floor = means[names[0]]
    for name in names:
        m = means[name]
        out[name] = {
            "us_per_op": statistics.median(m) * 1e6,
            "block_means_us": [x * 1e6 for x in m],
            "ops_per_block": ops[name],
            "blocks": len(m),
        }
        if name != names[0]:
            ratios = [a / b for a, b in zip(m, floor)]
            out[name]["block_ratios"] = ratios
            out[name]["ratio_to_floor"] = statistics.median(ratios)
        if name in counters:
            import pool_counters

            out[name]["pool_per_op"] = pool_counters.per_op(before[name], counters[name](),
                                                            ops[name] * len(m))
    return out


# The pool's work behind a Numba op (emmpool.stats() keys; builds without one skip it): events
# recorded and queried to fence Numba's frees, segments taken from and given back to the driver.
POOL_COUNTERS = ("batches_closed", "fence_queries", "segment_allocations", "segment_releases",
                 "dormant_fences")


def _pool_counters(name):
    """A function returning the emmpool pool's counters for _measure, or None (other managers)."""
    sys.path.insert(0, HERE)
    import pool_counters

    return pool_counters.reader(name, POOL_COUNTERS)


def _raw_device_array(n, dtype):
    """A device array backed by a direct cuMemAlloc, bypassing the plugin.

    Used for the axpy inputs so that every manager runs the same kernel on the
    same kind of memory, and so the `nothing` floor (whose allocations all
    alias one buffer) still computes a checkable result.
    """
    from cuda.bindings import driver as cu
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    dtype = np.dtype(dtype)
    nbytes = n * dtype.itemsize
    err, ptr = cu.cuMemAlloc(nbytes)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemAlloc({nbytes}) failed: {err.name}")
    # No finalizer: two 8 MiB buffers, freed with the process.
    mem = cuda.MemoryPointer(cuda.current_context(), ptr, nbytes)
    return DeviceNDArray(
        shape=(n,), strides=(dtype.itemsize,), dtype=dtype, gpu_data=mem
    )


def _device_cases():
    """The device suite's cases, in order: [(case, make)]. make(name) builds what the case keeps
    between ops with the manager Numba uses now (churn's live arrays come from it) and returns
    (run, finish): run(n) does n ops; finish() runs the case's correctness check after the
    timing and returns {check: status}."""
    device_array = cuda.device_array
    sync = cuda.synchronize
    u8 = np.uint8
    f64 = np.float64
    cases = []

    # --- alloc_free_*: allocate and immediately drop one array -------------
    for label, nbytes in ALLOC_FREE_SIZES:

        def make_alloc_free(name, nbytes=nbytes):
            def run(n):
                for _ in range(n):
                    a = device_array(nbytes, dtype=u8)
                    del a

            return run, dict

        cases.append((f"alloc_free_{label}", make_alloc_free))

    # --- churn: random-size replacements in a ring of live arrays ----------
    rng = np.random.default_rng(CHURN_SEED)
    log_sizes = rng.uniform(
        np.log(CHURN_MIN_BYTES), np.log(CHURN_MAX_BYTES), CHURN_SCHEDULE
    )
    sizes = np.clip(
        np.rint(np.exp(log_sizes)), CHURN_MIN_BYTES, CHURN_MAX_BYTES
    ).astype(np.int64).tolist()  # Python ints: no numpy scalars in the loop
    slot_of = rng.integers(0, CHURN_SLOTS, CHURN_SCHEDULE).tolist()

    def make_churn(name):
        slots = [device_array(sizes[i], dtype=u8) for i in range(CHURN_SLOTS)]
        pos = [0]

        def run(n):
            i = pos[0]
            for _ in range(n):
                slots[slot_of[i]] = device_array(sizes[i], dtype=u8)
                i = (i + 1) & (CHURN_SCHEDULE - 1)
            pos[0] = i

        def finish():
            # The live arrays must not overlap (the floor aliases on purpose).
            if name == FLOOR:
                return {"churn_disjoint": "n/a (floor aliases by design)"}
            try:
                spans = sorted(
                    (s.__cuda_array_interface__["data"][0], s.nbytes) for s in slots
                )
                bad = [
                    (hex(a), sa, hex(b))
                    for (a, sa), (b, _) in zip(spans, spans[1:])
                    if a + sa > b
                ]
                status = "ok" if not bad else f"FAILED: overlapping live arrays {bad[:3]}"
            except Exception as e:
                status = f"FAILED: {type(e).__name__}: {e}"
            del slots[:]
            return {"churn_disjoint": status}

        return run, finish

    cases.append(("churn", make_churn))

    # --- alloc_axpy: allocate the output, launch, drop it ------------------
    # Small integers: a*x+y is exact in float64 with or without FMA. The inputs are made once
    # per process, at the first make.
    inputs = {}

    def make_axpy(name):
        if not inputs:
            hx = (np.arange(AXPY_N) % 1024).astype(f64)
            hy = (np.arange(AXPY_N) % 7).astype(f64)
            x = _raw_device_array(AXPY_N, f64)
            y = _raw_device_array(AXPY_N, f64)
            x.copy_to_device(hx)
            y.copy_to_device(hy)
            inputs.update(hx=hx, hy=hy, x=x, y=y,
                          launch=_axpy[(AXPY_N + AXPY_TPB - 1) // AXPY_TPB, AXPY_TPB])
        x, y, launch = inputs["x"], inputs["y"], inputs["launch"]
        out = device_array(AXPY_N, f64)
        launch(out, 2.0, x, y)  # compile outside the timed region
        sync()
        del out

        def run(n):
            for _ in range(n):
                out = device_array(AXPY_N, f64)
                launch(out, 2.0, x, y)
                del out  # freed while the kernel may still be running

        def finish():
            # After the timed loop, with a different `a`, so neither stale memory from the
            # loop nor a skipped launch can pass.
            try:
                out = device_array(AXPY_N, f64)
                launch(out, 3.0, x, y)
                got = out.copy_to_host()
                want = 3.0 * inputs["hx"] + inputs["hy"]
                if np.array_equal(got, want):
                    status = "ok"
                else:
                    nbad = int(np.count_nonzero(got != want))
                    status = f"FAILED: {nbad}/{AXPY_N} elements wrong"
                del out
            except Exception as e:
                status = f"FAILED: {type(e).__name__}: {e}"
            sync()
            return {"axpy": status}

        return run, finish

    cases.append(("alloc_axpy", make_axpy))
    return cases


def _describe(c):
    """A _measure result, in a line of progress."""
    return f"{c['us_per_op']:.2f} us/op ({c['blocks']} x {c['ops_per_block']} ops)"


def _timed_case(label, measure, describe=_describe):
    """measure() after a gc.collect() (each case starts clean; GC stays enabled: frees come
    from finalizers), or {"error": ...} if it raised (the traceback printed); a line of progress
    on stderr either way."""
    gc.collect()
    try:
        c = measure()
        msg = describe(c)
    except Exception as e:
        c = {"error": f"{type(e).__name__}: {e}"}
        msg = c["error"]
        traceback.print_exc()
    print(f"[bench]   {label}: {msg}", file=sys.stderr, flush=True)
    return c


def _run_cases(name, knobs, result):
    counters = _pool_counters(name)
    for case, make in _device_cases():
        run, finish = make(name)
        result["cases"][case] = _timed_case(
            f"{name} {case}", lambda: _measure(run, cuda.synchronize, knobs, counters))
        result["checks"].update(finish())


def _run_pinned_cases(name, knobs, result):
    cases = result["cases"]

    def timed(case, run):
        cases[case] = _timed_case(f"{name} {case}",
                                  lambda: _measure(run, cuda.synchronize, knobs))

    for kind, make in (("pinned", cuda.pinned_array), ("mapped", cuda.mapped_array)):
        for label, nbytes in PINNED_SIZES:

            def run(n, make=make, nbytes=nbytes):
                for _ in range(n):
                    h = make(nbytes, dtype=np.uint8)
                    del h

            timed(f"{kind}_{label}", run)

    # A pinned staging buffer per transfer, dropped while its copy may still be running.
    stream = cuda.stream()
    dev = cuda.device_array(1 << 20, dtype=np.uint8)

    def run_copy(n):
        for _ in range(n):
            h = cuda.pinned_array(1 << 20, dtype=np.uint8)
            dev.copy_to_host(h, stream=stream)
            del h

    timed("pinned_copy_1MiB", run_copy)


SUITES = {
    # name: (managers, cases, run_cases, output stem, timing knobs that differ from FULL)
    "device": (MANAGERS, CASES, _run_cases, "bench_numba", {}),
    # Numba's own pinned allocation of 64 MiB takes ~30 ms: fewer forced ops per block.
    "pinned": (PINNED_MANAGERS, PINNED_CASES, _run_pinned_cases, "bench_pinned",
               dict(warmup_ops=20, min_ops=5)),
}


def child_main(name, knobs, suite="device", guests=None):
    """One manager's cases (`name`, installed with set_memory_manager), or with `guests` (a
    list of other managers' names) the in-process pairing: `name` installed, the guests made
    beside it on the same context, and the cases timed by _run_paired_cases."""
    result = {"manager": name, "versions": _versions(), "cases": {}, "checks": {}}

    def emit():
        try:
            line = json.dumps(result, default=str)
        except (TypeError, ValueError):  # e.g. non-string keys in stats()
            result["emmpool_stats"] = repr(result.get("emmpool_stats"))
            line = json.dumps(result, default=str)
        print(RESULT_MARKER + line, flush=True)

    # Plugin import and installation.  An ImportError means "not available
    # here" (no CuPy, emmpool not built) and is reported as skipped; any other
    # error is a broken plugin and is reported as failed.
    try:
        mgr_cls = _load_manager(name)
        if mgr_cls is not None:
            cuda.set_memory_manager(mgr_cls)
    except ImportError as e:
        result["skipped"] = f"{type(e).__name__}: {e}"
        emit()
        return 0
    except Exception as e:
        traceback.print_exc()
        result["failed"] = f"plugin setup: {type(e).__name__}: {e}"
        emit()
        return 1

    try:
        ctx = cuda.current_context()  # creates the context with the plugin
        mm = ctx.memory_manager
        result["manager_class"] = f"{type(mm).__module__}.{type(mm).__qualname__}"
        if mgr_cls is not None and not isinstance(mm, mgr_cls):
            raise RuntimeError(
                f"context uses {result['manager_class']}, not {mgr_cls!r}: "
                "was a CUDA context created before set_memory_manager()?"
            )
        dev = cuda.get_current_device()
        gpu = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        result["gpu"] = gpu
        result["compute_capability"] = list(dev.compute_capability)
        from numba.cuda.cudadrv.driver import driver as cu_driver

        result["driver_version"] = list(cu_driver.get_version())

        if guests is None:
            SUITES[suite][2](name, knobs, result)
        else:
            _run_paired_cases(name, guests, ctx, knobs, result)

        if name.startswith("emmpool"):
            try:
                import emmpool

                result["emmpool_stats"] = emmpool.stats()
            except Exception as e:
                result["emmpool_stats"] = f"unavailable: {type(e).__name__}: {e}"
    except Exception as e:
        traceback.print_exc()
        result["failed"] = f"{type(e).__name__}: {e}"
        emit()
        return 1
    emit()
    return 0


def _make_guest(name, ctx):
    """Manager `name` on `ctx` beside the installed one, initialised as Numba would."""
    cls = _load_manager(name)
    if cls is None:  # numba-default
        from numba.cuda.cudadrv.driver import NumbaCUDAMemoryManager as cls
    mm = cls(context=ctx)
    mm.initialize()
    return mm


def _describe_paired(cell):
    """A _measure_paired result, in a line of progress."""
    return ", ".join(
        f"{n} {c['us_per_op']:.2f}"
        + (f" ({c['ratio_to_floor']:.3f}x)" if "ratio_to_floor" in c else "")
        for n, c in cell.items()) + " us/op"


def _run_paired_cases(home, guests, ctx, knobs, result):
    """The device cases with the installed manager (`home`) and the guests in one process, by
    _measure_paired: each case's cell is {manager: figures}, and result["paired"] names the
    managers in their order (the floor first).

    A guest is Numba's memory manager only while its blocks run: the context's
    `memory_manager`, which Context.memalloc asks for every allocation, is swapped between
    blocks (outside the timing). Arrays keep the finalizer of the manager that made them, so
    each is freed by its own manager whichever is in place when it dies. Numba's API offers no
    such swap (a plugin is chosen once per process); it is a benchmark's device, and emmpool,
    the one under test, is the one installed the supported way."""
    managers = {home: ctx.memory_manager}
    result["skipped_guests"] = {}
    for name in [FLOOR] + [g for g in guests if g != FLOOR]:
        try:
            managers[name] = _make_guest(name, ctx)
        except ImportError as e:  # e.g. no CuPy here
            if name == FLOOR:
                raise
            result["skipped_guests"][name] = f"{type(e).__name__}: {e}"
    order = [FLOOR, home] + [n for n in managers if n not in (FLOOR, home)]
    result["paired"] = order

    def switch(name):
        ctx.memory_manager = managers[name]

    sync = cuda.synchronize
    counters = {n: f for n in order if (f := _pool_counters(n)) is not None}
    checks = result["checks"] = {n: {} for n in order}
    try:
        for case, make in _device_cases():
            built = {}
            for name in order:
                switch(name)
                built[name] = make(name)
            result["cases"][case] = _timed_case(
                case,
                lambda: _measure_paired({n: built[n][0] for n in order}, switch, sync, knobs,
                                        counters),
                describe=_describe_paired)
            for name in order:
                switch(name)
                checks[name].update(built[name][1]())
    finally:
        switch(home)


# --------------------------------------------------------------------------
# Parent: run children, collect, report
# --------------------------------------------------------------------------


def _run_child(name, extra_env, args, guests=None):
    env = dict(os.environ)
    env.update(extra_env)
    # Only set_memory_manager() may choose the plugin.
    env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--suite", args.suite]
    if args.quick:
        cmd.append("--quick")
    if args.budget is not None:
        cmd += ["--budget", str(args.budget)]
    if guests is not None:
        cmd += ["--guests", ",".join(guests)]
    timeout = 180 if args.quick else 600
    t0 = time.perf_counter()
    try:
        # stdout carries the result line; stderr (progress, warnings,
        # tracebacks) goes straight to the terminal.
        proc = subprocess.run(
            cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"manager": name, "failed": f"timed out after {timeout} s"}
    wall = time.perf_counter() - t0

    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
    if result is None:
        result = {"manager": name,
                  "failed": f"child exited {proc.returncode} without a result"}
    result["wall_s"] = round(wall, 2)
    return result


def _fmt_us(us):
    if us < 10:
        return f"{us:.2f}"
    if us < 100:
        return f"{us:.1f}"
    return f"{us:.0f}"


def _method(report):
    """The markdown's paragraph on what a cell quotes."""
    blocks = (f"A process's figure is the median over {report['repeats']} timed blocks of the "
              "mean per-op time (device synchronised at block ends)"
              + (f", after {report['warmup_s']:g} s of warm-up per case"
                 if "warmup_s" in report else "") + ".")
    if report.get("pairing") == "in-process":
        return (
            f"µs per op. **Quoted: the median over {report['rounds']} rounds of the ratio to "
            f"the `{FLOOR}` floor measured in the same process** (Numba's own per-allocation "
            "overhead): in each round one process installs emmpool and swaps the other "
            "managers in block by block (A B C, C B A, ...), and the round's ratio is the "
            "median of each block's ratio to the floor's block beside it. A host's speed "
            "drifts over seconds; blocks a fraction of a second apart share the drift. "
            "A cell: median µs over rounds, (median ratio), and the lowest–highest round's "
            "ratio. A build or mode of emmpool other than the first (`emmpool@NAME`, "
            "benchmarks/baselines.py) runs in its own process per round, with the floor. "
            + blocks + " Every round and block is in the JSON.")
    return (
        f"µs per op. **Quoted: the median over interleaved rounds** (one process per manager "
        f"and round; {report['rounds']} rounds for the floor, emmpool and earlier builds "
        "(`emmpool@NAME`, benchmarks/baselines.py), "
        f"{report.get('anchor_rounds', report['rounds'])} for the other managers, the floor "
        "running in every round); after it, `best`: the best round. "
        + blocks + " In parentheses: the ratio to the "
        f"`{FLOOR}` floor's figure of the same kind (median to median, best to best): "
        "Numba's own per-allocation overhead. Every round is in the JSON.")


def _markdown(report):
    managers = report["managers"]
    cases = report["cases"]
    floor = managers.get(FLOOR, {}).get("cases", {})
    lines = [
        "# Numba allocation benchmark"
        + (" (pinned host memory)" if report.get("suite") == "pinned" else ""),
        "",
        f"- GPU: {report.get('gpu', '?')}"
        + (f" (cc {'.'.join(map(str, report['compute_capability']))})"
           if report.get("compute_capability") else "")
        + (f", driver {'.'.join(map(str, report['driver_version']))}"
           if report.get("driver_version") else ""),
        f"- numba-cuda {report.get('numba_cuda', '?')}, "
        + ", ".join(f"{k} {v}" for k, v in report.get("versions", {}).items()
                    if k != "numba-cuda"),
        f"- {report['timestamp']}, {'quick' if report['quick'] else 'full'} run, "
        + (f"CPUs {report['cpus']} (near the GPU)" if report.get("cpus") else "CPUs not pinned"),
        "",
        _method(report),
        "",
        "| manager | " + " | ".join(cases) + " |",
        "|---|" + "---:|" * len(cases),
    ]
    notes = []

    def note(text):
        notes.append(" ".join(str(text).split()))  # keep each note on one line

    if report.get("rounds_asked", report["rounds"]) > report["rounds"]:
        note(f"- stopped after {report['rounds']} of {report['rounds_asked']} rounds: the next "
             "would have passed the time limit (--time-limit, EMMCI_BENCH_DEADLINE)")

    for name in managers:
        r = managers.get(name)
        if r is None:
            continue
        label = f"{name} (floor)" if name == FLOOR else name
        if "skipped" in r or "failed" in r:
            kind = "skipped" if "skipped" in r else "failed"
            note(f"- `{name}` {kind}: {r[kind]}")
            lines.append(f"| {label} | " + " | ".join([kind] * len(cases)) + " |")
            continue
        checks = r.get("checks", {})
        for check, status in checks.items():
            if not str(status).startswith(("ok", "n/a")):
                note(f"- `{name}` check {check}: {status}")
        failed_case = {
            "churn": not str(checks.get("churn_disjoint", "ok")).startswith(("ok", "n/a")),
            "alloc_axpy": not str(checks.get("axpy", "ok")).startswith("ok"),
        }
        cells = []
        for case in cases:
            c = r.get("cases", {}).get(case)
            if c is None or "error" in c:
                cells.append("error")
                if c is not None:
                    note(f"- `{name}` {case}: {c['error']}")
                continue
            cell = _fmt_us(c["us_per_op"])
            f = floor.get(case, {}).get("us_per_op")
            if "ratio_to_floor" in c:  # in-process pairing: the ratio within each process
                cell += f" ({c['ratio_to_floor']:.2f}×)"
                if len(c["rounds_ratio"]) > 1:
                    cell += f" {min(c['rounds_ratio']):.2f}–{max(c['rounds_ratio']):.2f}"
            elif f:
                cell += f" ({c['us_per_op'] / f:.2f}×)"
            best, floor_best = c.get("best_us"), floor.get(case, {}).get("best_us")
            if "ratio_to_floor" not in c and best is not None and len(c.get("rounds_us", ())) > 1:
                cell += f" best {_fmt_us(best)}"
                if floor_best:
                    cell += f" ({best / floor_best:.2f}×)"
            if failed_case.get(case):
                cell += " ✗"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        work = []
        for case, c in r.get("cases", {}).items():
            if "pool_per_op" in c:
                counts = ", ".join(f"{v:.3g} {k}" for k, v in c["pool_per_op"].items() if v)
                work.append(f"{case}: {counts or 'none'}")
        if work:
            note(f"- `{name}` pool work per op (last round; zero counts left out): "
                 + "; ".join(work))
    if notes:
        lines += ["", "Notes:", ""] + notes + ["", "✗ = correctness check failed."]
    return "\n".join(lines) + "\n"


def _ok_rounds(results):
    """The rounds that ran (neither failed nor skipped), or None if any did not."""
    ok = [r for r in results if "cases" in r and "failed" not in r and "skipped" not in r]
    return ok if ok and len(ok) == len(results) else None


def _merged_cell(timed):
    """One case of one manager over the rounds that timed it (oldest first): the last round's
    cell with the median over rounds quoted (us_per_op, and ratio_to_floor where the rounds
    have one), the best round next to it, and every round kept.

    The median: on the GPU hosts used, now and then a whole process (the floor's as much as any
    other) runs at about half speed, which the median of five or more rounds passes over and a
    median of three may not."""
    values = [c["us_per_op"] for c in timed]
    cell = dict(timed[-1])
    cell.update(us_per_op=statistics.median(values), best_us=min(values), rounds_us=values)
    ratios = [c["ratio_to_floor"] for c in timed if "ratio_to_floor" in c]
    if ratios:
        cell.update(ratio_to_floor=statistics.median(ratios), rounds_ratio=ratios)
    return cell


def _merge_rounds(results):
    """One manager's results over rounds (process pairing), each case by _merged_cell."""
    ok = _ok_rounds(results)
    if ok is None:
        return results[-1]
    merged = dict(ok[-1])
    merged["cases"] = {}
    for case in ok[-1]["cases"]:
        timed = [r["cases"][case] for r in ok if "us_per_op" in r["cases"].get(case, {})]
        if not timed:  # an error in every round: keep the last one's message
            merged["cases"][case] = dict(ok[-1]["cases"][case])
            continue
        merged["cases"][case] = _merged_cell(timed)
    merged["rounds"] = len(ok)
    return merged


def _merge_paired(rounds):
    """The in-process pairing's results over rounds: {home: [child result per round]} ->
    {manager: merged}, each manager once (the floor from the first child; a later home's
    child has the floor only for its own ratios). A cell quotes the median over rounds of the
    manager's figure and of its ratio to the floor of the same process (`ratio_to_floor`, each
    round's the median of its block ratios), and keeps every round."""
    managers = {}
    for home, results in rounds.items():
        ok = _ok_rounds(results)
        if ok is None:
            managers[home] = results[-1]
            continue
        last = ok[-1]
        for name, why in last.get("skipped_guests", {}).items():
            managers.setdefault(name, {"manager": name, "skipped": why})
        for name in last["paired"]:
            if name in managers:
                continue
            merged = {k: v for k, v in last.items()
                      if k not in ("cases", "checks", "paired", "skipped_guests", "manager",
                                   "emmpool_stats", "manager_class")}
            merged.update(manager=name, rounds=len(ok), checks=last["checks"].get(name, {}),
                          cases={})
            if name == home:
                for k in ("emmpool_stats", "manager_class"):
                    if k in last:
                        merged[k] = last[k]
            for case, cell in last["cases"].items():
                timed = [r["cases"][case][name] for r in ok
                         if "us_per_op" in r["cases"].get(case, {}).get(name, {})]
                if not timed:
                    merged["cases"][case] = {"error": cell.get("error", "no round timed it")}
                    continue
                merged["cases"][case] = _merged_cell(timed)
            managers[name] = merged
    return managers


def _deadline(args):
    """When the results must be written, in time.time() seconds, or None: --time-limit from
    now, else EMMCI_BENCH_DEADLINE (.ci/gpu.py sets it from the step's timeout), whichever is
    sooner. A run cut off by a timeout would leave nothing; one that stops at its deadline
    keeps the rounds it finished."""
    limits = []
    if args.time_limit is not None:
        limits.append(time.time() + args.time_limit)
    if os.environ.get("EMMCI_BENCH_DEADLINE"):
        limits.append(float(os.environ["EMMCI_BENCH_DEADLINE"]))
    return min(limits, default=None)


def parent_main(args):
    knobs = dict(QUICK if args.quick else FULL)
    if args.budget is not None:
        knobs["budget"] = args.budget
    os.makedirs(args.out, exist_ok=True)
    suite_managers, suite_cases, _, stem, _ = SUITES[args.suite]
    sys.path.insert(0, HERE)
    import baselines

    # Earlier builds (EMMCI_BENCH_BASELINES), timed in every round like emmpool itself.
    earlier = [(f"emmpool@{name}", {"EMMPOOL_MODE": "pool", **baselines.child_env(path)})
               for name, path in baselines.baselines()]
    ALL_ROUNDS.update(name for name, _ in earlier)
    suite_managers = list(suite_managers) + (earlier if args.suite == "device" else [])
    selected = [m for m in suite_managers if not args.managers or m[0] in args.managers]
    if not selected:
        sys.exit(f"none of {args.managers} runs in the {args.suite} suite "
                 f"(it has: {', '.join(m for m, _ in suite_managers)})")

    # Managers run in interleaved rounds (A B C ... A B C ...) and each cell is the median
    # over rounds: a GPU's clocks and a host's load drift over minutes, and a drift must not
    # land on one manager alone.
    sys.path.insert(0, HERE)
    import cpus

    pinned_cpus = cpus.pin_near_gpu(args.cpus)  # the children inherit it
    print(f"[bench] CPUs: {pinned_cpus or 'not pinned'}", file=sys.stderr, flush=True)
    paired = args.pairing == "in-process" and args.suite == "device"
    if paired:
        # One child per emmpool build or mode and round: the first also hosts every other
        # manager selected, the floor always (its ratios are taken within the process).
        homes = [(n, env) for n, env in selected if n.startswith("emmpool")]
        if not homes:
            sys.exit("--pairing in-process needs an emmpool manager (it is the one installed)")
        guests = [FLOOR] + [n for n, _ in selected if not n.startswith("emmpool") and n != FLOOR]
        jobs = [(home, env, guests if i == 0 else [FLOOR], True)
                for i, (home, env) in enumerate(homes)]
    else:
        jobs = [(n, env, None, n in ALL_ROUNDS) for n, env in selected]
        if args.suite == "device":
            stem += "_process"
    rounds: dict[str, list] = {name: [] for name, *_ in jobs}
    anchor_rounds = min(args.rounds, args.anchor_rounds)
    deadline = _deadline(args)
    done = 0

    def runs_in(rnd, name, every_round):
        if rounds[name] and ("skipped" in rounds[name][0] or "failed" in rounds[name][0]):
            return False
        # an anchor runs in the first rounds only, so that five or more rounds fit one step's budget
        return every_round or rnd < anchor_rounds

    for rnd in range(args.rounds):
        if rnd > 0 and deadline is not None:
            # Whole rounds only (a round is what keeps the managers' drift fair); the next is
            # guessed from each child's last run.
            guess = sum(rounds[name][-1].get("wall_s", 0) for name, _, _, every in jobs
                        if runs_in(rnd, name, every))
            if time.time() + guess > deadline:
                print(f"[bench] stopping after {rnd} of {args.rounds} rounds: the next "
                      f"(~{guess:.0f} s) would pass the deadline", file=sys.stderr, flush=True)
                break
        for name, extra_env, with_guests, every in jobs:
            if not runs_in(rnd, name, every):
                continue
            beside = f" with {', '.join(with_guests)}" if with_guests else ""
            print(f"[bench] round {rnd + 1}/{args.rounds}: {name}{beside} ...", file=sys.stderr,
                  flush=True)
            r = _run_child(name, extra_env, args, guests=with_guests)
            rounds[name].append(r)
            status = ("skipped: " + r["skipped"]) if "skipped" in r else (
                ("FAILED: " + r["failed"]) if "failed" in r else "ok")
            print(f"[bench] {name}: {status} ({r.get('wall_s', '?')} s)",
                  file=sys.stderr, flush=True)
        done = rnd + 1
    if paired:
        managers = _merge_paired(rounds)
    else:
        managers = {name: _merge_rounds(rs) for name, rs in rounds.items()}

    first = next((r for r in managers.values() if "gpu" in r), {})
    now = datetime.datetime.now(datetime.timezone.utc)
    gpu = first.get("gpu", "unknown-gpu")
    report = {
        "gpu": gpu,
        "compute_capability": first.get("compute_capability"),
        "driver_version": first.get("driver_version"),
        "numba_cuda": first.get("versions", {}).get("numba-cuda")
        or _versions().get("numba-cuda"),
        "versions": first.get("versions", _versions()),
        "timestamp": now.isoformat(timespec="seconds"),
        "quick": args.quick,
        "budget_s_per_case": knobs["budget"],
        "repeats": knobs["repeats"],
        "warmup_s": knobs["warmup_s"],
        "rounds": done,
        "rounds_asked": args.rounds,
        "anchor_rounds": done if paired else min(anchor_rounds, done),
        "quoted": ("median over rounds of ratio_to_floor (each round's: the median of its "
                   "blocks' ratios to the floor's blocks beside them) and of us_per_op"
                   if paired else "median over rounds (us_per_op); best_us: the best round"),
        "cpus": pinned_cpus,
        "pairing": "in-process" if paired else "process",
        "floor": FLOOR,
        "suite": args.suite,
        "cases": suite_cases,
        "managers": managers,
    }
    md = _markdown(report)
    json_path = os.path.join(args.out, f"{stem}.json")
    md_path = os.path.join(args.out, f"{stem}.md")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2, default=str)
        f.write("\n")
    with open(md_path, "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {json_path} and {md_path} (the current results of a GPU kind: "
          f"benchmarks/results/<GPU>/, written by .ci/gpu-results)")
    ran = [r for r in managers.values() if "skipped" not in r]
    return 1 if any("failed" in r for r in ran) else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output directory (required)")
    p.add_argument("--quick", action="store_true",
                   help="few iterations; a smoke test (< 1 min)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per case per manager (default 1.0, quick 0.15)")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds over the managers; cells quote the median over "
                        "rounds, the best round next to it (default 5)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="start no round that would end more than S seconds from now (by the "
                        "last round's time); the results keep the rounds run (at least one)")
    p.add_argument("--anchor-rounds", type=int, default=2,
                   help="with --pairing process: rounds (the first ones) in which the managers "
                        "other than the floor and emmpool run (default 2)")
    p.add_argument("--cpus", type=int, default=4,
                   help="pin every process to this many CPUs near the GPU; 0: no pinning "
                        "(default 4)")
    p.add_argument("--managers", nargs="+", metavar="NAME",
                   help="run only these managers (emmpool@NAME: an earlier build named in "
                        "EMMCI_BENCH_BASELINES, see baselines.py)")
    p.add_argument("--pairing", choices=("in-process", "process"), default="in-process",
                   help="in-process (default): each round is one process in which emmpool is "
                        "installed and the other managers swapped in block by block, and the "
                        "ratios are taken within it; process: one process per manager and "
                        "round (each installed alone; timed minutes apart)")
    p.add_argument("--suite", choices=sorted(SUITES), default="device",
                   help="device allocations (default) or pinned host memory")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--guests", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        knobs = dict(QUICK if args.quick else FULL)
        if not args.quick:
            knobs.update(SUITES[args.suite][4])
        if args.budget is not None:
            knobs["budget"] = args.budget
        guests = args.guests.split(",") if args.guests else None
        return child_main(args.child, knobs, args.suite, guests)
    if not args.out:
        p.error("--out DIR is required")
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())

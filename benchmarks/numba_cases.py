"""One child process of bench_numba.py: a memory manager installed in Numba (with the
in-process pairing, the others beside it on the same context), every case of a suite timed, one
result line printed. benchmarks/README.md says what the cases measure and why."""

import gc
import os
import statistics
import sys
import time
import traceback

import numpy as np
from numba import cuda  # importing creates no CUDA context

import baselines
import harness
import pool_counters

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
        baselines.check_imported()  # emmpool@NAME: the earlier build, or fail
        return manager
    import anchors  # cuda.bindings: only a child that runs an anchor needs it

    return anchors.ANCHORS[name]


def versions():
    return {"python": sys.version.split()[0], **harness.versions(
        ("numba-cuda", "numba", "numpy", "cuda-bindings", "cupy-cuda13x", "cupy-cuda12x", "cupy",
         "emmpool"))}


def _warm_up_and_calibrate(run, sync, knobs):
    """Run the op for knobs['warmup_s'] seconds (a fresh process settles over its first tenths
    of a second: benchmarks/README.md), then find how many ops make a timed block (about
    knobs['budget'] / knobs['repeats'] seconds, whatever the op costs); returns that count."""
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
    """One manager's figures (_measure_paired with no other): the median over timed blocks of
    the mean time per op, each block's, and with `counters` (a function returning emmpool's pool
    counters) their change over the timed blocks per op, as "pool_per_op"."""
    return _measure_paired({None: run}, lambda name: None, sync, knobs,
                           {None: counters} if counters else None)[None]


def _measure_paired(runs, switch, sync, knobs, counters=None):
    """Several managers timed in one process, in turns of one block each (A B C, C B A, ...:
    benchmarks/README.md says why). runs: {manager: run(n ops)}, the floor first; switch(manager)
    makes Numba allocate with it. The device is synchronised before each block (untimed) and at
    its end (timed): work an op queued on the GPU is charged to it. Returns {manager:
    {us_per_op (the median block's), block_means_us, ops_per_block, blocks}}, and for each but
    the floor "block_ratios" (its block over the floor's of the same turn) and "ratio_to_floor",
    their median; with `counters` ({manager: function returning its pool counters}) "pool_per_op",
    their change over the timed blocks per op."""
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
            out[name]["pool_per_op"] = pool_counters.per_op(before[name], counters[name](),
                                                            ops[name] * len(m))
    return out


# The pool's work behind a Numba op (emmpool.stats() keys; builds without one skip it): events
# recorded and queried to fence Numba's frees, segments taken from and given back to the driver.
POOL_COUNTERS = ("batches_closed", "fence_queries", "segment_allocations", "segment_releases",
                 "dormant_fences")


def _pool_counters(name):
    """A function returning the emmpool pool's counters for _measure, or None (other managers)."""
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
    result = {"manager": name, "versions": versions(), "cases": {}, "checks": {}}
    code = _run_manager(name, knobs, suite, guests, result)
    try:
        harness.emit(result)
    except (TypeError, ValueError):  # e.g. non-string keys in stats()
        result["emmpool_stats"] = repr(result.get("emmpool_stats"))
        harness.emit(result)
    return code


def _run_manager(name, knobs, suite, guests, result):
    """child_main's work, into `result`; the child's exit status."""
    # Plugin import and installation.  An ImportError means "not available
    # here" (no CuPy, emmpool not built) and is reported as skipped; any other
    # error is a broken plugin and is reported as failed.
    try:
        mgr_cls = _load_manager(name)
        if mgr_cls is not None:
            cuda.set_memory_manager(mgr_cls)
    except ImportError as e:
        result["skipped"] = f"{type(e).__name__}: {e}"
        return 0
    except Exception as e:
        traceback.print_exc()
        result["failed"] = f"plugin setup: {type(e).__name__}: {e}"
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
        return 1
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
    managers in their order (the floor first). A guest is the context's `memory_manager` only
    while its blocks run (benchmarks/README.md): Numba's API offers no such swap, a benchmark's
    device; emmpool, the one under test, is installed the supported way."""
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


"""Replay an allocation trace against emmpool and other allocators: time and fragmentation.

A trace is a list of operations ("alloc", id, size) / ("free", id, 0); an allocation that
named a stream (CuPy's, PyTorch's) is ("alloc", id, size, stream), freed in that stream's
order as its library frees it; one whose library the trace names is ("alloc", id, size,
stream or None, tag), tag its index in emmpool.trace.LIBRARIES, so that emmpool counts it as
that library's (its statistics by library, its segment events); ("sync", 0, 0) marks where the
program synchronized the device (emmpool.trace.mark_synchronize). `from_records` builds one
from a recorded CSV (emmpool.trace), `from_slots` from a synthetic churn. For each backend the
replay reports peak live bytes (the sum of requested sizes), peak reserved bytes (what the
allocator held from the driver) and their ratio, and the replay's wall time.

The replay runs no kernels, so on a GPU every fence emmpool records has completed by the time
it asks: "emmpool" and "emmpool-host" replay an idle GPU. "emmpool-host-behind" replays the
other end, a GPU a whole step behind: events complete only at the trace's synchronizations, so
only blocks freed in stream order on their own stream come back before them. A real run lies
between the two.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

from . import _core

__all__ = ["Skip", "BACKENDS", "from_records", "from_slots", "run"]

Op = tuple  # ("alloc", id, size[, stream[, tag]]) | ("free", id, 0) | ("sync", 0, 0)

_TAGS = {name: tag for tag, name in enumerate(_core.LIBRARIES)}


def _alloc_op(key: int, size: int, stream: int | None, tag: int) -> Op:
    """An allocation, its stream and tag left out where they are the defaults."""
    if tag:
        return ("alloc", key, size, stream, tag)
    return ("alloc", key, size) if stream is None else ("alloc", key, size, stream)


class Skip(Exception):
    """The backend cannot run here (no GPU, library missing)."""


def from_records(records: Iterable, device: int | None = None) -> list[Op]:
    """Operations from trace records (emmpool.trace.TraceRecord); frees of pointers the trace
    never saw allocated are dropped. Only one device's records if `device` is given.
    Allocations on a named stream keep it (the trace's handle); legacy-stream ones (Numba's:
    no stream named) do not. Each keeps its library's tag."""
    ops, live, next_id = [], {}, 0
    for r in records:
        if device is not None and r.device != device:
            continue
        key = (r.device, r.ptr)
        if r.op == "sync":
            ops.append(("sync", 0, 0))
        elif r.op == "alloc":
            live[key] = next_id
            stream = r.stream if r.stream != _core.LEGACY_STREAM else None
            ops.append(_alloc_op(next_id, r.size, stream, _TAGS.get(r.library, 0)))
            next_id += 1
        elif key in live:
            ops.append(("free", live.pop(key), 0))
    return ops


def from_slots(fill: Sequence[int], slots: Sequence[int], sizes: Sequence[int]) -> list[Op]:
    """A churn: allocate `fill`, then for each (slot, size) free that slot and allocate anew."""
    ops, ids = [], []
    for i, n in enumerate(fill):
        ops.append(("alloc", i, n))
        ids.append(i)
    next_id = len(fill)
    for s, n in zip(slots, sizes):
        ops.append(("free", ids[s], 0))
        ops.append(("alloc", next_id, n))
        ids[s] = next_id
        next_id += 1
    return ops


def _drive(ops, alloc: Callable, free: Callable, reserved_now: Callable | None = None,
           sync: Callable | None = None) -> dict:
    """alloc(size, stream, tag) (stream: the trace's handle, None for no stream named; tag: the
    library's) -> handle; free(handle); sync() at the trace's synchronizations."""
    handles, sizes = {}, {}
    live = peak_live = peak_sampled = 0
    t0 = time.perf_counter()
    for op in ops:
        kind, key, size = op[:3]
        if kind == "alloc":
            stream = op[3] if len(op) > 3 else None
            handles[key] = alloc(size, stream, op[4] if len(op) > 4 else 0)
            sizes[key] = size
            live += size
            peak_live = max(peak_live, live)
            if reserved_now is not None:
                peak_sampled = max(peak_sampled, reserved_now())
        elif kind == "free":
            free(handles.pop(key))
            live -= sizes.pop(key)
        elif sync is not None:
            sync()
    seconds = time.perf_counter() - t0
    for h in handles.values():
        free(h)
    return {"peak_live": peak_live, "peak_reserved": peak_sampled, "seconds": seconds,
            "ops": len(ops)}


class _StreamMap:
    """The trace's stream handles as streams of the replay's driver: the context streams
    (null, legacy, per-thread) as they are, any other handle as a stream made for it (the
    host driver's; on a GPU every named stream is replayed on the null stream, which orders
    the same way for a one-stream trace)."""

    def __init__(self, make: Callable | None):
        self.make, self.streams = make, {}

    def __call__(self, handle: int | None) -> int:
        if handle is None:
            return _core.LEGACY_STREAM
        if handle <= _core.PER_THREAD_STREAM:
            return handle
        if self.make is None:
            return 0
        if handle not in self.streams:
            self.streams[handle] = self.make()
        return self.streams[handle]


def _emmpool(ops, driver, segments="fixed", sync: Callable | None = None) -> dict:
    from . import _config

    cfg = _config.config()  # EMMPOOL_GROWABLE_*, as the process-wide pools would get them
    pool = _core.DevicePool(driver, 0, mode="pool", segments=segments,
                            growable_free_limit=cfg.growable_free_limit,
                            growable_page_size=cfg.growable_page_size)
    if segments == "growable" and not pool.growable:
        raise Skip("the device does not support virtual memory management (growable segments)")
    stream_of = _StreamMap(driver.create_stream if driver is not None else None)
    named = set()  # blocks allocated on a named stream: freed in its order, as torch and CuPy do

    def alloc(size, handle, tag):
        ptr = pool.allocate(size, stream_of(handle), tag)
        if handle is not None:
            named.add(ptr)
        return ptr

    def free(ptr):
        if ptr in named:
            named.discard(ptr)
            pool.deallocate(ptr, _core.ALLOCATION_STREAM)
        else:
            pool.deallocate(ptr)

    at_syncs = []  # page maps so far at each of the trace's synchronizations

    def on_sync():
        if sync is not None:
            sync()
        at_syncs.append(pool.stats()["page_maps"])

    r = _drive(ops, alloc, free, sync=on_sync)
    st = pool.stats()
    r.update(peak_reserved=st["peak_bytes_reserved"], segment_allocations=st["segment_allocations"],
             segment_releases=st["segment_releases"], page_maps=st["page_maps"],
             page_maps_at_syncs=at_syncs,
             page_unmaps=st["page_unmaps"], page_creates=st["page_creates"],
             page_releases=st["page_releases"], segments=segments)
    pool.synchronize()
    pool.trim()
    return r


def _configured_segments() -> str:
    # EMMPOOL_SEGMENTS (the one parser), as the process-wide pools would get it.
    from . import _config

    return _config.config().segments


def _emmpool_host(ops, segments=None, behind=False) -> dict:
    driver = _core.HostDriver(devices=1, capacity=1 << 44)  # no memory pressure: the policy alone
    driver.set_auto_complete(not behind)  # behind: events complete at the trace's syncs only
    return _emmpool(ops, driver, segments or _configured_segments(),
                    sync=driver.complete_all_events if behind else None)


def _emmpool_cuda(ops, segments=None) -> dict:
    try:
        if _core.device_count() < 1:
            raise Skip("no CUDA device")
    except _core.CudaError as e:
        raise Skip(f"no usable CUDA driver: {e}") from None
    return _emmpool(ops, None, segments or _configured_segments())


def _cupy(ops) -> dict:
    try:
        import cupy
    except ImportError as e:
        raise Skip(f"CuPy is not importable: {e}") from None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise Skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise Skip(f"no usable GPU for CuPy: {e}") from None
    pool = cupy.cuda.MemoryPool()
    # MemoryPointer objects: dropping the last reference returns the block to the pool. All on
    # the current stream.
    r = _drive(ops, lambda n, _s, _t: pool.malloc(n), lambda h: None, pool.total_bytes)
    pool.free_all_blocks()
    return r


def _torch(ops) -> dict:
    try:
        import torch
    except ImportError as e:
        raise Skip(f"PyTorch is not importable: {e}") from None
    if not torch.cuda.is_available():
        raise Skip("torch.cuda.is_available() is False")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    stream = torch.cuda.current_stream()  # every stream of the trace: a one-stream replay
    r = _drive(ops, lambda n, _s, _t: torch.cuda.caching_allocator_alloc(n, 0, stream),
               torch.cuda.caching_allocator_delete)
    r["peak_reserved"] = torch.cuda.max_memory_reserved()
    torch.cuda.empty_cache()
    return r


def _driver_pool(ops) -> dict:
    """The driver's stream-ordered pool (cuMemAllocFromPoolAsync), a pool of its own through
    cuda.core, set up as RMM's async resource and PyTorch's cudaMallocAsync backend set theirs:
    nothing released at a synchronization (release threshold: everything). The trace's
    synchronizations synchronize its stream, as the program did: after one the driver may map
    the memory of freed blocks under new ones (as "emmpool-host-behind" completes its fences
    there). Its peak reserved is the pool's own high-water mark."""
    try:
        from cuda.bindings import driver
        from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions
    except ImportError as e:
        raise Skip(f"cuda.core is not importable: {e}") from None
    try:
        dev = Device(0)
        dev.set_current()
    except Exception as e:  # noqa: BLE001 - cuda.core's error for a machine without a GPU
        raise Skip(f"no usable GPU for cuda.core: {e}") from None
    if not dev.properties.memory_pools_supported:
        raise Skip("the device has no stream-ordered memory pools")
    mr = DeviceMemoryResource(dev, DeviceMemoryResourceOptions())  # a pool of its own
    everything = driver.cuuint64_t((1 << 64) - 1)
    handle = mr.handle if isinstance(mr.handle, driver.CUmemoryPool) else \
        driver.CUmemoryPool(int(mr.handle))
    (err,) = driver.cuMemPoolSetAttribute(
        handle, driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, everything)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemPoolSetAttribute(release threshold): {err}")
    stream = dev.create_stream()  # every stream of the trace: a one-stream replay
    try:
        r = _drive(ops, lambda n, _s, _t: mr.allocate(n, stream=stream),
                   lambda b: b.close(stream), sync=stream.sync)
        stream.sync()
        r["peak_reserved"] = mr.attributes.reserved_mem_high
    finally:
        mr.close()
    return r


def _torch_expandable(ops) -> dict:
    """PyTorch's caching allocator with expandable segments (its closest to a growable
    segment), switched on for this replay only."""
    try:
        import torch
    except ImportError as e:
        raise Skip(f"PyTorch is not importable: {e}") from None
    if not torch.cuda.is_available():
        raise Skip("torch.cuda.is_available() is False")
    if torch.cuda.get_allocator_backend() != "native":
        raise Skip(f"PyTorch's allocator here is {torch.cuda.get_allocator_backend()!r}, not "
                   "its caching allocator")
    # PyTorch 2.13 moved the setter (the old name warns); 2.11's is torch.cuda.memory's.
    settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        torch.cuda.memory._set_allocator_settings
    torch.cuda.empty_cache()
    settings("expandable_segments:True")
    try:
        return _torch(ops)
    finally:
        torch.cuda.empty_cache()
        settings("expandable_segments:False")


BACKENDS: dict[str, Callable[[list], dict]] = {
    # emmpool-host and emmpool: the segments EMMPOOL_SEGMENTS asks for (default fixed); the
    # -fixed and -growable backends name theirs, for a comparison in one run.
    "emmpool-host": _emmpool_host,
    "emmpool-host-fixed": lambda ops: _emmpool_host(ops, "fixed"),
    "emmpool-host-growable": lambda ops: _emmpool_host(ops, "growable"),
    "emmpool-host-behind": lambda ops: _emmpool_host(ops, behind=True),
    "emmpool": _emmpool_cuda,
    "emmpool-fixed": lambda ops: _emmpool_cuda(ops, "fixed"),
    "emmpool-growable": lambda ops: _emmpool_cuda(ops, "growable"),
    "cupy": _cupy,
    "torch": _torch,
    # The anchors a pool shared by every library is measured against: the driver's own pool
    # (RMM's async resource and CuPy's MemoryAsyncPool are it under every library), and
    # PyTorch's expandable segments.
    "driver-pool": _driver_pool,
    "torch-expandable": _torch_expandable,
}


def run(ops: list[Op], backend: str) -> dict:
    """Replay on one backend: {peak_live, peak_reserved, ratio, seconds, ops, ...}.
    Raises Skip where the backend cannot run here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {sorted(BACKENDS)}")
    if not any(op[0] == "alloc" for op in ops):
        raise ValueError("the trace holds no allocation")
    r = BACKENDS[backend](ops)
    r["ratio"] = r["peak_reserved"] / r["peak_live"] if r["peak_live"] else float("nan")
    return r

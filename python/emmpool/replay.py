"""Replay an allocation trace against emmpool and other allocators: time and fragmentation.

A trace is a list of operations ("alloc", id, size) / ("free", id, 0); `from_records` builds
one from a recorded CSV (emmpool.trace), `from_slots` from a synthetic churn. For each backend
the replay reports peak live bytes (the sum of requested sizes), peak reserved bytes (what the
allocator held from the driver) and their ratio, and the replay's wall time.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

from . import _core

__all__ = ["Skip", "BACKENDS", "from_records", "from_slots", "run"]

Op = tuple  # ("alloc"|"free", id, size)


class Skip(Exception):
    """The backend cannot run here (no GPU, library missing)."""


def from_records(records: Iterable, device: int | None = None) -> list[Op]:
    """Operations from trace records (emmpool.trace.TraceRecord); frees of pointers the trace
    never saw allocated are dropped. Only one device's records if `device` is given."""
    ops, live, next_id = [], {}, 0
    for r in records:
        if device is not None and r.device != device:
            continue
        key = (r.device, r.ptr)
        if r.op == "alloc":
            live[key] = next_id
            ops.append(("alloc", next_id, r.size))
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


def _drive(ops, alloc: Callable, free: Callable, reserved_now: Callable | None = None) -> dict:
    handles, sizes = {}, {}
    live = peak_live = peak_sampled = 0
    t0 = time.perf_counter()
    for op, key, size in ops:
        if op == "alloc":
            handles[key] = alloc(size)
            sizes[key] = size
            live += size
            peak_live = max(peak_live, live)
            if reserved_now is not None:
                peak_sampled = max(peak_sampled, reserved_now())
        else:
            free(handles.pop(key))
            live -= sizes.pop(key)
    seconds = time.perf_counter() - t0
    for h in handles.values():
        free(h)
    return {"peak_live": peak_live, "peak_reserved": peak_sampled, "seconds": seconds,
            "ops": len(ops)}


def _emmpool(ops, driver, segments="fixed") -> dict:
    pool = _core.DevicePool(driver, 0, mode="pool", segments=segments)
    if segments == "growable" and not pool.growable:
        raise Skip("the device does not support virtual memory management (growable segments)")
    r = _drive(ops, pool.allocate, pool.deallocate)
    st = pool.stats()
    r.update(peak_reserved=st["peak_bytes_reserved"], segment_allocations=st["segment_allocations"],
             segment_releases=st["segment_releases"], page_maps=st["page_maps"],
             page_unmaps=st["page_unmaps"], segments=segments)
    pool.synchronize()
    pool.trim()
    return r


def _configured_segments() -> str:
    # EMMPOOL_SEGMENTS (the one parser), as the process-wide pools would get it.
    from . import _config

    return _config.config().segments


def _emmpool_host(ops, segments=None) -> dict:
    driver = _core.HostDriver(devices=1, capacity=1 << 44)  # no memory pressure: the policy alone
    driver.set_auto_complete(True)
    return _emmpool(ops, driver, segments or _configured_segments())


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
    # MemoryPointer objects: dropping the last reference returns the block to the pool.
    r = _drive(ops, pool.malloc, lambda h: None, pool.total_bytes)
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
    stream = torch.cuda.current_stream()
    r = _drive(ops, lambda n: torch.cuda.caching_allocator_alloc(n, 0, stream),
               torch.cuda.caching_allocator_delete)
    r["peak_reserved"] = torch.cuda.max_memory_reserved()
    torch.cuda.empty_cache()
    return r


BACKENDS: dict[str, Callable[[list], dict]] = {
    # emmpool-host and emmpool: the segments EMMPOOL_SEGMENTS asks for (default fixed); the
    # -fixed and -growable backends name theirs, for a comparison in one run.
    "emmpool-host": _emmpool_host,
    "emmpool-host-fixed": lambda ops: _emmpool_host(ops, "fixed"),
    "emmpool-host-growable": lambda ops: _emmpool_host(ops, "growable"),
    "emmpool": _emmpool_cuda,
    "emmpool-fixed": lambda ops: _emmpool_cuda(ops, "fixed"),
    "emmpool-growable": lambda ops: _emmpool_cuda(ops, "growable"),
    "cupy": _cupy,
    "torch": _torch,
}


def run(ops: list[Op], backend: str) -> dict:
    """Replay on one backend: {peak_live, peak_reserved, ratio, seconds, ops, ...}.
    Raises Skip where the backend cannot run here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {sorted(BACKENDS)}")
    if not any(op == "alloc" for op, _, _ in ops):
        raise ValueError("the trace holds no allocation")
    r = BACKENDS[backend](ops)
    r["ratio"] = r["peak_reserved"] / r["peak_live"] if r["peak_live"] else float("nan")
    return r

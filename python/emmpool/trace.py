"""An optional record of every allocation and free, written as CSV, for replay and analysis.

    emmpool.trace.start()            # or EMMPOOL_TRACE=path.csv for the whole run
    ...                               # allocations through Numba, CuPy, PyTorch
    emmpool.trace.mark_synchronize()  # optional: after each device synchronization
    records = emmpool.trace.stop()
    emmpool.trace.write_csv("trace.csv", records)

Recording happens in the C++ pools under their lock (a timestamp and one vector append per
call); when off it costs one branch. `python -m emmpool replay trace.csv` replays a trace
against emmpool and the other allocators.
"""

from __future__ import annotations

import csv
import threading
import time
from typing import Iterable, NamedTuple

from . import _core

__all__ = ["TraceRecord", "start", "stop", "collect", "write_csv", "read_csv", "LIBRARIES"]

LIBRARIES: tuple[str, ...] = tuple(_core.LIBRARIES)  # the pool's allocation tags, in order
FIELDS = ("time_ns", "device", "op", "ptr", "size", "stream", "library")


class TraceRecord(NamedTuple):
    time_ns: int  # steady clock (CLOCK_MONOTONIC, as time.monotonic_ns())
    device: int
    op: str  # "alloc", "free" or "sync" (mark_synchronize: no ptr, size, stream or library)
    ptr: int
    size: int  # bytes requested (alloc) or held (free)
    stream: int
    library: str


def start() -> None:
    """Record allocations and frees of every pool, present and future."""
    _core.set_tracing(True)


_marks: list[TraceRecord] = []
_marks_lock = threading.Lock()


def mark_synchronize(device: int = 0) -> None:
    """Note that the program has just synchronized `device` (torch.cuda.synchronize(),
    cuda.synchronize()): every fence recorded before now has completed. A replay uses the
    marks to model a GPU that runs behind the program (emmpool.replay, "emmpool-host-behind").
    Kept until the next collect() without pools, which returns them in time order."""
    with _marks_lock:
        _marks.append(TraceRecord(time.monotonic_ns(), device, "sync", 0, 0, 0, ""))


def collect(pools=None) -> list[TraceRecord]:
    """The records since the last collect(), in time order, of `pools` (default: the
    process-wide pools, and the marks of mark_synchronize()). Tracing goes on."""
    records = []
    if pools is None:
        with _marks_lock:
            records.extend(_marks)
            _marks.clear()
    for pool in _core.pools() if pools is None else pools:
        for t, op, ptr, size, stream, tag in pool.take_trace():
            records.append(
                TraceRecord(t, pool.device, "alloc" if op == "a" else "free", ptr, size, stream,
                            LIBRARIES[tag])
            )
    records.sort(key=lambda r: r.time_ns)
    return records


def stop() -> list[TraceRecord]:
    """Stop recording and return what was recorded since the last collect()."""
    _core.set_tracing(False)
    return collect()


def write_csv(path, records: Iterable[TraceRecord]) -> int:
    """Write records as CSV (header: time_ns,device,op,ptr,size,stream,library). Returns rows."""
    n = 0
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for r in records:
            w.writerow(r)
            n += 1
    return n


def read_csv(path) -> list[TraceRecord]:
    """Read a trace written by write_csv(). Raises ValueError naming the first bad line."""
    out = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(header) != FIELDS:
            raise ValueError(f"{path}: not an emmpool trace (expected header {','.join(FIELDS)})")
        for lineno, row in enumerate(reader, start=2):
            try:
                t, dev, op, ptr, size, stream, lib = row
                if not (op in ("alloc", "free") and lib in LIBRARIES or op == "sync"):
                    raise ValueError
                out.append(TraceRecord(int(t), int(dev), op, int(ptr), int(size), int(stream), lib))
            except ValueError:
                raise ValueError(f"{path}:{lineno}: bad trace row {row!r}") from None
    return out

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
import reprlib
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


_MAX_ADDRESS = 1 << 64  # pointers, sizes and stream handles are 64-bit unsigned in the pools
# A bad row as an error shows it: whole where it has the fields of one, cut short where it is
# something else (a line of a binary file, say), so that the message stays one readable line.
_shown = reprlib.Repr()
_shown.maxlist, _shown.maxstring, _shown.maxother = len(FIELDS) + 1, 40, 40


def read_csv(path) -> list[TraceRecord]:
    """Read a trace written by write_csv(). Raises ValueError naming the first bad line (OSError
    where the file cannot be read)."""
    out = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None or tuple(header) != FIELDS:
                raise ValueError(f"{path}: not an emmpool trace (expected header "
                                 f"{','.join(FIELDS)})")
            for row in reader:
                out.append(_record(row, f"{path}:{reader.line_num}"))
        except (csv.Error, UnicodeDecodeError) as e:
            # Not text, or not CSV (a NUL byte, an unclosed quote): the csv module's words, and
            # where.
            raise ValueError(f"{path}:{reader.line_num or 1}: not an emmpool trace ({e})") from None
    return out


def _record(row: list[str], where: str) -> TraceRecord:
    """One row as a record; ValueError saying what is wrong with it."""

    def bad(why: str) -> ValueError:
        return ValueError(f"{where}: bad trace row {_shown.repr(row)}: {why}")

    if len(row) != len(FIELDS):
        raise bad(f"expected {len(FIELDS)} fields ({','.join(FIELDS)})")
    t, dev, op, ptr, size, stream, lib = row
    if not (op in ("alloc", "free") and lib in LIBRARIES or op == "sync"):
        raise bad(f"expected op alloc or free with a library of {', '.join(LIBRARIES)}, or op "
                  f"sync")
    numbers = {}
    for name, text in (("time_ns", t), ("device", dev), ("ptr", ptr), ("size", size),
                       ("stream", stream)):
        try:
            numbers[name] = int(text)
        except ValueError:
            raise bad(f"{name} is not an integer") from None
        # A replay hands these to the pools, which take them unsigned.
        if name != "time_ns" and not 0 <= numbers[name] < _MAX_ADDRESS:
            raise bad(f"{name} is out of range")
    return TraceRecord(numbers["time_ns"], numbers["device"], op, numbers["ptr"],
                       numbers["size"], numbers["stream"], lib)

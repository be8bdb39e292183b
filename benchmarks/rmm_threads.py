"""benchmarks/rmm_threads.cpp, built against the RMM installed and loaded with ctypes: threads
that allocate and free through RMM's resource of a device with no Python (as libcudf's do).

    lib = rmm_threads.load(cache_dir)          # built once per source and RMM there
    seconds = rmm_threads.run(lib, device=0, threads=8, iterations=10_000, bytes=4096)

Its compiler flags and include directories are emmpool's own for its native RMM resource
(emmpool._rmm), so that what builds one builds the other. ``hold_gil=True`` (the default) calls
it through ctypes.PyDLL, which keeps the GIL for the whole call: an allocation that needed the
GIL would never finish (the caller's timeout says so); a Python callback resource needs
``hold_gil=False``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from pathlib import Path

SOURCE = Path(__file__).with_name("rmm_threads.cpp")


def _library(cache: str | os.PathLike, hold_gil: bool):
    from emmpool import _rmm

    version, _, include, lib, logger = _rmm._rmm_parts()
    cuda = _rmm._cuda_include()
    # RMM's inline code (rmm::cuda_stream, rmm::device_buffer) calls the CUDA runtime, which
    # librmm links statically and does not export: this library links its own.
    found = [p for d in (cuda.parent / "lib64", cuda.parent / "lib")
             for p in sorted(d.glob("libcudart.so*"))]
    if not found:
        raise _rmm.RmmBuildError(f"no libcudart.so in {cuda.parent}/lib64 or lib")
    flags = [*_rmm.CXXFLAGS, f"-I{include}", f"-I{include / 'rapids'}", f"-I{logger}",
             f"-I{cuda}", f"-L{lib}", "-lrmm", f"-Wl,-rpath,{lib}", str(found[0]),
             f"-Wl,-rpath,{found[0].parent}", "-pthread"]
    key = SOURCE.read_bytes() + version.encode() + " ".join(flags).encode()
    target = Path(cache) / f"rmm_threads-{hashlib.sha256(key).hexdigest()[:12]}.so"
    if not target.exists():
        Path(cache).mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.so")
        _rmm._run([*_rmm._compiler(), str(SOURCE), "-o", str(partial), *flags],
                  "the C++ compiler")
        os.replace(partial, target)
    import rmm.mr  # noqa: F401 - librmm loaded, and the per-device resources it keeps

    return (ctypes.PyDLL if hold_gil else ctypes.CDLL)(str(target))


def load(cache: str | os.PathLike, hold_gil: bool = True):
    f = _library(cache, hold_gil).emmci_rmm_threads
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
                  ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, ctypes.c_size_t]
    return f


def churn(cache: str | os.PathLike):
    """emmci_rmm_churn(device, stream a, stream b, iterations), called holding the GIL: in
    the calling thread, allocations on a freed on b."""
    f = _library(cache, hold_gil=True).emmci_rmm_churn
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
    return f


def run(f, device: int = 0, threads: int = 8, iterations: int = 10_000, bytes: int = 4096,
        buffers: bool = False) -> float:
    """Seconds for every thread's `iterations` allocations and frees; raises RuntimeError with
    the first failure's words."""
    seconds = ctypes.c_double()
    error = ctypes.create_string_buffer(512)
    if f(device, threads, iterations, bytes, int(buffers), ctypes.byref(seconds), error,
         len(error)) != 0:
        raise RuntimeError(error.value.decode(errors="replace"))
    return seconds.value

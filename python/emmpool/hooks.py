"""CuPy and PyTorch allocate from the same process-wide pools as Numba.

Both go through plain C entry points of emmpool._core (CuPy: cpp/edges/cupy_adapter.cpp, PyTorch:
cpp/edges/c_api.cpp): no Python runs per allocation. Neither library is needed by emmpool itself;
each hook says what to install.
"""

from __future__ import annotations

import warnings

from . import _core
from ._config import ensure_configured, log

_installed: list = []  # keeps CuPy's allocator object alive
_cupy_malloc = None  # the function use_for_cupy() gave CuPy last: tells emmpool's from another


def use_for_cupy() -> None:
    """Install emmpool as CuPy's allocator (``cupy.cuda.set_allocator``).

    Each block belongs to CuPy's current stream at its allocation, as in CuPy's own pool: its
    free is fenced on that stream, and a block freed on a stream can go straight to the next
    allocation on the same stream. CuPy's C function allocator passes no stream, so emmpool asks
    CuPy (``cupy_backends.cuda.stream.get_stream_ptr``, or else
    ``cupy.cuda.stream.get_current_stream_ptr``: C functions CuPy exports); should a CuPy
    version export neither, blocks name no stream and frees are fenced on the legacy default
    stream (safe for the null, per-thread and blocking streams; memory used on a non-blocking
    stream then needs :func:`emmpool.record_stream` before its free).
    """
    try:
        import cupy
    except ImportError as e:
        raise ImportError(
            "emmpool.use_for_cupy() needs CuPy: pip install 'emmpool[cupy]' (cupy-cuda13x)"
        ) from e
    global _cupy_malloc
    ensure_configured()
    try:
        from cupy_backends.cuda import stream as backend_stream
    except ImportError:
        backend_stream = None
    _ask_cupy_for_its_stream(cupy, backend_stream)
    addresses = _core.c_function_addresses()
    allocator = cupy.cuda.memory.CFunctionAllocator(
        0, addresses["cupy_malloc"], addresses["cupy_free"], _core
    )
    # Sizes are rounded up to CuPy's allocation unit (512 bytes), as CuPy's own pool does and
    # reports in Memory.size. CuPy does not check the C function's result: a NULL from the pool
    # (out of memory) would become a silent null pointer. Where this CuPy passes on an exception
    # raised by the C function, the entry point raises CuPy's OutOfMemoryError itself;
    # otherwise the wrapper (in C) checks each result.
    out_of_memory = cupy.cuda.memory.OutOfMemoryError
    _core.set_cupy_failure(out_of_memory)
    if _cupy_passes_errors_on(cupy, addresses):
        malloc = _core.cupy_malloc(allocator.malloc)
        checked = False
    else:
        _core.set_cupy_failure(None)
        malloc = _core.cupy_malloc(allocator.malloc, out_of_memory)
        checked = True
    log.info("CuPy %s: failed allocations %s", cupy.__version__,
             "are checked by the wrapper" if checked else "raise from the C entry point")
    cupy.cuda.set_allocator(malloc)
    _installed.append(allocator)
    _cupy_malloc = malloc


def _cupy_passes_errors_on(cupy, addresses) -> bool:
    """Whether this CuPy's C-function allocator passes on an exception raised by its C malloc
    (CuPy's Cython wrapper does where it is compiled to propagate exceptions, with -1 as their
    marker). Tried with a request emmpool refuses (device -1: ValueError) through the very
    constructor CuPy's CFunctionAllocator.malloc uses; where the exception is not passed on,
    Python reports a SystemError instead, and the probe's memory (address -1) frees nothing."""
    memory = getattr(cupy.cuda.memory, "CFunctionAllocatorMemory", None)
    if memory is None:
        return False
    try:
        memory(256, 0, addresses["cupy_malloc"], addresses["cupy_free"], -1)
    except ValueError as e:
        return "device" in str(e)
    except Exception:  # noqa: BLE001 - SystemError, or whatever another CuPy does
        return False
    return False


def _ask_cupy_for_its_stream(cupy, backend_stream=None) -> None:
    """Give the CuPy entry points the cheapest of CuPy's exported stream lookups that this
    CuPy has with a signature emmpool knows; warn if there is none."""
    candidates = [
        (backend_stream, "get_stream_ptr"),               # by device: no runtime call
        (cupy.cuda.stream, "get_current_stream_ptr"),     # of the current device
    ]
    for module, name in candidates:
        capsule = getattr(module, "__pyx_capi__", {}).get(name)
        if capsule is None:
            continue
        try:
            _core.set_cupy_stream_source(capsule)
        except (ValueError, TypeError) as e:  # another signature in this CuPy version
            log.info("CuPy %s: %s.%s: %s", cupy.__version__, module.__name__, name, e)
            continue
        log.info("CuPy's current stream from %s.%s", module.__name__, name)
        return
    _core.set_cupy_stream_source(None)
    warnings.warn(
        f"CuPy {cupy.__version__} does not say which stream is current: emmpool fences "
        "CuPy's frees on the legacy default stream (memory used on a non-blocking stream "
        "needs emmpool.record_stream before its free)",
        RuntimeWarning,
        stacklevel=3,
    )


def use_for_torch(allocator: str | None = None) -> str:
    """Install emmpool as PyTorch's CUDA allocator, before PyTorch's first CUDA allocation;
    return how: ``"extension"`` (emmpool's allocator extension, compiled on first use) or
    ``"pluggable"`` (PyTorch's CUDAPluggableAllocator). ``allocator`` (or
    ``EMMPOOL_TORCH_ALLOCATOR``): ``auto`` (default), ``extension`` or ``pluggable``; see
    emmpool._torch and README's PyTorch section.

    PyTorch passes the stream of each allocation: frees are fenced on that stream.
    """
    from . import _torch

    return _torch.use_for_torch(allocator)


_TAG_RMM = _core.LIBRARIES.index("rmm")


def rmm_resource(device: int | None = None):
    """An RMM memory resource that allocates from emmpool's pool of ``device`` (default: the
    current device, else 0), for an application that wants RAPIDS libraries in the same pool:
    ``rmm.mr.set_current_device_resource(emmpool.rmm_resource())``.

    It is RMM's ``CallbackMemoryResource``: one Python call per allocation and free (a few µs),
    negligible for RAPIDS-sized buffers, not for millions of tiny ones. The stream RMM passes is
    honoured: the free is fenced on it, and blocks go straight back to that stream. RMM
    guarantees that stream alive during the call (its buffers hold their stream); emmpool
    never uses it afterwards, so it may be destroyed at any time after.
    """
    try:
        import rmm.mr
    except ImportError as e:
        raise ImportError(
            "emmpool.rmm_resource() needs RMM: pip install rmm-cu13 (or rmm-cu12)"
        ) from e
    ensure_configured()
    if device is None:
        device = max(_core.current_device(), 0)
    return rmm.mr.CallbackMemoryResource(*_rmm_callbacks(_core.pool(device)))


def _rmm_callbacks(pool):
    """The allocate and deallocate callbacks of :func:`rmm_resource` over ``pool`` (RMM passes
    objects with ``__cuda_stream__``), apart so that tests can drive them without RMM."""
    allocate, deallocate = pool.allocate, pool.deallocate_tagged

    def alloc(size, stream):
        return allocate(size, stream.__cuda_stream__()[1], _TAG_RMM)

    def free(ptr, size, stream):
        deallocate(ptr, stream.__cuda_stream__()[1], _TAG_RMM)

    return alloc, free

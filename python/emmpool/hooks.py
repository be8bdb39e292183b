"""CuPy and PyTorch allocate from the same process-wide pools as Numba.

Both go through plain C entry points of emmpool._core (cpp/src/c_api.cpp): no Python runs per
allocation. Neither library is needed by emmpool itself; each hook says what to install.
"""

from __future__ import annotations

from . import _core
from ._config import ensure_configured

_installed: list = []  # keeps CuPy's allocator object alive


def use_for_cupy() -> None:
    """Install emmpool as CuPy's allocator (``cupy.cuda.set_allocator``).

    CuPy's C function allocator passes no stream, so frees are fenced on the legacy default
    stream: safe for CuPy's default, per-thread default and blocking streams. Memory used on a
    *non-blocking* CuPy stream must be declared with :func:`emmpool.record_stream` before it is
    freed.
    """
    try:
        import cupy
    except ImportError as e:
        raise ImportError(
            "emmpool.use_for_cupy() needs CuPy: pip install 'emmpool[cupy]' (cupy-cuda13x)"
        ) from e
    ensure_configured()
    addresses = _core.c_function_addresses()
    allocator = cupy.cuda.memory.CFunctionAllocator(
        0, addresses["cupy_malloc"], addresses["cupy_free"], _core
    )
    c_malloc = allocator.malloc
    out_of_memory = cupy.cuda.memory.OutOfMemoryError

    # CuPy does not check the C function's result: a NULL from the pool (out of memory) would
    # become a silent null pointer. This one comparison turns it into CuPy's own error.
    def malloc(size):
        mem = c_malloc(size)
        if mem.ptr == 0 and size > 0:
            raise out_of_memory(size, -1)
        return mem

    cupy.cuda.set_allocator(malloc)
    _installed.append(allocator)


def use_for_torch() -> None:
    """Install emmpool as PyTorch's CUDA allocator (CUDAPluggableAllocator).

    Must run before PyTorch's first CUDA allocation. PyTorch passes the stream of each
    allocation and free: frees are fenced on that stream.
    """
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "emmpool.use_for_torch() needs PyTorch: pip install 'emmpool[torch]'"
        ) from e
    ensure_configured()
    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        _core.__file__, "emmpool_torch_malloc", "emmpool_torch_free"
    )
    torch.cuda.memory.change_current_allocator(allocator)
    _installed.append(allocator)

"""Anchor EMM plugins that bracket emmpool in the Numba benchmark (ANCHORS, at the end, names
them as benchmarks/README.md's table of managers does; each class says what it is).

All follow Numba's EMM contract (numba-cuda ``cudadrv/driver.py``):

* ``__init__`` must not touch CUDA: ``set_memory_manager`` instantiates the
  class once with ``context=None`` just to read ``interface_version``.
* ``initialize()`` runs on *every* top-level Numba API call
  (``ensure_context`` -> ``prepare_for_use``), so after the first call it must
  be a cheap check.
* The finalizer given to ``MemoryPointer`` runs via ``weakref.finalize`` when
  the pointer dies, so it must not reference the ``MemoryPointer`` itself.
* The pointer handed to ``MemoryPointer`` is a ``CUdeviceptr`` (what Numba's
  own allocator produces); ctypes pointers are not accepted by this version.

Allocations are made on the calling thread's current context, which Numba has
made current (the device's primary context) before calling ``memalloc``.
"""

import collections
import functools

from cuda.bindings import driver as cu
from numba.cuda import (
    GetIpcHandleMixin,
    HostOnlyCUDAMemoryManager,
    MemoryInfo,
    MemoryPointer,
)
from numba.cuda.cudadrv.driver import CudaAPIError, MappedMemory, PinnedMemory

_SUCCESS = cu.CUresult.CUDA_SUCCESS

# Errors a free may legitimately hit while the interpreter is shutting down
# (weakref.finalize runs leftover finalizers at exit, possibly after the
# context is gone).  Anything else is a real bug and is raised.
_SHUTDOWN_ERRORS = frozenset(
    {
        cu.CUresult.CUDA_ERROR_DEINITIALIZED,
        cu.CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED,
    }
)


def _check(err, what):
    if err != _SUCCESS:
        # Numba's own error type, so an out-of-memory looks the same to
        # callers as it does with Numba's built-in allocator.
        raise CudaAPIError(err, f"{what} failed: {err.name}")


def _mem_alloc(size):
    err, ptr = cu.cuMemAlloc(size)
    _check(err, f"cuMemAlloc({size})")
    return ptr  # a CUdeviceptr


def _mem_free(ptr):
    err = cu.cuMemFree(ptr)[0]
    if err != _SUCCESS and err not in _SHUTDOWN_ERRORS:
        _check(err, f"cuMemFree({int(ptr):#x})")


def _driver_memory_info():
    err, free, total = cu.cuMemGetInfo()
    _check(err, "cuMemGetInfo")
    return MemoryInfo(free=free, total=total)


def _noop():
    pass


class _AnchorBase(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
    """Shared plumbing: driver-reported memory info and the interface version.

    ``GetIpcHandleMixin`` derives the IPC handle from the enclosing driver
    allocation (``cuMemGetAddressRange``), which is correct for all three
    anchors since each hands out memory carved from ``cuMemAlloc`` blocks.
    """

    def get_memory_info(self):
        return _driver_memory_info()

    @property
    def interface_version(self):
        return 1


class CudaMallocManager(_AnchorBase):
    """One ``cuMemAlloc`` per ``memalloc``, ``cuMemFree`` in the finalizer: what a naive plugin
    costs (the driver's allocator, the implicit synchronisation inside ``cuMemFree`` included)."""

    def initialize(self):
        # Nothing to prepare: each allocation goes straight to the driver.
        pass

    def memalloc(self, size):
        ptr = _mem_alloc(size)
        # partial() binds only the CUdeviceptr, never the MemoryPointer.
        return MemoryPointer(self.context, ptr, size, finalizer=functools.partial(_mem_free, ptr))


class CupyPoolManager(_AnchorBase):
    """Allocations come from CuPy's default memory pool.

    The CuPy ``MemoryPointer`` is parked in ``self._live`` and popped by the
    Numba finalizer; dropping that last reference returns the block to CuPy's
    pool.  CuPy and Numba share the device's primary context, and both use
    the legacy default stream here (Numba launches on stream 0, CuPy's null
    stream), so CuPy's stream-ordered reuse is safe for these allocations.
    Single-device only: CuPy allocates on its current device, which is the
    device of the context Numba made current.
    """

    def __init__(self, *args, **kwargs):
        # Importing CuPy does not initialise CUDA, so this is allowed here,
        # and it makes set_memory_manager() fail early when CuPy is missing.
        import cupy.cuda.memory

        super().__init__(*args, **kwargs)
        self._cupy_alloc = cupy.cuda.memory.alloc
        self._live = {}

    def initialize(self):
        # CuPy creates its pool lazily on first allocation.
        pass

    def memalloc(self, size):
        cp_mem = self._cupy_alloc(size)
        addr = cp_mem.ptr
        self._live[addr] = cp_mem
        # pop(addr, None): reset() may already have released everything.
        return MemoryPointer(self.context, cu.CUdeviceptr(addr), size,
                             finalizer=functools.partial(self._live.pop, addr, None))

    def reset(self):
        super().reset()
        self._live.clear()


class CupyPinnedPoolManager(CupyPoolManager):
    """Device memory as ``CupyPoolManager``; pinned host memory from CuPy's pinned-memory pool
    (``cupy.cuda.alloc_pinned_memory``), the usual way to cache pinned buffers in Python.
    CuPy's pinned pool cannot map memory: mapped requests stay Numba's own."""

    def __init__(self, *args, **kwargs):
        import cupy.cuda

        super().__init__(*args, **kwargs)
        self._cupy_pinned = cupy.cuda.alloc_pinned_memory

    def memhostalloc(self, size, mapped=False, portable=False, wc=False):
        if mapped or wc:
            return super().memhostalloc(size, mapped, portable, wc)
        mem = self._cupy_pinned(size)  # back to CuPy's pinned pool when `owner` dies
        return PinnedMemory(self.context, mem.ptr, size, owner=mem, finalizer=_noop)


class NothingManager(_AnchorBase):
    """The floor: no allocation work at all per ``memalloc``, so that an allocation costs only
    Numba's own bookkeeping (context lookup, ``MemoryPointer`` + ``weakref.finalize``,
    ``DeviceNDArray``). All its allocations alias each other: it is only fit for timing.

    ``initialize`` makes one 256 MiB buffer; every request that fits gets a
    pointer to its start.  A larger request grows the buffer once (to at
    least double), after which it also comes for free.  Superseded buffers are
    kept until ``reset`` because pointers into them may still be in use.

    The finalizer is a no-op, but it is still passed so that each allocation
    pays for the ``weakref.finalize`` that every real plugin needs.
    """

    BUFFER_BYTES = 256 << 20

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ptr = None  # CUdeviceptr of the current buffer
        self._capacity = 0  # its size; 0 until initialize() has run
        self._buffers = []  # every buffer made, freed on reset()
        self._host = None  # the mapped host buffer of memhostalloc()
        self._mapped = collections.deque(maxlen=64)  # recent MappedMemory objects

    def initialize(self):
        if self._capacity == 0:
            self._grow(self.BUFFER_BYTES)

    def _grow(self, size):
        want = max(size, 2 * self._capacity, self.BUFFER_BYTES)
        try:
            ptr = _mem_alloc(want)
        except CudaAPIError:
            if want == size:
                raise
            ptr = _mem_alloc(size)  # doubling did not fit; exact size might
            want = size
        self._buffers.append(ptr)
        self._ptr, self._capacity = ptr, want

    def memalloc(self, size):
        if size > self._capacity:  # also covers "initialize() not run yet"
            self._grow(size)
        return MemoryPointer(self.context, self._ptr, size, finalizer=_noop)

    def memhostalloc(self, size, mapped=False, portable=False, wc=False):
        # Host requests alias one mapped pinned buffer too (made by Numba's own allocator, so
        # that it is freed by the base class's reset()); MappedMemory's device-pointer lookup
        # stays in the floor, since every manager pays it.
        if self._host is None or self._host.size < size:
            self._host = super().memhostalloc(max(size, self.BUFFER_BYTES // 4), mapped=True)
        ptr = self._host.host_pointer
        if not mapped:
            return PinnedMemory(self.context, ptr, size, owner=self._host, finalizer=_noop)
        # Numba wants the owned view of mapped memory (the buffer an ndarray wraps), which
        # refers to the MappedMemory weakly: keep the last few alive, as Numba's own
        # `allocations` does until their arrays die.
        mem = MappedMemory(self.context, ptr, size, owner=self._host, finalizer=_noop)
        self._mapped.append(mem)
        return mem.own()

    def reset(self):
        super().reset()
        self._host = None
        self._mapped.clear()
        buffers, self._buffers = self._buffers, []
        self._ptr, self._capacity = None, 0
        for ptr in buffers:
            _mem_free(ptr)


# Benchmark name -> plugin class.
ANCHORS = {
    "cudamalloc": CudaMallocManager,
    "cupy-pool": CupyPoolManager,
    "cupy-pinned-pool": CupyPinnedPoolManager,
    "nothing": NothingManager,
}

"""Numba External Memory Management (EMM) plugin backed by emmpool's C++ pools.

Enable it with either::

    numba.cuda.set_memory_manager(emmpool.plugin.EmmPoolManager)   # before any CUDA use
    NUMBA_CUDA_MEMORY_MANAGER=emmpool.plugin python ...

Device memory comes from the process-wide pool of the context's device (shared with CuPy and
PyTorch when their hooks are installed). Pinned and mapped host memory are Numba's own
(``HostOnlyCUDAMemoryManager``) unless ``EMMPOOL_PINNED=pool``: then ``memhostalloc`` is served
by emmpool's pinned-host cache and ``mempin`` goes through its C++ core (see host_pool.hpp).

``defer_cleanup``: while it is active, nothing is returned to the CUDA driver (no
``cuMemFree``, which would synchronize); freed device blocks still flow back into the pool
once the work issued before their free has completed, and can be reused. Host allocations are
deferred exactly as by Numba's own manager.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

from numba.cuda import MemoryInfo, MemoryPointer, HostOnlyCUDAMemoryManager, IpcHandle
from numba.cuda.cudadrv.driver import MappedMemory, PinnedMemory
from numba.cuda.cudadrv.driver import CudaAPIError, GetIpcHandleMixin, binding

from . import _core
from ._config import check_environment, ensure_configured, log

# NUMBA_CUDA_MEMORY_MANAGER=emmpool.plugin imports this module: a bad EMMPOOL_* value fails
# here, naming the variable, not at the first allocation. (Nothing here may touch CUDA.)
check_environment()

__all__ = ["EmmPoolManager"]

_LEGACY = _core.LEGACY_STREAM
_TAG_NUMBA = 1
_OOM = binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY


class EmmPoolManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
    """Numba memory manager whose device allocations come from emmpool's pool.

    Numba makes one instance per context. ``__init__`` touches no CUDA (Numba instantiates the
    class with ``context=None`` just to read ``interface_version``); the pool is bound on the
    first ``initialize()``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pool = None

    # -- binding to the pool -------------------------------------------------------------
    def initialize(self):
        # Called on every context push: after the first call this is one attribute test.
        if self._pool is None:
            self._bind()

    def _bind(self):
        cfg = ensure_configured()
        dev = self.context.device
        # A Numba Device, or a bare CUdevice for contexts attached from a third party.
        self._device = dev.id if hasattr(dev, "id") else int(dev)
        pool = _core.pool(self._device)
        self._ctx = weakref.proxy(self.context)
        self._allocate = pool.allocate
        self._free = pool.deallocate
        self._generation = pool.generation
        self._pinned = _core.pinned_pool(self._device) if cfg.pinned == "pool" else None
        self._pinned_generation = self._pinned.generation if self._pinned is not None else 0
        self._pool = pool
        log.info("Numba context on device %d allocates from emmpool (%s mode)", self._device,
                 pool.options["mode"])

    @property
    def pool(self):
        """The :class:`emmpool._core.DevicePool` of this context's device."""
        self.initialize()
        return self._pool

    # -- the EMM interface ---------------------------------------------------------------
    def memalloc(self, size):
        if type(size) is not int:
            size = _as_size(size)
        if size < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({size})")
        try:
            if self._pool is None:
                self._bind()
            ptr = self._allocate(size, _LEGACY, _TAG_NUMBA)
        except (_core.OutOfMemoryError, _core.CudaError) as e:
            raise _as_numba_error(e) from None
        finalizer = functools.partial(self._free, ptr, _LEGACY, self._generation)
        return MemoryPointer(self._ctx, ptr, size, finalizer=finalizer)

    def memhostalloc(self, size, mapped=False, portable=False, wc=False):
        """Pinned (or mapped) host memory from emmpool's pinned cache (EMMPOOL_PINNED=pool),
        with Numba's bookkeeping: mapped memory is kept in ``self.allocations`` until freed."""
        self.initialize()
        if self._pinned is None:
            return super().memhostalloc(size, mapped, portable, wc)
        flags = (
            (_core.HOST_MAPPED if mapped else 0)
            | (_core.HOST_PORTABLE if portable else 0)
            | (_core.HOST_WRITECOMBINED if wc else 0)
        )
        try:
            ptr = self._pinned.allocate(size, flags)
        except (_core.OutOfMemoryError, _core.CudaError) as e:
            raise _as_numba_error(e) from None
        finalizer = _host_finalizer(self, self._pinned.deallocate, ptr, mapped,
                                    self._pinned_generation)
        if mapped:
            mem = MappedMemory(self._ctx, ptr, size, finalizer=finalizer)
            self.allocations[ptr] = mem
            return mem.own()
        return PinnedMemory(self._ctx, ptr, size, finalizer=finalizer)

    def mempin(self, owner, pointer, size, mapped=False):
        """Page-lock caller memory through emmpool's core (EMMPOOL_PINNED=pool); unpinned as
        soon as it is released, so that the same memory can be pinned again at once."""
        self.initialize()
        if self._pinned is None:
            return super().mempin(owner, pointer, size, mapped)
        pointer = int(pointer)
        self._pinned.register_memory(pointer, size, _core.HOST_MAPPED if mapped else 0)
        finalizer = _host_finalizer(self, self._pinned.unregister_memory, pointer, mapped)
        if mapped:
            mem = MappedMemory(self._ctx, pointer, size, owner=owner, finalizer=finalizer)
            self.allocations[pointer] = mem
            return mem.own()
        return PinnedMemory(self._ctx, pointer, size, owner=owner, finalizer=finalizer)

    def get_memory_info(self):
        """Driver's free memory plus what the pool holds free, and the device's total."""
        self.initialize()
        free, total = _core.memory_info(self._device)
        return MemoryInfo(free=free + self._pool.stats()["bytes_free"], total=total)

    def get_ipc_handle(self, memory):
        """IPC handle of the pool segment holding ``memory``, with the block's offset in it.

        Memory the pool did not allocate (e.g. a foreign array through the CUDA Array
        Interface) gets Numba's own handling: the handle of its whole allocation.
        """
        self.initialize()
        info = self._pool.ipc_handle(int(memory.handle))
        if info is None:
            return super().get_ipc_handle(memory)
        handle_bytes, base, _segment_size, offset = info
        handle = binding.CUipcMemHandle()
        handle.reserved = handle_bytes
        source_info = self.context.device.get_device_identity()
        return IpcHandle(memory, handle, memory.size, source_info, offset=offset)

    def reset(self):
        """Numba resets the context (e.g. ``cuda.close()``): wait for pending frees, return
        free memory to the driver, and retire segments still holding live arrays, so that
        their addresses are never handed out again. Finalizers of those arrays may run later
        (even at exit): they are matched to the retired blocks by generation."""
        super().reset()
        if self._pool is not None:
            self._pool.reset()
            self._generation = self._pool.generation
        if getattr(self, "_pinned", None) is not None:
            self._pinned.reset()
            self._pinned_generation = self._pinned.generation

    @contextlib.contextmanager
    def defer_cleanup(self):
        with super().defer_cleanup():
            if self._pool is None:
                yield
                return
            pools = [self._pool] + ([self._pinned] if self._pinned is not None else [])
            for p in pools:
                p.defer_cleanup_begin()
            try:
                yield
            finally:
                for p in pools:
                    p.defer_cleanup_end()

    @property
    def interface_version(self):
        return 1


def _as_numba_error(e: Exception) -> CudaAPIError:
    """The error Numba's own manager would raise: CudaAPIError with the driver's code, and
    CUDA_ERROR_OUT_OF_MEMORY when the pool is out of memory (its message says what the pool
    holds), so that callers' handlers keep working."""
    if isinstance(e, _core.OutOfMemoryError):
        log.warning("%s", e)
        return CudaAPIError(_OOM, str(e))
    try:
        code = binding.CUresult(e.code)
    except (ValueError, AttributeError):
        code = binding.CUresult.CUDA_ERROR_UNKNOWN
    return CudaAPIError(code, str(e))


def _host_finalizer(manager, release, ptr, mapped, generation=None):
    """What Numba's own host finalizers do (drop the mapped entry from the manager's
    bookkeeping), then give the memory back to emmpool."""
    allocations = manager.allocations

    def core():
        if mapped and allocations:
            allocations.pop(ptr, None)
        if generation is None:
            release(ptr)
        else:
            release(ptr, _LEGACY, generation)

    return core


def _as_size(size) -> int:
    try:
        return int(size.__index__())
    except (AttributeError, TypeError):
        raise TypeError(
            f"allocation size must be an integer number of bytes, not {type(size).__name__}"
        ) from None


_numba_memory_manager = EmmPoolManager

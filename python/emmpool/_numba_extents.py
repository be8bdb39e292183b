"""Numba's ``driver.device_extents`` answering with emmpool's blocks.

Numba's ``device_extents(obj)``, and ``device_memory_size(obj)`` through it, ask the driver for
the allocation that holds an array (``cuMemGetAddressRange``). With Numba's own allocator that
is the array's own allocation. With a plugin that sub-allocates, it is the pool segment, which
other arrays share. A program that is correct with Numba's allocator then writes over its
neighbours: Numba's own ``test_host_alloc_pinned`` does ``device_memset(a, 0,
device_memory_size(a))``, which zeroes the arrays after ``a`` in its segment, or fails with
``CUDA_ERROR_INVALID_VALUE`` when it runs past the segment's end.

The plugin therefore wraps the function in each Numba package's driver module it serves.
- Memory of emmpool's pools: the wrapper answers with the live block that holds the pointer
  (``DevicePool.live_extent``), as the driver would for an allocation of its own.
- Any other memory (freed blocks, other allocators, another process's): it asks the driver, as
  before.
- Numba's other caller, ``GetIpcHandleMixin.get_ipc_handle``, never sees a pool block: the
  plugin's own ``get_ipc_handle`` exports pool memory. It keeps the mixin for other memory, for
  which nothing changes.
"""

from __future__ import annotations

import functools
import threading

_lock = threading.Lock()
_pools: dict[int, object] = {}  # device -> the DevicePool whose blocks the wrappers answer for


def install(driver, device: int, pool) -> None:
    """Answer ``driver.device_extents`` (a Numba package's driver module) with `pool`'s blocks
    from now on. Once per module; each device's pool is added once."""
    with _lock:
        _pools.setdefault(device, pool)
        current = getattr(driver, "device_extents", None)
        if current is None or getattr(current, "__wrapped__", None) is not None:
            return  # not this package's API, or wrapped already
        driver.device_extents = _wrap(driver, current)


def _wrap(driver, original):
    def device_extents(devmem):
        ptr = driver.device_pointer(devmem)
        if ptr:
            for pool in tuple(_pools.values()):
                extent = pool.live_extent(ptr)
                if extent is not None:
                    base, size = extent
                    return base, base + size
        return original(devmem)

    functools.update_wrapper(device_extents, original)  # its name and doc; __wrapped__
    device_extents.__doc__ = (original.__doc__ or "") + (
        "\n    emmpool: for memory of its pools, the extents of the block holding it.\n")
    return device_extents

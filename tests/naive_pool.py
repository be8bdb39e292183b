"""A deliberately unsafe Numba plugin: it reuses a freed block at once, whatever work may still
use it. Only for showing that tests/test_gpu_numba.py's cross-stream test can fail."""

from __future__ import annotations

import weakref

from numba.cuda import HostOnlyCUDAMemoryManager, MemoryInfo, MemoryPointer
from numba.cuda.cudadrv.driver import GetIpcHandleMixin, driver


class NaivePool(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._free: dict[int, list[int]] = {}

    def initialize(self):
        pass

    def memalloc(self, size):
        bucket = self._free.setdefault(size, [])
        ptr = bucket.pop() if bucket else int(driver.cuMemAlloc(size))
        return MemoryPointer(
            weakref.proxy(self.context), ptr, size, finalizer=lambda: bucket.append(ptr)
        )

    def get_memory_info(self):
        free, total = driver.cuMemGetInfo()
        return MemoryInfo(free=free, total=total)

    @property
    def interface_version(self):
        return 1

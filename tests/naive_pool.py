"""A deliberately unsafe Numba plugin: it reuses a freed block at once, whatever work may still
use it. Only for showing that tests/test_gpu_numba.py's cross-stream test can fail. For the
package the scenario uses (EMMCI_TEST_CUDA, as in tests/gpu_scripts.py)."""

from __future__ import annotations

import importlib
import os
import weakref

_cuda = importlib.import_module(os.environ.get("EMMCI_TEST_CUDA", "numba.cuda"))
_emm = _cuda.cudadrv.driver
MemoryInfo, MemoryPointer, driver = _emm.MemoryInfo, _emm.MemoryPointer, _emm.driver


class NaivePool(_emm.GetIpcHandleMixin, _emm.HostOnlyCUDAMemoryManager):
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

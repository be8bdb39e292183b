#!/usr/bin/env python3
"""Before numba-cuda-mlir's suite is compared (.ci/gpu.py, step mlir): is each run's memory
manager the one it claims to be? Run once with Numba's default manager and once with
NUMBA_CUDA_MEMORY_MANAGER=emmpool.plugin; exit status 0 when it is.

A plugin run that silently fell back to the default manager would pass every test and prove
nothing, so the check allocates and asks. Under the plugin it checks both ways numba-cuda-mlir
allocates device memory: a device array (the EMM interface, memalloc), and the device copy of a
NumPy array passed to a kernel, which numba-cuda-mlir makes through cuda.core's
``Device.allocate``; the plugin makes emmpool the memory resource of that cuda.core Device
(docs/design.md, "cuda.core"), so the copy too must be counted in emmpool's pool, and the
driver's own stream-ordered pool (cuda.core's default resource) must not have held a byte.
"""

from __future__ import annotations

import os

import numpy as np
from cuda.bindings import driver as drv
from numba_cuda_mlir import cuda

PLUGIN = os.environ.get("NUMBA_CUDA_MEMORY_MANAGER") == "emmpool.plugin"
_HIGH = drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_HIGH


def _ok(result):
    err, *rest = result
    assert err == drv.CUresult.CUDA_SUCCESS, err
    return rest[0] if rest else None


def driver_pool_high() -> int:
    """Bytes the driver's pool of device 0 has held at most since the last reset."""
    return int(_ok(drv.cuMemPoolGetAttribute(_ok(drv.cuDeviceGetMemPool(0)), _HIGH)))


@cuda.jit
def inc(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] += 1


def main() -> None:
    a = cuda.to_device(np.arange(1000))
    assert (a.copy_to_host() == np.arange(1000)).all()
    manager = type(cuda.current_context().memory_manager)
    name = f"{manager.__module__}.{manager.__qualname__}"
    print(os.environ.get("NUMBA_CUDA_MEMORY_MANAGER", "default"), "->", name)
    if not PLUGIN:
        assert not manager.__module__.startswith("emmpool"), name
        print("OK")
        return
    import emmpool
    from emmpool.cuda_core import EmmPoolMemoryResource

    assert manager.__qualname__ == "EmmPoolMlirManager", name
    numba = emmpool.stats(0)["by_library"]["numba"]
    assert numba["bytes_in_use"] >= a.nbytes, numba
    print("emmpool holds the device array:", numba)

    core_device = getattr(cuda.current_context().device, "_dev", None)
    assert core_device is not None, "numba-cuda-mlir's device has no cuda.core Device (_dev)"
    resource = core_device.memory_resource
    assert isinstance(resource, EmmPoolMemoryResource), resource
    _ok(drv.cuMemPoolSetAttribute(_ok(drv.cuDeviceGetMemPool(0)), _HIGH, drv.cuuint64_t(0)))
    before = numba["allocations"]
    host = np.zeros(1 << 16)
    inc[(host.size + 255) // 256, 256](host)  # copied in and out through Device.allocate
    cuda.synchronize()
    assert (host == 1).all()
    after = emmpool.stats(0)["by_library"]["numba"]["allocations"]
    assert after > before, f"the kernel-argument copy did not come from emmpool ({before} -> " \
                           f"{after} allocations)"
    high = driver_pool_high()
    assert high == 0, f"the driver's pool held {high} bytes: the copy went around emmpool"
    print(f"kernel-argument copy through emmpool: numba allocations {before} -> {after}, "
          f"resource {type(resource).__name__}, driver pool high-water {high}")
    print("OK")


if __name__ == "__main__":
    main()

"""Two or more GPUs: one pool per device, Numba switching devices, staged IPC between devices.
Skipped, with the reason, where fewer than two GPUs are present."""

from __future__ import annotations

import functools

import pytest

from tests import gpu_scripts
from tests.test_gpu_numba import check, run

pytestmark = pytest.mark.gpu


@functools.cache
def _device_count() -> int:
    import emmpool

    try:
        return emmpool._core.device_count()
    except emmpool.CudaError:
        return 0


needs_two = pytest.mark.skipif("_device_count() < 2", reason="needs two or more GPUs")

# Arrays on every device through cuda.gpus[i]: a kernel on each device doubles them. The
# invariant emmpool owes: every block a device's pool hands out lives on that device (the driver
# says so), and no other pool owns it; statistics are per device. Printed per array, for the log:
# the device Numba selected, the device of the driver's current context, the pointer's device.
ARRAYS_ON_EVERY_DEVICE = r"""
import gc, numpy as np
from numba import cuda
from cuda.bindings import driver as drv
import emmpool
from emmpool import _core

@cuda.jit
def double(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] *= 2

def ordinal_of(ptr):
    err, ordinal = drv.cuPointerGetAttribute(
        drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    assert err == drv.CUresult.CUDA_SUCCESS, err
    return ordinal

def current_device():
    err, dev = drv.cuCtxGetDevice()
    assert err == drv.CUresult.CUDA_SUCCESS, err
    return int(dev)

ndev = len(cuda.gpus)
arrays, report, wrong = {}, [], []
for d in range(ndev):
    with cuda.gpus[d]:
        current = current_device()
        arrays[d] = [cuda.to_device(np.full(n, d + 1, np.int64)) for n in (100, 70_000, 3 << 20)]
        for a in arrays[d]:
            double[(a.size + 255) // 256, 256](a)
        for a in arrays[d]:
            ptr = a.__cuda_array_interface__["data"][0]
            owners = [e for e in range(ndev) if _core.pool(e).owns(ptr)]
            ordinal = ordinal_of(ptr)
            report.append((d, current, a.size, hex(ptr), owners, ordinal))
            # on the device whose context is current, and owned by that device's pool alone
            if ordinal != current or owners != [ordinal]:
                wrong.append(report[-1])
            assert (a.copy_to_host() == 2 * (d + 1)).all(), (d, a.size)
print("numba device, driver's current device, elements, pointer, owning pools, pointer's device")
for r in report:
    print("  ", r)
assert not wrong, wrong
stats = emmpool.stats()
for e in stats:
    held = sum(a.nbytes for arrs in arrays.values() for a in arrs
               if _core.pool(e).owns(a.__cuda_array_interface__["data"][0]))
    assert stats[e]["by_library"]["numba"]["bytes_in_use"] >= held, (e, stats[e])
del arrays, a; gc.collect()
for e in stats:
    assert emmpool.stats(e)["bytes_in_use"] == 0, emmpool.stats(e)
print("OK")
"""

# A pooled array of device 0 (at a nonzero offset in its segment in pool mode) opened by
# processes whose context is device 1, both ways Numba has, one consumer each: directly (peer
# access, where the devices have it) and staged (opened on device 0, copied into memory
# allocated on device 1 through the plugin). A consumer's failure comes back as its traceback.
STAGED_IPC = gpu_scripts.SPAWNED_CONSUMER + r"""
import os, traceback, numpy as np
from numba import cuda

def consume(how, payload, q):
    try:
        from numba import cuda
        from numba.cuda.cudadrv import driver
        import emmpool
        handle = pickle.loads(payload)
        with cuda.gpus[1]:
            ctx = cuda.current_context()
            before = emmpool.stats(1)["by_library"]["numba"]["allocations"]
            mem = handle.open_direct(ctx) if how == "direct" else handle.open_staged(ctx)
            got = np.empty(50_000, np.float64)
            driver.device_to_host(got, mem, got.nbytes)
            handle.close()
            allocs = emmpool.stats(1)["by_library"]["numba"]["allocations"] - before
        q.put(("ok", got, allocs))
    except BaseException:
        q.put(("error", traceback.format_exc(), 0))

if __name__ == "__main__":
    with cuda.gpus[0]:
        pad = cuda.device_array(4321, np.uint8)
        a = cuda.to_device(np.arange(50_000, dtype=np.float64))
        h = cuda.current_context().get_ipc_handle(a.gpu_data)
        if os.environ["EMMPOOL_MODE"] == "pool":
            assert h.offset != 0, h.offset            # a block inside a pooled segment
        can_peer = cuda.current_context().can_access_peer(1)
    for how in ("direct", "staged") if can_peer else ("staged",):
        status, got, allocs = run_consumer(consume, how, pickle.dumps(h))
        assert status == "ok", f"{how}: {got}"
        assert (got == np.arange(50_000)).all(), how
        if how == "staged":
            assert allocs >= 1, allocs                # the staging buffer came from the plugin
        print(how, "ok")
    print("OK")
"""


@needs_two
@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_arrays_on_every_device_come_from_that_devices_pool(mode):
    check(run(ARRAYS_ON_EVERY_DEVICE, mode=mode))


@needs_two
@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_staged_ipc_between_devices(mode):
    check(run(STAGED_IPC, mode=mode))

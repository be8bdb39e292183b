"""Two or more GPUs: one pool per device, Numba switching devices, staged IPC between devices.
Skipped, with the reason, where fewer than two GPUs are present."""

from __future__ import annotations

import functools

import pytest

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

# Arrays on every device through cuda.gpus[i]: a kernel on each device doubles them; each
# device's pool owns its own arrays and no other pool does; the driver puts each pointer in that
# device's context; statistics are per device.
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

ndev = len(cuda.gpus)
arrays, contexts = {}, {}
for d in range(ndev):
    with cuda.gpus[d]:
        contexts[d] = int(cuda.current_context().handle.value)
        arrays[d] = [cuda.to_device(np.full(n, d + 1, np.int64)) for n in (100, 70_000, 3 << 20)]
        for a in arrays[d]:
            double[(a.size + 255) // 256, 256](a)
report, wrong = [], []
for d in range(ndev):
    with cuda.gpus[d]:
        for a in arrays[d]:
            ptr = a.__cuda_array_interface__["data"][0]
            _, ctx = drv.cuPointerGetAttribute(
                drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT, ptr)
            _, ordinal = drv.cuPointerGetAttribute(
                drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
            owners = [e for e in range(ndev) if _core.pool(e).owns(ptr)]
            report.append((d, a.size, hex(ptr), owners, int(ctx) == contexts[d], ordinal))
            if owners != [d] or int(ctx) != contexts[d]:
                wrong.append(report[-1])
            assert (a.copy_to_host() == 2 * (d + 1)).all(), (d, a.size)
print("device, elements, pointer, owning pools, in the device's context, ordinal attribute:")
for r in report:
    print("  ", r)
assert not wrong, wrong
stats = emmpool.stats()
assert sorted(stats) == list(range(ndev)), stats
for d in range(ndev):
    want = sum(a.nbytes for a in arrays[d])
    assert stats[d]["by_library"]["numba"]["bytes_in_use"] >= want, (d, stats[d])
    assert stats[d]["bytes_in_use"] < want + (1 << 20), (d, stats[d])   # nothing of the other
del arrays, a; gc.collect()
for d in range(ndev):
    assert emmpool.stats(d)["bytes_in_use"] == 0, emmpool.stats(d)
print("OK")
"""

# A pooled array of device 0 (at a nonzero offset in its segment) opened by a process whose
# context is device 1, both ways Numba has: directly (peer access, where the devices have it) and
# staged (opened on device 0, copied into memory allocated on device 1 through the plugin).
STAGED_IPC = r"""
import multiprocessing as mp, os, pickle, numpy as np
from numba import cuda

def consume(payload, q):
    from numba import cuda
    from numba.cuda.cudadrv import driver
    import emmpool
    array_handle, raw_handle = pickle.loads(payload)
    with cuda.gpus[1]:
        with array_handle as arr:                     # direct if peers, else staged
            direct = arr.copy_to_host()
        ctx = cuda.current_context()
        before = emmpool.stats(1)["by_library"]["numba"]["allocations"]
        mem = raw_handle.open_staged(ctx)             # staged: allocates on device 1
        staged = np.empty(50_000, np.float64)
        driver.device_to_host(staged, mem, staged.nbytes)
        raw_handle.close()
        allocs = emmpool.stats(1)["by_library"]["numba"]["allocations"] - before
    q.put((direct, staged, allocs))

if __name__ == "__main__":
    with cuda.gpus[0]:
        pad = cuda.device_array(4321, np.uint8)
        a = cuda.to_device(np.arange(50_000, dtype=np.float64))
        raw = cuda.current_context().get_ipc_handle(a.gpu_data)
        if os.environ["EMMPOOL_MODE"] == "pool":
            assert raw.offset != 0, raw.offset        # a block inside a pooled segment
        payload = pickle.dumps((a.get_ipc_handle(), raw))
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=consume, args=(payload, q))
        p.start()
        direct, staged, allocs = q.get(timeout=120)
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    assert (direct == np.arange(50_000)).all()
    assert (staged == np.arange(50_000)).all()
    assert allocs >= 1, allocs                       # the staging buffer came from the plugin
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

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

# Arrays on every device through cuda.gpus[i]; each device's pool holds its own arrays, which
# live in that device's memory (the driver says so); a kernel on each device reads them.
ARRAYS_ON_EVERY_DEVICE = r"""
import gc, numpy as np
from numba import cuda
from cuda.bindings import driver as drv
import emmpool

@cuda.jit
def double(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] *= 2

ndev = len(cuda.gpus)
arrays = {}
for d in range(ndev):
    with cuda.gpus[d]:
        arrays[d] = [cuda.to_device(np.full(n, d + 1, np.int64)) for n in (100, 70_000, 3 << 20)]
        for a in arrays[d]:
            double[(a.size + 255) // 256, 256](a)
for d in range(ndev):
    with cuda.gpus[d]:
        for a in arrays[d]:
            ptr = a.__cuda_array_interface__["data"][0]
            err, ordinal = drv.cuPointerGetAttribute(
                drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
            assert err == drv.CUresult.CUDA_SUCCESS and ordinal == d, (err, ordinal, d)
            assert (a.copy_to_host() == 2 * (d + 1)).all()
stats = emmpool.stats()
assert sorted(stats) == list(range(ndev)), stats
for d in range(ndev):
    want = sum(a.nbytes for a in arrays[d])
    assert stats[d]["by_library"]["numba"]["bytes_in_use"] >= want, (d, stats[d])
    assert stats[d]["bytes_in_use"] < want + (1 << 20), (d, stats[d])   # nothing of the other
del arrays; gc.collect()
for d in range(ndev):
    assert emmpool.stats(d)["bytes_in_use"] == 0, emmpool.stats(d)
print("OK")
"""

# A pooled array of device 0 (at a nonzero offset in its segment) opened by a process whose
# context is device 1: Numba stages it (opens it on device 0, copies into memory allocated on
# device 1 through the plugin).
STAGED_IPC = r"""
import multiprocessing as mp, pickle, numpy as np
from numba import cuda

def consume(payload, q):
    from numba import cuda
    import emmpool
    handle = pickle.loads(payload)
    with cuda.gpus[1]:
        with handle as arr:                            # staged: source device 0
            assert arr.__cuda_array_interface__ is not None
            got = arr.copy_to_host()
            s = emmpool.stats()
    q.put((got, sorted(s), s[1]["by_library"]["numba"]["allocations"]))

if __name__ == "__main__":
    with cuda.gpus[0]:
        pad = cuda.device_array(4321, np.uint8)
        a = cuda.to_device(np.arange(50_000, dtype=np.float64))
        h = a.get_ipc_handle()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=consume, args=(pickle.dumps(h), q))
        p.start()
        got, devices, allocs_dev1 = q.get(timeout=120)
        p.join(60)
        assert p.exitcode == 0, p.exitcode
        assert (got == np.arange(50_000)).all()
    assert 1 in devices and allocs_dev1 >= 1, (devices, allocs_dev1)  # staged through the plugin
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

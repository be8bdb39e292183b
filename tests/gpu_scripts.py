"""Scenarios the GPU tests run in fresh interpreters (the memory manager must be chosen before
Numba creates a context, so each scenario gets its own process). Each prints 'OK' on success.

Each takes Numba's CUDA target from the package EMMCI_TEST_CUDA names (``numba.cuda``, the
default, or ``numba_cuda_mlir.cuda``; tests.test_gpu_numba.run sets it), and reaches the
driver module as ``cuda.cudadrv.driver``, which both packages provide."""

from __future__ import annotations

import sys

IMPORT_CUDA = (
    "import importlib, os\n"
    "cuda = importlib.import_module(os.environ.get('EMMCI_TEST_CUDA', 'numba.cuda'))\n"
)

ALLOC_SIZES = IMPORT_CUDA + r"""
import gc, numpy as np
import emmpool
rng = np.random.default_rng(0)
for n in [1, 255, 256, 4097, (1 << 20) + 3, 5 << 20, 64 << 20]:
    h = rng.integers(0, 255, n, dtype=np.uint8)
    d = cuda.to_device(h)
    assert (d.copy_to_host() == h).all(), n
    del d
gc.collect()
arrays = [cuda.device_array(int(s), np.uint8) for s in rng.integers(1, 1 << 22, 300)]
ptrs = sorted((a.__cuda_array_interface__["data"][0], a.nbytes) for a in arrays)
assert all(p0 + n0 <= p1 for (p0, n0), (p1, _) in zip(ptrs, ptrs[1:])), "overlap"
s = emmpool.stats(0)
assert s["by_library"]["numba"]["bytes_in_use"] >= sum(a.nbytes for a in arrays)
del arrays; gc.collect()
assert emmpool.stats(0)["bytes_in_use"] == 0, emmpool.stats(0)
info = cuda.current_context().get_memory_info()
assert 0 < info.free <= info.total, info
assert type(info).__name__ == "MemoryInfo"
print("OK")
"""

# View(ptr, n, typestr): a foreign array, memory the pool did not allocate, known to Numba
# only by the CUDA Array Interface.
FOREIGN_ARRAY = r"""
class View:
    def __init__(self, ptr, n, typestr):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": typestr,
                                         "version": 3}
"""

# The start of every IPC scenario: run_consumer(target, *args) runs target(*args, q) in a
# spawned process and returns what it put on q (a consumer that dies without a result fails at
# once, not after the timeout); read_handles is the consumer that copies back each handle's data.
SPAWNED_CONSUMER = IMPORT_CUDA + r"""
import multiprocessing as mp, pickle, queue, time

def run_consumer(target, *args, timeout=120):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    end = time.monotonic() + timeout
    while True:
        try:
            got = q.get(timeout=1)
            break
        except queue.Empty:
            if p.exitcode is not None:
                raise AssertionError(f"consumer exited {p.exitcode} without a result")
            if time.monotonic() > end:
                raise AssertionError("no result from the consumer")
    p.join(60)
    assert p.exitcode == 0, p.exitcode
    return got

def read_handles(payload, q):
    out = []
    for ph in pickle.loads(payload):
        with ph as d:
            out.append(d.copy_to_host())
    q.put(out)
"""

IPC_PRODUCER = SPAWNED_CONSUMER + r"""
import numpy as np

if __name__ == "__main__":
    pad = cuda.device_array(12345, np.uint8)          # so that blocks start inside a segment
    a = cuda.to_device(np.arange(100_000, dtype=np.float64))
    b = cuda.to_device(np.arange(5000, dtype=np.int32) * 7)  # same segment as a
    sl = a[1000:2000]
    handles = [a.get_ipc_handle(), sl.get_ipc_handle(), b.get_ipc_handle()]
    import os
    offsets = [h._ipc_handle.offset for h in handles]
    assert offsets[1] == offsets[0] + 1000 * 8, offsets
    if os.environ["EMMPOOL_MODE"] == "pool":
        assert offsets[2] != 0, offsets         # b lies inside a pooled segment
    else:
        assert offsets[0] == offsets[2] == 0, offsets  # passthrough: own segments
    got = run_consumer(read_handles, pickle.dumps(handles))
    assert (got[0] == a.copy_to_host()).all()
    assert (got[1] == sl.copy_to_host()).all()
    assert (got[2] == b.copy_to_host()).all()
    print("OK")
"""

# Two arrays from one pooled segment, both open at once in the consumer: their handles name the
# same segment, which the consumer maps once per open.
IPC_SAME_SEGMENT_OPEN_TOGETHER = SPAWNED_CONSUMER + r"""
import numpy as np

def consume(payload, q):
    ha, hb = pickle.loads(payload)
    try:
        with ha as a, hb as b:
            q.put(("ok", a.copy_to_host(), b.copy_to_host()))
    except Exception as e:
        q.put(("error", f"{type(e).__name__}: {e}", None))

if __name__ == "__main__":
    a = cuda.to_device(np.arange(4096, dtype=np.int64))
    b = cuda.to_device(np.arange(4096, dtype=np.int64) * 3)
    ha, hb = a.get_ipc_handle(), b.get_ipc_handle()
    status, ga, gb = run_consumer(consume, pickle.dumps((ha, hb)))
    print("consumer:", status, ga if status == "error" else "")
    assert status == "ok", ga
    assert (ga == a.copy_to_host()).all() and (gb == b.copy_to_host()).all()
    print("OK")
"""

# Memory the pool did not allocate, seen by Numba through the CUDA Array Interface: a view at a
# nonzero offset into a raw cuMemAlloc allocation, and (where CuPy is installed) an array from
# CuPy's own pool, itself a block inside one of CuPy's segments. Their handles are Numba's own
# (the whole driver allocation, with the view's offset in it); the consumer reads the right data.
IPC_FOREIGN = SPAWNED_CONSUMER + FOREIGN_ARRAY + r"""
import importlib.util, numpy as np
from cuda.bindings import driver as drv

if __name__ == "__main__":
    cuda.current_context()                          # Numba's (primary) context is current
    err, raw = drv.cuMemAlloc(1 << 20)
    assert err == drv.CUresult.CUDA_SUCCESS, err
    n = 10_000
    view = cuda.as_cuda_array(View(int(raw) + 4096, n, "<i8"))
    view.copy_to_device(np.arange(n, dtype=np.int64) * 5)
    pool = cuda.current_context().memory_manager.pool
    assert not pool.owns(int(raw) + 4096)
    handles = [view.get_ipc_handle()]
    expected = [np.arange(n, dtype=np.int64) * 5]
    assert handles[0]._ipc_handle.offset == 4096, handles[0]._ipc_handle.offset
    if importlib.util.find_spec("cupy") is not None:
        import cupy                                  # CuPy's own pool, not emmpool's
        pad = cupy.empty(1000, dtype=cupy.uint8)
        c = cupy.arange(n, dtype=cupy.int64) * 3
        handles.append(cuda.as_cuda_array(c).get_ipc_handle())
        expected.append(cupy.asnumpy(c))
    got = run_consumer(read_handles, pickle.dumps(handles))
    for g, e in zip(got, expected):
        assert (g == e).all()
    del view
    drv.cuMemFree(raw)
    print(f"foreign handles: {len(handles)}")
    print("OK")
"""

# Numba's device_memory_size / device_extents: the array's block, not the segment its
# neighbours share. Numba's own test_host_alloc_pinned zeroes device_memory_size(a) bytes from a.
DEVICE_MEMORY_SIZE = IMPORT_CUDA + FOREIGN_ARRAY + r"""
import numpy as np
from cuda.bindings import driver as drv
driver = cuda.cudadrv.driver

before = cuda.to_device(np.full(1000, 5, np.uint8))
a = cuda.device_array(1000, np.uint8)            # in pool mode, between two neighbours
after = cuda.to_device(np.full(1000, 7, np.uint8))
ptr = a.__cuda_array_interface__["data"][0]
size = driver.device_memory_size(a)
assert 1000 <= size <= 1024, size
assert driver.device_extents(a) == (ptr, ptr + size), (driver.device_extents(a), ptr, size)
assert driver.device_extents(a[100:]) == (ptr, ptr + size)
driver.device_memset(a, 0, size)
cuda.synchronize()
assert (a.copy_to_host() == 0).all()
assert (before.copy_to_host() == 5).all() and (after.copy_to_host() == 7).all(), "neighbours"
err, raw = drv.cuMemAlloc(1 << 20)                 # memory the pool did not allocate
assert err == drv.CUresult.CUDA_SUCCESS, err
foreign = cuda.as_cuda_array(View(int(raw) + 4096, 100, "|u1"))
err, base, n = drv.cuMemGetAddressRange(raw)
assert err == drv.CUresult.CUDA_SUCCESS, err
assert driver.device_extents(foreign) == (int(base), int(base) + n), driver.device_extents(foreign)
del foreign
drv.cuMemFree(raw)
print("OK")
"""

RESET_WITH_LIVE_ARRAYS = IMPORT_CUDA + r"""
import gc, numpy as np
import emmpool
keep = cuda.to_device(np.arange(1000, dtype=np.float32))
old = [cuda.device_array(1 << 16, np.uint8) for _ in range(10)]
cuda.current_context().reset()              # a context reset with arrays alive
assert (keep.copy_to_host() == np.arange(1000, dtype=np.float32)).all()
new = [cuda.to_device(np.full(1 << 16, i, np.uint8)) for i in range(10)]
del old; gc.collect()                        # pre-reset finalizers run after the reset
for i, a in enumerate(new):
    assert (a.copy_to_host() == i).all()
dangling = cuda.device_array(1 << 20, np.uint8)
cuda.close()                                 # a device reset, with `dangling` alive
x = cuda.to_device(np.arange(10))
assert (x.copy_to_host() == np.arange(10)).all()
del dangling, keep, new; gc.collect()       # finalizers of the old context: harmless
y = cuda.to_device(np.arange(20))
assert (x.copy_to_host() == np.arange(10)).all() and (y.copy_to_host() == np.arange(20)).all()
live_at_exit = cuda.device_array(1 << 20)   # and one left alive at interpreter exit
print("OK")
"""

DEFER_CLEANUP = IMPORT_CUDA + r"""
import gc, numpy as np
import emmpool
cuda.device_array(1)  # create the pool
pool = cuda.current_context().memory_manager.pool
with cuda.defer_cleanup():
    before = pool.stats()["segment_releases"]
    for i in range(50):
        a = cuda.to_device(np.full(1 << 20, i, np.uint8))
        assert (a.copy_to_host() == i).all()
        del a
    assert pool.trim() == 0, "nothing may be returned to the driver while cleanup is deferred"
    assert pool.stats()["segment_releases"] == before
assert pool.trim() > 0
print("OK")
"""

# A kernel on stream A reads `a` long after `a` is freed; meanwhile a same-sized array is
# allocated and overwritten on stream B. With a pool that reuses at once, B's write lands in
# A's input before A reads it.
CROSS_STREAM = IMPORT_CUDA + r"""
import gc, sys, numpy as np
if len(sys.argv) > 1 and sys.argv[1] == "naive":
    sys.path.insert(0, sys.argv[2])
    import naive_pool
    cuda.set_memory_manager(naive_pool.NaivePool)

@cuda.jit
def slow_sum(a, out, delay_us):
    # One thread sleeps first, then sums: the read happens well after the host frees `a`.
    for _ in range(delay_us):
        cuda.nanosleep(1000)
    s = 0.0
    for i in range(a.size):
        s += a[i]
    out[0] = s

@cuda.jit
def fill(b, value):
    i = cuda.grid(1)
    if i < b.size:
        b[i] = value

n = 1 << 16
sA, sB = cuda.stream(), cuda.stream()
host = np.ones(n)
out = cuda.device_array(1)
slow_sum[1, 1](cuda.to_device(host), out, 1, )  # compile
fill[1, 32](cuda.device_array(32), 0.0)
cuda.synchronize()
a = cuda.to_device(host, stream=sA)
a_ptr = a.__cuda_array_interface__["data"][0]
slow_sum[1, 1, sA](a, out, 200_000)   # ~0.2 s before it reads `a`
del a; gc.collect()                    # freed while the kernel is queued/running
b = cuda.device_array(n, dtype=np.float64)
fill[(n + 255) // 256, 256, sB](b, -1.0)
same = b.__cuda_array_interface__["data"][0] == a_ptr
sB.synchronize(); sA.synchronize()
result = out.copy_to_host()[0]
print("reused-address" if same else "fresh-address", result)
print("OK" if result == n else "CORRUPTED")
"""

OUT_OF_MEMORY = IMPORT_CUDA + r"""
import numpy as np
import emmpool
CudaAPIError = cuda.cudadrv.driver.CudaAPIError
total = cuda.current_context().get_memory_info().total
try:
    cuda.device_array(2 * total, np.uint8)
except CudaAPIError as e:
    assert e.code == 2, e.code
    assert "holds" in str(e), str(e)
else:
    raise AssertionError("no out-of-memory error")
a = cuda.to_device(np.arange(1000))
assert (a.copy_to_host() == np.arange(1000)).all()
print("OK")
"""

PASSTHROUGH_ONE_SEGMENT_EACH = IMPORT_CUDA + r"""
import numpy as np
driver = cuda.cudadrv.driver
arrays = [cuda.device_array(n, np.uint8) for n in (1000, 4096, 12345, 1 << 20)]
for a in arrays:
    base, end = driver.device_extents(a.gpu_data)
    assert base == a.__cuda_array_interface__["data"][0], "block does not start its segment"
print("OK")
"""

if __name__ == "__main__":  # pragma: no cover - manual use
    exec(globals()[sys.argv[1]])

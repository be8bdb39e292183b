"""emmpool and RMM in one process (GPU; skipped, with the reason, where RMM or a GPU is absent).

Two ways an application that already uses RMM can combine the two (README, "RMM"): side by side,
each with its own pool and budget; or RMM allocating from emmpool (emmpool.use_for_rmm()).
"""

from __future__ import annotations

import pytest

from tests.conftest import requires
from tests.test_gpu_numba import check, run

pytestmark = [
    pytest.mark.gpu,
    requires("rmm"),
    pytest.mark.rmm,
]

# RMM with its own pool (as RAPIDS sets it up), Numba through emmpool; arrays of each are used
# by the other through the CUDA Array Interface; each pool counts only its own memory; both give
# everything back.
SIDE_BY_SIDE = r"""
import gc, numpy as np, rmm
from numba import cuda
import emmpool
emmpool.use_for_numba()
rmm.reinitialize(pool_allocator=True, initial_pool_size=1 << 30, maximum_pool_size=4 << 30)
stats = rmm.mr.StatisticsResourceAdaptor(rmm.mr.get_current_device_resource())
rmm.mr.set_current_device_resource(stats)
try:                                   # RMM's own pool, chosen by the program, stays
    emmpool.use_for_rmm()
except emmpool.AllocatorConflictError as e:
    assert "RMM's resource for device 0 is " in str(e) and "StatisticsResourceAdaptor" in str(e), e
else:
    raise AssertionError("RMM's own resource was replaced")
assert rmm.mr.get_current_device_resource() is stats

@cuda.jit
def add(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] + b[i]

n = 1 << 20
buf = rmm.DeviceBuffer.to_device(np.arange(n, dtype=np.float64).tobytes())   # RMM memory
a = cuda.as_cuda_array(buf).view(np.float64)
b = cuda.to_device(np.ones(n))                                           # emmpool memory
out = rmm.DeviceBuffer(size=8 * n)
add[(n + 255) // 256, 256](a, b, cuda.as_cuda_array(out).view(np.float64))
got = np.frombuffer(out.copy_to_host(), dtype=np.float64)
assert (got == np.arange(n) + 1).all()
assert stats.allocation_counts.current_bytes >= 16 * n
s = emmpool.stats(0)
assert s["by_library"]["numba"]["bytes_in_use"] == 8 * n, s          # RMM's buffers are not ours
assert s["by_library"]["rmm"]["allocations"] == 0, s
del a, b, buf, out; gc.collect()
assert emmpool.stats(0)["bytes_in_use"] == 0
assert stats.allocation_counts.current_bytes == 0
print("OK")
"""

# RMM allocating from emmpool's pool: one pool for RMM, Numba (and CuPy/PyTorch) alike.
RMM_ON_EMMPOOL = r"""
import gc, numpy as np, rmm
from numba import cuda
import emmpool
emmpool.use_for_numba()
done = emmpool.use_for_rmm()           # RMM's default resource: taken over, on every device
assert done.library == "rmm" and done.how == emmpool.hooks.rmm_resource_kind(), done
assert rmm.mr.get_current_device_resource() is done.allocators[0] is emmpool.rmm_resource()
assert emmpool.use_for_rmm() == done
n = 1 << 20
bufs = [rmm.DeviceBuffer.to_device(np.full(n, i, np.uint8).tobytes()) for i in range(8)]
s = emmpool.stats(0)["by_library"]["rmm"]
assert s["allocations"] == 8 and s["bytes_in_use"] == 8 * n, s
x = cuda.to_device(np.arange(1000))
for i, b in enumerate(bufs):
    assert (np.frombuffer(b.copy_to_host(), np.uint8) == i).all()
stream = rmm.pylibrmm.stream.Stream()                       # a stream of RMM's own
for _ in range(100):
    t = rmm.DeviceBuffer(size=n, stream=stream); del t
s = emmpool.stats(0)
assert s["same_stream_reuses"] >= 99, s                    # stream order, as RMM's own pools
del bufs, b, x; gc.collect(); stream.synchronize()
assert emmpool.stats(0)["bytes_in_use"] == 0, emmpool.stats(0)
print("OK")
"""


def test_rmm_pool_and_emmpool_side_by_side():
    check(run(SIDE_BY_SIDE, manager=None))


def test_rmm_allocating_from_emmpool():
    check(run(RMM_ON_EMMPOOL, manager=None))


# RMM's C++ callers on emmpool's native resource, as libcudf's threads: 8 threads, each with a
# stream of its own, making rmm::device_buffers through the device's resource while the main
# thread holds the GIL (benchmarks/rmm_threads.cpp); RMM's logging adaptor on top of it.
NATIVE_FROM_CPP_THREADS = r"""
import os, sys, tempfile
import rmm, rmm.mr
import emmpool
sys.path.insert(0, sys.argv[1])
import rmm_threads
done = emmpool.use_for_rmm()
assert done.how == "native resource", done
with tempfile.TemporaryDirectory() as tmp:
    f = rmm_threads.load(tmp, hold_gil=True)
    rmm_threads.run(f, device=0, threads=8, iterations=2000, bytes=4096, buffers=True)
    s = emmpool.stats(0)["by_library"]["rmm"]
    assert s == {"bytes_in_use": 0, "allocations": 16000}, s
    path = os.path.join(tmp, "rmm.csv")
    log = rmm.mr.LoggingResourceAdaptor(done.allocators[0], log_file_name=path)
    b = rmm.DeviceBuffer(size=1 << 20, mr=log)
    del b
    log.flush()
    text = open(log.get_file_name()).read()
    assert "allocate" in text and "free" in text, text
print("OK")
"""


def test_rmms_cpp_threads_and_adaptors_on_the_native_resource():
    from tests.conftest import ROOT, benchmark_module

    benchmark_module("rmm_threads")  # skips where benchmarks/ is not shipped
    check(run(NATIVE_FROM_CPP_THREADS, str(ROOT / "benchmarks"), manager=None))

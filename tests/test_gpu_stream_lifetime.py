"""Streams that die before their blocks do, on a real GPU (skipped where there is none).

Programs that are correct with CuPy's and PyTorch's own pools must be correct with emmpool:
CuPy destroys a Stream when its Python object dies, often before the arrays made on it are
freed, and torch.cuda.ExternalStream can outlive its stream. A fence recorded on such a handle
later would be cuEventRecord on a destroyed stream (SIGSEGV); emmpool records none. See
reuse_rule.hpp, "stream lifetime". The CPU tests (test_stream_lifetime.py) prove the same over the host driver,
which fails on any use of a dead stream.
"""

from __future__ import annotations

import pytest

from tests.conftest import requires
from tests.test_gpu_numba import check, run

pytestmark = pytest.mark.gpu

needs_cupy = requires("cupy")
needs_cupy_torch = requires("cupy", "torch")

# CuPy's usual pattern: the Stream dies first, then the array; later
# allocations miss the free lists (where the pool fences what was freed).
ISSUE_PATTERN = r"""
import gc, cupy, emmpool
emmpool.use_for_cupy()
def work():
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        b = cupy.empty(1 << 16, dtype=cupy.float32); b.fill(2.0)
        assert float(b.sum()) == 2.0 * (1 << 16)
for _ in range(200):
    work(); work()
    big = [cupy.empty(n, dtype=cupy.uint8) for n in (3 << 20, 30 << 20, 100 << 20)]
    del big
gc.collect()
emmpool.trim()
print(emmpool.stats(0)["dormant_fences"], "dormant fences")
print("OK")
"""

# 1,000 CuPy streams (blocking and non-blocking), each dropped while the arrays it filled live
# on; Numba and PyTorch allocate from the same pool all along. A slow kernel on a dropped
# non-blocking stream still writes a freed block while the other libraries allocate: that block
# must not be handed to them before the kernel is done (their data would be overwritten).
THOUSAND_STREAMS = r"""
import gc, numpy as np, cupy, torch
from numba import cuda
import emmpool
emmpool.use_for_torch(); emmpool.use_for_cupy(); emmpool.use_for_numba()

late_write = cupy.RawKernel(r'''
extern "C" __global__ void late_write(double* a, long long n, double v, int delay_us) {
    if (threadIdx.x == 0) { for (int i = 0; i < delay_us; ++i) __nanosleep(1000); }
    __syncthreads();
    for (long long i = threadIdx.x; i < n; i += blockDim.x) a[i] = v;
}''', "late_write")

@cuda.jit
def fill(a, v):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = v

rng = np.random.default_rng(0)
kept = []          # (array, expected value): CuPy arrays outliving their streams, and others
torch_side = torch.cuda.Stream()
corrupted = 0
for i in range(1000):
    s = cupy.cuda.Stream(non_blocking=bool(i % 2))
    n = int(rng.integers(1, 1 << 17))
    with s:
        a = cupy.empty(n); a.fill(float(i))
        if i % 100 == 7:
            # Freed while a slow kernel on this dropped stream still writes it.
            doomed = cupy.empty(1 << 20)
            late_write((1,), (256,), (doomed, cupy.int64(1 << 20), cupy.float64(-1.0),
                                      cupy.int32(200_000)))
            del doomed
    kept.append((a, float(i)))
    del s, a                                     # the stream dies first
    if i % 100 == 7:
        # Other libraries' streams now ask for memory of that size, while the kernel waits.
        with torch.cuda.stream(torch_side):
            t = torch.full((1 << 20,), 7.0, dtype=torch.float64, device="cuda")
        nb = cuda.device_array(1 << 20); fill[(1 << 20) // 256, 256](nb, 9.0)
        cuda.synchronize(); torch.cuda.synchronize()
        corrupted += int((t != 7.0).sum()) + int((nb.copy_to_host() != 9.0).sum())
        del t, nb
    if i % 3 == 0:                               # churn that misses now and then
        x = torch.empty(int(rng.integers(1, 1 << 22)), device="cuda")
        y = cuda.device_array(int(rng.integers(1, 1 << 20)))
        kept.append((y, None)); del x
    if len(kept) > 200:                          # old arrays die in arrival order
        arr, v = kept.pop(0)
        if v is not None:
            corrupted += int((arr != v).sum())
        del arr
    if i % 250 == 0:
        gc.collect()
cupy.cuda.Device().synchronize()
for arr, v in kept:
    if v is not None:
        corrupted += int((arr != v).sum())
del kept, arr
gc.collect()
s = emmpool.stats(0)
print("corrupted elements:", corrupted, "| dormant fences:", s["dormant_fences"],
      "| same-stream reuses:", s["same_stream_reuses"])
assert corrupted == 0
emmpool.trim()
s = emmpool.stats(0)
assert s["by_library"]["cupy"]["bytes_in_use"] == 0, s
print("OK")
"""

# torch.cuda.ExternalStream over a stream that its owner destroys before the tensors die:
# PyTorch's free then passes the dead handle. (gc.freeze() here and in NUMBA_RECORD_STREAM: a
# gc.collect() over the imported libraries took ~70-100 ms, 300 of them most of the 30-50 s
# each of these scenarios took on one H100.)
TORCH_EXTERNAL_STREAM = r"""
import gc, cupy, torch, emmpool
emmpool.use_for_torch()
torch.zeros(1, device="cuda")
gc.collect(); gc.freeze()  # the loop's gc.collect() then scans what the loop made alone
for i in range(300):
    owner = cupy.cuda.Stream(non_blocking=True)
    ext = torch.cuda.ExternalStream(owner.ptr)
    with torch.cuda.stream(ext):
        t = torch.full((1 << (10 + i % 12),), float(i), device="cuda")
        assert float(t[-1]) == float(i)
    owner.synchronize()
    del ext, owner                  # the stream is destroyed here ...
    gc.collect()
    big = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")  # a miss: the pool fences
    del t, big                      # ... the tensor is freed after
torch.cuda.synchronize()
emmpool.trim()
print("OK")
"""

# Numba's record_stream: the stream must live until the free, then may die at once.
NUMBA_RECORD_STREAM = r"""
import gc, numpy as np
from numba import cuda
import emmpool
emmpool.use_for_numba()
@cuda.jit
def fill(a, v):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = v
fill[1, 1](cuda.device_array(1), 0.0)
gc.collect(); gc.freeze()  # the loop's gc.collect() then scans what the loop made alone
bad = 0
for i in range(300):
    s = cuda.stream()                # Numba's streams are ordinary (blocking) streams
    a = cuda.device_array(1 << 16)
    fill[64, 1024, s](a, float(i))
    emmpool.record_stream(a.__cuda_array_interface__["data"][0], int(s.handle))
    host = a.copy_to_host(stream=s)
    s.synchronize()
    bad += int((host != i).sum())
    del a                            # freed: the fence on s is recorded now ...
    gc.collect()
    del s                            # ... and s is destroyed right after
    gc.collect()
    x = cuda.device_array(int(3 << 20) + i)   # misses
    del x
assert bad == 0
print("OK")
"""


@needs_cupy
@pytest.mark.cupy
@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_cupy_stream_dies_before_its_array(mode):
    check(run(ISSUE_PATTERN, mode=mode, manager=None))


@needs_cupy_torch
@pytest.mark.cupy
@pytest.mark.torch
@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_thousand_dropped_cupy_streams_with_numba_and_torch(mode):
    p = run(THOUSAND_STREAMS, mode=mode, manager=None)
    check(p)
    assert "corrupted elements: 0 " in p.stdout, p.stdout


@needs_cupy_torch
@pytest.mark.cupy
@pytest.mark.torch
@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_torch_external_stream_dies_before_its_tensor(mode):
    check(run(TORCH_EXTERNAL_STREAM, mode=mode, manager=None))


@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_numba_record_stream_then_the_stream_dies(mode):
    check(run(NUMBA_RECORD_STREAM, mode=mode, manager=None))

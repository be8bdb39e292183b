"""Pinned and mapped host memory through emmpool's pinned cache (EMMPOOL_PINNED=pool) on a real
GPU; skipped, with the reason, where there is none."""

from __future__ import annotations

import pytest

from tests.test_gpu_numba import check, run

pytestmark = pytest.mark.gpu

PINNED_AND_MAPPED = r"""
import gc, numpy as np
from numba import cuda
import emmpool

@cuda.jit
def add_one(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] += 1

for n in (1, 4096, 1 << 20, 64 << 20):
    h = cuda.pinned_array(n, dtype=np.uint8)
    h[:] = 7
    d = cuda.to_device(h)
    back = cuda.pinned_array(n, dtype=np.uint8)
    d.copy_to_host(back)
    assert (back == 7).all()
m = cuda.mapped_array(1000, dtype=np.int64)
m[:] = np.arange(1000)
add_one[4, 256](m)
cuda.synchronize()
assert (m == np.arange(1, 1001)).all()
buf = np.zeros(1 << 16, dtype=np.uint8)
with cuda.pinned(buf):
    cuda.to_device(np.ones(1 << 16, np.uint8)).copy_to_host(buf)
with cuda.pinned(buf):  # the same memory pinned again at once
    pass
assert buf.all()
with cuda.mapped(buf) as mb:
    add_one[256, 256](mb)
    cuda.synchronize()
assert (buf == 2).all()
del h, back, d, m, mb; gc.collect()
s = emmpool._core.pinned_pool(0).stats()

def still_alive():  # what keeps pinned memory in use, should the check below fail
    from numba.cuda.cudadrv.driver import MappedMemory, PinnedMemory
    import sys, types
    def name(r):
        if isinstance(r, types.FrameType):
            return f"frame {r.f_code.co_name} {r.f_code.co_filename}:{r.f_lineno}"
        return type(r).__name__
    def holders(o, depth, seen):  # referrer chains up to `depth`, this function's own left out
        if depth == 0:
            return []
        out = []
        for r in gc.get_referrers(o):
            if id(r) in seen or r is sys._getframe() or type(r) is list and len(r) > 1000:
                continue
            seen.add(id(r))
            out.append((name(r), holders(r, depth - 1, seen)))
        return out
    # type(), not isinstance(): a weak proxy whose object died raises on isinstance()
    live = [o for o in gc.get_objects() if type(o) in (MappedMemory, PinnedMemory)]
    return [(type(o).__name__, o.size, o.refct, holders(o, 4, {id(live)})) for o in live]

# Everything freed is back in the cache, but what Numba still references: under
# compute-sanitizer (only there) Numba keeps the mapped array's MappedMemory referenced after
# `del` + collect (referenced from a closure of Numba's, refct 1), and its block is rightly
# still in use. Any byte in use beyond what Numba references would be emmpool's leak.
alive = still_alive()
held = sum(emmpool._core.HostPool.size_class(size) for _, size, refct, _ in alive if refct > 0)
assert s["bytes_registered"] == 0 and s["bytes_in_use"] == held, (s, alive)
if alive:
    print("still referenced by Numba, so still in use:", alive)
for _ in range(100):
    x = cuda.pinned_array(1 << 20, dtype=np.uint8); del x
s = emmpool._core.pinned_pool(0).stats()
assert s["cache_hits"] >= 90, s   # steady state: no cuMemHostAlloc per array
print("OK")
"""

# A device-to-host copy into a pinned buffer is queued behind a slow kernel; the buffer is freed
# meanwhile. A new buffer of the same size must not be that one until the copy has completed.
FREED_DURING_ASYNC_COPY = r"""
import gc, numpy as np
from numba import cuda

@cuda.jit
def slow(x, delay_us):
    for _ in range(delay_us):
        cuda.nanosleep(1000)
    x[0] = 1

n = 1 << 22
s = cuda.stream()
d = cuda.to_device(np.full(n, 5, np.uint8))
flag = cuda.device_array(1)
slow[1, 1](flag, 1); cuda.synchronize()
h = cuda.pinned_array(n, dtype=np.uint8)
addr = h.ctypes.data
slow[1, 1, s](flag, 200_000)          # ~0.2 s
d.copy_to_host(h, stream=s)           # writes h when the kernel is done
del h; gc.collect()                   # freed while the copy is pending
h2 = cuda.pinned_array(n, dtype=np.uint8)
assert h2.ctypes.data != addr, "a pinned buffer was reused while a copy into it was pending"
h2[:] = 9
s.synchronize()
assert (h2 == 9).all(), "the pending copy wrote into the new buffer"
print("OK")
"""


@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_pinned_and_mapped_memory_through_the_pinned_cache(mode, monkeypatch):
    monkeypatch.setenv("EMMPOOL_PINNED", "pool")
    check(run(PINNED_AND_MAPPED, mode=mode))


def test_pinned_block_not_reused_during_async_copy(monkeypatch):
    monkeypatch.setenv("EMMPOOL_PINNED", "pool")
    check(run(FREED_DURING_ASYNC_COPY))

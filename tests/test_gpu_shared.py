"""CuPy, PyTorch and Numba drawing from one emmpool pool (GPU; skipped where absent)."""

from __future__ import annotations

import pytest

from tests.conftest import requires
from tests.test_gpu_numba import check, run

pytestmark = [pytest.mark.gpu, pytest.mark.cupy]

needs_cupy_torch = requires("cupy", "torch")

# Each library in turn takes 60% of the device in 1 GiB arrays, then drops them. With each
# library's own pool the memory stays cached by the first, and the second runs out.
THREE_PHASES = r"""
import gc, sys
shared = sys.argv[1] == "shared"
import cupy, torch
from numba import cuda
if shared:
    import emmpool
    emmpool.use_for_torch(); emmpool.use_for_cupy(); emmpool.use_for_numba()
GiB = 1 << 30
total = cuda.current_context().get_memory_info().total
n = int(0.6 * total) // GiB
def phase(name, make):
    try:
        arrays = [make() for _ in range(n)]
    except Exception as e:
        print(f"{name}: OUT OF MEMORY ({type(e).__name__})")
        return False
    del arrays; gc.collect()
    return True
ok = phase("cupy", lambda: cupy.empty(GiB, dtype=cupy.uint8))
ok = ok and phase("torch", lambda: torch.empty(GiB, dtype=torch.uint8, device="cuda"))
ok = ok and phase("numba", lambda: cuda.device_array(GiB, dtype="u1"))
if shared:
    s = emmpool.stats(0)
    assert s["by_library"]["cupy"]["allocations"] == n, s
    assert s["by_library"]["torch"]["allocations"] >= n, s
    assert s["by_library"]["numba"]["allocations"] >= n, s
    assert s["bytes_in_use"] == 0, s
    assert s["peak_bytes_reserved"] < 0.7 * total, s
print("ALL PHASES FIT" if ok else "FAILED")
print("OK")
"""

INTERLEAVED = r"""
import gc, numpy as np, cupy, torch
from numba import cuda
import emmpool
emmpool.use_for_torch(); emmpool.use_for_cupy(); emmpool.use_for_numba()

@cuda.jit
def add(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] + b[i]

rng = np.random.default_rng(0)
for it in range(50):
    n = int(rng.integers(1, 1 << 20))
    h1, h2 = rng.random(n), rng.random(n)
    c = cupy.asarray(h1)                                  # CuPy memory
    t = torch.as_tensor(h2, device="cuda")                # PyTorch memory
    nb = cuda.device_array(n)                             # Numba memory
    add[(n + 255) // 256, 256](cuda.as_cuda_array(c), cuda.as_cuda_array(t), nb)
    back = torch.from_dlpack(cupy.asarray(nb))            # Numba -> CuPy (CAI) -> torch (DLPack)
    assert np.allclose(back.cpu().numpy(), h1 + h2)
    s = emmpool.stats(0)["by_library"]
    assert s["cupy"]["bytes_in_use"] >= 8 * n and s["torch"]["bytes_in_use"] >= 8 * n, s
    del c, t, nb, back
gc.collect(); torch.cuda.synchronize()
s = emmpool.stats(0)
assert s["by_library"]["numba"]["bytes_in_use"] == 0 and s["by_library"]["cupy"]["bytes_in_use"] == 0, s
print("OK")
"""


# CuPy's memory belongs to CuPy's current stream, as in CuPy's own pool: a block freed on a
# non-blocking stream A while a kernel on A still reads it is not given to stream B before that
# kernel is done; on the stream that freed it, a block is reused at once (stream order).
CUPY_STREAMS = r"""
import cupy, numpy as np
import emmpool
emmpool.use_for_cupy()
slow_sum = cupy.RawKernel('''
extern "C" __global__ void slow_sum(const double* a, double* out, long long n, int delay_us) {
    for (int i = 0; i < delay_us; ++i) __nanosleep(1000);
    double s = 0;
    for (long long i = 0; i < n; ++i) s += a[i];
    out[0] = s;
}''', "slow_sum")
n = 8 << 20                                   # 64 MiB: a segment of its own
A = cupy.cuda.Stream(non_blocking=True)
B = cupy.cuda.Stream(non_blocking=True)
out = cupy.zeros(1)
with A:
    a = cupy.ones(n)
    slow_sum((1,), (1,), (a, out, cupy.int64(n), cupy.int32(1)))
    A.synchronize()                           # compiled and warm
    slow_sum((1,), (1,), (a, out, cupy.int64(n), cupy.int32(300_000)))  # ~0.3 s before it reads
    a_ptr = a.data.ptr
    del a                                     # freed while the kernel waits
with B:
    b = cupy.empty(n)
    b.fill(-1.0)
assert b.data.ptr != a_ptr, "a block was reused on another stream while a kernel still read it"
B.synchronize(); A.synchronize()
assert float(out[0]) == n, float(out[0])
with A:                                       # same stream: straight back, in stream order
    c = cupy.empty(n); c_ptr = c.data.ptr; del c
    d = cupy.empty(n)
    assert d.data.ptr == c_ptr
before = emmpool.stats(0)["same_stream_reuses"]
for _ in range(1000):
    x = cupy.empty(1 << 20); del x
assert emmpool.stats(0)["same_stream_reuses"] - before >= 999, emmpool.stats(0)
try:                                          # more than the device: CuPy's own error
    cupy.empty(1 << 50, dtype=cupy.uint8)
except cupy.cuda.memory.OutOfMemoryError as e:
    assert "1,125,899,906,842,624 bytes" in str(e), str(e)
else:
    raise AssertionError("no OutOfMemoryError")
assert emmpool.stats(0)["out_of_memory"] >= 1
assert float(cupy.ones(1000).sum()) == 1000.0  # and the pool still serves
print("OK")
"""


# CuPy allocates holding the GIL. An allocation that must wait for the GPU (no room under the
# cap but a pending free) while the GPU waits for a host callback, which needs the GIL, must let
# go of it: holding it, the three wait for each other forever.
CUPY_HOST_CALLBACK = r"""
import cupy
import emmpool
emmpool.configure(maximum_pool_size=64 << 20)
emmpool.use_for_cupy()
spin = cupy.RawKernel('''
extern "C" __global__ void spin(int ms) { for (int i = 0; i < ms; ++i) __nanosleep(1000000); }''',
                      "spin")
spin((1,), (1,), (1,))
cupy.cuda.Device().synchronize()              # compiled
ran = []
n = 48 << 20
a = cupy.empty(n, dtype=cupy.uint8)
del a                                         # pending, fenced on the null stream
S = cupy.cuda.Stream()                        # blocking: the null stream's fence waits for it
with S:
    spin((1,), (1,), (300,))                  # ~0.3 s
S.launch_host_func(ran.append, 1)             # Python: CUDA's callback thread takes the GIL
with cupy.cuda.Stream(non_blocking=True):
    b = cupy.empty(n, dtype=cupy.uint8)       # 96 MiB > the cap: waits for a's fence
assert ran == [1], ran
assert emmpool.stats(0)["peak_bytes_reserved"] <= 64 << 20
print("OK")
"""


@requires("cupy")
def test_a_cupy_allocation_waiting_for_the_gpu_lets_a_host_callback_run():
    check(run(CUPY_HOST_CALLBACK, manager=None))


@requires("cupy")
def test_cupy_memory_follows_cupys_current_stream():
    check(run(CUPY_STREAMS, manager=None))


@needs_cupy_torch
@pytest.mark.torch
def test_three_libraries_in_turn_fit_only_with_one_shared_pool():
    shared = run(THREE_PHASES, "shared", manager=None)
    check(shared)
    assert "ALL PHASES FIT" in shared.stdout, shared.stdout
    separate = run(THREE_PHASES, "separate", manager=None)
    assert separate.returncode == 0, separate.stderr
    assert "OUT OF MEMORY" in separate.stdout, separate.stdout


@needs_cupy_torch
@pytest.mark.torch
def test_arrays_of_each_library_used_by_the_others():
    check(run(INTERLEAVED, manager=None))

"""cuda.core allocations on a real GPU come from emmpool (skipped, with the reason, where there
is none).

numba-cuda allocates device memory two ways: through the EMM plugin (device arrays), and
through cuda.core's ``Device.allocate`` (host arrays copied for a kernel launch, ``cuda.In``,
``cuda.Out``, ``cuda.InOut``, records: ``devicearray._to_strided_memory_view``). Each idiom
below is listed from numba-cuda's source; the scenario checks that each one made allocations in
emmpool's pool and that the driver's own stream-ordered pool (cuda.core's default resource)
never held a byte. Run without the plugin, the same idioms do use the driver's pool: the check
can fail."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import needs
from tests.test_gpu_numba import check, run

pytestmark = pytest.mark.gpu

# The driver's pool of device 0 (what cuda.core's default DeviceMemoryResource allocates from):
# its high-water mark of bytes in use, reset at the start.
DRIVER_POOL = r"""
from cuda.bindings import driver as drv

def _ok(result):
    err, *rest = result
    assert err == drv.CUresult.CUDA_SUCCESS, err
    return rest[0] if rest else None

_attr = drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_HIGH

def driver_pool():
    return _ok(drv.cuDeviceGetMemPool(0))

def driver_pool_high():
    return int(_ok(drv.cuMemPoolGetAttribute(driver_pool(), _attr)))

def reset_driver_pool_high():
    _ok(drv.cuMemPoolSetAttribute(driver_pool(), _attr, drv.cuuint64_t(0)))
"""

NUMBA_IDIOMS = r"""
import gc, sys
import numpy as np
from numba import cuda
import emmpool
plugin = sys.argv[1] == "plugin"

@cuda.jit
def inc(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] += 1

@cuda.jit
def copy(src, dst):
    i = cuda.grid(1)
    if i < src.size:
        dst[i] = src[i]

@cuda.jit
def rec_inc(r):
    r.x += 1

cuda.current_context()  # the plugin binds here
""" + DRIVER_POOL + r"""
reset_driver_pool_high()
n = 1 << 16
h = np.arange(n, dtype=np.float64)

def host_array_argument():      # a NumPy array: an implicit InOut copy
    a = h.copy(); inc[n // 256, 256](a); assert a[7] == 8.0
def cuda_in_and_out():
    out = np.zeros(n)
    copy[n // 256, 256](cuda.In(h), cuda.Out(out)); assert (out == h).all()
def cuda_inout():
    a = h.copy(); inc[n // 256, 256](cuda.InOut(a)); assert a[0] == 1.0
def record_argument():
    rec = np.zeros(1, dtype=np.dtype([("x", np.int64), ("y", np.float64)]))[0]
    rec_inc[1, 1](rec)
def zero_size_host_array():
    inc[1, 1](np.zeros(0))
def device_array():
    d = cuda.device_array(n); d_like = cuda.device_array_like(d); del d, d_like
def to_device_and_setitem_from_host():
    d = cuda.to_device(h); d[:] = h[::-1].copy(); d[3:10] = h[:7].copy()
    assert d.copy_to_host()[3] == 0.0
def device_array_kernel_on_a_stream():
    # (a host array on a stream other than the default one numba-cuda refuses by itself:
    # "NumPy only supports stream=None", from cuda.core's StridedMemoryView)
    s = cuda.stream(); d = cuda.to_device(h, stream=s); inc[n // 256, 256, s](d)
    s.synchronize(); assert d.copy_to_host()[0] == 1.0
def reduce():
    r = cuda.reduce(lambda a, b: a + b); assert r(h) == h.sum()
def vectorize():
    from numba import vectorize
    @vectorize(["float64(float64)"], target="cuda")
    def twice(x):
        return x * 2
    assert twice(h)[5] == 10.0
def forall():
    a = h.copy(); inc.forall(n)(a); assert a[1] == 2.0

IDIOMS = [host_array_argument, cuda_in_and_out, cuda_inout, record_argument,
          zero_size_host_array, device_array, to_device_and_setitem_from_host,
          device_array_kernel_on_a_stream, reduce, vectorize, forall]
for idiom in IDIOMS:
    before = emmpool.stats(0)["allocations"] if plugin else 0
    idiom()
    cuda.synchronize(); gc.collect()
    made = emmpool.stats(0)["allocations"] - before if plugin else 0
    print(f"{idiom.__name__}: {made} emmpool allocations, driver pool high {driver_pool_high()} B")
    if plugin and idiom.__name__ != "zero_size_host_array":
        assert made > 0, idiom.__name__

high = driver_pool_high()
if plugin:
    from emmpool import cuda_core
    mr = cuda.current_context().device._dev.memory_resource
    assert isinstance(mr, cuda_core.EmmPoolMemoryResource) and mr.library == "numba", mr
    s = emmpool.stats(0)
    assert s["by_library"]["cuda_core"]["allocations"] == 0, s  # all of them counted as Numba's
    assert s["by_library"]["numba"]["bytes_in_use"] == 0, s    # and every one came back
    assert high == 0, f"the driver's pool held {high} B beside emmpool"
else:
    assert high > 0, "without the plugin, kernel-argument copies use the driver's pool"
print("OK")
"""


def test_every_numba_idiom_allocates_from_emmpool(numba_package):
    if numba_package.name != "numba-cuda":
        pytest.skip(needs("numba-cuda", "the idioms are written against its API"))
    check(run(NUMBA_IDIOMS, "plugin", package=numba_package))


def test_without_the_plugin_the_idioms_use_the_drivers_pool(numba_package):
    # The check above can fail: the same idioms, Numba's own manager.
    if numba_package.name != "numba-cuda":
        pytest.skip(needs("numba-cuda", "the idioms are written against its API"))
    check(run(NUMBA_IDIOMS, "default", manager=None, package=numba_package))


@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_numba_context_reset_leaves_cuda_core_buffers_safe(mode):
    check(run(CONTEXT_RESET, mode=mode))


CONTEXT_RESET = r"""
import gc
import numpy as np
from numba import cuda
import emmpool
from cuda.core import Stream
ctx = cuda.current_context()
dev = ctx.device._dev
s0 = Stream.from_handle(0)                    # Numba's default stream, as numba passes it
kept = dev.allocate(1 << 20, stream=s0)      # a Buffer cuda.core still holds at the reset
kept.fill(3, stream=s0); s0.sync()
cuda.close()                                  # Numba resets its context
a = cuda.to_device(np.arange(1 << 18, dtype=np.float32))  # a new context, the same pool
@cuda.jit
def inc(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] += 1
h = np.zeros(1 << 18, dtype=np.float32)
inc[(1 << 18) // 256, 256](h)                 # a kernel-argument copy after the reset
assert (h == 1).all()
kept.close()                                  # freed after the reset: matched to its retired block
del kept, a; gc.collect(); cuda.synchronize()
s = emmpool.stats(0)
assert s["bytes_in_use"] == 0, s
print("OK")
"""

DIRECT = r"""
import gc
import numpy as np
import emmpool
from cuda.core import Device
from cuda.core.utils import StridedMemoryView
from cuda.core._utils.cuda_utils import CUDAError
""" + DRIVER_POOL + r"""
installed = emmpool.use_for_cuda_core()            # every device
assert installed.devices == tuple(range(len(Device.get_all_devices()))), installed
dev = Device(0)
dev.set_current()
reset_driver_pool_high()
assert dev.memory_resource is installed.allocators[0] is emmpool.cuda_core_resource(0)
s = dev.create_stream()
a = dev.allocate(1 << 20, stream=s)
b = dev.allocate(1 << 20, stream=s)
a.fill(7, stream=s)
b.copy_from(a, stream=s)
c = b.copy_to(stream=s)                      # allocated by the buffer's resource: emmpool's
import ctypes
from cuda.core import LegacyPinnedMemoryResource
pinned = LegacyPinnedMemoryResource().allocate(1 << 20)
pinned.copy_from(c, stream=s); s.sync()
view = np.ctypeslib.as_array((ctypes.c_uint8 * (1 << 20)).from_address(int(pinned.handle)))
assert (view == 7).all()
smv = StridedMemoryView.from_buffer(c, shape=(1 << 18,), strides=None, dtype=np.dtype(np.float32))
assert smv.ptr == int(c.handle)
assert c.__dlpack_device__() == (2, 0)      # kDLCUDA, device 0
st = emmpool.stats(0)
assert st["by_library"]["cuda_core"]["bytes_in_use"] == 3 << 20, st
z = dev.allocate(0, stream=s); assert z.size == 0; z.close()
for buf in (a, b, c):
    buf.close(s)
assert emmpool.stats(0)["bytes_in_use"] == 0
try:
    dev.allocate(1 << 50, stream=s)          # a petabyte
except CUDAError as err:
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(err) and "emmpool" in str(err), err
    assert isinstance(err, MemoryError)
else:
    raise AssertionError("no out-of-memory error")
high = driver_pool_high()
assert high == 0, f"the driver's pool held {high} B"
# Into a graph being built: cuda.core's graph memory resource makes it a node of the graph.
gb = dev.create_stream().create_graph_builder().begin_building()
g = dev.allocate(4096, stream=gb)
assert not isinstance(g.memory_resource, emmpool.cuda_core.EmmPoolMemoryResource)
g.close(gb)
gb.end_building().complete()
print("OK")
"""


def test_cuda_core_used_directly_allocates_from_emmpool():
    check(run(DIRECT, manager=None))


# A stream-ordered free racing a reader: a slow kernel on s1 reads A; A is closed on s1 at
# once; s2 allocates as much and writes it. s2 must not get A before s1's reader is done.
RACE = r"""
import numpy as np
from numba import cuda
import emmpool
from cuda.core import Device
emmpool.use_for_cuda_core()
dev = Device(0); dev.set_current()
N = 1 << 20
@cuda.jit
def slow_sum(a, reps, out):
    i = cuda.grid(1)
    if i < a.size:
        acc = 0.0
        for _ in range(reps):
            acc += a[i]
        out[i] = acc
@cuda.jit
def fill(a, v):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = v
def as_array(buf, stream):
    cai = {"shape": (N,), "typestr": "<f8", "data": (int(buf.handle), False), "version": 3}
    return cuda.from_cuda_array_interface(cai, owner=buf, sync=False)
bad = 0
for trial in range(20):
    s1, s2 = dev.create_stream(), dev.create_stream()
    ns1, ns2 = cuda.external_stream(int(s1.handle)), cuda.external_stream(int(s2.handle))
    A = dev.allocate(N * 8, stream=s1)
    out = cuda.device_array(N, stream=ns1)
    fill[N // 256, 256, ns1](as_array(A, ns1), 1.0)
    slow_sum[N // 256, 256, ns1](as_array(A, ns1), 2000, out)
    A.close()                                   # in s1's order, the reader still running
    B = dev.allocate(N * 8, stream=s2)          # another stream: never A before s1's fence
    fill[N // 256, 256, ns2](as_array(B, ns2), 7.0)
    res = out.copy_to_host(stream=ns1); ns1.synchronize(); ns2.synchronize()
    bad += int((res != 2000.0).sum())
    B.close()
assert bad == 0, f"{bad} elements read another owner's data"
print("OK")
"""


def test_a_stream_ordered_free_never_races_a_reader_on_its_stream():
    check(run(RACE, manager=None))


def test_readme_cuda_core_example():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("\n### cuda.core\n", 1)[1].split("\n### ", 1)[0]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    p = run(example + "print('OK')\n", manager=None)
    check(p)
    assert p.stdout.splitlines()[0] == "1048576", p.stdout

"""Streams that die before their blocks are reclaimed: each client's pattern, over the host driver.

CuPy destroys a stream when its Python object dies, often before the arrays made on it are
freed; torch.cuda.ExternalStream and RMM streams can dangle too. emmpool must never pass such a
stream's handle to CUDA again (reuse_rule.hpp, "stream lifetime"). The host driver
raises, and counts in ``dead_stream_uses``, on any use of a destroyed stream's handle, and gives
a destroyed stream's handle to the next stream it creates, as CUDA may: every test here fails on
the first touch of a dead stream, and checks that no freed block comes back early.

The CuPy and PyTorch cases go through the very C entry points those libraries call
(``emmpool_cupy_malloc`` ...), in a subprocess whose process-wide pools run over a host driver.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from emmpool import _core
from emmpool.hooks import _rmm_callbacks

MiB = 1 << 20
CUPY, TORCH, RMM = (_core.LIBRARIES.index(n) for n in ("cupy", "torch", "rmm"))
MODES = ["pool", "passthrough"]


def make_pool(host, mode):
    return _core.DevicePool(host, 0, mode=mode)


def assert_no_dead_stream_use(host):
    assert host.stats()["dead_stream_uses"] == 0


def churn(pool, host, streams, rounds=3):
    """Allocations on the given (live) streams with misses, event completions in between:
    every chance for the pool to fence old batches. Returns the addresses handed out."""
    got = []
    for _ in range(rounds):
        for s in streams:
            ptrs = [pool.allocate(n, s, CUPY) for n in (256, 64 << 10, 3 * MiB, 24 * MiB)]
            got += ptrs
            for p in ptrs:
                pool.deallocate_tagged(p, _core.ALLOCATION_STREAM, CUPY)
        host.complete_all_events()
    return got


class FakeRmmStream:
    """What RMM passes its callbacks: an object with ``__cuda_stream__``."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tag", [CUPY, TORCH])
def test_destroyed_stream_cupy_and_torch_frees(host, mode, tag):
    # CuPy's and PyTorch's frees name the allocation's stream; that stream is gone by then.
    pool = make_pool(host, mode)
    s = host.create_stream()
    p = pool.allocate(24 * MiB, s, tag)
    host.destroy_stream(s)
    pool.deallocate_tagged(p, _core.ALLOCATION_STREAM, tag)
    live = host.create_stream()  # gets the dead stream's handle: another stream all the same
    assert live == s
    got = churn(pool, host, [_core.LEGACY_STREAM, 0, live])
    assert p not in got  # no fence could cover the dead stream's work yet
    assert_no_dead_stream_use(host)
    pool.synchronize()  # one device synchronization fences it
    assert pool.stats()["bytes_waiting"] == 0
    assert host.stats()["device_syncs"] >= 1
    if mode == "pool":
        assert pool.allocate(24 * MiB) == p
    assert_no_dead_stream_use(host)


@pytest.mark.parametrize("mode", MODES)
def test_destroyed_stream_rmm_frees(host, mode):
    # RMM names a live stream at the free, and may destroy it right after.
    pool = make_pool(host, mode)
    alloc, free = _rmm_callbacks(lambda: pool)  # the pool, asked at the first allocation
    s = FakeRmmStream(host.create_stream())
    ptrs = [alloc(n, s) for n in (1 << 10, 2 * MiB, 30 * MiB)]
    for p in ptrs:
        free(p, 0, s)
    host.destroy_stream(s.handle)
    reborn = FakeRmmStream(host.create_stream())
    assert reborn.handle == s.handle
    got = [alloc(n, reborn) for n in (1 << 10, 2 * MiB, 30 * MiB)]  # no stream order: new stream
    assert not set(got) & set(ptrs)
    assert pool.stats()["same_stream_reuses"] == 0
    for p in got:
        free(p, 0, reborn)
    pool.trim()
    assert_no_dead_stream_use(host)
    assert pool.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_destroyed_stream_after_record_stream(host, mode):
    # Numba's record_stream: the recorded stream lives until the free, then dies.
    pool = make_pool(host, mode)
    s = host.create_stream()
    p = pool.allocate(24 * MiB)
    pool.record_stream(p, s)
    records = host.stats()["event_records"]
    pool.deallocate(p)
    assert host.stats()["event_records"] == records + 1  # its fence, recorded in the free
    host.destroy_stream(s)
    got = churn(pool, host, [_core.LEGACY_STREAM], rounds=4)
    assert_no_dead_stream_use(host)
    if mode == "pool":
        assert p in got  # both fences completed: reused without a device synchronization
        assert host.stats()["device_syncs"] == 0


def test_live_stream_keeps_its_stream_order(host):
    # The fast path survives: a block freed on a live stream goes straight back to it.
    pool = make_pool(host, "pool")
    s = host.create_stream()
    p = pool.allocate(1 << 20, s, CUPY)
    for _ in range(100):
        pool.deallocate_tagged(p, _core.ALLOCATION_STREAM, CUPY)
        assert pool.allocate(1 << 20, s, CUPY) == p
    assert pool.stats()["same_stream_reuses"] == 100
    assert host.stats()["event_records"] == 0
    pool.deallocate_tagged(p, _core.ALLOCATION_STREAM, CUPY)


def test_many_dropped_streams_are_fenced_together(host):
    # 1,000 streams made and dropped, each leaving a freed block behind: the pool fences them
    # with a device synchronization now and then, never touches them, and reuses the memory.
    pool = make_pool(host, "pool")
    for _ in range(1000):
        s = host.create_stream()
        p = pool.allocate(64 << 10, s, CUPY)
        host.destroy_stream(s)
        pool.deallocate_tagged(p, _core.ALLOCATION_STREAM, CUPY)
        pool.deallocate(pool.allocate(64 << 10))  # Numba, say: a miss now and then
        host.complete_all_events()
    stats = pool.stats()
    assert 1 <= stats["dormant_fences"] <= 1000 // 32  # together, not one per stream
    assert stats["bytes_reserved"] <= 8 * MiB  # memory of dropped streams came back
    assert_no_dead_stream_use(host)


C_ENTRY_SCRIPT = textwrap.dedent(
    """
    import ctypes, sys
    import emmpool
    from emmpool import _core

    mode = sys.argv[1]
    host = _core.HostDriver(devices=1, capacity=1 << 32)
    _core._use_driver_for_all_pools(host)
    emmpool.configure(mode=mode)
    lib = ctypes.PyDLL(_core.__file__)  # PyDLL: the GIL stays held, as CuPy calls it
    cupy_malloc = lib.emmpool_cupy_malloc
    cupy_malloc.restype, cupy_malloc.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    cupy_free = lib.emmpool_cupy_free
    cupy_free.restype, cupy_free.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    torch_malloc = lib.emmpool_torch_malloc
    torch_malloc.restype, torch_malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    torch_free = lib.emmpool_torch_free
    torch_free.restype, torch_free.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

    # CuPy's current stream, as CuPy's exported get_stream_ptr(device) would say.
    current = [0]
    source = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)(lambda device: current[0])
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    _core.set_cupy_stream_source(new_capsule(ctypes.cast(source, ctypes.c_void_p), b"intptr_t (int)", None))

    def cupy_work(n):
        # The issue's pattern: `with Stream(): b = cupy.empty(n)`, the Stream dies, then b.
        s = host.create_stream()
        current[0] = s
        p = cupy_malloc(None, n, 0)
        current[0] = 0
        host.destroy_stream(s)
        cupy_free(None, p, 0)
        return p

    def torch_work(n):
        # torch.cuda.ExternalStream over a stream the user destroys before the tensor dies;
        # PyTorch passes that (dead) handle to the free.
        s = host.create_stream()
        p = torch_malloc(n, 0, s)
        host.destroy_stream(s)
        torch_free(p, n, 0, s)
        return p

    freed = set()
    for i in range(300):
        n = (256, 64 << 10, 4 << 20, 24 << 20)[i % 4]
        freed.add(cupy_work(n))
        freed.add(torch_work(n))
        # Other work on live streams (CuPy's null stream, a live torch stream), misses included.
        live = host.create_stream()
        q = torch_malloc(n, 0, live)
        r = cupy_malloc(None, n, 0)
        assert q and r, "allocation failed"
        torch_free(q, n, 0, live)
        cupy_free(None, r, 0)
        host.destroy_stream(live)
        if i % 50 == 0:
            host.complete_all_events()
    stats = emmpool.stats(0)
    assert host.stats()["dead_stream_uses"] == 0, host.stats()
    assert stats["bytes_in_use"] == 0, stats
    assert stats["by_library"]["cupy"]["allocations"] == 600
    assert stats["by_library"]["torch"]["allocations"] == 600
    emmpool.trim()
    assert emmpool.stats(0)["bytes_waiting"] == 0
    assert host.stats()["dead_stream_uses"] == 0
    print("ok", mode, stats["dormant_fences"], host.stats()["device_syncs"])
    """
)


@pytest.mark.parametrize("mode", MODES)
def test_destroyed_streams_through_the_c_entry_points(mode):
    out = subprocess.run(
        [sys.executable, "-c", C_ENTRY_SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"ok {mode}"), out.stdout + out.stderr

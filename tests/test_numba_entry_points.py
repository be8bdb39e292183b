"""The Numba plugin's hot pair in C (_core.NumbaEntryPoints and its finalizers), over the host
driver: the same blocks, generations, errors and tags as DevicePool.allocate / .deallocate."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from emmpool import _core

MiB = 1 << 20
NUMBA = _core.LIBRARIES.index("numba")


def test_allocate_returns_the_finalizer_that_frees_the_block(host):
    pool = _core.DevicePool(host, 0)
    entry = _core.NumbaEntryPoints(pool)
    free = entry.allocate(1000)
    assert isinstance(free, _core.NumbaFree)
    assert free.ptr % _core.ALIGNMENT == 0 and pool.owns(free.ptr)
    assert free.generation == pool.generation == 0
    s = pool.stats()
    assert s["by_library"]["numba"] == {"bytes_in_use": 1024, "allocations": 1}
    assert free() is None
    assert not pool.owns(free.ptr)
    assert pool.stats()["bytes_waiting"] == 1024  # fenced on the legacy stream, as Numba's frees
    host.complete_all_events()
    pool.synchronize()
    again = entry.allocate(1000)
    assert again.ptr == free.ptr
    assert free() is None  # a second call does nothing: it never frees the block now there
    assert pool.owns(again.ptr) and pool.stats()["blocks_in_use"] == 1
    with pytest.raises(TypeError):
        free(1)
    again()


def test_blocks_come_back_only_after_their_fence(host):
    pool = _core.DevicePool(host, 0)
    entry = _core.NumbaEntryPoints(pool)
    # The growable segment's peak lifted first: a request that would pass it waits for the
    # pending frees that could cover it (which then come back fenced), where this test wants
    # the miss to grow, as below the peak.
    entry.allocate(96 * MiB)()
    pool.trim()
    free = entry.allocate(24 * MiB)
    p = free.ptr
    free()
    other = entry.allocate(24 * MiB)
    assert other.ptr != p  # the free's event has not completed
    host.complete_all_events()
    again = [entry.allocate(24 * MiB) for _ in range(2)]
    assert p in [f.ptr for f in again]
    for f in (other, *again):
        f()


def test_neighbours_freed_before_one_fence_wait_as_one_block(host):
    pool = _core.DevicePool(host, 0)
    entry = _core.NumbaEntryPoints(pool)
    frees = [entry.allocate(4096) for _ in range(64)]  # neighbours in one small segment
    for f in frees[::2] + frees[1::2]:  # every other one first: the rest join both sides
        f()
    s = pool.stats()
    assert s["bytes_waiting"] == 64 * 4096 and s["blocks_waiting"] == 1, s
    fenced = entry.allocate(24 * MiB)  # a miss: the fence is recorded, not completed
    assert not frees[0].ptr <= fenced.ptr < frees[0].ptr + 64 * 4096
    host.complete_all_events()
    pool.synchronize()
    again = entry.allocate(64 * 4096)  # the joined block, coalesced back
    assert again.ptr == frees[0].ptr and pool.stats()["blocks_waiting"] == 0
    fenced()
    again()


def test_a_free_from_before_a_reset_frees_the_retired_block(host):
    pool = _core.DevicePool(host, 0)
    entry = _core.NumbaEntryPoints(pool)
    old = entry.allocate(256)
    pool.reset()
    new = entry.allocate(256)
    assert new.generation == 1 and old.generation == 0
    old()  # the retired block, never the new one at whatever address
    assert pool.owns(new.ptr)
    new()
    assert pool.stats()["blocks_in_use"] == 0


def test_errors_are_the_pools(host):
    host.set_capacity(0, 64 * MiB)
    pool = _core.DevicePool(host, 0)
    entry = _core.NumbaEntryPoints(pool)
    with pytest.raises(_core.OutOfMemoryError, match="out of memory"):
        entry.allocate(1 << 30)
    with pytest.raises(OverflowError):
        entry.allocate(-1)
    with pytest.raises(TypeError):
        entry.allocate(1.5)
    with pytest.raises(TypeError):
        _core.NumbaEntryPoints(object())
    assert entry.pool is pool


def test_threads_allocate_and_free_through_the_entry_points(host):
    # Lock contention: try_allocate / try_deallocate fail, the calls fall back to waiting for the
    # lock without the GIL. Every block must be freed exactly once.
    host.set_auto_complete(True)
    pool = _core.DevicePool(host, 0)
    entry = _core.NumbaEntryPoints(pool)
    errors = []

    def work(seed):
        try:
            sizes = [256 << ((seed + i) % 16) for i in range(64)]
            for _ in range(50):
                frees = [entry.allocate(n) for n in sizes]
                for f in frees:
                    f()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = pool.stats()
    assert s["blocks_in_use"] == 0 and s["allocations"] == s["frees"] == 8 * 50 * 64


# What the plugin tests below run first, in a fresh interpreter: the process-wide pools over a
# host driver (`host`), and `mgr`, a manager of the package (`cls`; `emm`, its EMM names) over a
# bare context of device 0 (only what the manager reads: no CUDA).
MANAGER_PREAMBLE = """
import gc, sys, threading, types
from emmpool import _core
host = _core.HostDriver(devices=1, capacity={capacity})
host.set_auto_complete({auto_complete})
_core._use_driver_for_all_pools(host)
from emmpool import _numba_packages as packages, plugin
pkg = packages.by_name({package!r})
emm = packages.emm_api(pkg)
ctx = emm.Context.__new__(emm.Context)
ctx.device = types.SimpleNamespace(id=0)
cls = plugin.manager_for(pkg.name)
mgr = cls(context=ctx)
"""


def run_with_a_manager(package, body, *, capacity=256 << 20, auto_complete=False, env=None):
    """MANAGER_PREAMBLE, then `body`, in a fresh interpreter: its CompletedProcess."""
    code = MANAGER_PREAMBLE.format(capacity=capacity, auto_complete=auto_complete,
                                   package=package.name) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


def test_plugin_memalloc_over_the_entry_points(numba_package):
    # The plugin's memalloc as Numba calls it, its MemoryPointer's finalizer, reset, and
    # Numba's out-of-memory error.
    out = run_with_a_manager(numba_package, """
        m = mgr.memalloc(1000)
        assert isinstance(m, emm.MemoryPointer) and m.size == 1000
        ptr = int(m.device_pointer)
        assert mgr.pool.owns(ptr)
        del m
        gc.collect()
        assert not mgr.pool.owns(ptr)
        old = mgr.memalloc(256)
        mgr.pool.reset()
        new = mgr.memalloc(256)
        old.free()
        assert mgr.pool.owns(int(new.device_pointer))
        new.free()
        try:
            mgr.memalloc(1 << 40)
        except emm.CudaAPIError as e:
            assert e.code == emm.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY, e
        else:
            raise AssertionError("no error")
        assert mgr.pool.stats()["blocks_in_use"] == 0
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_c_memalloc_is_the_python_one(numba_package):
    # Once bound, a manager answers memalloc with its own C function (no Python frame): the
    # same sizes, pointers and errors as the class's method, which a subclass may override.
    out = run_with_a_manager(numba_package, """
        import numpy as np
        mgr.initialize()
        fast, slow = mgr.memalloc, lambda n: cls.memalloc(mgr, n)
        assert "memalloc" in vars(mgr) and type(fast).__name__ == "builtin_function_or_method"
        pool = mgr.pool

        def outcome(f, size):
            try:
                m = f(size)
            except Exception as e:
                shown = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
                return (type(e), str(e), getattr(e, "code", None), shown)
            out = (type(m), m.size, type(m.size), m.context.device.id, pool.owns(int(m.device_pointer)))
            m.free()
            return out

        for size in (0, 1000, np.int64(4096), True, -1, -(1 << 70), 1.5, "8", 1 << 40, 1 << 64):
            assert outcome(fast, size) == outcome(slow, size), (size, outcome(fast, size))
        assert outcome(fast, 1 << 40)[0] is emm.CudaAPIError
        assert outcome(fast, -1)[:2] == (ValueError, "cannot allocate a negative number of bytes (-1)")
        assert pool.stats()["blocks_in_use"] == 0

        def refused(*args, **kwargs):
            raise RuntimeError("no pointer")
        broken = mgr._entry.memalloc_for(refused, mgr._ctx, lambda e: e)
        try:
            broken(1000)
        except RuntimeError as e:
            assert str(e) == "no pointer"
        else:
            raise AssertionError("no error")
        assert pool.stats()["blocks_in_use"] == 0  # the block went back

        class Own(cls):
            def memalloc(self, size):
                return "own"
        own = Own(context=ctx)
        own.initialize()
        assert "memalloc" not in vars(own) and own.memalloc(1) == "own"
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_numba_free_cannot_be_made_from_python():
    # Without DISALLOW_INSTANTIATION, NumbaFree inherited object's tp_new, so NumbaFree() makes a finalizer with entry NULL,
    # and calling it dereferences NULL (SIGSEGV, rc -11).
    code = "from emmpool import _core\ntry:\n    _core.NumbaFree()()\nexcept TypeError:\n    pass\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, (r.returncode, r.stderr[-400:])


def allocate_while_resetting(allocate: str, reset: str) -> str:
    """Script lines: 4 threads run `allocate` into `blocks` until another has run `reset` 100
    times (a reset between an allocation and the reading of its generation, if one can be)."""
    return textwrap.dedent(
        f"""
        blocks, lock, stop = [], threading.Lock(), [False]
        def alloc():
            mine = []
            while not stop[0]:
                mine.append({allocate})
            with lock:
                blocks.extend(mine)
        def resetter():
            for _ in range(100):
                {reset}
            stop[0] = True
        ts = [threading.Thread(target=alloc) for _ in range(4)] + [threading.Thread(target=resetter)]
        for t in ts: t.start()
        for t in ts: t.join()
        """
    )


def test_a_block_is_labelled_with_the_generation_it_was_allocated_in():
    # A generation read outside the pool's lock (as the entry once kept it, updated after each
    # reset) could be a reset behind: the allocation may wait for the lock without the GIL while
    # another thread's reset() goes first. A block of generation g+1 labelled g has its free go
    # to the retired blocks (PoolError "from before a reset is not live", or a retired block at
    # the same address freed in its place) and stays live forever.
    code = textwrap.dedent(
        """
        import sys, threading
        from emmpool import _core
        sys.setswitchinterval(1e-6)
        host = _core.HostDriver(devices=1, capacity=1 << 34)
        host.set_auto_complete(True)
        pool = _core.DevicePool(host, 0)
        entry = _core.NumbaEntryPoints(pool)
        """
    ) + allocate_while_resetting("entry.allocate(256)", "pool.reset()")
    code += textwrap.dedent(
        """
        errors = 0
        for f in blocks:
            try:
                f()
            except _core.PoolError:
                errors += 1
        print(errors, pool.stats()["blocks_in_use"])
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-400:]
    assert r.stdout.split() == ["0", "0"], r.stdout

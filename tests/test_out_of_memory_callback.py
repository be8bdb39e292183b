"""emmpool.set_out_of_memory_callback over the host driver: what a spilling library (Dask's
workers) relies on when an allocation cannot be served. Each case runs in a fresh interpreter
whose process-wide pools take a host driver of 64 MiB (they take their driver once)."""

from __future__ import annotations

import textwrap

import pytest

from tests.processes import run_python

MiB = 1 << 20

PRELUDE = textwrap.dedent(
    """
    import ctypes, threading
    import emmpool
    from emmpool import _core
    MiB = 1 << 20
    host = _core.HostDriver(devices=1, capacity=64 * MiB)
    host.set_auto_complete(True)
    _core._use_driver_for_all_pools(host)
    emmpool.configure(segments={segments!r})
    pool = _core.pool(0)
    held = [pool.allocate(24 * MiB, _core.LEGACY_STREAM, 2) for _ in range(2)]  # "CuPy's"
    calls = []

    def out_of_memory(size):  # the error an allocation of `size` bytes must raise
        try:
            pool.allocate(size)
        except emmpool.OutOfMemoryError as e:
            return e
        raise AssertionError("no out-of-memory error")
    """
)


def run(body: str):
    # On the default (growable segments, 20 MiB pages: a spilled block's pages stay mapped and
    # serve the retry) and on fixed segments (the spill frees a whole segment): the cases'
    # arithmetic holds on both.
    for segments in ("growable", "fixed"):
        prelude = PRELUDE.replace("{segments!r}", repr(segments))
        p = run_python(["-c", prelude + textwrap.dedent(body) + "\nprint('OK')\n"],
                       timeout=120)
        assert p.returncode == 0 and p.stdout.strip().endswith("OK"), (segments, p.stdout +
                                                                        p.stderr)


def test_the_callback_frees_and_the_allocation_is_tried_again():
    run(
        """
        def spill(device, size, stats):
            calls.append((device, size, stats["bytes_in_use"]))
            pool.deallocate_tagged(held.pop(), _core.ALLOCATION_STREAM, 2)
            return True
        emmpool.set_out_of_memory_callback(spill)
        ptr = pool.allocate(24 * MiB)  # 48 of 64 MiB held: only after one spill
        assert calls == [(0, 24 * MiB, 48 * MiB)], calls
        assert len(held) == 1 and pool.stats()["bytes_in_use"] == 48 * MiB
        """
    )


def test_a_callback_that_frees_nothing_ends_in_the_error_at_once():
    run(
        """
        emmpool.set_out_of_memory_callback(lambda d, n, s: calls.append(n) or False, device=0)
        e = out_of_memory(24 * MiB)
        assert "out of memory" in str(e) and e.__cause__ is None
        assert calls == [24 * MiB]
        emmpool.set_out_of_memory_callback(None, device=0)  # removed: not asked any more
        out_of_memory(24 * MiB)
        assert calls == [24 * MiB]
        """
    )


def test_retries_are_bounded():
    run(
        """
        emmpool.set_out_of_memory_callback(lambda d, n, s: calls.append(n) or True)  # "freed"
        out_of_memory(24 * MiB)
        assert len(calls) == 8, calls
        """
    )


def test_an_exception_in_the_callback_is_chained_to_the_error():
    run(
        """
        class SpillFailed(Exception):
            pass
        def spill(device, size, stats):
            raise SpillFailed("disk full")
        emmpool.set_out_of_memory_callback(spill)
        e = out_of_memory(24 * MiB)
        assert isinstance(e.__cause__, SpillFailed), repr(e.__cause__)
        assert "callback raised SpillFailed: disk full" in str(e), e
        emmpool.set_out_of_memory_callback(lambda d, n, s: False)
        assert out_of_memory(24 * MiB).__cause__ is None  # no stale cause from the last error
        """
    )


def test_the_callback_may_allocate_and_its_own_shortage_fails_without_asking_again():
    run(
        """
        def spill(device, size, stats):
            calls.append(size)
            staging = pool.allocate(1 * MiB)        # fits: no lock of emmpool's is held here
            pool.deallocate(staging)
            out_of_memory(40 * MiB)                 # does not: fails, the callback not re-asked
            pool.deallocate_tagged(held.pop(), _core.ALLOCATION_STREAM, 2)
            return True
        emmpool.set_out_of_memory_callback(spill)
        pool.allocate(24 * MiB)
        assert calls == [24 * MiB], calls
        """
    )


def test_two_threads_out_of_memory_at_once_both_succeed_after_spilling():
    run(
        """
        lock = threading.Lock()
        def spill(device, size, stats):
            with lock:
                calls.append(size)
                if held:
                    pool.deallocate_tagged(held.pop(), _core.ALLOCATION_STREAM, 2)
                    return True
                return False
        emmpool.set_out_of_memory_callback(spill)
        got, errors = [], []
        barrier = threading.Barrier(2)
        def work():
            barrier.wait()
            try:
                got.append(pool.allocate(20 * MiB))
            except Exception as e:
                errors.append(e)
        threads = [threading.Thread(target=work) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors and len(got) == 2 and not held, (errors, got, held)
        """
    )


def test_every_client_asks_it_cupys_c_entry_point_and_numbas():
    run(
        """
        def spill(device, size, stats):
            calls.append(size)
            if held:
                pool.deallocate_tagged(held.pop(), _core.ALLOCATION_STREAM, 2)
                return True
            return False
        emmpool.set_out_of_memory_callback(spill)
        lib = ctypes.PyDLL(_core.__file__)
        cupy_malloc = lib.emmpool_cupy_malloc
        cupy_malloc.restype, cupy_malloc.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        assert cupy_malloc(None, 20 * MiB, 0)                  # CuPy's C function allocator
        numba = _core.NumbaEntryPoints(pool)
        assert numba.allocate(20 * MiB).ptr                     # Numba's C entry point
        assert calls == [20 * MiB, 20 * MiB], calls
        """
    )


def test_bad_arguments():
    import emmpool

    with pytest.raises(TypeError, match="callable"):
        emmpool.set_out_of_memory_callback("spill")
    with pytest.raises(TypeError, match="device"):
        emmpool.set_out_of_memory_callback(None, device="0")

"""The device pool logic through the Python binding, on the host driver (no GPU needed).

The C++ suite (cpp/tests) covers the same logic more exhaustively, under sanitizers; these tests
check that the binding exposes it faithfully."""

from __future__ import annotations

import threading

import pytest

import emmpool
from emmpool import _core

MiB = 1 << 20


def make_pool(host, **kw):
    return _core.DevicePool(host, 0, **kw)


def test_alignment_and_rounding(host):
    pool = make_pool(host)
    ptrs = [pool.allocate(n) for n in (1, 255, 256, 257, 1000, 4096, 3 * MiB + 7)]
    assert all(p % 256 == 0 for p in ptrs)
    assert len(set(ptrs)) == len(ptrs)
    assert pool.stats()["bytes_in_use"] == 256 + 256 + 256 + 512 + 1024 + 4096 + 3 * MiB + 256


def test_zero_bytes_gives_distinct_blocks(host):
    pool = make_pool(host)
    a, b = pool.allocate(0), pool.allocate(0)
    assert a != b


def test_no_reuse_before_event_completes(host):
    pool = make_pool(host)
    p = pool.allocate(1024)
    pool.deallocate(p)
    # The event recorded after the free has not completed: p must not come back, however
    # often we ask (each miss closes a batch and queries it).
    seen = {pool.allocate(1024) for _ in range(5000)}
    assert p not in seen
    host.complete_all_events()
    for q in seen:
        pool.deallocate(q)
    host.complete_all_events()
    pool.synchronize()
    assert pool.stats()["bytes_waiting"] == 0
    assert p in {pool.allocate(1024) for _ in range(5000)}


def test_split_and_coalesce_back_to_one_block(host):
    pool = make_pool(host)
    blocks = [pool.allocate(100 * 1024) for _ in range(10)]
    assert pool.stats()["segments"] == 1
    for b in blocks:
        pool.deallocate(b)
    host.complete_all_events()
    pool.synchronize()
    s = pool.stats()
    assert s["bytes_free"] == s["bytes_reserved"] == 2 * MiB
    assert s["largest_free_block"] == 2 * MiB


def test_maximum_size_gives_out_of_memory_and_pool_stays_usable(host):
    pool = make_pool(host, maximum_size=64 * MiB)
    big = pool.allocate(60 * MiB)
    with pytest.raises(emmpool.OutOfMemoryError, match="holds"):
        pool.allocate(8 * MiB)
    assert isinstance(emmpool.OutOfMemoryError("x"), MemoryError)
    pool.deallocate(big)
    assert pool.allocate(8 * MiB) % 256 == 0


def test_ladder_waits_for_pending_frees_before_failing(host):
    host.set_capacity(0, 40 * MiB)
    pool = make_pool(host)
    a = pool.allocate(30 * MiB)
    pool.deallocate(a)  # pending: its event is not complete
    b = pool.allocate(30 * MiB)  # must wait (synchronize the event) rather than fail
    assert b == a
    assert host.stats()["event_syncs"] >= 1


def test_ladder_releases_cached_segments_then_retries(host):
    host.set_capacity(0, 64 * MiB)
    pool = make_pool(host)
    smalls = [pool.allocate(512 * 1024) for _ in range(8)]  # fills small segments
    for p in smalls:
        pool.deallocate(p)
    host.complete_all_events()
    pool.synchronize()
    reserved = pool.stats()["bytes_reserved"]
    assert reserved > 0
    big = pool.allocate(64 * MiB - 0)  # only fits once the cached small segments are gone
    assert big % 256 == 0
    assert host.stats()["deallocations"] >= 1


def test_trim_and_defer_cleanup(host):
    pool = make_pool(host)
    p = pool.allocate(MiB * 4)
    pool.deallocate(p)
    host.complete_all_events()
    pool.defer_cleanup_begin()
    assert pool.trim() == 0  # nothing goes back to the driver while deferred
    assert pool.allocate(MiB * 4) == p  # but blocks are reused
    pool.deallocate(p)
    pool.defer_cleanup_end()
    host.complete_all_events()
    assert pool.trim() > 0
    assert host.stats()["live_segments"] == 0


def test_passthrough_gives_each_allocation_its_own_segment(host):
    pool = make_pool(host, mode="passthrough")
    ptrs = [pool.allocate(1000) for _ in range(4)]
    assert host.stats()["live_segments"] == 4
    for p in ptrs:
        pool.deallocate(p)
    host.complete_all_events()
    pool.synchronize()
    assert host.stats()["live_segments"] == 0


def test_reset_retires_live_blocks_and_old_finalizers_are_harmless(host):
    pool = make_pool(host)
    old = pool.allocate(4096)
    gen = pool.generation
    pool.reset()
    host.invalidate_device(0)  # the context is gone: the driver reuses addresses
    new = pool.allocate(4096)
    assert pool.generation == gen + 1
    # The old finalizer runs late: it must not free the new block, even at the same address.
    pool.deallocate(old, _core.LEGACY_STREAM, gen)
    assert pool.owns(new)
    with pytest.raises(emmpool.PoolError):
        pool.deallocate(old, _core.LEGACY_STREAM, gen)  # twice


def test_double_free_and_foreign_pointer_are_errors(host):
    pool = make_pool(host)
    p = pool.allocate(256)
    pool.deallocate(p)
    with pytest.raises(emmpool.PoolError, match="not a live allocation"):
        pool.deallocate(p)
    with pytest.raises(emmpool.PoolError):
        pool.deallocate(12345)


def test_bad_arguments(host):
    pool = make_pool(host)
    with pytest.raises(TypeError):
        pool.allocate(-1)
    with pytest.raises(TypeError):
        pool.allocate(1.5)
    with pytest.raises(ValueError, match="too large"):
        pool.allocate(1 << 63)
    with pytest.raises(ValueError, match="tag"):
        pool.allocate(1, _core.LEGACY_STREAM, 9)
    with pytest.raises(ValueError, match="mode"):
        make_pool(host, mode="bogus")
    with pytest.raises(ValueError, match="maximum_fraction"):
        make_pool(host, maximum_fraction=2.0)


def test_stats_by_library(host):
    pool = make_pool(host)
    a = pool.allocate(1000, _core.LEGACY_STREAM, 1)
    pool.allocate(3000, _core.LEGACY_STREAM, 2)
    s = pool.stats()["by_library"]
    assert s["numba"]["bytes_in_use"] == 1024
    assert s["cupy"]["bytes_in_use"] == 3072
    pool.deallocate(a)
    assert pool.stats()["by_library"]["numba"]["bytes_in_use"] == 0
    assert pool.stats()["by_library"]["numba"]["allocations"] == 1


def test_ipc_handle_names_segment_and_offset(host):
    pool = make_pool(host)
    a = pool.allocate(4096)
    b = pool.allocate(4096)
    ha, base_a, _, off_a = pool.ipc_handle(a)
    hb, base_b, _, off_b = pool.ipc_handle(b + 100)  # a view inside b
    assert base_a == base_b and ha == hb and len(ha) == 64
    assert off_a == a - base_a and off_b == b + 100 - base_b
    assert pool.ipc_handle(0x1234) is None


def test_threads_free_what_others_allocated():
    host = _core.HostDriver(devices=1, capacity=1 << 40)  # address space only: no real memory
    host.set_auto_complete(True)
    pool = make_pool(host)
    out: list[int] = []
    lock = threading.Lock()

    def producer(seed):
        import random

        rng = random.Random(seed)
        for _ in range(2000):
            p = pool.allocate(rng.choice((256, 4096, 100_000, 3 * MiB)))
            with lock:
                out.append(p)

    def consumer():
        while True:
            with lock:
                p = out.pop() if out else None
            if p is not None:
                pool.deallocate(p)
            elif not any(t.is_alive() for t in producers):
                # A producer may have appended its last block just before it ended.
                with lock:
                    rest, out[:] = list(out), []
                for q in rest:
                    pool.deallocate(q)
                return

    producers = [threading.Thread(target=producer, args=(i,)) for i in range(4)]
    for t in producers:
        t.start()
    consumer()  # frees on the main thread what the producers allocated on theirs
    for t in producers:
        t.join()
    pool.synchronize()
    s = pool.stats()
    assert s["bytes_in_use"] == 0 and s["allocations"] == s["frees"] == 8000
    pool.trim()
    assert host.stats()["bytes_reserved"] == 0


def _fork(child) -> int:
    """Run child() in a forked process; return its exit status (or -1 if it hung)."""
    import os
    import time
    import warnings

    with warnings.catch_warnings():
        # Python 3.12+ warns that fork() in a multi-threaded process may deadlock: that is
        # exactly what these tests check the pool does not do.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if child() else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -1


def test_fork_child_gets_a_clear_error_and_frees_are_harmless(host):
    pool = make_pool(host)
    inherited = pool.allocate(4096)

    def child():
        assert pool.forked
        pool.deallocate(inherited)  # a finalizer of an inherited array: does nothing
        try:
            pool.allocate(256)
        except emmpool.PoolError as e:
            return "forked" in str(e) and "spawn" in str(e)
        return False

    assert _fork(child) == 0
    assert not pool.forked and pool.owns(inherited)  # the parent's pool is untouched
    pool.deallocate(inherited)
    assert pool.allocate(256) % 256 == 0


def test_fork_while_other_threads_use_the_pool_never_deadlocks():
    host = _core.HostDriver(devices=1, capacity=1 << 40)
    host.set_auto_complete(True)
    pool = make_pool(host)
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            pool.deallocate(pool.allocate(12345))

    threads = [threading.Thread(target=churn) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        # Each child must be able to take the pool's lock: a mutex inherited locked would hang.
        statuses = [_fork(lambda: pool.stats()["segments"] >= 0 and pool.trim() == 0)
                    for _ in range(20)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert statuses == [0] * 20
    pool.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


def test_out_of_memory_while_other_threads_allocate():
    host = _core.HostDriver(devices=1, capacity=256 * MiB)
    host.set_auto_complete(True)
    pool = make_pool(host)
    errors, done = [], []

    def worker(seed):
        import random

        rng = random.Random(seed)
        for _ in range(20):
            # Take memory until the pool refuses (256 MiB can't hold 10 x 30 MiB even for one
            # thread alone), then give it all back: every thread meets the limit, whatever
            # the interleaving.
            held = []
            try:
                for _ in range(10):
                    held.append(pool.allocate(rng.choice((4096, 3 * MiB, 30 * MiB, 30 * MiB))))
                    if len(held) == 10:
                        held.append(pool.allocate(300 * MiB))  # never fits
            except emmpool.OutOfMemoryError as e:
                errors.append(str(e))
            for p in held:
                pool.deallocate(p)
        done.append(seed)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(done) == list(range(6))
    assert errors and all("holds" in e for e in errors)  # OOM happened, with the pool's state
    pool.synchronize()
    s = pool.stats()
    assert s["bytes_in_use"] == 0 and s["out_of_memory"] == len(errors)
    assert pool.allocate(100 * MiB) % 256 == 0  # usable right after


def test_passthrough_survives_a_failing_cuMemFree(host):
    pool = make_pool(host, mode="passthrough")
    ptrs = [pool.allocate(1000) for _ in range(4)]
    for p in ptrs:
        pool.deallocate(p)
    host.complete_all_events()
    host.fail_next_deallocations(2)  # a sticky error for two cuMemFree calls
    pool.synchronize()  # releases what it can; the two failed segments stay, wholly free
    s = pool.stats()
    assert s["bytes_in_use"] == 0 and s["bytes_waiting"] == 0
    assert host.stats()["live_segments"] == 2
    assert pool.trim() > 0 and host.stats()["live_segments"] == 0  # a later trim retries
    fresh = {pool.allocate(1000) for _ in range(4)}
    assert len(fresh) == 4


def test_reset_survives_failing_frees_and_never_aliases(host):
    pool = make_pool(host, mode="passthrough")
    live = pool.allocate(4096)
    gen = pool.generation
    pending = pool.allocate(4096)
    pool.deallocate(pending)
    host.fail_next_deallocations(5)
    pool.reset()  # must complete: generation bumped, live block retired
    assert pool.generation == gen + 1
    host.invalidate_device(0)
    new = pool.allocate(4096)
    pool.deallocate(live, _core.LEGACY_STREAM, gen)
    assert pool.owns(new)


def test_late_cupy_free_after_reset_never_frees_a_numba_block(host):
    pool = make_pool(host)
    cupy_block = pool.allocate(4096, _core.LEGACY_STREAM, 2)
    pool.reset()
    host.invalidate_device(0)
    numba_block = pool.allocate(4096, _core.LEGACY_STREAM, 1)
    assert numba_block == cupy_block  # the address was reused
    pool.deallocate_tagged(cupy_block, _core.LEGACY_STREAM, 2)  # CuPy's late free
    assert pool.owns(numba_block)
    with pytest.raises(emmpool.PoolError, match="this library"):
        pool.deallocate_tagged(numba_block, _core.LEGACY_STREAM, 2)


def test_a_failing_record_on_a_side_stream_does_not_wedge_the_pool(host):
    pool = make_pool(host)
    side = 0x5EED
    p = pool.allocate(4096, side)
    pool.deallocate(p, side)
    host.fail_next_event_records(1)  # a driver error on the live side stream
    for _ in range(3):
        pool.allocate(2 << 20, side)  # misses on it: its batch is fenced each time
    assert host.stats()["device_syncs"] == 1  # fenced by synchronizing the device instead
    host.complete_all_events()
    pool.synchronize()
    assert pool.allocate(4096) == p  # and reused after that fence


def test_record_stream_zero_means_the_default_stream(host):
    pool = make_pool(host)
    p = pool.allocate(4096)
    pool.record_stream(p, 0)
    pool.deallocate(p)
    host.complete_all_events()
    pool.allocate(2 << 20)  # miss: records the first fence
    host.complete_all_events()
    pool.allocate(2 << 20)  # promotes it: the block needs a second fence (the free's stream)
    host.complete_all_events()
    pool.synchronize()
    assert pool.allocate(4096) == p


def test_a_cap_below_the_segment_size_still_serves_what_fits(host):
    pool = make_pool(host, maximum_size=MiB)  # smaller than one 2 MiB small segment
    a = pool.allocate(1000)
    b = pool.allocate(300 * 1024)
    assert a != b and pool.stats()["bytes_reserved"] <= MiB
    with pytest.raises(emmpool.OutOfMemoryError):
        pool.allocate(900 * 1024)


# ---- stream order: a block freed on a named stream goes straight back to that stream ----------

S, T = 0x5000, 0x6000  # two named streams (opaque handles to the host driver)


def test_block_freed_on_a_stream_is_reused_at_once_on_that_stream(host):
    pool = make_pool(host)
    p = pool.allocate(4096, S)
    pool.deallocate(p, S)
    # No event has completed: only stream order makes this safe, and only on S.
    assert pool.allocate(4000, S) == p
    assert pool.stats()["same_stream_reuses"] == 1
    assert pool.stats()["bytes_waiting"] == 0 and pool.stats()["bytes_in_use"] == 4096


def test_no_unfenced_reuse_on_another_stream_or_without_a_stream(host):
    pool = make_pool(host)
    p = pool.allocate(4096, S)
    pool.deallocate(p, S)
    others = [pool.allocate(4096, T), pool.allocate(4096), pool.allocate(4096, 0)]
    assert p not in others
    assert pool.stats()["same_stream_reuses"] == 0
    # Numba's frees name no stream: never reused unfenced, whatever stream asks.
    q = pool.allocate(4096)
    pool.deallocate(q)
    assert q not in {pool.allocate(4096, s) for s in (_core.LEGACY_STREAM, T, 0)}
    assert pool.stats()["same_stream_reuses"] == 0


def test_per_thread_stream_is_never_reused_unfenced(host):
    # One handle, a different stream on every thread: treated as "no stream named".
    pool = make_pool(host)
    p = pool.allocate(4096, _core.PER_THREAD_STREAM)
    pool.deallocate(p, _core.PER_THREAD_STREAM)
    assert pool.allocate(4096, _core.PER_THREAD_STREAM) != p


def test_sizes_far_from_the_freed_block_are_not_served_from_it_whole(host):
    pool = make_pool(host)
    p = pool.allocate(8192, S)
    pool.deallocate(p, S)
    assert pool.allocate(8192 + 256, S) != p     # does not fit
    assert pool.allocate(8192 - 512, S) == p     # within 1/8: whole
    pool.deallocate(p, S)
    # Smaller: the front of p, which fits tighter than the free rest of the segment; p's
    # rest waits on S, taken by S's next fit.
    assert pool.allocate(1024, S) == p
    assert pool.allocate(4096, S) == p + 1024
    assert pool.stats()["bytes_waiting"] == 8192 - 1024 - 4096


def test_a_tighter_free_block_goes_before_cutting_a_pending_one(host):
    host.set_auto_complete(True)
    pool = make_pool(host)
    a = pool.allocate(4096)                      # Numba's: fenced, then free
    b = pool.allocate(65536, S)
    pool.allocate(4096)                          # keeps b apart from the segment's free rest
    pool.deallocate(a)
    pool.allocate(3 << 20)                       # a miss fences and frees a (events complete)
    pool.deallocate(b, S)
    assert pool.allocate(2048, S) == a           # a (4 KiB, free) fits tighter than b (64 KiB)
    assert pool.allocate(8192, S) == b           # then b's front, not the segment's free rest


def test_a_free_on_the_null_stream_absorbs_free_neighbours_until_its_fence(host):
    # As PyTorch's pool coalesces a freed block with its free neighbours: the null stream's
    # next request of any size up to the merged block needs no new segment even while the GPU
    # runs behind (no event completes); others get the free part back after the fence.
    pool = make_pool(host)
    p = pool.allocate(512 << 10, 0)              # a small segment (2 MiB): p, then free
    pool.deallocate(p, 0)
    st = pool.stats()
    assert st["bytes_waiting"] == 2 << 20 and st["bytes_free"] == 0
    q = pool.allocate(1 << 20, 0)                # larger than p: the merged block's front
    assert q == p and pool.stats()["segment_allocations"] == 1
    pool.deallocate(q, 0)
    assert pool.allocate(4096) != p              # Numba: not before the null stream's fence
    host.complete_all_events()                   # (a new segment: p, then 2 MiB - 4 KiB free)
    got = [pool.allocate(1 << 20) for _ in range(3)]
    assert p in got and pool.stats()["segment_allocations"] == 2  # after it, everyone's


def test_a_free_on_another_named_stream_leaves_free_neighbours_free(host):
    # Its batch may wait dormant (the stream may never allocate again): free bytes stay free.
    pool = make_pool(host)
    p = pool.allocate(1 << 20, S)
    pool.deallocate(p, S)
    st = pool.stats()
    assert st["bytes_waiting"] == 1 << 20 and st["bytes_free"] == 1 << 20
    assert pool.allocate(4096) == p + (1 << 20)  # Numba gets the free half at once


def test_record_stream_of_the_null_stream_keeps_one_fence_and_stream_order(host):
    # record_stream(p, 0) names the legacy default stream, which a free on the null stream
    # already fences: the block keeps one fence and goes back to the null stream at once.
    pool = make_pool(host)
    p = pool.allocate(4096, 0)
    pool.record_stream(p, 0)
    pool.deallocate(p, 0)
    assert pool.allocate(4096, 0) == p
    with pytest.raises(ValueError, match="allocation_stream"):
        pool.record_stream(p, _core.ALLOCATION_STREAM)


def test_trace_names_every_library_tag(host):
    from emmpool import trace

    pool = make_pool(host)
    pool.set_tracing(True)
    for tag in range(len(_core.LIBRARIES)):
        pool.deallocate_tagged(pool.allocate(256, S, tag), S, tag)
    assert {r.library for r in trace.collect([pool])} == set(_core.LIBRARIES)
    assert "rmm" in _core.LIBRARIES and pool.stats()["by_library"].keys() == set(_core.LIBRARIES)


def test_recorded_stream_blocks_wait_for_their_fence(host):
    pool = make_pool(host)
    p = pool.allocate(4096, S)
    pool.record_stream(p, T)
    pool.deallocate(p, S)
    assert p not in {pool.allocate(4096, S), pool.allocate(4096, T)}


def test_allocation_stream_fences_the_free_on_the_allocations_stream(host):
    # The CuPy entry point frees with ALLOCATION_STREAM: the block goes back to its own stream.
    pool = make_pool(host)
    p = pool.allocate(4096, S, 2)
    pool.deallocate_tagged(p, _core.ALLOCATION_STREAM, 2)
    assert pool.allocate(4096, T, 2) != p
    assert pool.allocate(4096, S, 2) == p
    with pytest.raises(ValueError, match="allocation_stream"):
        pool.allocate(16, _core.ALLOCATION_STREAM)


def test_same_stream_reuse_keeps_segment_accounting(host):
    pool = make_pool(host)
    ptrs = [pool.allocate(4096, S) for _ in range(4)]
    for _ in range(1000):
        pool.deallocate(ptrs[-1], S)
        ptrs[-1] = pool.allocate(4096, S)
    for p in ptrs:
        pool.deallocate(p, S)
    host.complete_all_events()
    pool.synchronize()
    s = pool.stats()
    assert s["bytes_in_use"] == 0 and s["bytes_waiting"] == 0 and s["same_stream_reuses"] == 1000
    assert pool.trim() == s["bytes_reserved"]    # every segment wholly free again

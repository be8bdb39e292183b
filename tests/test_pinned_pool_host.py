"""The pinned-host cache (cpp/include/emmpool/host_pool.hpp) on the host driver: no GPU needed.
The host driver's "pinned" memory is real (malloc), so the blocks can be written and read."""

from __future__ import annotations

import ctypes
import os
import textwrap

import pytest

import emmpool
from emmpool import _core

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def pinned(host):
    return _core.HostPool(host, 0, limit=64 * MiB)


def test_size_classes_round_by_at_most_a_quarter():
    classes = [_core.HostPool.size_class(n) for n in (1, 4096, 4097, 5121, 8192, MiB, MiB + 1)]
    assert classes == [4096, 4096, 5120, 6144, 8192, MiB, MiB + MiB // 4]
    for n in range(4097, 10 * MiB, 77_777):
        c = _core.HostPool.size_class(n)
        assert n <= c <= 1.25 * n + 4096


def test_blocks_are_real_memory_and_reused_only_after_the_fence(host, pinned):
    p = pinned.allocate(100 * KiB)
    ctypes.memset(p, 0xAB, 100 * KiB)
    assert ctypes.string_at(p + 100 * KiB - 1, 1) == b"\xab"
    pinned.deallocate(p)
    again = [pinned.allocate(100 * KiB) for _ in range(3)]
    assert p not in again  # the copy that may still read p has not been fenced
    host.complete_all_events()
    for q in again:
        pinned.deallocate(q)
    host.complete_all_events()
    s0 = pinned.stats()
    assert pinned.allocate(100 * KiB) in again + [p]  # now from the cache, no driver call
    s1 = pinned.stats()
    assert s1["cache_hits"] == s0["cache_hits"] + 1
    assert s1["driver_allocations"] == s0["driver_allocations"]


def test_flags_are_kept_apart(host, pinned):
    host.set_auto_complete(True)  # an idle GPU: every fence completes once recorded
    p = pinned.allocate(8 * KiB, _core.HOST_MAPPED)
    pinned.deallocate(p)
    host.complete_all_events()
    q = pinned.allocate(8 * KiB, 0)  # same class, other flags: not p
    assert q != p
    assert pinned.allocate(8 * KiB, _core.HOST_MAPPED) == p
    with pytest.raises(ValueError, match="flags"):
        pinned.allocate(8, 64)


def test_limit_releases_cache_then_waits_then_fails_clearly(host, pinned):
    held = [pinned.allocate(16 * MiB) for _ in range(3)]
    for p in held[:2]:
        pinned.deallocate(p)  # pending
    # 48 MiB held of 64: another 32 MiB fits only after waiting for the pending frees and
    # returning one of them (a different class) to the driver; the other stays cached.
    big = pinned.allocate(32 * MiB)
    s = pinned.stats()
    assert host.stats()["event_syncs"] >= 1  # the pending frees were waited for
    assert s["bytes_held"] == 64 * MiB and s["driver_frees"] == 1
    assert s["bytes_cached"] == 16 * MiB
    with pytest.raises(emmpool.OutOfMemoryError, match="EMMPOOL_PINNED_LIMIT"):
        pinned.allocate(32 * MiB)
    pinned.deallocate(big)
    host.complete_all_events()
    assert pinned.allocate(32 * MiB) == big  # usable right after


def test_trim_and_defer_cleanup(host, pinned):
    ps = [pinned.allocate(n) for n in (4 * KiB, 100 * KiB, 3 * MiB)]
    for p in ps:
        pinned.deallocate(p)
    pinned.defer_cleanup_begin()
    assert pinned.trim() == 0
    pinned.defer_cleanup_end()
    released = pinned.trim()
    assert released == sum(_core.HostPool.size_class(n) for n in (4 * KiB, 100 * KiB, 3 * MiB))
    s = pinned.stats()
    assert s["bytes_held"] == s["bytes_cached"] == 0 and s["driver_frees"] == 3


def test_register_passes_through_and_unregisters_at_once(pinned):
    buf = ctypes.create_string_buffer(1 << 16)
    addr = ctypes.addressof(buf)
    pinned.register_memory(addr, len(buf), _core.HOST_MAPPED)
    assert pinned.stats()["bytes_registered"] == 1 << 16
    with pytest.raises(emmpool.CudaError, match="ALREADY_REGISTERED"):
        pinned.register_memory(addr, len(buf))
    pinned.unregister_memory(addr)
    pinned.register_memory(addr, len(buf))  # pinned again right away
    pinned.unregister_memory(addr)
    with pytest.raises(emmpool.PoolError, match="not pinned"):
        pinned.unregister_memory(addr)


def test_reset_retires_live_blocks(host, pinned):
    live = pinned.allocate(8 * KiB)
    gen = pinned.generation
    pinned.reset()
    assert pinned.generation == gen + 1
    pinned.deallocate(live, _core.LEGACY_STREAM, gen)  # a late finalizer: harmless
    with pytest.raises(emmpool.PoolError):
        pinned.deallocate(live, _core.LEGACY_STREAM, gen)
    s = pinned.stats()
    assert s["bytes_in_use"] == 0 and s["bytes_held"] == 0


def test_double_free_is_an_error(pinned):
    p = pinned.allocate(1)
    pinned.deallocate(p)
    with pytest.raises(emmpool.PoolError, match="not a live allocation"):
        pinned.deallocate(p)


def test_forked_child_gets_a_clear_error(host, pinned):
    from tests.test_device_pool_host import _fork

    inherited = pinned.allocate(4096)

    def child():
        pinned.deallocate(inherited)
        try:
            pinned.allocate(4096)
        except emmpool.PoolError as e:
            return "forked" in str(e)
        return False

    assert _fork(child) == 0
    pinned.deallocate(inherited)


def test_the_plugins_pinned_blocks_carry_the_generation_they_were_allocated_in(numba_package):
    # The plugin once labelled a pinned block with the generation it kept on the side (updated
    # after each reset), read after the allocation: a reset by another thread in between gave
    # the block the next generation. Its free then looked for a live block of that generation,
    # raised PoolError, and the retired block stayed live for ever.
    from tests.test_numba_entry_points import allocate_while_resetting, run_with_a_manager

    script = textwrap.dedent("""
        sys.setswitchinterval(1e-6)
        mgr.initialize()
    """) + allocate_while_resetting("mgr.memhostalloc(4096)", "mgr._pinned.reset()")
    script += textwrap.dedent("""
        errors, count = [], len(blocks)
        sys.unraisablehook = lambda u: errors.append(u.exc_value)  # the finalizers' errors
        blocks.clear()  # each PinnedMemory's weakref.finalize frees its block
        print(len(errors), mgr._pinned.stats()["bytes_in_use"], count)
    """)
    out = run_with_a_manager(numba_package, script, capacity=1 << 34, auto_complete=True,
                             env=dict(os.environ, EMMPOOL_PINNED="pool"))
    assert out.returncode == 0, out.stderr[-2000:]
    errors, in_use, count = map(int, out.stdout.split())
    assert count > 0 and (errors, in_use) == (0, 0), out.stdout

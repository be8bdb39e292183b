"""Growable segments on a real GPU (skipped, with the reason, where there is none): the CUDA
driver's virtual memory management behind the seam (cuMemAddressReserve, cuMemCreate, cuMemMap,
cuMemSetAccess, cuMemUnmap), memory that kernels and copies really use, the fragmentation
replay on the CUDA driver, and Numba's IPC on growable segments (the default).

`.ci/gpu.py` runs these in every GPU run, and every other GPU test (Numba's, CuPy's, PyTorch's)
in the default mode; `EMMPOOL_SEGMENTS=fixed python3 .ci/gpu.py --only pytest` runs them on
fixed segments."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from emmpool import _config, _core, replay
from tests import gpu_scripts
from tests.conftest import benchmark_module, needs, require
from tests.test_gpu_numba import check, run

pytestmark = pytest.mark.gpu
MiB = 1 << 20
NUMBA_TAG, CUPY_TAG = 1, 2


def growable_pool(**options):
    options.setdefault("growable_room", 0)
    options.setdefault("growable_page_size", 0)  # the driver's 2 MiB pages: the tests count them
    pool = _core.DevicePool(None, 0, segments="growable", **options)
    if not pool.growable:
        pytest.skip(needs("a GPU with virtual memory management", "device 0 does not "
                          "support it (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)"))
    return pool


def numba_view(ptr, nbytes):
    """A Numba device array over pool memory (Numba's primary context, as the pool's)."""
    from numba import cuda
    from numba.cuda.cudadrv import driver

    mem = driver.MemoryPointer(cuda.current_context(), ptr, nbytes)  # as emmpool.plugin does
    return cuda.devicearray.DeviceNDArray(shape=(nbytes,), strides=(1,), dtype=np.uint8,
                                          gpu_data=mem)


def test_mapped_pages_hold_data_and_trim_unmaps_them():
    pool = growable_pool()
    sizes = [3 * MiB, 50 * MiB, 5 * MiB + 256]
    ptrs = [pool.allocate(n, tag=CUPY_TAG) for n in sizes]
    assert pool.stats()["page_maps"] > 0
    for i, (p, n) in enumerate(zip(ptrs, sizes)):
        data = (np.arange(n, dtype=np.uint64) * (i + 7) % 251).astype(np.uint8)
        arr = numba_view(p, n)
        arr.copy_to_device(data)
        assert np.array_equal(arr.copy_to_host(), data)
    for p in ptrs:
        pool.deallocate(p)
    pool.trim()
    st = pool.stats()
    assert st["bytes_reserved"] == 0 and st["page_unmaps"] == st["page_maps"], st


def test_growth_past_the_peak_reuses_pages_and_blocks_stay_usable():
    pool = growable_pool(growable_free_limit=0)  # every free page may move
    live = [pool.allocate(n * MiB) for n in (8, 8, 8)]
    pool.deallocate(live[1])
    pool.synchronize()
    big = pool.allocate(30 * MiB)  # the hole's pages move under it: unmapped, mapped again
    st = pool.stats()
    assert st["peak_bytes_reserved"] <= 48 * MiB, st
    assert st["page_creates"] * MiB * 2 == st["peak_bytes_reserved"], st  # no page made twice
    arr = numba_view(big, 30 * MiB)
    arr.copy_to_device(np.full(30 * MiB, 3, np.uint8))
    assert int(arr.copy_to_host().sum()) == 3 * 30 * MiB
    for p in (live[0], live[2], big):
        pool.deallocate(p)


def test_growable_requests_take_the_initial_fixed_segment_first():
    """initial_pool_size's segment (cuMemAlloc) serves large requests before any page is
    mapped: otherwise it would sit idle beside new pages."""
    pool = growable_pool(initial_size=64 * MiB)
    a, b = pool.allocate(40 * MiB, tag=CUPY_TAG), pool.allocate(20 * MiB, tag=CUPY_TAG)
    st = pool.stats()
    assert st["bytes_reserved"] == 64 * MiB and st["page_maps"] == 0, st
    c = pool.allocate(8 * MiB, tag=CUPY_TAG)  # past it: pages
    assert pool.stats()["page_maps"] == 4, pool.stats()
    for i, (p, n) in enumerate(((a, 40 * MiB), (b, 20 * MiB), (c, 8 * MiB))):
        arr = numba_view(p, n)
        arr.copy_to_device(np.full(n, i + 1, np.uint8))
        assert int(arr.copy_to_host().sum()) == (i + 1) * n
    for p in (a, b, c):
        pool.deallocate(p)


@pytest.mark.ipc
def test_block_of_a_growable_segment_refuses_legacy_ipc_clearly():
    pool = growable_pool()
    for tag in (CUPY_TAG, NUMBA_TAG):
        b = pool.allocate(4 * MiB, tag=tag)
        with pytest.raises(_core.PoolError, match="growable segment"):
            pool.ipc_handle(b)
        assert pool.share_pages(b) is not None  # cuMemExportToShareableHandle works
        pool.deallocate(b)
    small = pool.allocate(4096, tag=NUMBA_TAG)  # a small segment: cuIpcGetMemHandle works
    assert pool.ipc_handle(small) is not None
    pool.deallocate(small)


def test_replay_on_the_cuda_driver_is_at_most_1_10_with_2_mib_pages(monkeypatch):
    require("numpy")
    ops = replay.from_slots(*benchmark_module("replay").make_trace())
    # The replay's pool takes the environment's page size: not that of pools made before.
    monkeypatch.setattr(_config, "_applied", None)
    monkeypatch.setattr(_core, "pools", lambda: [])
    monkeypatch.setattr(_core, "pinned_pools", lambda: [])
    monkeypatch.setenv("EMMPOOL_GROWABLE_PAGE_SIZE", "2MiB")
    r = replay.run(ops, "emmpool-growable")
    assert r["ratio"] <= 1.10, r


def test_pages_move_rather_than_come_and_go_on_the_cuda_driver():
    """benchmarks/growable_steps.py over the CUDA driver: free pages move under the requests
    that lack pages (cuMemUnmap + cuMemMap, no cuMemCreate or cuMemRelease), and the pool's
    books agree with the driver's calls. Times are the benchmark's to compare, not this test's."""
    growable_pool()  # skips without VMM
    bench = benchmark_module("growable_steps")
    moved = bench.run("growable", 0, steps=40, seed=1, cuda=True)
    kept = bench.run("growable", 1 << 40, steps=40, seed=1, cuda=True)
    print("growable_steps on the CUDA driver:", moved, kept)
    assert moved["growable"] and kept["growable"]
    assert moved["page_creates_per_step"] * 4 <= moved["page_maps_per_step"], moved
    assert kept["page_unmaps_per_step"] == 0, kept
    assert moved["peak_reserved_mib"] < kept["peak_reserved_mib"], (moved, kept)


@pytest.mark.ipc
@pytest.mark.parametrize("scenario", ["IPC_PRODUCER", "IPC_SAME_SEGMENT_OPEN_TOGETHER",
                                      "IPC_FOREIGN", "ALLOC_SIZES"])
def test_numba_ipc_and_allocations_with_growable_segments(scenario, monkeypatch, numba_package):
    monkeypatch.setenv("EMMPOOL_SEGMENTS", "growable")
    check(run(getattr(gpu_scripts, scenario), mode="pool", package=numba_package))

"""Growable segments on a real GPU (skipped, with the reason, where there is none): the CUDA
driver's virtual memory management behind the seam (cuMemAddressReserve, cuMemCreate, cuMemMap,
cuMemSetAccess, cuMemUnmap), memory that kernels and copies really use, the fragmentation
replay on the CUDA driver, and Numba's IPC with EMMPOOL_SEGMENTS=growable.

`.ci/gpu.py` runs these in every GPU run; `EMMPOOL_SEGMENTS=growable python3 .ci/gpu.py --only
pytest` runs every other GPU test (Numba's, CuPy's, PyTorch's) in that mode as well."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from emmpool import _core, replay
from tests import gpu_scripts
from tests.conftest import benchmark_module
from tests.test_gpu_numba import check, run

pytestmark = pytest.mark.gpu
MiB = 1 << 20
NUMBA_TAG, CUPY_TAG = 1, 2


def growable_pool(**options):
    options.setdefault("growable_room", 0)
    pool = _core.DevicePool(None, 0, segments="growable", **options)
    if not pool.growable:
        pytest.skip("device 0 does not support virtual memory management "
                    "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)")
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
    pool = growable_pool()
    live = [pool.allocate(n * MiB) for n in (8, 8, 8)]
    pool.deallocate(live[1])
    pool.synchronize()
    big = pool.allocate(30 * MiB)  # new peak: the hole's pages go back first
    assert pool.stats()["peak_bytes_reserved"] <= 48 * MiB
    arr = numba_view(big, 30 * MiB)
    arr.copy_to_device(np.full(30 * MiB, 3, np.uint8))
    assert int(arr.copy_to_host().sum()) == 3 * 30 * MiB
    for p in (live[0], live[2], big):
        pool.deallocate(p)


@pytest.mark.ipc
def test_block_of_a_growable_segment_refuses_ipc_clearly():
    pool = growable_pool()
    c = pool.allocate(4 * MiB, tag=CUPY_TAG)
    with pytest.raises(_core.PoolError, match="growable segment"):
        pool.ipc_handle(c)
    n = pool.allocate(4 * MiB, tag=NUMBA_TAG)  # fixed segment: cuIpcGetMemHandle works
    assert pool.ipc_handle(n) is not None
    pool.deallocate(c)
    pool.deallocate(n)


def test_replay_on_the_cuda_driver_is_at_most_1_10():
    pytest.importorskip("numpy")
    ops = replay.from_slots(*benchmark_module("replay").make_trace())
    r = replay.run(ops, "emmpool-growable")
    assert r["ratio"] <= 1.10, r


def test_hysteresis_maps_fewer_pages_per_step_on_the_cuda_driver():
    """benchmarks/growable_steps.py over the CUDA driver: at a new peak only the free pages that
    keep reserved at the peak are unmapped; far fewer cuMemMap/cuMemUnmap per step, and no
    slower per step (each map is cuMemCreate + cuMemMap + cuMemSetAccess)."""
    growable_pool()  # skips without VMM
    bench = benchmark_module("growable_steps")
    off = bench.run("growable", False, steps=40, seed=1, cuda=True)
    on = bench.run("growable", True, steps=40, seed=1, cuda=True)
    print("growable_steps on the CUDA driver:", off, on)
    assert on["growable"] and off["growable"]
    assert on["page_maps_per_step"] * 2 <= off["page_maps_per_step"], (on, off)
    assert on["ms_per_step"] <= off["ms_per_step"] * 1.10, (on, off)


@pytest.mark.ipc
@pytest.mark.parametrize("scenario", ["IPC_PRODUCER", "IPC_SAME_SEGMENT_OPEN_TOGETHER",
                                      "IPC_FOREIGN", "ALLOC_SIZES"])
def test_numba_ipc_and_allocations_with_growable_segments(scenario, monkeypatch, numba_package):
    monkeypatch.setenv("EMMPOOL_SEGMENTS", "growable")
    check(run(getattr(gpu_scripts, scenario), mode="pool", package=numba_package))

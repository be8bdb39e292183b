"""Numba's device_extents (and device_memory_size through it) with the plugin: the block that
holds an array, or a view inside it, not the segment other arrays share; for any other memory,
the driver's answer as before. Over the host driver, without a GPU: Numba's MemoryPointer, its
views and DeviceNDArray are made as on a GPU. test_gpu_numba.py checks the same on a GPU,
through the installed plugin, with a real memset."""

from __future__ import annotations

import importlib

import pytest

from emmpool import _core, _numba_extents
from emmpool import _numba_packages as packages
from tests.conftest import needs_package

SEGMENT = (1 << 44, 1 << 45)  # what the fake "driver" says: one big allocation


@pytest.fixture(params=[p.name for p in packages.PACKAGES])
def driver(request):
    """The driver module of each package that provides Numba's CUDA target (skipped where it
    is not installed)."""
    package = next(p for p in packages.PACKAGES if p.name == request.param)
    if package not in packages.installed():
        pytest.skip(needs_package(package))
    return packages.emm_api(package).driver


@pytest.fixture
def asked(driver, monkeypatch):
    """The driver module's device_extents replaced by a fake driver call (restored after the
    test), and no pool registered yet. Returns the pointers the fake was asked about."""
    monkeypatch.setattr(_numba_extents, "_pools", {})
    calls = []

    def from_the_driver(devmem):
        calls.append(driver.device_pointer(devmem))
        return SEGMENT

    monkeypatch.setattr(driver, "device_extents", from_the_driver)
    return calls


def memory(driver, ptr, size):
    return driver.MemoryPointer(None, driver.binding.CUdeviceptr(ptr), size)


def array(driver, ptr, n):
    devicearray = importlib.import_module(driver.__name__.rpartition(".")[0] + ".devicearray")
    return devicearray.DeviceNDArray(shape=(n,), strides=(1,), dtype="u1",
                                     gpu_data=memory(driver, ptr, n))


def test_a_pool_block_answers_for_itself_and_views_inside_it(host, driver, asked):
    pool = _core.DevicePool(host, 0)
    a, b = pool.allocate(1000), pool.allocate(1000)  # neighbours in one small segment
    _numba_extents.install(driver, 0, pool)
    assert driver.device_extents(memory(driver, b, 1000)) == (b, b + 1024)
    assert driver.device_extents(memory(driver, b, 1000).view(10)) == (b, b + 1024)
    assert driver.device_extents(memory(driver, a, 1000).view(999, 1000)) == (a, a + 1024)
    # device_memory_size of an array (which has no size of its own) goes through it
    assert driver.device_memory_size(array(driver, a, 1000)) == 1024
    assert asked == []  # the driver was not asked
    pool.deallocate(a)
    pool.deallocate(b)


def test_other_memory_is_the_drivers_answer(host, driver, asked):
    pool = _core.DevicePool(host, 0)
    a = pool.allocate(1000)
    _numba_extents.install(driver, 0, pool)
    pool.deallocate(a)  # freed: no array holds it
    assert driver.device_extents(memory(driver, a, 1000)) == SEGMENT
    foreign = SEGMENT[0] + 4096
    assert driver.device_extents(memory(driver, foreign, 100)) == SEGMENT
    assert asked == [a, foreign]


def test_installed_once_per_module_with_every_devices_pool(driver, asked):
    drv = _core.HostDriver(devices=2, capacity=1 << 30)
    pools = [_core.DevicePool(drv, d) for d in (0, 1)]
    for d, pool in enumerate(pools):
        _numba_extents.install(driver, d, pool)
        _numba_extents.install(driver, d, pool)  # a second context of the device: no change
    wrapper = driver.device_extents
    assert wrapper.__wrapped__.__name__ == "from_the_driver"  # one layer, over the original
    ptrs = [pool.allocate(5000) for pool in pools]
    for ptr in ptrs:
        assert driver.device_extents(memory(driver, ptr + 1, 10)) == (ptr, ptr + 5120)
    assert asked == []
    for pool, ptr in zip(pools, ptrs):
        pool.deallocate(ptr)


def test_a_module_without_the_function_is_left_alone(host, monkeypatch):
    monkeypatch.setattr(_numba_extents, "_pools", {})

    class Elsewhere:  # a driver module of another API
        pass

    _numba_extents.install(Elsewhere, 0, _core.DevicePool(host, 0))
    assert not hasattr(Elsewhere, "device_extents")

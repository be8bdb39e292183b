"""The use_for_* family without a GPU: what each returns, that a second call changes nothing,
and that an allocator another library or the program chose is left in place unless asked.

Numba's own driver modules are used, their state set per test; CuPy, PyTorch and RMM are
stand-ins with the calls emmpool makes of them (the real libraries are exercised on a GPU:
tests/test_gpu_shared.py, test_gpu_torch.py, test_gpu_rmm.py; cuda.core's part is in
tests/test_cuda_core_resource.py)."""

from __future__ import annotations

import sys
import threading
import types

import pytest

import emmpool
from emmpool import _core, _installed, _numba_packages, hooks
from tests.conftest import needs

NATIVE_RMM = hooks._native_rmm  # before any fixture replaces it

Installed, AllocatorConflictError = emmpool.Installed, emmpool.AllocatorConflictError


@pytest.fixture(autouse=True)
def nothing_installed_yet(monkeypatch):
    monkeypatch.setattr(_installed, "_installed", {})


def conflict(call) -> str:
    with pytest.raises(AllocatorConflictError) as raised:
        call()
    return str(raised.value)


# ---- Numba -----------------------------------------------------------------------------------
@pytest.fixture
def numba_drivers(monkeypatch):
    """The driver module of every installed package that provides Numba's CUDA target, as
    before any CUDA use: no manager chosen, no context made (restored after the test)."""
    drivers = {}
    for package in _numba_packages.installed():
        driver = _numba_packages.emm_api(package).driver
        monkeypatch.setattr(driver, "_memory_manager", None)
        monkeypatch.setattr(driver.config, "CUDA_MEMORY_MANAGER", "default")
        monkeypatch.setattr(driver.driver, "devices", {})
        drivers[package.name] = driver
    if not drivers:
        pytest.skip(needs("numba-cuda or numba-cuda-mlir", "pip install 'emmpool[numba]'"))
    return drivers


def test_use_for_numba_gives_every_package_its_manager(numba_drivers):
    from emmpool import plugin

    done = emmpool.use_for_numba()
    managers = tuple(plugin.manager_for(name) for name in numba_drivers)
    assert done == Installed("numba", "memory manager", managers)
    for name, driver in numba_drivers.items():
        assert driver._memory_manager is plugin.manager_for(name)
    assert emmpool.use_for_numba() == done  # idempotent
    assert _installed.installed()["numba"] == done


def test_use_for_numba_keeps_another_manager_unless_asked(numba_drivers, monkeypatch):
    name, driver = next(iter(numba_drivers.items()))
    monkeypatch.setattr(driver.config, "CUDA_MEMORY_MANAGER", "rmm.allocators.numba")
    message = conflict(emmpool.use_for_numba)
    assert "memory manager is rmm.allocators.numba already. emmpool does not replace" in message
    assert "use_for_numba(replace=True)" in message
    assert all(d._memory_manager is None for d in numba_drivers.values())  # nothing was set
    done = emmpool.use_for_numba(replace=True)
    assert driver._memory_manager is done.allocators[0]


def test_use_for_numba_says_a_context_keeps_its_manager(numba_drivers, monkeypatch):
    name, driver = next(iter(numba_drivers.items()))
    made = types.SimpleNamespace(primary_context=types.SimpleNamespace(
        memory_manager=driver.NumbaCUDAMemoryManager(context=None)))
    monkeypatch.setattr(driver.driver, "devices", {0: made})
    message = conflict(emmpool.use_for_numba)
    assert "has made its CUDA context already, with " in message
    assert "NumbaCUDAMemoryManager as memory manager, and a context keeps its manager" in message
    assert "for the contexts Numba makes from now on" in message


# ---- CuPy ------------------------------------------------------------------------------------
@pytest.fixture
def fake_cupy(monkeypatch):
    """``cupy`` as use_for_cupy looks at it (its allocator, its default pool); installing
    emmpool's C entry points is a GPU test's, here a function that says it was installed."""

    class MemoryPool:
        def malloc(self, size):
            raise AssertionError("not called")

    pool = MemoryPool()
    cupy = types.ModuleType("cupy")
    cupy.get_default_memory_pool = lambda: pool
    cupy.cuda = types.SimpleNamespace(allocator=pool.malloc)
    cupy.cuda.get_allocator = lambda: cupy.cuda.allocator
    cupy.cuda.set_allocator = lambda f: setattr(cupy.cuda, "allocator", f)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(hooks, "_cupy_malloc", None)
    installs = []

    def install(c):
        def emmpool_malloc(size):
            raise AssertionError("not called")
        installs.append(emmpool_malloc)
        c.cuda.set_allocator(emmpool_malloc)
        return emmpool_malloc

    monkeypatch.setattr(hooks, "_install_for_cupy", install)
    cupy.installs = installs
    return cupy


def test_use_for_cupy_takes_the_default_pools_place_once(fake_cupy):
    done = emmpool.use_for_cupy()
    assert done == Installed("cupy", "C function allocator", (fake_cupy.installs[0],))
    assert fake_cupy.cuda.get_allocator() is done.allocators[0]
    assert emmpool.use_for_cupy() == done and len(fake_cupy.installs) == 1  # idempotent


def test_use_for_cupy_keeps_another_allocator_unless_asked(fake_cupy):
    def rmm_cupy_allocator(size):
        raise AssertionError("not called")

    fake_cupy.cuda.set_allocator(rmm_cupy_allocator)
    message = conflict(emmpool.use_for_cupy)
    assert message.startswith(f"CuPy allocates through {__name__}."
                              f"{rmm_cupy_allocator.__qualname__} already. "), message
    assert "leave CuPy to it, or call emmpool.use_for_cupy(replace=True)" in message
    assert fake_cupy.cuda.get_allocator() is rmm_cupy_allocator and not fake_cupy.installs
    done = emmpool.use_for_cupy(replace=True)
    assert fake_cupy.cuda.get_allocator() is done.allocators[0]


# ---- PyTorch ---------------------------------------------------------------------------------
@pytest.fixture
def fake_torch(monkeypatch):
    """``torch`` as emmpool's pluggable path uses it, and as use_for_torch looks at what
    allocates: the allocator changed to (none: PyTorch's own), and whether CUDA is initialized.
    emmpool._torch forgets what it installed after the test."""
    from emmpool import _config, _torch

    class CUDAPluggableAllocator:
        def __init__(self, path, malloc, free):
            self.args = (path, malloc, free)

        def allocator(self):
            return self

    state = types.SimpleNamespace(current=None, initialized=False, changes=[])

    def change_current_allocator(allocator):
        state.changes.append(allocator)
        state.current = allocator

    memory = types.SimpleNamespace(
        CUDAPluggableAllocator=CUDAPluggableAllocator,
        change_current_allocator=change_current_allocator,
        _get_current_allocator=lambda: types.SimpleNamespace(allocator=lambda: state.current),
        get_allocator_backend=lambda: "pluggable" if state.current else "native",
    )
    torch = types.ModuleType("torch")
    torch.__version__ = "2.11.0"
    torch.cuda = types.SimpleNamespace(memory=memory, is_initialized=lambda: state.initialized)
    torch.state = state
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(_torch, "_how", None)
    monkeypatch.setattr(_torch, "_installed", [])
    monkeypatch.setattr(_config, "_applied", None)  # EMMPOOL_TORCH_ALLOCATOR read afresh
    monkeypatch.delenv("EMMPOOL_TORCH_ALLOCATOR", raising=False)
    return torch


def test_use_for_torch_returns_how_it_serves_pytorch(fake_torch):
    done = emmpool.use_for_torch("pluggable")
    (allocator,) = fake_torch.state.changes
    assert done == Installed("torch", "pluggable", (allocator,))
    assert allocator.args == (_core.__file__, "emmpool_torch_malloc", "emmpool_torch_free")
    assert emmpool.use_for_torch("pluggable") == done  # idempotent: PyTorch swaps once
    assert emmpool.use_for_torch() == done and len(fake_torch.state.changes) == 1


def test_use_for_torch_follows_the_configuration(fake_torch, monkeypatch):
    # From the environment, as configure(torch_allocator=...) would set it; configure() itself
    # is refused here on a GPU host, where an earlier test of this process made a pool.
    from emmpool import _config

    monkeypatch.setattr(_config, "_applied", None)
    monkeypatch.setenv("EMMPOOL_TORCH_ALLOCATOR", "pluggable")
    assert emmpool.use_for_torch().how == "pluggable"
    with pytest.raises(ValueError, match="allocator='fast': expected 'auto' or 'extension' or "
                                         "'pluggable'"):
        emmpool.use_for_torch("fast")


def test_use_for_torch_keeps_another_allocator_unless_asked(fake_torch):
    fake_torch.state.current = object()  # RMM's, say, changed to before
    message = conflict(lambda: emmpool.use_for_torch("pluggable"))
    assert message.startswith("PyTorch allocates through another allocator already "
                              "('pluggable', installed with torch.cuda.memory."
                              "change_current_allocator). emmpool does not replace"), message
    assert "use_for_torch(replace=True) to ask PyTorch to swap it" in message
    assert not fake_torch.state.changes
    assert emmpool.use_for_torch("pluggable", replace=True).how == "pluggable"


def test_use_for_torch_says_pytorchs_own_allocator_is_in_use(fake_torch):
    fake_torch.state.initialized = True
    message = conflict(lambda: emmpool.use_for_torch("pluggable"))
    assert message.startswith("PyTorch has initialized CUDA with its own caching allocator "
                              "already (call use_for_torch() before PyTorch's first CUDA call)")
    assert not fake_torch.state.changes


def test_dump_torch_snapshot_writes_nothing_where_there_is_no_snapshot(fake_torch, tmp_path,
                                                                       monkeypatch):
    path = tmp_path / "snap.pickle"
    emmpool.use_for_torch("pluggable")  # PyTorch's pluggable allocator takes no snapshot
    with pytest.raises(RuntimeError, match="needs emmpool's PyTorch extension"):
        emmpool.dump_torch_snapshot(str(path))
    assert not path.exists()
    monkeypatch.setitem(sys.modules, "torch", None)  # PyTorch not installed
    for call in (lambda: emmpool.dump_torch_snapshot(str(path)), emmpool.torch_snapshot):
        with pytest.raises(ImportError, match=r"needs PyTorch: pip install 'emmpool\[torch\]'"):
            call()
    assert not path.exists()


# ---- RMM -------------------------------------------------------------------------------------
def test_use_for_rmm_serves_every_device_and_makes_no_pool_until_rmm_allocates(fake_rmm,
                                                                              monkeypatch):
    def no_pool(device):
        raise AssertionError(f"a pool was made for device {device}")

    monkeypatch.setattr(_core, "pool", no_pool)
    done = emmpool.use_for_rmm()
    assert done == Installed("rmm", "callback resource",
                             (emmpool.rmm_resource(0), emmpool.rmm_resource(1)), (0, 1))
    assert [fake_rmm.mr.get_per_device_resource(d) for d in (0, 1)] == list(done.allocators)
    assert emmpool.rmm_resource() is done.allocators[0]  # None: the current device
    assert emmpool.use_for_rmm() == done  # idempotent
    assert emmpool.use_for_rmm([1]) == Installed("rmm", "callback resource",
                                                 (done.allocators[1],), (1,))
    with pytest.raises(ValueError, match="device 2 does not exist: this process sees 2"):
        emmpool.use_for_rmm([2])


def test_the_native_resources_first_build_holds_no_install_lock(fake_rmm, monkeypatch):
    # The native module's first build takes seconds; meanwhile other libraries' installs (and
    # other devices' resources) must not wait for it.
    from emmpool import _rmm

    building, finish = threading.Event(), threading.Event()

    def slow_build():
        building.set()
        finish.wait(10)
        raise _rmm.RmmBuildError("no compiler here")

    monkeypatch.setattr(hooks, "_native_rmm", NATIVE_RMM)  # fake_rmm's stands in for it
    monkeypatch.setattr(hooks, "_rmm_problem", [])
    monkeypatch.setattr(_rmm, "module", slow_build)
    made = []
    thread = threading.Thread(target=lambda: made.append(emmpool.rmm_resource(0)))
    with pytest.warns(RuntimeWarning, match="no compiler here; RMM allocates from emmpool "
                                            "through a Python callback resource"):
        thread.start()
        assert building.wait(10)
        free = hooks.lock.acquire(timeout=5)
        if free:
            hooks.lock.release()
        finish.set()
        thread.join(10)
    assert free, "the install lock was held while the native module was built"
    assert type(made[0]).__name__ == "CallbackMemoryResource"


def test_a_use_for_rmm_that_will_refuse_builds_nothing(fake_rmm, monkeypatch):
    from emmpool import _rmm

    builds = []
    monkeypatch.setattr(hooks, "_native_rmm", NATIVE_RMM)
    monkeypatch.setattr(hooks, "_rmm_problem", [])
    monkeypatch.setattr(_rmm, "module", lambda: builds.append(1))
    fake_rmm.mr.set_per_device_resource(1, fake_rmm.mr.PoolMemoryResource())
    with pytest.raises(AllocatorConflictError):
        emmpool.use_for_rmm()
    with pytest.raises(ValueError, match="device 2 does not exist"):
        emmpool.use_for_rmm([2])
    with pytest.raises(ValueError, match="device 2 does not exist"):
        emmpool.rmm_resource(2)
    assert builds == []


def test_use_for_rmm_keeps_another_resource_unless_asked(fake_rmm):
    pool = fake_rmm.mr.PoolMemoryResource()  # rmm.reinitialize(pool_allocator=True), say
    fake_rmm.mr.set_per_device_resource(1, pool)
    message = conflict(emmpool.use_for_rmm)
    assert message.startswith("RMM's resource for device 1 is tests.conftest.fake_rmm.<locals>."
                              "PoolMemoryResource already. emmpool does not replace"), message
    assert "use_for_rmm(replace=True)" in message
    # nothing changed, on either device
    assert type(fake_rmm.mr.get_per_device_resource(0)) is fake_rmm.mr.CudaMemoryResource
    assert fake_rmm.mr.get_per_device_resource(1) is pool
    assert emmpool.use_for_rmm([0]).devices == (0,)  # another device's choice is its own
    done = emmpool.use_for_rmm(replace=True)
    assert fake_rmm.mr.get_per_device_resource(1) is done.allocators[1]


def test_what_was_installed_is_listed_by_info(fake_rmm, fake_cupy):
    from emmpool import _info

    emmpool.use_for_rmm()
    emmpool.use_for_cupy()
    line = next(line for line in _info._hooks() if line.startswith("use_for_* in this process"))
    assert "cupy (C function allocator), rmm (callback resource)" in line, line


# ---- arguments -----------------------------------------------------------------------------------
def test_record_stream_means_the_current_device_by_default(monkeypatch):
    asked = []

    class Pool:
        def __init__(self, device):
            self.device = device

        def record_stream(self, ptr, stream):
            asked.append((self.device, ptr, stream))

    monkeypatch.setattr(_core, "pool", Pool)
    monkeypatch.setattr(_core, "current_device", lambda: 1)
    emmpool.record_stream(0x7000, 5)
    emmpool.record_stream(0x7000, 5, device=0)
    monkeypatch.setattr(_core, "current_device", lambda: -1)  # no CUDA context current
    emmpool.record_stream(0x7000, 6)
    assert asked == [(1, 0x7000, 5), (0, 0x7000, 5), (0, 0x7000, 6)]


@pytest.mark.parametrize(
    "call",
    [lambda: emmpool.use_for_numba(replace="yes"), lambda: emmpool.use_for_cupy(replace=1),
     lambda: emmpool.use_for_torch(replace=None), lambda: emmpool.use_for_rmm(replace="no"),
     lambda: emmpool.use_for_cuda_core(replace=0)],
)
def test_replace_is_true_or_false(call):
    with pytest.raises(TypeError, match=r"replace=.*: expected True or False"):
        call()

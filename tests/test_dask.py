"""emmpool.dask on a CPU cluster: the plugin and the preload reach every worker, options are
checked on the client, registering again is harmless, statistics come from every worker.

The clusters are distributed's LocalCluster with worker processes (as dask-cuda's
LocalCUDACluster has them); without a GPU no pool is ever made, so what is checked is what
reaches each worker: the configuration and Numba's memory manager.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import needs, require

require("distributed")

import dask  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

import emmpool  # noqa: E402
import emmpool.dask  # noqa: E402
from emmpool import _config, _core  # noqa: E402
from emmpool.dask import EmmPool  # noqa: E402
from tests.processes import run_python  # noqa: E402

pytestmark = pytest.mark.dask

# Every wait is bounded: a cluster that cannot start or answer fails the test in seconds.
TIMEOUTS = {
    "distributed.comm.timeouts.connect": "30s",
    "distributed.comm.timeouts.tcp": "30s",
    "distributed.deploy.lost-worker-timeout": "15s",
}


def local_cluster(**kwargs) -> LocalCluster:
    """A small CPU cluster of worker processes (spawned, each with a nanny), no dashboard.

    The scheduler's HTTP server, which it starts even without a dashboard, takes a free port:
    on its default one (8787) a second cluster, or anything else there, would make it warn."""
    kwargs = {"n_workers": 2, "threads_per_worker": 1, "processes": True,
              "dashboard_address": "127.0.0.1:0", "scheduler_kwargs": {"dashboard": False},
              **kwargs}
    return LocalCluster(**kwargs)


@pytest.fixture(scope="module")
def client():
    """One cluster for the module's plugin tests; each test registers its own options."""
    with dask.config.set(TIMEOUTS), local_cluster() as cluster, Client(cluster) as c:
        c.wait_for_workers(2, timeout=60)
        yield c


def worker_configs(client) -> dict[str, _config.Config]:
    return client.run(emmpool.config)


def numba_managers(client) -> dict[str, str]:
    """Numba's memory manager on each worker, by name (None: not chosen yet, i.e. default)."""

    def manager():
        from numba.cuda.cudadrv import driver

        m = driver._memory_manager
        return None if m is None else f"{m.__module__}.{m.__qualname__}"

    return client.run(manager)


def test_bad_options_fail_on_the_client():
    with pytest.raises(ValueError, match="mode"):
        EmmPool(mode="fast")
    with pytest.raises(ValueError, match="maximum_pool_size='4Gx'"):
        EmmPool(maximum_pool_size="4Gx")
    with pytest.raises(ValueError, match=r"maximum_pool_size=1.5: expected a fraction"):
        EmmPool(maximum_pool_size=1.5)
    with pytest.raises(ValueError, match="exceeds maximum_pool_size"):
        EmmPool(initial_pool_size="2GiB", maximum_pool_size="1GiB")
    with pytest.raises(ValueError, match="pinned_limit"):
        EmmPool(pinned_limit="lots")
    with pytest.raises(TypeError, match="cupy='yes': expected True or False"):
        EmmPool(cupy="yes")
    with pytest.raises(TypeError):
        EmmPool(colour="blue")  # not an option


def test_options_are_checked_without_the_clients_environment(monkeypatch):
    # The workers' environment is theirs: a bad variable on the client must not fail the
    # plugin, and the plugin carries only the options given.
    monkeypatch.setenv("EMMPOOL_MODE", "fast")
    plugin = EmmPool(pinned="numba", cupy=True)
    assert plugin.options == {"pinned": "numba"}
    assert plugin.libraries == ("numba", "cupy")
    assert repr(plugin) == "EmmPool(pinned='numba', numba=True, cupy=True, torch=False, rmm=False, spill=False)"


def test_plugin_reaches_every_worker_present_and_future(client):
    client.register_plugin(EmmPool(mode="passthrough", initial_pool_size="64MiB",
                                   maximum_pool_size="80%", pinned_limit="1GiB"))
    client.cluster.scale(3)
    client.wait_for_workers(3, timeout=60)
    configs = worker_configs(client)
    assert len(configs) == 3
    for cfg in configs.values():
        assert (cfg.mode, cfg.initial_pool_size, cfg.maximum_pool_fraction, cfg.pinned_limit) == (
            "passthrough", 64 << 20, 0.8, 1 << 30)
    assert set(numba_managers(client).values()) == {"emmpool.plugin.EmmPoolManager"}


def test_registering_again_is_harmless_and_applies_new_options(client):
    plugin = EmmPool(mode="pool", maximum_pool_size="2GiB")
    for _ in range(2):
        responses = client.register_plugin(plugin)
        assert {r["status"] for r in responses.values()} == {"OK"}
    # setup run again on the same worker, as a worker restart of the plugin would
    client.run(lambda dask_worker: dask_worker.plugins["emmpool"].setup(dask_worker))
    for cfg in worker_configs(client).values():
        assert (cfg.mode, cfg.maximum_pool_size) == ("pool", 2 << 30)
    # no pool exists on these workers: other options still apply
    client.register_plugin(EmmPool(mode="passthrough", maximum_pool_size="3GiB"))
    for cfg in worker_configs(client).values():
        assert (cfg.mode, cfg.maximum_pool_size) == ("passthrough", 3 << 30)
    assert set(numba_managers(client).values()) == {"emmpool.plugin.EmmPoolManager"}


def test_each_library_is_installed_once_per_process(monkeypatch):
    # PyTorch, for one, refuses a second allocator swap; workers of one process share it.
    installed = []
    monkeypatch.setattr(emmpool.dask, "_installed", set())
    monkeypatch.setattr(emmpool.dask, "_configure", lambda options, where: None)
    monkeypatch.setitem(emmpool.dask._INSTALL, "torch", installed.append)
    for worker in ("worker a", "worker b"):
        emmpool.dask._install({}, ("torch",), worker)
    assert installed == ["worker a"]


def test_setup_errors_reach_the_client_saying_what_to_install(client):
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip(needs("no PyTorch", "it is installed here, so its hook would install, not fail"))
    try:
        with pytest.raises(ImportError, match=r"pip install 'emmpool\[torch\]'"):
            client.register_plugin(EmmPool(torch=True))
    finally:
        # a failed registration stays registered (distributed's rule): not for later tests
        client.unregister_worker_plugin("emmpool")


def test_stats_from_every_worker(client):
    per_worker = emmpool.dask.stats(client)
    assert set(per_worker) == set(client.scheduler_info()["workers"])
    assert all(pools == {} for pools in per_worker.values())  # no GPU: no pool
    rows = [line.split() for line in emmpool.dask.summary(per_worker).splitlines()[1:]]
    assert rows == [[address, "-", "no", "pool", "yet"] for address in sorted(per_worker)]


def test_summary_shows_each_pool(host):
    pool = _core.DevicePool(host, 0)
    pool.allocate(1 << 20, 0, 1)  # tag 1: numba
    pool.allocate(3 << 20, 0, 2)  # tag 2: cupy
    text = emmpool.dask.summary({"tcp://w1:1": {0: pool.stats()}, "tcp://w0:1": {}})
    lines = text.splitlines()
    assert lines[0].split() == ["worker", "device", "in", "use", "peak", "in", "use", "reserved",
                                "peak", "reserved", "allocations"]
    assert lines[1].startswith("tcp://w0:1  -       no pool yet")  # sorted by worker
    row = lines[2].split()
    assert row[:4] == ["tcp://w1:1", "0", "4", "MiB"]
    assert lines[2].endswith("numba 1, cupy 1")


def test_a_pool_that_exists_keeps_its_options(monkeypatch):
    # No GPU here to make a pool: configure() is made to answer as it does once one exists.
    made_with = _config.resolve({"mode": "pool", "maximum_pool_size": "1GiB"}, _config.Config())
    monkeypatch.setattr(_config, "_applied", made_with)

    def pool_exists(**_):
        raise RuntimeError("configure() must be called before the first pool is created")

    monkeypatch.setattr(_core, "configure", pool_exists)
    emmpool.dask._configure({"mode": "pool", "maximum_pool_size": 1 << 30}, "worker w")
    with pytest.raises(RuntimeError, match=r"worker w: .* cannot take mode='passthrough'\. "
                                           r"Register the plugin before the first GPU task"):
        emmpool.dask._configure({"mode": "passthrough"}, "worker w")


def test_numba_choices_made_before_are_reported(monkeypatch):
    from types import SimpleNamespace

    from numba.cuda.cudadrv import driver

    monkeypatch.setattr(driver, "_memory_manager", None)
    monkeypatch.setattr(driver.config, "CUDA_MEMORY_MANAGER", "rmm.allocators.numba")
    with pytest.raises(RuntimeError, match=r"worker w: Numba's memory manager is "
                                           r"rmm\.allocators\.numba already; .*numba=False"):
        emmpool.dask._INSTALL["numba"]("worker w")
    monkeypatch.setattr(driver.config, "CUDA_MEMORY_MANAGER", "default")
    made = SimpleNamespace(primary_context=SimpleNamespace(
        memory_manager=driver.NumbaCUDAMemoryManager(context=None)))
    monkeypatch.setattr(driver.driver, "devices", {0: made})
    with pytest.raises(RuntimeError, match="worker w: Numba has made its CUDA context"):
        emmpool.dask._INSTALL["numba"]("worker w")
    assert driver._memory_manager is None  # nothing was changed


def test_cupy_allocator_chosen_before_is_reported():
    cupy = require("cupy")

    def rmm_cupy_allocator(size):  # stands for RMM's, as dask-cuda installs it
        raise AssertionError("not called")

    before = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(rmm_cupy_allocator)
    try:
        with pytest.raises(RuntimeError, match=r"worker w: CuPy allocates through "
                                               r"\S*rmm_cupy_allocator already.*cupy=False"):
            emmpool.dask._INSTALL["cupy"]("worker w")
    finally:
        cupy.cuda.set_allocator(before)


def test_rmm_is_put_on_the_pool_unless_another_resource_was_chosen(monkeypatch, fake_rmm):
    """EmmPool(rmm=True): RMM's default resource is replaced by emmpool's; one that dask-cuda
    (or anyone) set is reported, not replaced; without RMM, nothing happens. Only the worker's
    device: another's resource is neither checked nor replaced."""
    other = fake_rmm.mr.PoolMemoryResource()
    fake_rmm.mr.set_per_device_resource(1, other)
    emmpool.dask._for_rmm("worker w")
    assert fake_rmm.mr.get_per_device_resource(0) is emmpool.rmm_resource(0)
    assert fake_rmm.mr.get_per_device_resource(1) is other
    fake_rmm.mr.set_per_device_resource(0, fake_rmm.mr.PoolMemoryResource())
    with pytest.raises(RuntimeError, match=r"worker w: RMM's resource for device 0 is "
                                           r"\S*PoolMemoryResource already.*rmm=False"):
        emmpool.dask._for_rmm("worker w")
    monkeypatch.setitem(sys.modules, "rmm", None)  # not installed: nothing to do
    emmpool.dask._for_rmm("worker w")
    assert repr(EmmPool(rmm=True)).count("rmm=True") == 1


def test_preload_takes_its_options_and_the_workers_environment():
    with dask.config.set(TIMEOUTS), local_cluster(
        n_workers=1, preload=["emmpool.dask"],
        preload_argv=["--emmpool-mode=passthrough", "--emmpool-maximum-pool-size", "0.5"],
        env={"EMMPOOL_PINNED_LIMIT": "1GiB"},
    ) as cluster, Client(cluster) as client:
        client.wait_for_workers(1, timeout=60)
        (cfg,) = worker_configs(client).values()
        assert (cfg.mode, cfg.maximum_pool_fraction, cfg.pinned_limit) == (
            "passthrough", 0.5, 1 << 30)
        assert set(numba_managers(client).values()) == {"emmpool.plugin.EmmPoolManager"}


@pytest.mark.parametrize("argv, message", [
    (["--emmpool-initial-pool-size=2GiB", "--emmpool-maximum-pool-size=1GiB"],
     "emmpool.dask: initial_pool_size (2147483648) exceeds maximum_pool_size"),
    (["--emmpool-mode=fast"], "emmpool.dask: mode='fast'"),
])
def test_preload_bad_options_stop_dask_worker_before_it_starts(argv, message):
    # The scheduler address is never reached: the command line is refused first.
    worker = [sys.executable, "-m", "distributed.cli.dask_worker", "tcp://127.0.0.1:9",
              "--preload", "emmpool.dask", *argv]
    done = subprocess.run(worker, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_emmpool_works_without_distributed_and_emmpool_dask_says_what_to_install():
    code = (
        "import sys\n"
        "sys.modules['distributed'] = None  # as if not installed\n"
        "import emmpool\n"
        "emmpool.configure(maximum_pool_size='50%')\n"
        "try:\n"
        "    import emmpool.dask\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install 'emmpool[dask]'" in done.stdout


SPILL_SCRIPT = textwrap.dedent(
    """
    import types
    import zict
    import emmpool
    from emmpool import _core
    from emmpool.dask import DeviceSpiller, EmmPool
    MiB = 1 << 20
    host = _core.HostDriver(devices=1, capacity=64 * MiB)
    host.set_auto_complete(True)
    _core._use_driver_for_all_pools(host)
    pool = _core.pool(0)

    class DeviceArray:  # a CuPy array's life: a block of the pool until it is dropped
        def __init__(self, nbytes):
            self.nbytes, self.ptr = nbytes, pool.allocate(nbytes, _core.LEGACY_STREAM, 2)
        def __del__(self):
            pool.deallocate_tagged(self.ptr, _core.ALLOCATION_STREAM, 2)

    # dask-cuda's DeviceHostFile with a device_memory_limit: device objects in a zict.Buffer
    # whose slow side serializes them to host memory.
    device_buffer = zict.Buffer(
        {}, zict.Func(lambda a: ("on host", a.nbytes), lambda h: DeviceArray(h[1]), {}),
        n=1 << 40, weight=lambda k, v: v.nbytes)
    worker = types.SimpleNamespace(address="tcp://w", data=types.SimpleNamespace(
        device_buffer=device_buffer))
    for key in "abc":
        device_buffer[key] = DeviceArray(16 * MiB)        # 48 of 64 MiB

    EmmPool(spill=True).setup(worker)                     # installs the worker's spiller
    big = pool.allocate(32 * MiB)                         # needs 16 MiB more: spills a, then b
    assert list(device_buffer.fast) == ["c"] and sorted(device_buffer.slow) == ["a", "b"]
    assert device_buffer["a"].nbytes == 16 * MiB          # and it comes back when asked
    pool.deallocate(big)

    spiller = DeviceSpiller(worker)
    assert spiller(0, 1, {}) and spiller.spilled_bytes > 0
    nothing = DeviceSpiller(types.SimpleNamespace(address="w", data={}))  # no device LRU
    assert not nothing(0, 1 << 20, {})

    assert device_buffer["a"].nbytes == 16 * MiB          # on the device again: 60 MiB more
    EmmPool().setup(worker)                               # registered again without spill
    try:
        pool.allocate(60 * MiB)
    except emmpool.OutOfMemoryError:
        pass
    else:
        raise AssertionError("the callback was not taken away")
    print("OK")
    """
)


def test_spill_moves_device_data_to_host_and_the_allocation_succeeds():
    # What EmmPool(spill=True) does on a dask-cuda worker, over a host driver: out of memory,
    # its least recently used device data goes to host, and the allocation is tried again.
    p = run_python(["-c", SPILL_SCRIPT], timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr

"""emmpool on every Dask worker: a worker plugin, a worker preload, per-worker statistics.

From a client, for the workers present and those that join later::

    from emmpool.dask import EmmPool, stats, summary
    client.register_plugin(EmmPool(maximum_pool_size="80%", cupy=True))
    ...
    print(summary(stats(client)))

or on the command line (the options of :class:`EmmPool`; those not given come from the
worker's ``EMMPOOL_*`` variables)::

    dask worker SCHEDULER --preload emmpool.dask --emmpool-maximum-pool-size=80% --emmpool-cupy

Why a WorkerPlugin, and no NannyPlugin: nothing has to be in a worker's environment before its
process starts. The plugin's setup runs inside the worker process before the worker's first
task (on a worker present at registration at once; on one that joins later as it registers,
before the scheduler can send it a task). There it calls :func:`emmpool.configure`, which
precedes the first pool (emmpool reads its variables only then), and
``numba.cuda.set_memory_manager``, which does what ``NUMBA_CUDA_MEMORY_MANAGER`` does until Numba
makes its CUDA context. What no plugin can change is a worker that has used the GPU already: a
pool keeps the options it was made with, a Numba context its memory manager. setup() reports
that as an error naming the worker; ``client.restart()`` gives fresh workers, which run the
plugin as they join.
"""

from __future__ import annotations

import threading
from dataclasses import fields

try:
    import click
    from distributed import Worker, WorkerPlugin
except ImportError as e:
    raise ImportError(
        "emmpool.dask needs Dask's distributed scheduler: pip install 'emmpool[dask]' "
        "(dask-cuda on top for LocalCUDACluster)"
    ) from e

from . import AllocatorConflictError, _args, _config, _core, config, configure
from . import set_out_of_memory_callback, use_for_cupy, use_for_numba, use_for_rmm, use_for_torch
from . import stats as _pool_stats
from ._args import format_bytes

__all__ = ["DeviceSpiller", "EmmPool", "dask_setup", "stats", "summary"]

_log = _config.log.getChild("dask")


class EmmPool(WorkerPlugin):
    """Configure emmpool on every worker and make Numba, CuPy and PyTorch allocate from it.

    Register it with ``client.register_plugin(EmmPool(...))``: it runs on every worker present
    and on every worker that joins later.

    Parameters
    ----------
    mode, initial_pool_size, maximum_pool_size, pinned, pinned_limit, log
        As :func:`emmpool.configure` takes them: sizes as bytes or strings such as ``'4GiB'``,
        ``maximum_pool_size`` also as a fraction of the device's memory (``0.8``, ``'80%'``).
        An option not given (None) keeps the worker's ``EMMPOOL_*`` value, or the default.
    numba, cupy, torch : bool
        The libraries that allocate from emmpool on the workers (default: Numba alone).
    rmm : bool
        RMM's current device resource on emmpool's pool (:func:`emmpool.rmm_resource`). Where
        RMM imports, distributed makes the device arrays a worker receives from another, and
        dask-cuda those it brings back from host, as ``rmm.DeviceBuffer``s: without this they
        come from RMM's own resource, outside emmpool's pool and its cap. Nothing where RMM
        does not import.
    spill : bool
        When an allocation on the worker cannot be served, spill the worker's device data to
        host memory (least recently used first) and try again, instead of failing the task
        (:func:`emmpool.set_out_of_memory_callback`). It needs a worker that keeps device data
        apart from host data, as dask-cuda's workers do where ``device_memory_limit`` is set
        (``LocalCUDACluster(device_memory_limit=...)``, ``dask cuda worker
        --device-memory-limit``): their ``DeviceHostFile`` spills when tracked device data
        passes the limit, this spills on demand below it. Elsewhere it spills nothing. The
        callback is the process's: where several workers share one (``processes=False``), the
        last one set up is the one whose data spills.

    Raises
    ------
    ValueError, TypeError
        At construction, on the client, for a bad option: before anything is sent.

    Notes
    -----
    Registering again (the same or other options) is harmless: the plugin has one name, so the
    new one replaces the old and its setup runs again on every worker, which configures the
    pool anew where it does not exist yet, finds the same options where it does, and installs
    emmpool for each library once per process. Setup fails, naming the worker, where a pool
    exists with other options, where Numba made its CUDA context before, or where another
    allocator serves a library already (RMM's, say: for CuPy by dask-cuda's
    ``rmm_allocator_external_lib_list``, for Numba by ``NUMBA_CUDA_MEMORY_MANAGER``; a pool
    for RMM itself by ``rmm_pool_size``): emmpool does not replace another library's choice
    (the ``use_for_*`` family's :class:`emmpool.AllocatorConflictError`). A registration that
    failed stays registered, as any worker plugin does in distributed: register a corrected one
    (same name), or ``client.unregister_worker_plugin("emmpool")``. The pool and the installed
    allocators stay for the worker's life; unregistering the plugin does not remove them.
    """

    name = "emmpool"
    # False: registering again replaces the plugin, so changed options reach the workers
    # (True would make the scheduler keep the first plugin and drop the new one unseen).
    idempotent = False

    def __init__(
        self,
        *,
        mode: str | None = None,
        initial_pool_size: int | str | None = None,
        maximum_pool_size: int | float | str | None = None,
        pinned: str | None = None,
        pinned_limit: int | str | None = None,
        log: str | None = None,
        numba: bool = True,
        cupy: bool = False,
        torch: bool = False,
        rmm: bool = False,
        spill: bool = False,
    ):
        given = dict(mode=mode, initial_pool_size=initial_pool_size,
                     maximum_pool_size=maximum_pool_size, pinned=pinned,
                     pinned_limit=pinned_limit, log=log)
        self.options = {k: v for k, v in given.items() if v is not None}
        # Checked against the defaults: the client cannot see the workers' environment.
        _config.resolve(self.options, _config.Config())
        chosen = dict(numba=numba, cupy=cupy, torch=torch, rmm=rmm)
        for library, on in {**chosen, "spill": spill}.items():
            _args.flag(on, library)
        self.libraries = tuple(library for library, on in chosen.items() if on)
        self.spill = spill

    def __repr__(self) -> str:
        args = [f"{k}={v!r}" for k, v in self.options.items()]
        args += [f"{library}={library in self.libraries}" for library in _INSTALL]
        args += [f"spill={self.spill}"]
        return f"EmmPool({', '.join(args)})"

    def setup(self, worker: Worker) -> None:
        _install(self.options, self.libraries, f"worker {worker.address}")
        # Registering again without spill=True takes the callback away.
        self.spiller = DeviceSpiller(worker) if self.spill else None  # its counts, on the worker
        set_out_of_memory_callback(self.spiller)

    def teardown(self, worker: Worker) -> None:
        # The callback is the process's: a worker that goes takes its spiller with it.
        spiller = getattr(self, "spiller", None)
        if spiller is not None and spiller.worker is worker:
            set_out_of_memory_callback(None)


# Several workers may share a process (LocalCluster(processes=False)): what is installed is
# the process's, and one setup at a time installs it.
_lock = threading.Lock()
_installed: set[str] = set()


def _install(options: dict, libraries: tuple[str, ...], where: str) -> None:
    with _lock:
        _configure(options, where)
        for library in libraries:
            if library not in _installed:
                _INSTALL[library](where)
                _installed.add(library)
    _log.info("%s: %s; emmpool allocates for %s", where, config(),
              ", ".join(sorted(_installed)) or "no library")


def _configure(options: dict, where: str) -> None:
    """configure(**options); or nothing where a pool made with these options exists (setup
    ran before and the worker has allocated since)."""
    try:
        configure(**options)
    except RuntimeError:  # a pool exists
        in_force, wanted = config(), _config.resolve(options)
        if in_force != wanted:
            changes = ", ".join(
                f"{f.name}={getattr(wanted, f.name)!r}" for f in fields(_config.Config)
                if getattr(in_force, f.name) != getattr(wanted, f.name)
            )
            raise RuntimeError(
                f"{where}: emmpool's pool exists already (the worker has used the GPU), made "
                f"with {in_force}; it cannot take {changes}. Register the plugin before the "
                f"first GPU task, or restart the workers (client.restart()): they run it as "
                f"they join"
            ) from None


# Where each library's allocator may have been chosen before on a Dask worker: what the error
# says beside AllocatorConflictError's own sentence.
_CHOSEN_BY = {
    "numba": "",
    "cupy": " (RMM's where dask-cuda's rmm_allocator_external_lib_list names 'cupy')",
    "torch": " (RMM's where dask-cuda's rmm_allocator_external_lib_list names 'torch')",
    "rmm": " (dask-cuda's rmm_pool_size or rmm_async sets one)",
}
_NAMES = {"numba": "Numba", "cupy": "CuPy", "torch": "PyTorch", "rmm": "RMM"}


def _for(library: str, install, where: str) -> None:
    """``install()`` (a use_for_*), its refusal to replace another's allocator said for a
    worker: which one, and how to leave that library to it."""
    try:
        install()
    except AllocatorConflictError as e:
        raise RuntimeError(
            f"{where}: {e.situation}{_CHOSEN_BY[library]}; emmpool does not replace another "
            f"library's choice: leave {_NAMES[library]} to it (EmmPool({library}=False)), or "
            f"drop that setting"
        ) from None


def _for_rmm(where: str) -> None:
    try:
        import rmm.mr  # noqa: F401
    except ImportError:
        return  # distributed then makes Numba's arrays, which emmpool serves
    # The worker's device only (dask-cuda gives each worker one, first in CUDA_VISIBLE_DEVICES):
    # another device's RMM resource is not this worker's to check or to replace.
    _for("rmm", lambda: use_for_rmm([_core.current_device()]), where)


_INSTALL = {
    "numba": lambda where: _for("numba", use_for_numba, where),
    "cupy": lambda where: _for("cupy", use_for_cupy, where),
    "torch": lambda where: _for("torch", use_for_torch, where),
    "rmm": _for_rmm,
}


class _SetupCommand(click.Command):
    """The preload's command line, checked as a whole once parsed.

    distributed parses a preload's arguments when ``dask worker`` parses its own, and again as
    each worker starts: a bad option stops ``dask worker`` with a usage error before any worker
    starts, where an error in dask_setup itself would only be logged by the worker."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        try:
            EmmPool(**_plugin_options(ctx.params))
        except (TypeError, ValueError) as e:
            raise click.UsageError(f"emmpool.dask: {e}", ctx) from None
        return rest


def _plugin_options(params: dict) -> dict:
    return {name.removeprefix("emmpool_"): value for name, value in params.items()}


@click.command(cls=_SetupCommand)
@click.option("--emmpool-mode", help="pool or passthrough (as EMMPOOL_MODE)")
@click.option("--emmpool-initial-pool-size", help="bytes, or a size such as 4GiB")
@click.option("--emmpool-maximum-pool-size",
              help="a size, or a fraction of the device's memory: 0.8 or 80%")
@click.option("--emmpool-pinned", help="pool or numba (as EMMPOOL_PINNED)")
@click.option("--emmpool-pinned-limit", help="a size: pinned bytes the cache may hold")
@click.option("--emmpool-log", help="warning, info or debug")
@click.option("--emmpool-numba/--no-emmpool-numba", default=True, show_default=True,
              help="Numba allocates from emmpool")
@click.option("--emmpool-cupy/--no-emmpool-cupy", default=False, show_default=True,
              help="CuPy allocates from emmpool")
@click.option("--emmpool-torch/--no-emmpool-torch", default=False, show_default=True,
              help="PyTorch allocates from emmpool")
@click.option("--emmpool-rmm/--no-emmpool-rmm", default=False, show_default=True,
              help="RMM's current device resource on emmpool's pool")
@click.option("--emmpool-spill/--no-emmpool-spill", default=False, show_default=True,
              help="out of device memory, spill device data to host and try again")
def dask_setup(worker, **params) -> None:
    """``dask worker --preload emmpool.dask``: :class:`EmmPool`'s setup on this worker.

    Options not given keep the worker's ``EMMPOOL_*`` values, or the defaults. A preload runs
    before the worker's own plugins: under ``dask cuda worker``, a library that
    ``--set-rmm-allocator-for-libs`` names is given to RMM afterwards, so leave it out here
    (``--no-emmpool-cupy``)."""
    if not isinstance(worker, Worker):
        raise TypeError(
            f"emmpool.dask is a worker preload (dask worker --preload emmpool.dask), not one "
            f"for a {type(worker).__name__}"
        )
    EmmPool(**_plugin_options(params)).setup(worker)


class DeviceSpiller:
    """The out-of-memory callback of a worker (:func:`emmpool.set_out_of_memory_callback`):
    moves the worker's least recently used device data to host memory until the bytes moved
    cover the request, and says whether it moved anything.

    The worker's data must keep device objects in an LRU of its own: ``worker.data.device_buffer``
    a ``zict.Buffer`` whose ``fast`` part holds them, as dask-cuda's ``DeviceHostFile`` does with
    a ``device_memory_limit`` (its ``slow`` part serializes to host memory). zict's buffers
    take their own lock, so tasks on several threads may spill at once. A value still used by
    a running task is moved all the same; its device memory comes back when that task lets go
    of it."""

    def __init__(self, worker):
        self.worker = worker
        self.spilled_bytes = 0   # moved to host by this callback, over the worker's life
        self.spills = 0          # calls that moved something

    def __call__(self, device: int, size: int, stats: dict) -> bool:
        lru = getattr(getattr(self.worker.data, "device_buffer", None), "fast", None)
        if lru is None or not hasattr(lru, "evict"):
            return False  # no device LRU: nothing this callback may spill
        moved = 0
        while moved < size:
            try:
                _, _, weight = lru.evict()  # least recently used first
            except Exception:  # noqa: BLE001 - empty (zict raises), or a value that cannot move
                break
            moved += max(int(weight), 0)
            if weight <= 0 and not len(lru):
                break
        if moved == 0:
            return False
        self.spilled_bytes += moved
        self.spills += 1
        _log.info("worker %s spilled %s of device data to host for an allocation of %s",
                  self.worker.address, format_bytes(moved), format_bytes(size))
        return True


def stats(client) -> dict[str, dict[int, dict]]:
    """:func:`emmpool.stats` of every worker of ``client``'s cluster, by worker address.

    A worker that has not allocated through emmpool yet reports ``{}``. Under dask-cuda's
    LocalCUDACluster each worker sees its own GPU as device 0 (CUDA_VISIBLE_DEVICES)."""
    return client.run(_pool_stats)


def summary(per_worker: dict[str, dict[int, dict]]) -> str:
    """:func:`stats`' result as a table: a row per worker and device."""
    rows = [("worker", "device", "in use", "peak in use", "reserved", "peak reserved",
             "allocations")]
    for worker, pools in sorted(per_worker.items()):
        if not pools:
            rows.append((worker, "-", "no pool yet", "", "", "", ""))
        for device, s in sorted(pools.items()):
            by_library = ", ".join(f"{library} {t['allocations']}"
                                   for library, t in s["by_library"].items() if t["allocations"])
            rows.append((worker, str(device), *(format_bytes(s[k]) for k in (
                "bytes_in_use", "peak_bytes_in_use", "bytes_reserved", "peak_bytes_reserved")),
                by_library or "0"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)

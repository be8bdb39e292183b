"""emmpool: one stream-safe GPU memory pool per device, shared by Numba, cuda.core, CuPy,
PyTorch and RMM.

Importing emmpool touches no GPU: the CUDA driver is loaded on first use.

The ``use_for_*`` family makes a library allocate from the pool. Each returns an
:class:`Installed` (what the library was given), is idempotent, and leaves an allocator another
library or the program chose in place, raising :class:`AllocatorConflictError`, unless called
with ``replace=True``. Where one device is asked for, ``device=None`` means the current device
(0 where no CUDA context is current); where several, ``devices=None`` means every device.
"""

from __future__ import annotations

from . import _args, _config, _core, _installed
from ._config import Config, UnknownVariableWarning, config, configure
from ._core import CudaError, DriverUnavailableError, OutOfMemoryError, PoolError
from ._installed import AllocatorConflictError, Installed
from ._numba_packages import UntestedVersionWarning

__version__ = "0.1.0"

__all__ = [
    "AllocatorConflictError",
    "Config",
    "CudaError",
    "DriverUnavailableError",
    "Installed",
    "OutOfMemoryError",
    "PoolError",
    "UnknownVariableWarning",
    "UntestedVersionWarning",
    "config",
    "configure",
    "cuda_core_resource",
    "dump_torch_snapshot",
    "record_stream",
    "reset_peak_stats",
    "rmm_resource",
    "set_out_of_memory_callback",
    "stats",
    "torch_snapshot",
    "trim",
    "use_for_cuda_core",
    "use_for_cupy",
    "use_for_numba",
    "use_for_rmm",
    "use_for_torch",
]


def use_for_numba(*, replace: bool = False) -> Installed:
    """Make Numba allocate device memory from emmpool: every installed package that provides
    Numba's CUDA target (numba-cuda, numba-cuda-mlir) gets its manager class from
    :mod:`emmpool.plugin`. Call before that package's first CUDA use: a context Numba has made
    keeps its manager (AllocatorConflictError; ``replace=True`` serves the contexts made from
    then on), as does another manager chosen before (``NUMBA_CUDA_MEMORY_MANAGER``,
    ``set_memory_manager``).

    Returns ``Installed("numba", "memory manager", (manager class per package,))``. Applies the
    configuration (``EMMPOOL_*``, or :func:`configure` before): a bad value raises ``ValueError``
    here rather than at Numba's first allocation. Raises ImportError saying what to install when
    neither package is installed."""
    from . import hooks

    return hooks.use_for_numba(_args.flag(replace, "replace"))


def use_for_cuda_core(devices=None, *, replace: bool = False) -> Installed:
    """Make cuda.core allocate from emmpool: each device's ``Device(i).memory_resource``
    becomes :func:`cuda_core_resource` ``(i)`` (default: every device). cuda.core's Device
    objects are per thread: this sets the calling thread's. A resource other than cuda.core's
    own is left in place (AllocatorConflictError) unless ``replace=True``.

    Returns ``Installed("cuda_core", "memory resource", (resource per device,), devices)``.
    (The Numba plugin installs the resource itself for the Device Numba allocates through.)"""
    devices = _args.devices(devices)
    replace = _args.flag(replace, "replace")
    from . import cuda_core

    resources = cuda_core.install(devices, replace=replace)
    return _installed.record(Installed("cuda_core", "memory resource", tuple(resources),
                            tuple(mr.device_id for mr in resources)))


def cuda_core_resource(device: int | None = None):
    """emmpool's ``cuda.core.MemoryResource`` for ``device`` (default: the current device, else
    0): :class:`emmpool.cuda_core.EmmPoolMemoryResource`."""
    if device is not None:
        device = _args.device(device)
    from . import cuda_core

    return cuda_core.resource(device)


def use_for_cupy(*, replace: bool = False) -> Installed:
    """Make CuPy allocate from emmpool's pools (a C function allocator: no Python per call).
    CuPy's default memory pool is replaced; another allocator set before (RMM's, say) is left
    in place (AllocatorConflictError) unless ``replace=True``.

    Returns ``Installed("cupy", "C function allocator", (the function CuPy was given,))``;
    see :func:`emmpool.hooks.use_for_cupy`."""
    replace = _args.flag(replace, "replace")
    from . import hooks

    return hooks.use_for_cupy(replace)


def use_for_torch(allocator: str | None = None, *, replace: bool = False) -> Installed:
    """Make PyTorch allocate from emmpool's pools, before PyTorch's first CUDA allocation.
    ``allocator``: ``"auto"`` (default: ``EMMPOOL_TORCH_ALLOCATOR``, or
    ``configure(torch_allocator=...)``), ``"extension"`` or ``"pluggable"``. PyTorch swaps no
    allocator once one is initialized: another library's, or its own once CUDA is initialized,
    raises AllocatorConflictError (``replace=True`` asks PyTorch all the same).

    Returns ``Installed("torch", how, (the allocator,))``, ``how`` being ``"extension"`` or
    ``"pluggable"``; see :func:`emmpool.hooks.use_for_torch`."""
    if allocator is not None and not isinstance(allocator, str):
        raise TypeError(f"allocator must be {', '.join(repr(c) for c in _config.TORCH_ALLOCATORS)}"
                        f" or None, not {type(allocator).__name__}")
    replace = _args.flag(replace, "replace")
    from . import hooks

    return hooks.use_for_torch(allocator, replace)


def use_for_rmm(devices=None, *, replace: bool = False) -> Installed:
    """Make RMM allocate from emmpool's pools: each device's RMM resource becomes
    :func:`rmm_resource` of that device (default: every device; a pool is made where RMM
    allocates). RMM's default resource is replaced; another (``rmm.reinitialize``'s pool,
    dask-cuda's) is left in place (AllocatorConflictError) unless ``replace=True``.

    Returns ``Installed("rmm", how, (resource per device,), devices)``, ``how`` being
    ``"native resource"`` (built against the RMM installed: no Python per allocation) or
    ``"callback resource"`` (where it cannot be built; a warning says why)."""
    devices = _args.devices(devices)
    replace = _args.flag(replace, "replace")
    from . import hooks

    return hooks.use_for_rmm(devices, replace)


def torch_snapshot() -> dict:
    """PyTorch's memory snapshot of emmpool's pool, every other library's blocks named (see
    :func:`emmpool._torch.torch_snapshot`)."""
    from . import hooks

    hooks.import_torch("emmpool.torch_snapshot()")
    from ._torch import torch_snapshot as _snapshot

    return _snapshot()


def dump_torch_snapshot(filename: str = "dump_snapshot.pickle") -> None:
    """:func:`torch_snapshot` pickled for PyTorch's memory viewer (memory_viz). Nothing is
    written where there is no snapshot to take."""
    from . import hooks

    hooks.import_torch("emmpool.dump_torch_snapshot()")
    from ._torch import dump_torch_snapshot as _dump

    _dump(filename)


def rmm_resource(device: int | None = None):
    """emmpool's RMM memory resource for ``device`` (default: the current device, else 0); see
    :func:`emmpool.hooks.rmm_resource`. :func:`use_for_rmm` installs it."""
    if device is not None:
        device = _args.device(device)
    from . import hooks

    return hooks.rmm_resource(device)


def stats(device: int | None = None) -> dict:
    """Statistics of the pools created so far: ``{device: {...}}``, or one device's dict.

    Raises ``ValueError`` naming the variable where an ``EMMPOOL_*`` value is bad (what the
    pools would be made with)."""
    if device is not None:
        device = _args.device(device)
    _config.ensure_configured()
    pools = {p.device: p for p in _core.pools()}
    if device is not None:
        if device not in pools:
            raise ValueError(f"no pool exists for device {device} (it has not allocated yet)")
        return pools[device].stats()
    return {d: p.stats() for d, p in sorted(pools.items())}


def trim() -> int:
    """Wait for pending frees and return every wholly free segment to the driver.

    Returns the number of bytes released."""
    _config.ensure_configured()
    released = sum(p.trim() for p in _core.pools())
    _config.log.info("trim returned %d bytes to the driver", released)
    return released


def reset_peak_stats() -> None:
    """Restart the peak counters of every pool from the current values."""
    _config.ensure_configured()
    for p in _core.pools():
        p.reset_peaks()


def record_stream(ptr: int, stream: int, device: int | None = None) -> None:
    """Declare that ``stream`` (e.g. a non-blocking stream) uses the block at ``ptr``.

    Its free then also waits for the work issued to that stream before the free; without this,
    only work on the freeing stream is waited for (and, for frees that name no stream, as
    Numba's, work on every blocking stream).

    ``ptr``, ``stream`` (a handle: CuPy's ``stream.ptr``, PyTorch's ``stream.cuda_stream``)
    and ``device`` (the block's pool; default: the current device, else 0) are integers:
    anything else raises TypeError before the driver is loaded."""
    ptr = _args.integer(ptr, "ptr", "the device address of a block from emmpool's pool")
    stream = _args.integer(stream, "stream", "a stream handle, e.g. CuPy's stream.ptr or "
                                             "PyTorch's stream.cuda_stream")
    if device is not None:
        device = _args.device(device)
    _config.ensure_configured()
    _core.pool(_args.current_device(device)).record_stream(ptr, stream)


def set_out_of_memory_callback(callback, device: int | None = None) -> None:
    """Ask ``callback(device, size, stats)`` before an allocation on ``device`` (None: every
    device without a callback of its own) fails for lack of memory; ``callback=None`` removes
    it.

    It is asked once emmpool's own recovery has failed (waiting for pending frees, giving
    wholly free memory back to the driver), for every client: Numba, cuda.core, CuPy, PyTorch
    and RMM. ``size`` is the request in bytes, ``stats`` the pool's statistics
    (:func:`stats`). It returns whether it freed something (spilled data to the host, dropped
    a cache): then the allocation is tried again, and the callback asked again if that fails
    too, at most 8 times an allocation. A false answer ends in the out-of-memory error at once.

    It runs with no emmpool lock held, holding the GIL, on the thread that allocates: two
    threads that run out of memory at once ask it concurrently (it must be thread safe). It
    may allocate (copy to pinned host memory, say): an allocation of its own that runs out of
    memory fails at once rather than asking it again. An exception it raises ends the
    allocation: the out-of-memory error says so, and has that exception as its ``__cause__``
    where the client raises Python errors (emmpool, cuda.core, Numba)."""
    if callback is not None and not callable(callback):
        raise TypeError(f"the out-of-memory callback must be callable or None, not "
                        f"{type(callback).__name__}")
    _core.set_out_of_memory_callback(callback, None if device is None else _args.device(device))

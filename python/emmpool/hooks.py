"""The ``use_for_*`` family's work: each library made to allocate from emmpool's pools.

Numba gets emmpool's memory manager class (:mod:`emmpool.plugin`); CuPy and PyTorch plain C entry
points of emmpool._core (CuPy: cpp/entry_points/cupy_adapter.cpp, PyTorch: cpp/entry_points/c_api.cpp), so that
no Python runs per allocation; RMM a callback resource (cuda.core's resource is
:mod:`emmpool.cuda_core`). None of these libraries is needed by emmpool itself: each install
says what to install where it is missing.

Each install returns an :class:`~emmpool._installed.Installed`, is idempotent, and first looks at
what the library allocates through: its own default, or emmpool's, is taken over; anything else
was chosen by another library or the program, and is left in place with an
:class:`~emmpool._installed.AllocatorConflictError` unless ``replace=True``.
"""

from __future__ import annotations

import threading
import warnings

from . import _args, _core
from ._config import caller_outside_emmpool, ensure_configured, log
from ._installed import AllocatorConflictError, Installed, lock, record

_installed: list = []  # keeps CuPy's allocator object alive
_cupy_malloc = None  # the function use_for_cupy() gave CuPy last: tells emmpool's from another


def _name(obj) -> str:
    """``module.qualname`` of a class or function: how an error names another's allocator."""
    return f"{getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', obj)}"


# ---- Numba -----------------------------------------------------------------------------------
def use_for_numba(replace: bool = False) -> Installed:
    """Give every installed package that provides Numba's CUDA target (numba-cuda,
    numba-cuda-mlir) emmpool's memory manager class (``set_memory_manager``).

    Numba asks for its manager when it makes a device's context, and a context keeps the one it
    got: where Numba has made one already, or another manager is chosen
    (``set_memory_manager``, ``NUMBA_CUDA_MEMORY_MANAGER``), this raises
    AllocatorConflictError; ``replace=True`` sets emmpool's for the contexts made from then on.
    """
    from . import _numba_packages, plugin

    ensure_configured()
    with lock:
        chosen = []
        for package in _numba_packages.installed():
            api = _numba_packages.emm_api(package)
            manager = plugin.manager_for(package.name)
            situation = None if replace else _numba_conflict(api.driver, manager, package)
            if situation is not None:
                raise AllocatorConflictError(
                    "numba", situation,
                    "set emmpool's manager for the contexts Numba makes from now on")
            chosen.append((api, manager))
        for api, manager in chosen:
            api.set_memory_manager(manager)
        return record(Installed("numba", "memory manager", tuple(m for _, m in chosen)))


def _numba_conflict(driver, ours: type, package=None) -> str | None:
    """Why ``package``'s Numba would not, or should not, allocate through ``ours``: a context
    made with another manager, or another manager chosen; None if it will. Numba has no public
    getter for its manager: this reads its driver module's state (the same in both
    packages)."""
    numba = "Numba" if package is None or package.name == "numba-cuda" else package.name
    devices = getattr(getattr(driver, "driver", None), "devices", None) or {}
    for device in devices.values():
        context = getattr(device, "primary_context", None)
        if context is not None and not isinstance(context.memory_manager, ours):
            return (f"{numba} has made its CUDA context already, with "
                    f"{_name(type(context.memory_manager))} as memory manager, and a context "
                    f"keeps its manager (call use_for_numba() before Numba's first CUDA call)")
    chosen = getattr(driver, "_memory_manager", None)  # set_memory_manager, or the first context
    variable = getattr(getattr(driver, "config", None), "CUDA_MEMORY_MANAGER", "default")
    if chosen is not None and chosen is not getattr(driver, "NumbaCUDAMemoryManager", None):
        other = None if issubclass(chosen, ours) else _name(chosen)
    else:
        other = None if variable in ("default", "emmpool.plugin") else variable
    return None if other is None else f"{numba}'s memory manager is {other} already"


# ---- CuPy ------------------------------------------------------------------------------------
def use_for_cupy(replace: bool = False) -> Installed:
    """Install emmpool as CuPy's allocator (``cupy.cuda.set_allocator``).

    Each block belongs to CuPy's current stream at its allocation, as in CuPy's own pool: its
    free is fenced on that stream, and a block freed on a stream can go straight to the next
    allocation on the same stream. CuPy's C function allocator passes no stream, so emmpool asks
    CuPy (``cupy_backends.cuda.stream.get_stream_ptr``, or else
    ``cupy.cuda.stream.get_current_stream_ptr``: C functions CuPy exports); should a CuPy
    version export neither, blocks name no stream and frees are fenced on the legacy default
    stream (safe for the null, per-thread and blocking streams; memory used on a non-blocking
    stream then needs :func:`emmpool.record_stream` before its free).

    CuPy's default memory pool is replaced; any other allocator (``cupy.cuda.get_allocator()``:
    RMM's, say) raises AllocatorConflictError unless ``replace=True``.
    """
    try:
        import cupy
    except ImportError as e:
        raise ImportError(
            "emmpool.use_for_cupy() needs CuPy: pip install 'emmpool[cupy]' (cupy-cuda13x)"
        ) from e
    global _cupy_malloc
    ensure_configured()
    with lock:
        current = _cupy_allocator(cupy)
        if current is not None and current is _cupy_malloc:
            return record(Installed("cupy", "C function allocator", (current,)))
        if not replace and current is not None and not _is_cupys_pool(cupy, current):
            raise AllocatorConflictError("cupy", f"CuPy allocates through {_name(current)} "
                                                 f"already")
        _cupy_malloc = _install_for_cupy(cupy)
        return record(Installed("cupy", "C function allocator", (_cupy_malloc,)))


def _cupy_allocator(cupy):
    """CuPy's current allocator function, or None where this CuPy cannot say."""
    get = getattr(cupy.cuda, "get_allocator", None)
    return get() if get is not None else None


def _is_cupys_pool(cupy, allocator) -> bool:
    """Whether ``allocator`` is CuPy's default: its default memory pool's malloc (a bound
    method, equal though not identical to a new one)."""
    try:
        return allocator == cupy.get_default_memory_pool().malloc
    except Exception:  # noqa: BLE001 - a CuPy without a default pool has no default to match
        return False


def _install_for_cupy(cupy):
    try:
        from cupy_backends.cuda import stream as backend_stream
    except ImportError:
        backend_stream = None
    _ask_cupy_for_its_stream(cupy, backend_stream)
    addresses = _core.c_function_addresses()
    allocator = cupy.cuda.memory.CFunctionAllocator(
        0, addresses["cupy_malloc"], addresses["cupy_free"], _core
    )
    # Sizes are rounded up to CuPy's allocation unit (512 bytes), as CuPy's own pool does and
    # reports in Memory.size. CuPy does not check the C function's result: a NULL from the pool
    # (out of memory) would become a silent null pointer. Where this CuPy passes on an exception
    # raised by the C function, the entry point raises CuPy's OutOfMemoryError itself;
    # otherwise the wrapper (in C) checks each result.
    out_of_memory = cupy.cuda.memory.OutOfMemoryError
    _core.set_cupy_failure(out_of_memory)
    if _cupy_passes_errors_on(cupy, addresses):
        malloc = _core.cupy_malloc(allocator.malloc)
        checked = False
    else:
        _core.set_cupy_failure(None)
        malloc = _core.cupy_malloc(allocator.malloc, out_of_memory)
        checked = True
    log.info("CuPy %s: failed allocations %s", cupy.__version__,
             "are checked by the wrapper" if checked else "raise from the C entry point")
    cupy.cuda.set_allocator(malloc)
    _installed.append(allocator)
    return malloc


def _cupy_passes_errors_on(cupy, addresses) -> bool:
    """Whether this CuPy's C-function allocator passes on an exception raised by its C malloc
    (CuPy's Cython wrapper does where it is compiled to propagate exceptions, with -1 as their
    marker). Tried with a request emmpool refuses (device -1: ValueError) through the very
    constructor CuPy's CFunctionAllocator.malloc uses; where the exception is not passed on,
    Python reports a SystemError instead, and the probe's memory (address -1) frees nothing."""
    memory = getattr(cupy.cuda.memory, "CFunctionAllocatorMemory", None)
    if memory is None:
        return False
    try:
        memory(256, 0, addresses["cupy_malloc"], addresses["cupy_free"], -1)
    except ValueError as e:
        return "device" in str(e)
    except Exception:  # noqa: BLE001 - SystemError, or whatever another CuPy does
        return False
    return False


def _ask_cupy_for_its_stream(cupy, backend_stream=None) -> None:
    """Give the CuPy entry points the cheapest of CuPy's exported stream lookups that this
    CuPy has with a signature emmpool knows; warn if there is none."""
    candidates = [
        (backend_stream, "get_stream_ptr"),               # by device: no runtime call
        (cupy.cuda.stream, "get_current_stream_ptr"),     # of the current device
    ]
    for module, name in candidates:
        capsule = getattr(module, "__pyx_capi__", {}).get(name)
        if capsule is None:
            continue
        try:
            _core.set_cupy_stream_source(capsule)
        except (ValueError, TypeError) as e:  # another signature in this CuPy version
            log.info("CuPy %s: %s.%s: %s", cupy.__version__, module.__name__, name, e)
            continue
        log.info("CuPy's current stream from %s.%s", module.__name__, name)
        return
    _core.set_cupy_stream_source(None)
    warnings.warn(
        f"CuPy {cupy.__version__} does not say which stream is current: emmpool fences "
        "CuPy's frees on the legacy default stream (memory used on a non-blocking stream "
        "needs emmpool.record_stream before its free)",
        RuntimeWarning,
        stacklevel=caller_outside_emmpool(),
    )


# ---- PyTorch ---------------------------------------------------------------------------------
def import_torch(what: str):
    """PyTorch, or ImportError saying that ``what`` needs it and how to install it."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"{what} needs PyTorch: pip install 'emmpool[torch]'") from e
    return torch


def use_for_torch(allocator: str | None = None, replace: bool = False) -> Installed:
    """Install emmpool as PyTorch's CUDA allocator, before PyTorch's first CUDA allocation.
    ``allocator`` (or ``EMMPOOL_TORCH_ALLOCATOR``, ``configure(torch_allocator=...)``): ``auto``
    (default), ``extension`` or ``pluggable``; see emmpool._torch and README's PyTorch section.
    The result's ``how`` says which serves: ``"extension"`` (emmpool's allocator extension,
    compiled on first use) or ``"pluggable"`` (PyTorch's CUDAPluggableAllocator).

    PyTorch passes the stream of each allocation: frees are fenced on that stream. PyTorch
    swaps no allocator once one is initialized (another library's, or its own once CUDA is):
    that raises AllocatorConflictError, saying which; ``replace=True`` asks PyTorch all the
    same, and PyTorch decides.
    """
    torch = import_torch("emmpool.use_for_torch()")
    from . import _torch

    with lock:
        if _torch.how_installed() is None and not replace:
            situation = _torch_conflict(torch)
            if situation is not None:
                raise AllocatorConflictError(
                    "torch", situation, "ask PyTorch to swap it all the same (it refuses where "
                    "the allocator in place is initialized)")
        how = _torch.use_for_torch(allocator)
        return record(Installed("torch", how, tuple(_torch._installed[:1])))


def _torch_conflict(torch) -> str | None:
    """What PyTorch allocates through other than its default-to-be or emmpool's; None if
    emmpool can take its place. ``torch.cuda.memory._get_current_allocator()`` answers the
    allocator installed with ``change_current_allocator`` (none: PyTorch's own)."""
    try:
        current = torch.cuda.memory._get_current_allocator().allocator()
    except (AttributeError, RuntimeError):  # a PyTorch without the call, or without CUDA
        current = None
    if current is not None:
        try:
            backend = torch.cuda.memory.get_allocator_backend()
        except (AttributeError, RuntimeError):
            backend = type(current).__name__
        return (f"PyTorch allocates through another allocator already ({backend!r}, installed "
                f"with torch.cuda.memory.change_current_allocator)")
    try:
        initialized = torch.cuda.is_initialized()
    except (AttributeError, RuntimeError):
        initialized = False
    if initialized:
        return ("PyTorch has initialized CUDA with its own caching allocator already (call "
                "use_for_torch() before PyTorch's first CUDA call)")
    return None


# ---- RMM -------------------------------------------------------------------------------------
_TAG_RMM = _core.LIBRARIES.index("rmm")
_rmm_resources: dict[int, object] = {}  # one per device: tells emmpool's from another's


def _import_rmm(what: str):
    try:
        import rmm.mr
    except ImportError as e:
        raise ImportError(f"{what} needs RMM: pip install 'emmpool[rmm]' (rmm-cu13; "
                          f"'emmpool[rmm-cu12]' for CUDA 12)") from e
    return rmm


def rmm_resource(device: int | None = None):
    """emmpool's RMM memory resource for ``device`` (default: the current device, else 0), one
    per device, for an application that wants RAPIDS libraries in the same pool
    (:func:`use_for_rmm` installs it).

    It is native where it can be built (emmpool._rmm: compiled on first use against the RMM
    installed, then cached): RMM's C++ callers (libcudf, ``rmm::device_buffer``) allocate
    through it with no Python and no GIL. Where it cannot be (no compiler, no Cython, no CUDA
    headers), a warning says why in one line and RMM's ``CallbackMemoryResource`` serves
    instead: one Python call per allocation and free (a few µs, and the GIL).

    Either way, the stream RMM passes is honoured: the free is fenced on it, and blocks go
    straight back to that stream. RMM guarantees that stream alive during the call (its
    buffers hold their stream); emmpool never uses it afterwards, so it may be destroyed at
    any time after. The device's pool is made at the resource's first allocation.
    """
    _import_rmm("emmpool.rmm_resource()")
    ensure_configured()
    device = _args.current_device(device)
    if device not in _rmm_resources:
        _check_exists(device)  # before a build: a device that is not there compiles nothing
    native = _native_rmm()  # a first build takes seconds: not under the install lock
    with lock:
        mr = _rmm_resources.get(device)
        if mr is None:  # checked above: a device's resource, once made, stays
            mr = _new_rmm_resource(device, native)
            _rmm_resources[device] = mr
        return mr


def rmm_resource_kind() -> str:
    """``"native resource"`` or ``"callback resource"``: what :func:`rmm_resource` makes in this
    process (the native one is built, or found in the cache, on the first call)."""
    return "callback resource" if _native_rmm() is None else "native resource"


_rmm_problem: list = []  # why the native resource cannot be had, once known
# The native module's first build or load, one thread at a time, apart from the install lock:
# a compile takes seconds, and other libraries' installs need not wait for it.
_rmm_building = threading.Lock()


def _native_rmm():
    """emmpool._rmm, its module built or loaded, or None (warned once, saying why)."""
    from . import _rmm

    with _rmm_building:
        if _rmm_problem:
            return None
        try:
            _rmm.module()
        except _rmm.RmmBuildError as e:
            _rmm_problem.append(str(e))
            first, *rest = str(e).splitlines()
            if rest:  # a compiler's words: in the log, where they do not drown the warning
                log.debug("emmpool's native RMM resource: %s", e)
            warnings.warn(
                f"{first.rstrip(':')}{' (EMMPOOL_LOG=debug shows why)' if rest else ''}; RMM "
                "allocates from emmpool through a Python callback resource instead (one Python "
                "call and the GIL per allocation)", RuntimeWarning, stacklevel=4)
            return None
        return _rmm


def _new_rmm_resource(device: int, native):
    if native is not None:
        return native.resource(device)
    rmm = _import_rmm("emmpool.rmm_resource()")
    return rmm.mr.CallbackMemoryResource(*_rmm_callbacks(lambda: _core.pool(device)))


def _check_exists(device: int) -> None:
    count = _core.device_count()
    if device >= count:
        raise ValueError(f"device {device} does not exist: this process sees {count} CUDA "
                         f"device(s)")


def use_for_rmm(devices=None, replace: bool = False) -> Installed:
    """Make RMM allocate from emmpool: each device's RMM resource
    (``rmm.mr.set_per_device_resource``) becomes :func:`rmm_resource` of that device, for
    ``devices`` (default: every device; a device's pool is made when RMM first allocates
    there).

    RMM's default resource (``CudaMemoryResource``) is replaced; any other (a pool set by
    ``rmm.reinitialize``, dask-cuda's ``rmm_pool_size``, an adaptor) raises
    AllocatorConflictError, naming the device, unless ``replace=True``.
    """
    rmm = _import_rmm("emmpool.use_for_rmm()")
    ensure_configured()
    if devices is None:
        devices = tuple(range(_core.device_count()))
    with lock:  # what would refuse, refuses before a build
        _refuse_rmm_conflicts(rmm, devices, replace)
    _native_rmm()  # built (or found) before the install lock is taken
    with lock:
        _refuse_rmm_conflicts(rmm, devices, replace)  # again: another thread may have acted
        resources = tuple(rmm_resource(d) for d in devices)
        for d, mr in zip(devices, resources):
            if rmm.mr.get_per_device_resource(d) is not mr:
                rmm.mr.set_per_device_resource(d, mr)
        return record(Installed("rmm", rmm_resource_kind(), resources, tuple(devices)))


def _refuse_rmm_conflicts(rmm, devices, replace: bool) -> None:
    """AllocatorConflictError if a device's RMM resource is neither RMM's default nor
    emmpool's (unless ``replace``); ValueError for a device that is not there."""
    for d in devices:
        if d not in _rmm_resources:
            _check_exists(d)
        current = rmm.mr.get_per_device_resource(d)
        if not replace and current is not _rmm_resources.get(d) and not _is_rmms_default(
                rmm, current):
            raise AllocatorConflictError(
                "rmm", f"RMM's resource for device {d} is {_name(type(current))} already")


def _is_rmms_default(rmm, resource) -> bool:
    """Whether ``resource`` is what RMM serves a device with until told otherwise."""
    default = getattr(rmm.mr, "CudaMemoryResource", None)
    if default is not None:
        return type(resource) is default
    return type(resource).__name__ == "CudaMemoryResource"


def _rmm_callbacks(pool_of):
    """The allocate and deallocate callbacks of :func:`rmm_resource` over the pool that
    ``pool_of()`` gives, asked at the first allocation (RMM passes objects with
    ``__cuda_stream__``); apart so that tests can drive them without RMM."""
    pool = None

    def alloc(size, stream):
        nonlocal pool
        if pool is None:
            pool = pool_of()
        return pool.allocate(size, stream.__cuda_stream__()[1], _TAG_RMM)

    def free(ptr, size, stream):
        pool.deallocate_tagged(ptr, stream.__cuda_stream__()[1], _TAG_RMM)  # after an alloc

    return alloc, free

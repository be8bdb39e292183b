"""emmpool as a cuda.core memory resource.

cuda.core (NVIDIA's Python layer over the driver, which numba-cuda builds on) lets a program
choose what serves each device's allocations: ``Device(i).memory_resource = mr``.
:class:`EmmPoolMemoryResource` is such an ``mr`` over emmpool's pool of device ``i``, the pool
Numba, CuPy and PyTorch share, so that a Buffer made by cuda.core (by the program, or by
numba-cuda when it copies a host array to the device for a kernel launch) comes from the same
memory, counts in :func:`emmpool.stats`, obeys the pool's limits and returns with
:func:`emmpool.trim`::

    import emmpool
    from cuda.core import Device

    emmpool.use_for_cuda_core()          # every device, for this thread's Device objects
    dev = Device(0)
    dev.set_current()
    buf = dev.allocate(1 << 20, stream=dev.default_stream)   # from emmpool's pool
    buf.close()

**Streams.** ``allocate(size, stream=s)`` hands out a block that work on ``s`` may use at once,
and ``deallocate(ptr, size, stream=s)`` (what ``Buffer.close(s)`` and garbage collection call)
frees it in ``s``'s order, the contract of cuda.core's own stream-ordered resource: a later
allocation on ``s`` may take the block at once, any other stream only after an event recorded
on ``s`` has completed. Memory used on another stream must be ordered before the free by the
program (as with cuda.core's resource), or declared with :func:`emmpool.record_stream`. A free on
the stream of the allocation (the default: cuda.core records it in the Buffer) never passes
its handle to CUDA again, so a stream destroyed in between is harmless (the reuse rule:
``cpp/include/emmpool/reuse_rule.hpp``).

**Graphs.** An allocation ordered into a CUDA graph being built (a ``GraphBuilder`` as the
stream) goes to cuda.core's ``GraphMemoryResource`` of the device, which makes it a node of the
graph: a pool block handed out while capturing would be freed, and reused, while the graph
still refers to it.

**Threads.** cuda.core's ``Device(i)`` objects are per thread: :func:`install` sets the
resource of the calling thread's objects; call it in each thread that allocates through
``Device.allocate``. numba-cuda keeps the Device of the thread that made its context and uses
it from every thread: the Numba plugin installs the resource there, once.
"""

from __future__ import annotations

import threading

from . import _args, _core
from ._config import ensure_configured
from ._installed import AllocatorConflictError

try:
    from cuda.core import Buffer, Device, MemoryResource, Stream
    from cuda.core.graph import GraphBuilder
except ImportError as e:  # pragma: no cover - cuda-core comes with numba-cuda
    raise ImportError(
        "emmpool.cuda_core needs cuda.core: pip install 'cuda-core[cu13]' (numba-cuda brings it)"
    ) from e

try:
    from cuda.core._utils.cuda_utils import CUDAError as _CUDAError
except ImportError:  # pragma: no cover - where cuda.core moves it, its base still holds
    _CUDAError = Exception

__all__ = ["EmmPoolMemoryResource", "OutOfMemoryError", "install", "install_on", "resource"]

_LEGACY = _core.LEGACY_STREAM
_ALLOCATION = _core.ALLOCATION_STREAM


class OutOfMemoryError(_CUDAError, _core.OutOfMemoryError):
    """What an allocation the pool cannot serve raises: the error cuda.core raises for the
    driver's ``CUDA_ERROR_OUT_OF_MEMORY`` (its message starts with that name), and emmpool's
    :class:`emmpool.OutOfMemoryError` (a ``MemoryError``), so either handler catches it."""


class EmmPoolMemoryResource(MemoryResource):
    """A cuda.core ``MemoryResource`` over emmpool's pool of one device.

    ``library``: the name its blocks count under in ``stats()["by_library"]``
    ("cuda_core"; the Numba plugin's is "numba").
    """

    # __dict__: where __init__ puts the C allocate and deallocate, which take precedence over
    # the methods of the class.
    __slots__ = ("_device", "_pool", "_tag", "_allocate", "_free", "_graphs", "_lock", "__dict__")

    def __init__(self, device: int = 0, *, library: str = "cuda_core") -> None:
        if type(device) is not int:
            device = _args.device(device)
        if library not in _core.LIBRARIES:
            raise ValueError(f"library must be one of {', '.join(_core.LIBRARIES)}, not {library!r}")
        ensure_configured()
        pool = _core.pool(device)  # raises ValueError for a device that does not exist
        self._device = device
        self._pool = pool
        self._tag = _core.LIBRARIES.index(library)
        # The pool's allocate(size, stream) and deallocate(ptr, stream) under this tag, in plain
        # C (cpp/bindings/cuda_core_entry_points.cpp): a pybind11 call costs several times more.
        calls = _core.ResourceCalls(pool, self._tag)
        self._allocate = calls.allocate
        self._free = calls.deallocate
        self._graphs = None  # cuda.core's GraphMemoryResource, made on first need
        self._lock = threading.Lock()
        cls = type(self)
        if cls.allocate is _ALLOCATE and cls.deallocate is _DEALLOCATE:
            # cuda.core calls both for every Buffer. From now on the instance's own, in C, do
            # what the methods below do for an int size or address and a stream that is None or
            # exactly Stream, with no Python frame; any other call goes on to those methods,
            # which a subclass may override (then they are kept, and no C ones are made). Each
            # holds the resource: a cycle, which the garbage collector frees.
            self.allocate, self.deallocate = calls.methods_for(
                self, _ALLOCATE.__get__(self), _DEALLOCATE.__get__(self), Stream, globals(),
                _as_error)

    # -- the MemoryResource interface ----------------------------------------------------
    def allocate(self, size: int, *, stream: Stream | GraphBuilder | None = None) -> Buffer:
        """A Buffer of ``size`` bytes from the pool, for work on ``stream`` (None: cuda.core's
        default stream). Zero bytes give a Buffer at address 0, as cuda.core's resources do.

        Raises :class:`OutOfMemoryError` when the pool cannot serve it."""
        if type(size) is not int:
            size = _args.size(size)
        if type(stream) is Stream:
            handle = stream.__cuda_stream__()[1]
        elif stream is None:
            handle = _LEGACY  # "no stream named": freed blocks wait for an event
        elif isinstance(stream, GraphBuilder):
            return self._graph_resource().allocate(size, stream=stream)  # a node of the graph
        else:
            handle = _stream_handle(stream)  # a Stream subclass, or what has __cuda_stream__
        if size <= 0:
            if size < 0:
                raise ValueError(f"cannot allocate a negative number of bytes ({size})")
            return Buffer.from_handle(0, 0, self, stream=stream)
        try:
            ptr = self._allocate(size, handle)
        except _core.OutOfMemoryError as e:
            error = _as_error(e)
            raise error from error.__cause__
        try:
            return Buffer.from_handle(ptr, size, self, stream=stream)
        except BaseException:
            self._free(ptr, _ALLOCATION)
            raise

    def deallocate(self, ptr, size: int, *, stream: Stream | GraphBuilder | None = None) -> None:
        """Free the block at ``ptr`` in ``stream``'s order (None: the allocation's stream).

        Raises :class:`emmpool.PoolError` for a pointer this resource did not allocate or
        already freed (cuda.core reports it as a warning when a Buffer is collected)."""
        ptr = int(ptr)
        if not ptr:
            return  # a zero-byte Buffer
        if type(stream) is Stream:
            handle = stream.__cuda_stream__()[1]
        elif stream is None:
            handle = _ALLOCATION
        else:
            handle = _stream_handle(stream)
        self._free(ptr, handle)

    @property
    def device_id(self) -> int:
        return self._device

    # A class attribute, not a property: cuda.core reads it for every Buffer it makes (whether
    # to record the Buffer's deallocation stream), and a property costs a Python call there.
    is_device_accessible: bool = True

    @property
    def is_host_accessible(self) -> bool:
        return False

    @property
    def is_managed(self) -> bool:
        return False

    # -- emmpool's own -------------------------------------------------------------------
    @property
    def pool(self):
        """The :class:`emmpool._core.DevicePool` this resource allocates from."""
        return self._pool

    @property
    def library(self) -> str:
        """What its blocks count as in ``stats()["by_library"]``."""
        return _core.LIBRARIES[self._tag]

    def __repr__(self) -> str:
        return f"<EmmPoolMemoryResource device={self._device} library={self.library!r}>"

    # -- allocations into a graph being built -------------------------------------------
    def _graph_resource(self) -> MemoryResource:
        with self._lock:
            if self._graphs is None:
                from cuda.core import GraphMemoryResource

                self._graphs = GraphMemoryResource(self._device)
            return self._graphs


_ALLOCATE = EmmPoolMemoryResource.allocate
_DEALLOCATE = EmmPoolMemoryResource.deallocate


def _as_error(error: BaseException) -> BaseException:
    """What an allocation raises for the pool's ``error``: the pool's out-of-memory error as
    :class:`OutOfMemoryError`, its cause kept (an out-of-memory callback's own error, if one
    raised); any other error as it is."""
    if not isinstance(error, _core.OutOfMemoryError):
        return error
    new = OutOfMemoryError(f"CUDA_ERROR_OUT_OF_MEMORY: {error}")
    new.__cause__ = error.__cause__
    new.__context__ = error
    return new


def _stream_handle(stream) -> int:
    """The CUstream of what cuda.core accepts as a stream (an object with ``__cuda_stream__``);
    TypeError, as cuda.core raises, for anything else."""
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is None:
        raise TypeError(
            f"stream must be a cuda.core Stream or GraphBuilder (or an object with "
            f"__cuda_stream__), not {type(stream).__name__}")
    _, handle = protocol()
    return int(handle)


_resources: dict[tuple[int, str], EmmPoolMemoryResource] = {}
_making = threading.Lock()


def resource(device: int | None = None, *, library: str = "cuda_core") -> EmmPoolMemoryResource:
    """emmpool's cuda.core memory resource for ``device`` (default: the current device, else
    0), one per device and library, made on first use."""
    if type(device) is not int:
        device = _args.current_device(device)
    with _making:
        mr = _resources.get((device, library))
        if mr is None:
            mr = _resources[(device, library)] = EmmPoolMemoryResource(device, library=library)
        return mr


def install(devices=None, *, library: str = "cuda_core",
            replace: bool = False) -> list[EmmPoolMemoryResource]:
    """Make emmpool serve cuda.core's allocations: ``Device(i).memory_resource`` becomes
    :func:`resource` ``(i)`` for each device in ``devices`` (default: every device), on the
    calling thread's Device objects (cuda.core's are per thread). Returns the resources, in
    device order.

    cuda.core's own resources are replaced; any other (another library's, the program's) raises
    :class:`emmpool.AllocatorConflictError` naming the device, before anything changes, unless
    ``replace``."""
    if devices is None:
        devices = range(_core.device_count())
    targets = [Device(d) for d in devices]
    if not replace:
        for device in targets:
            current = device.memory_resource
            if not _ours_or_cuda_cores(current):
                raise AllocatorConflictError(
                    "cuda_core", f"cuda.core's Device({device.device_id}).memory_resource is "
                                 f"{type(current).__module__}.{type(current).__qualname__} "
                                 f"already")
    return [install_on(device, library=library) for device in targets]


def _ours_or_cuda_cores(mr) -> bool:
    """Whether ``mr`` is emmpool's, or one of cuda.core's own (its default, which differs with
    the device: a memory pool's, or synchronous where the device has no pools)."""
    module = type(mr).__module__
    return isinstance(mr, EmmPoolMemoryResource) or module == "cuda.core" or module.startswith(
        "cuda.core.")


def install_on(device, *, library: str = "cuda_core") -> EmmPoolMemoryResource:
    """:func:`install` for one cuda.core ``Device`` object (numba-cuda's, say). Idempotent."""
    mr = resource(device.device_id, library=library)
    if device.memory_resource is not mr:
        device.memory_resource = mr
    return mr

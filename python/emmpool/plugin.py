"""Numba External Memory Management (EMM) plugin backed by emmpool's C++ pools.

It serves numba-cuda (``numba.cuda``) and numba-cuda-mlir (``numba_cuda_mlir.cuda``), either or
both. Enable it with either::

    emmpool.use_for_numba()                        # every installed package, before any CUDA use
    NUMBA_CUDA_MEMORY_MANAGER=emmpool.plugin python ...

or by hand, per package: ``numba.cuda.set_memory_manager(emmpool.plugin.EmmPoolManager)``,
``numba_cuda_mlir.cuda.set_memory_manager(emmpool.plugin.EmmPoolMlirManager)``.

**One class per package.** An EMM plugin derives from its package's ``HostOnlyCUDAMemoryManager``
and hands out that package's ``MemoryPointer``, ``IpcHandle`` and ``CudaAPIError``, and the two
packages' are distinct classes. So the implementation is written once (``_EmmPoolManager``) and
:func:`manager_for` puts it in front of each package's bases, with that package's names
(``_numba_packages.emm_api``). Every class allocates from the same per-device pools (the C++
registry in ``emmpool._core``): arrays of both packages in one process share one pool per GPU,
and nothing here keeps per-package state but the class.

**Which class ``_numba_memory_manager`` is.** Both packages read NUMBA_CUDA_MEMORY_MANAGER and
load the plugin the same way, ``importlib.import_module(name)._numba_memory_manager`` in their
driver module's ``_ensure_memory_manager()``, so one module attribute answers both. It is
computed on access (a module ``__getattr__``, PEP 562) from the module asking: numba-cuda's
driver gets numba-cuda's class, numba-cuda-mlir's gets numba-cuda-mlir's. Any other caller gets
the class of the preferred installed package (numba-cuda, else numba-cuda-mlir). The classes are
made on first use, so a process that uses one package never imports the other. A manager that
a context of the other package uses says so at once instead of mixing the two.

**Which releases.** Making a package's class checks the installed release against the range
emmpool is tested with (``Package.minimum`` and ``Package.tested`` in ``_numba_packages``, the
one place that says it): an older release is refused with an ImportError saying how to
upgrade, a newer minor series is served with an ``UntestedVersionWarning``, once.

Device memory comes from the process-wide pool of the context's device (shared with CuPy and
PyTorch when their hooks are installed): what Numba asks of this interface, and what it asks
of cuda.core (host arrays copied for a kernel launch, ``cuda.In/Out/InOut``), for which the
plugin makes emmpool the memory resource of numba's cuda.core Device (emmpool.cuda_core). Pinned and mapped host memory are Numba's own
(``HostOnlyCUDAMemoryManager``) unless ``EMMPOOL_PINNED=pool``: then ``memhostalloc`` is served
by emmpool's pinned-host cache and ``mempin`` goes through its C++ core (see host_pool.hpp).

**IPC.** ``get_ipc_handle`` answers with the package's ``IpcHandle``: for a block of a fixed
segment, the legacy handle of its segment and the block's offset there; for a block of the
growable segment, which has no legacy handle, the class's ``PagesIpcHandle``, which carries the
block's pages (:mod:`emmpool.ipc`) and is pickled, opened and closed as Numba's handle is.

``defer_cleanup``: while it is active, nothing is returned to the CUDA driver (no
``cuMemFree``, which would synchronize); freed device blocks still flow back into the pool
once the work issued before their free has completed, and can be reused. Host allocations are
deferred exactly as by Numba's own manager.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
import weakref

from . import _core
from . import _numba_extents
from . import _numba_packages as packages
from ._args import size as _as_size  # by this name: benchmarks/bench_plugin_path.py times it
from ._config import check_environment, ensure_configured, log

# NUMBA_CUDA_MEMORY_MANAGER=emmpool.plugin imports this module: a bad EMMPOOL_* value fails
# here, naming the variable, not at the first allocation. (Nothing here may touch CUDA.)
check_environment()

if not packages.installed():
    raise packages.missing_error()

# The public name of each package's class (numba-cuda's is the one emmpool always had).
_CLASS_NAMES = {packages.NUMBA_CUDA.name: "EmmPoolManager",
                packages.NUMBA_CUDA_MLIR.name: "EmmPoolMlirManager"}
# Only the installed packages' classes: the others would raise ImportError when looked up.
_AVAILABLE = [_CLASS_NAMES[p.name] for p in packages.installed()]
__all__ = [*_AVAILABLE, "manager_for"]

_LEGACY = _core.LEGACY_STREAM


class _EmmPoolManager:
    """Numba memory manager whose device allocations come from emmpool's pool.

    The implementation of every package's class: :func:`manager_for` derives a class from it
    and the package's ``GetIpcHandleMixin`` and ``HostOnlyCUDAMemoryManager``, with the
    package's EMM names as ``_emm``. Numba makes one instance per context. ``__init__`` touches
    no CUDA (Numba instantiates the class with ``context=None`` just to read
    ``interface_version``); the pool is bound on the first ``initialize()``.
    """

    _emm = None  # the package's EMM names (_numba_packages.emm_api), set by manager_for
    _package = ""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pool = None

    # -- binding to the pool -------------------------------------------------------------
    def initialize(self):
        # Called on every context push: after the first call this is one attribute test.
        if self._pool is None:
            self._bind()

    def _bind(self):
        if not isinstance(self.context, self._emm.Context):
            # The other package's class, set by hand: its MemoryPointer would not be this
            # package's, so refuse before the first allocation rather than mix the two.
            raise TypeError(
                f"{type(self).__name__} is emmpool's memory manager for {self._package}, but "
                f"a {type(self.context).__module__} context is using it: give each package "
                f"its own (emmpool.use_for_numba(), or emmpool.plugin.manager_for(package))")
        cfg = ensure_configured()
        dev = self.context.device
        # A Numba Device, or a bare CUdevice for contexts attached from a third party.
        self._device = dev.id if hasattr(dev, "id") else int(dev)
        pool = _core.pool(self._device)
        self._ctx = weakref.proxy(self.context)
        # The hot pair in plain C (cpp/bindings/numba_entry_points.cpp): allocate(size) returns
        # the block's finalizer, which holds its address (.ptr) and reset generation.
        self._entry = _core.NumbaEntryPoints(pool)
        self._allocate = self._entry.allocate
        self._pinned = _core.pinned_pool(self._device) if cfg.pinned == "pool" else None
        if type(self).memalloc is _EmmPoolManager.memalloc:
            # Numba calls memalloc for every array: from now on the instance's own, in C
            # (memalloc_for), answers, with no Python frame. The same checks, pointer and
            # errors as the method below, which a subclass may override: then it is kept.
            # Last but for _pool: a bind that failed is tried again by the method.
            self.memalloc = self._entry.memalloc_for(
                self._emm.MemoryPointer, self._ctx, functools.partial(_memalloc_error, self._emm))
        # device_memory_size(array) is then the array's block, not the segment it shares.
        _numba_extents.install(self._emm.driver, self._device, pool)
        # Numba copies host arrays to the device for kernel launches (and In/Out/InOut)
        # through cuda.core's Device.allocate, beside this interface: that Device's memory
        # resource becomes emmpool's too, its blocks counted as Numba's.
        _serve_cuda_core(dev)
        self._pool = pool
        log.info("Numba context on device %d allocates from emmpool (%s mode)", self._device,
                 pool.options["mode"])

    @property
    def pool(self):
        """The :class:`emmpool._core.DevicePool` of this context's device."""
        self.initialize()
        return self._pool

    # -- the EMM interface ---------------------------------------------------------------
    def memalloc(self, size):
        # Until the first bind; then the instance's C memalloc (_bind) does just this.
        if type(size) is not int:
            size = _as_size(size)
        if size < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({size})")
        try:
            if self._pool is None:
                self._bind()
            free = self._allocate(size)  # tagged numba, no stream named: fenced on the legacy one
        except (_core.OutOfMemoryError, _core.CudaError) as e:
            error = _as_numba_error(self._emm, e)
            raise error from error.__cause__
        return self._emm.MemoryPointer(self._ctx, free.ptr, size, finalizer=free)

    def memhostalloc(self, size, mapped=False, portable=False, wc=False):
        """Pinned (or mapped) host memory from emmpool's pinned cache (EMMPOOL_PINNED=pool),
        with Numba's bookkeeping: mapped memory is kept in ``self.allocations`` until freed."""
        self.initialize()
        if self._pinned is None:
            return super().memhostalloc(size, mapped, portable, wc)
        flags = (
            (_core.HOST_MAPPED if mapped else 0)
            | (_core.HOST_PORTABLE if portable else 0)
            | (_core.HOST_WRITECOMBINED if wc else 0)
        )
        try:
            # Labelled under the pool's lock: another thread's reset() may come between the
            # allocation and any later read of the generation.
            ptr, generation = self._pinned.allocate_labelled(size, flags)
        except (_core.OutOfMemoryError, _core.CudaError) as e:
            raise _as_numba_error(self._emm, e) from None
        finalizer = _host_finalizer(self, self._pinned.deallocate, ptr, mapped, generation)
        if mapped:
            mem = self._emm.MappedMemory(self._ctx, ptr, size, finalizer=finalizer)
            self.allocations[ptr] = mem
            return mem.own()
        return self._emm.PinnedMemory(self._ctx, ptr, size, finalizer=finalizer)

    def mempin(self, owner, pointer, size, mapped=False):
        """Page-lock caller memory through emmpool's core (EMMPOOL_PINNED=pool); unpinned as
        soon as it is released, so that the same memory can be pinned again at once."""
        self.initialize()
        if self._pinned is None:
            return super().mempin(owner, pointer, size, mapped)
        pointer = int(pointer)
        self._pinned.register_memory(pointer, size, _core.HOST_MAPPED if mapped else 0)
        finalizer = _host_finalizer(self, self._pinned.unregister_memory, pointer, mapped)
        if mapped:
            mem = self._emm.MappedMemory(self._ctx, pointer, size, owner=owner,
                                         finalizer=finalizer)
            self.allocations[pointer] = mem
            return mem.own()
        return self._emm.PinnedMemory(self._ctx, pointer, size, owner=owner, finalizer=finalizer)

    def get_memory_info(self):
        """Driver's free memory plus what the pool holds free, and the device's total."""
        self.initialize()
        free, total = _core.memory_info(self._device)
        return self._emm.MemoryInfo(free=free + self._pool.stats()["bytes_free"], total=total)

    def get_ipc_handle(self, memory):
        """Numba's IPC handle of ``memory``, a block of the pool or a view into one.

        A block of a fixed segment: the legacy handle of its segment (``cuIpcGetMemHandle``),
        with the block's offset in it. A block of the growable segment, which that call cannot
        export: a ``PagesIpcHandle`` (this class's attribute; see :class:`_PagesIpcHandle`),
        which carries the block's pages instead. Memory the pool did not allocate (e.g. a
        foreign array through the CUDA Array Interface) gets Numba's own handling: the handle
        of its whole allocation.
        """
        self.initialize()
        ptr = int(memory.handle)
        # Asked first: ipc_handle refuses a growable block.
        pages = self._pool.share_pages(ptr)
        if pages is not None:
            from . import ipc

            shared = ipc.export(ptr, nbytes=memory.size, device=self._device)
            source_info = self.context.device.get_device_identity()
            # offset: from the start of the block's first page, where what the receiver maps
            # starts, as Numba's is from the start of the allocation it opens.
            return self.PagesIpcHandle(memory, shared, memory.size, source_info,
                                       offset=pages[2])
        info = self._pool.ipc_handle(ptr)
        if info is None:
            return super().get_ipc_handle(memory)
        handle_bytes, base, _segment_size, offset = info
        handle = self._emm.binding.CUipcMemHandle()
        handle.reserved = handle_bytes
        source_info = self.context.device.get_device_identity()
        return self._emm.IpcHandle(memory, handle, memory.size, source_info, offset=offset)

    def reset(self):
        """Numba resets the context (e.g. ``cuda.close()``): wait for pending frees, return
        free memory to the driver, and retire segments still holding live arrays, so that
        their addresses are never handed out again. Finalizers of those arrays may run later
        (even at exit): they are matched to the retired blocks by generation."""
        super().reset()
        if self._pool is not None:
            self._pool.reset()
        if getattr(self, "_pinned", None) is not None:
            self._pinned.reset()

    @contextlib.contextmanager
    def defer_cleanup(self):
        with super().defer_cleanup():
            if self._pool is None:
                yield
                return
            pools = [self._pool] + ([self._pinned] if self._pinned is not None else [])
            for p in pools:
                p.defer_cleanup_begin()
            try:
                yield
            finally:
                for p in pools:
                    p.defer_cleanup_end()

    @property
    def interface_version(self):
        return 1


class _PagesIpcHandle:
    """Numba's ``IpcHandle`` of a block of emmpool's growable segment.

    The implementation of every package's ``PagesIpcHandle`` (an attribute of its manager
    class): :func:`manager_for` derives it from this and the package's ``IpcHandle``.
    ``cuIpcGetMemHandle`` cannot export memory mapped with ``cuMemMap``, so this handle
    carries the block's pages instead (``shared``: an :class:`emmpool.ipc.IpcHandle`, one file
    descriptor per page) and maps them where Numba's handle opens a legacy one. What Numba
    does with a handle works unchanged: pickling it, ``open``, ``open_array``, ``close``, and
    the ``IpcArrayHandle`` of ``devarr.get_ipc_handle()``. The descriptors cross processes as
    ``multiprocessing`` passes them: the receiver must be a process of the sender's
    ``multiprocessing`` family (see :mod:`emmpool.ipc`). Unpickling needs emmpool and the same
    Numba package. While a handle lives, its descriptors keep the block's pages allocated in
    the driver (``shared.close()`` lets them go sooner; the handle can then be neither sent
    nor opened).

    ``size`` is the memory's bytes, ``offset`` its place from the start of its block's first
    page, where the receiver's mapping starts (Numba's: from the start of the allocation the
    receiver opens). Views of one array keep their distance in both.

    There is no legacy handle: reading ``handle`` raises AttributeError. Code that sends
    ``handle.reserved`` itself and opens it with ``cuIpcOpenMemHandle`` (Numba's
    ``cuda.open_ipc_array``) cannot reach this memory: send the handle object instead.
    """

    _emm = None  # the package's EMM names, set by manager_for
    _package = ""

    def __init__(self, base, shared, size, source_info=None, offset=0):
        super().__init__(base, None, size, source_info, offset=offset)
        self.shared = shared

    @property
    def handle(self):
        raise AttributeError(
            "this IpcHandle has no legacy CUDA IPC handle (cuIpcGetMemHandle): its memory lies "
            "on emmpool's growable segment, shared as pages; send the handle object itself and "
            "open it with .open(context)")

    @handle.setter
    def handle(self, value):
        # Numba's __init__ sets it: to None, here.
        if value is not None:
            raise AttributeError("a PagesIpcHandle has no legacy CUDA IPC handle")

    def _check_openable(self):
        # Numba's checks, with Numba's words (its tests match them).
        if self._impl is not None:
            raise ValueError("IpcHandle is already opened")
        if self.base is not None:
            raise ValueError("opening IpcHandle from original process")

    def _source_device(self, context) -> int:
        """The exporting device, as this process numbers it (CUDA_VISIBLE_DEVICES may differ
        from the sender's): its pages are mapped there, readable by its peers."""
        if self.source_info is None:
            return self.shared.device
        if self.source_info == context.device.get_device_identity():
            return context.device.id
        return self._emm.driver.Device.from_identity(self.source_info).id

    def open_direct(self, context):
        """Map the pages in this process and return the package's ``MemoryPointer`` of the
        memory. The pointer, its views and the arrays made of them keep the mapping for as
        long as they live; :meth:`close` unmaps it at once."""
        self._check_openable()
        mapped = self.shared.open(self._source_device(context))
        if not isinstance(context, weakref.ProxyTypes):
            context = weakref.proxy(context)  # as Numba's pointers hold their context
        # The mapping as the pointer's owner, as Numba wraps memory it did not allocate
        # (from_cuda_array_interface): its views hold it too.
        memory = self._emm.MemoryPointer(context, mapped.ptr, self.size, owner=mapped)
        self._impl = mapped
        return memory

    def open_staged(self, context):
        """A copy of the memory in memory of ``context``'s device, as Numba's staged open does
        for a device that cannot reach the exporting one: the pages are mapped on the exporting
        device only for the copy."""
        self._sentry_source_info()
        self._check_openable()
        mapped = self.shared.open(self._source_device(context))
        try:
            copy = context.memalloc(self.size)
            source = self._emm.MemoryPointer(context, mapped.ptr, self.size)
            self._emm.driver.device_to_device(copy, source, self.size)
            context.synchronize()  # the copy is done before the pages are unmapped
        finally:
            mapped.close()
        # Closed already: close() has nothing left to unmap, as with Numba's staged open.
        self._impl = mapped
        return copy

    def close(self):
        """Unmap what :meth:`open` mapped (the device synchronized first): arrays opened from
        it must not be used after. Does nothing if the handle is not open."""
        if self._impl is not None:
            self._impl.close()
            self._impl = None

    def __reduce__(self):
        # The pages' descriptors travel as multiprocessing passes them (emmpool.ipc.IpcHandle);
        # the receiver's class is its own package's, found by name.
        return (_rebuild_pages_handle,
                (self._package, self.shared, self.size, self.source_info, self.offset))


def _rebuild_pages_handle(package, shared, size, source_info, offset):
    return manager_for(package).PagesIpcHandle(None, shared, size, source_info, offset=offset)


def _serve_cuda_core(numba_device) -> None:
    """Install emmpool's cuda.core resource (library "numba") on the cuda.core Device that
    numba-cuda and numba-cuda-mlir allocate kernel-argument copies from (``Device._dev``, in
    ``devicearray._to_strided_memory_view``). A context attached from a third party has no
    such Device, and allocates nothing through cuda.core."""
    core_device = getattr(numba_device, "_dev", None)
    if core_device is None:
        return
    from . import cuda_core

    cuda_core.install_on(core_device, library="numba")


def _as_numba_error(emm, e: Exception) -> Exception:
    """The error the package's own manager would raise (``emm``: its EMM names): its
    CudaAPIError with the driver's code, and CUDA_ERROR_OUT_OF_MEMORY when the pool is out of
    memory (its message says what the pool holds), so that callers' handlers keep working."""
    result = emm.binding.CUresult
    if isinstance(e, _core.OutOfMemoryError):
        log.warning("%s", e)
        error = emm.CudaAPIError(result.CUDA_ERROR_OUT_OF_MEMORY, str(e))
        error.__cause__ = e.__cause__  # an out-of-memory callback's own error, if one raised
        return error
    try:
        code = result(e.code)
    except (ValueError, AttributeError):
        code = result.CUDA_ERROR_UNKNOWN
    return emm.CudaAPIError(code, str(e))


def _memalloc_error(emm, e: Exception) -> Exception:
    """What memalloc raises for e: the package's own error for the pool's (_as_numba_error),
    any other as it is."""
    if isinstance(e, (_core.OutOfMemoryError, _core.CudaError)):
        return _as_numba_error(emm, e)
    return e


def _host_finalizer(manager, release, ptr, mapped, generation=None):
    """What Numba's own host finalizers do (drop the mapped entry from the manager's
    bookkeeping), then give the memory back to emmpool."""
    allocations = manager.allocations

    def core():
        if mapped and allocations:
            allocations.pop(ptr, None)
        if generation is None:
            release(ptr)
        else:
            release(ptr, _LEGACY, generation)

    return core


_made: dict[str, type] = {}
_making = threading.Lock()


def manager_for(package: str) -> type:
    """emmpool's memory manager class for ``package`` ("numba-cuda" or "numba-cuda-mlir"): a
    subclass of that package's ``HostOnlyCUDAMemoryManager``, made on first use, with its
    ``PagesIpcHandle`` (a subclass of the package's ``IpcHandle``: see :class:`_PagesIpcHandle`).

    Raises ImportError saying what to install when the package is missing."""
    pkg = packages.by_name(package)
    with _making:
        cls = _made.get(pkg.name)
        if cls is None:
            emm = packages.emm_api(pkg)
            name = _CLASS_NAMES[pkg.name]
            common = {"__module__": __name__, "_emm": emm, "_package": pkg.name}
            pages_handle = types.new_class(
                "PagesIpcHandle", (_PagesIpcHandle, emm.IpcHandle),
                exec_body=lambda ns: ns.update(common, __qualname__=f"{name}.PagesIpcHandle",
                                               __doc__=_PagesIpcHandle.__doc__))
            body = {**common, "__qualname__": name, "PagesIpcHandle": pages_handle,
                    "__doc__": f"emmpool's EMM plugin for {pkg.name}."}
            # new_class, not type(): the bases' metaclass (ABCMeta) makes the class.
            cls = types.new_class(
                name, (_EmmPoolManager, emm.GetIpcHandleMixin, emm.HostOnlyCUDAMemoryManager),
                exec_body=lambda ns: ns.update(body))
            _made[pkg.name] = cls
        return cls


def __getattr__(name: str):
    if name == "_numba_memory_manager":
        # Asked by a package's driver (NUMBA_CUDA_MEMORY_MANAGER): that package's class.
        caller = sys._getframe(1).f_globals.get("__name__", "")
        pkg = packages.of_module(caller) or packages.installed()[0]
        return manager_for(pkg.name)
    for package, class_name in _CLASS_NAMES.items():
        if name == class_name:
            return manager_for(package)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_AVAILABLE, "_numba_memory_manager"})

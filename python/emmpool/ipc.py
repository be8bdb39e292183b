"""Share a block of emmpool's pool with another process, whatever segment holds it.

A block of a fixed segment has a legacy CUDA IPC handle (``cuIpcGetMemHandle`` of its segment,
and its offset there): what Numba's ``get_ipc_handle`` and CuPy's ``ipcGetMemHandle`` use. A
block of the growable segment (``EMMPOOL_SEGMENTS=growable``, the default: blocks above 1 MiB)
lies on pages mapped with ``cuMemMap``, which that call cannot export: its pages are shared
instead, one file descriptor each (``cuMemExportToShareableHandle``), and the receiver maps them
into addresses of its own. (The Numba plugin's ``get_ipc_handle`` wraps such a handle in
Numba's ``IpcHandle``.)

:func:`export` makes an :class:`IpcHandle` of either kind. It pickles: send it through
``multiprocessing`` (a ``Queue``, a ``Pipe``, a ``Pool``'s arguments) as any object. Descriptors
cross processes the way ``multiprocessing`` passes them (``multiprocessing.reduction.DupFd``:
a Unix socket of the sending process, no ptrace rights needed between the two), so the
receiver must be a process of the same ``multiprocessing`` family (it checks the family's
authentication key). In the receiver, :meth:`IpcHandle.open` maps the memory and returns an
:class:`IpcMemory`, which CuPy, Numba and PyTorch take as an array
(``__cuda_array_interface__``) when the export described one::

    # sender                                   # receiver (a multiprocessing child)
    x = cupy.arange(1 << 20)                   with handle.open() as mem:
    queue.put(emmpool.ipc.export(x))               y = cupy.asarray(mem)   # x's memory

The sender keeps the block alive until every receiver has closed what it opened (as with CUDA's
own IPC). A handle of pages holds their memory itself, through its descriptors, for as long as
it lives: :meth:`IpcHandle.close` (or dropping it) once the receivers have opened it lets the
driver have that memory back after the pool gives the pages back. Closing an import
synchronizes the receiver's device first: work issued to the memory there must not outlive its
mapping. PyTorch's tensors need none of this: torch.multiprocessing
shares them through emmpool's PyTorch extension, in PyTorch's own format.
"""

from __future__ import annotations

import os
import threading
import weakref
from multiprocessing import reduction

from . import _args, _core

__all__ = ["IpcHandle", "IpcMemory", "export"]


class IpcHandle:
    """What another process opens to reach a block of this one's pool (:func:`export`)."""

    def __init__(self, device: int, ptr: int, nbytes: int, offset: int, *, handle: bytes = b"",
                 page_size: int = 0, fds: tuple = (), array: dict | None = None):
        self.device = device
        self.ptr = ptr            # the address in the sending process (for messages)
        self.nbytes = nbytes
        self._offset = offset     # the shared address from the start of what is mapped
        self._handle = handle     # a fixed segment's legacy handle
        self._page_size = page_size
        self._fds = tuple(fds)    # a growable block's pages: descriptors of this process
        self._array = array
        self._closed = False
        self._release = None      # closes the descriptors, this handle's own copies
        # close() waits for a pickling under way (a Queue's feeder thread), which must not
        # duplicate a descriptor closed, or its number reused, in between.
        self._lock = threading.Lock()

    def _own_fds(self) -> None:
        self._release = weakref.finalize(self, _close_fds, self._fds)

    def close(self) -> None:
        """Close the handle's descriptors: while open they keep a growable block's pages
        allocated in the driver, whatever the pool does with them. Call it once the receivers
        have opened what was sent (a ``multiprocessing.Queue`` pickles in a thread of its own:
        after ``put`` returns, the handle may not have been sent yet). A closed handle can be
        neither opened nor sent; closing twice does nothing."""
        with self._lock:
            self._closed = True
            if self._release is not None:
                self._release()

    def __enter__(self) -> IpcHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self!r} is closed")

    @property
    def kind(self) -> str:
        """``"pages"`` (a growable block's) or ``"handle"`` (a fixed segment's)."""
        return "pages" if self._fds else "handle"

    def open(self, device: int | None = None) -> IpcMemory:
        """Map the shared memory in this process (not the sending one): an :class:`IpcMemory`,
        to close when done (or let it be collected). ``device``: the sender's device as this
        process numbers it, where that differs (``CUDA_VISIBLE_DEVICES``); by default the
        sender's number. Raises ``emmpool.CudaError`` where the driver refuses (the sending
        process gone, or its memory freed), ``ValueError`` for a closed handle."""
        device = self.device if device is None else _args.device(device)
        with self._lock:  # the descriptors stay open while they are mapped
            self._check_open()
            if self._fds:
                base = _core.ipc_open_pages(device, list(self._fds), self._page_size)
            else:
                base = _core.ipc_open_handle(device, self._handle)
        return IpcMemory(base, base + self._offset, self.nbytes, device, self._array)

    def __reduce__(self):
        with self._lock:
            self._check_open()
            # Each descriptor as multiprocessing sends one: duplicated, handed over by this
            # process's resource sharer, detached in the receiver.
            shared = tuple(reduction.DupFd(fd) for fd in self._fds)
        if not self._fds:
            return (_rebuild, (self.device, self.ptr, self.nbytes, self._offset, self._handle,
                               0, (), self._array))
        return (_rebuild, (self.device, self.ptr, self.nbytes, self._offset, b"",
                           self._page_size, shared, self._array))

    def __repr__(self) -> str:
        return (f"<emmpool.ipc.IpcHandle of {self.nbytes} bytes at {self.ptr:#x} on device "
                f"{self.device} ({self.kind}{', closed' if self._closed else ''})>")


def _dup_all(fds) -> tuple:
    copies: list = []
    try:
        for fd in fds:
            copies.append(os.dup(fd))
    except BaseException:
        _close_fds(copies)
        raise
    return tuple(copies)


def _rebuild(device, ptr, nbytes, offset, handle, page_size, shared, array) -> IpcHandle:
    detached: list = []
    try:
        for s in shared:
            detached.append(s.detach())  # descriptors of this process now
    except BaseException:
        _close_fds(detached)  # none left open if the sender could not hand over them all
        raise
    fds = tuple(detached)
    h = IpcHandle(device, ptr, nbytes, offset, handle=handle, page_size=page_size, fds=fds,
                  array=array)
    if fds:
        h._own_fds()
    return h


def _close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class IpcMemory:
    """Memory another process shares, mapped here (:meth:`IpcHandle.open`). ``ptr`` is the
    shared address; ``__cuda_array_interface__`` describes the exported array, if any."""

    def __init__(self, base: int, ptr: int, nbytes: int, device: int, array: dict | None):
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self._array = array
        self._close = weakref.finalize(self, _core.ipc_close, base)

    @property
    def closed(self) -> bool:
        return not self._close.alive

    def close(self) -> None:
        """Unmap it (once; the device is synchronized first)."""
        self._close()

    def __enter__(self) -> IpcMemory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def __cuda_array_interface__(self) -> dict:
        if self._array is None:
            raise AttributeError("the export described no array: use .ptr and .nbytes")
        if self.closed:
            raise ValueError("the shared memory is closed")
        return {**self._array, "data": (self.ptr, False), "version": 3}


def export(obj, nbytes: int | None = None, device: int | None = None) -> IpcHandle:
    """An :class:`IpcHandle` of a block of emmpool's pool, for another process to open.

    ``obj``: an array that has ``__cuda_array_interface__`` (CuPy, Numba, PyTorch), whose
    layout the receiver's :class:`IpcMemory` repeats, or a device address (an int, with
    ``nbytes``: to the block's end if not given). ``device``: the pool to look in (default:
    every pool that exists). Raises ``ValueError`` for memory emmpool did not allocate."""
    array = None
    if hasattr(obj, "__cuda_array_interface__"):
        cai = obj.__cuda_array_interface__
        ptr = cai["data"][0]
        array = {"shape": tuple(cai["shape"]), "typestr": cai["typestr"],
                 "strides": tuple(cai["strides"]) if cai.get("strides") else None}
        nbytes = _array_bytes(cai) if nbytes is None else nbytes
    else:
        ptr = _args.integer(obj, "obj", "a device address, or an array with "
                                        "__cuda_array_interface__")
    pool, (start, size) = _pool_holding(ptr, device)
    if nbytes is not None:
        nbytes = _args.integer(nbytes, "nbytes", "bytes from the address on")
    nbytes = _within(nbytes, start + size - ptr, ptr)
    shared = pool.share_pages(ptr)
    if shared is not None:
        first, page_size, offset, left, fds = shared
        # The handle's own copies: the pool closes its descriptors when a page goes back to the
        # driver, which may come before the handle is pickled (a Queue pickles in a thread).
        fds = _dup_all(fds)
        h = IpcHandle(pool.device, ptr, nbytes, offset, page_size=page_size, fds=fds,
                      array=array)
        h._own_fds()
        return h
    handle, base, segment_size, offset = pool.ipc_handle(ptr)
    return IpcHandle(pool.device, ptr, nbytes, offset, handle=handle, array=array)


def _array_bytes(cai: dict) -> int:
    import numpy as np

    itemsize = np.dtype(cai["typestr"]).itemsize
    shape, strides = tuple(cai["shape"]), cai.get("strides")
    if any(n == 0 for n in shape):
        return 0
    if strides and any(s < 0 for s in strides):
        raise ValueError("an array with negative strides (its memory lies before its first "
                         "element): export a contiguous copy, or the address with nbytes")
    if not strides:
        n = itemsize
        for extent in shape:
            n *= extent
        return n
    return itemsize + sum((extent - 1) * stride for extent, stride in zip(shape, strides))


def _within(nbytes: int | None, left: int, ptr: int) -> int:
    if nbytes is None:
        return left
    if nbytes < 0 or nbytes > left:
        raise ValueError(f"{nbytes} bytes from {ptr:#x} pass the end of its block ({left} bytes "
                         "left)")
    return nbytes


def _pool_holding(ptr: int, device: int | None):
    if device is not None:
        pools = [_core.pool(_args.device(device))]
    else:
        pools = _core.pools()
    for pool in pools:
        extent = pool.live_extent(ptr)
        if extent is not None:
            return pool, extent
    where = f"device {device}'s pool" if device is not None else "any of emmpool's pools"
    raise ValueError(f"address {ptr:#x} is no live block of {where}: only memory emmpool "
                     "allocated can be exported (and only while it is allocated)")

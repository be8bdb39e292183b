"""Share a block of emmpool's pool with another process, whatever segment holds it.

A block of a fixed segment has a legacy CUDA IPC handle (``cuIpcGetMemHandle`` of its segment,
and its offset there): what Numba's ``get_ipc_handle`` and CuPy's ``ipcGetMemHandle`` use. A
block of the growable segment (``EMMPOOL_SEGMENTS=growable``, the default: blocks above 1 MiB)
lies on pages mapped with ``cuMemMap``, which that call cannot export: its pages are shared
instead, one file descriptor each (``cuMemExportToShareableHandle``), and the receiver maps them
into addresses of its own. (The Numba plugin's ``get_ipc_handle`` wraps such a handle in
Numba's ``IpcHandle``.)

:func:`export` makes an :class:`IpcHandle` of either kind. It pickles: send it through
``multiprocessing`` (a ``Queue``, a ``Pipe``, a ``Pool``'s arguments) as any object. In the
receiver, :meth:`IpcHandle.open` maps the memory and returns an :class:`IpcMemory`, which
CuPy, Numba and PyTorch take as an array (``__cuda_array_interface__``) when the export
described one::

    # sender                                   # receiver (a multiprocessing child)
    x = cupy.arange(1 << 20)                   with handle.open() as mem:
    queue.put(emmpool.ipc.export(x))               y = cupy.asarray(mem)   # x's memory

**The block is held while any process may use it.** An export holds the block in the sender's
pool: freed there, it is not handed out again until every copy of the handle is closed or
collected, in every process (the sender's, one in flight, each receiver's) and every
:class:`IpcMemory` opened from one is closed. The sender may free its array at any time; no
receiver ever sees the memory reused. The count is the kernel's (the handle holds a pipe's
write end, which pickling passes as ``multiprocessing`` passes descriptors: its resource
sharer, so the receiver must be of the sender's ``multiprocessing`` family), so a receiver
that dies lets go too. A handle pickled and never unpickled holds the block until the sending
process exits, as the resource sharer keeps what it was given.

**Pages cross without ptrace rights.** When a receiver opens a growable block's handle, it asks
the sending process's IPC service (a thread listening on an abstract Unix socket) for the
pages' descriptors, which arrive over the socket (SCM_RIGHTS) after the service checked the
handle's key (the block's own, made when it was first shared) and that the block is still the
one shared: no ``pidfd_getfd``, which needs ptrace rights over the sender (refused by Yama's
``ptrace_scope=1`` and by containers without ``CAP_SYS_PTRACE``). The sender must be alive when
a receiver opens. Each page is one descriptor while it is imported: opening counts them against
the descriptor limit first (``RLIMIT_NOFILE``, raised toward its hard limit where needed) and
says so if they cannot fit.

Closing an import synchronizes the receiver's device first: work issued to the memory there
must not outlive its mapping; a close that failed (the synchronization) can be called again.
PyTorch's tensors need none of this: torch.multiprocessing shares them through emmpool's
PyTorch extension, in PyTorch's own format, over the same service.
"""

from __future__ import annotations

import os
import threading
import weakref
from multiprocessing import reduction

from . import _args, _core

__all__ = ["IpcHandle", "IpcMemory", "export"]


class IpcHandle:
    """What another process opens to reach a block of this one's pool (:func:`export`).

    While it is open it holds the block in the sending process's pool (see the module)."""

    def __init__(self, device: int, ptr: int, nbytes: int, offset: int, extent: int, *,
                 handle: bytes = b"", offer: tuple | None = None, array: dict | None = None,
                 lease: int = -1):
        self.device = device
        self.ptr = ptr            # the address in the sending process (for messages)
        self.nbytes = nbytes
        self._offset = offset     # the shared address from the start of what is mapped
        self._extent = extent     # the bytes mapped: the segment's, or its pages'
        self._handle = handle     # a fixed segment's legacy handle
        # A growable block's pages, as its service is asked for them: (address, the block's
        # key, the sender's device, the first page's address there, the page size, the
        # sender's descriptor numbers). Numbers of another process: nothing to close here.
        self._offer = offer
        self._array = array
        self._closed = False
        # The lease on the block (this process's copy), closed once by close() or at
        # collection; open() takes a copy of its own for the IpcMemory.
        self._lease = lease
        self._release = weakref.finalize(self, _close_fd, lease) if lease >= 0 else None
        # close() waits for a pickling under way (a Queue's feeder thread), which must not
        # duplicate a descriptor closed, or its number reused, in between.
        self._lock = threading.Lock()

    def close(self) -> None:
        """Let this copy of the handle go: its hold on the block ends (the block is reused
        once every copy and every opened :class:`IpcMemory` is closed). A ``Queue`` pickles in
        a thread of its own, so after ``put`` returns the handle may not have been sent yet:
        close it once the receiver has it. A closed handle can be neither opened nor sent;
        closing twice does nothing."""
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
        return "pages" if self._offer is not None else "handle"

    def open(self, device: int | None = None) -> IpcMemory:
        """Map the shared memory in this process (not the sending one): an :class:`IpcMemory`,
        to close when done (or let it be collected). ``device``: the sender's device as this
        process numbers it, where that differs (``CUDA_VISIBLE_DEVICES``); by default the
        sender's number. Raises ``ValueError`` for a closed handle, or one whose description
        does not add up (checked before anything is mapped), ``emmpool.PoolError`` where the
        sending process cannot hand over the pages (gone, or the handle no longer its block's)
        or the descriptor limit is too low, ``emmpool.CudaError`` where the driver refuses."""
        device = self.device if device is None else _args.device(device)
        _check_description(self)
        with self._lock:  # the lease stays open while it is copied
            self._check_open()
            lease = os.dup(self._lease) if self._lease >= 0 else -1
        try:
            if self._offer is not None:
                base = _core.ipc_open_offer(device, *self._offer[:5], list(self._offer[5]))
            else:
                base = _core.ipc_open_handle(device, self._handle)
        except BaseException:
            _close_fd(lease)
            raise
        return IpcMemory(base, base + self._offset, self.nbytes, device, self._array, lease)

    def __reduce__(self):
        with self._lock:
            self._check_open()
            # The lease travels as multiprocessing sends a descriptor: duplicated, handed over
            # by this process's resource sharer, detached in the receiver. Until then the
            # sharer's copy holds the block.
            lease = reduction.DupFd(self._lease) if self._lease >= 0 else None
        return (_rebuild, (self.device, self.ptr, self.nbytes, self._offset, self._extent,
                           self._handle, self._offer, self._array, lease))

    def __repr__(self) -> str:
        return (f"<emmpool.ipc.IpcHandle of {self.nbytes} bytes at {self.ptr:#x} on device "
                f"{self.device} ({self.kind}{', closed' if self._closed else ''})>")


def _rebuild(device, ptr, nbytes, offset, extent, handle, offer, array, lease) -> IpcHandle:
    return IpcHandle(device, ptr, nbytes, offset, extent, handle=handle, offer=offer,
                     array=array, lease=lease.detach() if lease is not None else -1)


def _close_fd(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def _check_description(h: IpcHandle) -> None:
    """What a handle says it maps must add up before anything is mapped: it came from another
    process, through pickle."""
    def bad(why: str):
        return ValueError(f"{h!r} is ill-formed: {why}")

    for name in ("nbytes", "_offset", "_extent"):
        value = getattr(h, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(f"{name.lstrip('_')} {value!r} is not a byte count")
    try:
        _args.device(h.device)
    except (TypeError, ValueError) as e:
        raise bad(str(e)) from None
    if h._offer is not None:
        if len(h._offer) != 6:
            raise bad("its pages are not described")
        address, key, sender, first_page, page_size, fds = h._offer
        if not (isinstance(address, bytes) and isinstance(key, bytes) and len(key) == 16):
            raise bad("the sending process's service or the block's key is missing")
        if not (isinstance(page_size, int) and page_size > 0 and fds and
                all(isinstance(fd, int) and fd >= 0 for fd in fds)):
            raise bad("its pages are not described")
        if h._extent != len(fds) * page_size:
            raise bad(f"{len(fds)} pages of {page_size} bytes are not {h._extent} bytes")
    elif not (isinstance(h._handle, bytes) and len(h._handle) == 64):
        raise bad("a legacy CUDA IPC handle has 64 bytes")
    if h._offset + h.nbytes > h._extent:
        raise bad(f"{h.nbytes} bytes at offset {h._offset} pass the {h._extent} bytes it maps")
    if h._array is not None:
        try:
            extent = _array_bytes(h._array)
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"its array is not described ({e})") from None
        if extent > h.nbytes:
            raise bad(f"its array spans {extent} bytes, more than the {h.nbytes} shared")


class IpcMemory:
    """Memory another process shares, mapped here (:meth:`IpcHandle.open`). ``ptr`` is the
    shared address; ``__cuda_array_interface__`` describes the exported array, if any. While
    open it holds the block in the sending process's pool, as the handle does."""

    def __init__(self, base: int, ptr: int, nbytes: int, device: int, array: dict | None,
                 lease: int = -1):
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self._array = array
        self._base = base
        self._lease = lease
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_import, base, lease)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unmap it (once; the device is synchronized first), then let its hold on the
        sender's block go. If the synchronization fails, nothing is unmapped or let go and the
        error is raised: call close() again."""
        with self._lock:
            if not self._finalizer.alive:
                return
            _core.ipc_close(self._base)  # raises: still open, close() again
            self._finalizer.detach()
            _close_fd(self._lease)  # after the unmap: the sender may reuse the block now

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


def _close_import(base: int, lease: int) -> None:
    # Collected unclosed: unmap, then let the sender's block go. If the unmap fails the lease
    # stays open, so that the sender never reuses memory this process may still map.
    _core.ipc_close(base)
    _close_fd(lease)


def export(obj, nbytes: int | None = None, device: int | None = None) -> IpcHandle:
    """An :class:`IpcHandle` of a block of emmpool's pool, for another process to open. It
    holds the block until closed (see the module).

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
    lease, held = _core.ipc_lease(pool.device, ptr)
    try:
        if held != start:  # freed and allocated again meanwhile, by another thread
            raise ValueError(f"address {ptr:#x}: its block changed while it was exported")
        shared = pool.share_pages(ptr)
        if shared is not None:
            first, page_size, offset, _left, fds, key = shared
            offer = (_core.ipc_service_address(), key, pool.device, first, page_size, tuple(fds))
            return IpcHandle(pool.device, ptr, nbytes, offset, len(fds) * page_size,
                             offer=offer, array=array, lease=lease)
        handle, _base, segment_size, offset = pool.ipc_handle(ptr)
        return IpcHandle(pool.device, ptr, nbytes, offset, segment_size, handle=handle,
                         array=array, lease=lease)
    except BaseException:
        _close_fd(lease)
        raise


def _array_bytes(cai: dict) -> int:
    import numpy as np

    itemsize = np.dtype(cai["typestr"]).itemsize
    shape, strides = tuple(cai["shape"]), cai.get("strides")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
        raise ValueError(f"an array's shape is non-negative integers, not {shape}")
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
    if len(strides) != len(shape):
        raise ValueError(f"strides {strides} do not match shape {shape}")
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

"""emmpool.ipc over the host driver: what an export holds, how it pickles (descriptors through
multiprocessing's resource sharer), what the receiver maps and closes, and the errors. Each
case runs in a fresh interpreter whose process-wide pools take a host driver; the host driver's
memory lives in one process, so the receiver here is the same process (tests/test_gpu_ipc.py
crosses processes on a GPU)."""

from __future__ import annotations

import textwrap

from tests.processes import run_python

PRELUDE = textwrap.dedent(
    """
    import pickle
    import emmpool, emmpool.ipc
    from emmpool import _core
    MiB = 1 << 20
    host = _core.HostDriver(devices=1, capacity=1 << 30)
    _core._use_driver_for_all_pools(host)
    emmpool.configure(segments="growable", growable_page_size="2MiB")  # pages counted below
    pool = _core.pool(0)
    CUPY, NUMBA = 2, 1

    def _is_open(fd):
        import os
        try:
            os.fstat(fd)
            return True
        except OSError:
            return False
    """
)


def run(body: str):
    p = run_python(["-c", PRELUDE + textwrap.dedent(body) + "\nprint('OK')\n"], timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr


def test_a_growable_block_shares_its_pages_and_the_receiver_maps_them():
    run(
        """
        p = pool.allocate(5 * MiB, _core.LEGACY_STREAM, CUPY)   # three 2 MiB pages
        h = emmpool.ipc.export(p + 4096, nbytes=1000)
        assert h.kind == "pages" and h.nbytes == 1000 and h.device == 0, h
        received = pickle.loads(pickle.dumps(h))  # the descriptors, duplicated, sent, detached
        assert received.kind == "pages" and received._fds != h._fds
        exported = host.stats()["exports"]
        with received.open() as mem:
            assert mem.ptr % (2 * MiB) == 4096 and mem.ptr != p + 4096
            assert host.accessible(0, mem.ptr - 4096, 6 * MiB)
            assert host.stats()["imports"] == 3 and _core.ipc_open_count() == 1
        assert mem.closed and _core.ipc_open_count() == 0
        mem.close()  # once: a second close does nothing
        assert emmpool.ipc.export(p).nbytes == 5 * MiB  # to the block's end
        assert host.stats()["exports"] == exported  # each page is exported once
        # The handle holds copies of the pool's descriptors: freeing the block and trimming
        # (the pool closes its own) leaves the handle's open, to be pickled later.
        pool_fds = set(pool.share_pages(p)[4])
        late = emmpool.ipc.export(p)
        assert not pool_fds & set(late._fds)
        pool.deallocate(p)
        pool.trim()
        assert all(_is_open(fd) for fd in late._fds)  # still open
        # Closing the handle closes them: nothing of this process holds the pages any more.
        late.close()
        still = [fd for fd in late._fds if _is_open(fd)]
        assert not still, f"descriptors {still} still open after close()"
        late.close()  # twice: nothing
        assert "closed" in repr(late)
        for use in (late.open, lambda: pickle.dumps(late)):
            try:
                use()
            except ValueError as e:
                assert "is closed" in str(e), e
            else:
                raise AssertionError("a closed handle was opened or sent")
        q = pool.allocate(3 * MiB, _core.LEGACY_STREAM, CUPY)
        with emmpool.ipc.export(q) as h:
            fds = h._fds
        assert h._closed and all(not _is_open(fd) for fd in fds)
        """
    )


def test_a_fixed_block_shares_its_segments_legacy_handle():
    run(
        """
        p = pool.allocate(512 << 10, _core.LEGACY_STREAM, NUMBA)  # 1 MiB at most: fixed
        h = pickle.loads(pickle.dumps(emmpool.ipc.export(p + 256, nbytes=256)))
        assert h.kind == "handle", h
        mem = h.open()
        assert mem.ptr == p + 256  # the host driver's one process opens the same segment
        mem.close()
        assert _core.ipc_open_count() == 0
        """
    )


def test_an_exported_array_opens_as_the_same_array():
    run(
        """
        p = pool.allocate(MiB, _core.LEGACY_STREAM, CUPY)
        class Array:  # what CuPy, Numba and PyTorch arrays say of themselves
            __cuda_array_interface__ = {"data": (p, False), "shape": (256, 512),
                                        "typestr": "<f4", "strides": None, "version": 3}
        h = pickle.loads(pickle.dumps(emmpool.ipc.export(Array())))
        assert h.nbytes == 256 * 512 * 4
        with h.open() as mem:
            cai = mem.__cuda_array_interface__
            assert cai["shape"] == (256, 512) and cai["typestr"] == "<f4"
            assert cai["data"] == (mem.ptr, False)
        try:
            mem.__cuda_array_interface__
        except ValueError as e:
            assert "closed" in str(e)
        else:
            raise AssertionError("a closed import still described its array")
        """
    )


def test_what_is_not_emmpools_is_refused_saying_why():
    run(
        """
        p = pool.allocate(MiB, _core.LEGACY_STREAM, CUPY)
        for bad, words in [(12345, "no live block"), (p + 2 * MiB, "no live block")]:
            try:
                emmpool.ipc.export(bad)
            except ValueError as e:
                assert words in str(e), e
            else:
                raise AssertionError(f"{bad:#x} was exported")
        try:
            emmpool.ipc.export(p, nbytes=2 * MiB)
        except ValueError as e:
            assert "pass the end of its block" in str(e), e
        else:
            raise AssertionError("more than the block was exported")
        try:
            emmpool.ipc.export("p")
        except TypeError as e:
            assert "device address" in str(e), e
        else:
            raise AssertionError("a str was taken for an address")
        class Reversed:  # an array viewed backwards: its memory lies before its first element
            __cuda_array_interface__ = {"data": (p + 1024, False), "shape": (256,),
                                        "typestr": "<f4", "strides": (-4,), "version": 3}
        try:
            emmpool.ipc.export(Reversed())
        except ValueError as e:
            assert "negative strides" in str(e), e
        else:
            raise AssertionError("an array with negative strides was exported")
        pool.deallocate(p)
        try:
            emmpool.ipc.export(p)
        except ValueError as e:
            assert "while it is allocated" in str(e), e
        else:
            raise AssertionError("a freed block was exported")
        """
    )


# The Numba plugin's get_ipc_handle over the host driver, for each package: a fake context of
# device 0 (what the plugin and the handle ask of one), the manager bound to the host pool.
NUMBA_PRELUDE = textwrap.dedent(
    """
    import gc, importlib
    import numpy as np
    from emmpool import plugin
    driver = importlib.import_module({driver!r})
    devicearray = importlib.import_module({driver!r}.rsplit(".", 1)[0] + ".devicearray")
    Manager = plugin.manager_for({package!r})

    class Device:
        id = 0
        def get_device_identity(self):
            return {{"pci_domain_id": 0, "pci_bus_id": 0x41, "pci_device_id": 0}}

    class Context:
        device = Device()
        def __init__(self):
            self.synchronized = 0
        def memalloc(self, size):
            return driver.MemoryPointer(self, pool.allocate(size, _core.LEGACY_STREAM, NUMBA),
                                        size)
        def synchronize(self):
            self.synchronized += 1

    ctx = Context()
    manager = Manager(context=ctx)
    manager._pool, manager._device = pool, 0   # bound as initialize() binds (no CUDA here)

    def pointer(p, size):  # what Numba hands get_ipc_handle: a MemoryPointer, or a view of one
        return driver.MemoryPointer(ctx, p, size)

    def raises(call, error, words):
        try:
            call()
        except error as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"no {{error.__name__}} ({{words}})")
    """
)


def run_numba(package, body: str):
    run(NUMBA_PRELUDE.format(driver=package.driver, package=package.name) + textwrap.dedent(body))


def test_numbas_handle_of_a_fixed_block_is_its_segments_legacy_handle(numba_package):
    run_numba(numba_package, """
        p = pool.allocate(256 << 10, _core.LEGACY_STREAM, NUMBA)   # a small block: fixed
        class CUipcMemHandle:  # cuda.bindings' needs a CUDA driver to have its bytes
            reserved = None
        driver.binding.CUipcMemHandle = CUipcMemHandle
        h = manager.get_ipc_handle(pointer(p + 512, 1024))
        assert type(h) is driver.IpcHandle, type(h)
        handle_bytes, base, _, offset = pool.ipc_handle(p + 512)
        assert bytes(h.handle.reserved) == handle_bytes and h.offset == offset == p + 512 - base
        assert h.size == 1024 and h.source_info == ctx.device.get_device_identity()
        # Memory the pool did not allocate: Numba's own handling, as before.
        driver.GetIpcHandleMixin.get_ipc_handle = lambda self, memory: "numba's own"
        assert manager.get_ipc_handle(pointer(12345 << 20, 64)) == "numba's own"
        """)


def test_numbas_handle_of_a_growable_block_carries_its_pages(numba_package):
    run_numba(numba_package, """
        p = pool.allocate(5 * MiB, _core.LEGACY_STREAM, CUPY)   # three 2 MiB pages
        assert p % (2 * MiB) == 0
        memory = pointer(p, 5 * MiB)
        h = manager.get_ipc_handle(memory.view(2 * MiB + 4096, 2 * MiB + 4096 + 1000))
        assert isinstance(h, driver.IpcHandle) and isinstance(h, Manager.PagesIpcHandle), h
        # offset: from the block's first page, as Numba's is from its allocation's start
        assert h.size == 1000 and h.offset == 2 * MiB + 4096, (h.size, h.offset)
        assert h.shared.kind == "pages" and h.shared.nbytes == 1000
        assert len(h.shared._fds) == 3  # the block's pages
        assert h.source_info == ctx.device.get_device_identity() and h.base is not None
        raises(lambda: h.handle, AttributeError, "no legacy CUDA IPC handle")
        assert not hasattr(h, "handle")
        raises(lambda: h.open(ctx), ValueError, "opening IpcHandle from original process")
        h.close()  # never opened: nothing to do

        received = pickle.loads(pickle.dumps(h))  # the descriptors, duplicated, sent, detached
        assert type(received) is type(h) and received.base is None
        assert (received.size, received.offset, received.source_info) == (1000, h.offset,
                                                                           h.source_info)
        assert received.shared._fds != h.shared._fds
        received.close()  # not opened yet: nothing
        got = received.open(ctx)
        assert isinstance(got, driver.MemoryPointer) and got.size == 1000
        ptr = int(got.device_pointer)
        assert ptr % (2 * MiB) == 4096 and ptr != p + 2 * MiB + 4096
        assert host.accessible(0, ptr - h.offset, 6 * MiB) and _core.ipc_open_count() == 1
        raises(lambda: received.open(ctx), ValueError, "IpcHandle is already opened")
        view = got.view(8, 16)  # a view holds the mapping as its base does
        del got
        gc.collect()
        assert _core.ipc_open_count() == 1 and int(view.device_pointer) == ptr + 8
        received.close()  # unmaps, whatever still points there
        assert _core.ipc_open_count() == 0
        received.close()  # twice: nothing
        again = received.open(ctx)  # closed, it opens again, as Numba's does
        assert _core.ipc_open_count() == 1
        received.close()
        assert _core.ipc_open_count() == 0

        # What open returns keeps the mapping when the handle is dropped unclosed.
        kept = pickle.loads(pickle.dumps(h)).open(ctx)
        gc.collect()
        assert _core.ipc_open_count() == 1
        del kept
        gc.collect()
        assert _core.ipc_open_count() == 0

        # open_array, and an IpcArrayHandle (devarr.get_ipc_handle()) as the receiver opens it.
        f32 = np.dtype(np.float32)
        whole = manager.get_ipc_handle(memory)
        assert whole.size == 5 * MiB and whole.offset == 0 and len(whole.shared._fds) == 3
        received = pickle.loads(pickle.dumps(whole))
        arr = received.open_array(ctx, shape=(5 * MiB // 4,), dtype=f32)
        data = arr.__cuda_array_interface__["data"][0]
        assert data % (2 * MiB) == 0 and data != p and host.accessible(0, data, 5 * MiB)
        received.close()
        assert _core.ipc_open_count() == 0
        devicearray.devices.get_context = lambda: ctx  # the receiver's current context
        desc = dict(shape=(250,), strides=(4,), dtype=f32)
        array_handle = devicearray.IpcArrayHandle(ipc_handle=h, array_desc=desc)  # h: a view
        with pickle.loads(pickle.dumps(array_handle)) as arr:
            assert arr.shape == (250,)
            assert arr.__cuda_array_interface__["data"][0] % (2 * MiB) == 4096
            assert _core.ipc_open_count() == 1
        assert _core.ipc_open_count() == 0
        """)


def test_numbas_staged_open_of_pages_copies_them_then_unmaps(numba_package):
    run_numba(numba_package, """
        p = pool.allocate(3 * MiB, _core.LEGACY_STREAM, CUPY)
        received = pickle.loads(pickle.dumps(manager.get_ipc_handle(pointer(p + 256, 2048))))
        copies = []
        def device_to_device(dst, src, size, stream=0):
            src = driver.device_pointer(src)
            copies.append((driver.device_pointer(dst), src, size, ctx.synchronized,
                           host.accessible(0, src, size), _core.ipc_open_count()))
        driver.device_to_device = device_to_device
        copy = received.open_staged(ctx)
        assert pool.owns(int(copy.device_pointer)) and copy.size == 2048  # this context's
        [(dst, src, size, synchronized, mapped, opened)] = copies
        assert dst == int(copy.device_pointer) and size == 2048 and synchronized == 0
        assert mapped and opened == 1 and src % (2 * MiB) == (p + 256) % (2 * MiB)
        assert ctx.synchronized == 1 and _core.ipc_open_count() == 0  # copied, then unmapped
        raises(lambda: received.open_staged(ctx), ValueError, "IpcHandle is already opened")
        received.close()  # nothing mapped: nothing to do
        assert received.open_direct(ctx).size == 2048
        received.close()
        assert _core.ipc_open_count() == 0
        """)

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
        p = pool.allocate(3 * MiB, _core.LEGACY_STREAM, NUMBA)   # Numba's: fixed segments
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

"""emmpool.ipc over the host driver: what an export holds and for how long (the lease), how it
pickles, how a receiver gets the pages (the sending process's IPC service, over a Unix socket),
what the receiver maps and closes, what it checks, and the errors. Each case runs in a fresh
interpreter whose process-wide pools take a host driver; the host driver's memory lives in one
process, so the receiver that maps is the same process (tests/test_gpu_ipc.py crosses processes
on a GPU), while the lease crosses to a real second process (tests/ipc_receiver.py)."""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import needs
from tests.processes import run_python

PRELUDE = textwrap.dedent(
    """
    import gc, os, pickle, time
    import emmpool, emmpool.ipc
    from emmpool import _core
    MiB = 1 << 20
    host = _core.HostDriver(devices=1, capacity=1 << 30)
    _core._use_driver_for_all_pools(host)
    emmpool.configure(segments="growable", growable_page_size="2MiB")  # pages counted below
    pool = _core.pool(0)
    CUPY, NUMBA = 2, 1

    def open_fds():
        # Once multiprocessing's resource sharer and the IPC service's thread have let go of
        # what they handed over or served: their threads close their copies a moment later, so
        # the count is taken once it held still for 50 ms.
        n, still = len(os.listdir("/proc/self/fd")), 0
        for _ in range(400):
            time.sleep(0.01)
            m = len(os.listdir("/proc/self/fd"))
            still = still + 1 if m == n else 0
            n = m
            if still == 5:
                return n
        return n

    def eventually(check, what, seconds=10):
        # The IPC service's thread lets a block go once the last copy of its lease closed.
        end = time.monotonic() + seconds
        while not check():
            if time.monotonic() > end:
                raise AssertionError(what)
            time.sleep(0.01)

    def raises(call, error, words):
        try:
            call()
        except error as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"no {error.__name__} ({words})")
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
        received = pickle.loads(pickle.dumps(h))  # the lease duplicated, sent, detached
        assert received.kind == "pages" and received._lease != h._lease
        exported, before = host.stats()["exports"], open_fds()
        with received.open() as mem:  # the pages asked of this process's service
            assert mem.ptr % (2 * MiB) == 4096 and mem.ptr != p + 4096
            assert host.accessible(0, mem.ptr - 4096, 6 * MiB)
            assert host.stats()["imports"] == 3 and _core.ipc_open_count() == 1
            assert open_fds() == before + 1  # the import's lease only: the pages' went
        assert mem.closed and _core.ipc_open_count() == 0 and open_fds() == before
        mem.close()  # once: a second close does nothing
        assert _core.ipc_service_stats()["served"] == 1
        assert emmpool.ipc.export(p).nbytes == 5 * MiB  # to the block's end
        assert host.stats()["exports"] == exported  # each page is exported once
        h.close()
        h.close()  # twice: nothing
        assert "closed" in repr(h)
        for use in (h.open, lambda: pickle.dumps(h)):
            raises(use, ValueError, "is closed")
        with emmpool.ipc.export(p) as h2:
            lease = h2._lease
        assert h2._closed
        raises(lambda: os.fstat(lease), OSError, "Bad file descriptor")
        """
    )


def test_the_block_is_held_until_every_copy_and_import_is_closed():
    run(
        """
        p = pool.allocate(6 * MiB, _core.LEGACY_STREAM, CUPY)
        h = emmpool.ipc.export(p)
        received = pickle.loads(pickle.dumps(h))
        mem = received.open()
        in_use = pool.stats()["bytes_in_use"]
        pool.deallocate(p)  # the sender is done with it: the receivers are not
        assert pool.held_blocks() == 1 and not pool.owns(p)
        assert pool.stats()["bytes_in_use"] == in_use  # still in use, by another process
        raises(lambda: pool.deallocate(p), emmpool.PoolError, "not a live allocation")
        pool.synchronize()
        q = pool.allocate(6 * MiB, _core.LEGACY_STREAM, CUPY)
        assert q != p  # never handed out while held
        pool.deallocate(q)
        h.close()
        received.close()
        time.sleep(0.05)
        assert pool.held_blocks() == 1  # the import holds it still
        mem.close()
        eventually(lambda: pool.held_blocks() == 0, "the last close let nothing go")
        assert pool.stats()["bytes_in_use"] == in_use - 6 * MiB
        pool.synchronize()
        assert pool.allocate(6 * MiB, _core.LEGACY_STREAM, CUPY) in (p, q)  # reusable now

        # Bytes written into a lease (nobody should) do not end it: only its last close does.
        s = pool.allocate(6 * MiB, _core.LEGACY_STREAM, CUPY)
        h = emmpool.ipc.export(s)
        pool.deallocate(s)
        os.write(h._lease, b"x" * 1000)
        time.sleep(0.1)
        assert pool.held_blocks() == 1, "bytes in a lease let its block go"
        h.close()
        eventually(lambda: pool.held_blocks() == 0, "the lease's close let nothing go")

        # A received copy that is only collected (never closed) lets go as well.
        r = pool.allocate(6 * MiB, _core.LEGACY_STREAM, CUPY)
        copy = pickle.loads(pickle.dumps(emmpool.ipc.export(r)))  # the sender's copy: dropped
        pool.deallocate(r)
        assert pool.held_blocks() == 1
        del copy
        gc.collect()
        eventually(lambda: pool.held_blocks() == 0, "a collected copy still holds the block")
        """
    )


def test_a_receiver_in_another_process_holds_the_block_until_it_closes_or_dies():
    run(
        """
        import multiprocessing as mp
        from tests import ipc_receiver
        ctx = mp.get_context("spawn")
        for ending in ("close", "die"):
            p = pool.allocate(4 * MiB, _core.LEGACY_STREAM, CUPY)
            inbox, outbox = ctx.Queue(), ctx.Queue()
            child = ctx.Process(target=ipc_receiver.hold_then, args=(inbox, outbox))
            child.start()
            h = emmpool.ipc.export(p, nbytes=MiB)
            inbox.put(h)
            assert outbox.get(timeout=60) == ("holding", "pages", MiB)
            h.close()          # the sender's own copy goes
            pool.deallocate(p)
            time.sleep(0.1)
            assert pool.held_blocks() == 1, ending  # the child's copy holds it
            inbox.put(ending)
            if ending == "close":
                assert outbox.get(timeout=60) == "closed"
            eventually(lambda: pool.held_blocks() == 0, f"a child that {ending}d held on")
            inbox.put("done")
            child.join(60)
            assert child.exitcode == (0 if ending == "close" else 3), child.exitcode
        """
    )


def test_a_receiver_that_may_not_copy_the_senders_descriptors_gets_the_pages():
    from tests import no_ptrace

    if no_ptrace.supported() is not None:
        pytest.skip(needs(no_ptrace.supported(), "Linux on x86-64 or AArch64"))
    run(
        """
        import multiprocessing as mp
        from tests import ipc_receiver
        ctx = mp.get_context("spawn")
        p = pool.allocate(4 * MiB, _core.LEGACY_STREAM, CUPY)
        inbox, outbox = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=ipc_receiver.open_without_ptrace, args=(inbox, outbox))
        child.start()
        with emmpool.ipc.export(p) as h:
            inbox.put(h)
            refused, raised, message = outbox.get(timeout=60)
        child.join(60)
        assert refused, "pidfd_getfd was not refused in the child"
        # The descriptors came over this process's service; the child's own host driver then
        # refused to import memory that lives here (the model has no memory across processes).
        assert raised == "CudaError" and "cuMemImportFromShareableHandle" in message, message
        assert _core.ipc_service_stats()["served"] == 1
        """
    )


def test_a_fixed_block_shares_its_segments_legacy_handle_and_is_held_too():
    run(
        """
        p = pool.allocate(512 << 10, _core.LEGACY_STREAM, NUMBA)  # 1 MiB at most: fixed
        h = pickle.loads(pickle.dumps(emmpool.ipc.export(p + 256, nbytes=256)))
        assert h.kind == "handle", h
        mem = h.open()
        assert mem.ptr == p + 256  # the host driver's one process opens the same segment
        pool.deallocate(p)
        assert pool.held_blocks() == 1
        mem.close()
        h.close()
        assert _core.ipc_open_count() == 0
        eventually(lambda: pool.held_blocks() == 0, "a legacy handle's block stayed held")
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
        raises(lambda: mem.__cuda_array_interface__, ValueError, "closed")
        """
    )


def test_open_checks_what_a_handle_describes_before_it_maps_anything():
    run(
        """
        p = pool.allocate(5 * MiB, _core.LEGACY_STREAM, CUPY)   # three 2 MiB pages
        good = emmpool.ipc.export(p + MiB, nbytes=MiB)

        def tampered(**change):
            copy = pickle.loads(pickle.dumps(good))
            for name, value in change.items():
                setattr(copy, name, value)
            return copy

        tampered().close()  # multiprocessing's resource sharer listens from its first use on
        fds = open_fds()

        offer = good._offer
        cases = [
            (dict(nbytes=1 << 40), "pass the"),                      # 1 TiB of three pages
            (dict(_offset=6 * MiB), "pass the"),                     # past the pages
            (dict(nbytes=-1), "not a byte count"),
            (dict(_offset=-4096), "not a byte count"),
            (dict(device=True), "device must be an integer"),
            (dict(device=1 << 40), "CUDA device ordinal"),
            (dict(_extent=8 * MiB), "are not"),                      # pages and extent differ
            (dict(_offer=offer[:5] + ((),)), "not described"),       # no pages
            (dict(_offer=offer[:4] + (0,) + offer[5:]), "not described"),
            (dict(_offer=offer[:1] + (b"short",) + offer[2:]), "key is missing"),
            (dict(_array={"shape": (1 << 20,), "typestr": "<f8", "strides": None}), "spans"),
            (dict(_array={"shape": (-1,), "typestr": "<f4", "strides": None}), "not described"),
            (dict(_array={"shape": (4,), "typestr": "<f4", "strides": (4, 4)}), "not described"),
        ]
        for change, words in cases:
            h = tampered(**change)
            raises(h.open, ValueError, words)
            h.close()
        # A device this process lacks: refused before anything is asked of the sender.
        h = tampered(device=1000)
        raises(h.open, ValueError, "does not exist in this process")
        h.close()
        served = _core.ipc_service_stats()["served"]
        assert served == 0 and _core.ipc_open_count() == 0 and host.stats()["imports"] == 0
        assert open_fds() == fds, "a refused open left descriptors open"
        """
    )


def test_the_sender_serves_only_the_block_of_the_key_while_it_is_the_one_shared():
    run(
        """
        p = pool.allocate(5 * MiB, _core.LEGACY_STREAM, CUPY)
        h = emmpool.ipc.export(p)
        address, key, sender, first, page_size, fds = h._offer
        other = pool.allocate(5 * MiB, _core.LEGACY_STREAM, CUPY)
        other_key = emmpool.ipc.export(other)._offer[1]
        assert other_key != key

        def offer_open(**change):
            args = dict(address=address, key=key, sender_device=sender, first_page=first,
                        page_size=page_size, fds=list(fds))
            args.update(change)
            return _core.ipc_open_offer(0, **args)

        before = open_fds()
        gone = "does not share these pages now"
        raises(lambda: offer_open(key=bytes(16)), emmpool.PoolError, gone)
        raises(lambda: offer_open(key=other_key), emmpool.PoolError, gone)  # another block's
        raises(lambda: offer_open(fds=[fds[1], fds[0], fds[2]]), emmpool.PoolError, gone)
        raises(lambda: offer_open(fds=list(fds[:2])), emmpool.PoolError, gone)  # some of them
        raises(lambda: offer_open(first_page=first + page_size), emmpool.PoolError, gone)
        raises(lambda: offer_open(sender_device=7), emmpool.PoolError, gone)
        raises(lambda: offer_open(address=b"\\0emmpool-nobody"), emmpool.PoolError,
               "cannot reach")
        assert _core.ipc_service_stats()["refused"] == 6
        assert open_fds() == before and _core.ipc_open_count() == 0  # nothing received stays
        # The block freed and its lease gone: an offer of it (a copy of the handle's
        # description, without its lease) is refused, never served with whatever lies there
        # now: a new block at the same address on the same pages, whose descriptors are the
        # ones the offer names.
        h.close()
        pool.deallocate(p)
        eventually(lambda: pool.held_blocks() == 0, "held after its lease closed")
        pool.synchronize()
        q = pool.allocate(5 * MiB, _core.LEGACY_STREAM, CUPY)
        assert q == p and pool.share_pages(q)[4] == fds
        raises(offer_open, emmpool.PoolError, gone)
        # Its pages go back: the pool closes its descriptors of them (an exported descriptor
        # holds its memory in the driver), and the offer stays refused.
        pool.deallocate(q)
        pool.deallocate(other)
        pool.synchronize()
        pool.trim()
        assert host.stats()["live_exports"] == 0 and host.stats()["bytes_physical"] == 0
        raises(offer_open, emmpool.PoolError, gone)
        """
    )


def test_the_service_survives_what_a_stranger_sends_it():
    run(
        """
        import socket, struct, threading
        p = pool.allocate(5 * MiB, _core.LEGACY_STREAM, CUPY)
        h = emmpool.ipc.export(p)
        address, key, sender, first, page_size, fds = h._offer

        def talk(data):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(address)  # an abstract name: its leading NUL included
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
            s.close()
            return reply

        def request(count, numbers, magic=b"EMMPOOLQ", version=2):
            return struct.pack("=8sIi16sQQQ", magic, version, 0, key, first, page_size,
                               count) + struct.pack(f"={len(numbers)}i", *numbers)

        assert talk(b"") == b""                       # nothing: dropped
        assert b"ill-formed" in talk(b"x" * 100)      # not a request
        assert b"ill-formed" in talk(request(1 << 40, []))             # 2**40 pages
        assert b"ill-formed" in talk(request(3, fds, magic=b"EMMPOOLX"))
        assert b"ill-formed" in talk(request(3, fds, version=1))
        assert talk(request(3, fds[:1])) == b""       # cut short: dropped
        assert _core.ipc_service_stats()["refused"] == 4
        with pickle.loads(pickle.dumps(h)).open() as mem:  # and it still serves
            assert host.accessible(0, mem.ptr, 5 * MiB)

        # A peer that connects and says nothing, or drips, keeps its own connection waiting,
        # not the service: another receiver is served at once, and leases still end.
        silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
        for s in silent:
            s.connect(address)
        silent[0].sendall(b"EMMP")
        start = time.monotonic()
        with pickle.loads(pickle.dumps(h)).open() as mem:
            assert host.accessible(0, mem.ptr, 5 * MiB)
        assert time.monotonic() - start < 5, "a silent peer held the service up"
        r = pool.allocate(5 * MiB, _core.LEGACY_STREAM, CUPY)
        leased = emmpool.ipc.export(r)
        pool.deallocate(r)
        leased.close()
        eventually(lambda: pool.held_blocks() == 1, "a silent peer held a lease's end up", 5)
        for s in silent:
            s.close()

        # A peer that accepts and says nothing: the receiver gives up, saying so.
        mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        mute.bind(b"\\0emmpool-test-mute")
        mute.listen(1)
        threading.Thread(target=lambda: mute.accept()[0].close(), daemon=True).start()
        before = open_fds()
        raises(lambda: _core.ipc_open_offer(0, b"\\0emmpool-test-mute", key, sender, first,
                                            page_size, list(fds)),
               emmpool.PoolError, "did not answer")
        assert open_fds() == before and _core.ipc_open_count() == 0
        """
    )


def test_the_service_rests_while_the_process_has_no_descriptor_to_accept_with():
    run(
        """
        import resource, subprocess, sys
        address = _core.ipc_service_address()
        child = subprocess.Popen([sys.executable, "-c", (
            "import socket, time; time.sleep(0.5); s = socket.socket(socket.AF_UNIX); "
            f"s.connect({address!r}); time.sleep(5)")])
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
        fillers = []
        try:
            while True:  # the free numbers below the limit taken: accept() has none
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        try:
            start = time.process_time()  # every thread's
            time.sleep(2)
            busy = time.process_time() - start
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        child.kill()
        child.wait()
        assert busy < 0.5, f"the service spun: {busy:.2f} s of CPU in 2 s"
        """
    )


def test_a_forked_child_keeps_no_copy_of_the_services_listener():
    # Else a sender that exited would leave its name listening in its children, and a late
    # receiver would wait for an answer instead of being refused at once.
    run(
        """
        address = _core.ipc_service_address()
        name = "@" + address[1:].decode()
        inode = next(line.split()[6] for line in open("/proc/net/unix")
                     if line.rstrip().endswith(name))

        def sockets():
            found = set()
            for fd in os.listdir("/proc/self/fd"):
                try:
                    link = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:  # the listing's own descriptor, closed by now
                    continue
                if link.startswith("socket:["):
                    found.add(link[8:-1])
            return found

        assert inode in sockets()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, repr(sorted(sockets())).encode())
            os._exit(0)
        os.close(write)
        child = eval(os.read(read, 1 << 16).decode())
        os.waitpid(pid, 0)
        assert inode not in child, "the child holds the listener"
        assert inode in sockets(), "the parent lost it"
        """
    )


def test_a_close_whose_synchronization_failed_can_be_retried():
    run(
        """
        p = pool.allocate(3 * MiB, _core.LEGACY_STREAM, CUPY)
        h = emmpool.ipc.export(p)
        mem = h.open()
        h.close()
        pool.deallocate(p)
        host.fail_next_device_syncs(1)
        raises(mem.close, emmpool.CudaError, "cuCtxSynchronize")
        assert not mem.closed and _core.ipc_open_count() == 1
        time.sleep(0.05)
        assert pool.held_blocks() == 1  # still mapped here: the sender keeps the block
        mem.close()
        assert mem.closed and _core.ipc_open_count() == 0
        eventually(lambda: pool.held_blocks() == 0, "a retried close let nothing go")
        """
    )


def test_descriptors_are_counted_against_the_limit_before_any_is_opened():
    run(
        """
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        p = pool.allocate(200 * MiB, _core.LEGACY_STREAM, CUPY)   # 100 pages of 2 MiB
        # Room below the hard limit: the soft one is raised as far as the export needs.
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 20, hard))
        h = emmpool.ipc.export(p)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= open_fds()
        mem = h.open()  # 100 more for the moment of the import: raised again
        mem.close()
        # No room: refused, saying so, before any descriptor was made.
        q = pool.allocate(200 * MiB, _core.LEGACY_STREAM, CUPY)
        limit = open_fds() + 20
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
        fds, exports = open_fds(), host.stats()["exports"]
        raises(lambda: emmpool.ipc.export(q), emmpool.PoolError, "file descriptors")
        assert open_fds() == fds and host.stats()["exports"] == exports
        assert pool.held_blocks() == 1  # h's block: q's lease went with the failure
        raises(h.open, emmpool.PoolError, "ulimit -n")  # the receiver's side too
        assert open_fds() == fds and _core.ipc_open_count() == 0
        h.close()
        eventually(lambda: pool.held_blocks() == 0, "held after the export failed")
        """
    )


def test_what_is_not_emmpools_is_refused_saying_why():
    run(
        """
        p = pool.allocate(MiB, _core.LEGACY_STREAM, CUPY)
        for bad, words in [(12345, "no live block"), (p + 2 * MiB, "no live block")]:
            raises(lambda: emmpool.ipc.export(bad), ValueError, words)
        raises(lambda: emmpool.ipc.export(p, nbytes=2 * MiB), ValueError,
               "pass the end of its block")
        raises(lambda: emmpool.ipc.export("p"), TypeError, "device address")
        class Reversed:  # an array viewed backwards: its memory lies before its first element
            __cuda_array_interface__ = {"data": (p + 1024, False), "shape": (256,),
                                        "typestr": "<f4", "strides": (-4,), "version": 3}
        raises(lambda: emmpool.ipc.export(Reversed()), ValueError, "negative strides")
        pool.deallocate(p)
        raises(lambda: emmpool.ipc.export(p), ValueError, "while it is allocated")
        assert pool.held_blocks() == 0 and _core.ipc_service_stats()["leases"] == 0
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
        assert len(h.shared._offer[5]) == 3  # the block's pages
        assert h.source_info == ctx.device.get_device_identity() and h.base is not None
        raises(lambda: h.handle, AttributeError, "no legacy CUDA IPC handle")
        assert not hasattr(h, "handle")
        raises(lambda: h.open(ctx), ValueError, "opening IpcHandle from original process")
        h.close()  # never opened: nothing to do

        received = pickle.loads(pickle.dumps(h))  # the lease duplicated, sent, detached
        assert type(received) is type(h) and received.base is None
        assert (received.size, received.offset, received.source_info) == (1000, h.offset,
                                                                           h.source_info)
        assert received.shared._lease != h.shared._lease
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
        assert whole.size == 5 * MiB and whole.offset == 0 and len(whole.shared._offer[5]) == 3
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

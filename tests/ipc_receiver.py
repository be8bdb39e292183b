"""A receiving process for tests/test_ipc.py, started by multiprocessing (spawn): it takes an
emmpool.ipc handle off a queue, says so, and then ends as it is told (closing the handle, or
dying at once, as a crashed receiver would). Over the host driver the memory lives in the
sending process only, so a receiver here holds the handle, not a mapping: what it tests is the
lease, which crosses processes as a real descriptor."""

from __future__ import annotations

import os


def hold_then(inbox, outbox) -> None:
    handle = inbox.get()  # unpickled: the lease detached from the sender's resource sharer
    outbox.put(("holding", handle.kind, handle.nbytes))
    how = inbox.get()
    if how == "die":
        os._exit(3)  # no finalizer runs: the kernel closes the lease with the process
    handle.close()
    outbox.put("closed")
    inbox.get()  # stay alive until told: the test checks the block let go while we live


def open_without_ptrace(inbox, outbox) -> None:
    """Open a handle of pages in a process that may not copy another's descriptors: they must
    come over the sender's IPC service. The memory itself lives in the sender's host driver,
    so this process's own host driver refuses the import: reaching that step is the proof that
    the descriptors arrived."""
    import emmpool
    from emmpool import _core

    from tests import no_ptrace

    no_ptrace.deny_pidfd_getfd()
    _core._use_driver_for_all_pools(_core.HostDriver(devices=1, capacity=1 << 30))
    handle = inbox.get()
    refused = no_ptrace.pidfd_getfd_refused(os.getppid())
    try:
        handle.open()
        outbox.put((refused, "opened", ""))
    except (emmpool.CudaError, emmpool.PoolError) as e:
        outbox.put((refused, type(e).__name__, str(e)))
    handle.close()

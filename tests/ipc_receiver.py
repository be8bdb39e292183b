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

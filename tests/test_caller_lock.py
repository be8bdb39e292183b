"""The C entry points never hold the caller's GIL while they wait for the pool's lock or the GPU.

CuPy calls its allocator holding the GIL (PyTorch at times). A thread that holds the pool's lock
may be waiting for the GPU, and the GPU for a host callback queued before (Numba's
``stream.add_callback``, CuPy's ``launch_host_func``) that needs the GIL: an allocation or free
that waited for the pool's lock holding the GIL would deadlock all three, where each library's own
pool would not. Over the host driver, whose synchronizations run such a callback
(``HostDriver.set_sync_wait``), each entry point is called, holding the GIL, while another thread
holds the pool's lock in a synchronization: it must come back.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import ctypes, sys, threading, time
    from emmpool import _core

    host = _core.HostDriver(devices=1, capacity=1 << 32)
    _core._use_driver_for_all_pools(host)
    pool = _core.pool(0)
    lib = ctypes.PyDLL(_core.__file__)  # PyDLL: the GIL stays held through the call, as CuPy's
    def c(name, restype, *argtypes):
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, list(argtypes)
        return f
    P, Z, I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    cupy_malloc = c("emmpool_cupy_malloc", P, P, Z, I)
    cupy_free = c("emmpool_cupy_free", None, P, P, I)
    torch_malloc = c("emmpool_torch_malloc", P, Z, I, P)
    torch_free = c("emmpool_torch_free", None, P, Z, I, P)
    torch_stats = c("emmpool_torch_stats", I, I, ctypes.POINTER(ctypes.c_uint64), I)
    torch_trim = c("emmpool_torch_trim", Z, I)
    entry = _core.NumbaEntryPoints(pool)

    cupy_block, torch_block, numba_block = cupy_malloc(None, 4096, 0), torch_malloc(4096, 0, None), entry.allocate(4096)
    # A free not yet fenced complete: the other thread's synchronize() waits for the GPU.
    cupy_free(None, cupy_malloc(None, 1 << 20, 0), 0)

    entered = threading.Event()
    def host_callback():  # GPU work the synchronization waits for: it needs the GIL
        entered.set()
        time.sleep(0.3)  # lets go of the GIL, and needs it back to return
    host.set_sync_wait(host_callback)
    holder = threading.Thread(target=pool.synchronize)  # the pool's lock, through the wait
    holder.start()
    entered.wait()
    # From here the GIL is this thread's, held through the call (and the callback needs it).
    call = sys.argv[1]
    if call == "cupy_malloc":
        assert cupy_malloc(None, 4096, 0)
    elif call == "cupy_free":
        cupy_free(None, cupy_block, 0)
    elif call == "torch_malloc":
        assert torch_malloc(4096, 0, None)
    elif call == "torch_free":
        torch_free(torch_block, 4096, 0, None)
    elif call == "torch_stats":
        out = (ctypes.c_uint64 * 16)()
        assert torch_stats(0, out, 16) == 16
    elif call == "torch_trim":
        torch_trim(0)
    elif call == "numba_allocate":
        entry.allocate(4096)
    elif call == "numba_free":
        numba_block()
    holder.join()
    host.set_sync_wait(None)
    print("ok")
    """
)

SINGLE_THREAD = textwrap.dedent(
    """
    import ctypes, sys
    from emmpool import _core

    MiB = 1 << 20
    host = _core.HostDriver(devices=1, capacity=8 * MiB)
    _core._use_driver_for_all_pools(host)
    lib = ctypes.PyDLL(_core.__file__)
    P, Z, I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    malloc, free = lib.emmpool_cupy_malloc, lib.emmpool_cupy_free
    malloc.restype, malloc.argtypes = P, [P, Z, I]
    free.restype, free.argtypes = None, [P, P, I]
    free(None, malloc(None, 6 * MiB, 0), 0)  # pending: its fence has not completed
    ran = []
    host.set_sync_wait(lambda: ran.append(1))  # a host callback, queued before that fence
    # No room to grow: the pool waits for the pending free, and the GPU for the callback.
    assert malloc(None, 6 * MiB, 0)
    assert ran, "the allocation never waited for the GPU"
    host.set_sync_wait(None)
    print("ok")
    """
)


def test_an_allocation_that_waits_for_the_gpu_lets_host_callbacks_take_the_gil():
    # One thread: the wait for the GPU is the allocation's own (no room left but pending frees).
    try:
        out = subprocess.run([sys.executable, "-c", SINGLE_THREAD], capture_output=True,
                             text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the CuPy entry point waited for the GPU holding the GIL: deadlock")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


CALLS = ["cupy_malloc", "cupy_free", "torch_malloc", "torch_free", "torch_stats", "torch_trim",
         "numba_allocate", "numba_free"]


@pytest.mark.parametrize("call", CALLS)
def test_an_entry_point_lets_go_of_the_gil_while_the_pool_waits_for_the_gpu(call):
    try:
        out = subprocess.run([sys.executable, "-c", SCRIPT, call], capture_output=True,
                             text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{call} held the GIL while waiting for the pool's lock: deadlock")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

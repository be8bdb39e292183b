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

import shutil
import subprocess
import textwrap

import pytest

from tests.conftest import needs
from tests.processes import hung, run_python

# What every script below runs first: the process-wide pools over a host driver (`host`) and
# `entry_point(name, gil)`, a C entry point called through ctypes as its library calls it:
# holding the GIL throughout (PyDLL, as CuPy), or having let go of it (CDLL, as PyTorch's ops).
PREAMBLE = """
import ctypes, sys, threading, time
from emmpool import _core
host = _core.HostDriver(devices=1, capacity={capacity})
host.set_auto_complete({auto_complete})
_core._use_driver_for_all_pools(host)
P, Z, I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
SIGNATURES = {{
    "cupy_malloc": (P, [P, Z, I]),
    "cupy_free": (None, [P, P, I]),
    "torch_malloc": (P, [Z, I, P]),
    "torch_free": (None, [P, Z, I, P]),
    # its emmpool_torch_stats record: 16 uint64 (emmpool/torch_api.h)
    "torch_stats_of": (I, [I, ctypes.POINTER(ctypes.c_uint64)]),
    "torch_trim": (Z, [I]),
}}
def entry_point(name, gil=True):
    f = getattr((ctypes.PyDLL if gil else ctypes.CDLL)(_core.__file__), "emmpool_" + name)
    f.restype, f.argtypes = SIGNATURES[name]
    return f
"""


def run(body, *args, capacity=1 << 32, auto_complete=False, hang=None):
    """PREAMBLE, then `body`, in a fresh interpreter; it must print "ok". `hang`: the failure
    to report if it does not end in 30 s (a deadlock)."""
    code = PREAMBLE.format(capacity=capacity, auto_complete=auto_complete) + textwrap.dedent(body)
    out = run_python(["-c", code, *args], timeout=30 if hang else 60)
    if hung(out):  # with every thread's stack: where it waits
        pytest.fail(f"{hang or 'timed out'}\n{out.stderr[-4000:]}")
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode,
                                                               out.stderr[-2000:])


SCRIPT = """
    pool = _core.pool(0)
    cupy_malloc, cupy_free = entry_point("cupy_malloc"), entry_point("cupy_free")
    torch_malloc, torch_free = entry_point("torch_malloc"), entry_point("torch_free")
    torch_stats, torch_trim = entry_point("torch_stats_of"), entry_point("torch_trim")
    entry = _core.NumbaEntryPoints(pool)

    cupy_block, torch_block, numba_block = cupy_malloc(None, 4096, 0), torch_malloc(4096, 0, None), entry.allocate(4096)
    # A free not yet fenced complete: the other thread's synchronize() waits for the GPU.
    cupy_free(None, cupy_malloc(None, 1 << 20, 0), 0)

    entered, calling = threading.Event(), threading.Event()
    def host_callback():  # GPU work the synchronization waits for: it needs the GIL
        entered.set()
        calling.wait()  # returns only with the GIL, which the call below holds
    host.set_sync_wait(host_callback)
    holder = threading.Thread(target=pool.synchronize)  # the pool's lock, through the wait
    holder.start()
    entered.wait()
    sys.setswitchinterval(60)  # this thread keeps the GIL until it lets go of it itself
    calling.set()
    # From here the GIL is this thread's, held into the call, while the holder waits for it.
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
        assert torch_stats(0, out) == 0
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

SINGLE_THREAD = """
    MiB = 1 << 20
    malloc, free = entry_point("cupy_malloc"), entry_point("cupy_free")
    free(None, malloc(None, 6 * MiB, 0), 0)  # pending: its fence has not completed
    ran = []
    host.set_sync_wait(lambda: ran.append(1))  # a host callback, queued before that fence
    # No room to grow: the pool waits for the pending free, and the GPU for the callback.
    assert malloc(None, 6 * MiB, 0)
    assert ran, "the allocation never waited for the GPU"
    host.set_sync_wait(None)
    print("ok")
"""


def test_an_allocation_that_waits_for_the_gpu_lets_host_callbacks_take_the_gil():
    # One thread: the wait for the GPU is the allocation's own (no room left but pending frees).
    run(SINGLE_THREAD, capacity=8 << 20,
        hang="the CuPy entry point waited for the GPU holding the GIL: deadlock")


CALLS = ["cupy_malloc", "cupy_free", "torch_malloc", "torch_free", "torch_stats", "torch_trim",
         "numba_allocate", "numba_free"]


@pytest.mark.parametrize("call", CALLS)
def test_an_entry_point_lets_go_of_the_gil_while_the_pool_waits_for_the_gpu(call):
    run(SCRIPT, call, hang=f"{call} held the GIL while waiting for the pool's lock: deadlock")


EXIT_WITH_DAEMON_THREADS = """
    malloc, release = entry_point("cupy_malloc"), entry_point("cupy_free")
    trim = entry_point("torch_trim", gil=False)
    def cupy():
        while True:
            release(None, malloc(None, 1 << 20, 0), 0)
    def torch():
        while True:
            trim(0)
    entry = _core.NumbaEntryPoints(_core.pool(0))
    def numba():
        while True:
            entry.allocate(1 << 20)()
    pinned = _core.HostPool(host, 0, limit=1 << 30)
    def numba_pinned():  # the plugin's memhostalloc and its finalizer
        while True:
            ptr, generation = pinned.allocate_labelled(1 << 16)
            pinned.deallocate(ptr, _core.LEGACY_STREAM, generation)
    import emmpool
    def monitor():  # a program's own thread watching the pool: the public API and the pools'
        while True:   # pybind11 methods
            emmpool.stats(0), emmpool.trim(), _core.pool(0).synchronize()
    private = _core.DevicePool(host, 0)
    def methods():
        while True:
            private.deallocate(private.allocate(1 << 20), _core.LEGACY_STREAM)
            private.stats(), private.trim(), private.generation
            pinned.deallocate(pinned.allocate(1 << 16)), pinned.stats()
    import os
    def failed(args):  # a thread that raised would leave its calls untried
        print(args.exc_type.__name__, args.exc_value, file=sys.stderr, flush=True)
        os._exit(3)
    threading.excepthook = failed
    for f in (cupy, cupy, torch, torch, numba, numba, numba_pinned, numba_pinned, monitor,
              monitor, methods, methods):
        threading.Thread(target=f, daemon=True).start()
    time.sleep(0.1)
    print("ok")  # and exit, the daemon threads in the pool's entry points
"""


def test_the_process_exits_cleanly_with_threads_inside_the_entry_points():
    # A daemon thread that let go of the GIL in an entry point or a pool's method and takes it
    # back while the interpreter finalizes is ended by a forced unwind: through a noexcept
    # frame or a destructor (pybind11's gil_scoped_release), it aborts.
    for _ in range(8):
        run(EXIT_WITH_DAEMON_THREADS, auto_complete=True)


# A library's free as PyTorch's DataPtr deleter calls it: from a destructor (noexcept), here
# for PyTorch's free and a private (graph) pool's, holding the GIL (ctypes.PyDLL).
FREE_IN_DESTRUCTOR = r"""
#include <dlfcn.h>
#include <cstddef>
using torch_free_fn = void (*)(void*, std::size_t, int, void*);
using private_free_fn = void (*)(void*);
static torch_free_fn torch_free;
static private_free_fn private_free;
struct freed_by_torch { void* p; ~freed_by_torch() { torch_free(p, 0, 0, nullptr); } };
struct freed_privately { void* p; ~freed_privately() { private_free(p); } };
extern "C" void init(const char* core)
{
  void* lib    = dlopen(core, RTLD_NOW | RTLD_NOLOAD);
  torch_free   = reinterpret_cast<torch_free_fn>(dlsym(lib, "emmpool_torch_free"));
  private_free = reinterpret_cast<private_free_fn>(dlsym(lib, "emmpool_private_free"));
}
extern "C" void free_as_torch(void* p) { freed_by_torch d{p}; }
extern "C" void free_privately(void* p) { freed_privately d{p}; }
"""

EXIT_WITH_FREES_IN_DESTRUCTORS = """
    class Id(ctypes.Structure):
        _fields_ = [("first", ctypes.c_uint64), ("second", ctypes.c_uint64)]
    shim = ctypes.PyDLL(sys.argv[1])
    shim.init(_core.__file__.encode())
    shim.free_as_torch.argtypes = shim.free_privately.argtypes = [P]
    core = ctypes.PyDLL(_core.__file__)
    core.emmpool_private_create_or_incref.argtypes = [I, Id]
    core.emmpool_private_allocate.restype = P
    core.emmpool_private_allocate.argtypes = [Id, Z, I, P, P]
    torch_malloc = entry_point("torch_malloc")

    def work(k):
        pool = Id(7, k)
        core.emmpool_private_create_or_incref(0, pool)
        while True:  # another stream's free each time: the full path, which lets go of the GIL
            shim.free_as_torch(torch_malloc(1 << 16, 0, 0x100 + k))
            shim.free_privately(core.emmpool_private_allocate(pool, 1 << 16, 0, 0x200 + k, None))

    for k in range(6):
        threading.Thread(target=work, args=(k,), daemon=True).start()
    time.sleep(0.2)
    print("ok")
"""


def test_a_free_called_from_a_destructor_as_the_interpreter_exits_lets_it_exit(tmp_path):
    # Taking the GIL back as Python finalizes would end the thread by an unwind through the
    # destructor above the free: std::terminate, exit status 134 (caller_lock.hpp).
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip(needs("a C++ compiler", "none on PATH"))
    source, shim = tmp_path / "shim.cpp", tmp_path / "shim.so"
    source.write_text(FREE_IN_DESTRUCTOR)
    subprocess.run([cxx, "-shared", "-fPIC", "-O1", str(source), "-o", str(shim), "-ldl"],
                   check=True, capture_output=True)
    for _ in range(3):
        run(EXIT_WITH_FREES_IN_DESTRUCTORS, str(shim), auto_complete=True)


SUBINTERPRETER = """
    try:
        import _interpreters as interpreters
    except ImportError:
        import _xxsubinterpreters as interpreters
    _core.pool(0)
    stats = entry_point("torch_stats_of", gil=False)
    out = (ctypes.c_uint64 * 16)()
    assert stats(0, out) == 0
    interpreters.destroy(interpreters.create())  # from now on PyGILState_Check() answers 1
    assert stats(0, out) == 0
    print("ok")
"""


def test_an_entry_point_called_without_the_gil_after_a_subinterpreter():
    try:
        import _interpreters  # noqa: F401
    except ImportError:
        pytest.importorskip("_xxsubinterpreters", reason=needs("sub-interpreters", "this Python has none"))
    run(SUBINTERPRETER)


TWO_FREES = """
    pool = _core.DevicePool(host, 0)
    entry = _core.NumbaEntryPoints(pool)
    free = entry.allocate(4096)
    entry.allocate(1 << 20)()  # pending: synchronize() waits
    entered, go = threading.Event(), threading.Event()
    def host_callback():
        entered.set()
        go.wait()
    host.set_sync_wait(host_callback)
    holder = threading.Thread(target=pool.synchronize)  # the pool's lock, through the wait
    holder.start()
    entered.wait()
    errors = []
    def call():
        try:
            free()  # the first waits for the lock without the GIL; the second finds it freed
        except Exception as e:
            errors.append(e)
    callers = [threading.Thread(target=call) for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(0.2)
    go.set()
    holder.join()
    for t in callers:
        t.join()
    host.set_sync_wait(None)
    assert not errors, errors
    assert pool.stats()["frees"] == 2, pool.stats()
    print("ok")
"""


def test_a_numba_finalizer_called_from_two_threads_frees_once():
    run(TWO_FREES)

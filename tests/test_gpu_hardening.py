"""Hardening on a real GPU: threads, out-of-memory, fork and interpreter exit (skipped, with the
reason, where there is no GPU). The same situations over the host driver run in CI
(test_device_pool_host.py and the C++ tests); these check them against the CUDA driver.

Each scenario runs in a fresh interpreter (tests.test_gpu_numba.run) and must print OK with
nothing on stderr."""

from __future__ import annotations

import pytest

from tests.conftest import requires
from tests.test_gpu_numba import check, run

pytestmark = pytest.mark.gpu

MODES = ["pool", "passthrough"]

# 8 threads, each 400 operations: Numba arrays (written and read back), the pool's own
# allocate/free, and frees of arrays made by other threads (finalizers run on whatever thread
# drops the last reference). At the end every byte is back: nothing lost, nothing doubly freed.
THREADS = r"""
import gc, random, threading, numpy as np
from numba import cuda
import emmpool
from emmpool import _core

THREADS, OPS = 8, 400
cuda.device_array(1)                  # the context and the pool, before the threads start
pool = _core.pool(0)
shared, shared_lock, errors = [], threading.Lock(), []

def worker(seed):
    rng = random.Random(seed)
    mine = []
    try:
        for i in range(OPS):
            op = rng.random()
            if op < 0.4:
                n = rng.choice([1, 300, 4096, 70_000, 1 << 20, 3 << 20])
                a = cuda.to_device(np.full(n, seed, np.uint8))
                mine.append(a)
            elif op < 0.6:
                p = pool.allocate(rng.choice([256, 5000, 1 << 21]))
                pool.deallocate(p)
            elif op < 0.8 and mine:
                with shared_lock:
                    shared.append(mine.pop(rng.randrange(len(mine))))
            else:
                with shared_lock:
                    victim = shared.pop(rng.randrange(len(shared))) if shared else None
                del victim                        # another thread's array, freed here
            if len(mine) > 20:
                a = mine.pop(0)
                assert (a.copy_to_host() == seed).all(), "data of a live array changed"
                del a
        for a in mine:
            assert (a.copy_to_host() == seed).all(), "data of a live array changed"
    except BaseException as e:
        errors.append(repr(e))

ts = [threading.Thread(target=worker, args=(s,)) for s in range(1, THREADS + 1)]
for t in ts: t.start()
for t in ts: t.join(timeout=240)
assert not any(t.is_alive() for t in ts), "a thread hung"
assert not errors, errors
del shared[:]; gc.collect(); cuda.synchronize()
s = emmpool.stats(0)
assert s["bytes_in_use"] == 0 and s["blocks_in_use"] == 0, s
assert s["allocations"] == s["frees"], s
print(f"threads={THREADS} ops={THREADS * OPS} allocations={s['allocations']}")
print("OK")
"""

# Four out-of-memory situations; each must raise Numba's CudaAPIError(CUDA_ERROR_OUT_OF_MEMORY)
# (or, through the pool's own API, emmpool.OutOfMemoryError) and leave the pool usable.
OUT_OF_MEMORY_CASES = r"""
import gc, threading, numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError
import emmpool
from emmpool import _core

GiB, MiB = 1 << 30, 1 << 20
total = cuda.current_context().get_memory_info().total
pool = _core.pool(0)

def expect_oom(make, what):
    try:
        x = make()
    except CudaAPIError as e:
        assert e.code == 2, (what, e.code)
        return str(e)
    raise AssertionError(f"{what}: no out-of-memory error")

def usable():
    a = cuda.to_device(np.arange(1 << 16))
    assert (a.copy_to_host() == np.arange(1 << 16)).all()

# 1. larger than the GPU
msg = expect_oom(lambda: cuda.device_array(2 * total, np.uint8), "larger than the GPU")
usable()

# 2. fits only once the pool gives cached segments back: fill 70% in 1 GiB arrays, drop them
#    (the pool keeps them), then ask for one array of 60%.
n = int(0.7 * total) // GiB
arrays = [cuda.device_array(GiB, np.uint8) for _ in range(n)]
del arrays; gc.collect()
big = cuda.device_array(int(0.6 * total), np.uint8)
big[:4].copy_to_device(np.arange(4, dtype=np.uint8))
del big; gc.collect()
usable()

# 3. fragmented (pool mode; passthrough has no segments to fragment): 10 MiB arrays, two per
#    20 MiB segment, over 80% of the device, every other one freed. 40% of the device is free in
#    the pool, in 10 MiB holes, none of whose segments can go back to the driver.
ooms = 1                                  # case 1
if pool.options["mode"] == "pool":
    n = int(0.8 * total) // (10 * MiB)
    arrays = [cuda.device_array(10 * MiB, np.uint8) for _ in range(n)]
    del arrays[::2]; gc.collect()
    s = emmpool.stats(0)
    request = int(0.3 * total)
    assert s["bytes_free"] + s["bytes_waiting"] > request, s  # enough bytes, not in one piece
    msg = expect_oom(lambda: cuda.device_array(request, np.uint8), "fragmented")
    assert "holds" in msg, msg
    usable()
    del arrays; gc.collect()
    big = cuda.device_array(request, np.uint8)  # after the frees: segments go back, then it fits
    del big; gc.collect()
    ooms += 1

# 4. while other threads allocate: 4 threads churn 256 MiB arrays, retrying on out-of-memory;
#    the main thread asks for more than the device three times.
stop, errors, counts = threading.Event(), [], [0] * 4
def churn(k):
    try:
        live = []
        while not stop.is_set():
            try:
                live.append(cuda.device_array(256 * MiB, np.uint8))
                counts[k] += 1
            except CudaAPIError as e:
                assert e.code == 2, e.code
                live.clear()
            if len(live) > 8:
                live.pop(0)
    except BaseException as e:
        errors.append(repr(e))
ts = [threading.Thread(target=churn, args=(k,)) for k in range(4)]
for t in ts: t.start()
for _ in range(3):
    expect_oom(lambda: cuda.device_array(total + GiB, np.uint8), "while threads allocate")
stop.set()
for t in ts: t.join(timeout=120)
assert not errors and not any(t.is_alive() for t in ts), errors
assert min(counts) > 0, counts
gc.collect(); cuda.synchronize()
usable()
s = emmpool.stats(0)
assert s["bytes_in_use"] == 0, s
assert s["out_of_memory"] >= ooms + 3, s
print("OK")
"""

# fork() after the parent used the pool. The child may touch nothing of CUDA (Numba refuses,
# and so does emmpool, with errors that say so); dropping inherited arrays is harmless; the
# parent's memory is untouched. One child ends with os._exit, one with a normal interpreter exit
# (atexit handlers and finalizers run in the child).
FORK = r"""
import gc, os, sys, tempfile, warnings, numpy as np
# CUDA's own threads make the process multi-threaded; Python 3.12 warns about fork() then.
warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks",
                        category=DeprecationWarning)
from numba import cuda
import emmpool
from emmpool import _core

data = cuda.to_device(np.arange(1 << 20, dtype=np.int64))
cuda.synchronize()

def child(normal_exit):
    out = []
    try:
        _core.pool(0).allocate(1024)
        out.append("emmpool allocated in the child")
    except emmpool.PoolError as e:
        out.append("emmpool-refused" if "spawn" in str(e) else f"emmpool: {e}")
    try:
        cuda.device_array(10)
        out.append("numba allocated in the child")
    except Exception as e:
        out.append("numba-refused")
    global data
    del data; gc.collect()                # an inherited array, finalized in the child
    os.write(1, (" ".join(out) + "\n").encode())
    if normal_exit:
        sys.exit(0)
    os._exit(0)

for normal_exit in (False, True):
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.dup2(err.fileno(), 2)          # the child's stderr, for the parent to check
        child(normal_exit)
    _, status = os.waitpid(pid, 0)
    err.seek(0)
    child_err = err.read().decode(errors="replace")
    for bad in ("Traceback", "Fatal Python error", "Segmentation", "emmpool"):
        assert bad not in child_err, child_err
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, child_err)

assert (data.copy_to_host() == np.arange(1 << 20)).all(), "the parent's array changed"
b = cuda.to_device(np.ones(1000))
assert (b.copy_to_host() == 1).all()
print("OK")
"""

# Interpreter exit with arrays of every library alive, the three sharing one pool.
EXIT_SHARED = r"""
import numpy as np, cupy, torch
from numba import cuda
import emmpool
emmpool.use_for_torch(); emmpool.use_for_cupy(); emmpool.use_for_numba()
n = cuda.to_device(np.arange(1000))
c = cupy.arange(1000)
t = torch.arange(1000, device="cuda")
s = cupy.cuda.Stream(non_blocking=True)
with s:
    c2 = cupy.ones(1 << 20)
ts = torch.cuda.Stream()
with torch.cuda.stream(ts):
    t2 = torch.ones(1 << 20, device="cuda")
assert int(c.sum()) == int(t.sum()) == int(n.copy_to_host().sum()) == 499500
assert emmpool.stats(0)["by_library"]["cupy"]["bytes_in_use"] > 0
print("OK")
"""


@pytest.mark.parametrize("mode", MODES)
def test_threads_allocate_and_free_through_numba_and_the_pool(mode):
    check(run(THREADS, mode=mode))


@pytest.mark.parametrize("mode", MODES)
def test_out_of_memory_cases_leave_the_pool_usable(mode):
    check(run(OUT_OF_MEMORY_CASES, mode=mode))


@pytest.mark.fork
@pytest.mark.parametrize("mode", MODES)
def test_fork_after_use_child_refuses_parent_intact(mode):
    p = run(FORK, mode=mode)
    check(p)
    lines = p.stdout.splitlines()
    assert lines.count("emmpool-refused numba-refused") == 2, p.stdout


@requires("cupy", "torch")
@pytest.mark.cupy
@pytest.mark.torch
@pytest.mark.parametrize("mode", MODES)
def test_exit_with_live_arrays_of_three_libraries(mode):
    check(run(EXIT_SHARED, mode=mode, manager=None))

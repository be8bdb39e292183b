"""emmpool.ipc across processes on a GPU: CuPy arrays of the growable segment (their pages) and
of fixed segments (a legacy handle), sent to a spawned child through multiprocessing and back,
read and written on both sides; and a child that dies holding an import takes nothing from the
sender, whose handle holds the freed block until it is closed. Numba's handles of arrays on the growable segment (the plugin's PagesIpcHandle), sent
and opened as Numba's own tests do. (PyTorch's tensors: tests/test_gpu_torch.py,
torch.multiprocessing.)"""

from __future__ import annotations

import textwrap

import pytest

from tests import gpu_scripts
from tests.conftest import requires
from tests.processes import run_python
from tests.test_gpu_numba import check as check_numba, run as run_numba

pytestmark = [pytest.mark.gpu, pytest.mark.ipc]

SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp
    import os, sys, time
    import cupy, emmpool, emmpool.ipc

    def child(inbox, outbox, die, segments):
        emmpool.configure(segments=segments)
        emmpool.use_for_cupy()
        handle = inbox.get()
        mem = handle.open()
        x = cupy.asarray(mem)                      # the parent's array, mapped here
        total = float(x.sum())
        x += 1                                     # written for the parent to see
        cupy.cuda.runtime.deviceSynchronize()
        if die:
            os._exit(0)                            # holding the import: never closed
        y = cupy.full(x.shape, 7, dtype=x.dtype)   # the other way: the child's own array
        outbox.put((total, emmpool.ipc.export(y)))
        inbox.get()                                # until the parent has read it
        del x
        mem.close()

    def main(elements, segments, die):
        emmpool.configure(segments=segments)
        emmpool.use_for_cupy()
        pad = cupy.zeros(1000, dtype=cupy.float32)          # noqa: F841 (an offset in the segment)
        # the kernels the checks below use, loaded before the device's free memory is read
        assert bool((pad == cupy.arange(1000, dtype=cupy.float32) + 1).all()) is False
        free_before = emmpool._core.memory_info(0)[0]
        a = cupy.arange(elements, dtype=cupy.float32)
        cupy.cuda.runtime.deviceSynchronize()
        handle = emmpool.ipc.export(a)
        ctx = mp.get_context("spawn")
        inbox, outbox = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=child, args=(inbox, outbox, die, segments))
        p.start()
        inbox.put(handle)
        if die:
            p.join(120)
            assert p.exitcode == 0, p.exitcode
            assert bool((a == cupy.arange(elements, dtype=cupy.float32) + 1).all())
            del a, pad
            emmpool.trim()
            # The sender's handle still holds a's block (the dead child's copy let go with it):
            # freed, it is still in use, never reused.
            held = emmpool.stats(0)["bytes_in_use"] >= 4 * elements
            handle.close()
            pool = emmpool._core.pool(0)
            for _ in range(1000):
                if pool.held_blocks() == 0:
                    break
                time.sleep(0.01)
            emmpool.trim()
            st = emmpool.stats(0)
            # (a few MiB of the driver's own may come and go)
            def returned():
                return emmpool._core.memory_info(0)[0] >= free_before - (16 << 20)
            # then the memory went back to the driver: the dead child's import held none of it
            print("RESULT", handle.kind, st["bytes_in_use"], st["bytes_reserved"], held,
                  returned())
            return
        total, back = outbox.get(timeout=120)
        with back.open() as mem:
            seen = float(cupy.asarray(mem).sum())
        inbox.put("done")
        p.join(120)
        assert p.exitcode == 0, p.exitcode
        assert total == elements * (elements - 1) / 2, total
        assert bool((a == cupy.arange(elements, dtype=cupy.float32) + 1).all())
        assert seen == 7 * elements, seen
        print("RESULT", handle.kind, back.kind)

    if __name__ == "__main__":
        main(int(sys.argv[1]), sys.argv[2], sys.argv[3] == "die")
    """
)


def run(elements: int, segments: str, die: bool = False, tmp_path=None) -> list[str]:
    path = tmp_path / "ipc_scenario.py"
    path.write_text(SCRIPT)
    p = run_python([str(path), str(elements), segments, "die" if die else "live"], timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, p.stdout + p.stderr
    return lines[-1].split()[1:]


@pytest.mark.cupy
@requires("cupy")
@pytest.mark.parametrize("segments", ["growable", "fixed"])
def test_cupy_arrays_both_ways(segments, tmp_path):
    # 4 MiB: a growable block (its pages) under segments=growable, a large fixed segment's
    # block otherwise
    kinds = run(1 << 20, segments, tmp_path=tmp_path)
    expected = "pages" if segments == "growable" else "handle"
    assert kinds == [expected, expected], kinds


@pytest.mark.cupy
@requires("cupy")
def test_a_small_array_shares_its_small_segment(tmp_path):
    assert run(1000, "growable", tmp_path=tmp_path) == ["handle", "handle"]


@pytest.mark.cupy
@requires("cupy")
def test_a_child_that_dies_holding_an_import_takes_nothing_from_the_sender(tmp_path):
    # 256 MiB: a leak would show in the device's free memory
    kind, in_use, reserved, held, returned = run(1 << 26, "growable", die=True,
                                                 tmp_path=tmp_path)
    assert kind == "pages"
    assert held == "True"  # until the sender closes its handle
    assert int(in_use) == 0 and int(reserved) == 0, (in_use, reserved)
    assert returned == "True"


# Numba (tests/gpu_scripts.py's scenarios: the plugin loaded by NUMBA_CUDA_MEMORY_MANAGER, the
# package EMMCI_TEST_CUDA names) with EMMPOOL_SEGMENTS=growable: an array of 4 MiB lies on the
# growable segment, so its handles are the plugin's PagesIpcHandle. The start of each scenario:
# the array (after a pad, so that it does not start a page), and the check that it is so.
NUMBA_GROWABLE_ARRAY = gpu_scripts.SPAWNED_CONSUMER + r"""
import numpy as np

def array_on_pages():
    ctx = cuda.current_context()
    pages = type(ctx.memory_manager).PagesIpcHandle
    pad = cuda.device_array(12345, np.uint8)
    a = cuda.to_device(np.arange(1 << 19, dtype=np.float64))   # 4 MiB
    pool = ctx.memory_manager.pool
    ptr = a.__cuda_array_interface__["data"][0]
    assert pool.share_pages(ptr) is not None, "a Numba array of 4 MiB is not on growable pages"
    return ctx, pages, pad, a
"""

# (a) devarr.get_ipc_handle(): Numba's IpcArrayHandle, of the array and of slices, opened by a
# spawned child with `with handle as array` (tests/gpu_scripts.py's read_handles), as Numba's own
# test_ipc_array does; and opened twice at once, refused with Numba's words.
NUMBA_ARRAY_HANDLES = NUMBA_GROWABLE_ARRAY + r"""
def open_twice(payload, q):
    handle = pickle.loads(payload)
    with handle as d:
        first = float(d.copy_to_host()[0])
        try:
            with handle:
                pass
        except ValueError as e:
            q.put((first, str(e)))
            return
    q.put((first, "opened twice"))

if __name__ == "__main__":
    ctx, pages, pad, a = array_on_pages()
    n = a.shape[0]
    sl, tail = a[1000:300_000], a[n - 5:]
    handles = [a.get_ipc_handle(), sl.get_ipc_handle(), tail.get_ipc_handle()]
    for h in handles:
        assert isinstance(h._ipc_handle, pages), type(h._ipc_handle)
    offsets = [h._ipc_handle.offset for h in handles]
    assert offsets[1] == offsets[0] + 1000 * 8 and offsets[2] == offsets[0] + (n - 5) * 8, offsets
    assert [h._ipc_handle.size for h in handles] == [a.nbytes, sl.nbytes, tail.nbytes]
    got = run_consumer(read_handles, pickle.dumps(handles))
    assert (got[0] == a.copy_to_host()).all()
    assert (got[1] == sl.copy_to_host()).all()
    assert (got[2] == tail.copy_to_host()).all() and got[2].tolist() == list(range(n - 5, n))
    first, words = run_consumer(open_twice, pickle.dumps(sl.get_ipc_handle()))
    assert first == 1000.0 and "IpcHandle is already opened" in words, (first, words)
    print("OK")
"""

# (b) ctx.get_ipc_handle(devarr.gpu_data), pickled: unpickled here it is the same handle (no
# legacy bytes); a spawned child opens it staged (a copy, as Numba's test_staged does on device
# 0), then with open_array, reads it all and writes its first elements for this process to see;
# a slice's gpu_data opens to the slice.
NUMBA_CONTEXT_HANDLE = NUMBA_GROWABLE_ARRAY + r"""
f64 = np.dtype(np.float64)

def staged(payload, q):
    handle = pickle.loads(payload)
    mem = handle.open_staged(cuda.current_context())
    got = np.empty(handle.size // f64.itemsize, f64)
    cuda.cudadrv.driver.device_to_host(got, mem, handle.size)
    handle.close()
    q.put(got)

def open_and_write(payload, q):
    handle, part = pickle.loads(payload)
    ctx = cuda.current_context()
    d = handle.open_array(ctx, shape=handle.size // f64.itemsize, dtype=f64)
    whole = d.copy_to_host()
    d[:4].copy_to_device(np.array([-1.0, -2.0, -3.0, -4.0]))
    cuda.synchronize()
    handle.close()
    p = part.open_array(ctx, shape=part.size // f64.itemsize, dtype=f64)
    q.put((whole, p.copy_to_host()))
    part.close()

if __name__ == "__main__":
    ctx, pages, pad, a = array_on_pages()
    h = ctx.get_ipc_handle(a.gpu_data)
    assert isinstance(h, pages) and isinstance(h, cuda.cudadrv.driver.IpcHandle), type(h)
    assert h.size == a.nbytes and h.base is a.gpu_data
    try:
        h.handle
    except AttributeError as e:
        assert "no legacy CUDA IPC handle" in str(e), e
    else:
        raise AssertionError("a handle of pages has legacy bytes")
    back = pickle.loads(pickle.dumps(h))
    assert type(back) is type(h) and back.base is None
    assert (back.size, back.offset, back.source_info) == (h.size, h.offset, h.source_info)
    expected = np.arange(1 << 19, dtype=np.float64)
    got = run_consumer(staged, pickle.dumps(h))
    assert (got == expected).all()
    sl = a[5000:6000]
    part = ctx.get_ipc_handle(sl.gpu_data)
    assert isinstance(part, pages) and part.offset == h.offset + 5000 * 8, (part.offset, h.offset)
    whole, got_part = run_consumer(open_and_write, pickle.dumps((h, part)))
    assert (whole == expected).all() and (got_part == expected[5000:6000]).all()
    assert a[:5].copy_to_host().tolist() == [-1.0, -2.0, -3.0, -4.0, 4.0]
    print("OK")
"""


def test_numbas_array_handles_of_growable_memory_open_in_a_child(monkeypatch, numba_package):
    monkeypatch.setenv("EMMPOOL_SEGMENTS", "growable")
    check_numba(run_numba(NUMBA_ARRAY_HANDLES, mode="pool", package=numba_package))


def test_numbas_context_handle_of_growable_memory_pickles_and_opens_in_a_child(
        monkeypatch, numba_package):
    monkeypatch.setenv("EMMPOOL_SEGMENTS", "growable")
    check_numba(run_numba(NUMBA_CONTEXT_HANDLE, mode="pool", package=numba_package))

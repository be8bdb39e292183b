"""emmpool.ipc across processes on a GPU: CuPy arrays of the growable segment (their pages) and
of fixed segments (a legacy handle), sent to a spawned child through multiprocessing and back,
read and written on both sides; and a child that dies holding an import takes nothing from the
sender. (PyTorch's tensors: tests/test_gpu_torch.py, torch.multiprocessing.)"""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import requires
from tests.processes import run_python

pytestmark = [pytest.mark.gpu, pytest.mark.ipc, pytest.mark.cupy, requires("cupy")]

SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp
    import os, sys
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
            st = emmpool.stats(0)
            # (a few MiB of the driver's own may come and go)
            def returned():
                return emmpool._core.memory_info(0)[0] >= free_before - (16 << 20)
            # the handle's own descriptors still hold the pages, whatever the pool did
            held = not returned()
            handle.close()
            # then they went back to the driver: the dead child's import held none of them
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


@pytest.mark.parametrize("segments", ["growable", "fixed"])
def test_cupy_arrays_both_ways(segments, tmp_path):
    # 4 MiB: a growable block (its pages) under segments=growable, a large fixed segment's
    # block otherwise
    kinds = run(1 << 20, segments, tmp_path=tmp_path)
    expected = "pages" if segments == "growable" else "handle"
    assert kinds == [expected, expected], kinds


def test_a_small_array_shares_its_small_segment(tmp_path):
    assert run(1000, "growable", tmp_path=tmp_path) == ["handle", "handle"]


def test_a_child_that_dies_holding_an_import_takes_nothing_from_the_sender(tmp_path):
    # 256 MiB: a leak would show in the device's free memory
    kind, in_use, reserved, held, returned = run(1 << 26, "growable", die=True,
                                                 tmp_path=tmp_path)
    assert kind == "pages"
    assert int(in_use) == 0 and int(reserved) == 0, (in_use, reserved)
    assert held == "True"  # until the sender closes its handle
    assert returned == "True"

"""The use_for_* family against the real libraries (GPU): each installs once, says what it
installed, and leaves an allocator that another library or the program chose in place
(tests/test_use_for.py checks the same logic with stand-ins, without a GPU)."""

from __future__ import annotations

import pytest

from tests.conftest import requires
from tests.test_gpu_numba import check, run

pytestmark = pytest.mark.gpu

NUMBA = r"""
import sys
from numba import cuda
import emmpool
if sys.argv[1] == "first":
    done = emmpool.use_for_numba()
    assert (done.library, done.how) == ("numba", "memory manager"), done
    assert emmpool.use_for_numba() == done
    a = cuda.device_array(1000)
    assert type(cuda.current_context().memory_manager) is done.allocators[0]
    assert emmpool.stats(0)["by_library"]["numba"]["bytes_in_use"] >= 8000
else:  # Numba has made its context with its own manager: that context keeps it
    a = cuda.device_array(1000)
    try:
        emmpool.use_for_numba()
    except emmpool.AllocatorConflictError as e:
        assert "has made its CUDA context already, with " in str(e), e
        assert "NumbaCUDAMemoryManager" in str(e), e
    else:
        raise AssertionError("use_for_numba() after Numba's first context said nothing")
print("OK")
"""


@pytest.mark.parametrize("when", ["first", "after-numba"])
def test_use_for_numba(when):
    check(run(NUMBA, when, manager=None))


CUPY = r"""
import cupy
import emmpool
done = emmpool.use_for_cupy()                  # CuPy's default pool: taken over
assert (done.library, done.how) == ("cupy", "C function allocator"), done
assert cupy.cuda.get_allocator() is done.allocators[0]
assert emmpool.use_for_cupy() == done
a = cupy.ones(1000)
assert emmpool.stats(0)["by_library"]["cupy"]["bytes_in_use"] >= 8000
other = cupy.cuda.MemoryPool()                 # another pool, chosen by the program
cupy.cuda.set_allocator(other.malloc)
try:
    emmpool.use_for_cupy()
except emmpool.AllocatorConflictError as e:
    assert "CuPy allocates through " in str(e) and "replace=True" in str(e), e
else:
    raise AssertionError("another CuPy allocator was replaced")
assert cupy.cuda.get_allocator() == other.malloc
again = emmpool.use_for_cupy(replace=True)
assert cupy.cuda.get_allocator() is again.allocators[0]
print("OK")
"""


@requires("cupy")
def test_use_for_cupy():
    check(run(CUPY, manager=None))


TORCH = r"""
import sys, torch
import emmpool
case = sys.argv[1]
if case == "first":
    done = emmpool.use_for_torch()
    assert done.library == "torch" and done.how in ("extension", "pluggable"), done
    assert emmpool.use_for_torch() == done
    t = torch.ones(1000, device="cuda")
    assert emmpool.stats(0)["by_library"]["torch"]["bytes_in_use"] >= 4000
else:
    if case == "after-torch":     # PyTorch's own allocator is initialized with CUDA
        torch.zeros(1, device="cuda")
        expected = "PyTorch has initialized CUDA with its own caching allocator already"
    else:                          # another allocator changed to, before any CUDA use
        other = torch.cuda.memory.CUDAPluggableAllocator("libc.so.6", "malloc", "free")
        torch.cuda.memory.change_current_allocator(other)
        expected = "PyTorch allocates through another allocator already ('pluggable'"
    try:
        emmpool.use_for_torch()
    except emmpool.AllocatorConflictError as e:
        assert str(e).startswith(expected), e
    else:
        raise AssertionError("use_for_torch() took another allocator's place")
print("OK")
"""


@requires("torch")
@pytest.mark.parametrize("case", ["first", "after-torch", "after-another"])
def test_use_for_torch(case):
    check(run(TORCH, case, manager=None))

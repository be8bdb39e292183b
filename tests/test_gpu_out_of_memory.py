"""The out-of-memory callback on a real GPU (skipped, with the reason, where there is none): a
Numba allocation larger than what the pool may still take succeeds once the callback has freed
a CuPy array, as a spilling Dask worker would."""

from __future__ import annotations

import pytest

from tests.conftest import requires
from tests.test_gpu_numba import check, run

pytestmark = [
    pytest.mark.gpu,
    requires("cupy"),
    pytest.mark.cupy,
]

SPILL = r"""
import cupy
from numba import cuda
import emmpool
GiB = 1 << 30
emmpool.configure(maximum_pool_size=8 * GiB)
emmpool.use_for_cupy()
spillable = [cupy.ones(3 * GiB, dtype=cupy.uint8) for _ in range(2)]   # 6 of the pool's 8 GiB
calls = []
def spill(device, size, stats):
    calls.append((device, size, stats["by_library"]["cupy"]["bytes_in_use"]))
    if not spillable:
        return False
    spillable.pop()            # "to host": its memory goes back to the pool
    return True
emmpool.set_out_of_memory_callback(spill)
d = cuda.device_array(4 * GiB, dtype="u1")       # needs one spill
d[:1024] = 7
assert (d[:1024].copy_to_host() == 7).all()
assert calls == [(0, 4 * GiB, 6 * GiB)], calls
assert len(spillable) == 1
try:
    cuda.device_array(8 * GiB, dtype="u1")       # more than the cap: spills all, still fails
except Exception as e:
    assert "OUT_OF_MEMORY" in str(e) or "out of memory" in str(e), e
else:
    raise AssertionError("no out-of-memory error")
assert not spillable and len(calls) == 3, calls
print("OK")
"""


def test_a_numba_allocation_succeeds_after_the_callback_frees_a_cupy_array():
    check(run(SPILL))

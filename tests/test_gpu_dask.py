"""Dask on GPUs (dask-cuda's LocalCUDACluster): README's example, as written, on two GPUs (the
result, and each worker's pool on its own GPU serving Numba and CuPy), and a worker that spills
to host instead of failing a task, on one. Skipped, with the reason, where the GPUs, dask-cuda
or CuPy are absent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import needs, require
from tests.processes import run_python

pytestmark = [pytest.mark.gpu, pytest.mark.dask]

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_dask_example() -> str:
    """The first Python block of README's section "### Dask"."""
    section = README.read_text().split("\n### Dask\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_job(tmp_path, code: str, *, gpus: int, timeout: float):
    """Run a Dask job on `gpus` GPUs (else skip) as a user runs it: from a file, since the
    workers are spawned processes that import it. Returns its stdout, once it exited 0."""
    import emmpool

    if emmpool._core.device_count() < gpus:
        pytest.skip(needs(f"{gpus} or more CUDA GPUs", f"this machine has {emmpool._core.device_count()}"))
    for module in ("dask_cuda", "cupy"):
        require(module)
    script = tmp_path / "job.py"
    script.write_text(code)
    done = run_python([str(script)], timeout=timeout, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.multi_gpu
def test_readme_dask_example_on_two_gpus(tmp_path):
    stdout = run_job(tmp_path, readme_dask_example(), gpus=2, timeout=300)
    lines = stdout.splitlines()
    assert float(lines[0]) == 2.0**52, stdout  # sum of 2x + 1 for x < 2**26
    rows = [line.split() for line in lines[2:] if line.startswith("tcp://")]
    assert len(rows) == 2, stdout
    for row in rows:
        # every worker has one pool, on its device 0, which served both libraries
        assert row[1] == "0" and "numba" in row and "cupy" in row, stdout


SPILL = r"""
import cupy, dask.array as da
from dask_cuda import LocalCUDACluster
from distributed import Client
import emmpool.dask

GiB = 1 << 30

def data():  # 6 GiB of device data in 256 MiB chunks, for a pool capped at 4 GiB
    return da.ones((24, 2**25), chunks=(1, 2**25)).map_blocks(cupy.asarray)

if __name__ == "__main__":
    # dask-cuda's own spilling (device_memory_limit) starts above the pool's cap: the pool runs
    # out first, as when other libraries hold the rest of the GPU.
    with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", n_workers=1, threads_per_worker=1,
                          device_memory_limit="12GiB", memory_limit="64GiB") as cluster, \
            Client(cluster) as client:
        client.register_plugin(emmpool.dask.EmmPool(maximum_pool_size="4GiB", cupy=True))
        try:
            data().persist().sum().compute()
        except Exception as e:  # the task's out-of-memory error, as CuPy raises it
            print("without spill:", type(e).__name__)
        else:
            print("without spill: no error")
        client.restart()
        client.register_plugin(
            emmpool.dask.EmmPool(maximum_pool_size="4GiB", cupy=True, spill=True))
        x = data().persist()
        print("total:", float((x * 2).sum().compute()))
        spilled = client.run(lambda dask_worker: dask_worker.plugins["emmpool"].spiller.spilled_bytes)
        print("spilled:", sum(spilled.values()))
"""


def test_a_worker_spills_to_host_instead_of_failing_on_one_gpu(tmp_path):
    stdout = run_job(tmp_path, SPILL, gpus=1, timeout=400)
    lines = dict(line.split(": ", 1) for line in stdout.splitlines() if ": " in line)
    assert lines["without spill"] == "OutOfMemoryError", stdout
    assert float(lines["total"]) == 2.0 * 24 * 2**25, stdout
    assert int(lines["spilled"]) >= 2 << 30, stdout  # at least the 2 GiB over the cap

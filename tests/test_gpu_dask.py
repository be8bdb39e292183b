"""README's Dask example, as written, on two GPUs (dask-cuda's LocalCUDACluster): the result,
and each worker's pool on its own GPU serving Numba and CuPy. Skipped, with the reason, where
fewer than two GPUs, or dask-cuda or CuPy, are absent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.processes import run_python

pytestmark = pytest.mark.gpu

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_dask_example() -> str:
    """The first Python block of README's section "### Dask"."""
    section = README.read_text().split("\n### Dask\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_dask_example_on_two_gpus(tmp_path):
    import emmpool

    if emmpool._core.device_count() < 2:
        pytest.skip("needs two or more GPUs")
    for module in ("dask_cuda", "cupy"):
        pytest.importorskip(module, reason=f"the example needs {module}")
    # A file, as a user runs it: the workers are spawned processes that import it.
    script = tmp_path / "example.py"
    script.write_text(readme_dask_example())
    done = run_python([str(script)], timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert float(lines[0]) == 2.0**52, done.stdout  # sum of 2x + 1 for x < 2**26
    rows = [line.split() for line in lines[2:] if line.startswith("tcp://")]
    assert len(rows) == 2, done.stdout
    for row in rows:
        # every worker has one pool, on its device 0, which served both libraries
        assert row[1] == "0" and "numba" in row and "cupy" in row, done.stdout

"""The command-line tool and the trace on a real GPU (skipped, with the reason, elsewhere)."""

from __future__ import annotations

import os

import pytest

from emmpool import trace
from tests.processes import run_python

pytestmark = pytest.mark.gpu


def run_cli(*args, env=None, timeout=600):
    return run_python(["-m", "emmpool", *args], timeout=timeout, env=env)


def test_info():
    p = run_cli("info")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "driver: CUDA" in p.stdout and "device 0:" in p.stdout


def test_selftest():
    p = run_cli("selftest")
    assert p.returncode == 0 and "PASS" in p.stdout, p.stdout + p.stderr


def test_numba_run_traced_to_csv_then_replayed(tmp_path):
    path = tmp_path / "numba.csv"
    code = (
        "import numpy as np\n"
        "from numba import cuda\n"
        "arrays = [cuda.device_array(int(n), np.uint8) for n in np.geomspace(256, 1 << 24, 50)]\n"
        "del arrays[::2]\n"
    )
    env = dict(os.environ, EMMPOOL_TRACE=str(path), NUMBA_CUDA_MEMORY_MANAGER="emmpool.plugin")
    p = run_python(["-c", code], env=env, timeout=300)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    records = trace.read_csv(path)
    allocs = [r for r in records if r.op == "alloc" and r.library == "numba"]
    assert len(allocs) >= 50 and sum(r.op == "free" for r in records) >= 25
    p = run_cli("replay", str(path), "--backends", "emmpool-host", "emmpool")
    assert p.returncode == 0 and "| emmpool |" in p.stdout, p.stdout + p.stderr

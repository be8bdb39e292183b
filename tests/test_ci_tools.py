"""The GPU host's tools, checked here where they can be without a GPU: .ci/compare_numba.py,
which turns the Numba test-suite runs of .ci/gpu and .ci/gpu-numba-mlir into a verdict, over
samples of both log formats it reads (numba.runtests and pytest, with and without xdist)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

COMPARE = Path(__file__).parent.parent / ".ci" / "compare_numba.py"


def test_compare_numba_selftest():
    p = subprocess.run([sys.executable, str(COMPARE), "--selftest"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "selftest: OK" in p.stdout, p.stdout + p.stderr

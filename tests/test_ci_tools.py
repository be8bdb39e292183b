"""The GPU host's tools, checked here where they can be without a GPU: .ci/compare_numba.py,
which turns the Numba test-suite runs of .ci/gpu and .ci/gpu-numba-mlir into a verdict, over
samples of both log formats it reads (numba.runtests and pytest, with and without xdist); and
tests.processes, which makes a GPU scenario that hangs say where."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import HUNG, hung, run_python

COMPARE = Path(__file__).parent.parent / ".ci" / "compare_numba.py"


@pytest.mark.skipif(not COMPARE.exists(), reason=".ci/ is not shipped here")  # an sdist
def test_compare_numba_selftest():
    p = subprocess.run([sys.executable, str(COMPARE), "--selftest"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "selftest: OK" in p.stdout, p.stdout + p.stderr


HANGS = """
import threading, time
def wait_forever():
    threading.Event().wait()
threading.Thread(target=wait_forever, daemon=True).start()
time.sleep(600)
"""


def test_a_scenario_that_hangs_is_stopped_with_every_threads_stack(monkeypatch):
    monkeypatch.delenv("EMMPOOL_TEST_HANG_AFTER", raising=False)
    p = run_python(["-c", HANGS], timeout=2)
    assert p.returncode == HUNG and hung(p), (p.returncode, p.stderr)
    assert 'File "<string>", line 6 in <module>' in p.stderr, p.stderr  # the main thread
    assert "in wait_forever" in p.stderr, p.stderr  # and the other
    assert p.stderr.endswith("hung: stopped after 2 s\n"), p.stderr


def test_hang_after_caps_the_timeout(monkeypatch):
    monkeypatch.setenv("EMMPOOL_TEST_HANG_AFTER", "1")
    p = run_python(["-c", "import time; time.sleep(600)"], timeout=300)
    assert p.returncode == HUNG and "stopped after 1 s" in p.stderr, p.stderr
    p = run_python(["-c", "print('done')"], timeout=300)
    assert p.returncode == 0 and p.stdout == "done\n" and p.stderr == "" and not hung(p)
    p = run_python(["-c", "import os; os.abort()"], timeout=300)  # aborts: not a hang
    assert p.returncode == HUNG and not hung(p), p.stderr

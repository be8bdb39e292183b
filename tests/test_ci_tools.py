"""The GPU host's tools, checked here where they can be without a GPU: .ci/compare_numba.py,
which turns the Numba and numba-cuda-mlir test-suite runs of .ci/gpu.py into a verdict, over
samples of both log formats it reads (numba.runtests and pytest, with and without xdist);
.ci/torch_suite.py (and the pytest -v parsing it shares with .ci/cupy_suite.py), which turns two
runs of PyTorch's test_cuda.py into a verdict, over sample logs and plugin records; CuPy's suite
split into parts and merged again; and tests.processes, which makes a GPU scenario that hangs
say where. (.ci/gpu.py itself: tests/test_gpu_runner.py.)"""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import needs_repository
from tests.processes import HUNG, hung, run_python

CI = Path(__file__).parent.parent / ".ci"


HANGS = """
import threading, time
def wait_forever():
    threading.Event().wait()
threading.Thread(target=wait_forever, daemon=True).start()
time.sleep(600)
"""


def test_a_scenario_that_hangs_is_stopped_with_every_threads_stack(monkeypatch):
    monkeypatch.delenv("EMMCI_TEST_HANG_AFTER", raising=False)
    p = run_python(["-c", HANGS], timeout=2)
    assert p.returncode == HUNG and hung(p), (p.returncode, p.stderr)
    assert 'File "<string>", line 6 in <module>' in p.stderr, p.stderr  # the main thread
    assert "in wait_forever" in p.stderr, p.stderr  # and the other
    assert p.stderr.endswith("hung: stopped after 2 s\n"), p.stderr


def test_hang_after_caps_the_timeout(monkeypatch):
    monkeypatch.setenv("EMMCI_TEST_HANG_AFTER", "1")
    p = run_python(["-c", "import time; time.sleep(600)"], timeout=300)
    assert p.returncode == HUNG and "stopped after 1 s" in p.stderr, p.stderr
    p = run_python(["-c", "print('done')"], timeout=300)
    assert p.returncode == 0 and p.stdout == "done\n" and p.stderr == "" and not hung(p)
    p = run_python(["-c", "import os; os.abort()"], timeout=300)  # aborts: not a hang
    assert p.returncode == HUNG and not hung(p), p.stderr


def load_ci_module(name: str):
    if not (CI / f"{name}.py").exists():
        pytest.skip(needs_repository(".ci/"))
    spec = importlib.util.spec_from_file_location(name, CI / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- .ci/compare_numba.py -------------------------------------------------------------------
# Samples crafted from the output of numba.runtests -v (Python 3.11/3.12 unittest,
# numba 0.68 ParallelTestRunner), serial and parallel.

BASE_PARALLEL = """\
Parallel: 12. Serial: 0
test_host_alloc_driver (numba.cuda.tests.cudadrv.test_host_alloc.TestHostAlloc.test_host_alloc_driver) ... ok
test_host_alloc_pinned (numba.cuda.tests.cudadrv.test_host_alloc.TestHostAlloc.test_host_alloc_pinned) ... ok
some output a worker printed
test_max_pending_count (numba.cuda.tests.cudadrv.test_deallocations.TestDeallocation.test_max_pending_count) ... ok
test_ownership (numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_ownership) ... ok
test_array_views (numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_array_views)
Views created via array interface support: ... ok
test_ipc_handle (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle) ... ERROR
test_sub (numba.cuda.tests.cudapy.test_x.TestX.test_sub) ... ok
test_flaky (numba.cuda.tests.cudapy.test_x.TestX.test_flaky) ... FAIL
test_skipme (numba.cuda.tests.cudapy.test_x.TestX.test_skipme) ... skipped 'not on this GPU'
test_xf (numba.cuda.tests.cudapy.test_x.TestX.test_xf) ... expected failure
test_gone (numba.cuda.tests.cudapy.test_x.TestX.test_gone) ... ok
test_other (numba.cuda.tests.cudapy.test_y.TestY.test_other) ... ok

======================================================================
ERROR: test_ipc_handle (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle)
----------------------------------------------------------------------
Traceback (most recent call last):
AssertionError: daemonic processes are not allowed to have children

======================================================================
FAIL: test_flaky (numba.cuda.tests.cudapy.test_x.TestX.test_flaky)
----------------------------------------------------------------------
AssertionError: 1 != 2

----------------------------------------------------------------------
Ran 12 tests in 201.532s

FAILED (failures=1, errors=1, skipped=1, expected failures=1)
=== Resource Infos ===
=== End Resource Infos ===
"""

BASE_SERIAL = """\
test_ipc_array (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_array) ... ok
test_ipc_handle (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle) ... ok
test_init_reset (numba.cuda.tests.cudadrv.test_init.TestInit.test_init_reset) ... ok

----------------------------------------------------------------------
Ran 3 tests in 12.000s

OK
"""

PLUGIN_PARALLEL = """\
Parallel: 12. Serial: 0
test_host_alloc_driver (numba.cuda.tests.cudadrv.test_host_alloc.TestHostAlloc.test_host_alloc_driver) ... ok
test_host_alloc_pinned (numba.cuda.tests.cudadrv.test_host_alloc.TestHostAlloc.test_host_alloc_pinned) ... ERROR
test_max_pending_count (numba.cuda.tests.cudadrv.test_deallocations.TestDeallocation.test_max_pending_count) ... skipped 'Deallocation specific to Numba memory management'
test_ownership (numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_ownership) ... skipped 'Ownership not relevant with external memmgr'
test_array_views (numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_array_views)
Views created via array interface support: ... FAIL
test_ipc_handle (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle) ... ERROR
test_sub (numba.cuda.tests.cudapy.test_x.TestX.test_sub) ... 
  test_sub (numba.cuda.tests.cudapy.test_x.TestX.test_sub) (i=1) ... FAIL
  test_sub (numba.cuda.tests.cudapy.test_x.TestX.test_sub) (i=2) ... skipped 'meh'
test_flaky (numba.cuda.tests.cudapy.test_x.TestX.test_flaky) ... ok
test_skipme (numba.cuda.tests.cudapy.test_x.TestX.test_skipme) ... skipped 'not on this GPU'
test_xf (numba.cuda.tests.cudapy.test_x.TestX.test_xf) ... unexpected success
numba.cuda.tests.cudapy.test_z (unittest.loader._FailedTest.numba.cuda.tests.cudapy.test_z) ... ERROR
test_other (numba.cuda.tests.cudapy.test_y.TestY.test_other) ... ok

======================================================================
ERROR: test_host_alloc_pinned (numba.cuda.tests.cudadrv.test_host_alloc.TestHostAlloc.test_host_alloc_pinned)
----------------------------------------------------------------------
CudaAPIError: [1] Call to cuMemsetD8 results in CUDA_ERROR_INVALID_VALUE

======================================================================
FAIL: test_sub (numba.cuda.tests.cudapy.test_x.TestX.test_sub) [<object object at 0x7f5f97d9db50>] (i=1)
----------------------------------------------------------------------
AssertionError: 1 not less than 1

======================================================================
UNEXPECTED SUCCESS: test_xf (numba.cuda.tests.cudapy.test_x.TestX.test_xf)
----------------------------------------------------------------------
Ran 12 tests in 190.001s

FAILED (failures=2, errors=3, skipped=3, unexpected successes=1)
"""

# Serial run killed by `timeout` inside a test: the test's own output, then nothing.
PLUGIN_SERIAL = """\
test_ipc_array (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_array) ... ok
test_ipc_handle (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle) ... /x/numba/cuda/dispatcher.py:600: NumbaPerformanceWarning: Grid size 1 will likely result in GPU under-utilization due to low occupancy.
  warn(NumbaPerformanceWarning(msg))
FAIL
test_init_reset (numba.cuda.tests.cudadrv.test_init.TestInit.test_init_reset) ... some output
[.ci/gpu] suite-pool-serial: rc=124 after 240s
"""

SETUPCLASS = """\
setUpClass (numba.cuda.tests.cudapy.test_q.TestQ) ... ERROR
test_print (numba.cuda.tests.cudapy.test_q.TestP.test_print) ... printed text
warn text
ok
test_old (numba.cuda.tests.cudapy.test_q.TestP) ... ok

======================================================================
ERROR: setUpClass (numba.cuda.tests.cudapy.test_q.TestQ)
----------------------------------------------------------------------
RuntimeError: setup failed

----------------------------------------------------------------------
Ran 2 tests in 0.002s

FAILED (errors=1)
"""

# pytest -v with pytest-xdist (pytest 9.2, xdist 3.8), as numba-cuda-mlir's suite is run by
# .ci/gpu.py (step mlir): the default manager, complete; the plugin, complete; the plugin, cut off.
MLIR_HA = "tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::"
PYTEST_BASE = """\
============================= test session starts ==============================
platform linux -- Python 3.12.3, pytest-9.2.0, pluggy-1.7.0 -- /usr/bin/python3
rootdir: /tmp/mlir-tests
configfile: pyproject.toml
plugins: xdist-3.8.0
created: 3/3 workers
3 workers [9 items]

scheduling tests via LoadScopeScheduling
tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::test_host_alloc_pinned 
tests/test_array.py::test_param[a b] 
tests/numba_cuda_tests/cudadrv/test_deallocations.py::TestDeallocation::test_max_pending_count 
[gw0] [ 11%] PASSED tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::test_host_alloc_pinned 
[gw1] [ 22%] PASSED tests/test_array.py::test_param[a b] 
[gw2] [ 33%] PASSED tests/numba_cuda_tests/cudadrv/test_deallocations.py::TestDeallocation::test_max_pending_count 
tests/test_array.py::test_param[x::y] 
[gw1] [ 44%] PASSED tests/test_array.py::test_param[x::y] 
tests/numba_cuda_tests/cudapy/test_cuda_array_interface.py::TestCudaArrayInterface::test_ownership 
[gw2] [ 55%] PASSED tests/numba_cuda_tests/cudapy/test_cuda_array_interface.py::TestCudaArrayInterface::test_ownership 
tests/test_array.py::TestSub::test_sub 
[gw1] [ 66%] SUBPASSED(i='0') tests/test_array.py::TestSub::test_sub 
[gw1] [ 66%] PASSED tests/test_array.py::TestSub::test_sub 
tests/test_numpy.py::test_np_elementwise_ops 
[gw0] [ 77%] SUBPASSED[add] (shape=(3,)) tests/test_numpy.py::test_np_elementwise_ops 
[gw0] [ 77%] PASSED tests/test_numpy.py::test_np_elementwise_ops 
tests/test_array.py::test_gone 
[gw1] [ 88%] PASSED tests/test_array.py::test_gone 
tests/test_array.py::test_skipme 
[gw1] [100%] SKIPPED tests/test_array.py::test_skipme 

==================================== ERRORS ====================================
__________ ERROR collecting tests/numba_cuda_tests/cudapy/test_bfloat16.py __________
E   ModuleNotFoundError: No module named 'ml_dtypes'
=========================== short test summary info ============================
ERROR tests/numba_cuda_tests/cudapy/test_bfloat16.py - ModuleNotFoundError: No module named 'ml_dtypes'
SKIPPED [1] tests/test_array.py:40: needs two GPUs
= 8 passed, 1 skipped, 1 error, 2 subtests passed in 61.20s (0:01:01) =
"""

PYTEST_PLUGIN = """\
============================= test session starts ==============================
created: 3/3 workers
3 workers [9 items]
[gw0] [ 11%] FAILED tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::test_host_alloc_pinned 
[gw1] [ 22%] FAILED tests/test_array.py::test_param[a b] 
[gw2] [ 33%] SKIPPED tests/numba_cuda_tests/cudadrv/test_deallocations.py::TestDeallocation::test_max_pending_count 
[gw1] [ 44%] PASSED tests/test_array.py::test_param[x::y] 
[gw2] [ 55%] FAILED tests/numba_cuda_tests/cudapy/test_cuda_array_interface.py::TestCudaArrayInterface::test_ownership 
[gw1] [ 66%] SUBFAILED(i='0') tests/test_array.py::TestSub::test_sub 
[gw1] [ 66%] PASSED tests/test_array.py::TestSub::test_sub 
[gw0] [ 77%] PASSED tests/test_numpy.py::test_np_elementwise_ops 
[gw1] [ 88%] ERROR tests/test_array.py::test_gone 
[gw1] [100%] SKIPPED tests/test_array.py::test_skipme 
__________ ERROR collecting tests/numba_cuda_tests/cudapy/test_bfloat16.py __________
= 4 failed, 3 passed, 2 skipped, 2 errors in 64.00s (0:01:04) =
"""

# Without xdist: a failing unittest subTest shows only in the short summary.
PYTEST_SERIAL = """\
============================= test session starts ==============================
collecting ... collected 3 items / 1 error

tests/test_array.py::TestSub::test_sub 
tests/test_array.py::TestSub::test_sub PASSED                            [ 33%]
tests/test_array.py::test_param[a b] PASSED                              [ 66%]
tests/test_array.py::test_skipme SKIPPED (needs two GPUs)                [100%]

=========================== short test summary info ============================
SUBFAILED(i=1) tests/test_array.py::TestSub::test_sub - AssertionError: 1 != 0
ERROR tests/numba_cuda_tests/cudapy/test_bfloat16.py
SKIPPED [1] tests/test_array.py:40: needs two GPUs
= 1 failed, 2 passed, 1 skipped, 1 error in 0.07s =
"""

PYTEST_CUT = """\
============================= test session starts ==============================
created: 3/3 workers
3 workers [9 items]
tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::test_host_alloc_pinned 
tests/test_array.py::test_param[a b] 
[gw1] [ 22%] PASSED tests/test_array.py::test_param[a b] 
tests/test_array.py::test_param[x::y] 
[.ci/gpu] mlir pool: rc=124 after 300s (timeout)
"""
X = "numba.cuda.tests.cudapy.test_x.TestX."
VIEWS = "numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_array_views"
ARR = "tests/test_array.py::"


@pytest.fixture(scope="module")
def compare_numba():
    return load_ci_module("compare_numba")


def write_logs(folder: Path, **texts: str) -> dict[str, str]:
    for name, text in texts.items():
        (folder / f"{name}.txt").write_text(text)
    return {name: str(folder / f"{name}.txt") for name in texts}


def test_compare_numba_reads_numba_runtests_logs(compare_numba):
    bp = compare_numba.parse_text(BASE_PARALLEL, "base-par")
    assert bp.complete and bp.ran == 12 and bp.parallel == (12, 0), bp.describe()
    assert bp.outcomes[VIEWS] == "ok"
    assert bp.outcomes[X + "test_flaky"] == "FAIL"
    assert bp.outcomes[X + "test_skipme"] == "skipped"
    assert bp.skip_reasons[X + "test_skipme"] == "'not on this GPU'"
    assert bp.outcomes[X + "test_xf"] == "expected failure"
    assert len(bp.outcomes) == 12, len(bp.outcomes)

    pp = compare_numba.parse_text(PLUGIN_PARALLEL, "plug-par")
    assert pp.outcomes[X + "test_sub"] == "FAIL", pp.outcomes[X + "test_sub"]
    assert pp.outcomes[X + "test_xf"] == "unexpected success"
    assert pp.outcomes["unittest.loader._FailedTest.numba.cuda.tests.cudapy.test_z"] == "ERROR"
    assert pp.outcomes[VIEWS] == "FAIL"

    ps = compare_numba.parse_text(PLUGIN_SERIAL, "plug-ser")
    assert not ps.complete and ps.ci_rc == 124
    assert ps.outcomes["numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle"] == "FAIL"
    assert ps.outcomes["numba.cuda.tests.cudadrv.test_init.TestInit.test_init_reset"] == "unknown"

    sc = compare_numba.parse_text(SETUPCLASS, "setup")
    assert sc.outcomes["numba.cuda.tests.cudapy.test_q.TestQ.setUpClass"] == "ERROR"
    assert sc.outcomes["numba.cuda.tests.cudapy.test_q.TestP.test_print"] == "ok"
    assert sc.outcomes["numba.cuda.tests.cudapy.test_q.TestP.test_old"] == "ok"  # Python <= 3.10


def test_compare_numba_finds_regressions_and_excuses_only_the_known_ones(compare_numba, tmp_path):
    paths = write_logs(tmp_path, bp=BASE_PARALLEL, bs=BASE_SERIAL, pp=PLUGIN_PARALLEL,
                       ps=PLUGIN_SERIAL)
    base_logs, base = compare_numba.parse_logs([paths["bp"], paths["bs"]])
    # last log wins: the serial run decides test_ipc_handle for the base
    assert base["numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle"] == "ok"

    plug_logs, plug = compare_numba.parse_logs([paths["pp"], paths["ps"]])
    res = compare_numba.compare(base_logs, base, plug_logs, plug, mode="pool", full_scope=True)
    unexpected = {t for t, _, _ in res["unexpected"]}
    assert unexpected == {
        VIEWS, X + "test_sub", X + "test_xf",
        "numba.cuda.tests.cudadrv.test_init.TestInit.test_init_reset",  # unknown: run ended in it
        # not excused: the plugin sizes an array's allocation as its block
        "numba.cuda.tests.cudadrv.test_host_alloc.TestHostAlloc.test_host_alloc_pinned",
    }, unexpected
    assert {t for t, _, _ in res["not_run"]} == {X + "test_gone"}  # plugin incomplete
    assert {t for t, _, _ in res["known_skip"]} == {
        "numba.cuda.tests.cudadrv.test_deallocations.TestDeallocation.test_max_pending_count",
        "numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface."
        "test_ownership"}
    assert {t for t, _, _ in res["known_suballoc"]} == {
        "numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle"}
    assert {t for t, _, _ in res["new_pass"]} == {X + "test_flaky"}
    assert {t for t, _, _ in res["new_fail"]} == {
        "unittest.loader._FailedTest.numba.cuda.tests.cudapy.test_z"}
    text, code = compare_numba.report("pool", base_logs, base, plug_logs, plug, res, True)
    assert code == 1 and "RESULT: FAIL" in text, text

    # passthrough: the sub-allocation tests are not excused
    res = compare_numba.compare(base_logs, base, plug_logs, plug, mode="passthrough",
                                full_scope=True)
    unexpected = {t for t, _, _ in res["unexpected"]}
    assert "numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle" in unexpected
    assert not res["known_suballoc"]

    # identical logs: PASS, exit 0; targeted scope leaves other modules out
    res = compare_numba.compare(base_logs, base, base_logs, base, mode="pool", full_scope=True)
    text, code = compare_numba.report("same", base_logs, base, base_logs, base, res, True)
    assert code == 0 and not res["unexpected"], text
    tl, tgt = compare_numba.parse_logs([paths["bs"]])
    res = compare_numba.compare(base_logs, base, tl, tgt, mode="passthrough", full_scope=False)
    text, code = compare_numba.report("targeted", base_logs, base, tl, tgt, res, False)
    assert code == 0 and res["out_of_scope"] == 9, (res["out_of_scope"], text)

    # a missing plugin log: inconclusive
    ml, mp = compare_numba.parse_logs([paths["bs"], str(tmp_path / "nope.txt")])
    res = compare_numba.compare(base_logs, base, ml, mp, full_scope=False)
    text, code = compare_numba.report("missing", base_logs, base, ml, mp, res, False)
    assert code == 3 and "MISSING" in text, text

    # CLI, both forms
    rc = compare_numba.main(["--mode", "pool", "--all", "--base", paths["bp"], paths["bs"],
                             "--plugin", paths["bp"], paths["bs"]], out=io.StringIO())
    assert rc == 0, rc
    rc = compare_numba.main([paths["bp"], paths["bs"], "--", paths["pp"], paths["ps"],
                             "--mode", "pool"], out=io.StringIO())
    assert rc == 1, rc


def test_compare_numba_reads_pytest_logs_with_and_without_xdist(compare_numba):
    pb = compare_numba.parse_text(PYTEST_BASE, "mlir-base")
    assert pb.complete and pb.ran == 10 and pb.workers == 3, pb.describe()
    assert pb.outcomes[ARR + "test_param[a b]"] == pb.outcomes[ARR + "test_param[x::y]"] == "ok"
    assert pb.outcomes[ARR + "test_skipme"] == "skipped"
    assert pb.outcomes["tests/numba_cuda_tests/cudapy/test_bfloat16.py"] == "ERROR"
    assert pb.outcomes["tests/test_numpy.py::test_np_elementwise_ops"] == "ok"
    assert len(pb.outcomes) == 10, pb.outcomes
    pq = compare_numba.parse_text(PYTEST_PLUGIN, "mlir-pool")
    assert pq.complete and pq.ran == 11, pq.describe()
    assert pq.outcomes[ARR + "TestSub::test_sub"] == "FAIL"  # a failing subtest fails its test
    assert pq.outcomes[ARR + "test_param[a b]"] == "FAIL"
    ps = compare_numba.parse_text(PYTEST_SERIAL, "mlir-serial")
    assert ps.complete and ps.workers is None and ps.ran == 5, ps.describe()
    assert ps.outcomes == {ARR + "TestSub::test_sub": "FAIL", ARR + "test_param[a b]": "ok",
                           ARR + "test_skipme": "skipped",
                           "tests/numba_cuda_tests/cudapy/test_bfloat16.py": "ERROR"}, ps.outcomes
    assert ps.skip_reasons[ARR + "test_skipme"] == "(needs two GPUs)"
    one = compare_numba.parse_text("== test session starts ==\ncreated: 1/1 worker\n", "one")
    assert one.workers == 1
    pc = compare_numba.parse_text(PYTEST_CUT, "mlir-cut")
    assert not pc.complete and pc.ci_rc == 124 and pc.workers == 3
    assert pc.outcomes == {ARR + "test_param[a b]": "ok"}, pc.outcomes
    assert sorted(pc.in_flight) == [MLIR_HA + "test_host_alloc_pinned", ARR + "test_param[x::y]"]
    assert "2 tests in flight" in pc.describe()
    assert compare_numba.module_of(ARR + "test_param[x::y]") == "tests/test_array.py"


def test_compare_numba_compares_pytest_runs_cut_off_or_not(compare_numba, tmp_path):
    paths = write_logs(tmp_path, base=PYTEST_BASE, plug=PYTEST_PLUGIN, cut=PYTEST_CUT)
    base_logs, base = compare_numba.parse_logs([paths["base"]])
    plug_logs, plug = compare_numba.parse_logs([paths["plug"]])
    res = compare_numba.compare(base_logs, base, plug_logs, plug, mode="pool", full_scope=True)
    assert {t for t, _, _ in res["unexpected"]} == {
        ARR + "test_param[a b]", ARR + "TestSub::test_sub", ARR + "test_gone"}, res["unexpected"]
    assert {t for t, _, _ in res["known_skip"]} == {
        compare_numba._MLIR_DEALLOC + "test_max_pending_count",
        "tests/numba_cuda_tests/cudapy/test_cuda_array_interface.py::TestCudaArrayInterface::"
        "test_ownership"}
    assert {t for t, _, _ in res["known_suballoc"]} == {MLIR_HA + "test_host_alloc_pinned"}
    text, code = compare_numba.report("mlir", base_logs, base, plug_logs, plug, res, True)
    assert code == 1, text
    # cut off: what finished is compared, what was in flight or not reached is not run
    cut_logs, cut = compare_numba.parse_logs([paths["cut"]])
    res = compare_numba.compare(base_logs, base, cut_logs, cut, mode="pool", full_scope=True)
    assert not res["unexpected"] and len(res["not_run"]) == 5, res
    text, code = compare_numba.report("mlir-cut", base_logs, base, cut_logs, cut, res, True)
    assert code == 3 and "INCONCLUSIVE" in text, text
    # the base cut off: a plugin failure it never reached is no regression, nor a pass
    res = compare_numba.compare(cut_logs, cut, plug_logs, plug, mode="pool", full_scope=True)
    assert {t for t, _, _ in res["unexpected"]} == {ARR + "test_param[a b]"}, res
    assert ARR + "test_gone" in {t for t, _, _ in res["not_reached"]} and not res["new_fail"]
    text, code = compare_numba.report("base-cut", cut_logs, cut, plug_logs, plug, res, True)
    assert code == 1, text


XDIST_LOG = """\
## all: python -m pytest -v -n 1 test_cuda.py
test_cuda.py::TestCuda::test_memory_stats
[gw0] [ 10%] PASSED test_cuda.py::TestCuda::test_memory_stats
[gw0] [ 20%] SUBPASSED(i='0') test_cuda.py::TestCuda::test_subtests
[gw0] [ 20%] PASSED test_cuda.py::TestCuda::test_subtests
[gw0] [ 30%] PASSED test_cuda.py::TestMemPool::test_mempool_with_allocator
[gw0] [ 40%] PASSED test_cuda.py::TestCudaMallocAsync::test_memory_snapshot
[gw0] [ 40%] ERROR test_cuda.py::TestCudaMallocAsync::test_memory_snapshot
[gw0] node down: Not properly terminated
[gw0] [ 50%] FAILED test_cuda.py::TestCuda::test_graph_two_successive
replacing crashed worker gw0
worker 'gw0' crashed while running 'test_cuda.py::TestCuda::test_graph_two_successive'
[gw1] [ 60%] SKIPPED test_cuda.py::TestCuda::test_memory_stats_multigpu
[gw1] [ 70%] XFAIL test_cuda.py::TestCuda::test_graph_make_graphed_callables_with_amp
FAILED test_cuda.py::TestCuda::test_graph_two_successive - worker 'gw0' crashed
"""
PLAIN_LOG = """\
test_cuda.py::TestCuda::test_memory_stats PASSED                          [ 10%]
test_cuda.py::TestCuda::test_out_of_memory FAILED                         [ 20%]
test_cuda.py::TestCuda::test_memory_stats_multigpu SKIPPED (only one GPU detected) [ 30%]
test_cuda.py::TestCuda::test_record_stream
FAILED test_cuda.py::TestCuda::test_out_of_memory - AssertionError: ...
"""


def test_pytest_verbose_logs_parse_with_and_without_xdist(tmp_path):
    cupy_suite = load_ci_module("cupy_suite")
    (tmp_path / "x.log").write_text(XDIST_LOG)
    (tmp_path / "p.log").write_text(PLAIN_LOG)
    assert cupy_suite.outcomes(tmp_path / "x.log") == {
        "test_cuda.py::TestCuda::test_memory_stats": "passed",
        "test_cuda.py::TestCuda::test_subtests": "passed",
        "test_cuda.py::TestMemPool::test_mempool_with_allocator": "passed",
        "test_cuda.py::TestCudaMallocAsync::test_memory_snapshot": "error",  # teardown error
        "test_cuda.py::TestCuda::test_graph_two_successive": "failed",  # crashed its worker
        "test_cuda.py::TestCuda::test_memory_stats_multigpu": "skipped",
        "test_cuda.py::TestCuda::test_graph_make_graphed_callables_with_amp": "xfailed",
    }
    assert len(cupy_suite.crashed_workers(tmp_path / "x.log")) == 2
    assert cupy_suite.outcomes(tmp_path / "p.log") == {  # the last one never finished
        "test_cuda.py::TestCuda::test_memory_stats": "passed",
        "test_cuda.py::TestCuda::test_out_of_memory": "failed",
        "test_cuda.py::TestCuda::test_memory_stats_multigpu": "skipped",
    }


def write_torch_run(out: Path, run: str, log: str, backend: str, allocations: int = 0,
                    filled: tuple = ()):
    (out / f"torch-{run}.log").write_text(log)
    record = {"run": run, "phase": "all", "worker": "gw0", "tests": 9, "backend": backend,
              "how": "extension" if run == "emmpool" else None, "torch_allocations": allocations,
              "filled": list(filled)}
    (out / f"{run}-all-gw0.json").write_text(json.dumps(record))


def torch_report(tmp_path, native: str, emmpool: str, backend="emmpool", allocations=100,
                 filled=()):
    torch_suite = load_ci_module("torch_suite")
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    write_torch_run(out, "native", native, "native", filled=filled)
    write_torch_run(out, "emmpool", emmpool, backend, allocations, filled=filled)
    args = SimpleNamespace(timeout=600, jobs=1, concurrent=False, xdist=True, k="memory")
    status = {"native": (1, 100), "emmpool": ("timeout (-15)", 200)}
    info = {"torch": "2.11.0+cu130", "gpus": ["NVIDIA H100 80GB HBM3"]}
    return torch_suite.report(args, tmp_path, out, status, None, info)


NATIVE = """\
[gw0] [ 25%] PASSED test_cuda.py::TestCuda::test_memory_stats
[gw0] [ 50%] PASSED test_cuda.py::TestCuda::test_graph_two_successive
[gw0] [ 75%] FAILED test_cuda.py::TestCuda::test_out_of_memory
[gw0] [100%] PASSED test_cuda.py::TestMemPool::test_nested_mempool
"""


def test_torch_suite_lists_regressions_and_the_tests_not_reached_apart(tmp_path):
    emmpool = """\
[gw0] [ 25%] PASSED test_cuda.py::TestCuda::test_memory_stats
[gw0] [ 50%] FAILED test_cuda.py::TestCuda::test_graph_two_successive
[gw0] [ 75%] PASSED test_cuda.py::TestCuda::test_out_of_memory
"""
    text, ok = torch_report(tmp_path, NATIVE, emmpool)
    assert not ok
    assert "REGRESSIONS (pass with PyTorch's allocator, not with emmpool): 1\n" \
           "  test_cuda.py::TestCuda::test_graph_two_successive: failed\n" in text
    assert "NOT REACHED by the emmpool run (pass with PyTorch's allocator): 1\n" \
           "  test_cuda.py::TestMemPool::test_nested_mempool\n" in text
    assert "pass with emmpool, not with PyTorch's allocator: 1\n" \
           "  test_cuda.py::TestCuda::test_out_of_memory: failed" in text
    assert "emmpool    exit timeout (-15) in 200 s: 3 tests, failed 1, passed 2" in text
    assert "emmpool really installed: yes" in text


def test_torch_suite_passes_only_where_emmpool_really_served_pytorch(tmp_path):
    same = NATIVE.replace("FAILED", "PASSED")
    text, ok = torch_report(tmp_path, same, same)
    assert ok and "REGRESSIONS (pass with PyTorch's allocator, not with emmpool): 0" in text, text
    text, ok = torch_report(tmp_path, same, same, backend="pluggable")
    assert not ok and "emmpool really installed: NO" in text
    text, ok = torch_report(tmp_path, same, same, allocations=0)
    assert not ok and "emmpool really installed: NO" in text
    text, ok = torch_report(tmp_path, same, "")  # the emmpool run ran nothing
    assert not ok


def test_torch_suite_says_which_names_it_defined_for_a_newer_test_file(tmp_path):
    same = NATIVE.replace("FAILED", "PASSED")
    text, ok = torch_report(tmp_path, same, same)
    assert ok and "lacks" not in text
    text, ok = torch_report(tmp_path, same, same, filled=("TEST_CUDAMALLOCASYNC",))
    assert ok and "common_utils lacks, defined in both runs as PyTorch's own test file defined " \
                  "them: TEST_CUDAMALLOCASYNC" in text


def test_torch_suite_says_why_a_run_ran_nothing(tmp_path):
    torch_suite = load_ci_module("torch_suite")
    log = tmp_path / "torch-emmpool.log"
    log.write_text(
        "INTERNALERROR>   File \"plugin.py\", line 37, in pytest_configure\n"
        "INTERNALERROR> RuntimeError: emmpool's PyTorch extension did not build: no nvcc\n"
        "INTERNALERROR> RuntimeError: Unexpectedly no active workers available\n"
        "_____________________ ERROR collecting test_cuda.py _____________________\n"
        "test_cuda.py:23: in <module>\n"
        "    import psutil\n"
        "E   ModuleNotFoundError: No module named 'psutil'\n")
    assert torch_suite.problems(log) == [
        "could not collect test_cuda.py: ModuleNotFoundError: No module named 'psutil'",
        "pytest INTERNALERROR: RuntimeError: emmpool's PyTorch extension did not build: no nvcc",
    ]


# ---- CuPy's suite in parts -------------------------------------------------------------------
def test_every_test_is_in_exactly_one_part_whatever_the_number_of_parts():
    plugin = load_ci_module("emmpool_cupy_suite_plugin")
    ids = [f"tests/cupy_tests/core_tests/test_x{i % 7}.py::TestX::test_{i}" for i in range(4000)]
    for parts in (1, 2, 3, 4, 7):
        sizes = [sum(plugin.in_part(i, k, parts) for i in ids) for k in range(1, parts + 1)]
        assert sum(sizes) == len(ids)  # each in one part, none in two
        assert min(sizes) > 0.8 * len(ids) / parts  # and the parts about even
    assert [plugin.in_part(ids[5], k, 4) for k in range(1, 5)].count(True) == 1


def write_part(folder: Path, part, label, pool_log: str, emmpool_log: str, status=None,
               allocations=10):
    folder.mkdir(parents=True)
    (folder / "cupy-part.json").write_text(json.dumps({
        "part": list(part), "label": label, "tag": "v14.2.0", "subset": ["tests/cupy_tests"],
        "status": status or {"cupy-pool": [0, 100], "emmpool": [0, 110]}}))
    (folder / "cupy-cupy-pool.log").write_text(pool_log)
    (folder / "cupy-emmpool.log").write_text(emmpool_log)
    (folder / "emmpool-worker-gw0.json").write_text(json.dumps({
        "worker": "gw0", "tests": 2, "allocator": "emmpool", "cupy_allocations": allocations,
        "dormant_fences": 0, "same_stream_reuses": 5}))


def test_parts_merge_by_test_name_and_say_which_ran_and_how_far(tmp_path):
    cupy_suite = load_ci_module("cupy_suite")
    one = "[gw0] [ 50%] PASSED tests/a.py::test_1\n[gw0] [100%] PASSED tests/a.py::test_2\n"
    two = "[gw0] [ 50%] PASSED tests/b.py::test_3\n[gw0] [100%] FAILED tests/b.py::test_4\n"
    write_part(tmp_path / "p1", (1, 3), "NVIDIA-H200-1999-01-01", one, one)
    write_part(tmp_path / "p2", (2, 3), "NVIDIA-H200-1999-01-02", two,
               two.replace("PASSED tests/b.py::test_3", "FAILED tests/b.py::test_3"),
               status={"cupy-pool": [0, 100], "emmpool": ["timeout (-15)", 300]})
    label, text, ok = cupy_suite.merge([tmp_path / "p2", tmp_path / "p1"])
    assert not ok
    assert label == "NVIDIA-H200-1999-01-01-to-1999-01-02"
    assert "parts run: 2 of 3; MISSING: 3/3; CUT OFF by the timeout: 2/3" in text
    assert "cupy-pool  over the parts: 4 tests, failed 1, passed 3" in text
    assert "REGRESSIONS (pass with CuPy's pool, not with emmpool): 1\n" \
           "  tests/b.py::test_3: failed" in text
    assert "CuPy allocations through emmpool: 20" in text
    with pytest.raises(ValueError, match="part 1/3 is given twice"):
        cupy_suite.merge([tmp_path / "p1", tmp_path / "p1"])


def test_a_complete_set_of_parts_read_from_runner_outdirs_holds(tmp_path):
    cupy_suite = load_ci_module("cupy_suite")
    outdirs = []
    for k in (1, 2):
        staging = tmp_path / f"staging{k}"
        log = f"[gw0] [100%] PASSED tests/a.py::test_{k}\n"
        write_part(staging / "logs" / "cupy-suite", (k, 2), "NVIDIA-H100-1999-01-01", log, log)
        outdir = tmp_path / f"out{k}"
        outdir.mkdir()
        with tarfile.open(outdir / "logs.tar.gz", "w:gz") as tar:
            tar.add(staging, arcname=".")
        outdirs.append(outdir)
    assert cupy_suite.main(["--merge", *map(str, outdirs), "--out", str(tmp_path / "m")]) == 0
    text = (tmp_path / "m" / "NVIDIA-H100-1999-01-01-cupy-suite.txt").read_text()
    assert "parts run: 2 of 2; each ran to its end with both allocators" in text
    assert "REGRESSIONS (pass with CuPy's pool, not with emmpool): 0" in text
    with pytest.raises(SystemExit):  # argparse's error: the folder holds no run
        cupy_suite.main(["--merge", str(tmp_path)])


@pytest.mark.skipif(not (CI / "mutants.py").exists(), reason=needs_repository(".ci/"))
def test_every_mutant_still_names_a_line_of_the_code():
    """.ci/mutants.py's list names each promise's line by a snippet: one that no longer occurs
    exactly once (the code moved on) would make the mutant test nothing."""
    p = subprocess.run([sys.executable, str(CI / "mutants.py"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "every snippet found once" in p.stdout, p.stdout + p.stderr

"""The GPU host's tools, checked here where they can be without a GPU: .ci/compare_numba.py,
which turns the Numba and numba-cuda-mlir test-suite runs of .ci/gpu.py into a verdict, over
samples of both log formats it reads (numba.runtests and pytest, with and without xdist);
.ci/torch_suite.py (and the pytest -v parsing it shares with .ci/cupy_suite.py), which turns two
runs of PyTorch's test_cuda.py into a verdict, over sample logs and plugin records; CuPy's suite
split into parts and merged again; and tests.processes, which makes a GPU scenario that hangs
say where. (.ci/gpu.py itself: tests/test_gpu_runner.py.)"""

from __future__ import annotations

import importlib.util
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
COMPARE = CI / "compare_numba.py"


@pytest.mark.skipif(not COMPARE.exists(), reason=needs_repository(".ci/"))
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

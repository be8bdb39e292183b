"""The GPU runner (.ci/gpu.py), checked where it can be without a GPU: the time budget, the
options, which steps run, what comes back (at most 8 files), its plan (--dry-run), and a whole
run here, where every GPU step is skipped with its reason."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[1] / ".ci"
if not (CI / "gpu.py").exists():
    pytest.skip(".ci/ is not shipped here", allow_module_level=True)  # an sdist


def load(name: str, file: str):
    if not (CI / file).exists():
        pytest.skip(".ci/ is not shipped here")  # an sdist
    loader = importlib.machinery.SourceFileLoader(name, str(CI / file))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu():
    return load("gpu_runner", "gpu.py")


@pytest.fixture(scope="module")
def plan(gpu):
    return sys.modules["gpu_plan"]  # what gpu.py imported: the steps and the modes


@pytest.fixture(scope="module")
def jobs(gpu):
    return sys.modules["gpu_jobs"]  # the commands it runs


# ---- time ------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_step_gets_what_it_asks_cut_to_what_is_left_after_the_reserve(gpu):
    clock = Clock()
    budget = gpu.Budget(570, 25, clock)
    assert budget.grant(240) == 240
    clock.now += 400  # 145 s left before the reserve
    assert budget.left() == 145
    assert budget.grant(240) == 145
    assert budget.grant(240, minimum=150) == 0  # a step that needs more is skipped
    assert budget.grant(100, minimum=150) == 100  # one that asks less gets it
    clock.now += 130  # 15 s left: under the default minimum of 20
    assert budget.grant(240) == 0
    assert budget.grant(10) == 10
    clock.now += 100  # past the budget
    assert budget.grant(10) == 0


# ---- options and steps -----------------------------------------------------------------------
def test_default_steps_of_a_cuda_13_and_a_cuda_12_run(gpu):
    args = gpu.parse_args([])
    why = gpu.chosen_steps(args.only, args.skip, "13", args.results)
    assert [s for s, w in why.items() if w is None] == [
        "wheels", "env", "build", "torch-ext", "baselines", "pytest", "sanitizer", "cupy-suite",
        "torch-suite", "rmm-suite", "cuda-core-suite", "bench-core", "cli", "bench",
        "numba-suite", "mlir"]
    assert why["results"] == "without --results"
    why = gpu.chosen_steps(None, [], "12", False)
    assert [s for s, w in why.items() if w is None] == [
        "wheels", "env", "cuda12", "build", "pytest", "cupy-suite", "numba-suite"]
    assert why["sanitizer"] == "not part of a --cuda 12 run"


def test_only_keeps_the_setup_steps_and_skip_wins(gpu):
    args = gpu.parse_args(["--only", "pytest,mlir", "--skip", "mlir,wheels", "--results"])
    why = gpu.chosen_steps(args.only, args.skip, args.cuda, args.results)
    assert [s for s, w in why.items() if w is None] == ["env", "build", "pytest", "results"]
    assert why["mlir"] == why["wheels"] == "--skip"
    assert why["bench"] == "not chosen (--only)"


@pytest.mark.parametrize("argv, message", [
    (["--only", "pytest,bench-numba"], "unknown step bench-numba: expected wheels, env"),
    (["--skip", "suite"], "unknown step suite"),
    (["--benches", "bench_numba,bench_nothing"], "no benchmarks/bench_nothing.py"),
    (["--bench-args", "bench_numba"], "expected NAME='ARGS'"),
    (["--benches", "bench_numba", "--bench-args", "replay=--quick"], "not one of the benchmarks"),
    (["--bench-args", "bench_numba=--rounds '3"], "does not parse as shell words"),
    (["--pytest-args", "-k 'a"], "--pytest-args does not parse"),
    (["--numba-modes", "pool,fast"], "mode 'fast': expected pool or passthrough"),
    (["--numba-modes", "pool-cuda"], "mode 'pool-cuda'"),
    (["--full-modes", "passthrough", "--numba-modes", "pool"], "not one of --numba-modes"),
    (["--cupy-part", "5/4"], "expected K/N with 1 <= K <= N"),
    (["--cupy-part", "two"], "expected K/N"),
    (["--budget", "30"], "at least 60 seconds"),
    (["--budget", "100", "--reserve", "100"], "--reserve 100"),
])
def test_bad_options_are_said_in_a_sentence(gpu, argv, message):
    with pytest.raises(gpu.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("*", r"\*")):
        gpu.parse_args(argv)


def test_options_are_parsed_into_what_the_steps_use(gpu):
    args = gpu.parse_args([
        "--pytest-args", "-m 'torch and not ipc' -x", "--benches", "bench_shared,replay",
        "--bench-args", "bench_shared=--rounds 3 --label 'a b'", "--numba-modes",
        "pool,pool-numba,passthrough+growable", "--full-modes", "pool,passthrough+growable",
        "--cupy-part", "2/4", "--pytest-paths", "tests/test_gpu_torch.py,tests/test_gpu_rmm.py"])
    assert args.pytest_args == ["-m", "torch and not ipc", "-x"]
    assert args.benches == ["bench_shared", "replay"]
    assert args.bench_args == {"bench_shared": ["--rounds", "3", "--label", "a b"]}
    assert args.full_modes == ["pool", "passthrough+growable"]
    assert args.cupy_part == (2, 4)
    assert args.pytest_paths == ["tests/test_gpu_torch.py", "tests/test_gpu_rmm.py"]
    assert args.sanitizer_args == ["-m", "gpu and passthrough and not ipc and not fork"]


def test_each_numba_suite_mode_sets_its_environment(gpu, plan):
    assert gpu.parse_mode("default") == {"NUMBA_CUDA_MEMORY_MANAGER": None, "EMMPOOL_MODE": None,
                                         "EMMPOOL_PINNED": None, "EMMPOOL_SEGMENTS": None}
    assert gpu.parse_mode("pool") == {"NUMBA_CUDA_MEMORY_MANAGER": "emmpool.plugin",
                                      "EMMPOOL_MODE": "pool", "EMMPOOL_PINNED": None}
    assert gpu.parse_mode("passthrough-numba+growable") == {
        "NUMBA_CUDA_MEMORY_MANAGER": "emmpool.plugin", "EMMPOOL_MODE": "passthrough",
        "EMMPOOL_PINNED": "numba", "EMMPOOL_SEGMENTS": "growable"}
    env = gpu.with_env({"EMMPOOL_SEGMENTS": "growable", "EMMPOOL_PINNED": "numba", "X": "1"},
                       gpu.parse_mode("pool"))
    assert env == {"EMMPOOL_SEGMENTS": "growable", "X": "1", "EMMPOOL_MODE": "pool",
                   "NUMBA_CUDA_MEMORY_MANAGER": "emmpool.plugin"}  # the caller's segments kept
    assert plan.mode_file_name("pool+growable") == "pool_growable"


# ---- what comes back -------------------------------------------------------------------------
def test_at_most_seven_files_stay_beside_the_tarball_the_verdicts_first(gpu):
    files = {"summary.txt": 900, "compare-pool.txt": 5000, "compare-passthrough.txt": 3000,
             "compare-mlir-pool.txt": 4000, "bench_numba.md": 3000, "bench_numba.json": 90_000,
             "NVIDIA-H200-1999-01-01-cupy-suite.txt": 2000, "bench_shared.md": 2000,
             "bench_shared.json": 20_000, "bench_pinned.md": 1000, "replay.png": 3_000_000,
             "notes.log": 10}
    keep = gpu.choose_loose(files)
    assert keep == ["summary.txt", "compare-mlir-pool.txt", "compare-passthrough.txt",
                    "compare-pool.txt", "bench_numba.md", "NVIDIA-H200-1999-01-01-cupy-suite.txt",
                    "bench_pinned.md"]  # then the smallest output that fits
    assert len(gpu.choose_loose({f"compare-m{i}.txt": 1 for i in range(9)})) == 7
    assert gpu.choose_loose({"summary.txt": 1, "bench_core.json": 10, "big.png": 3_000_000}) == [
        "summary.txt", "bench_core.json"]
    assert "H200-cupy-suite-part2of4.txt" in gpu.choose_loose(
        {"summary.txt": 1, "H200-cupy-suite-part2of4.txt": 10})


def test_outdir_is_cleared_only_when_it_holds_an_earlier_run(gpu, tmp_path):
    assert gpu.outdir_state(tmp_path / "missing") == "empty"
    assert gpu.outdir_state(tmp_path) == "empty"
    (tmp_path / "summary.txt").write_text("")
    assert gpu.outdir_state(tmp_path) == "foreign"
    (tmp_path / "logs.tar.gz").write_bytes(b"")
    assert gpu.outdir_state(tmp_path) == "earlier run"
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("")
    with pytest.raises(gpu.UsageError, match="refusing to clear it"):
        gpu.resolve_outdir(other)


def test_a_verdicts_digest_is_its_head_and_the_sections_that_matter(gpu):
    text = "\n".join(["== Numba CUDA suite ==", "base tests=3", "RESULT: FAIL: 1 unexpected",
                      "", "-- UNEXPECTED: pass with default, not with plugin (1) --",
                      "  a.b.c: ok -> FAIL", "", "-- pass with plugin, not with default (1) --",
                      "  d.e.f: FAIL -> ok"])
    assert gpu.compare_digest(text) == ["== Numba CUDA suite ==", "base tests=3",
                                        "RESULT: FAIL: 1 unexpected", "-- UNEXPECTED: pass with "
                                        "default, not with plugin (1) --", "  a.b.c: ok -> FAIL",
                                        ""]


def test_a_command_past_its_timeout_is_stopped_and_says_so(gpu, tmp_path):
    log = tmp_path / "suite.txt"
    job = gpu.Job([sys.executable, "-c", "import time; print('started', flush=True); "
                   "time.sleep(60)"], log=log, timeout=1, cwd=tmp_path, env=dict(os.environ),
                  name="pool-serial", grace=2).start()
    assert job.wait() == 124 and job.timed_out
    lines = log.read_text().splitlines()
    assert lines[0].startswith("[.ci/gpu] pool-serial: default manager timeout 1s: ")
    assert "started" in lines
    assert lines[-1].startswith("[.ci/gpu] pool-serial: rc=124 after ")
    assert lines[-1].endswith("s (timeout)")  # what compare_numba.py reads (rc=124)


def test_a_runner_stopped_from_outside_takes_its_running_commands_with_it(gpu, jobs, tmp_path):
    job = gpu.Job([sys.executable, "-c", "import time; time.sleep(60)"], log=tmp_path / "x.txt",
                  timeout=120, cwd=tmp_path, env=dict(os.environ)).start()
    assert job in jobs._RUNNING
    gpu.stop_all()  # what the runner's exit and signal handlers call
    assert job.proc.wait(timeout=10) == -9
    job.poll()
    assert job not in jobs._RUNNING


# ---- whole runs here, without a GPU ----------------------------------------------------------
def run_runner(*argv, env=None):
    return subprocess.run([sys.executable, str(CI / "gpu.py"), *argv], capture_output=True,
                          text=True, timeout=600, env=env)


def test_dry_run_prints_the_plan_and_touches_nothing(gpu, tmp_path):
    out = tmp_path / "out"
    p = run_runner("--dry-run", "--only", "pytest,numba-suite", "--numba-modes", "pool",
                   str(out))
    assert p.returncode == 0, p.stderr
    assert not out.exists()
    assert "pytest: needs build, gpu; budget 240s" in p.stdout
    assert "numba.runtests -m" in p.stdout and "compare_numba.py --mode pool" in p.stdout
    assert "mlir: skipped (not chosen (--only))" in p.stdout
    p = run_runner("--dry-run", "--cuda", "12", str(out))
    assert p.returncode == 0, p.stderr
    assert "cu12_check.py --site /tmp/site-cu12" in p.stdout
    assert "test_gpu_cuda_core.py" in p.stdout and "--subset tests/cupy_tests/creation_tests" \
        in p.stdout
    assert "sanitizer: skipped (not part of a --cuda 12 run)" in p.stdout


def test_a_run_without_a_gpu_goes_through_and_says_why_each_step_was_skipped(gpu, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.txt").write_text("an earlier run\n")
    (out / "logs.tar.gz").write_bytes(b"")
    (out / "stale.json").write_text("{}")
    env = dict(os.environ, OUT=str(out))
    # No wheels (installing them could replace packages the calling pytest is using), no build
    # (minutes, and every later step stands on it), no C++ benchmark (it needs no build).
    p = run_runner("--skip", "wheels,build,bench-core", "--budget", "120", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    files = sorted(x.name for x in out.iterdir())
    assert files == ["logs.tar.gz", "summary.txt"]
    summary = (out / "summary.txt").read_text().splitlines()
    rows = {line.split()[0]: line for line in summary[1:]}
    assert rows["build"].split()[1] == "-" and "skipped (--skip)" in rows["build"]
    assert "skipped (--skip)" in rows["wheels"] and "skipped (--skip)" in rows["bench-core"]
    assert "skipped (the build step was skipped)" in rows["numba-suite"]
    assert rows["env"].split()[1] == "0"
    assert rows["total"].split()[1] == "-" and "budget 120s" in rows["total"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "./logs/env.txt" in names and "./summary.txt" in names
    assert "==== summary.txt ====" in p.stdout


def test_outdir_of_something_else_is_refused(tmp_path):
    (tmp_path / "data.csv").write_text("1,2\n")
    p = run_runner(str(tmp_path))
    assert p.returncode == 2 and "refusing to clear it" in p.stderr
    assert (tmp_path / "data.csv").exists()


# ---- the CUDA 12 site's preload ----------------------------------------------------------------
def test_the_cuda_12_site_loads_its_libraries_first_and_runs_the_sitecustomize_it_shadows(tmp_path):
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    import ctypes

    # zlib stands in for cudart: what is checked is that a process has the site's copy mapped
    # from its start, before anything asked for it.
    try:
        ctypes.CDLL("libz.so.1")
    except OSError:
        pytest.skip("no libz.so.1 here to stand in for a CUDA library")
    maps = Path("/proc/self/maps").read_text().split()
    zlib = next(word for word in maps if os.path.basename(word).startswith("libz.so"))
    site, other = tmp_path / "site-cu12", tmp_path / "other"
    lib = site / "nvidia/cuda_runtime/lib/libcudart.so.12"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(Path(zlib).read_bytes())
    (site / "sitecustomize.py").write_text((CI / "cu12_sitecustomize.py").read_text())
    other.mkdir()
    (other / "sitecustomize.py").write_text("print('shadowed sitecustomize ran')\n")
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{other}")
    p = subprocess.run([sys.executable, "-c", "print(open('/proc/self/maps').read())"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert str(lib) in p.stdout  # mapped at startup, from the site
    assert p.stdout.startswith("shadowed sitecustomize ran\n")
    assert p.stderr == ""  # the libraries not carried (NVRTC, ...) are left alone, silently


# ---- the suite steps, over stand-ins for the suites ------------------------------------------
# A stand-in for `python`: numba.runtests and pytest print what they would (one test of each
# outcome the comparison reads); anything else runs for real.
FAKE_PYTHON = r"""
import os, sys
args = sys.argv[1:]
plugin = os.environ.get("NUMBA_CUDA_MEMORY_MANAGER") == "emmpool.plugin"
if args[:2] == ["-m", "numba.runtests"]:
    print("test_a (numba.cuda.tests.cudapy.test_x.TestX.test_a) ... ok")
    print("test_b (numba.cuda.tests.cudapy.test_x.TestX.test_b) ... " + ("FAIL" if plugin and
          os.environ.get("EMMPOOL_MODE") == "passthrough" else "ok"))
    print("\n" + "-" * 70 + "\nRan 2 tests in 0.100s\n\nOK")
elif args[:2] == ["-m", "pytest"]:
    print("=" * 20 + " test session starts " + "=" * 20)
    print("created: 2/2 workers")
    print("[gw0] [ 50%] PASSED tests/test_y.py::test_c")
    print("[gw1] [100%] PASSED tests/test_y.py::test_d")
    print("=" * 20 + " 2 passed in 0.50s " + "=" * 20)
elif args and args[0].endswith("numba_mlir_check.py"):
    print("OK")
else:
    os.execv(sys.executable, [sys.executable, *args])
"""


def stand_in_runner(gpu, tmp_path, argv):
    fake = tmp_path / "fake_python.py"
    fake.write_text(FAKE_PYTHON)
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    runner = gpu.Runner(gpu.parse_args(argv + [str(out)]), out, dry=False)
    runner.work.rmdir()  # its own temporary folder, made empty: the test's instead
    runner.work = tmp_path / "work"
    runner.work.mkdir()
    runner.summary.write_text("step rc secs note\n")
    runner.python = lambda *args: [sys.executable, str(fake), *args]
    return runner, out


def test_numba_suite_runs_each_phase_and_compares_each_mode(gpu, tmp_path):
    runner, out = stand_in_runner(gpu, tmp_path, ["--numba-modes", "pool,passthrough",
                                                  "--suite-jobs", "2"])
    step = next(s for s in gpu.STEPS if s.name == "numba-suite")
    assert runner.step_numba_suite(step) == 1  # passthrough: test_b regressed
    summary = runner.summary.read_text()
    for run in ("default-serial", "pool-serial", "default-targeted", "passthrough-targeted",
                "default-parallel", "pool-parallel"):
        assert f"suite-{run} " in summary
        assert "Ran 2 tests in 0.100s; OK" in summary
        log = (out / "logs" / f"suite-{run}.txt").read_text()
        assert log.startswith(f"[.ci/gpu] {run}: ") and f"[.ci/gpu] {run}: rc=0 after " in log
    assert "RESULT: PASS" in (out / "compare-pool.txt").read_text()
    verdict = (out / "compare-passthrough.txt").read_text()
    assert "RESULT: FAIL: 1 unexpected regression" in verdict
    assert "numba.cuda.tests.cudapy.test_x.TestX.test_b: ok -> FAIL" in verdict
    assert "-m 2 -v numba.cuda.tests" in (out / "logs/suite-pool-parallel.txt").read_text()
    assert "EMMPOOL_MODE=passthrough" in (out / "logs/suite-passthrough-targeted.txt").read_text()


def test_mlir_checks_each_manager_then_compares_its_two_runs(gpu, tmp_path, monkeypatch):
    suite = tmp_path / "suite"
    (suite / "tests").mkdir(parents=True)
    (suite / "pyproject.toml").write_text("")
    tarball = tmp_path / "numba-cuda-mlir-tests-0.6.0.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(suite, arcname=".")
    runner, out = stand_in_runner(gpu, tmp_path, ["--mlir-jobs", "2"])
    monkeypatch.setattr(runner, "mlir_tarball", lambda: tarball)
    step = next(s for s in gpu.STEPS if s.name == "mlir")
    assert runner.step_mlir(step) == 0
    assert (out / "logs/mlir/manager-check.txt").read_text().count("OK") == 2
    assert "RESULT: PASS" in (out / "compare-mlir-pool.txt").read_text()
    summary = runner.summary.read_text()
    assert "compare-mlir" in summary and "\nmlir " in summary
    assert "-n 2 --dist loadscope" in (out / "logs/mlir/mlir-pool.txt").read_text()


# ---- a peer's own tests ----------------------------------------------------------------------
FAKE_PEER_CONFTEST = '''
from emmpool import _core

def pytest_configure(config):
    # The host driver stands in for the GPU, as in tests/test_rmm_native.py.
    _core._use_driver_for_all_pools(_core.HostDriver(devices=1, capacity=1 << 30))
    _core.device_count = lambda: 1
    _core.current_device = lambda: 0
'''
FAKE_PEER_TESTS = '''
import rmm.mr

def test_passes_everywhere():
    pass

def test_allocates_through_the_devices_resource():
    mr = rmm.mr.get_per_device_resource(0)
    assert type(mr).__name__ != "CudaMemoryResource", "cudaMalloc: no GPU here"
    mr.deallocate(mr.allocate(4096), 4096)
'''


@pytest.mark.rmm
def test_a_peers_suite_runs_twice_and_is_compared_by_name(tmp_path, monkeypatch):
    pytest.importorskip("rmm", reason="needs RMM: pip install 'emmpool[rmm]'")
    pytest.importorskip("Cython", reason="needs Cython: pip install 'emmpool[rmm]'")
    suite = load("peer_suite", "peer_suite.py")
    root, out = tmp_path / "peer", tmp_path / "out"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "TAG").write_text("v0.test\n")
    (root / "tests" / "conftest.py").write_text(FAKE_PEER_CONFTEST)
    (root / "tests" / "test_peer.py").write_text(FAKE_PEER_TESTS)
    # a test the peer's own resource cannot pass (one that hangs, say): out of both runs
    (root / "tests" / "test_stuck.py").write_text("def test_stuck():\n    assert False\n")
    monkeypatch.setitem(suite.PEERS, "rmm", dataclasses.replace(
        suite.PEERS["rmm"], deselected=(("test_stuck.py::test_stuck", "stuck here"),)))
    monkeypatch.setattr(suite, "preflight", lambda peer: (None, {"version": "x", "gpus": 1}))
    monkeypatch.setenv("EMMPOOL_RMM_CACHE", str(tmp_path / "cache"))
    rc = suite.main(["--peer", "rmm", "--tests", str(root), "--out", str(out),
                     "--timeout", "240"])
    text = (out / "rmm-suite.txt").read_text()
    # With RMM's default (cudaMalloc, no GPU here) one test fails; with emmpool's both pass.
    assert "left out of both runs: test_stuck.py::test_stuck (stuck here)" in text, text
    assert "default    exit 1" in text and "2 tests, failed 1, passed 1" in text, text
    assert "emmpool    exit 0" in text and "2 tests, passed 2" in text, text
    assert "emmpool run: 2 tests on emmpool's resource (native resource); allocations " \
           "through emmpool: 1" in text, text
    assert "REGRESSIONS (pass with RMM's default resource, not with emmpool): 0" in text, text
    assert "pass with emmpool, not with RMM's default resource: 1" in text, text
    assert rc == 0, text

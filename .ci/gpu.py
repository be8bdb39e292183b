#!/usr/bin/env python3
""".ci/gpu.py -- build, test and benchmark emmpool on a machine with an NVIDIA GPU.

    python3 .ci/gpu.py [options] [OUTDIR]      from the repository root
    python3 .ci/gpu.py --list                  the steps, what each needs, its time budget
    python3 .ci/gpu.py --dry-run [options]     the plan: each step and its commands, nothing run

Standard library only, no network: the GPU host needs Python 3.10+, pip, a C++ compiler,
CMake and the CUDA headers; bring the wheels it lacks in .whl/ (.ci/gpu-wheels).

OUTDIR (default: $OUT if set, else ./gpu-out) must be empty or hold an earlier run (summary.txt
and logs.tar.gz; it is then cleared). Each step logs to OUTDIR/logs/<step>.txt; a failed step
does not stop the run; summary.txt has one line per step (exit status or "-" when skipped, with
the reason; seconds; a note). At the end OUTDIR holds at most 8 files: logs.tar.gz (everything),
summary.txt, the compare-<mode>.txt verdicts, bench_numba.md, the CuPy and PyTorch suite
reports and, room permitting, other small benchmark outputs; the last thing printed is the
verdicts, the head of the suite reports, the bench_numba table, the failing steps'
diagnostics and summary.txt.

The whole run keeps to a time budget, --budget seconds (570): each step's timeout is cut to
what is left (less --reserve for the comparisons and the packing), and a step is skipped, saying
so, when too little is left. Steps whose needs are missing (a GPU, a library, carried tests) are
skipped with the reason. --cuda 12 runs the CUDA 12 stack of .whl/cu12/ (.ci/gpu-wheels cu12-*)
from a site directory of its own, ahead of the host's CUDA 13 packages: Numba's suite, CuPy's
suite and tests/test_gpu_cuda_core.py under it.

Environment variables the runner sets for what it runs (EMMCI_*, never EMMPOOL_*, which are
emmpool's own): EMMCI_BENCH_DEADLINE (a benchmark stops between rounds before its timeout),
EMMCI_BENCH_BASELINES (earlier builds to time beside this one: benchmarks/baselines.py),
EMMCI_TEST_REPORT_AT_ONCE (pytest writes each failure as it happens: tests/conftest.py).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import datetime
import glob
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
CI = REPO / ".ci"
TAG = "[.ci/gpu]"  # prefixes the runner's lines in suite logs: compare_numba.py reads rc= there

DEFAULT_BENCHES = ("bench_numba", "bench_cuda_core", "bench_pinned", "replay", "bench_shared",
                   "bench_torch_train", "bench_torch_compile", "torch_training", "growable_steps")
# Numba's tests that start subprocesses break under numba.runtests -m: run serially.
SERIAL_TESTS = ("numba.cuda.tests.cudapy.test_ipc", "numba.cuda.tests.cudadrv.test_init",
                "numba.cuda.tests.cudapy.test_multiprocessing",
                "numba.cuda.tests.cudapy.test_multithreads",
                "numba.cuda.tests.cudapy.test_caching.TestMultiprocessCache")
# The modes not given the full suite run these: what touches the memory manager.
TARGETED_TESTS = ("numba.cuda.tests.cudapy.test_ipc", "numba.cuda.tests.cudadrv.test_host_alloc",
                  "numba.cuda.tests.cudadrv.test_emm_plugins",
                  "numba.cuda.tests.cudadrv.test_deallocations",
                  "numba.cuda.tests.cudadrv.test_cuda_memory",
                  "numba.cuda.tests.cudadrv.test_pinned")
# compute-sanitizer sees each allocation only in passthrough mode; it supports neither CUDA IPC
# nor a fork after CUDA was used.
SANITIZER_MARKERS = "gpu and passthrough and not ipc and not fork"
# Under --cuda 12: emmpool's cuda.core path (and RMM's, where rmm-cu12 travels: rmm-cu13 would
# not import over cuda-bindings 12), and the parts of CuPy's suite that need no CUDA library
# beyond NVRTC (no cuBLAS, cuSOLVER, ...).
CU12_PYTEST_PATHS = ("tests/test_gpu_cuda_core.py", "tests/test_gpu_rmm.py")
CU12_CUPY_SUBSET = ("tests/cupy_tests/creation_tests", "tests/cupy_tests/manipulation_tests",
                    "tests/cupy_tests/indexing_tests", "tests/cupy_tests/cuda_tests/test_stream.py")
# pip, quiet and offline: the GPU host has no network.
PIP_ENV = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1",
           "PIP_ROOT_USER_ACTION": "ignore", "PYTHONUNBUFFERED": "1"}
LOOSE_FILES = 7  # files kept beside logs.tar.gz, read first; everything is in the tarball
LOGS_LIMIT = 16_000_000  # bytes of logs.tar.gz past which copying it back from a host gets slow


class UsageError(Exception):
    """Bad options or OUTDIR: said in one sentence, exit status 2."""


# ---- the steps ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    needs: tuple[str, ...]  # requirements (Runner.unmet), checked in order
    budget: str  # seconds: a number, or the options holding them ("a+b": phases in turn)
    what: str
    cuda: tuple[str, ...] = ("13", "12")  # the --cuda runs it belongs to
    setup: bool = False  # runs whatever --only says: the other steps stand on it
    default: bool = True  # chosen without --only (results: with --results)


STEPS = (
    Step("wheels", (), "120", "install .whl/*.whl and .whl/*.site.tar.xz into a site directory "
         "put first on PYTHONPATH (--cuda 12: .whl/cu12/ into one of its own, ahead of it)",
         setup=True),
    Step("env", (), "150", "GPUs, driver, toolchain, package versions and a Numba smoke test: "
         "logs/env.txt", setup=True),
    Step("cuda12", (), "180", "the CUDA 12 stack in force: cuda.bindings 12 imported, where "
         "cudart, NVRTC, NVVM and nvJitLink load from, a kernel compiled to PTX",
         cuda=("12",), setup=True),
    Step("build", (), "400", "pip install --no-build-isolation --no-deps . (into "
         "/tmp/emmpool-site where site-packages is read-only); import it from elsewhere",
         setup=True),
    Step("torch-ext", ("build", "gpu", "torch"), "300",
         "compile emmpool's PyTorch allocator extension once, up front", cuda=("13",)),
    Step("baselines", ("build", "benchmarks", ".baseline"), "200",
         "build each .baseline/NAME (.ci/gpu-baseline) to time beside this build, per baseline",
         cuda=("13",)),
    Step("pytest", ("build", "gpu"), "pytest_timeout",
         "tests/ with the GPU tests, from a temporary directory (the installed emmpool)"),
    Step("sanitizer", ("build", "gpu", "compute-sanitizer"), "sanitizer_timeout",
         f"compute-sanitizer memcheck over pytest -m '{SANITIZER_MARKERS}'", cuda=("13",)),
    Step("cupy-suite", ("build", "gpu", "cupy", ".cupy-tests"), "cupy_timeout",
         "CuPy's own tests, CuPy's pool vs emmpool, compared by name (.ci/cupy_suite.py)"),
    Step("torch-suite", ("build", "gpu", "torch", ".torch-tests"), "torch_suite_timeout",
         "PyTorch's test_cuda.py, its allocator vs emmpool's (.ci/torch_suite.py)",
         cuda=("13",)),
    Step("bench-core", ("gpu", "cmake"), "240",
         "the C++ micro-benchmark bench_core, pinned to a CPU near the GPU", cuda=("13",)),
    Step("cli", ("build", "gpu", "numba-cuda"), "180",
         "python -m emmpool info, selftest, bench", cuda=("13",)),
    Step("bench", ("build", "gpu"), "bench_timeout",
         "benchmarks/<name>.py --out OUTDIR for each of --benches (the timeout is each one's)",
         cuda=("13",)),
    Step("numba-suite", ("build", "gpu", "numba-cuda"), "serial_timeout+suite_timeout",
         "Numba's CUDA suite, default manager vs the plugin in each --numba-modes mode "
         "(serial phase, then parallel), compared by .ci/compare_numba.py"),
    Step("mlir", ("build", "gpu", "numba-cuda-mlir", "mlir-tests"), "mlir_timeout",
         "numba-cuda-mlir's suite, its default manager vs the plugin, after a check that "
         "kernel-argument copies come from emmpool", cuda=("13",)),
    Step("results", (), "60", "copy the run's results into benchmarks/results/<GPU>/ "
         "(.ci/gpu-results; with --results)", default=False),
)
STEP_NAMES = tuple(s.name for s in STEPS)
SETUP = tuple(s.name for s in STEPS if s.setup)


def step_seconds(step: Step, args: argparse.Namespace) -> int:
    return sum(int(part) if part.isdigit() else int(getattr(args, part))
               for part in step.budget.split("+"))


def split_names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `known`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise UsageError(f"unknown {what} {', '.join(bad)}: expected {', '.join(known)}")
    return names


def chosen_steps(only: list[str] | None, skip: list[str], cuda: str,
                 results: bool) -> dict[str, str | None]:
    """Each step -> None when it runs, else why not ("not chosen (--only)", ...)."""
    out: dict[str, str | None] = {}
    for step in STEPS:
        if cuda not in step.cuda:
            out[step.name] = f"not part of a --cuda {cuda} run"
        elif step.name in skip:
            out[step.name] = "--skip"
        elif step.name == "results":
            out[step.name] = None if results else "without --results"
        elif only is not None and step.name not in only and not step.setup:
            out[step.name] = "not chosen (--only)"
        elif only is None and not step.default:
            out[step.name] = "not chosen"
        else:
            out[step.name] = None
    return out


# ---- time ------------------------------------------------------------------------------------
class Budget:
    """The run's seconds: each step gets what it asks, cut to what is left after the reserve."""

    def __init__(self, total: float, reserve: float, clock: Callable[[], float] = time.monotonic):
        self.total, self.reserve, self.clock = total, reserve, clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.total - self.elapsed() - self.reserve

    def grant(self, want: float, minimum: float = 20) -> int:
        """Seconds for a step that wants `want`; 0 (skip it) when fewer than `minimum` (or all
        it wants, if less) are left."""
        seconds = int(min(want, self.left()))
        return seconds if seconds >= min(minimum, want) and seconds > 0 else 0


# ---- what comes back -------------------------------------------------------------------------
def outdir_state(path: Path) -> str:
    """'empty' (or missing), 'earlier run' (summary.txt and logs.tar.gz: this runner's), or
    'foreign' (anything else: not ours to clear)."""
    if not path.exists() or not any(path.iterdir()):
        return "empty"
    if (path / "summary.txt").is_file() and (path / "logs.tar.gz").is_file():
        return "earlier run"
    return "foreign"


def choose_loose(files: dict[str, int]) -> list[str]:
    """Of OUTDIR's top-level files (name -> bytes), those kept beside logs.tar.gz: summary.txt,
    the suite verdicts, bench_numba.md, the CuPy and PyTorch reports, then the smallest other
    benchmark outputs under 2 MB; at most LOOSE_FILES."""
    keep = [n for n in ("summary.txt",) if n in files]
    keep += sorted(n for n in files if n.startswith("compare-") and n.endswith(".txt"))
    keep += [n for n in ("bench_numba.md",) if n in files]
    keep += sorted(n for n in files if n.endswith("-cupy-suite.txt") or n == "torch-suite.txt"
                   or re.fullmatch(r".*-cupy-suite-part\d+of\d+\.txt", n))
    others = sorted((size, n) for n, size in files.items()
                    if n not in keep and n.rsplit(".", 1)[-1] in ("md", "json", "csv", "png")
                    and size < 2_000_000)
    for _, name in others:
        if len(keep) >= LOOSE_FILES:
            break
        keep.append(name)
    return keep[:LOOSE_FILES]


def compare_digest(text: str, limit: int = 15) -> list[str]:
    """A verdict's head up to its RESULT line, then at most `limit` lines of the sections that
    matter (unexpected regressions, tests not run, the known sub-allocation failures)."""
    out, rest = [], []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        out.append(line)
        if line.startswith("RESULT:"):
            rest = lines[i + 1:]
            break
    show, n = False, 0
    for line in rest:
        if line.startswith("-- "):
            show = line[3:].startswith(("UNEXPECTED", "not run", "known: assume"))
        if show and n < limit:
            out.append(line)
            n += 1
    return [line[:240] for line in out]


# ---- Numba suite modes -----------------------------------------------------------------------
def parse_mode(text: str) -> dict[str, str | None]:
    """A plugin mode of Numba's suite runs -> the environment it sets (None: unset).

    "<mode>" is EMMPOOL_MODE (pool, passthrough); "<mode>-<pinned>" sets EMMPOOL_PINNED too
    (pool, numba); "...+growable" sets EMMPOOL_SEGMENTS=growable. "default" is Numba's own
    manager, with emmpool's variables unset."""
    if text == "default":
        return {"NUMBA_CUDA_MEMORY_MANAGER": None, "EMMPOOL_MODE": None, "EMMPOOL_PINNED": None,
                "EMMPOOL_SEGMENTS": None}
    env: dict[str, str | None] = {"NUMBA_CUDA_MEMORY_MANAGER": "emmpool.plugin"}
    mode = text
    if mode.endswith("+growable"):
        env["EMMPOOL_SEGMENTS"] = "growable"
        mode = mode[: -len("+growable")]
    base, dash, pinned = mode.partition("-")
    if base not in ("pool", "passthrough") or (dash and pinned not in ("pool", "numba")):
        raise UsageError(f"Numba suite mode {text!r}: expected pool or passthrough, then "
                         f"optionally -pool or -numba (pinned memory), then optionally +growable")
    env["EMMPOOL_MODE"] = base
    env["EMMPOOL_PINNED"] = pinned or None
    return env


def mode_file_name(mode: str) -> str:
    """compare-<mode>.txt without '+', which some tools that copy files back refuse in names."""
    return mode.replace("+", "_")


def parse_bench_args(items: list[str], benches: list[str]) -> dict[str, list[str]]:
    """--bench-args NAME='ARGS' (repeatable) -> {NAME: [ARG, ...]}."""
    out: dict[str, list[str]] = {}
    for item in items:
        name, eq, text = item.partition("=")
        if not eq or not name:
            raise UsageError(f"--bench-args {item!r}: expected NAME='ARGS', e.g. "
                             f"bench_shared='--rounds 3'")
        if name not in benches:
            raise UsageError(f"--bench-args {name}: not one of the benchmarks run "
                             f"({', '.join(benches) or 'none'})")
        out[name] = shell_words(text, f"--bench-args {name}")
    return out


def shell_words(text: str, option: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as e:
        raise UsageError(f"{option} does not parse as shell words ({e}): {text}") from None


def parse_part(text: str | None) -> tuple[int, int] | None:
    """'2/4' -> (2, 4): the part of CuPy's selection a run takes."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise UsageError(f"--cupy-part {text!r}: expected K/N with 1 <= K <= N, e.g. 2/4")
    return int(m[1]), int(m[2])


# ---- processes -------------------------------------------------------------------------------
_RUNNING: set = set()  # the Jobs not finished yet


def stop_all(signum=None, frame=None) -> None:
    """Kill every running Job's process group: each runs in a session of its own, which would
    outlive the runner stopped from outside (a time limit, Ctrl-C) and hold the GPU."""
    for job in list(_RUNNING):
        try:
            os.killpg(job.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if signum is not None:
        sys.exit(128 + signum)


class Job:
    """A command in a process group of its own, its output into a log, stopped at its timeout
    (SIGTERM, then SIGKILL after `grace` seconds): exit status 124, or 137 when it had to be
    killed, as timeout(1) says."""

    def __init__(self, argv: list[str], *, log: Path, timeout: float, cwd: Path, env: dict,
                 name: str | None = None, append: bool = False, grace: float = 10):
        self.argv, self.log_path, self.timeout, self.cwd, self.env = argv, log, timeout, cwd, env
        self.name, self.append, self.grace = name, append, grace
        self.rc: int | None = None
        self.timed_out = False

    def start(self) -> "Job":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "ab" if self.append else "wb")
        if self.name:
            self._say(f"{self.name}: {describe_env(self.env)}timeout {int(self.timeout)}s: "
                      f"{shlex.join(self.argv)}")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        _RUNNING.add(self)
        return self

    def _say(self, text: str) -> None:
        self.log.write(f"{TAG} {text}\n".encode())
        self.log.flush()

    def poll(self) -> int | None:
        if self.rc is None:
            rc = self.proc.poll()
            if rc is None and time.monotonic() - self.t0 > self.timeout:
                rc = self._stop()
            if rc is not None:
                self._finish(rc)
        return self.rc

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.2)
        return self.rc

    def _stop(self) -> int:
        self.timed_out = True
        for sig, patience in ((signal.SIGTERM, self.grace), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=patience)
                return 124 if sig == signal.SIGTERM else 137
            except subprocess.TimeoutExpired:
                continue
        return 137

    def _finish(self, rc: int) -> None:
        _RUNNING.discard(self)
        self.rc = rc
        self.seconds = round(time.monotonic() - self.t0)
        if self.name:
            self.log.write(b"\n")  # a test cut off leaves its line open
            self._say(f"{self.name}: rc={rc} after {self.seconds}s"
                      + (" (timeout)" if self.timed_out else ""))
        self.log.close()


def wait_all(jobs: list[Job]) -> None:
    while any(job.poll() is None for job in jobs):
        time.sleep(0.5)


def describe_env(env: dict) -> str:
    shown = [f"{k}={env[k]}" for k in ("NUMBA_CUDA_MEMORY_MANAGER", "EMMPOOL_MODE",
                                       "EMMPOOL_PINNED", "EMMPOOL_SEGMENTS") if env.get(k)]
    return " ".join(shown) + " " if shown else "default manager "


def with_env(env: dict, changes: dict[str, str | None]) -> dict:
    out = dict(env)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def extract(archive: Path, dest: Path) -> None:
    """Unpack a tarball (any compression tarfile reads) into dest, members kept inside it."""
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "tar_filter"):  # Python >= 3.10.12 / 3.11.4
            tar.extractall(dest, filter="tar")
        else:  # pragma: no cover - older patch releases
            tar.extractall(dest)


def tail(path: Path, n: int, width: int = 240) -> list[str]:
    if not path.is_file():
        return []
    return [line[:width] for line in path.read_text(errors="replace").splitlines()[-n:]]


def first_match(path: Path, pattern: str, last: bool = False) -> str:
    if not path.is_file():
        return ""
    found = [line for line in path.read_text(errors="replace").splitlines()
             if re.search(pattern, line)]
    return (found[-1] if last else found[0]) if found else ""


# ---- probes run in child processes (the runner itself never touches CUDA) ---------------------
GPU_PROBE = r"""
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    sys.exit("no NVIDIA driver (libcuda.so.1 does not load)")
rc = cuda.cuInit(0)
if rc != 0:
    sys.exit(f"cuInit failed (CUresult {rc})")
n = ctypes.c_int(0)
cuda.cuDeviceGetCount(ctypes.byref(n))
if n.value == 0:
    sys.exit("the driver reports no device")
print(n.value)
"""

VERSIONS = r"""
import importlib, importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for d in ["numba", "numba-cuda", "numba-cuda-mlir", "ml-dtypes", "llvmlite", "numpy",
          "cuda-bindings", "cuda-core", "cuda-python", "cuda-pathfinder", "cupy-cuda13x",
          "cupy-cuda12x", "torch", "rmm-cu13", "rmm-cu12", "pybind11", "scikit-build-core",
          "pytest", "pytest-xdist", "filecheck", "cffi", "pycparser"]:
    try:
        print(f"{d:20s} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"{d:20s} -")
for m in ["numpy", "numba", "numba.cuda", "cuda.bindings"]:
    try:
        print(f"{m} from {importlib.import_module(m).__file__}")
    except Exception as e:
        print(f"{m}: import failed: {e!r}")
try:
    import numpy as np
    from numba import cuda
    @cuda.jit
    def k(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] += 1
    a = cuda.to_device(np.zeros(64))
    k[1, 64](a)
    assert a.copy_to_host().sum() == 64
    print("numba cuda jit smoke test: OK on", getattr(cuda.get_current_device(), "name", "?"))
except Exception as e:
    print("numba cuda jit smoke test: FAILED", repr(e))
"""

# The requirements that are a module to import (in a child, with the run's PYTHONPATH).
MODULES = {"torch": "torch", "cupy": "cupy", "numba-cuda": "numba.cuda",
           "numba-cuda-mlir": "numba_cuda_mlir"}
TOOLS = ("compute-sanitizer", "cmake")


# ---- the run ---------------------------------------------------------------------------------
class Runner:
    def __init__(self, args: argparse.Namespace, outdir: Path, dry: bool):
        self.args, self.outdir, self.dry = args, outdir, dry
        self.logs = outdir / "logs"
        self.summary = self.logs / "summary.txt"
        self.budget = Budget(args.budget, args.reserve)
        self.work = Path(tempfile.mkdtemp(prefix="emmpool-ci.")) if not dry else Path("$WORK")
        self.env = with_env(os.environ, PIP_ENV)
        self.why_not = chosen_steps(args.only, args.skip, args.cuda, args.results)
        self.done: dict[str, int | str] = {}  # step -> exit status, or "-" when skipped
        self.probed: dict[str, str | None] = {}
        self.compares: list[Path] = []
        self.baselines: list[tuple[str, Path]] = []  # (name, its bench_core build)
        self.jobs = args.suite_jobs or min(16, os.cpu_count() or 8)

    # -- output --
    def say(self, text: str) -> None:
        print(f"{TAG} +{int(self.budget.elapsed())}s {text}", flush=True)

    def record(self, name: str, rc: int | str, seconds: float, note: str = "") -> None:
        note = " ".join(note.split())[:200]  # one line, whatever a tool printed
        line = f"{name:<34s} {rc!s:>5s} {int(seconds):>6d}  {note}".rstrip()
        if not self.dry:
            with open(self.summary, "a") as f:
                f.write(line + "\n")
        self.say(f"{name}: rc={rc} ({int(seconds)}s) {note}")

    def sh(self, argv: list[str], log: Path, timeout: float, *, cwd: Path | None = None,
           env: dict | None = None, name: str | None = None, append: bool = False) -> int:
        """Run a command to its end or its timeout; in a dry run, print it."""
        if self.dry:
            where = f"(cd {cwd} && " if cwd and cwd != REPO else ""
            print(f"    $ {where}{shlex.join(argv)}{')' if where else ''}"
                  f"  # timeout {int(timeout)}s, log {log.relative_to(self.outdir)}")
            return 0
        return Job(argv, log=log, timeout=timeout, cwd=cwd or REPO, env=env or self.env,
                   name=name, append=append).start().wait()

    def start(self, argv: list[str], log: Path, timeout: float, *, cwd: Path, env: dict,
              name: str) -> Job | None:
        if self.dry:
            print(f"    $ (cd {cwd} && {shlex.join(argv)}) &  # {describe_env(env)}"
                  f"timeout {int(timeout)}s, log {log.relative_to(self.outdir)}")
            return None
        return Job(argv, log=log, timeout=timeout, cwd=cwd, env=env, name=name).start()

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def seconds_of(self, step: Step) -> int:
        return step_seconds(step, self.args)

    # -- requirements --
    def unmet(self, need: str) -> str | None:
        if need in SETUP or need == "build":
            rc = self.done.get(need)
            return None if rc == 0 or self.dry else f"the {need} step " + (
                "did not run" if rc is None else "was skipped" if rc == "-" else "failed")
        if self.dry:
            return None
        if need not in self.probed:
            self.probed[need] = self._probe(need)
        return self.probed[need]

    def _probe(self, need: str) -> str | None:
        if need == "gpu":
            p = subprocess.run(self.python("-c", GPU_PROBE), capture_output=True, text=True,
                               timeout=120, cwd=self.work, env=self.env)
            why = (p.stderr.strip().splitlines() or ["?"])[-1]
            return None if p.returncode == 0 else f"no GPU: {why}"
        if need == "cupy" and self.args.cuda == "12":
            # The host's cupy-cuda13x imports too, and would run on CUDA 13: not this run's
            site = os.path.realpath(self.args.site + "-cu12") + os.sep
            code = (f"import cupy, os, sys; f = os.path.realpath(cupy.__file__); sys.exit(None "
                    f"if f.startswith({site!r}) else f'the CUDA 12 site has no cupy-cuda12x "
                    f"(bash .ci/gpu-wheels cu12-cupy): cupy is {{f}}')")
            p = subprocess.run(self.python("-c", code), capture_output=True, text=True,
                               timeout=300, cwd=self.work, env=self.env)
            return None if p.returncode == 0 else \
                (p.stderr.strip().splitlines() or ["?"])[-1][:200]
        if need in MODULES:
            p = subprocess.run(self.python("-c", f"import {MODULES[need]}"), capture_output=True,
                               text=True, timeout=300, cwd=self.work, env=self.env)
            why = (p.stderr.strip().splitlines() or ["?"])[-1][:160]
            return None if p.returncode == 0 else f"{MODULES[need]} does not import ({why})"
        if need in TOOLS:
            return None if shutil.which(need) else f"no {need} on PATH"
        if need == ".cupy-tests":
            return None if (REPO / ".cupy-tests/tests").is_dir() else \
                "no .cupy-tests/tests (bash .ci/gpu-cupy-tests CUPY_CHECKOUT, then bring it)"
        if need == ".torch-tests":
            return None if (REPO / ".torch-tests/test_cuda.py").is_file() else \
                "no .torch-tests/test_cuda.py (bash .ci/gpu-torch-tests PYTORCH_CHECKOUT, " \
                "then bring it)"
        if need == ".baseline":
            return None if glob.glob(str(REPO / ".baseline/*/pyproject.toml")) else \
                "no .baseline/NAME (bash .ci/gpu-baseline REV NAME)"
        if need == "benchmarks":
            return None if any(self.why_not[s] is None for s in ("bench", "bench-core")) \
                else "no benchmark step chosen"
        if need == "mlir-tests":
            return None if self.mlir_tarball() else \
                "no .whl/numba-cuda-mlir-tests-*.tar.gz (bash .ci/gpu-wheels mlir)"
        raise AssertionError(need)

    # -- the run --
    def run(self) -> int:
        if not self.dry:
            self.logs.mkdir(parents=True, exist_ok=True)
            self.summary.write_text(f"{'step':<34s} {'rc':>5s} {'secs':>6s}  note\n")
        else:
            print(f"{TAG} dry run: budget {self.args.budget}s (reserve {self.args.reserve}s), "
                  f"OUTDIR {self.outdir}, CUDA {self.args.cuda}; nothing is run")
        for step in STEPS:
            why = self.why_not[step.name]
            if self.dry:
                print(f"\n{step.name}: " + (f"skipped ({why})" if why else
                      f"needs {', '.join(step.needs) or 'nothing'}; budget "
                      f"{self.seconds_of(step)}s"))
            if why is not None:
                if not (self.dry or step.name == "results" or why.startswith("not part")):
                    self.record(step.name, "-", 0, f"skipped ({why})")
                self.done[step.name] = "-"
                continue
            # Under --cuda 12 a step that does not run on the CUDA 12 stack proves nothing.
            needs = step.needs + (("cuda12",) if self.args.cuda == "12" and not step.setup
                                  else ())
            reason = next(filter(None, (self.unmet(n) for n in needs)), None)
            if reason:
                self.record(step.name, "-", 0, f"skipped ({reason})")
                self.done[step.name] = "-"
                continue
            if step.name == "results":
                continue  # after the packing
            self.done[step.name] = getattr(self, "step_" + step.name.replace("-", "_"))(step)
        self.pack_and_print()
        return 0

    def timed(self, step: Step, want: float | None = None, minimum: float = 20) -> int:
        """The step's seconds (0: skipped, recorded so)."""
        seconds = self.budget.grant(self.seconds_of(step) if want is None else want, minimum)
        if self.dry:
            return int(self.seconds_of(step) if want is None else want)
        if seconds == 0:
            self.record(step.name, "-", 0, f"skipped (budget: {int(self.budget.left())}s left)")
        return seconds

    # -- setup steps --
    def step_wheels(self, step: Step) -> int | str:
        groups = [(REPO / ".whl", Path(self.args.site))]
        if self.args.cuda == "12":
            groups.insert(0, (REPO / ".whl/cu12", Path(self.args.site + "-cu12")))
        t, rc, names, sites = time.monotonic(), 0, [], []
        log = self.logs / "wheels.txt"
        for folder, site in groups:
            wheels = sorted(folder.glob("*.whl"))
            packed = sorted(folder.glob("*.site.tar.xz"))
            if not wheels and not packed:
                continue
            names += [w.name.split("-")[0] + "-" + w.name.split("-")[1] for w in wheels]
            names += [p.name[: -len(".site.tar.xz")] for p in packed]
            if not self.dry:
                site.mkdir(parents=True, exist_ok=True)
            if wheels:
                rc = rc or self.sh(self.python("-m", "pip", "install", "-q", "--no-index",
                                               "--no-deps", "--no-compile", "--no-cache-dir",
                                               "--upgrade", "--target", str(site),
                                               *map(str, wheels)),
                                   log, self.timed(step), append=True)
            for archive in packed:
                if self.dry:
                    print(f"    unpack {archive.relative_to(REPO)} into {site}")
                    continue
                try:
                    extract(archive, site)
                except (OSError, tarfile.TarError) as e:
                    with open(log, "a") as f:
                        f.write(f"{archive}: {e}\n")
                    rc = rc or 1
            if folder.name == "cu12":
                # Loaded first by every Python process of the run: the CUDA 12 libraries carried,
                # which cuda-pathfinder would otherwise find in the host's CUDA 13 wheels first.
                if self.dry:
                    print(f"    copy .ci/cu12_sitecustomize.py to {site}/sitecustomize.py")
                else:
                    shutil.copy(CI / "cu12_sitecustomize.py", site / "sitecustomize.py")
            sites.append(str(site))
        if not names:
            self.record(step.name, "-", 0, "skipped (no .whl/*.whl or .whl/*.site.tar.xz"
                        + (" or .whl/cu12/" if self.args.cuda == "12" else "") + ")")
            return "-"
        if rc == 0:
            self.env["PYTHONPATH"] = os.pathsep.join(
                sites + ([self.env["PYTHONPATH"]] if self.env.get("PYTHONPATH") else []))
        self.record(step.name, rc, time.monotonic() - t, " ".join(names)[:200])
        if rc != 0:
            print("\n".join(tail(log, 20)))
        return rc

    def step_env(self, step: Step) -> int:
        t = time.monotonic()
        log = self.logs / "env.txt"
        if self.dry:
            print(f"    nvidia-smi -L; nvidia-smi --query-gpu=...; nvcc --version; "
                  f"cmake --version; package versions and a Numba smoke test  # into "
                  f"{log.relative_to(self.outdir)}")
            return 0
        with open(log, "w") as f:
            f.write(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}"
                    f"   host: {socket.gethostname()}   nproc: {os.cpu_count()}\n")
        for title, argv in (
                ("nvidia-smi -L", ["nvidia-smi", "-L"]),
                (None, ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used",
                        "--format=csv"]),
                ("nvcc", ["nvcc", "--version"]), ("cmake", ["cmake", "--version"])):
            with open(log, "a") as f:
                if title:
                    f.write(f"## {title}\n")
                try:
                    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
                    out = (p.stdout + p.stderr).splitlines()
                except (OSError, subprocess.TimeoutExpired) as e:
                    out = [f"{argv[0]}: {e}"]
                if argv[0] == "nvcc":
                    out = out[-2:]
                elif argv[0] == "cmake":
                    out = out[:1]
                f.write("\n".join(out) + "\n")
        with open(log, "a") as f:
            f.write(f"## python\nPYTHONPATH={self.env.get('PYTHONPATH', '')}\n")
        self.sh(self.python("-c", VERSIONS), log, self.timed(step, minimum=1), cwd=self.work,
                append=True)
        gpu = self.unmet("gpu")
        with open(log, "a") as f:
            f.write(f"gpu probe: {gpu or 'OK'}\n")
        note = f"{first_match(log, r'^GPU 0')[:60] or gpu}; {first_match(log, 'smoke test')}"
        self.record(step.name, 0, time.monotonic() - t, note)
        return 0

    def step_cuda12(self, step: Step) -> int:
        t, log = time.monotonic(), self.logs / "cuda12.txt"
        rc = self.sh(self.python(str(CI / "cu12_check.py"), "--site", self.args.site + "-cu12"),
                     log, self.timed(step, minimum=1), cwd=self.work)
        if not self.dry:
            self.record(step.name, rc, time.monotonic() - t,
                        first_match(log, r"^CUDA 12 stack:", last=True)[:200]
                        or "see logs/cuda12.txt")
            if rc != 0:
                print("\n".join(tail(log, 25)))
        return rc

    def step_build(self, step: Step) -> int:
        t, log = time.monotonic(), self.logs / "build.txt"
        pip = self.python("-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps",
                          "--no-index")
        purelib = subprocess.run(self.python("-c", "import sysconfig; print(sysconfig.get_paths()"
                                             "['purelib'])"), capture_output=True, text=True,
                                 env=self.env).stdout.strip()
        rc = 1
        writable = bool(purelib) and os.access(purelib, os.W_OK)
        if writable or self.dry:
            if not self.dry:
                log.write_text(f"## pip install into {purelib}\n")
            rc = self.sh(pip + ["."], log, self.timed(step, minimum=1), append=True)
        if rc != 0 and (not writable or re.search(
                r"Permission denied|Errno 13|Read-only file system|not writ",
                log.read_text(errors="replace"))):
            with open(log, "a") as f:
                f.write("## fallback: pip install --target /tmp/emmpool-site\n")
            rc = self.sh(pip + ["--target", "/tmp/emmpool-site", "."], log,
                         self.timed(step, minimum=1), append=True)
            if rc == 0:
                self.env["PYTHONPATH"] = os.pathsep.join(
                    ["/tmp/emmpool-site"] + ([self.env["PYTHONPATH"]]
                                              if self.env.get("PYTHONPATH") else []))
        if self.dry:
            return 0
        if rc != 0:
            self.record(step.name, rc, time.monotonic() - t, "see logs/build.txt")
            return rc
        p = subprocess.run(self.python("-c", "import emmpool, emmpool.plugin; "
                                       "print(emmpool.__file__)"),
                           capture_output=True, text=True, cwd=self.work, env=self.env)
        imported = (p.stdout + p.stderr).strip().splitlines()[-1:] or ["?"]
        with open(log, "a") as f:
            f.write(f"## import check from {self.work}: {imported[0]}\n")
        with open(self.logs / "env.txt", "a") as f:
            f.write(f"emmpool imported from: {imported[0]}\n")
        rc = 0 if imported[0].endswith(os.path.join("emmpool", "__init__.py")) else 99
        self.record(step.name, rc, time.monotonic() - t, f"emmpool: {imported[0]}"[:200])
        return rc

    # -- work steps --
    def step_torch_ext(self, step: Step) -> int | str:
        seconds = self.timed(step)
        if not seconds:
            return "-"
        t, log = time.monotonic(), self.logs / "torch-ext.txt"
        rc = self.sh(self.python("-c", "import emmpool._torch as t, torch; "
                                 "m = t.build_extension(verbose=True); "
                                 "print('torch', torch.__version__, 'extension', m.__file__)"),
                     log, seconds, cwd=self.work)
        if not self.dry:
            self.record(step.name, rc, time.monotonic() - t, " ".join(tail(log, 1))[:120])
            if rc != 0:
                print("\n".join(tail(log, 15)))
        return rc

    def step_baselines(self, step: Step) -> int:
        names = []
        for project in sorted(REPO.glob(".baseline/*/pyproject.toml")):
            src, name = project.parent, project.parent.name
            seconds = self.budget.grant(self.seconds_of(step), 60) if not self.dry else 200
            if not seconds:
                self.record(f"baseline-{name}", "-", 0, "skipped (budget)")
                continue
            t, log = time.monotonic(), self.logs / f"baseline-{name}.txt"
            site, bench = self.work / f"baseline-{name}", self.work / f"baseline-{name}-bench"
            rc = self.sh(self.python("-m", "pip", "install", "-v", "--no-build-isolation",
                                     "--no-deps", "--no-index", "--target", str(site), str(src)),
                         log, seconds)
            rc = rc or self.sh(["cmake", "-S", str(src), "-B", str(bench), "-G", "Ninja",
                                "-DCMAKE_BUILD_TYPE=Release", "-DEMMPOOL_BUILD_PYTHON=OFF",
                                "-DEMMPOOL_BUILD_BENCHMARKS=ON"], log, seconds, append=True)
            rc = rc or self.sh(["cmake", "--build", str(bench)], log, seconds, append=True)
            rev = (src / "BASELINE_REV").read_text()[:12] if (src / "BASELINE_REV").exists() \
                else ""
            if not self.dry:
                self.record(f"baseline-{name}", rc, time.monotonic() - t, rev)
            if rc == 0:
                names.append(f"{name}={site}")
                self.baselines.append((name, bench))
            elif not self.dry:
                print("\n".join(tail(log, 15)))
        if names:
            self.env["EMMCI_BENCH_BASELINES"] = " ".join(names)
        return 0

    def step_pytest(self, step: Step) -> int | str:
        seconds = self.timed(step)
        if not seconds:
            return "-"
        t, log = time.monotonic(), self.logs / "pytest.txt"
        paths = self.args.pytest_paths or ("tests",)
        if self.args.cuda == "12" and not self.args.pytest_paths:
            rmm = any((REPO / ".whl/cu12").glob("rmm_cu12-*"))
            paths = [p for p in CU12_PYTEST_PATHS if rmm or "rmm" not in p]
        cwd = self.work / "pytest"
        if not self.dry:
            cwd.mkdir(exist_ok=True)
        # --durations and each failure as it happens (tests/conftest.py): a run cut short by
        # its timeout still says what failed, and where time went
        rc = self.sh(self.python("-m", "pytest", "-ra", "-p", "no:cacheprovider",
                                 "--durations=20", "--rootdir", str(REPO),
                                 *self.args.pytest_args, *(str(REPO / p) for p in paths)),
                     log, seconds, cwd=cwd, env=dict(self.env, EMMCI_TEST_REPORT_AT_ONCE="1"))
        if not self.dry:
            self.record(step.name, rc, time.monotonic() - t, pytest_line(log))
        return rc

    def step_sanitizer(self, step: Step) -> int | str:
        seconds = self.timed(step)
        if not seconds:
            return "-"
        t, log, memlogs = time.monotonic(), self.logs / "sanitizer-pytest.txt", \
            self.logs / "sanitizer"
        cwd = self.work / "sanitizer"
        if not self.dry:
            cwd.mkdir(exist_ok=True)
            memlogs.mkdir(exist_ok=True)
        # Every process is instrumented (the tests run scenarios in child interpreters); one
        # with a memory error exits 86, failing its test. API errors are not reported: the tests
        # provoke out-of-memory on purpose, the pool asks the driver about pointers a reset may
        # have invalidated, and cuda-bindings probes entry points.
        rc = self.sh(["compute-sanitizer", "--tool", "memcheck", "--report-api-errors", "no",
                      "--target-processes", "all", "--error-exitcode", "86",
                      "--log-file", str(memlogs / "memcheck.%p.log"),
                      *self.python("-m", "pytest", "-ra", "-p", "no:cacheprovider", "--rootdir",
                                   str(REPO), *self.args.sanitizer_args, str(REPO / "tests"))],
                     log, seconds, cwd=cwd)
        if not self.dry:
            texts = [p.read_text(errors="replace") for p in memlogs.glob("memcheck.*.log")]
            summaries = [int(n) for text in texts
                         for n in re.findall(r"ERROR SUMMARY: (\d+)", text)]
            self.record(step.name, rc, time.monotonic() - t,
                        f"memcheck: {len(summaries)} processes, {sum(summaries)} errors; "
                        + pytest_line(log))
        return rc

    def suite_script(self, step: Step, script: str, extra: list[str]) -> int | str:
        """.ci/cupy_suite.py or .ci/torch_suite.py: its report into OUTDIR."""
        seconds = self.timed(step, minimum=60)
        if not seconds:
            return "-"
        t, out, log = time.monotonic(), self.logs / step.name, self.logs / f"{step.name}.txt"
        rc = self.sh(self.python(str(CI / script), "--out", str(out),
                                 "--timeout", str(max(30, seconds - 30)), *extra),
                     log, seconds + 60)
        if self.dry:
            return 0
        for report in out.glob(f"*{step.name}*.txt"):
            shutil.copy(report, self.outdir / report.name)
        self.record(step.name, rc, time.monotonic() - t,
                    first_match(log, r"^(NOT RUN|NO TESTS RAN|REGRESSIONS)")[:90])
        return rc

    def step_cupy_suite(self, step: Step) -> int | str:
        extra = ["--tests", str(REPO / ".cupy-tests"), "--jobs", str(self.jobs)]
        if self.args.cupy_part:
            extra += ["--part", "{}/{}".format(*self.args.cupy_part)]
        if self.args.cuda == "12" and "--subset" not in self.args.cupy_args:
            extra += ["--subset", *CU12_CUPY_SUBSET]
        return self.suite_script(step, "cupy_suite.py", extra + self.args.cupy_args)

    def step_torch_suite(self, step: Step) -> int | str:
        # its two runs take turns: some tests take half the GPU's memory
        return self.suite_script(step, "torch_suite.py",
                                 ["--tests", str(REPO / ".torch-tests"),
                                  *self.args.torch_suite_args])

    def step_bench_core(self, step: Step) -> int | str:
        seconds = self.timed(step, minimum=60)
        if not seconds:
            return "-"
        t, log, build = time.monotonic(), self.logs / "bench-core.txt", self.work / "bench-build"
        rc = self.sh(["cmake", "-S", str(REPO), "-B", str(build), "-G", "Ninja",
                      "-DCMAKE_BUILD_TYPE=Release", "-DEMMPOOL_BUILD_PYTHON=OFF",
                      "-DEMMPOOL_BUILD_BENCHMARKS=ON"], self.logs / "bench-core-build.txt",
                     seconds)
        rc = rc or self.sh(["cmake", "--build", str(build)], self.logs / "bench-core-build.txt",
                           seconds, append=True)
        if rc != 0:
            if not self.dry:
                self.record(step.name, rc, time.monotonic() - t, "see logs/bench-core-build.txt")
                print("\n".join(tail(self.logs / "bench-core-build.txt", 15)))
            return rc
        # One CPU near the GPU for every run (benchmarks/cpus.py): unpinned, runs of one binary
        # differed 1.7x as the process landed on one CPU or another.
        cpu = "" if self.dry else subprocess.run(
            self.python(str(REPO / "benchmarks/cpus.py"), "1"), capture_output=True, text=True,
            env=self.env).stdout.strip()
        pin = ["taskset", "-c", cpu] if cpu and shutil.which("taskset") else []
        if not self.dry:
            log.write_text(f"bench_core CPUs: {cpu or 'not pinned'}\n")
        binary = build / "benchmarks" / "bench_core"
        rc = self.sh(pin + [str(binary), "--out", str(self.outdir / "bench_core.json")], log, 120,
                     append=True)
        # Earlier builds, interleaved with this one: this, each earlier, this, each earlier
        if self.baselines:
            (self.logs / "bench").mkdir(exist_ok=True)
            for r in (1, 2, 3):
                for name, tree in [("", build)] + self.baselines:
                    out = self.logs / "bench" / f"bench_core{'@' + name if name else ''}-r{r}.json"
                    rc = self.sh(pin + [str(tree / "benchmarks" / "bench_core"), "--out",
                                        str(out)], log, 120, append=True) or rc
        if not self.dry:
            self.record(step.name, rc, time.monotonic() - t)
        return rc

    def step_cli(self, step: Step) -> int | str:
        seconds = self.timed(step)
        if not seconds:
            return "-"
        t, log = time.monotonic(), self.logs / "cli.txt"
        rc = 0
        for argv in (["info"], ["selftest"], ["bench", "--out", str(self.outdir)]):
            rc = rc or self.sh(self.python("-m", "emmpool", *argv), log,
                               max(1, seconds - (time.monotonic() - t)), cwd=self.work,
                               append=True)
        if not self.dry:
            self.record(step.name, rc, time.monotonic() - t)
            if rc != 0:
                print("\n".join(tail(log, 20)))
        return rc

    def step_bench(self, step: Step) -> int:
        worst = 0
        for name in self.args.benches:
            seconds = self.budget.grant(self.args.bench_timeout) if not self.dry \
                else self.args.bench_timeout
            if not seconds:
                self.record(f"bench-{name}", "-", 0, "skipped (budget)")
                continue
            t, log = time.monotonic(), self.logs / f"bench-{name}.txt"
            # a benchmark that reads the deadline (bench_numba) stops between rounds and writes
            # what it has, rather than losing everything to the timeout
            env = dict(self.env, EMMCI_BENCH_DEADLINE=str(int(time.time() + seconds - 15)))
            rc = self.sh(self.python(str(REPO / "benchmarks" / f"{name}.py"), "--out",
                                     str(self.outdir), *self.args.bench_args.get(name, [])),
                         log, seconds, env=env)
            if not self.dry:
                self.record(f"bench-{name}", rc, time.monotonic() - t)
                if rc != 0:
                    print("\n".join(tail(log, 15)))
            worst = worst or rc
        return worst

    # -- Numba's suite --
    def step_numba_suite(self, step: Step) -> int | str:
        modes = self.args.numba_modes
        full = [m for m in modes if m in self.args.full_modes]
        targeted = [m for m in modes if m not in self.args.full_modes]
        cwd_root = self.work / "numba-suite"
        serial = ["-v", *SERIAL_TESTS]

        def run(name: str, mode: str, seconds: int, argv: list[str]) -> Job | None:
            if seconds < 20:
                self.record(f"suite-{name}", "-", 0, "skipped (budget)")
                return None
            cwd = cwd_root / name
            if not self.dry:
                cwd.mkdir(parents=True, exist_ok=True)
            job = self.start(self.python("-m", "numba.runtests", *argv),
                             self.logs / f"suite-{name}.txt", seconds, cwd=cwd,
                             env=with_env(self.env, parse_mode(mode)), name=name)
            if job is not None and self.args.suite_sequential:
                job.wait()
            return job

        def phase(runs: list[tuple[str, str, list[str]]], want: int, minimum: int) -> bool:
            seconds = self.budget.grant(want, minimum) if not self.dry else want
            if not seconds:
                return False
            jobs = [run(name, mode, seconds if self.dry else self.budget.grant(want, minimum),
                        argv) for name, mode, argv in runs]
            jobs = [j for j in jobs if j is not None]
            wait_all(jobs)
            for job in jobs:
                self.record(f"suite-{job.name}", job.rc, job.seconds, suite_note(job.log_path))
            return True

        serial_runs = []
        if full:
            serial_runs += [("default-serial", "default", serial)]
            serial_runs += [(f"{m}-serial", m, serial) for m in full]
        if targeted:
            serial_runs += [("default-targeted", "default", ["-v", *TARGETED_TESTS])]
            serial_runs += [(f"{m}-targeted", m, ["-v", *TARGETED_TESTS]) for m in targeted]
        if serial_runs and not phase(serial_runs, self.args.serial_timeout, 20):
            self.record("suite-serial-phase", "-", 0, "skipped (budget)")
        if full:
            parallel = ["-m", str(self.jobs), "-v", *self.args.suite_tests]
            runs = [("default-parallel", "default", parallel)]
            runs += [(f"{m}-parallel", m, parallel) for m in full]
            if not phase(runs, self.args.suite_timeout, min(self.args.suite_timeout, 60)):
                self.record("suite-parallel-phase", "-", 0,
                            f"skipped (budget: {int(self.budget.left())}s left)")
        worst = 0
        for mode in modes:
            kind = "full" if mode in full else "targeted"
            base = ["default-parallel", "default-serial"] if kind == "full" \
                else ["default-targeted"]
            plugin = [f"{mode}-parallel", f"{mode}-serial"] if kind == "full" \
                else [f"{mode}-targeted"]
            rc = self.compare(f"compare-{mode}", mode, f"{mode}: {kind} suite",
                              [self.logs / f"suite-{r}.txt" for r in base],
                              [self.logs / f"suite-{r}.txt" for r in plugin],
                              self.outdir / f"compare-{mode_file_name(mode)}.txt")
            worst = worst or rc
        return worst

    def compare(self, name: str, mode: str, label: str, base: list[Path], plugin: list[Path],
                out: Path) -> int:
        t = time.monotonic()
        argv = self.python(str(CI / "compare_numba.py"), "--mode", parse_mode(mode)[
            "EMMPOOL_MODE"] or mode, "--label", label, "--all", *self.args.compare_args,
                           "--base", *map(str, base), "--plugin", *map(str, plugin))
        if self.dry:
            print(f"    $ {shlex.join(argv)} > {out.relative_to(self.outdir)}")
            return 0
        with open(out, "w") as f:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                timeout=300).returncode
        self.compares.append(out)
        self.record(name, rc, time.monotonic() - t, first_match(out, "^RESULT:")[:90])
        return rc

    # -- numba-cuda-mlir's suite --
    def mlir_tarball(self) -> Path | None:
        found = sorted(REPO.glob(".whl/numba-cuda-mlir-tests-*.tar.gz"),
                       key=lambda p: [int(x) if x.isdigit() else x for x in
                                      re.split(r"(\d+)", p.name)])
        return found[-1] if found else None

    def step_mlir(self, step: Step) -> int | str:
        seconds = self.timed(step, self.args.mlir_timeout + 45, minimum=90)
        if not seconds:
            return "-"
        t, logs, mode = time.monotonic(), self.logs / "mlir", self.args.mlir_mode
        suite = self.work / "mlir-suite"
        tarball = self.mlir_tarball()
        version = "?"
        if not self.dry:
            logs.mkdir(exist_ok=True)
            suite.mkdir(exist_ok=True)
            extract(tarball, suite)
            version = subprocess.run(self.python("-c", "import numba_cuda_mlir as m; "
                                                 "print(m.__version__)"), capture_output=True,
                                     text=True, cwd=self.work, env=self.env).stdout.strip()
        tests_version = tarball.name[len("numba-cuda-mlir-tests-"):-len(".tar.gz")] \
            if tarball else "?"
        # Each manager allocates once and is the one expected; under the plugin, a kernel
        # launched over a NumPy array copies it through emmpool (cuda.core's Device.allocate).
        check = logs / "manager-check.txt"
        rc = 0
        for manager in ("default", mode):
            env = with_env(self.env, parse_mode(manager))
            rc = rc or self.sh(self.python(str(CI / "numba_mlir_check.py")), check, 120,
                               cwd=self.work, env=env, append=True)
        if rc != 0 and not self.dry:
            self.record(step.name, 2, time.monotonic() - t,
                        "manager check failed: see logs/mlir/manager-check.txt")
            print("\n".join(tail(check, 20)))
            return 2
        # As the package's CI runs its suite, but: -o addopts= drops its reruns of failed tests
        # (a rerun could hide a failure the plugin causes), and a module that fails to import
        # is reported while the rest still run.
        jobs = self.args.mlir_jobs or max(1, min(8, (os.cpu_count() or 2) // 2))
        argv = self.python("-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts=",
                           "-rfE", "-W", "ignore::UserWarning", "--continue-on-collection-errors",
                           "-n", str(jobs), "--dist", "loadscope", "--ignore=tests/benchmarks",
                           "--ignore=tests/doc_examples", "--ignore=tests/test_symbol_isolation.py",
                           *self.args.mlir_pytest_args, *self.args.mlir_tests)
        runs = [self.start(argv, logs / f"mlir-{run}.txt", seconds - 45, cwd=suite,
                           env=with_env(self.env, parse_mode(run)), name=f"mlir {run}")
                for run in ("default", mode)]
        wait_all([j for j in runs if j is not None])
        rc = self.compare("compare-mlir", mode, f"numba-cuda-mlir {version}, {mode}",
                          [logs / "mlir-default.txt"], [logs / f"mlir-{mode}.txt"],
                          self.outdir / f"compare-mlir-{mode}.txt")
        if not self.dry:
            note = first_match(self.outdir / f"compare-mlir-{mode}.txt", "^RESULT:")[:90]
            if tests_version != version:
                note = f"tests of {tests_version}, package {version}; " + note
            self.record(step.name, rc, time.monotonic() - t, note)
        return rc

    # -- the end --
    def diagnostics(self) -> list[str]:
        out = []
        build = self.logs / "build.txt"
        if self.done.get("build") not in (0, "-") and build.is_file():
            text = build.read_text(errors="replace").splitlines()
            errors = [f"{i}:{line}"[:240] for i, line in enumerate(text, 1)
                      if re.search(r"error|Error|ERROR|FAILED|fatal|undefined reference", line)
                      and "Werror" not in line]
            out += ["==== build.txt: error lines ===="] + errors[:30]
            out += ["==== build.txt: last 25 lines ===="] + tail(build, 25)
        for name in ("pytest", "sanitizer-pytest"):
            log = self.logs / f"{name}.txt"
            if log.is_file() and not re.search(
                    r"^=+ \d+ passed( in|, \d+ (skipped|deselected|xfailed|xpassed|warnings?))",
                    log.read_text(errors="replace"), re.M):
                text = log.read_text(errors="replace").splitlines()
                marks = [i for i, line in enumerate(text) if "short test summary info" in line]
                shown = text[marks[-1]:][-30:] if marks else text[-20:]
                out += [f"==== {name}.txt: short summary ===="] + [s[:240] for s in shown]
        summary = self.summary.read_text() if self.summary.is_file() else ""
        for name in self.args.benches:
            if re.search(rf"^bench-{re.escape(name)} +[1-9]", summary, re.M):
                out += [f"==== bench-{name}.txt: last 12 lines ===="]
                out += tail(self.logs / f"bench-{name}.txt", 12)
        return out

    def pack_and_print(self) -> None:
        if self.dry:
            print(f"\npack: logs.tar.gz and at most {LOOSE_FILES} other files in OUTDIR")
            if self.why_not["results"] is None:
                print(f"results: python3 .ci/gpu-results {self.outdir}")
            return
        self.record("total", "-", self.budget.elapsed(), f"budget {self.args.budget}s")
        diag = self.diagnostics()
        shutil.copy(self.summary, self.outdir / "summary.txt")
        tarball = self.work / "logs.tar.gz"
        with tarfile.open(tarball, "w:gz") as tar:
            tar.add(self.outdir, arcname=".")
        files = {p.name: p.stat().st_size for p in self.outdir.iterdir() if p.is_file()}
        keep = set(choose_loose(files))
        for entry in self.outdir.iterdir():
            if entry.name not in keep:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        shutil.move(str(tarball), self.outdir / "logs.tar.gz")
        size = (self.outdir / "logs.tar.gz").stat().st_size
        if size > LOGS_LIMIT:
            print(f"WARNING: logs.tar.gz is {size} bytes, more than {LOGS_LIMIT}: slow to copy "
                  f"back from a host")
        print()
        for path in self.compares:
            if path.is_file():
                print(f"==== {path.name}: summary and unexpected regressions (full list in "
                      f"the file) ====")
                print("\n".join(compare_digest(path.read_text(errors="replace"))))
        for path in sorted(self.outdir.glob("*cupy-suite*.txt")) + \
                sorted(self.outdir.glob("torch-suite.txt")):
            print(f"==== {path.name} (head) ====")
            print("\n".join(line[:240] for line in
                            path.read_text(errors="replace").splitlines()[:30]))
        if (self.outdir / "bench_numba.md").is_file():
            print("==== bench_numba.md ====")
            print("\n".join(line[:240] for line in (self.outdir / "bench_numba.md")
                            .read_text(errors="replace").splitlines()[:40]))
        print("\n".join(diag))
        if self.why_not["results"] is None:
            print("==== .ci/gpu-results ====", flush=True)
            subprocess.run([sys.executable, str(CI / "gpu-results"), str(self.outdir)])
        print(f"==== OUTDIR: {' '.join(sorted(p.name for p in self.outdir.iterdir()))}")
        print("==== summary.txt ====")
        print((self.outdir / "summary.txt").read_text(), end="", flush=True)
        shutil.rmtree(self.work, ignore_errors=True)


def pytest_line(log: Path) -> str:
    line = first_match(log, r"^=+ .*(passed|failed|error|skipped|no tests ran).* =+$", last=True)
    return line.strip("= ")


def suite_note(log: Path) -> str:
    """"Ran N tests in S; OK|FAILED (...)" of a numba.runtests log, or how far it got."""
    ran = first_match(log, r"^Ran \d+ tests? in", last=True)
    if not ran:
        text = log.read_text(errors="replace") if log.is_file() else ""
        return f"INCOMPLETE: {len(re.findall(TEST_LINE, text))} test lines"
    return f"{ran}; {first_match(log, FINAL_LINE, last=True)}"


TEST_LINE = r" \.\.\. "  # numba.runtests -v: "test_x (mod.Class.test_x) ... ok"
FINAL_LINE = r"^(OK|FAILED)( \(|$)"


# ---- options ---------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python3 .ci/gpu.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Steps: " + ", ".join(STEP_NAMES) + " (--list says what each does).")
    ap.add_argument("outdir", nargs="?", type=Path,
                    help="where the results go [$OUT, else ./gpu-out]")
    run = ap.add_argument_group("what runs")
    run.add_argument("--only", metavar="STEP[,STEP]",
                     help="run these steps (and the setup steps: wheels, env, cuda12, build)")
    run.add_argument("--skip", metavar="STEP[,STEP]", default="", help="leave these steps out")
    run.add_argument("--cuda", choices=("13", "12"), default="13",
                     help="12: the CUDA 12 stack of .whl/cu12/ in a site directory of its own "
                          "(Numba's suite, CuPy's, tests/test_gpu_cuda_core.py) [13: the host's]")
    run.add_argument("--results", action="store_true",
                     help="at the end, copy the results into this checkout's "
                          "benchmarks/results/<GPU>/ (.ci/gpu-results)")
    run.add_argument("--list", action="store_true", help="print the steps and exit")
    run.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    time_ = ap.add_argument_group("time")
    time_.add_argument("--budget", type=int, default=570,
                       help="seconds the whole run may take: its time budget [570]")
    time_.add_argument("--reserve", type=int, default=25,
                       help="seconds kept for the comparisons and the packing [25]")
    steps = ap.add_argument_group("steps")
    steps.add_argument("--site", default="/tmp/site",
                       help="where .whl/ is installed [/tmp/site; --cuda 12: also <site>-cu12]")
    steps.add_argument("--pytest-args", default="", metavar="'ARGS'",
                       help="extra pytest arguments, shell words (e.g. \"-m 'torch'\", \"-x\")")
    steps.add_argument("--pytest-paths", default="", metavar="PATH[,PATH]",
                       help="what pytest runs, relative to the root [tests; --cuda 12: "
                            + ",".join(CU12_PYTEST_PATHS) + "]")
    steps.add_argument("--pytest-timeout", type=int, default=240, metavar="S")
    steps.add_argument("--sanitizer-args", default=f"-m '{SANITIZER_MARKERS}'", metavar="'ARGS'",
                       help=f"pytest arguments of the sanitizer step [-m '{SANITIZER_MARKERS}']")
    steps.add_argument("--sanitizer-timeout", type=int, default=240, metavar="S")
    steps.add_argument("--cupy-args", default="", metavar="'ARGS'",
                       help="extra arguments of .ci/cupy_suite.py (e.g. \"--subset tests/...\")")
    steps.add_argument("--cupy-part", metavar="K/N",
                       help="run part K of N of CuPy's selection (merge the parts with "
                            "python3 .ci/cupy_suite.py --merge OUTDIR ...)")
    steps.add_argument("--cupy-timeout", type=int, default=360, metavar="S",
                       help="both runs of CuPy's suite, at once [360]")
    steps.add_argument("--torch-suite-args", default="", metavar="'ARGS'",
                       help="extra arguments of .ci/torch_suite.py (e.g. \"--jobs 2\")")
    steps.add_argument("--torch-suite-timeout", type=int, default=480, metavar="S",
                       help="both runs of test_cuda.py, in turn [480]")
    steps.add_argument("--benches", metavar="NAME[,NAME]", default=",".join(DEFAULT_BENCHES),
                       help="benchmarks/<name>.py run by the bench step, in order")
    steps.add_argument("--bench-args", action="append", default=[], metavar="NAME='ARGS'",
                       help="extra arguments of one benchmark (repeatable), e.g. "
                            "bench_shared='--rounds 3'")
    steps.add_argument("--bench-timeout", type=int, default=360, metavar="S",
                       help="each benchmark's; bench_numba stops between rounds 15 s before [360]")
    steps.add_argument("--numba-modes", default="pool,passthrough", metavar="MODE[,MODE]",
                       help="plugin modes of Numba's suite: pool or passthrough, -pool/-numba "
                            "for the pinned memory, +growable [pool,passthrough]")
    steps.add_argument("--full-modes", default="pool", metavar="MODE[,MODE]",
                       help="those of them run over the whole suite (the others: the tests "
                            "that touch the memory manager) [pool]")
    steps.add_argument("--suite-tests", default="numba.cuda.tests", metavar="'TESTS'",
                       help="what the parallel runs run [numba.cuda.tests]")
    steps.add_argument("--suite-jobs", type=int, default=0, metavar="N",
                       help="processes of each parallel run [min(16, CPUs)]")
    steps.add_argument("--suite-timeout", type=int, default=420, metavar="S",
                       help="each parallel run [420]")
    steps.add_argument("--serial-timeout", type=int, default=240, metavar="S",
                       help="each serial or targeted run [240]")
    steps.add_argument("--suite-sequential", action="store_true",
                       help="the runs of a phase one after another (cleaner, about twice the "
                            "time) rather than at once")
    steps.add_argument("--compare-args", default="", metavar="'ARGS'",
                       help="extra arguments of compare_numba.py (\"--expect-fail 'PATTERN'\")")
    steps.add_argument("--mlir-mode", choices=("pool", "passthrough"), default="pool")
    steps.add_argument("--mlir-timeout", type=int, default=300, metavar="S",
                       help="each of numba-cuda-mlir's two runs, at once [300]")
    steps.add_argument("--mlir-jobs", type=int, default=0, metavar="N",
                       help="pytest-xdist workers per run [half the CPUs, at most 8]")
    steps.add_argument("--mlir-tests", default="tests", metavar="'PATHS'",
                       help="what its runs run, relative to its suite's root [tests]")
    steps.add_argument("--mlir-pytest-args", default="", metavar="'ARGS'")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked and normalized (lists split, names known); UsageError if bad."""
    args = parser().parse_args(argv)
    args.only = split_names(args.only, STEP_NAMES, "step") if args.only is not None else None
    args.skip = split_names(args.skip, STEP_NAMES, "step")
    if args.budget < 60:
        raise UsageError(f"--budget {args.budget}: at least 60 seconds")
    if not 0 <= args.reserve < args.budget:
        raise UsageError(f"--reserve {args.reserve}: from 0 to less than --budget")
    args.benches = [n.strip() for n in args.benches.split(",") if n.strip()]
    missing = [n for n in args.benches if not (REPO / "benchmarks" / f"{n}.py").is_file()]
    if missing:
        raise UsageError(f"--benches: no benchmarks/{missing[0]}.py")
    args.bench_args = parse_bench_args(args.bench_args, args.benches)
    args.numba_modes = [m.strip() for m in args.numba_modes.split(",") if m.strip()]
    args.full_modes = [m.strip() for m in args.full_modes.split(",") if m.strip()]
    for mode in args.numba_modes + args.full_modes:
        parse_mode(mode)
    extra = [m for m in args.full_modes if m not in args.numba_modes]
    if extra:
        raise UsageError(f"--full-modes {extra[0]}: not one of --numba-modes")
    args.pytest_paths = [p.strip() for p in args.pytest_paths.split(",") if p.strip()]
    for name in ("pytest_args", "sanitizer_args", "cupy_args", "torch_suite_args",
                 "compare_args", "mlir_pytest_args", "suite_tests", "mlir_tests"):
        setattr(args, name, shell_words(getattr(args, name),
                                        "--" + name.replace("_", "-")))
    args.cupy_part = parse_part(args.cupy_part)
    return args


def resolve_outdir(given: Path | None) -> Path:
    path = (given or Path(os.environ.get("OUT") or REPO / "gpu-out")).resolve()
    state = outdir_state(path)
    if state == "foreign":
        raise UsageError(f"OUTDIR {path} is not empty and holds no earlier run of this runner "
                         f"(summary.txt and logs.tar.gz): refusing to clear it")
    return path


def list_steps(args: argparse.Namespace) -> str:
    why_not = chosen_steps(args.only, args.skip, args.cuda, args.results)
    rows = [f"{'step':<12s} {'needs':<40s} {'budget':>7s}  what"]
    for step in STEPS:
        seconds = step_seconds(step, args)
        state = "" if why_not[step.name] is None else f"  [{why_not[step.name]}]"
        rows.append(f"{step.name:<12s} {', '.join(step.needs) or '-':<40s} {seconds:>6}s  "
                    f"{step.what}{state}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if args.list:
            print(list_steps(args))
            return 0
        outdir = resolve_outdir(args.outdir)
    except UsageError as e:
        print(f"python3 .ci/gpu.py: {e}", file=sys.stderr)
        return 2
    if not args.dry_run:
        atexit.register(stop_all)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, stop_all)
        outdir.mkdir(parents=True, exist_ok=True)
        for entry in outdir.iterdir():  # an earlier run's (resolve_outdir checked)
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    return Runner(args, outdir, dry=args.dry_run).run()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
""".ci/gpu.py -- build, test and benchmark emmpool on a machine with an NVIDIA GPU.

    python3 .ci/gpu.py [options] [OUTDIR]      from the repository root
    python3 .ci/gpu.py --list                  the steps, what each needs, its time budget
    python3 .ci/gpu.py --dry-run [options]     the plan: each step and its commands, nothing run

Standard library only, no network: the GPU host needs Python 3.10+, pip, a C++ compiler,
CMake and the CUDA headers; bring the wheels it lacks in .whl/ (.ci/gpu-wheels).
docs/gpu-testing.md says what a run does, what it leaves in OUTDIR (logs.tar.gz, summary.txt and
at most 6 other files, OUTDIR empty or an earlier run's before) and how to read it.

The whole run keeps to a time budget, --budget seconds (570): each step's timeout is cut to
what is left (less --reserve for the comparisons and the packing), and a step is skipped, saying
so, when too little is left. A failed step does not stop the run. Steps whose needs are missing
(a GPU, a library, a test tree brought with the checkout) are skipped with the reason;
gpu_plan.py lists the steps, gpu_steps.py says what each does.

Environment variables the runner sets for what it runs (EMMCI_*, never EMMPOOL_*, which are
emmpool's own): EMMCI_BENCH_DEADLINE (a benchmark stops between rounds before its timeout),
EMMCI_BENCH_BASELINES (earlier builds to time beside this one: benchmarks/baselines.py),
EMMCI_TEST_REPORT_AT_ONCE (pytest writes each failure as it happens: tests/conftest.py).
"""

from __future__ import annotations

import argparse
import atexit
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_*.py, also when imported
from gpu_jobs import TAG, Job, describe_env, stop_all, tail, with_env  # noqa: E402
from gpu_plan import (CI, CU12_PYTEST_PATHS, DEFAULT_BENCHES, REPO,  # noqa: E402
                      SANITIZER_MARKERS, SETUP, STEP_NAMES, STEPS, Budget, Step, UsageError,
                      chosen_steps, parse_mode, step_seconds)
from gpu_steps import Steps  # noqa: E402

# pip, quiet and offline: the GPU host has no network.
PIP_ENV = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1",
           "PIP_ROOT_USER_ACTION": "ignore", "PYTHONUNBUFFERED": "1"}
LOOSE_FILES = 7  # files kept beside logs.tar.gz, read first; everything is in the tarball
LOGS_LIMIT = 16_000_000  # bytes of logs.tar.gz past which copying it back from a host gets slow


def split_names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `known`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise UsageError(f"unknown {what} {', '.join(bad)}: expected {', '.join(known)}")
    return names


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
    keep += sorted(n for n in files if n.endswith("-cupy-suite.txt")
                   or n in ("torch-suite.txt", "rmm-suite.txt", "cuda-core-suite.txt")
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

# The requirements that are a module to import (in a child, with the run's PYTHONPATH).
MODULES = {"torch": "torch", "cupy": "cupy", "numba-cuda": "numba.cuda",
           "numba-cuda-mlir": "numba_cuda_mlir", "rmm": "rmm", "cuda-core": "cuda.core"}
TOOLS = ("compute-sanitizer", "cmake")
# The requirements that are trees brought with the checkout: what shows one, how to make it.
FILES = {".cupy-tests": (".cupy-tests/tests",
                         "bash .ci/gpu-cupy-tests CUPY_CHECKOUT, then bring it"),
         ".torch-tests": (".torch-tests/test_cuda.py",
                          "bash .ci/gpu-torch-tests PYTORCH_CHECKOUT, then bring it"),
         ".rmm-tests": (".rmm-tests/tests", "bash .ci/gpu-rmm-tests RMM_CHECKOUT, then bring it"),
         ".cuda-core-tests": (".cuda-core-tests/cuda_core/tests",
                              "bash .ci/gpu-cuda-core-tests CUDA_PYTHON_CHECKOUT, then bring it"),
         ".baseline": (".baseline/*/pyproject.toml", "bash .ci/gpu-baseline REV NAME"),
         "mlir-tests": (".whl/numba-cuda-mlir-tests-*.tar.gz", "bash .ci/gpu-wheels mlir")}


# ---- the run ---------------------------------------------------------------------------------
class Runner(Steps):
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
            why = self._fails(GPU_PROBE, timeout=120)
            return why and f"no GPU: {why}"
        if need == "cupy" and self.args.cuda == "12":
            # The host's cupy-cuda13x imports too, and would run on CUDA 13: not this run's
            site = os.path.realpath(self.args.site + "-cu12") + os.sep
            why = self._fails(f"import cupy, os, sys; f = os.path.realpath(cupy.__file__); "
                              f"sys.exit(None if f.startswith({site!r}) else f'the CUDA 12 site "
                              f"has no cupy-cuda12x (bash .ci/gpu-wheels cu12-cupy): cupy is "
                              f"{{f}}')")
            return why and why[:200]
        if need in MODULES:
            why = self._fails(f"import {MODULES[need]}")
            return why and f"{MODULES[need]} does not import ({why[:160]})"
        if need in TOOLS:
            return None if shutil.which(need) else f"no {need} on PATH"
        if need in FILES:
            pattern, how = FILES[need]
            return None if glob.glob(str(REPO / pattern)) else f"no {pattern} ({how})"
        if need == "benchmarks":
            return None if any(self.why_not[s] is None for s in ("bench", "bench-core")) \
                else "no benchmark step chosen"
        raise AssertionError(need)

    def child(self, code: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """`code` run by a child Python with the run's environment, from the scratch folder."""
        return subprocess.run(self.python("-c", code), capture_output=True, text=True,
                              timeout=timeout, cwd=self.work, env=self.env)

    def _fails(self, code: str, timeout: float = 300) -> str | None:
        """None where `code` runs (self.child); else the last line it wrote to stderr."""
        p = self.child(code, timeout)
        return None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["?"])[-1]

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
                      f"{step_seconds(step, self.args)}s"))
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

    def grant(self, want: float, minimum: float = 20) -> int:
        """Seconds for work that wants `want` (0: too few are left); in a dry run, all of it."""
        return int(want) if self.dry else self.budget.grant(want, minimum)

    def timed(self, step: Step, want: float | None = None, minimum: float = 20) -> int:
        """The step's seconds (0: skipped, recorded so)."""
        seconds = self.grant(step_seconds(step, self.args) if want is None else want, minimum)
        if seconds == 0:
            self.record(step.name, "-", 0, f"skipped (budget: {int(self.budget.left())}s left)")
        return seconds

    def finish(self, name: str, rc: int, t: float, log: Path | None = None, note: str = "",
               show: int = 15) -> None:
        """The line in summary.txt of work started at `t`, and where it failed the last `show`
        lines of its log; nothing in a dry run."""
        if self.dry:
            return
        self.record(name, rc, time.monotonic() - t, note)
        if rc != 0 and log is not None and show:
            print("\n".join(tail(log, show)))

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
        suites = [*sorted(self.outdir.glob("*cupy-suite*.txt")),
                  *(self.outdir / n for n in ("torch-suite.txt", "rmm-suite.txt",
                                              "cuda-core-suite.txt"))]
        for path, title, lines in [*((p, f"{p.name} (head)", 30) for p in suites),
                                   (self.outdir / "bench_numba.md", "bench_numba.md", 40)]:
            if path.is_file():
                print(f"==== {title} ====")
                print("\n".join(line[:240] for line in
                                path.read_text(errors="replace").splitlines()[:lines]))
        print("\n".join(diag))
        if self.why_not["results"] is None:
            print("==== .ci/gpu-results ====", flush=True)
            subprocess.run([sys.executable, str(CI / "gpu-results"), str(self.outdir)])
        print(f"==== OUTDIR: {' '.join(sorted(p.name for p in self.outdir.iterdir()))}")
        print("==== summary.txt ====")
        print((self.outdir / "summary.txt").read_text(), end="", flush=True)
        shutil.rmtree(self.work, ignore_errors=True)


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
    steps.add_argument("--cupy-part", metavar="K/N",
                       help="run part K of N of CuPy's selection (merge the parts with "
                            "python3 .ci/cupy_suite.py --merge OUTDIR ...)")
    steps.add_argument("--cupy-timeout", type=int, default=360, metavar="S",
                       help="both runs of CuPy's suite, at once [360]")
    steps.add_argument("--torch-suite-timeout", type=int, default=480, metavar="S",
                       help="both runs of test_cuda.py, in turn [480]")
    steps.add_argument("--rmm-suite-timeout", type=int, default=300, metavar="S",
                       help="both runs of RMM's tests, in turn [300]")
    steps.add_argument("--cuda-core-suite-timeout", type=int, default=300, metavar="S",
                       help="both runs of cuda.core's tests, in turn [300]")
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
    steps.add_argument("--suite-jobs", type=int, default=0, metavar="N",
                       help="processes of each parallel run [min(16, CPUs)]")
    steps.add_argument("--suite-timeout", type=int, default=420, metavar="S",
                       help="each parallel run [420]")
    steps.add_argument("--serial-timeout", type=int, default=240, metavar="S",
                       help="each serial or targeted run [240]")
    steps.add_argument("--suite-sequential", action="store_true",
                       help="the runs of a phase one after another (cleaner, about twice the "
                            "time) rather than at once")
    steps.add_argument("--mlir-timeout", type=int, default=300, metavar="S",
                       help="each of numba-cuda-mlir's two runs, at once [300]")
    steps.add_argument("--mlir-jobs", type=int, default=0, metavar="N",
                       help="pytest-xdist workers per run [half the CPUs, at most 8]")
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
    for name in ("pytest_args", "sanitizer_args"):
        setattr(args, name, shell_words(getattr(args, name), "--" + name.replace("_", "-")))
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
    rows = [f"{'step':<15s} {'needs':<42s} {'budget':>7s}  what"]
    for step in STEPS:
        seconds = step_seconds(step, args)
        state = "" if why_not[step.name] is None else f"  [{why_not[step.name]}]"
        rows.append(f"{step.name:<15s} {', '.join(step.needs) or '-':<42s} {seconds:>6}s  "
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

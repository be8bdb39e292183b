"""What each step of .ci/gpu.py does (gpu_plan.py lists them): the methods step_<name> of the
runner, which gives them its budget, its logs and summary.txt, its environment and its commands
(or, in a dry run, the printing of them)."""

from __future__ import annotations

import datetime
import os
import re
import shlex
import shutil
import socket
import subprocess
import tarfile
import time
from pathlib import Path

from gpu_jobs import extract, first_match, pytest_line, suite_note, tail, wait_all, with_env
from gpu_plan import CI, CU12_CUPY_SUBSET, CU12_PYTEST_PATHS, REPO, SERIAL_TESTS, TARGETED_TESTS, \
    Step, mode_file_name, parse_mode, step_seconds

# pip building a source tree here: no network, so no isolated build environment either.
PIP_BUILD = ("-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "--no-index")

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


class Steps:
    """The steps, mixed into the runner (.ci/gpu.py's Runner): each returns its exit status, or
    "-" when it was skipped."""

    # -- helpers --
    def command(self, step: Step, argv: list[str], *, note=lambda log: "", show: int = 15,
                minimum: float = 20, cwd: Path | None = None, env: dict | None = None,
                log: Path | None = None) -> int | str:
        """A step that is one command, logged to logs/<step>.txt: its seconds from the budget,
        its line in summary.txt (`note(log)` says what matters), and its log's last `show`
        lines printed where it failed."""
        seconds = self.timed(step, minimum=minimum)
        if not seconds:
            return "-"
        t, log = time.monotonic(), log or self.logs / f"{step.name}.txt"
        rc = self.sh(argv, log, seconds, cwd=cwd, env=env)
        self.finish(step.name, rc, t, log, "" if self.dry else note(log), show)
        return rc

    def cmake(self, src: Path, build: Path, log: Path, seconds: float, append: bool) -> int:
        """bench_core of the tree `src`, built in `build` (no Python extension)."""
        rc = self.sh(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja",
                      "-DCMAKE_BUILD_TYPE=Release", "-DEMMPOOL_BUILD_PYTHON=OFF",
                      "-DEMMPOOL_BUILD_BENCHMARKS=ON"], log, seconds, append=append)
        return rc or self.sh(["cmake", "--build", str(build)], log, seconds, append=True)

    def prepend_path(self, *dirs: str) -> None:
        """Put `dirs` first on the PYTHONPATH of every later command."""
        self.env["PYTHONPATH"] = os.pathsep.join([*dirs, *filter(None, [self.env.get(
            "PYTHONPATH")])])

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
                # Loaded first by every Python process of the run: the CUDA 12 libraries
                # brought, which cuda-pathfinder would otherwise find in the host's CUDA 13
                # wheels first.
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
            self.prepend_path(*sites)
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
        for title, argv, kept in (  # kept: the lines of its output that say what matters
                ("nvidia-smi -L", ["nvidia-smi", "-L"], slice(None)),
                (None, ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used",
                        "--format=csv"], slice(None)),
                ("nvcc", ["nvcc", "--version"], slice(-2, None)),
                ("cmake", ["cmake", "--version"], slice(1))):
            with open(log, "a") as f:
                if title:
                    f.write(f"## {title}\n")
                try:
                    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
                    out = (p.stdout + p.stderr).splitlines()[kept]
                except (OSError, subprocess.TimeoutExpired) as e:
                    out = [f"{argv[0]}: {e}"]
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

    def step_cuda12(self, step: Step) -> int | str:
        return self.command(
            step, self.python(str(CI / "cu12_check.py"), "--site", self.args.site + "-cu12"),
            minimum=1, cwd=self.work, show=25,
            note=lambda log: first_match(log, r"^CUDA 12 stack:", last=True)[:200]
            or "see logs/cuda12.txt")

    def step_build(self, step: Step) -> int:
        t, log = time.monotonic(), self.logs / "build.txt"
        pip = self.python(*PIP_BUILD)
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
                self.prepend_path("/tmp/emmpool-site")
        if self.dry:
            return 0
        if rc != 0:
            self.record(step.name, rc, time.monotonic() - t, "see logs/build.txt")
            return rc
        p = self.child("import emmpool, emmpool.plugin; print(emmpool.__file__)")
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
        return self.command(step, self.python(
            "-c", "import emmpool._torch as t, torch; m = t.build_extension(verbose=True); "
            "print('torch', torch.__version__, 'extension', m.__file__)"),
            cwd=self.work, note=lambda log: " ".join(tail(log, 1))[:120])

    def step_baselines(self, step: Step) -> int:
        names = []
        for project in sorted(REPO.glob(".baseline/*/pyproject.toml")):
            src, name = project.parent, project.parent.name
            seconds = self.grant(step_seconds(step, self.args), 60)
            if not seconds:
                self.record(f"baseline-{name}", "-", 0, "skipped (budget)")
                continue
            t, log = time.monotonic(), self.logs / f"baseline-{name}.txt"
            site, bench = self.work / f"baseline-{name}", self.work / f"baseline-{name}-bench"
            rc = self.sh(self.python(*PIP_BUILD, "--target", str(site), str(src)), log, seconds)
            rc = rc or self.cmake(src, bench, log, seconds, append=True)
            rev = (src / "BASELINE_REV").read_text()[:12] if (src / "BASELINE_REV").exists() \
                else ""
            self.finish(f"baseline-{name}", rc, t, log, rev)
            if rc == 0:
                names.append(f"{name}={site}")
                self.baselines.append((name, bench))
        if names:
            self.env["EMMCI_BENCH_BASELINES"] = " ".join(names)
        return 0

    def step_pytest(self, step: Step) -> int | str:
        paths = self.args.pytest_paths or ("tests",)
        if self.args.cuda == "12" and not self.args.pytest_paths:
            rmm = any((REPO / ".whl/cu12").glob("rmm_cu12-*"))
            paths = [p for p in CU12_PYTEST_PATHS if rmm or "rmm" not in p]
        cwd = self.work / "pytest"
        if not self.dry:
            cwd.mkdir(exist_ok=True)
        # Each test's name and seconds as it ends (-v, "times") and each failure's report as it
        # happens (tests/conftest.py): a run cut short by its timeout still says what ran, what
        # failed and where the time went (--durations prints only at a run's end)
        return self.command(
            step, self.python("-m", "pytest", "-ra", "-p", "no:cacheprovider", "--durations=20",
                              "-v", "-o", "console_output_style=times",
                              "--rootdir", str(REPO), *self.args.pytest_args,
                              *(str(REPO / p) for p in paths)),
            cwd=cwd, env=dict(self.env, EMMCI_TEST_REPORT_AT_ONCE="1"), note=pytest_line, show=0)

    def step_sanitizer(self, step: Step) -> int | str:
        cwd, memlogs = self.work / "sanitizer", self.logs / "sanitizer"
        if not self.dry:
            cwd.mkdir(exist_ok=True)
            memlogs.mkdir(exist_ok=True)

        def note(log: Path) -> str:
            texts = [p.read_text(errors="replace") for p in memlogs.glob("memcheck.*.log")]
            found = [int(n) for text in texts for n in re.findall(r"ERROR SUMMARY: (\d+)", text)]
            return (f"memcheck: {len(found)} processes, {sum(found)} errors; "
                    + pytest_line(log))

        # Every process is instrumented (the tests run scenarios in child interpreters); one
        # with a memory error exits 86, failing its test. API errors are not reported: the tests
        # provoke out-of-memory on purpose, the pool asks the driver about pointers a reset may
        # have invalidated, and cuda-bindings probes entry points.
        return self.command(
            step, ["compute-sanitizer", "--tool", "memcheck", "--report-api-errors", "no",
                   "--target-processes", "all", "--error-exitcode", "86",
                   "--log-file", str(memlogs / "memcheck.%p.log"),
                   *self.python("-m", "pytest", "-ra", "-p", "no:cacheprovider", "--rootdir",
                                str(REPO), *self.args.sanitizer_args, str(REPO / "tests"))],
            cwd=cwd, log=self.logs / "sanitizer-pytest.txt", note=note, show=0)

    def suite_script(self, step: Step, script: str, extra: list[str]) -> int | str:
        """.ci/cupy_suite.py, .ci/torch_suite.py or .ci/peer_suite.py: its report into OUTDIR."""
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
        self.finish(step.name, rc, t, note=first_match(
            log, r"^(NOT RUN|NO TESTS RAN|REGRESSIONS)")[:90])
        return rc

    def step_cupy_suite(self, step: Step) -> int | str:
        extra = ["--tests", str(REPO / ".cupy-tests"), "--jobs", str(self.jobs)]
        if self.args.cupy_part:
            extra += ["--part", "{}/{}".format(*self.args.cupy_part)]
        if self.args.cuda == "12":
            extra += ["--subset", *CU12_CUPY_SUBSET]
        return self.suite_script(step, "cupy_suite.py", extra)

    def step_torch_suite(self, step: Step) -> int | str:
        # its two runs take turns: some tests take half the GPU's memory
        return self.suite_script(step, "torch_suite.py", ["--tests", str(REPO / ".torch-tests")])

    def step_rmm_suite(self, step: Step) -> int | str:
        return self.suite_script(step, "peer_suite.py",
                                 ["--peer", "rmm", "--tests", str(REPO / ".rmm-tests")])

    def step_cuda_core_suite(self, step: Step) -> int | str:
        return self.suite_script(step, "peer_suite.py",
                                 ["--peer", "cuda-core", "--tests", str(REPO / ".cuda-core-tests")])

    def step_bench_core(self, step: Step) -> int | str:
        seconds = self.timed(step, minimum=60)
        if not seconds:
            return "-"
        t, log, build = time.monotonic(), self.logs / "bench-core.txt", self.work / "bench-build"
        build_log = self.logs / "bench-core-build.txt"
        rc = self.cmake(REPO, build, build_log, seconds, append=False)
        if rc != 0:
            self.finish(step.name, rc, t, build_log, "see logs/bench-core-build.txt")
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
        # Each earlier build taking turns with this one, round by round (instructions.py)
        for name, tree in self.baselines:
            rc = self.sh(pin + self.python(
                str(REPO / "benchmarks/instructions.py"), str(binary),
                str(tree / "benchmarks" / "bench_core"), "--timed", "30"), log, 300,
                append=True) or rc
        self.finish(step.name, rc, t)
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
        self.finish(step.name, rc, t, log, show=20)
        return rc

    def step_bench(self, step: Step) -> int:
        worst = 0
        for name in self.args.benches:
            seconds = self.grant(self.args.bench_timeout)
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
            self.finish(f"bench-{name}", rc, t, log)
            worst = worst or rc
        return worst

    # -- Numba's suite --
    def step_numba_suite(self, step: Step) -> int | str:
        modes = self.args.numba_modes
        full = [m for m in modes if m in self.args.full_modes]
        targeted = [m for m in modes if m not in self.args.full_modes]
        cwd_root = self.work / "numba-suite"
        serial = ["-v", *SERIAL_TESTS]

        def run(name: str, mode: str, seconds: int, argv: list[str]):
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
            if not self.grant(want, minimum):
                return False
            jobs = [run(name, mode, self.grant(want, minimum), argv) for name, mode, argv in runs]
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
            parallel = ["-m", str(self.jobs), "-v", "numba.cuda.tests"]
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
            "EMMPOOL_MODE"] or mode, "--label", label, "--all",
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
        t, logs, mode = time.monotonic(), self.logs / "mlir", "pool"
        suite = self.work / "mlir-suite"
        tarball = self.mlir_tarball()
        version = "?"
        if not self.dry:
            logs.mkdir(exist_ok=True)
            suite.mkdir(exist_ok=True)
            extract(tarball, suite)
            version = self.child("import numba_cuda_mlir as m; print(m.__version__)").stdout.strip()
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
            self.finish(step.name, 2, t, check,
                        "manager check failed: see logs/mlir/manager-check.txt", show=20)
            return 2
        # As the package's CI runs its suite, but: -o addopts= drops its reruns of failed tests
        # (a rerun could hide a failure the plugin causes), and a module that fails to import
        # is reported while the rest still run.
        jobs = self.args.mlir_jobs or max(1, min(8, (os.cpu_count() or 2) // 2))
        argv = self.python("-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts=",
                           "-rfE", "-W", "ignore::UserWarning", "--continue-on-collection-errors",
                           "-n", str(jobs), "--dist", "loadscope", "--ignore=tests/benchmarks",
                           "--ignore=tests/doc_examples", "--ignore=tests/test_symbol_isolation.py",
                           "tests")
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

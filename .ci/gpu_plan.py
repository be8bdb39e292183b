"""The steps of .ci/gpu.py, which of them a run takes, what each needs and the seconds it may
have: the plan of a run, before anything runs."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
CI = REPO / ".ci"

DEFAULT_BENCHES = ("bench_numba", "bench_cuda_core", "bench_rmm", "bench_pinned", "replay",
                   "bench_shared", "bench_torch_train", "bench_torch_compile", "torch_training",
                   "torch_ddp", "growable_steps")
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
    Step("rmm-suite", ("build", "gpu", "rmm", ".rmm-tests"), "rmm_suite_timeout",
         "RMM's own tests, its default resource vs emmpool's, compared by name "
         "(.ci/peer_suite.py --peer rmm)", cuda=("13",)),
    Step("cuda-core-suite", ("build", "gpu", "cuda-core", ".cuda-core-tests"),
         "cuda_core_suite_timeout", "cuda.core's own tests, its default memory resource vs "
         "emmpool's, compared by name (.ci/peer_suite.py --peer cuda-core)", cuda=("13",)),
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
         "(.ci/gpu-results; with --results)"),
)
STEP_NAMES = tuple(s.name for s in STEPS)
SETUP = tuple(s.name for s in STEPS if s.setup)


def step_seconds(step: Step, args: argparse.Namespace) -> int:
    return sum(int(part) if part.isdigit() else int(getattr(args, part))
               for part in step.budget.split("+"))


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

"""Programs that mix GPU libraries, with one pool (emmpool) against each library's own pool and
against the bridges people use to share one: how much device memory each needs, how large a
problem fits in a given amount of memory, and what each costs in time.

    python benchmarks/mixed_programs.py --out DIR [--programs a,b,c] [--setups NAME ...]
        [--rounds 3] [--budget-gib 8] [--skip-capacity | --capacity-only] [--devices 0,1]
    python benchmarks/mixed_programs.py --out DIR --quick           # a smoke test
    python benchmarks/mixed_programs.py --merge A.json B.json --out DIR

Programs (mixed_workloads.py; each has one integer scale that its memory grows with, about
linearly, and batches of 0.6, 1.0, 0.35 and 0.8 times the scale's in turn):

- a ``cupy_torch``: a CuPy phase of large temporaries (batched matmul and solve, FFT), then a
  PyTorch MLP's forward, backward and AdamW step on its output (DLPack), repeated;
- b ``numba_cupy_torch``: CuPy preprocessing and Numba kernels (arrays from Numba's allocator,
  launched on CuPy arrays) of variable-size batches feeding a PyTorch training step;
- c ``rapids``: tables in rmm.DeviceBuffers (what cuDF and distributed allocate), a Numba UDF
  over them, CuPy's sort, gather and group-by, buffers freed and allocated again.

Setups, each installed before any library's first CUDA allocation:

- ``separate``: each library's own: CuPy's MemoryPool, PyTorch's caching allocator, Numba's
  manager (cuMemAlloc per array), RMM's default resource (cudaMalloc per buffer);
- ``separate-expandable``: the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  (checked in PyTorch's snapshot; not run where the program has no PyTorch);
- ``rmm-pool``: RMM everywhere over RMM's PoolMemoryResource: CuPy through
  ``rmm.allocators.cupy.rmm_cupy_allocator`` (a Python call per allocation), Numba through
  ``rmm.allocators.numba.RMMNumbaManager``, PyTorch through
  ``rmm.allocators.torch.rmm_torch_allocator`` (a CUDAPluggableAllocator over RMM's current
  resource). The pool starts empty (``--rmm-initial-pool``, 0) with no maximum, and grows by the
  larger of the request and its size: RMM's default initial size, half the free memory, would
  make its peak that half whatever the program needs;
- ``rmm-async``: the same over RMM's CudaAsyncMemoryResource (the driver's stream-ordered pool;
  RMM keeps what it reserved: its release threshold is the largest value);
- ``torch-under-cupy``: CuPy allocating from PyTorch's caching allocator
  (``cupy.cuda.memory.PythonFunctionAllocator`` over ``torch.cuda.caching_allocator_alloc`` /
  ``caching_allocator_delete``, as pytorch-pfn-extras' ``use_torch_mempool_in_cupy``); Numba and
  RMM keep their own (no standard bridge puts Numba on PyTorch's pool);
- ``emmpool`` (EMMPOOL_SEGMENTS=fixed) and ``emmpool-growable`` (EMMPOOL_SEGMENTS=growable):
  ``emmpool.use_for_numba()``, ``use_for_cupy()``, ``use_for_torch()`` and
  ``rmm.mr.set_current_device_resource(emmpool.rmm_resource())``, for the libraries used.

Measured per program and setup:

- peak GPU memory of the process: NVML's per-process used memory
  (nvmlDeviceGetComputeRunningProcesses) where NVML reports the child's pid, else the device's
  used memory above its value before the child started (the results say which); sampled by a
  thread of this process every ``--sample-ms`` (2) ms, contexts, library handles and kernels'
  code included; the largest over the rounds;
- the allocators' own peak reserved, summed over the libraries that cache: CuPy's pool
  (total_bytes, read after every step: CuPy keeps no peak), PyTorch's max_memory_reserved (which
  holds CuPy's blocks too under torch-under-cupy), RMM's pool size, the high-water mark of the
  CUDA pool behind RMM's async resource, emmpool's peak_bytes_reserved (every library). Numba's
  own manager and RMM's default resource cache nothing and are not counted;
- time per step: each child warms up (``--warmup-cycles``: every kernel compiled or loaded, the
  pools filled) and then times ``--cycles`` cycles of steps, one device synchronization per
  step; a round's figure is the median over its cycles of a cycle's time per step; the table
  gives the median and the best of the rounds, each against the fastest setup's;
- the largest scale that completes when only B bytes (``--budget-gib``) of the device are left
  to the program: a probe child makes the CUDA context, then one driver allocation of all free
  memory but B (the same for every setup: B is what the program, its libraries' handles and
  kernels included, may use beyond the context), then installs the setup and runs one cycle of
  steps at the probed scale. Every library's out-of-memory error is an "oom"; any other failure
  is an error, which stops the search and is never taken for a fit. The search starts where the
  timing run's peak predicts, grows by ``--grow`` until a probe fails, then bisects, at most
  ``--probes`` probes a setup; its resolution is reported;
- a check: every step's value (a loss, or for program c sums over the shuffled columns) is
  compared with the first setup's (separate's, where it ran), relative difference at most
  1e-4.

Why a child per (program, setup, round): an allocator is fixed per process, and rounds run the
setups in turn (round 1: every setup, round 2: every setup, ...), so that a drift of the host's
speed over the minutes of the run falls on every setup alike; each round starts at another
setup. The children start from a zygote (``--start fork``, the default): a process that imports
the libraries once (seconds for every child otherwise; the JSON says how long) and never
initializes CUDA,
forking one child per job, so that each child starts with no CUDA state, as a fresh interpreter
does; where an import initialized CUDA or started a thread, forking would be unsafe and the
children are started as ``python mixed_programs.py --child JOB`` instead (``--start exec``
always does that). Capacity searches of several setups run at once on ``--devices`` (one search
per GPU of the same kind); timing uses the first device only.

Writes DIR/mixed_programs.json (every round and probe, each setup's memory over time in its
first round, the environment),
DIR/mixed_programs.md (the tables, also printed) and DIR/mixed_programs_<program>.png (used
memory over time, one line per setup; where matplotlib is installed). ``--merge`` writes the
same from the JSON of one or several runs (say, the timing and the capacity halves of the
matrix), pictures included, on any machine.
Exit status 1 where a check differs, PyTorch's segments were not expandable under
separate-expandable, an emmpool setup failed, or the run stopped early (SIGTERM, an error: what
ran is written all the same).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cpus  # noqa: E402
import mixed_workloads as work  # noqa: E402  (imports no GPU library)

GiB = 1 << 30
MiB = 1 << 20
CHECK_TOLERANCE = 1e-4
GOAL_PEAK = 0.8         # emmpool's peak at most this times the separate pools'
GOAL_CAPACITY = 1.25    # its largest scale in B at least this times theirs
GOAL_TIME = 1.02        # its time per step at most this times the fastest setup's
NAME = "mixed_programs"

# ---------------------------------------------------------------------------------------------
# Options


def parse_size(text: str) -> int:
    """Bytes from '0', '1073741824', '512MiB', '1.5GiB', '2GB'; ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with KiB, MiB, GiB)")
    units = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
    return int(float(m[1]) * units[(m[2] or "b").lower()])


def _split(values) -> list:
    out = []
    for v in values or []:
        out += [x for x in v.split(",") if x.strip()]
    return [x.strip() for x in out]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="output directory")
    p.add_argument("--programs", default="a,b,c",
                   help="programs, by letter or name, comma-separated [a,b,c]")
    p.add_argument("--setups", nargs="+", default=None,
                   help=f"setups (space- or comma-separated) [{' '.join(work.SETUPS)}]")
    p.add_argument("--scales", default="",
                   help="timing scale per program, e.g. a=16,c=8 [each program's own]")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds [3; --quick 1]")
    p.add_argument("--cycles", type=int, default=None,
                   help=f"timed cycles of {work.STEPS_PER_CYCLE} steps per child [8; --quick 2]")
    p.add_argument("--warmup-cycles", type=int, default=1,
                   help="untimed cycles first in each timing child [1]")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="B: GiB of the device left to a capacity probe [8; --quick 2]")
    p.add_argument("--probes", type=int, default=None,
                   help="capacity probes per setup at most [5; --quick 3]")
    p.add_argument("--grow", type=float, default=1.25,
                   help="capacity search: factor between probes until one fails [1.25]")
    p.add_argument("--resolution", type=float, default=0.03,
                   help="capacity search: stop once the bracket is this fraction wide [0.03]")
    p.add_argument("--skip-capacity", action="store_true", help="no capacity searches")
    p.add_argument("--capacity-only", action="store_true", help="capacity searches only")
    p.add_argument("--timing-from", type=Path,
                   help="an earlier run's JSON whose peaks tell the capacity searches where to "
                        "start (with --capacity-only)")
    p.add_argument("--devices", default="0",
                   help="GPUs by NVML index (PCI bus order), comma-separated: timing on the "
                        "first, capacity searches spread over all [0]")
    p.add_argument("--start", choices=("fork", "exec"), default="fork",
                   help="children forked from a zygote that imported the libraries, or each a "
                        "fresh interpreter [fork]")
    p.add_argument("--rmm-initial-pool", default="0",
                   help="rmm-pool's initial pool size [0: it grows from empty]")
    p.add_argument("--sample-ms", type=float, default=2.0,
                   help="NVML sampling period in milliseconds [2]")
    p.add_argument("--cpus", type=int, default=8,
                   help="pin to this many CPUs near the GPU (cpus.py); 0: no pinning [8]")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the unreported warm-up children (CuPy's kernel cache on disk, "
                        "Numba's cache, emmpool's PyTorch extension)")
    p.add_argument("--time-limit", type=float,
                   help="seconds the run may take: no round or probe starts that would end "
                        "past it [EMMPOOL_BENCH_DEADLINE, else none]")
    p.add_argument("--child-timeout", type=float, default=240.0,
                   help="seconds a timing child or probe may take [240]")
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: scale 1, one round, 2 cycles, B = 2 GiB, 3 probes")
    p.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                   help="merge these runs' mixed_programs.json into --out instead of running")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child or args.zygote:
        return args
    if args.out is None:
        p.error("--out DIR is required")
    try:
        _complete(args)
    except ValueError as e:
        p.error(str(e))
    return args


def _complete(args) -> None:
    """Check the options and fill in what --quick and the defaults say; ValueError saying what
    is wrong."""
    if args.merge:
        return
    args.programs = list(dict.fromkeys(work.program_named(x) for x in _split([args.programs])))
    setups = _split(args.setups) if args.setups else list(work.SETUPS)
    for s in setups:
        if s not in work.SETUPS:
            raise ValueError(f"unknown setup {s!r}: one of {', '.join(work.SETUPS)}")
    args.setups = list(dict.fromkeys(setups))
    scales = {}
    for item in _split([args.scales]):
        name, _, value = item.partition("=")
        try:
            scale = int(value)
        except ValueError:
            scale = 0
        if scale < 1:
            raise ValueError(f"--scales {item!r}: PROGRAM=SCALE, SCALE an integer >= 1")
        scales[work.program_named(name)] = scale
    quick = args.quick
    args.scales = {p: scales.get(p, work.PROGRAMS[p].quick_scale if quick
                                 else work.PROGRAMS[p].timing_scale) for p in args.programs}
    args.rounds = args.rounds if args.rounds is not None else (1 if quick else 3)
    args.cycles = args.cycles if args.cycles is not None else (2 if quick else 8)
    args.probes = args.probes if args.probes is not None else (3 if quick else 5)
    budget = args.budget_gib if args.budget_gib is not None else (2.0 if quick else 8.0)
    args.budget = int(budget * GiB)
    if args.rounds < 1 or args.cycles < 1 or args.warmup_cycles < 0 or args.probes < 1:
        raise ValueError("--rounds, --cycles and --probes must be at least 1, "
                         "--warmup-cycles at least 0")
    if args.budget <= 0:
        raise ValueError("--budget-gib must be more than 0")
    if args.grow <= 1.0:
        raise ValueError("--grow must be more than 1")
    if not 0 < args.resolution < 1:
        raise ValueError("--resolution must be between 0 and 1")
    if args.skip_capacity and args.capacity_only:
        raise ValueError("--skip-capacity and --capacity-only exclude each other")
    if args.sample_ms <= 0:
        raise ValueError("--sample-ms must be more than 0")
    args.rmm_initial_pool = parse_size(args.rmm_initial_pool)
    try:
        args.devices = [int(d) for d in _split([args.devices])]
    except ValueError:
        raise ValueError(f"--devices {args.devices!r}: NVML indices, e.g. 0 or 0,1") from None
    if not args.devices or min(args.devices) < 0:
        raise ValueError("--devices: at least one NVML index >= 0")


# ---------------------------------------------------------------------------------------------
# The capacity search (pure: `probe(scale)` runs a child)


def search_capacity(probe, start: int, *, grow: float = 1.25, max_probes: int = 6,
                    resolution: float = 0.03, out_of_time=None) -> dict:
    """The largest integer scale >= 1 for which probe(scale) says 'ok', assuming that every
    smaller scale fits where one fits and every larger one fails where one fails ('oom').

    From `start`: up by `grow` until a probe fails (or down by it until one fits), then
    bisection, until the bracket (largest fit, smallest failure) is at most `resolution` of the
    fit wide, or one scale, or `max_probes` probes were made. Any outcome but 'ok' and 'oom' (an
    error) stops the search: it is not a fit, and not known to be a lack of memory either.
    `out_of_time()`, asked before each probe, stops it too. Returns largest (0: no scale fits),
    smallest_failing (None: none failed), resolution ((smallest failing - largest) / largest,
    None where unbracketed), probes [[scale, outcome], ...] and stopped (why it ended early, or
    None)."""
    lo, hi = 0, None
    probes: list = []
    stopped = None
    scale = max(1, int(start))
    while True:
        if len(probes) >= max_probes:
            bracketed = hi is not None and lo > 0 and hi - lo <= max(1, resolution * lo)
            if not bracketed:
                stopped = f"{max_probes} probes made"
            break
        if out_of_time is not None and out_of_time():
            stopped = "the run's time limit"
            break
        outcome = probe(scale)
        probes.append([scale, outcome])
        if outcome == "ok":
            lo = scale
        elif outcome == "oom":
            hi = scale
        else:
            stopped = f"{outcome} at scale {scale}"
            break
        if hi is None:                          # nothing failed yet: grow
            scale = max(lo + 1, math.ceil(lo * grow))
        elif lo == 0:                           # nothing fit yet: shrink
            if hi == 1:
                break
            scale = max(1, min(hi - 1, math.floor(hi / grow)))
        elif hi - lo <= max(1, resolution * lo):
            break
        else:
            scale = (lo + hi) // 2
    return {"largest": lo, "smallest_failing": hi,
            "resolution": (hi - lo) / lo if lo and hi is not None else None,
            "probes": probes, "stopped": stopped}


def predict_start(budget: int, timing: dict | None, bytes_per_scale: int) -> int:
    """Where a capacity search starts: the scale whose memory the timing run's peak, taken as
    proportional to the scale beyond the CUDA context, puts at 95% of the budget; without a
    timing run, the program's own guess of bytes per unit of scale."""
    if timing and timing.get("peak") and timing.get("scale"):
        used = timing["peak"] - (timing.get("context") or 0)
        if used > 0:
            return max(1, math.floor(0.95 * timing["scale"] * budget / used))
    return max(1, budget // bytes_per_scale)


# ---------------------------------------------------------------------------------------------
# NVML


class Gpu:
    """One GPU seen through NVML (never through CUDA: this process makes no context)."""

    def __init__(self, index: int):
        try:
            import pynvml
        except ImportError:
            raise SystemExit(f"{NAME} measures memory through NVML: pip install nvidia-ml-py "
                             "(on a host without network, carry its wheel)") from None
        self.nvml = pynvml
        pynvml.nvmlInit()
        self.index = index
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.name = _text(pynvml.nvmlDeviceGetName(self.handle))
        self.uuid = _text(pynvml.nvmlDeviceGetUUID(self.handle))
        self.total = int(pynvml.nvmlDeviceGetMemoryInfo(self.handle).total)
        self.driver = _text(pynvml.nvmlSystemGetDriverVersion())

    def used(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def process_used(self, pid: int) -> int | None:
        """NVML's used memory of process `pid` on this GPU; None where NVML does not list it
        (another PID namespace, say) or says nothing."""
        for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if p.pid == pid:
                value = p.usedGpuMemory
                return int(value) if value is not None else None
        return None

    def settle(self, idle: int, timeout: float = 15.0) -> int:
        """Wait until the used memory is back near `idle` (an exited child's memory goes back
        shortly after it exits); return it."""
        end = time.monotonic() + timeout
        while True:
            used = self.used()
            if used <= idle + 64 * MiB or time.monotonic() > end:
                return used
            time.sleep(0.05)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class MemorySampler:
    """The GPU's used memory, and the child's where NVML tells it, every `period` seconds from
    a thread, while a child runs."""

    BIN = 0.02    # the timeline keeps the largest sample of every 20 ms

    def __init__(self, gpu: Gpu, period: float):
        self.gpu, self.period = gpu, period
        self.baseline = gpu.used()
        self.pid = None
        self.per_process = True
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            process = None
            if self.pid is not None and self.per_process:
                try:
                    process = self.gpu.process_used(self.pid)
                except Exception:  # noqa: BLE001 - NVML without per-process figures here
                    self.per_process = False
            self.samples.append((time.time(), self.gpu.used(), process))

    def stop(self) -> dict:
        """Stop and summarize: peaks (device: above the baseline; process: NVML's own) and a
        timeline of the figure used (process where NVML reported the child, else device)."""
        self._stop.set()
        self._thread.join()
        return summarize_samples(self.samples, self.baseline, self.BIN)


def summarize_samples(samples: list, baseline: int, bin_s: float = 0.02) -> dict:
    """Peaks and the binned timeline [[time, device bytes above the baseline, process bytes or
    None], ...] (each bin's largest) of (time, device used, process used or None) samples. The
    process figure is the one quoted where NVML reported the child in every child of the table
    (program_table decides), else the device's."""
    if not samples:
        return {"source": None, "peak": None, "samples": 0}
    device_peak = max(s[1] for s in samples) - baseline
    reported = [s[2] for s in samples if s[2] is not None]
    timeline: list = []
    bin_ms = max(1, round(bin_s * 1000))
    for t_abs, device, process in samples:
        t = (round(t_abs * 1000) // bin_ms) * bin_ms / 1000
        device = max(device - baseline, 0)
        if timeline and timeline[-1][0] == t:
            last = timeline[-1]
            last[1] = max(last[1], device)
            if process is not None:
                last[2] = process if last[2] is None else max(last[2], process)
        else:
            timeline.append([t, device, process])
    process_peak = max(reported) if reported else None
    return {"source": "process" if reported else "device",
            "peak": process_peak if reported else device_peak,
            "peak_device": device_peak, "peak_process": process_peak,
            "baseline": baseline, "samples": len(samples), "timeline": timeline}


# ---------------------------------------------------------------------------------------------
# Children: forked from a zygote, or fresh interpreters


class ForkUnsafe(RuntimeError):
    """The zygote found forking unsafe after its imports (CUDA initialized, threads)."""


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def _result_or_error(result_path: Path, log: Path, code: int | None, timed_out: bool,
                     job: dict) -> dict:
    """The child's result; or, where it wrote none, an error saying how it ended (`code`: its
    exit code, negative for a signal, as subprocess reports it)."""
    if result_path.is_file():
        try:
            result = json.loads(result_path.read_text())
        except ValueError:
            result = None
        if result is not None:
            if result.get("outcome") != "ok":
                result["log_tail"] = _tail(log)
            return result
    if timed_out:
        why = "killed at its time limit"
    elif code is not None and code < 0:
        why = f"killed by signal {-code} ({signal.Signals(-code).name})"
    else:
        why = f"exited ({code}) without a result"
    return {"program": job["program"], "setup": job["setup"], "kind": job["kind"],
            "scale": job["scale"], "outcome": "error", "error": why, "log_tail": _tail(log)}


class ExecLauncher:
    """Each child a fresh interpreter: ``python mixed_programs.py --child JOBFILE``."""

    mode = "exec"

    def __init__(self, device_uuid: str, workdir: Path):
        self.uuid, self.workdir = device_uuid, workdir
        self.count = 0

    def run(self, job: dict, timeout: float, on_start=None) -> dict:
        self.count += 1
        base = self.workdir / f"exec-{self.uuid[-6:]}-{self.count}"
        result, log = base.with_suffix(".result.json"), base.with_suffix(".log")
        spec = base.with_suffix(".job.json")
        spec.write_text(json.dumps({"job": job, "result": str(result)}))
        env = dict(os.environ)
        for key, value in {**work.setup_environment(job["setup"]),
                           **_device_environment(self.uuid)}.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        with open(log, "w") as out:
            child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child",
                                      str(spec)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
            timed_out = False
            try:
                if on_start:
                    on_start(child.pid)
                status = child.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill_group(child.pid)
                status = child.wait()
                timed_out = True
            except BaseException:   # the run was stopped: the child goes with it
                _kill_group(child.pid)
                child.wait()
                raise
        return _result_or_error(result, log, status, timed_out, job)

    def close(self) -> None:
        pass


class ForkLauncher:
    """Children forked from a zygote (``mixed_programs.py --zygote``) that imported the
    libraries once and never initialized CUDA."""

    mode = "fork"

    def __init__(self, device_uuid: str, workdir: Path, ready_timeout: float = 900.0):
        self.uuid, self.workdir = device_uuid, workdir
        self.count = 0
        self.current = None   # the child running now
        log = workdir / f"zygote-{device_uuid[-6:]}.log"
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--zygote"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
            start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        message = self._next(ready_timeout)
        if message is None or "ready" not in message:
            self.close()
            raise ForkUnsafe(f"the zygote did not start: {_tail(log, 5)}")
        self.info = message["ready"]
        if self.info.get("fork_unsafe"):
            self.close()
            raise ForkUnsafe(self.info["fork_unsafe"])

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                continue   # a library's own output
        self.lines.put(None)

    def _next(self, timeout: float):
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return {"timeout": True}

    def run(self, job: dict, timeout: float, on_start=None) -> dict:
        self.count += 1
        base = self.workdir / f"fork-{self.uuid[-6:]}-{self.count}"
        result, log = base.with_suffix(".result.json"), base.with_suffix(".log")
        env = {**work.setup_environment(job["setup"]), **_device_environment(self.uuid)}
        self.proc.stdin.write(json.dumps({"job": job, "result": str(result), "log": str(log),
                                          "env": env}) + "\n")
        self.proc.stdin.flush()
        started = self._next(60)
        if not started or "started" not in started:
            return {**{k: job[k] for k in ("program", "setup", "kind", "scale")},
                    "outcome": "error", "error": f"the zygote did not fork: {started}"}
        pid = self.current = started["started"]
        if on_start:
            on_start(pid)
        exited = self._next(timeout)
        timed_out = bool(exited and exited.get("timeout"))
        if timed_out:
            _kill_group(pid)
            exited = self._next(60)
        self.current = None
        if exited is None:
            return {**{k: job[k] for k in ("program", "setup", "kind", "scale")},
                    "outcome": "error", "error": "the zygote died", "log_tail": _tail(log)}
        status = exited.get("status")
        code = os.waitstatus_to_exitcode(status) if status is not None else None
        return _result_or_error(result, log, code, timed_out, job)

    def close(self) -> None:
        """End the zygote, and a child still running (the run was stopped)."""
        if self.current is not None:
            _kill_group(self.current)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(10)
        self.proc.stdout.close()
        self._log.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _device_environment(uuid: str) -> dict:
    """The child sees the GPU it is given as device 0."""
    return {"CUDA_VISIBLE_DEVICES": uuid, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def make_launcher(mode: str, uuid: str, workdir: Path, notes: list):
    if mode == "fork":
        try:
            return ForkLauncher(uuid, workdir)
        except ForkUnsafe as e:
            notes.append(f"children started as fresh interpreters: forking was unsafe ({e})")
    return ExecLauncher(uuid, workdir)


# ---------------------------------------------------------------------------------------------
# The run


class Stopped(BaseException):
    """SIGTERM (a time limit from outside): the run writes what it has."""


def _stop(signum, frame):
    raise Stopped(f"signal {signal.Signals(signum).name}")


class Deadline:
    def __init__(self, limit: float | None):
        env = os.environ.get("EMMPOOL_BENCH_DEADLINE")
        self.at = (time.time() + limit if limit is not None
                   else float(env) if env else None)

    def allows(self, seconds: float) -> bool:
        """Whether work of about `seconds` would end before the deadline."""
        return self.at is None or time.time() + seconds < self.at


def job_of(args, program: str, setup: str, kind: str, scale: int) -> dict:
    job = {"program": program, "setup": setup, "kind": kind, "scale": scale,
           "rmm_initial_pool": args.rmm_initial_pool, "warmup_cycles": 0, "cycles": 1}
    if kind == "timing":
        job.update(warmup_cycles=args.warmup_cycles, cycles=args.cycles)
    elif kind == "probe":
        job["budget"] = args.budget
    return job


def _say(text: str) -> None:
    print(f"[{NAME}] {text}", flush=True)


def _ms_per_step(result: dict) -> float | None:
    cycles = result.get("cycle_s")
    if not cycles:
        return None
    return statistics.median(cycles) / work.STEPS_PER_CYCLE * 1e3


def run_timed(launcher, gpu: Gpu, idle: int, job: dict, args) -> dict:
    """One child, with its memory sampled."""
    gpu.settle(idle)
    sampler = MemorySampler(gpu, args.sample_ms / 1e3)

    def started(pid):
        sampler.pid = pid

    t = time.perf_counter()
    try:
        result = launcher.run(job, args.child_timeout, started)
    finally:
        memory = sampler.stop()
    result["wall_s"] = time.perf_counter() - t
    context = result.get("context")
    if context:   # the bytes the context took: device memory used once it existed, before it
        memory["context"] = max(0, context["total"] - context["free"] - memory.get("baseline", 0))
    result["memory"] = memory
    return result


def plan_pairs(args, importable) -> tuple[list, dict]:
    """The (program, setup) pairs to run, and why each other one is not run."""
    pairs, not_run = [], {}
    for program in args.programs:
        for setup in args.setups:
            why = work.not_run_reason(program, setup, importable)
            if why:
                not_run[(program, setup)] = why
            else:
                pairs.append((program, setup))
    return pairs, not_run


def round_order(pairs: list, r: int) -> list:
    """Round r's order: every program's setups, each program's list rotated by r, so that no
    setup always runs first (the first child after a pause, or after another program, may run
    on a cooler or a busier host)."""
    by_program: dict = {}
    for program, setup in pairs:
        by_program.setdefault(program, []).append(setup)
    order = []
    for program, setups in by_program.items():
        k = r % len(setups)
        order += [(program, s) for s in setups[k:] + setups[:k]]
    return order


def timing_phase(args, pairs, launcher, gpu, idle, deadline, results) -> int:
    """Interleaved rounds; returns the rounds run."""
    rounds_run = 0
    last = None
    for r in range(args.rounds):
        if r and last is not None and not deadline.allows(last * 1.1):
            _say(f"timing: stopped after {r} of {args.rounds} rounds (time limit)")
            break
        t = time.perf_counter()
        for program, setup in round_order(pairs, r):
            job = job_of(args, program, setup, "timing", args.scales[program])
            result = run_timed(launcher, gpu, idle, job, args)
            result["round"] = r
            entry = results.setdefault(program, {}).setdefault(setup, {})
            entry.setdefault("timing", {"scale": args.scales[program], "rounds": []})
            entry["timing"]["rounds"].append(result)
            ms = _ms_per_step(result)
            peak = result["memory"].get("peak")
            _say(f"round {r + 1}/{args.rounds} {program} {setup}: {_outcome(result)}"
                 + (f", {ms:.2f} ms/step" if ms else "")
                 + (f", peak {peak / GiB:.2f} GiB" if peak is not None else "")
                 + f" ({result['wall_s']:.1f} s)")
        last = time.perf_counter() - t
        rounds_run += 1
    return rounds_run


def _outcome(result: dict) -> str:
    if result.get("outcome") == "ok":
        return "ok"
    return f"{result.get('outcome')}: {result.get('error', '')}"[:200]


def search_pair(args, launcher, program: str, setup: str, start: int, deadline,
                durations: list, settle=None) -> dict:
    """The capacity search of one (program, setup), each probe a child, started once the GPU's
    memory is back to idle (`settle()`): memory the last child gave back after the filler was
    made would be more than B."""
    runs = []

    def probe(scale):
        job = job_of(args, program, setup, "probe", scale)
        if settle is not None:
            settle()
        t = time.perf_counter()
        result = launcher.run(job, args.child_timeout)
        result["wall_s"] = time.perf_counter() - t
        durations.append(result["wall_s"])
        runs.append(result)
        _say(f"capacity {program} {setup} scale {scale}: {_outcome(result)} "
             f"({result['wall_s']:.1f} s)")
        return result["outcome"]

    found = search_capacity(
        probe, start, grow=args.grow, max_probes=args.probes, resolution=args.resolution,
        out_of_time=lambda: not deadline.allows(1.2 * max(durations[-3:])))
    found.update(budget=args.budget, start=start, runs=[_slim_probe(r) for r in runs])
    left = [r["filler"]["free_after"] for r in runs if r.get("filler")]
    if left:
        found["free_after_filler"] = [min(left), max(left)]
    return found


def capacity_phase(args, pairs, launchers: list, gpus: list, deadline, results,
                   starts: dict) -> None:
    """One search per (program, setup); several at once, one per device."""
    tasks: queue.Queue = queue.Queue()
    for pair in pairs:
        tasks.put(pair)
    lock = threading.Lock()

    def worker(launcher, gpu):
        durations = [30.0]   # a guess of a probe's time until one has run
        idle = gpu.used()
        while True:
            try:
                program, setup = tasks.get_nowait()
            except queue.Empty:
                return
            found = search_pair(args, launcher, program, setup, starts[(program, setup)],
                                deadline, durations, lambda: gpu.settle(idle))
            with lock:
                results.setdefault(program, {}).setdefault(setup, {})["capacity"] = found

    threads = [threading.Thread(target=worker, args=pair)
               for pair in zip(launchers, gpus, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _slim_probe(result: dict) -> dict:
    keep = ("scale", "outcome", "error", "wall_s", "filler", "context", "checks", "serves",
            "log_tail", "allocator")
    return {k: result[k] for k in keep if k in result}


def warmup_phase(args, pairs, launcher) -> list:
    """Unreported children at the quick scale: CuPy compiles its kernels into its cache on
    disk, Numba its kernels into its cache, emmpool's PyTorch extension is built, once, before
    anything is timed (a fresh host's first runs spend most of their time there). One child per
    program for its separate setup and one for emmpool suffice: the kernels are the same for
    every setup."""
    out = []
    seen = set()
    for program, setup in pairs:
        if setup not in ("separate", "emmpool") or (program, setup) in seen:
            continue
        seen.add((program, setup))
        job = job_of(args, program, setup, "warmup", work.PROGRAMS[program].quick_scale)
        t = time.perf_counter()
        result = launcher.run(job, max(args.child_timeout, 600.0))
        wall = time.perf_counter() - t
        _say(f"warm-up {program} {setup}: {_outcome(result)} ({wall:.1f} s)")
        out.append({"program": program, "setup": setup, "outcome": result.get("outcome"),
                    "error": result.get("error"), "wall_s": wall})
    return out


def capacity_starts(args, pairs, results, earlier: dict | None) -> dict:
    starts = {}
    for program, setup in pairs:
        summary = None
        for source in (results, earlier or {}):
            timing = source.get(program, {}).get(setup, {}).get("timing")
            if timing:
                summary = summarize_timing(timing)
                break
        if summary and summary.get("peak") is not None:
            summary = {"peak": summary["peak"], "context": summary.get("context"),
                       "scale": summary["scale"]}
        starts[(program, setup)] = predict_start(args.budget, summary,
                                                 work.PROGRAMS[program].bytes_per_scale)
    return starts


def child_costs(results: dict) -> dict:
    """What a child costs, to plan runs: how many ran, and the median seconds of a timing
    child from its start to its setup in place (its CUDA context, PyTorch's and the others'
    start), to its timed cycles (the warm-up cycle), and in all; and of a probe in all."""
    timing = [r for p in results.values() for e in p.values()
              for r in e.get("timing", {}).get("rounds", [])]
    probes = [r for p in results.values() for e in p.values()
              for r in (e.get("capacity") or {}).get("runs", [])]

    def median(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 2) if values else None

    def since_start(r, mark):
        marks = r.get("marks", {})
        return marks[mark] - marks["start"] if mark in marks and "start" in marks else None

    return {"timing": len(timing), "probes": len(probes),
            "timing_to_installed_s": median(since_start(r, "installed") for r in timing),
            "timing_to_timed_s": median(since_start(r, "timed") for r in timing),
            "timing_wall_s": median(r.get("wall_s") for r in timing),
            "probe_wall_s": median(r.get("wall_s") for r in probes)}


def _keep_first_timeline(rounds: list) -> None:
    """The picture shows each setup's first round that ran: the other rounds keep their peaks,
    not their samples (the JSON stays small)."""
    kept = False
    for r in rounds:
        memory = r.get("memory") or {}
        if "timeline" in memory:
            if kept or r.get("outcome") != "ok":
                del memory["timeline"]
            else:
                kept = True


def versions() -> dict:
    from importlib import metadata

    names = ["emmpool", "cupy-cuda13x", "cupy-cuda12x", "cupy", "torch", "numba-cuda", "numba",
             "rmm-cu13", "rmm-cu12", "cuda-bindings", "numpy", "nvidia-ml-py", "matplotlib"]
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def run(args) -> dict:
    """Every phase; the run's document (what the JSON holds)."""
    import importlib.util

    t_run = time.perf_counter()
    deadline = Deadline(args.time_limit)
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    gpus = [Gpu(d) for d in args.devices]
    kinds = {g.name for g in gpus}
    if len(kinds) > 1:
        raise SystemExit(f"--devices: GPUs of different kinds ({', '.join(sorted(kinds))}): "
                         "capacity searches must run on one kind")
    gpu = gpus[0]
    pinned = cpus.pin_near_gpu(args.cpus, gpu.index) if len(gpus) == 1 else []
    idle = gpu.used()

    def importable(module):
        return importlib.util.find_spec(module.split(".")[0]) is not None

    pairs, not_run = plan_pairs(args, importable)
    notes: list = []
    run_id = datetime.datetime.now(datetime.timezone.utc).strftime("run %Y%m%dT%H%M%SZ")
    results: dict = {}
    for (program, setup), why in not_run.items():
        results.setdefault(program, {}).setdefault(setup, {})["not_run"] = why
    workdir = Path(tempfile.mkdtemp(prefix="mixed-programs-"))
    _say(f"{gpu.name}; {len(pairs)} (program, setup) pairs, {len(not_run)} not run; children "
         f"in {workdir}")
    launcher = make_launcher(args.start, gpu.uuid, workdir, notes)
    others: list = []
    warmup = []
    rounds_run = 0
    try:
        zygote = getattr(launcher, "info", None)
        if zygote:
            _say(f"zygote: imports {zygote['import_s']:.1f} s; not importable there: "
                 f"{', '.join(zygote['missing']) or 'none'}")
        if args.warmup:
            warmup = warmup_phase(args, pairs, launcher)
        if not args.capacity_only:
            rounds_run = timing_phase(args, pairs, launcher, gpu, idle, deadline, results)
        if not args.skip_capacity:
            earlier = None
            if args.timing_from:
                earlier = json.loads(args.timing_from.read_text()).get("results", {})
            starts = capacity_starts(args, pairs, results, earlier)
            others = [make_launcher(launcher.mode, g.uuid, workdir, notes) for g in gpus[1:]]
            capacity_phase(args, pairs, [launcher, *others], gpus, deadline, results, starts)
    except (Exception, Stopped) as e:   # what ran is kept, and said to be partial
        notes.append(f"the run stopped early: {type(e).__name__}: {e}")
        _say(f"stopped early: {type(e).__name__}: {e}")
    finally:
        for each in (launcher, *others):
            each.close()
    for program in results.values():
        for entry in program.values():
            for kind in ("timing", "capacity"):
                if kind in entry:
                    entry[kind]["run"] = run_id
            _keep_first_timeline(entry.get("timing", {}).get("rounds", []))
    sources = {r["memory"].get("source") for p in results.values() for e in p.values()
               for r in e.get("timing", {}).get("rounds", []) if r.get("memory")}
    children = child_costs(results)
    run_info = {
        "gpu": gpu.name, "gpu_total": gpu.total, "driver": gpu.driver,
        "devices": [g.index for g in gpus], "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "versions": versions(),
        "start": launcher.mode, "zygote": getattr(launcher, "info", None), "cpus": pinned,
        "budget": args.budget, "rounds": rounds_run, "rounds_asked": args.rounds,
        "cycles": args.cycles, "warmup_cycles": args.warmup_cycles,
        "steps_per_cycle": work.STEPS_PER_CYCLE, "factors": list(work.FACTORS),
        "scales": args.scales, "sample_ms": args.sample_ms,
        "rmm_initial_pool": args.rmm_initial_pool, "memory_sources": sorted(s for s in sources
                                                                             if s),
        "phases": [p for p, on in (("timing", not args.capacity_only),
                                   ("capacity", not args.skip_capacity)) if on],
        "notes": notes, "wall_s": time.perf_counter() - t_run, "children": children,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k not in ("child", "zygote", "merge")},
    }
    return {"benchmark": NAME, "gpu": gpu.name, "runs": {run_id: run_info},
            "results": results, "warmup": warmup}


# ---------------------------------------------------------------------------------------------
# Summaries (from the document alone: a merged one renders the same way)


def memory_source(timings: list) -> str:
    """'process' where NVML reported the child's own memory in every round that ran, else
    'device': one figure for every setup of a table."""
    rounds = [r for t in timings for r in t.get("rounds", []) if r.get("outcome") == "ok"
              and r.get("memory")]
    if rounds and all(r["memory"].get("peak_process") is not None for r in rounds):
        return "process"
    return "device"


def summarize_timing(timing: dict, source: str | None = None) -> dict:
    """Per (program, setup): outcome, peak memory (`source`: 'process' or 'device', by default
    what its own rounds allow), allocators' peak, ms/step (median and best round), the check
    values and whether the rounds agree, and the first round's memory over time."""
    rounds = timing.get("rounds", [])
    ok = [r for r in rounds if r.get("outcome") == "ok"]
    source = source or memory_source([timing])
    out: dict = {"scale": timing.get("scale"), "rounds": len(rounds), "rounds_ok": len(ok),
                 "run": timing.get("run"), "source": source}
    failed = [r for r in rounds if r.get("outcome") != "ok"]
    if failed:
        out["failure"] = f"{failed[0].get('outcome')}: {failed[0].get('error', '')}"
    if not ok:
        return out
    key = f"peak_{source}"
    peaks = [r["memory"].get(key, r["memory"].get("peak")) for r in ok if r.get("memory")]
    peaks = [p for p in peaks if p is not None]
    out["peak"] = max(peaks) if peaks else None
    out["peak_rounds"] = peaks
    contexts = [r["memory"].get("context") for r in ok if r.get("memory", {}).get("context")]
    out["context"] = max(contexts) if contexts else None
    allocator = [r.get("allocator") for r in ok if r.get("allocator")]
    if allocator:
        out["allocator"] = max(allocator, key=lambda a: a.get("total") or 0)
    times = [t for t in (_ms_per_step(r) for r in ok) if t is not None]
    if times:
        out["ms_median"] = statistics.median(times)
        out["ms_best"] = min(times)
        out["ms_rounds"] = times
    out["checks"] = ok[0].get("checks")
    out["rounds_agree"] = all(_rel_diff(r.get("checks"), out["checks"]) <= CHECK_TOLERANCE
                              for r in ok[1:])
    out["serves"] = ok[0].get("serves")
    if "expandable" in ok[0]:
        out["expandable"] = ok[0]["expandable"]
    first = next((r for r in ok if r.get("memory", {}).get("timeline")), None)
    if first:
        timeline = first["memory"]["timeline"]
        origin = first.get("marks", {}).get("context") or timeline[0][0]
        column = 2 if source == "process" else 1
        out["timeline"] = [[p[0] - origin, p[column] or 0] for p in timeline
                           if len(p) > column]
    return out


def _rel_diff(a, b) -> float:
    """The largest relative difference between two lists of check values (inf where they do
    not compare: other lengths, a value missing)."""
    if not a or not b or len(a) != len(b):
        return math.inf
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
            return math.inf
        worst = max(worst, abs(x - y) / max(abs(x), abs(y), 1e-12))
    return worst


def program_table(doc: dict, program: str) -> dict:
    """Every setup's summary with its ratios, for one program."""
    entries = doc["results"].get(program, {})
    source = memory_source([e["timing"] for e in entries.values() if "timing" in e])
    rows: dict = {}
    for setup in work.SETUPS:
        entry = entries.get(setup)
        if entry is None:
            continue
        row: dict = {"not_run": entry.get("not_run")}
        if "timing" in entry:
            row.update(summarize_timing(entry["timing"], source))
        if "capacity" in entry:
            row["capacity"] = entry["capacity"]
        rows[setup] = row
    ok = {s: r for s, r in rows.items() if r.get("ms_median") is not None}
    reference = next((s for s in work.SETUPS if s in ok and ok[s].get("checks")), None)
    fastest = min((r["ms_median"] for r in ok.values()), default=None)
    fastest_best = min((r["ms_best"] for r in ok.values()), default=None)
    separate_peak = rows.get("separate", {}).get("peak")
    separate_cap = (rows.get("separate", {}).get("capacity") or {}).get("largest")
    for row in rows.values():
        if reference and row.get("checks") is not None:
            scale_same = row.get("scale") == rows[reference].get("scale")
            row["check_diff"] = (_rel_diff(row["checks"], rows[reference]["checks"])
                                 if scale_same else None)
            row["check_reference"] = reference
        if row.get("ms_median") is not None:
            row["x_fastest"] = row["ms_median"] / fastest
            row["x_fastest_best"] = row["ms_best"] / fastest_best
        if row.get("peak") is not None and separate_peak:
            row["x_separate_peak"] = row["peak"] / separate_peak
        largest = (row.get("capacity") or {}).get("largest")
        if largest and separate_cap:
            row["x_separate_capacity"] = largest / separate_cap
    runs = {r.get("run") for r in ok.values()}
    return {"rows": rows, "reference": reference, "source": source,
            "timed_in_runs": sorted(x for x in runs if x)}


def check_cell(row: dict) -> str:
    if row.get("checks") is None:
        return "-"
    diff = row.get("check_diff")
    if diff is None:
        return "not compared (another scale)" if row.get("check_reference") else "-"
    if diff <= CHECK_TOLERANCE:
        agree = "" if row.get("rounds_agree", True) else "; rounds differ"
        return ("ok" if diff == 0 else f"ok (≤ {diff:.0e})") + agree
    return f"DIFFERS from {row['check_reference']} (rel. {diff:.1e})"


def goals(table: dict) -> list:
    """The issue's goals for each emmpool setup, each ✓ or ✗ with its figures."""
    rows = table["rows"]
    lines = []
    separate = [rows[s] for s in work.SEPARATE if s in rows and rows[s].get("peak") is not None]
    bridges = {s: rows[s] for s in work.BRIDGES if s in rows and rows[s].get("peak") is not None}
    sep_caps = [(rows[s].get("capacity") or {}).get("largest") for s in work.SEPARATE
                if s in rows]
    sep_caps = [c for c in sep_caps if c]
    for setup in ("emmpool", "emmpool-growable"):
        row = rows.get(setup)
        if row is None or row.get("not_run"):
            continue
        parts = []
        if row.get("peak") is not None and separate:
            lowest = min(r["peak"] for r in separate)
            x = row["peak"] / lowest
            parts.append(f"peak {x:.2f}× the separate pools' (≤ {GOAL_PEAK}) "
                         f"{'✓' if x <= GOAL_PEAK else '✗'}")
        for name, other in bridges.items():
            x = row["peak"] / other["peak"] if row.get("peak") is not None else None
            if x is not None:
                parts.append(f"{x:.2f}× {name}'s (≤ 1) {'✓' if x <= 1 else '✗'}")
        largest = (row.get("capacity") or {}).get("largest")
        if largest is not None and sep_caps:
            x = largest / max(sep_caps)
            parts.append(f"largest scale in B {x:.2f}× the separate pools' (≥ {GOAL_CAPACITY}) "
                         f"{'✓' if x >= GOAL_CAPACITY else '✗'}")
        if row.get("x_fastest") is not None:
            x = row["x_fastest"]
            parts.append(f"time per step {x:.3f}× the fastest setup's, median round "
                         f"(≤ {GOAL_TIME}) {'✓' if x <= GOAL_TIME else '✗'}")
        if row.get("failure") and row.get("ms_median") is None:
            parts.append(f"FAILED ({row['failure'][:120]}) ✗")
        if parts:
            lines.append(f"- {setup}: " + "; ".join(parts))
    return lines


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _x(v, digits=2) -> str:
    return "" if v is None else f" ({v:.{digits}f}×)"


def capacity_cell(row: dict) -> str:
    cap = row.get("capacity")
    if not cap:
        return "-"
    largest, hi = cap.get("largest"), cap.get("smallest_failing")
    if largest == 0 and hi is None:
        text = "-"
    elif largest == 0:
        text = f"none (scale {hi} fails)"
    elif hi is None:
        text = f"≥ {largest} (none failed)"
    else:
        res = cap.get("resolution")
        text = f"{largest}" + (f" ±{100 * res:.0f}%" if res else "")
    text += _x(row.get("x_separate_capacity"))
    if cap.get("stopped"):
        text += f"; stopped: {cap['stopped']}"
    return text


def allocator_cell(row: dict) -> str:
    a = row.get("allocator")
    if not a:
        return "-"
    counted = a.get("counted", {})
    parts = [f"{k} {_gib(v)}" for k, v in counted.items()]
    text = " + ".join(parts)
    if len(parts) > 1:
        text += f" = {_gib(a.get('total'))}"
    return text


LIBRARIES = (("cupy", "CuPy"), ("torch", "PyTorch"), ("numba", "Numba"), ("rmm", "RMM"))


def setups_table(doc: dict) -> list:
    """Who allocates for each library under each setup, as the children said."""
    serves: dict = {}
    for program in doc["results"]:
        for setup, row in program_table(doc, program)["rows"].items():
            for lib, how in (row.get("serves") or {}).items():
                serves.setdefault(setup, {}).setdefault(lib, how)
    if not serves:
        return []
    lines = ["", "| setup | " + " | ".join(name for _, name in LIBRARIES) + " |",
             "|---" * (len(LIBRARIES) + 1) + "|"]
    for setup in work.SETUPS:
        if setup in serves:
            lines.append(f"| {setup} | " + " | ".join(serves[setup].get(lib, "")
                                                        for lib, _ in LIBRARIES) + " |")
    return lines


def _children_text(c: dict | None) -> str:
    if not c:
        return ""
    parts = []
    if c.get("timing"):
        parts.append(f"{c['timing']} timing children, median {c.get('timing_wall_s')} s each "
                     f"({c.get('timing_to_installed_s')} s to the setup in place)")
    if c.get("probes"):
        parts.append(f"{c['probes']} probes, median {c.get('probe_wall_s')} s each")
    return f" ({'; '.join(parts)})" if parts else ""


def markdown(doc: dict, pictures: dict) -> str:
    runs = doc["runs"]
    first = next(iter(runs.values()))
    budget = next((r.get("budget") for r in runs.values() if "capacity" in r.get("phases", [])),
                  first.get("budget"))
    timed = any("timing" in r.get("phases", []) for r in runs.values())
    lines = [f"## Mixed programs: one pool against each library's own and the bridges, "
             f"{doc['gpu']}", ""]
    for run_id, r in runs.items():
        lines.append(
            f"- {run_id}: {r.get('date')}, {', '.join(r.get('phases', []))}; driver "
            f"{r.get('driver')}; children {r.get('start')}ed"
            + (f" (zygote imports {r['zygote']['import_s']:.1f} s)" if r.get("zygote") else "")
            + (f"; {r.get('rounds')} round(s) of {r.get('cycles')} timed cycles after "
               f"{r.get('warmup_cycles')} warm-up; scales "
               + ", ".join(f"{p}={s}" for p, s in (r.get("scales") or {}).items())
               if "timing" in r.get("phases", []) else "")
            + f"; {r.get('wall_s', 0):.0f} s" + _children_text(r.get("children")) + "; "
            + ", ".join(f"{k} {v}" for k, v in (r.get("versions") or {}).items()))
        for note in r.get("notes", []):
            lines.append(f"  - {note}")
    intro = []
    if timed:
        intro.append(
            "Peak GPU memory: NVML's used memory of the child process where NVML reports it "
            "for every child of the table, else the device's above its value before the child "
            "(each table says which), sampled every few ms, the CUDA context and the "
            "libraries' handles and kernels included; the largest over the rounds. Allocators' "
            "own peak: what each caching "
            "allocator reserved at most (Numba's own manager and RMM's default resource cache "
            "nothing and are not counted). ms/step: a round's median cycle over its steps; the "
            "median and the best round, with the ratio to the fastest setup's. Check: every "
            f"step's value against the first setup's, relative difference ≤ "
            f"{CHECK_TOLERANCE:g}.")
    if budget and any("capacity" in r.get("phases", []) for r in runs.values()):
        intro.append(
            f"Largest scale in B: the largest scale that completes one cycle of steps with "
            f"B = {_gib(budget)} GiB of the device left beyond the CUDA context (±: the "
            "search's bracket; × the separate setup's).")
    lines += ["", " ".join(intro)] if intro else []
    lines += setups_table(doc)
    for program in doc["results"]:
        spec = work.PROGRAMS[program]
        table = program_table(doc, program)
        rows = table["rows"]
        scale = next((r.get("scale") for r in rows.values() if r.get("scale")), None)
        lines += ["", f"### {spec.letter}. `{program}`: {spec.title}", ""]
        if scale:
            where = ("the child process's (NVML)" if table["source"] == "process"
                     else "the device's above its value before the child (NVML)")
            lines.append(f"Timing scale {scale} (one unit: {spec.unit}); peak GPU memory: "
                         f"{where}.")
        if len(table["timed_in_runs"]) > 1:
            lines.append(f"Timed in {len(table['timed_in_runs'])} runs: the time ratios "
                         "compare runs.")
        lines += [
            "",
            "| setup | check | peak GPU memory (GiB) | allocators' own peak (GiB) | ms/step, "
            "median round | ms/step, best round | largest scale in B |",
            "|---|---|---:|---|---:|---:|---|",
        ]
        for setup, row in rows.items():
            if row.get("not_run"):
                lines.append(f"| {setup} | not run: {row['not_run']} |||||| ")
                continue
            if row.get("ms_median") is None and row.get("failure"):
                failure = f"FAILED: {row['failure'][:150]}".replace("|", "/")
                lines.append(f"| {setup} | {failure} | | | | | {capacity_cell(row)} |")
                continue
            ms = "-" if row.get("ms_median") is None else f"{row['ms_median']:.2f}"
            best = "-" if row.get("ms_best") is None else f"{row['ms_best']:.2f}"
            check = check_cell(row)
            if row.get("expandable") is False:
                check += "; expandable segments NOT in force"
            if row.get("failure"):
                check += f"; a round failed: {row['failure'][:80]}"
            lines.append(
                f"| {setup} | {check} | {_gib(row.get('peak'))}{_x(row.get('x_separate_peak'))}"
                f" | {allocator_cell(row)} | {ms}{_x(row.get('x_fastest'), 3)} | "
                f"{best}{_x(row.get('x_fastest_best'), 3)} | {capacity_cell(row)} |")
        probes = [(s, (r.get("capacity") or {}).get("probes")) for s, r in rows.items()]
        probes = [(s, p) for s, p in probes if p]
        if probes:
            lines += ["", "Capacity probes (scale: outcome): " + "; ".join(
                f"{s}: " + ", ".join(f"{sc} {o}" for sc, o in p) for s, p in probes) + "."]
        goal_lines = goals(table)
        if goal_lines:
            lines += ["", f"Goals (same GPU, one run): emmpool's peak ≤ {GOAL_PEAK}× the "
                      f"separate pools' (the lower of separate and separate-expandable) and ≤ "
                      f"every bridge's; its largest scale in B ≥ {GOAL_CAPACITY}× theirs (the "
                      f"larger); time per step ≤ {GOAL_TIME}× the fastest setup's:", "",
                      *goal_lines]
        if program in pictures:
            lines += ["", f"![GPU memory over time, {program}]({pictures[program]})"]
        elif pictures.get("_why"):
            lines += ["", f"(No picture: {pictures['_why']}.)"]
    return "\n".join(lines) + "\n"


def plot(doc: dict, out: Path) -> dict:
    """One PNG per program: used memory over time, one line per setup (its first round). Returns
    {program: file name}, or {'_why': reason} where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"_why": "matplotlib is not installed where this ran; `mixed_programs.py --merge "
                        "mixed_programs.json --out DIR` draws them wherever it is"}
    written = {}
    for program in doc["results"]:
        rows = program_table(doc, program)["rows"]
        lines = [(s, r["timeline"]) for s, r in rows.items() if r.get("timeline")]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
        for setup, timeline in lines:
            ax.plot([t for t, _ in timeline], [v / GiB for _, v in timeline], label=setup,
                    linewidth=1.6 if setup.startswith("emmpool") else 1.0)
        ax.set_xlabel("seconds since the child's CUDA context")
        ax.set_ylabel("GPU memory used (GiB)")
        ax.set_title(f"{work.PROGRAMS[program].letter}. {program}: GPU memory over time, "
                     f"{doc['gpu']}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"{NAME}_{program}.png"
        fig.savefig(out / name)
        plt.close(fig)
        written[program] = name
    return written


def write_outputs(doc: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(doc, indent=1, default=str))
    pictures = plot(doc, out)
    text = markdown(doc, pictures)
    (out / f"{NAME}.md").write_text(text)
    return text


def failed(doc: dict) -> list:
    """What makes the exit status 1: a check that differs, an emmpool setup that failed, a run
    that stopped early."""
    bad = [note for r in doc["runs"].values() for note in r.get("notes", [])
           if note.startswith("the run stopped early")]
    for program in doc["results"]:
        for setup, row in program_table(doc, program)["rows"].items():
            diff = row.get("check_diff")
            if diff is not None and diff > CHECK_TOLERANCE:
                bad.append(f"{program} {setup}: check differs")
            if setup.startswith("emmpool") and row.get("failure"):
                bad.append(f"{program} {setup}: {row['failure'][:100]}")
            if row.get("expandable") is False:
                bad.append(f"{program} {setup}: PyTorch's segments were not expandable")
    return bad


# ---------------------------------------------------------------------------------------------
# Merge


def merge_docs(docs: list) -> dict:
    """Several runs' documents in one: each (program, setup)'s timing and capacity from the last
    document that has it (a replaced one is noted). ValueError where the runs are of different
    GPUs, or their capacity searches had different budgets."""
    if not docs:
        raise ValueError("nothing to merge")
    for d in docs:
        if d.get("benchmark") != NAME:
            raise ValueError(f"not a {NAME} result: {d.get('benchmark')!r}")
    gpus = {d["gpu"] for d in docs}
    if len(gpus) > 1:
        raise ValueError(f"runs of different GPUs cannot be merged: {', '.join(sorted(gpus))}")
    merged = {"benchmark": NAME, "gpu": docs[0]["gpu"], "runs": {}, "results": {},
              "warmup": []}
    budgets = set()
    replaced = []
    for d in docs:
        merged["runs"].update(d["runs"])
        merged["warmup"] += d.get("warmup", [])
        for program, setups in d["results"].items():
            target = merged["results"].setdefault(program, {})
            for setup, entry in setups.items():
                have = target.setdefault(setup, {})
                for kind in ("timing", "capacity"):
                    if kind in entry:
                        if kind in have:
                            replaced.append(f"{program} {setup} {kind}")
                        have[kind] = entry[kind]
                        have.pop("not_run", None)
                        if kind == "capacity":
                            budgets.add(entry[kind].get("budget"))
                if "not_run" in entry and not ({"timing", "capacity"} & set(have)):
                    have["not_run"] = entry["not_run"]
    if len(budgets) > 1:
        raise ValueError("capacity searches with different budgets B cannot be merged: "
                         + ", ".join(_gib(b) for b in sorted(budgets)))
    if replaced:
        last = list(merged["runs"])[-1]
        merged["runs"][last].setdefault("notes", []).append(
            "merged: taken from the later run: " + ", ".join(replaced))
    return merged


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return work.child_main(args.child)
    if args.zygote:
        return work.zygote_main()
    t = time.perf_counter()
    if args.merge:
        try:
            doc = merge_docs([json.loads(p.read_text()) for p in args.merge])
        except (OSError, ValueError) as e:
            raise SystemExit(f"--merge: {e}") from None
    else:
        signal.signal(signal.SIGTERM, _stop)
        doc = run(args)
    text = write_outputs(doc, args.out)
    print(text)
    bad = failed(doc)
    for line in bad:
        _say(f"FAILED: {line}")
    files = sorted(p.name for p in args.out.iterdir() if p.name.startswith(NAME))
    _say(f"wrote {', '.join(files)} to {args.out} in {time.perf_counter() - t:.0f} s"
         + (f"; {len(bad)} failure(s)" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

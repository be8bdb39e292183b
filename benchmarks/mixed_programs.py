"""Programs that mix GPU libraries, with one pool (emmpool) against each library's own pool and
against the bridges people use to share one: how much device memory each needs, how large a
problem fits in a given amount of memory, and what each costs in time.

    python benchmarks/mixed_programs.py --out DIR [--programs a,b,c] [--setups NAME ...]
        [--rounds 3] [--budget-gib 8] [--skip-capacity | --capacity-only] [--devices 0,1]
    python benchmarks/mixed_programs.py --out DIR --quick           # a smoke test
    python benchmarks/mixed_programs.py --merge A.json B.json --out DIR

benchmarks/README.md says what the programs and the setups are, what is measured and how. This
file runs the timing rounds and the capacity searches, a child process per program, setup and
round and per probe (mixed_children.py starts them); mixed_workloads.py is what runs in a child,
mixed_report.py makes the tables, goals and pictures from the JSON. Writes
DIR/mixed_programs.json, DIR/mixed_programs.md (also printed) and DIR/mixed_programs_<program>.png
(with matplotlib). Exit status 1 where a check differs, PyTorch's segments were not expandable
under separate-expandable, an emmpool setup failed, or the run stopped early (SIGTERM, an error:
what ran is written all the same).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import queue
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import cpus
import harness
import mixed_report as report
import mixed_workloads as work  # imports no GPU library
from mixed_children import make_launcher
from mixed_report import NAME, GiB, ms_per_step, summarize_timing
from nvml import Gpu

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
                        "past it [EMMCI_BENCH_DEADLINE, else none]")
    p.add_argument("--child-timeout", type=float, default=240.0,
                   help="seconds a timing child or probe may take [240]")
    p.add_argument("--traces", type=Path, metavar="DIR",
                   help="record emmpool's setups' allocations in the first timing round, as "
                        "DIR/<program>-<setup>.csv (emmpool.trace: replay.py --traces replays "
                        "them on every allocator)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: scale 1, one round, 2 cycles, B = 2 GiB, 3 probes")
    p.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                   help="merge these runs' mixed_programs.json into --out instead of running")
    args = p.parse_args(argv)
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
# The memory a child uses, sampled


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
# The run


class Stopped(BaseException):
    """SIGTERM (a time limit from outside): the run writes what it has."""


def _stop(signum, frame):
    raise Stopped(f"signal {signal.Signals(signum).name}")


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


def importable(module: str) -> bool:
    """Whether `module` can be imported here (without importing it)."""
    return importlib.util.find_spec(module.split(".")[0]) is not None


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
            if args.traces and r == 0 and setup.startswith("emmpool"):
                args.traces.mkdir(parents=True, exist_ok=True)
                job["trace"] = str(args.traces.resolve() / f"{program}-{setup}.csv")
            result = run_timed(launcher, gpu, idle, job, args)
            result["round"] = r
            entry = results.setdefault(program, {}).setdefault(setup, {})
            entry.setdefault("timing", {"scale": args.scales[program], "rounds": []})
            entry["timing"]["rounds"].append(result)
            ms = ms_per_step(result)
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


VERSIONS = ("emmpool", "cupy-cuda13x", "cupy-cuda12x", "cupy", "torch", "numba-cuda", "numba",
            "rmm-cu13", "rmm-cu12", "cuda-bindings", "numpy", "nvidia-ml-py", "matplotlib")


def run(args) -> dict:
    """Every phase; the run's document (what the JSON holds)."""
    t_run = time.perf_counter()
    deadline = harness.Deadline(args.time_limit)
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    gpus = [Gpu(d) for d in args.devices]
    kinds = {g.name for g in gpus}
    if len(kinds) > 1:
        raise SystemExit(f"--devices: GPUs of different kinds ({', '.join(sorted(kinds))}): "
                         "capacity searches must run on one kind")
    gpu = gpus[0]
    pinned = cpus.pin_near_gpu(args.cpus, gpu.index) if len(gpus) == 1 else []
    idle = gpu.used()

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
    costs = child_costs(results)
    run_info = {
        "gpu": gpu.name, "gpu_total": gpu.total, "driver": gpu.driver,
        "devices": [g.index for g in gpus], "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "versions": harness.versions(VERSIONS),
        "start": launcher.mode, "zygote": getattr(launcher, "info", None), "cpus": pinned,
        "budget": args.budget, "rounds": rounds_run, "rounds_asked": args.rounds,
        "cycles": args.cycles, "warmup_cycles": args.warmup_cycles,
        "steps_per_cycle": work.STEPS_PER_CYCLE, "factors": list(work.FACTORS),
        "scales": args.scales, "sample_ms": args.sample_ms,
        "rmm_initial_pool": args.rmm_initial_pool, "memory_sources": sorted(s for s in sources
                                                                             if s),
        "phases": [p for p, on in (("timing", not args.capacity_only),
                                   ("capacity", not args.skip_capacity)) if on],
        "notes": notes, "wall_s": time.perf_counter() - t_run, "children": costs,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k not in ("child", "zygote", "merge")},
    }
    return {"benchmark": NAME, "gpu": gpu.name, "runs": {run_id: run_info},
            "results": results, "warmup": warmup}


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    t = time.perf_counter()
    if args.merge:
        try:
            doc = report.merge_docs([json.loads(p.read_text()) for p in args.merge])
        except (OSError, ValueError) as e:
            raise SystemExit(f"--merge: {e}") from None
    else:
        # SIGTERM (a runner's timeout) ends the run with what it measured; the caller's own
        # handler comes back after, where main() runs inside another program (the tests).
        previous = signal.signal(signal.SIGTERM, _stop)
        try:
            doc = run(args)
        finally:
            signal.signal(signal.SIGTERM, previous)
    text = report.write_outputs(doc, args.out)
    print(text)
    bad = report.failed(doc)
    for line in bad:
        _say(f"FAILED: {line}")
    files = sorted(p.name for p in args.out.iterdir() if p.name.startswith(NAME))
    _say(f"wrote {', '.join(files)} to {args.out} in {time.perf_counter() - t:.0f} s"
         + (f"; {len(bad)} failure(s)" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Fragmentation replay: how much memory a pool reserves for a churning workload, a training
loop whose shapes change and the mixed programs' recorded allocations.

    python benchmarks/replay.py --out DIR [--backends NAME ...] [--steps N] [--write-trace FILE]
        [--traces CSV|DIR ...] [--warmup-steps N]

Traces replayed on every backend: a churn of random sizes (numpy's RNG, a fixed seed), a
PyTorch-like training loop (benchmarks/training_trace.py) and the mixed programs' recorded
allocations (benchmarks/traces/*.csv, or --traces); the result is peak reserved bytes /
peak live bytes (the sum of requested sizes). benchmarks/README.md says what the traces are and
what each backend is; a backend that cannot run here is skipped, with the reason. Writes
DIR/replay.json (everything) and DIR/replay.md (the tables, also printed); `--write-trace FILE`
also writes the churn as text, for `bench_core --replay --trace FILE`.
"""

import argparse
import datetime
import platform
import sys
import traceback
from pathlib import Path

import numpy as np

from emmpool import replay  # the replay engine and its backends (python/emmpool/replay.py)
from emmpool import trace as trace_io

import harness
import training_trace

SEED = 20240601
LIVE = 256
OPS = 40_000
MIN_BYTES = 256
MAX_BYTES = 64 << 20
MiB = 1 << 20
STEPS = 60  # of the training trace
TRACES = Path(__file__).resolve().parent / "traces"  # the mixed programs' recorded allocations
WARMUP_STEPS = 4  # their warm-up cycle (mixed_workloads.STEPS_PER_CYCLE steps)
BACKENDS = ["emmpool-host", "emmpool", "cupy", "torch", "emmpool-host-fixed",
            "emmpool-host-growable", "emmpool-fixed", "emmpool-growable", "driver-pool",
            "torch-expandable"]
DEFAULT_BACKENDS = ["emmpool-host-fixed", "emmpool-host-growable", "emmpool-fixed",
                    "emmpool-growable", "cupy", "torch", "driver-pool", "torch-expandable"]


def make_trace(seed=SEED, live=LIVE, ops=OPS):
    """(fill sizes, op slots, op sizes) as Python lists of ints."""
    rng = np.random.default_rng(seed)
    lo, hi = np.log(MIN_BYTES), np.log(MAX_BYTES)
    fill = np.exp(rng.uniform(lo, hi, size=live)).astype(np.int64)
    slots = rng.integers(0, live, size=ops)
    sizes = np.exp(rng.uniform(lo, hi, size=ops)).astype(np.int64)
    return fill.tolist(), slots.tolist(), sizes.tolist()


def default_backends() -> set[str]:
    """The backends that replay emmpool as a user gets it: the segments it makes by default."""
    from emmpool import _config

    segments = _config.Config().segments  # the default, whatever EMMPOOL_SEGMENTS says here
    return {f"emmpool-{segments}", f"emmpool-host-{segments}"}


def recorded_traces(paths) -> list[Path]:
    """The CSV files named, a folder's *.csv in name order."""
    out = []
    for p in map(Path, paths):
        out += sorted(p.glob("*.csv")) if p.is_dir() else [p]
    return out


def write_trace(path, trace):
    fill, slots, sizes = trace
    with open(path, "w") as f:
        f.write(f"emmpool-trace 1 {len(fill)} {len(slots)}\n")
        f.writelines(f"{n}\n" for n in fill)
        f.writelines(f"{s} {n}\n" for s, n in zip(slots, sizes))


def replay_all(ops, backends) -> dict:
    """Each backend's replay of `ops`: its figures, or why it was skipped or failed."""
    results = {}
    for name in backends:
        try:
            results[name] = {"status": "ok", **replay.run(ops, name)}
        except replay.Skip as e:
            results[name] = {"status": "skipped", "reason": str(e)}
        except Exception as e:  # a failure is reported, not hidden
            results[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()}
    return results


def table(title: str, backends, results: dict, per_step: bool = False) -> list[str]:
    """The results as markdown; with `per_step`, a column of emmpool's page maps per step after
    the warm-up (recorded traces: maps_per_step())."""
    column = " page maps / step |" if per_step else ""
    lines = [title, "",
             "| backend | peak live (MiB) | peak reserved (MiB) | reserved / live | replay s |"
             + column, "|---|---:|---:|---:|---:|" + ("---:|" if per_step else "")]
    default = default_backends()
    for name in backends:
        r = results[name]
        label = f"{name} (default)" if name in default else name
        if r["status"] == "ok":
            maps = r.get("page_maps_per_step")
            cell = (f" {maps:.1f} |" if maps is not None else " - |") if per_step else ""
            lines.append(f"| {label} | {r['peak_live'] / MiB:.1f} | "
                         f"{r['peak_reserved'] / MiB:.1f} | {r['ratio']:.3f} | "
                         f"{r['seconds']:.2f} |" + cell)
        else:
            lines.append(f"| {label} | {r['status']}: {r['reason']} | | | |"
                         + (" |" if per_step else ""))
    return lines


def maps_per_step(results: dict, warmup: int) -> None:
    """Adds page_maps_per_step to each emmpool result of a recorded trace: its page maps after
    the first `warmup` synchronizations (the recording's warm-up cycle), per step, from the
    counts the replay took at each synchronization (page_maps_at_syncs)."""
    for r in results.values():
        at = r.get("page_maps_at_syncs", []) if r["status"] == "ok" else []
        if len(at) > warmup:
            warm = at[warmup - 1] if warmup else 0
            r["page_maps_per_step"] = (r["page_maps"] - warm) / (len(at) - warmup)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--backends", nargs="+", choices=BACKENDS, default=DEFAULT_BACKENDS)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--ops", type=int, default=OPS)
    ap.add_argument("--live", type=int, default=LIVE)
    ap.add_argument("--steps", type=int, default=STEPS, help="steps of the training trace")
    ap.add_argument("--write-trace", metavar="FILE", help="also write the churn as text")
    ap.add_argument("--traces", nargs="*", default=[str(TRACES)], metavar="CSV|DIR",
                    help="recorded traces (emmpool.trace CSV; a folder: its *.csv, as "
                         "mixed_programs.py --traces writes them) replayed too, each in a "
                         "table of its own, emmpool-host-behind added (the GPU behind the "
                         "program until each recorded synchronization) [benchmarks/traces]")
    ap.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS,
                    help="recorded traces: steps before page maps are counted per step "
                         f"[{WARMUP_STEPS}: the recordings' warm-up cycle]")
    args = ap.parse_args(argv)

    trace = make_trace(args.seed, args.live, args.ops)
    if args.write_trace:
        write_trace(args.write_trace, trace)
    churn = replay_all(replay.from_slots(*trace), args.backends)
    training = replay_all(training_trace.make(args.steps, args.seed)[0], args.backends)
    recorded_backends = list(dict.fromkeys([*args.backends, "emmpool-host-behind"]))
    recorded, steps = {}, {}
    for path in recorded_traces(args.traces):
        ops = replay.from_records(trace_io.read_csv(path))
        steps[path.stem] = sum(1 for op in ops if op[0] == "sync")
        recorded[path.stem] = replay_all(ops, recorded_backends)
        maps_per_step(recorded[path.stem], args.warmup_steps)
    doc = {
        "benchmark": "replay",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "trace": {"generator": "numpy.random.default_rng", "seed": args.seed, "live": args.live,
                  "ops": args.ops, "min_bytes": MIN_BYTES, "max_bytes": MAX_BYTES,
                  "distribution": "log-uniform"},
        "training_trace": {"generator": "benchmarks/training_trace.py", "steps": args.steps,
                           "seed": args.seed},
        "python": platform.python_version(),
        "numpy": np.__version__,
        "results": churn,
        "training_results": training,
        "recorded_results": recorded,
    }
    lines = table(f"Fragmentation replay: {args.live} live, {args.ops} ops, sizes log-uniform "
                  f"{MIN_BYTES} B - {MAX_BYTES >> 20} MiB, seed {args.seed}",
                  args.backends, churn)
    lines += [""] + table(f"A training loop whose shapes change every step "
                          f"(benchmarks/training_trace.py): {args.steps} steps, seed {args.seed}",
                          args.backends, training)
    for name, results in recorded.items():
        lines += [""] + table(f"Recorded: {name} ({steps[name]} steps, the first "
                              f"{args.warmup_steps} a warm-up)", recorded_backends, results,
                              per_step=True)
    harness.write_results(args.out, "replay", doc, "\n".join(lines) + "\n", indent=2)
    failed = [r for results in (churn, training, *recorded.values()) for r in results.values()]
    return 1 if any(r["status"] == "error" for r in failed) else 0


if __name__ == "__main__":
    sys.exit(main())

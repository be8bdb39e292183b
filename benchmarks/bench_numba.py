#!/usr/bin/env python
"""Numba allocation benchmark: emmpool against anchor EMM plugins.

    python benchmarks/bench_numba.py --out DIR [--quick] [--pairing in-process|process]

Numba's EMM plugin is installed once per process, before its CUDA context exists, so this parent
starts child processes (numba_cases.py): by default one per round, in which emmpool is installed
and the other managers are swapped in beside it block by block (--pairing in-process: ratios to
the floor taken within the process), or one per manager and round (--pairing process). Each
child prints one result line; the parent writes ``DIR/bench_numba.json`` and ``.md``
(``bench_numba_process.*`` for the process pairing) and prints the markdown table.
See benchmarks/README.md for what each case measures and why the pairing.
"""

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

import baselines
import cpus
import harness
import numba_cases
from numba_cases import FLOOR, FULL, QUICK, SUITES


def _run_child(name, extra_env, args, guests=None):
    env = dict(os.environ, **extra_env)
    # Only set_memory_manager() may choose the plugin.
    env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--suite", args.suite]
    if args.quick:
        cmd.append("--quick")
    if args.budget is not None:
        cmd += ["--budget", str(args.budget)]
    if guests is not None:
        cmd += ["--guests", ",".join(guests)]
    timeout = 180 if args.quick else 600
    t0 = time.perf_counter()
    try:
        # stdout carries the result line; stderr (progress, warnings,
        # tracebacks) goes straight to the terminal.
        proc = subprocess.run(cmd, env=env, cwd=numba_cases.REPO, stdout=subprocess.PIPE,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"manager": name, "failed": f"timed out after {timeout} s"}
    wall = time.perf_counter() - t0

    result = harness.result_of(proc.stdout) or {
        "manager": name, "failed": f"child exited {proc.returncode} without a result"}
    result["wall_s"] = round(wall, 2)
    return result


def _fmt_us(us):
    if us < 10:
        return f"{us:.2f}"
    if us < 100:
        return f"{us:.1f}"
    return f"{us:.0f}"


def _method(report):
    """The markdown's paragraph on what a cell quotes."""
    blocks = (f"A process's figure is the median over {report['repeats']} timed blocks of the "
              "mean per-op time (device synchronised at block ends)"
              + (f", after {report['warmup_s']:g} s of warm-up per case"
                 if "warmup_s" in report else "") + ".")
    if report.get("pairing") == "in-process":
        return (
            f"µs per op. **Quoted: the median over {report['rounds']} rounds of the ratio to "
            f"the `{FLOOR}` floor measured in the same process** (Numba's own per-allocation "
            "overhead): in each round one process installs emmpool and swaps the other "
            "managers in block by block (A B C, C B A, ...), and the round's ratio is the "
            "median of each block's ratio to the floor's block beside it. A host's speed "
            "drifts over seconds; blocks a fraction of a second apart share the drift. "
            "A cell: median µs over rounds, (median ratio), and the lowest–highest round's "
            "ratio. A build or mode of emmpool other than the first (`emmpool@NAME`, "
            "benchmarks/baselines.py) runs in its own process per round, with the floor. "
            + blocks + " Every round and block is in the JSON.")
    return (
        f"µs per op. **Quoted: the median over interleaved rounds** (one process per manager "
        f"and round; {report['rounds']} rounds for the floor, emmpool and earlier builds "
        "(`emmpool@NAME`, benchmarks/baselines.py), "
        f"{report.get('anchor_rounds', report['rounds'])} for the other managers, the floor "
        "running in every round); after it, `best`: the best round. "
        + blocks + " In parentheses: the ratio to the "
        f"`{FLOOR}` floor's figure of the same kind (median to median, best to best): "
        "Numba's own per-allocation overhead. Every round is in the JSON.")


def _markdown(report):
    managers = report["managers"]
    cases = report["cases"]
    floor = managers.get(FLOOR, {}).get("cases", {})
    lines = [
        "# Numba allocation benchmark"
        + (" (pinned host memory)" if report.get("suite") == "pinned" else ""),
        "",
        f"- GPU: {report.get('gpu', '?')}"
        + (f" (cc {'.'.join(map(str, report['compute_capability']))})"
           if report.get("compute_capability") else "")
        + (f", driver {'.'.join(map(str, report['driver_version']))}"
           if report.get("driver_version") else ""),
        f"- numba-cuda {report.get('numba_cuda', '?')}, "
        + ", ".join(f"{k} {v}" for k, v in report.get("versions", {}).items()
                    if k != "numba-cuda"),
        f"- {report['timestamp']}, {'quick' if report['quick'] else 'full'} run, "
        + (f"CPUs {report['cpus']} (near the GPU)" if report.get("cpus") else "CPUs not pinned"),
        "",
        _method(report),
        "",
        "| manager | " + " | ".join(cases) + " |",
        "|---|" + "---:|" * len(cases),
    ]
    notes = []

    def note(text):
        notes.append(" ".join(str(text).split()))  # keep each note on one line

    if report.get("rounds_asked", report["rounds"]) > report["rounds"]:
        note(f"- stopped after {report['rounds']} of {report['rounds_asked']} rounds: the next "
             "would have passed the time limit (--time-limit, EMMCI_BENCH_DEADLINE)")

    for name in managers:
        r = managers.get(name)
        if r is None:
            continue
        label = f"{name} (floor)" if name == FLOOR else name
        if "skipped" in r or "failed" in r:
            kind = "skipped" if "skipped" in r else "failed"
            note(f"- `{name}` {kind}: {r[kind]}")
            lines.append(f"| {label} | " + " | ".join([kind] * len(cases)) + " |")
            continue
        checks = r.get("checks", {})
        for check, status in checks.items():
            if not str(status).startswith(("ok", "n/a")):
                note(f"- `{name}` check {check}: {status}")
        failed_case = {
            "churn": not str(checks.get("churn_disjoint", "ok")).startswith(("ok", "n/a")),
            "alloc_axpy": not str(checks.get("axpy", "ok")).startswith("ok"),
        }
        cells = []
        for case in cases:
            c = r.get("cases", {}).get(case)
            if c is None or "error" in c:
                cells.append("error")
                if c is not None:
                    note(f"- `{name}` {case}: {c['error']}")
                continue
            cell = _fmt_us(c["us_per_op"])
            f = floor.get(case, {}).get("us_per_op")
            if "ratio_to_floor" in c:  # in-process pairing: the ratio within each process
                cell += f" ({c['ratio_to_floor']:.2f}×)"
                if len(c["rounds_ratio"]) > 1:
                    cell += f" {min(c['rounds_ratio']):.2f}–{max(c['rounds_ratio']):.2f}"
            elif f:
                cell += f" ({c['us_per_op'] / f:.2f}×)"
            best, floor_best = c.get("best_us"), floor.get(case, {}).get("best_us")
            if "ratio_to_floor" not in c and best is not None and len(c.get("rounds_us", ())) > 1:
                cell += f" best {_fmt_us(best)}"
                if floor_best:
                    cell += f" ({best / floor_best:.2f}×)"
            if failed_case.get(case):
                cell += " ✗"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        work = []
        for case, c in r.get("cases", {}).items():
            if "pool_per_op" in c:
                counts = ", ".join(f"{v:.3g} {k}" for k, v in c["pool_per_op"].items() if v)
                work.append(f"{case}: {counts or 'none'}")
        if work:
            note(f"- `{name}` pool work per op (last round; zero counts left out): "
                 + "; ".join(work))
    if notes:
        lines += ["", "Notes:", ""] + notes + ["", "✗ = correctness check failed."]
    return "\n".join(lines) + "\n"


def _ok_rounds(results):
    """The rounds that ran (neither failed nor skipped), or None if any did not."""
    ok = [r for r in results if "cases" in r and "failed" not in r and "skipped" not in r]
    return ok if ok and len(ok) == len(results) else None


def _merged_cell(timed):
    """One case of one manager over the rounds that timed it (oldest first): the last round's
    cell with the median over rounds quoted (us_per_op, and ratio_to_floor where the rounds
    have one), the best round next to it, and every round kept.

    The median: on the GPU hosts used, now and then a whole process (the floor's as much as any
    other) runs at about half speed, which the median of five or more rounds passes over and a
    median of three may not."""
    values = [c["us_per_op"] for c in timed]
    cell = dict(timed[-1])
    cell.update(us_per_op=statistics.median(values), best_us=min(values), rounds_us=values)
    ratios = [c["ratio_to_floor"] for c in timed if "ratio_to_floor" in c]
    if ratios:
        cell.update(ratio_to_floor=statistics.median(ratios), rounds_ratio=ratios)
    return cell


def _merge_rounds(results):
    """One manager's results over rounds (process pairing), each case by _merged_cell."""
    ok = _ok_rounds(results)
    if ok is None:
        return results[-1]
    merged = dict(ok[-1])
    merged["cases"] = {}
    for case in ok[-1]["cases"]:
        timed = [r["cases"][case] for r in ok if "us_per_op" in r["cases"].get(case, {})]
        # an error in every round: keep the last one's message
        merged["cases"][case] = _merged_cell(timed) if timed else dict(ok[-1]["cases"][case])
    merged["rounds"] = len(ok)
    return merged


def _merge_paired(rounds):
    """The in-process pairing's results over rounds: {home: [child result per round]} ->
    {manager: merged}, each manager once (the floor from the first child; a later home's
    child has the floor only for its own ratios). A cell quotes the median over rounds of the
    manager's figure and of its ratio to the floor of the same process (`ratio_to_floor`, each
    round's the median of its block ratios), and keeps every round."""
    managers = {}
    for home, results in rounds.items():
        ok = _ok_rounds(results)
        if ok is None:
            managers[home] = results[-1]
            continue
        last = ok[-1]
        for name, why in last.get("skipped_guests", {}).items():
            managers.setdefault(name, {"manager": name, "skipped": why})
        for name in last["paired"]:
            if name in managers:
                continue
            merged = {k: v for k, v in last.items()
                      if k not in ("cases", "checks", "paired", "skipped_guests", "manager",
                                   "emmpool_stats", "manager_class")}
            merged.update(manager=name, rounds=len(ok), checks=last["checks"].get(name, {}),
                          cases={})
            if name == home:
                for k in ("emmpool_stats", "manager_class"):
                    if k in last:
                        merged[k] = last[k]
            for case, cell in last["cases"].items():
                timed = [r["cases"][case][name] for r in ok
                         if "us_per_op" in r["cases"].get(case, {}).get(name, {})]
                merged["cases"][case] = _merged_cell(timed) if timed else {
                    "error": cell.get("error", "no round timed it")}
            managers[name] = merged
    return managers


def parent_main(args):
    knobs = dict(QUICK if args.quick else FULL)
    if args.budget is not None:
        knobs["budget"] = args.budget
    suite_managers, suite_cases, _, stem, _ = SUITES[args.suite]
    # Earlier builds (EMMCI_BENCH_BASELINES), timed in every round like emmpool itself; the
    # other managers (anchors) in the first --anchor-rounds only.
    earlier = [(f"emmpool@{name}", {"EMMPOOL_MODE": "pool", **baselines.child_env(path)})
               for name, path in baselines.baselines()]
    every_round = {FLOOR, "emmpool", *(name for name, _ in earlier)}
    suite_managers = list(suite_managers) + (earlier if args.suite == "device" else [])
    selected = [m for m in suite_managers if not args.managers or m[0] in args.managers]
    if not selected:
        sys.exit(f"none of {args.managers} runs in the {args.suite} suite "
                 f"(it has: {', '.join(m for m, _ in suite_managers)})")

    # Managers run in interleaved rounds (A B C ... A B C ...) and each cell is the median
    # over rounds: a GPU's clocks and a host's load drift over minutes, and a drift must not
    # land on one manager alone.
    pinned_cpus = cpus.pin_near_gpu(args.cpus)  # the children inherit it
    print(f"[bench] CPUs: {pinned_cpus or 'not pinned'}", file=sys.stderr, flush=True)
    paired = args.pairing == "in-process" and args.suite == "device"
    if paired:
        # One child per emmpool build or mode and round: the first also hosts every other
        # manager selected, the floor always (its ratios are taken within the process).
        homes = [(n, env) for n, env in selected if n.startswith("emmpool")]
        if not homes:
            sys.exit("--pairing in-process needs an emmpool manager (it is the one installed)")
        guests = [FLOOR] + [n for n, _ in selected if not n.startswith("emmpool") and n != FLOOR]
        jobs = [(home, env, guests if i == 0 else [FLOOR], True)
                for i, (home, env) in enumerate(homes)]
    else:
        jobs = [(n, env, None, n in every_round) for n, env in selected]
        if args.suite == "device":
            stem += "_process"
    rounds: dict[str, list] = {name: [] for name, *_ in jobs}
    anchor_rounds = min(args.rounds, args.anchor_rounds)
    deadline = harness.Deadline(args.time_limit)
    done = 0

    def runs_in(rnd, name, every_round):
        if rounds[name] and ("skipped" in rounds[name][0] or "failed" in rounds[name][0]):
            return False
        # an anchor runs in the first rounds only: five rounds or more fit a step's budget
        return every_round or rnd < anchor_rounds

    for rnd in range(args.rounds):
        if rnd > 0:
            # Whole rounds only (a round is what keeps the managers' drift fair); the next is
            # guessed from each child's last run.
            guess = sum(rounds[name][-1].get("wall_s", 0) for name, _, _, every in jobs
                        if runs_in(rnd, name, every))
            if not deadline.allows(guess):
                print(f"[bench] stopping after {rnd} of {args.rounds} rounds: the next "
                      f"(~{guess:.0f} s) would pass the deadline", file=sys.stderr, flush=True)
                break
        for name, extra_env, with_guests, every in jobs:
            if not runs_in(rnd, name, every):
                continue
            beside = f" with {', '.join(with_guests)}" if with_guests else ""
            print(f"[bench] round {rnd + 1}/{args.rounds}: {name}{beside} ...", file=sys.stderr,
                  flush=True)
            r = _run_child(name, extra_env, args, guests=with_guests)
            rounds[name].append(r)
            status = ("skipped: " + r["skipped"]) if "skipped" in r else (
                ("FAILED: " + r["failed"]) if "failed" in r else "ok")
            print(f"[bench] {name}: {status} ({r.get('wall_s', '?')} s)",
                  file=sys.stderr, flush=True)
        done = rnd + 1
    managers = _merge_paired(rounds) if paired else {
        name: _merge_rounds(rs) for name, rs in rounds.items()}

    first = next((r for r in managers.values() if "gpu" in r), {})
    now = datetime.datetime.now(datetime.timezone.utc)
    gpu = first.get("gpu", "unknown-gpu")
    report = {
        "gpu": gpu,
        "compute_capability": first.get("compute_capability"),
        "driver_version": first.get("driver_version"),
        "numba_cuda": first.get("versions", {}).get("numba-cuda")
        or numba_cases.versions().get("numba-cuda"),
        "versions": first.get("versions", numba_cases.versions()),
        "timestamp": now.isoformat(timespec="seconds"),
        "quick": args.quick,
        "budget_s_per_case": knobs["budget"],
        "repeats": knobs["repeats"],
        "warmup_s": knobs["warmup_s"],
        "rounds": done,
        "rounds_asked": args.rounds,
        "anchor_rounds": done if paired else min(anchor_rounds, done),
        "quoted": ("median over rounds of ratio_to_floor (each round's: the median of its "
                   "blocks' ratios to the floor's blocks beside them) and of us_per_op"
                   if paired else "median over rounds (us_per_op); best_us: the best round"),
        "cpus": pinned_cpus,
        "pairing": "in-process" if paired else "process",
        "floor": FLOOR,
        "suite": args.suite,
        "cases": suite_cases,
        "managers": managers,
    }
    harness.write_results(args.out, stem, report, _markdown(report), indent=2)
    print(f"wrote {stem}.json and {stem}.md to {args.out} (the current results of a GPU kind: "
          f"benchmarks/results/<GPU>/, written by .ci/gpu-results)")
    ran = [r for r in managers.values() if "skipped" not in r]
    return 1 if any("failed" in r for r in ran) else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output directory (required)")
    p.add_argument("--quick", action="store_true",
                   help="few iterations; a smoke test (< 1 min)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per case per manager (default 1.0, quick 0.15)")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds over the managers; cells quote the median over "
                        "rounds, the best round next to it (default 5)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="start no round that would end more than S seconds from now (by the "
                        "last round's time); the results keep the rounds run (at least one)")
    p.add_argument("--anchor-rounds", type=int, default=2,
                   help="with --pairing process: rounds (the first ones) in which the managers "
                        "other than the floor and emmpool run (default 2)")
    p.add_argument("--cpus", type=int, default=4,
                   help="pin every process to this many CPUs near the GPU; 0: no pinning "
                        "(default 4)")
    p.add_argument("--managers", nargs="+", metavar="NAME",
                   help="run only these managers (emmpool@NAME: an earlier build named in "
                        "EMMCI_BENCH_BASELINES, see baselines.py)")
    p.add_argument("--pairing", choices=("in-process", "process"), default="in-process",
                   help="in-process (default): each round is one process in which emmpool is "
                        "installed and the other managers swapped in block by block, and the "
                        "ratios are taken within it; process: one process per manager and "
                        "round (each installed alone; timed minutes apart)")
    p.add_argument("--suite", choices=sorted(SUITES), default="device",
                   help="device allocations (default) or pinned host memory")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--guests", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        knobs = dict(QUICK if args.quick else FULL)
        if not args.quick:
            knobs.update(SUITES[args.suite][4])
        if args.budget is not None:
            knobs["budget"] = args.budget
        guests = args.guests.split(",") if args.guests else None
        return numba_cases.child_main(args.child, knobs, args.suite, guests)
    if not args.out:
        p.error("--out DIR is required")
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())

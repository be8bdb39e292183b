"""The tables, goals and pictures of mixed_programs.py, from its document alone (a run's, or
several merged: they render the same way), and the merge.

The document: {"benchmark": "mixed_programs", "gpu": name, "runs": {run id: what the run was},
"results": {program: {setup: {"not_run": why} or {"timing": {"scale", "run", "rounds": [a
child's result, ...]}, "capacity": {"largest", "smallest_failing", "resolution", "probes",
"budget", "run", ...}}}}, "warmup": [...]}.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import mixed_workloads as work
from harness import gib

NAME = "mixed_programs"
GiB = 1 << 30
MiB = 1 << 20
CHECK_TOLERANCE = 1e-4
GOAL_PEAK = 0.8         # emmpool's peak at most this times the separate pools'
GOAL_CAPACITY = 1.25    # its largest scale in B at least this times theirs
GOAL_TIME = 1.02        # its time per step at most this times the fastest setup's


def ms_per_step(result: dict) -> float | None:
    cycles = result.get("cycle_s")
    if not cycles:
        return None
    return statistics.median(cycles) / work.STEPS_PER_CYCLE * 1e3


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
    times = [t for t in (ms_per_step(r) for r in ok) if t is not None]
    if times:
        out.update(ms_median=statistics.median(times), ms_best=min(times), ms_rounds=times)
    out["checks"] = ok[0].get("checks")
    out["rounds_agree"] = all(_rel_diff(r.get("checks"), out["checks"]) <= CHECK_TOLERANCE
                              for r in ok[1:])
    out["serves"] = ok[0].get("serves")
    if ok[-1].get("pool_work"):
        out["pool_work"] = ok[-1]["pool_work"]
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
    parts = [f"{k} {gib(v)}" for k, v in counted.items()]
    text = " + ".join(parts)
    if len(parts) > 1:
        text += f" = {gib(a.get('total'))}"
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
            f"B = {gib(budget)} GiB of the device left beyond the CUDA context (±: the "
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
                f"| {setup} | {check} | {gib(row.get('peak'))}{_x(row.get('x_separate_peak'))}"
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
        work_lines = [f"- {setup}: " + (", ".join(f"{v:.3g} {k}" for k, v in w.items() if v)
                                        or "none")
                      for setup, w in ((s, r.get("pool_work")) for s, r in rows.items()) if w]
        if work_lines:
            lines += ["", "emmpool's driver work and waits per timed step (its last round; "
                      "zero counts left out):", "", *work_lines]
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
                         + ", ".join(gib(b) for b in sorted(budgets)))
    if replaced:
        last = list(merged["runs"])[-1]
        merged["runs"][last].setdefault("notes", []).append(
            "merged: taken from the later run: " + ", ".join(replaced))
    return merged

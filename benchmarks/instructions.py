"""Instructions per allocate+deallocate pair of the core, row by row of `bench_core --host
--quick`, counted by callgrind: a figure that does not move with the machine's speed, for "the
hot paths cost what they did" between two builds. (On a shared GPU host, timings of one build
move more between processes than the few percent such a change is held to.)

    python benchmarks/instructions.py BENCH_CORE [BASELINE_BENCH_CORE] [--out DIR]
        [--runs 3] [--rename 'OLD=NEW' ...]

BENCH_CORE is a bench_core binary (cmake -DEMMPOOL_BUILD_BENCHMARKS=ON), run with --pairs (fixed
counts, not sized by the clock) where it takes it; an older build's counts move a few percent
with the machine's load, as its blocks are sized by the clock. A baseline's rows are
paired with this one's by label and size; --rename gives a baseline label prefix the name the
same configuration has now (where a default changed, say). Each binary runs --runs times and
each row's median run is shown, with this build's range: a row can take one of two paths from
one run to the next (fixed segments, stream-ordered, 4 MiB: about 530 or 700 instructions a
pair, in builds before and after the core's refactor alike). Needs valgrind. Prints the table;
writes DIR/instructions.md and .json with --out.

With --timed ROUNDS (on a GPU, no valgrind), the two binaries run `bench_core --quick` in turns,
ROUNDS times each (in the opposite order every other round), and each row gives this build's
median over the rounds of its fastest block's ns per pair, and the median of its ratio to the
baseline's run of the same round: neighbours in time, so that the host's drift between
processes cancels. The anchors' rows (code neither build changed) show how far one round's
ratio still moves.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# What one pair runs, inclusive of everything it calls (its fences, the driver seam).
CALLS = {"allocate": "device_pool::allocate(", "deallocate": "device_pool::deallocate("}
ROW = re.compile(r"^(emmpool .+?)\s{2,}(\d+ [KMG]?i?B)\s")


def per_call(dump: str) -> dict[str, tuple[int, int]]:
    """{name: (calls, inclusive instructions)} of CALLS in one callgrind dump's text."""
    names: dict[str, str] = {}
    out: dict[str, list[int]] = {}
    callee, pending = None, False
    for line in dump.splitlines():
        m = re.match(r"(c?)fn=\((\d+)\)(?: (.*))?$", line)
        if m:
            if m[3]:
                names[m[2]] = m[3]
            if m[1]:
                callee = names.get(m[2], "")
            continue
        if line.startswith("calls="):
            pending = True
            count = int(line.split("=", 1)[1].split()[0])
            for key, pattern in CALLS.items():
                if callee and pattern in callee:
                    out.setdefault(key, [0, 0])[0] += count
            continue
        if pending:  # the cost line under calls=: position, then inclusive instructions
            pending = False
            fields = line.split()
            for key, pattern in CALLS.items():
                if callee and pattern in callee and len(fields) > 1:
                    out[key][1] += int(fields[1])
    return {k: (v[0], v[1]) for k, v in out.items()}


PAIRS = 2000  # per block, where bench_core takes --pairs


def fixed_counts(binary: str) -> bool:
    """Whether `binary` takes --pairs (older builds size their blocks by the clock: their
    counts move a few percent with the machine's load)."""
    p = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    return "--pairs" in p.stdout + p.stderr


def rows_of(binary: str, workdir: Path) -> list[dict]:
    """Each row of bench_core --host --quick: its label, size and instructions per pair."""
    if shutil.which("valgrind") is None:
        raise SystemExit("instructions.py needs valgrind (apt install valgrind)")
    out = workdir / "cg"
    fixed = ["--pairs", str(PAIRS)] if fixed_counts(binary) else []
    # A dump before each row's measure(): dump k holds row k-1's work, the last file the last
    # row's (callgrind writes it at exit).
    p = subprocess.run(["valgrind", "--tool=callgrind", "--dump-before=*measure(*",
                        f"--callgrind-out-file={out}", binary, "--host", "--quick", *fixed],
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"{binary} under callgrind failed ({p.returncode}):\n{p.stderr[-2000:]}")
    labels = [(m[1].strip(), m[2]) for m in map(ROW.match, p.stdout.splitlines()) if m]
    dumps = sorted(workdir.glob("cg.*"), key=lambda f: int(f.suffix[1:]))[1:] + [out]
    if len(dumps) != len(labels):
        raise SystemExit(f"{binary}: {len(labels)} rows but {len(dumps)} callgrind dumps")
    rows = []
    for (label, size), dump in zip(labels, dumps):
        calls = per_call(dump.read_text())
        each = {k: calls[k][1] / calls[k][0] for k in CALLS if calls.get(k, (0, 0))[0]}
        rows.append({"row": label, "size": size, "pairs": calls.get("allocate", (0, 0))[0],
                     **each, "pair": sum(each.values())})
    return rows


def medians(runs: list[list[dict]]) -> list[dict]:
    """Row by row (the first run's rows): the run with the median instructions per pair (the
    lower of the two middle ones), and the range over `runs`."""
    rows = []
    for i, first in enumerate(runs[0]):
        same = sorted((run[i] for run in runs if i < len(run) and run[i]["row"] == first["row"]),
                      key=lambda r: r["pair"])
        # the run whose pair is the median, whole: its allocate and deallocate add up to it
        row = dict(same[(len(same) - 1) // 2])
        row["range"] = [same[0]["pair"], same[-1]["pair"]]
        rows.append(row)
    return rows


def renamed(label: str, renames: list[tuple[str, str]]) -> str:
    """`label` with the longest OLD prefix of `renames` replaced by its NEW."""
    best = max((r for r in renames if label.startswith(r[0])), key=lambda r: len(r[0]),
               default=None)
    return label if best is None else best[1] + label[len(best[0]):]


def table(rows: list[dict], base: list[dict] | None) -> str:
    head = "| row | size | allocate | deallocate | per pair | range |"
    lines = [head + (" baseline | ÷ baseline |" if base is not None else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if base is not None else "")]
    by_label = {(b["row"], b["size"]): b for b in base or []}
    for r in rows:
        line = (f"| {r['row']} | {r['size']} | {r.get('allocate', 0):.1f} | "
                f"{r.get('deallocate', 0):.1f} | {r['pair']:.1f} | "
                f"{r['range'][0]:.0f}–{r['range'][1]:.0f} |")
        if base is not None:
            b = by_label.get((r["row"], r["size"]))
            line += (" — | — |" if b is None or not b["pair"] or not r["pair"] else
                     f" {b['pair']:.1f} | {r['pair'] / b['pair']:.3f} |")
        lines.append(line)
    return "\n".join(lines)


def size_label(n) -> str:
    """bench_core's byte counts as its table prints them ("256 B", "64 KiB"); "-" for none."""
    if not n:
        return "-"
    unit = next(u for u in range(4) if u == 3 or n % (1024 ** (u + 1)))
    return f"{n // 1024 ** unit} {('B', 'KiB', 'MiB', 'GiB')[unit]}"


def timed_runs(binaries: list[str], rounds: int) -> list[list[dict]]:
    """runs[b][r]: binary b's rows in round r, {(label, size): ns per pair of its fastest
    block} (a block slowed by another process adds time, never takes it away). The binaries
    take turns within each round, in the opposite order every other round (a process that
    starts right after another one may run slower or faster for it)."""
    runs: list[list[dict]] = [[] for _ in binaries]
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "run.json"
        for r in range(rounds):
            order = list(enumerate(binaries))
            for i, binary in order if r % 2 == 0 else order[::-1]:
                p = subprocess.run([binary, "--quick", "--out", str(out)], capture_output=True,
                                   text=True, timeout=300)
                if p.returncode != 0:
                    raise SystemExit(f"{binary} failed ({p.returncode}):\n{p.stderr[-2000:]}")
                runs[i].append({(x["allocator"], size_label(x["size"])): x["min_ns"]
                                for x in json.loads(out.read_text())["results"]})
    return runs


def paired(cur: list[dict], base: list[dict]) -> list[dict]:
    """Row by row of this build's first round: its median ns over the rounds and range, and the
    median (and range) of its ratio to the baseline's same row in the same round."""
    rows = []
    for key in cur[0]:
        ns = sorted(run[key] for run in cur if key in run)
        ratios = sorted(c[key] / b[key] for c, b in zip(cur, base) if key in c and b.get(key))
        row = {"row": key[0], "size": key[1], "ns": statistics.median(ns),
               "range": [ns[0], ns[-1]]}
        if ratios:
            row.update(ratio=statistics.median(ratios), ratio_range=[ratios[0], ratios[-1]])
        rows.append(row)
    return rows


def timed_table(rows: list[dict]) -> str:
    lines = ["| row | size | ns per pair | range | ÷ baseline | its range |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = (f"{r['ratio']:.3f} | {r['ratio_range'][0]:.3f}–{r['ratio_range'][1]:.3f}"
                 if "ratio" in r else "— | —")
        lines.append(f"| {r['row']} | {r['size']} | {r['ns']:.0f} | "
                     f"{r['range'][0]:.0f}–{r['range'][1]:.0f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_core")
    ap.add_argument("baseline", nargs="?")
    ap.add_argument("--out")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW")
    ap.add_argument("--timed", type=int, metavar="ROUNDS")
    args = ap.parse_args(argv)
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    if any(len(r) != 2 for r in renames):
        ap.error("--rename takes OLD=NEW")
    if args.timed:
        if not args.baseline:
            ap.error("--timed needs a baseline")
        cur, base = timed_runs([args.bench_core, args.baseline], args.timed)
        base = [{(renamed(k[0], renames), k[1]): v for k, v in run.items()} for run in base]
        print(f"ns per allocate+deallocate pair on the GPU (each run's fastest block), "
              f"bench_core --quick, {args.timed} rounds taking turns with the baseline\n\n"
              + timed_table(paired(cur, base)))
        return 0

    def runs(binary: str) -> list[dict]:
        out = []
        for _ in range(max(1, args.runs)):
            with tempfile.TemporaryDirectory() as d:
                out.append(rows_of(binary, Path(d)))
        return medians(out)

    rows = runs(args.bench_core)
    base = runs(args.baseline) if args.baseline else None
    for b in base or []:
        b["row"] = renamed(b["row"], renames)
    text = ("Instructions per call of device_pool's allocate and deallocate (inclusive), "
            f"bench_core --host --quick under callgrind, median of {max(1, args.runs)} runs"
            "\n\n" + table(rows, base))
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "instructions.md").write_text(text + "\n")
        (out / "instructions.json").write_text(json.dumps(
            {"benchmark": "instructions", "rows": rows, "baseline": base}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

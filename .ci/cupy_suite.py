#!/usr/bin/env python3
"""CuPy's own test suite, once with CuPy's pool and once with emmpool's, compared by test name.

    python3 .ci/cupy_suite.py [--tests .cupy-tests] [--out DIR] [--jobs N] [--timeout S]
                              [--subset PATH ...] [--part K/N] [--label GPU-DATE]
    python3 .ci/cupy_suite.py --merge RUN [RUN ...] [--out DIR]

The tests come from CuPy's repository at the release installed here (``bash .ci/gpu-cupy-tests``
puts them in .cupy-tests/). Both runs start at the same time, each with half of ``--jobs``
pytest-xdist workers, and load a small pytest plugin (.ci/emmpool_cupy_suite_plugin.py): in the
emmpool run it calls ``emmpool.use_for_cupy()`` in every worker at configure time and records,
at the end, how many allocations CuPy made through emmpool in that worker (proof that the run
used it).

Written to --out: ``cupy-<run>.log`` (pytest -v: one line per test, so a run cut short by
--timeout still counts what it ran), ``cupy-part.json`` (what ran: the part, the subset, each
run's exit status), and ``<label>-cupy-suite.txt`` (``-partKofN`` with ``--part K/N``), which
docs/gpu-testing.md explains, as it does the parts and ``--merge`` (each RUN a --out folder of
this script, or an OUTDIR of .ci/gpu.py). Both runs share one CuPy kernel cache, so that each
kernel is compiled once (the cache is content-addressed and written atomically).

Exit status 0 only when there is no regression, both runs ran (to their end, for --merge: every
part, each complete), and every emmpool worker used emmpool.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGIN = "emmpool_cupy_suite_plugin"  # HERE/emmpool_cupy_suite_plugin.py
RUNS = {"cupy-pool": "cupy", "emmpool": "emmpool"}  # run -> its EMMCI_CUPY_SUITE

SUBSET = [
    "tests/cupy_tests/core_tests",
    "tests/cupy_tests/creation_tests",
    "tests/cupy_tests/manipulation_tests",
    "tests/cupy_tests/indexing_tests",
    "tests/cupy_tests/sorting_tests",
    "tests/cupy_tests/statistics_tests",
    "tests/cupy_tests/linalg_tests",
    "tests/cupy_tests/cuda_tests/test_stream.py",
]

# pytest -v, one line a test. With pytest-xdist: "[gw3] [ 12%] PASSED tests/x.py::T::test_y" (a
# crashed worker's test is reported as FAILED by xdist); without it:
# "tests/x.py::T::test_y PASSED [ 12%]" or "... SKIPPED (why) [ 12%]". Other lines (subtests'
# SUBPASSED, the short summary's "FAILED name - why") match neither.
_STATUSES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_XDIST_LINE = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({_STATUSES}) (\S.*?)\s*$")
_PLAIN_LINE = re.compile(rf"^(\S+::\S.*?) ({_STATUSES})(?: \(.*\))?(?: +\[\s*\d+%\])?\s*$")
_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
           "XFAIL": "xfailed", "XPASS": "xpassed"}


def log_lines(log: Path) -> list[str]:
    """A log's lines; none where it is missing."""
    return log.read_text(errors="replace").splitlines() if log.exists() else []


def outcomes(log: Path) -> dict[str, str]:
    """Test id -> passed / failed / error / skipped / xfailed / xpassed, from a -v log."""
    return outcomes_in(log_lines(log))


def outcomes_in(lines: list[str]) -> dict[str, str]:
    """outcomes() of a -v log's lines."""
    out: dict[str, str] = {}
    for line in lines:
        m = _XDIST_LINE.match(line)
        if m:
            status, name = m.group(1), m.group(2)
        else:
            m = _PLAIN_LINE.match(line)
            if not m:
                continue
            name, status = m.group(1), m.group(2)
        # A test may appear twice (a teardown error after a pass): the worse outcome wins.
        if out.get(name) in ("failed", "error"):
            continue
        out[name] = _STATUS[status]
    return out


def crashed_workers(log: Path) -> list[str]:
    return [line.strip() for line in log_lines(log)
            if "crashed while running" in line or "node down" in line]


def wait_or_stop(p: subprocess.Popen, seconds: float):
    """The exit status of `p` (started with start_new_session=True), or "timeout (status)" once
    its process group was stopped after `seconds`."""
    try:
        return p.wait(timeout=max(1, seconds))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 15)
        try:
            rc = p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            rc = p.wait()
        return f"timeout ({rc})"


def tally(results: dict[str, str]) -> str:
    return ", ".join([f"{len(results)} tests",
                      *(f"{k} {v}" for k, v in sorted(Counter(results.values()).items()))])


def run_counts(run: str, results: dict[str, str], rc, secs: int) -> str:
    return f"{run:10s} exit {rc} in {secs} s: " + tally(results)


def preflight_child(code: str, hint: str) -> tuple[str | None, dict]:
    """(Why a suite cannot run here or None, the JSON of the last line `code` prints, which
    says "gpus"), from a child process: this one does not touch the GPU. `hint` follows the
    last line a failed child wrote to stderr."""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return f"{(p.stderr.strip().splitlines() or ['?'])[-1]} ({hint})", {}
    info = json.loads(p.stdout.strip().splitlines()[-1])
    return (None if info["gpus"] else "no CUDA GPU"), info


def compare(base: dict[str, str], ours: dict[str, str], base_name: str, ours_name: str = "emmpool",
            list_not_reached: bool = False) -> tuple[list[str], list[tuple[str, str]]]:
    """The report's comparison lines, and the regressions: tests that pass in the `base` run and
    were reached by `ours` without passing. Tests that only one run reached (the other's timeout)
    are counted apart, listed too with `list_not_reached`."""
    regressions, not_reached = [], []
    for name, st in sorted(base.items()):
        if st != "passed":
            continue
        got = ours.get(name)
        if got is None:
            not_reached.append(name)
        elif got != "passed":
            regressions.append((name, got))
    compared = sum(1 for n in base if n in ours)
    fixed = sorted(n for n, st in ours.items()
                   if st == "passed" and base.get(n) not in (None, "passed"))
    lines = [
        f"compared by name (reached by both runs): {compared}; passed with {base_name} but not "
        f"reached by the {ours_name} run before its timeout: {len(not_reached)}; reached only by "
        f"the {ours_name} run: {sum(1 for n in ours if n not in base)}",
        "",
        f"REGRESSIONS (pass with {base_name}, not with {ours_name}): {len(regressions)}",
        *[f"  {name}: {got}" for name, got in regressions],
        "",
    ]
    if list_not_reached:
        lines += [f"NOT REACHED by the {ours_name} run (pass with {base_name}): {len(not_reached)}",
                  *[f"  {name}" for name in not_reached], ""]
    lines += [f"pass with {ours_name}, not with {base_name}: {len(fixed)}",
              *[f"  {name}: {base.get(name)}" for name in fixed[:50]]]
    return lines, regressions


def run_both(args, root: Path, out: Path) -> dict:
    """Both runs at once; {run: (exit status or "timeout (status)", seconds)}."""
    procs = {}
    cache = Path(tempfile.mkdtemp(prefix="emmpool-cupy-suite-")) / "kernel-cache"
    per_run_jobs = max(1, args.jobs // len(RUNS))
    # pytest-timeout, where installed: one test that hangs costs that test only
    per_test = [f"--timeout={args.test_timeout}"] if importlib.util.find_spec("pytest_timeout") \
        else []
    for old in out.glob("emmpool-worker-*.json"):
        old.unlink()
    for run, how in RUNS.items():
        env = dict(os.environ, EMMCI_CUPY_SUITE=how, EMMCI_CUPY_SUITE_OUT=str(out),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(HERE),
                                                            os.environ.get("PYTHONPATH")])),
                   CUPY_CACHE_DIR=str(cache))
        if args.part:
            env["EMMCI_CUPY_SUITE_PART"] = "{}/{}".format(*args.part)
        cmd = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider",
               "-n", str(per_run_jobs), "-v", "-rN", *per_test, *args.subset]
        log = open(out / f"cupy-{run}.log", "w")
        log.write(" ".join(cmd) + "\n")
        log.flush()
        procs[run] = (subprocess.Popen(cmd, cwd=root, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True),
                      log, time.monotonic())
    def stop(signum, frame):  # stopped from outside: the runs go too (sessions of their own)
        for p, _, _ in procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    status = {}
    for run, (p, log, t0) in procs.items():
        rc = wait_or_stop(p, args.timeout - (time.monotonic() - t0))
        log.close()
        status[run] = (rc, round(time.monotonic() - t0))
    return status


def emmpool_line(workers: list[dict]) -> str:
    return (f"emmpool workers that reported (use_for_cupy active): {len(workers)}; CuPy "
            f"allocations through emmpool: {sum(w['cupy_allocations'] for w in workers)}; "
            f"dormant fences: {sum(w['dormant_fences'] for w in workers)}; same-stream reuses: "
            f"{sum(w['same_stream_reuses'] for w in workers)}")


def used_emmpool(workers: list[dict]) -> bool:
    return bool(workers) and all(w["cupy_allocations"] > 0 for w in workers)


def complete(status: dict) -> bool:
    """Both runs ended by themselves (not stopped at the timeout)."""
    return all(not str(rc).startswith("timeout") for rc, _ in status.values())


def run_main(args) -> int:
    root = Path(args.tests).resolve()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import cupy  # noqa: F401 - fail early and clearly if CuPy is missing

    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode().replace(" ", "-")
    label = args.label or f"{gpu}-{datetime.date.today().isoformat()}"
    tag = (root / "TAG").read_text().strip() if (root / "TAG").exists() else "?"
    status = run_both(args, root, out)
    results = {run: outcomes(out / f"cupy-{run}.log") for run in RUNS}
    comparison, regressions = compare(results["cupy-pool"], results["emmpool"], "CuPy's pool")
    # The xdist workers' records (the controller runs no test and allocates nothing).
    workers = [json.loads(p.read_text()) for p in sorted(out.glob("emmpool-worker-gw*.json"))]
    part = list(args.part or (1, 1))
    (out / "cupy-part.json").write_text(json.dumps({
        "part": part, "label": label, "tag": tag, "subset": args.subset,
        "status": {run: list(st) for run, st in status.items()}}, indent=1) + "\n")
    what = f"part {part[0]} of {part[1]} of " if args.part else ""
    lines = [
        f"# CuPy {tag}'s test suite: CuPy's own pool vs emmpool ({label})",
        "",
        f"command: python3 .ci/cupy_suite.py --jobs {args.jobs} --timeout {args.timeout}"
        + (" --part {}/{}".format(*args.part) if args.part else "")
        + f" (each run {max(1, args.jobs // len(RUNS))} xdist workers, both at once)",
        f"{what}subset: {' '.join(args.subset)}",
        "",
    ]
    for run in RUNS:
        rc, secs = status[run]
        lines.append(run_counts(run, results[run], rc, secs))
        for crash in crashed_workers(out / f"cupy-{run}.log"):
            lines.append(f"    {crash}")
    lines += ["", emmpool_line(workers), "", *comparison]
    text = "\n".join(lines) + "\n"
    name = f"{label}-cupy-suite" + ("-part{}of{}".format(*args.part) if args.part else "")
    (out / f"{name}.txt").write_text(text)
    print(text[:6000])
    both_ran = all(results[r] for r in RUNS) and used_emmpool(workers)
    return 0 if both_ran and not regressions else 1


# ---- the parts, merged -----------------------------------------------------------------------
def read_part(source: Path) -> dict[str, str]:
    """A part's files by name (cupy-part.json, cupy-<run>.log, emmpool-worker-*.json), from a
    --out folder, an OUTDIR of .ci/gpu.py (its logs/cupy-suite/, or its logs.tar.gz)."""
    for folder in (source, source / "logs" / "cupy-suite"):
        if (folder / "cupy-part.json").is_file():
            return {p.name: p.read_text(errors="replace") for p in folder.iterdir() if p.is_file()}
    tarball = source / "logs.tar.gz"
    if tarball.is_file():
        found = {}
        with tarfile.open(tarball) as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                parts = parts[1:] if parts and parts[0] == "." else parts
                if member.isfile() and parts[:2] == ("logs", "cupy-suite") and len(parts) == 3:
                    found[parts[2]] = tar.extractfile(member).read().decode("utf-8", "replace")
        if "cupy-part.json" in found:
            return found
    raise ValueError(f"{source}: no CuPy suite run in it (no cupy-part.json, nor a logs.tar.gz "
                     f"holding logs/cupy-suite/cupy-part.json)")


def merge(sources: list[Path]) -> tuple[str, str, bool]:
    """(label, the merged report, whether it holds: every part, each complete, no regression,
    emmpool used)."""
    parts = {}
    for source in sources:
        files = read_part(source)
        info = json.loads(files["cupy-part.json"])
        key = tuple(info["part"])
        if key in parts:
            raise ValueError(f"part {key[0]}/{key[1]} is given twice ({parts[key]['source']} "
                             f"and {source})")
        info["source"] = source
        info["results"] = {run: outcomes_in(files.get(f"cupy-{run}.log", "").splitlines())
                           for run in RUNS}
        info["workers"] = [json.loads(text) for name, text in sorted(files.items())
                           if re.fullmatch(r"emmpool-worker-gw\d+\.json", name)]
        parts[key] = info
    counts = {n for _, n in parts}
    if len(counts) != 1:
        raise ValueError("the parts are of different splits: "
                         + ", ".join(f"{k}/{n}" for k, n in sorted(parts)))
    (n,) = counts
    for what in ("tag", "subset"):
        if len({json.dumps(info[what]) for info in parts.values()}) != 1:
            raise ValueError(f"the parts ran different {what}s: " + "; ".join(
                f"{k}/{n}: {info[what]}" for (k, _), info in sorted(parts.items())))
    first = parts[min(parts)]
    merged = {run: {} for run in RUNS}
    for info in parts.values():
        for run in RUNS:
            merged[run].update(info["results"][run])
    workers = [w for info in parts.values() for w in info["workers"]]
    missing = [k for k in range(1, n + 1) if (k, n) not in parts]
    cut = [k for (k, _), info in sorted(parts.items()) if not complete(info["status"])]
    comparison, regressions = compare(merged["cupy-pool"], merged["emmpool"], "CuPy's pool")
    labels = sorted({info["label"] for info in parts.values()})
    # <GPU>-<date> of each part's run: the first, and the last date where they differ
    label = labels[0] if len(labels) == 1 else f"{labels[0]}-to-{labels[-1][-10:]}"
    lines = [
        f"# CuPy {first['tag']}'s test suite: CuPy's own pool vs emmpool ({', '.join(labels)})",
        "",
        f"command: python3 .ci/cupy_suite.py --part K/{n} for each part K, then --merge",
        f"subset: {' '.join(first['subset'])}",
        f"parts run: {len(parts)} of {n}"
        + (f"; MISSING: {', '.join(f'{k}/{n}' for k in missing)}" if missing else "")
        + (f"; CUT OFF by the timeout: {', '.join(f'{k}/{n}' for k in cut)}" if cut
           else "; each ran to its end with both allocators"),
    ]
    for (k, _), info in sorted(parts.items()):
        lines.append(f"  part {k}/{n} ({info['label']}): " + "; ".join(
            run_counts(run, info["results"][run], *info["status"][run]).replace("  ", " ")
            for run in RUNS))
    lines += [""]
    lines += [f"{run:10s} over the parts: " + tally(merged[run]) for run in RUNS]
    lines += ["", emmpool_line(workers), "", *comparison]
    ok = not missing and not cut and not regressions and used_emmpool(workers) and \
        all(merged[run] for run in RUNS)
    return label, "\n".join(lines) + "\n", ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", default=".cupy-tests", help="root holding CuPy's tests/ [.cupy-tests]")
    ap.add_argument("--out", default="cupy-suite-out")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 2))
    ap.add_argument("--timeout", type=int, default=480, help="seconds per run (both run at once)")
    ap.add_argument("--test-timeout", type=int, default=120,
                    help="pytest-timeout per test, where pytest-timeout is installed [120]")
    ap.add_argument("--subset", nargs="*", default=SUBSET)
    ap.add_argument("--part", metavar="K/N", help="run part K of N of the selection")
    ap.add_argument("--label", default=None, help="results file prefix [<GPU>-<date>]")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="RUN",
                    help="merge the parts' outputs (--out folders or .ci/gpu.py OUTDIRs)")
    args = ap.parse_args(argv)
    if args.merge:
        try:
            label, text, ok = merge(args.merge)
        except ValueError as e:
            ap.error(str(e))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{label}-cupy-suite.txt").write_text(text)
        print(text[:8000])
        print(f"written: {out / f'{label}-cupy-suite.txt'}")
        return 0 if ok else 1
    if args.part is not None:
        m = re.fullmatch(r"(\d+)/(\d+)", args.part)
        if not m or not 1 <= int(m[1]) <= int(m[2]):
            ap.error(f"--part {args.part!r}: expected K/N with 1 <= K <= N")
        args.part = (int(m[1]), int(m[2]))
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())

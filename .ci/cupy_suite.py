#!/usr/bin/env python3
"""CuPy's own test suite, once with CuPy's pool and once with emmpool's, compared by test name.

    python3 .ci/cupy_suite.py [--tests .cupy-tests] [--out DIR] [--jobs N] [--timeout S]
                              [--subset PATH ...] [--label GPU-DATE]

The tests come from CuPy's repository at the release installed here (``bash .ci/gpu-cupy-tests``
puts them in .cupy-tests/). Both runs start at the same time, each with half of ``--jobs``
pytest-xdist workers; the emmpool run loads a small pytest plugin that calls
``emmpool.use_for_cupy()`` in every worker at configure time and records, at the end, how many
allocations CuPy made through emmpool in that worker (proof that the run used it).

Written to --out: ``cupy-<run>.log`` (pytest -v: one line per test, so a run cut short by
--timeout still counts what it ran), and ``<label>-cupy-suite.txt``: counts per run and every
test that passes with CuPy's pool and does not pass with emmpool (a regression: failed,
errored, or crashed its worker). Tests that only one run reached before the timeout are
counted apart as "not reached", not as regressions. Both runs share one CuPy kernel cache, so
that each kernel is compiled once (the cache is content-addressed and written atomically).
Exit status 0 only when there is no regression, both runs ran, and every emmpool worker used
emmpool.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import re
from collections import Counter
from pathlib import Path

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

PLUGIN = textwrap.dedent(
    '''
    """Loaded with -p in every pytest(-xdist) process of the emmpool run."""
    import json, os

    _done = [0]

    def pytest_configure(config):
        if os.environ.get("EMMCI_CUPY_SUITE") == "emmpool":
            import emmpool
            emmpool.use_for_cupy()
            _report()

    def pytest_runtest_logfinish(nodeid, location):
        # Now and then, not only at the end: a run cut short by the timeout never ends.
        _done[0] += 1
        if _done[0] % 50 == 0:
            _report()

    def pytest_sessionfinish(session, exitstatus):
        _report()

    def _report():
        if os.environ.get("EMMCI_CUPY_SUITE") != "emmpool":
            return
        import cupy, emmpool
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        stats = emmpool.stats()
        record = {
            "worker": worker,
            "tests": _done[0],
            "allocator": repr(cupy.cuda.get_allocator()),
            "cupy_allocations": sum(s["by_library"]["cupy"]["allocations"] for s in stats.values()),
            "dormant_fences": sum(s["dormant_fences"] for s in stats.values()),
            "same_stream_reuses": sum(s["same_stream_reuses"] for s in stats.values()),
        }
        path = os.path.join(os.environ["EMMCI_CUPY_SUITE_OUT"], f"emmpool-worker-{worker}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    '''
)


# pytest -v, one line a test. With pytest-xdist: "[gw3] [ 12%] PASSED tests/x.py::T::test_y" (a
# crashed worker's test is reported as FAILED by xdist); without it:
# "tests/x.py::T::test_y PASSED [ 12%]" or "... SKIPPED (why) [ 12%]". Other lines (subtests'
# SUBPASSED, the short summary's "FAILED name - why") match neither.
_STATUSES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_XDIST_LINE = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({_STATUSES}) (\S.*?)\s*$")
_PLAIN_LINE = re.compile(rf"^(\S+::\S.*?) ({_STATUSES})(?: \(.*\))?(?: +\[\s*\d+%\])?\s*$")
_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
           "XFAIL": "xfailed", "XPASS": "xpassed"}


def outcomes(log: Path) -> dict[str, str]:
    """Test id -> passed / failed / error / skipped / xfailed / xpassed, from a -v log."""
    out: dict[str, str] = {}
    if not log.exists():
        return out
    for line in log.read_text(errors="replace").splitlines():
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
    if not log.exists():
        return []
    return [line.strip() for line in log.read_text(errors="replace").splitlines()
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


def run_counts(run: str, results: dict[str, str], rc, secs: int) -> str:
    counts = sorted(Counter(results.values()).items())
    return f"{run:10s} exit {rc} in {secs} s: " + ", ".join(
        [f"{len(results)} tests", *(f"{k} {v}" for k, v in counts)])


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", default=".cupy-tests", help="root holding CuPy's tests/ [.cupy-tests]")
    ap.add_argument("--out", default="cupy-suite-out")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 2))
    ap.add_argument("--timeout", type=int, default=480, help="seconds per run (both run at once)")
    ap.add_argument("--test-timeout", type=int, default=120, help="pytest-timeout per test")
    ap.add_argument("--subset", nargs="*", default=SUBSET)
    ap.add_argument("--label", default=None, help="results file prefix [<GPU>-<date>]")
    args = ap.parse_args()

    root = Path(args.tests).resolve()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import cupy  # noqa: F401 - fail early and clearly if CuPy is missing

    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode().replace(" ", "-")
    label = args.label or f"{gpu}-{datetime.date.today().isoformat()}"
    tag = (root / "TAG").read_text().strip() if (root / "TAG").exists() else "?"
    plugin_dir = Path(tempfile.mkdtemp(prefix="emmpool-cupy-suite-"))
    (plugin_dir / "emmpool_cupy_suite_plugin.py").write_text(PLUGIN)

    runs = {"cupy-pool": "cupy", "emmpool": "emmpool"}
    procs = {}
    cache = plugin_dir / "kernel-cache"
    per_run_jobs = max(1, args.jobs // len(runs))
    for run, how in runs.items():
        env = dict(os.environ, EMMCI_CUPY_SUITE=how, EMMCI_CUPY_SUITE_OUT=str(out),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(plugin_dir), os.environ.get("PYTHONPATH")])),
                   CUPY_CACHE_DIR=str(cache))
        cmd = [sys.executable, "-m", "pytest", "-p", "emmpool_cupy_suite_plugin",
               "-p", "no:cacheprovider", "-n", str(per_run_jobs), "-v", "-rN",
               f"--timeout={args.test_timeout}", *args.subset]
        log = open(out / f"cupy-{run}.log", "w")
        log.write(" ".join(cmd) + "\n")
        log.flush()
        procs[run] = (subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log, time.monotonic())
    status = {}
    for run, (p, log, t0) in procs.items():
        rc = wait_or_stop(p, args.timeout - (time.monotonic() - t0))
        log.close()
        status[run] = (rc, round(time.monotonic() - t0))

    results = {run: outcomes(out / f"cupy-{run}.log") for run in runs}
    comparison, regressions = compare(results["cupy-pool"], results["emmpool"], "CuPy's pool")
    # The xdist workers' records (the controller runs no test and allocates nothing).
    workers = [json.loads(p.read_text()) for p in sorted(out.glob("emmpool-worker-gw*.json"))]

    lines = [
        f"# CuPy {tag}'s test suite: CuPy's own pool vs emmpool ({label})",
        "",
        f"command: python3 .ci/cupy_suite.py --jobs {args.jobs} --timeout {args.timeout}"
        f" (each run {per_run_jobs} xdist workers, both at once)",
        f"subset: {' '.join(args.subset)}",
        "",
    ]
    for run in runs:
        rc, secs = status[run]
        lines.append(run_counts(run, results[run], rc, secs))
        for crash in crashed_workers(out / f"cupy-{run}.log"):
            lines.append(f"    {crash}")
    lines += [
        "",
        f"emmpool workers that reported (use_for_cupy active): {len(workers)}; CuPy allocations "
        f"through emmpool: {sum(w['cupy_allocations'] for w in workers)}; dormant fences: "
        f"{sum(w['dormant_fences'] for w in workers)}; same-stream reuses: "
        f"{sum(w['same_stream_reuses'] for w in workers)}",
        "",
        *comparison,
    ]
    text = "\n".join(lines) + "\n"
    (out / f"{label}-cupy-suite.txt").write_text(text)
    print(text[:6000])
    both_ran = all(results[r] for r in runs) and all(w["cupy_allocations"] > 0 for w in workers) and workers
    return 0 if both_ran and not regressions else 1


if __name__ == "__main__":
    sys.exit(main())

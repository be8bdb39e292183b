#!/usr/bin/env python3
"""PyTorch's own test/test_cuda.py, once with PyTorch's CUDA caching allocator and once with
emmpool's, compared by test name.

    python3 .ci/torch_suite.py [--tests .torch-tests] [--out DIR] [--timeout S] [--jobs N]
                               [--test-timeout S] [-k EXPR] [--concurrent]

The test file comes from PyTorch's repository (``bash .ci/gpu-torch-tests`` puts it and
PyTorch's pytest.ini into .torch-tests/). docs/gpu-testing.md ("PyTorch's suite") says how the
two runs are made: the plugin that installs emmpool and records each process's allocator, the
selection, the workers, the turns and the environment.

Written to --out: ``torch-<run>.log`` (pytest -v, one line a test, so a run cut short still
counts what it ran), the plugin's records, and ``torch-suite.txt``: counts per run, every test
that passes natively and does not pass with emmpool (a regression: failed, errored, or crashed
its worker), and apart from them the tests the emmpool run did not reach before its timeout.
Exit status 0 only when there is no regression, both runs ran tests, the native run used
PyTorch's allocator and every emmpool process used emmpool's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cupy_suite import (compare, crashed_workers, log_lines, outcomes,  # noqa: E402
                        preflight_child, run_counts, wait_or_stop)

DEFAULT_K = ("memory or graph or mempool or snapshot or alloc or caching or empty_cache or stats "
             "or stream or oom or expandable or workspace or TestCudaMallocAsync or TestMemPool "
             "or TestBlockStateAbsorption or TestCachingHostAllocatorCudaGraph")
RUNS = {"native": "PyTorch's allocator", "emmpool": "emmpool"}
PLUGIN = "emmpool_torch_suite_plugin"
# What test_cuda.py and torch.testing._internal import that a torch wheel does not bring along.
NEEDS = ["torch", "psutil", "expecttest", "torch.testing._internal.common_utils"]


def phases(jobs: int, xdist: bool) -> list[tuple[str, list[str]]]:
    """(name, pytest arguments) of the invocations of one run."""
    if not xdist:
        return [("all", [])]
    restarts = ["--max-worker-restart", "100"]  # each crash costs its test, not the run
    if jobs <= 1:
        return [("all", ["-n", "1", *restarts])]
    return [("parallel", ["-n", str(jobs), "-m", "not serial", *restarts]),
            ("serial", ["-n", "1", "-m", "serial", *restarts])]


def run_env(run: str, out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.update(EMMCI_TORCH_SUITE=run, EMMCI_TORCH_SUITE_OUT=str(out),
               PYTORCH_TESTING_DEVICE_ONLY_FOR="cuda", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    return env


def run_suite(run: str, root: Path, out: Path, args, extra: list[str], seconds: float):
    """Runs the phases of `run`, their -v output into torch-<run>.log; (status, seconds)."""
    t0 = time.monotonic()
    statuses = []
    with open(out / f"torch-{run}.log", "w") as log:
        for phase, phase_args in phases(args.jobs, args.xdist):
            cmd = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider",
                   "-p", "no:randomly", "-v", *phase_args, *extra, "-k", args.k, args.file]
            log.write(f"## {phase}: {shlex.join(cmd)}\n")
            log.flush()
            env = dict(run_env(run, out), EMMCI_TORCH_SUITE_PHASE=phase)
            p = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            rc = wait_or_stop(p, seconds - (time.monotonic() - t0))
            statuses.append((phase, rc))
            if isinstance(rc, str):  # timed out: no time is left for a next phase
                break
    if len(statuses) == 1:
        return statuses[0][1], round(time.monotonic() - t0)
    return ", ".join(f"{phase} {rc}" for phase, rc in statuses), round(time.monotonic() - t0)


def run_both(root: Path, out: Path, args, extra: list[str]) -> dict:
    """Both runs: one after the other (the native one first, at most half of the time), or at
    once, each in a thread of its own, with --concurrent."""
    if not args.concurrent:
        t0 = time.monotonic()
        native = run_suite("native", root, out, args, extra, args.timeout / 2)
        return {"native": native, "emmpool": run_suite(
            "emmpool", root, out, args, extra, args.timeout - (time.monotonic() - t0))}
    done: dict = {}

    def one(run):
        done[run] = run_suite(run, root, out, args, extra, args.timeout)

    threads = [threading.Thread(target=one, args=(run,)) for run in RUNS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


_COLLECTING = re.compile(r"^_+ ERROR collecting (\S+) _+$")
_INTERNAL = re.compile(r"^INTERNALERROR> ((?:[A-Za-z_][\w.]*)?(?:Error|Exception)\b.*)$")


def problems(log: Path) -> list[str]:
    """What kept tests from running: 'could not collect FILE: first E line' for each file pytest
    could not import, and the exception of pytest's first INTERNALERROR (emmpool.use_for_torch()
    raising at configure time, say)."""
    lines = log_lines(log)
    found = []
    for i, line in enumerate(lines):
        m = _COLLECTING.match(line)
        if m:
            why = next((x[1:].strip() for x in lines[i + 1:i + 60] if x.startswith("E ")), "?")
            found.append(f"could not collect {m.group(1)}: {why}")
    internal = [m.group(1) for m in map(_INTERNAL.match, lines) if m]
    if internal:  # the first: a worker's, before the controller's "no active workers"
        found.append(f"pytest INTERNALERROR: {internal[0][:300]}")
    return found


def run_lines(runs, status: dict, results: dict, log_of) -> list[str]:
    """A report's lines on its runs: each one's counts, crashed workers and what kept tests
    from running (its log: log_of(run)), and NO TESTS RAN for a run that ran none."""
    lines = []
    for run in runs:
        if run in status:
            rc, secs = status[run]
            lines.append(run_counts(run, results[run], rc, secs))
        lines += [f"    {crash}" for crash in crashed_workers(log_of(run))]
        lines += [f"    {p}" for p in problems(log_of(run))]
    for run in status:
        if not results[run]:
            why = problems(log_of(run))
            lines.append(f"NO TESTS RAN in the {run} run" + (f": {why[0]}" if why else ""))
    return lines


def workers(out: Path, run: str) -> list[dict]:
    """The plugin's records of `run`'s processes that ran tests."""
    return [r for r in (json.loads(p.read_text()) for p in sorted(out.glob(f"{run}-*.json")))
            if r["tests"] > 0]


def preflight() -> tuple[str | None, dict]:
    """(Why test_cuda.py cannot be run here or None, {"torch": version, "gpus": names})."""
    code = ("import importlib, json, sys\n"
            f"for m in {NEEDS!r}:\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except Exception as e:\n"
            "        sys.exit(f'{m}: {type(e).__name__}: {e}')\n"
            "import torch\n"
            "n = torch.cuda.device_count()\n"
            "print(json.dumps({'torch': torch.__version__,\n"
            "                  'gpus': [torch.cuda.get_device_name(i) for i in range(n)]}))\n")
    return preflight_child(code, "psutil and expecttest: bash .ci/gpu-wheels torch, bring .whl")


def report(args, root: Path, out: Path, status: dict, why_not: str | None,
           info: dict) -> tuple[str, bool]:
    """torch-suite.txt's text, and whether the comparison holds (no regression, both ran, each
    with its allocator)."""
    tag = (root / "TAG").read_text().strip() if (root / "TAG").exists() else "?"
    results = {run: outcomes(out / f"torch-{run}.log") for run in RUNS}
    records = {run: workers(out, run) for run in RUNS}
    lines = [
        f"# PyTorch's test/test_cuda.py ({tag}): PyTorch's CUDA caching allocator vs emmpool",
        "",
        f"torch {info.get('torch', '?')}; GPUs: {', '.join(info.get('gpus', [])) or '?'}",
        f"command: python3 .ci/torch_suite.py --timeout {args.timeout} --jobs {args.jobs}"
        + (" --concurrent" if args.concurrent else "") + (" (pytest-xdist)" if args.xdist else
                                                           " (no pytest-xdist here: one process)"),
        f"-k {args.k}",
        "",
    ]
    if why_not:
        lines += [f"NOT RUN: {why_not}", ""]
    lines += run_lines(RUNS, status, results, lambda run: out / f"torch-{run}.log")
    native_ok = bool(records["native"]) and all(r["backend"] == "native" for r in records["native"])
    emmpool_ok = all(r["backend"] == "emmpool" for r in records["emmpool"]) and \
        sum(r["torch_allocations"] for r in records["emmpool"]) > 0
    hows = sorted({f"{r['how']}, backend {r['backend']!r}" for r in records["emmpool"]})
    lines += [
        "",
        f"native run processes that ran tests: {len(records['native'])}, allocator backends: "
        f"{sorted({r['backend'] for r in records['native']})}",
        f"emmpool run processes that ran tests: {len(records['emmpool'])}, installed as: "
        f"{'; '.join(hows) or '-'}; PyTorch allocations through emmpool: "
        f"{sum(r['torch_allocations'] for r in records['emmpool'])}",
        f"emmpool really installed: {'yes' if emmpool_ok else 'NO'}",
    ]
    filled = sorted({n for run in RUNS for r in records[run] for n in r.get("filled", [])})
    if filled:
        lines.append("names test_cuda.py imports that this PyTorch's common_utils lacks, defined "
                     f"in both runs as PyTorch's own test file defined them: {', '.join(filled)}")
    lines.append("")
    comparison, regressions = compare(results["native"], results["emmpool"], RUNS["native"],
                                      list_not_reached=True)
    lines += comparison
    both_ran = all(results[run] for run in RUNS)
    return "\n".join(lines) + "\n", both_ran and native_ok and emmpool_ok and not regressions


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", default=".torch-tests",
                    help="folder holding test_cuda.py and pytest.ini [.torch-tests]")
    ap.add_argument("--file", default="test_cuda.py", help="the test file in it [test_cuda.py]")
    ap.add_argument("--out", default="torch-suite-out")
    ap.add_argument("--timeout", type=int, default=600,
                    help="seconds for both runs together [600]")
    ap.add_argument("--jobs", type=int, default=1,
                    help="pytest-xdist workers for the tests not marked serial [1]")
    ap.add_argument("--test-timeout", type=int, default=300,
                    help="pytest-timeout per test, where pytest-timeout is installed [300]")
    ap.add_argument("-k", default=DEFAULT_K, help="pytest -k expression [the memory tests]")
    ap.add_argument("--concurrent", action="store_true", help="run both at once")
    args = ap.parse_args()

    root = Path(args.tests).resolve()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("native-*.json"), *out.glob("emmpool-*.json")]:
        old.unlink()
    args.xdist = importlib.util.find_spec("xdist") is not None
    extra = [f"--timeout={args.test_timeout}"] if importlib.util.find_spec("pytest_timeout") else []
    why_not, info = (None, {}) if (root / args.file).is_file() else (f"no {root / args.file}", {})
    if not why_not:
        why_not, info = preflight()
    status = {} if why_not else run_both(root, out, args, extra)
    text, ok = report(args, root, out, status, why_not, info)
    (out / "torch-suite.txt").write_text(text)
    print(text[:8000])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A peer's own Python tests (RMM's, cuda.core's), once with the peer's default memory resource
and once with emmpool's as every device's, compared by test name.

    python3 .ci/peer_suite.py --peer rmm|cuda-core [--tests DIR] [--out DIR] [--timeout S]

The tests come from the peer's repository at the release installed here (``bash
.ci/gpu-rmm-tests`` puts RMM's into .rmm-tests/tests, ``bash .ci/gpu-cuda-core-tests``
cuda.core's into .cuda-core-tests/cuda_core/tests, as laid out in its repository; each with the
peer's pytest.ini beside). The two runs take turns; each loads a small pytest plugin
(.ci/emmpool_peer_suite_plugin.py) that, in the emmpool run, makes emmpool's resource every
device's before each test, and records in both how many tests ran and how many allocations the
peer made from emmpool (proof that the run used it).

Written to --out: ``<peer>-<run>.log`` (pytest -v: one line a test, so that a run cut short
still counts what it ran), the plugin's records and ``<peer>-suite.txt``: counts per run, every
test that passes with the peer's default and not with emmpool's (a regression), and the tests
the emmpool run did not reach. Exit status 0 only when there is no regression, both runs ran
tests and the emmpool run allocated through emmpool.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cupy_suite import compare, outcomes, preflight_child, wait_or_stop  # noqa: E402
from torch_suite import run_lines  # noqa: E402

PLUGIN = "emmpool_peer_suite_plugin"


@dataclass(frozen=True)
class Peer:
    title: str    # whose tests
    default: str  # what the peer allocates through unless told otherwise
    tests: str    # the folder .ci/gpu-<peer>-tests makes
    inside: str   # the tests' folder in it (as in the peer's repository: its conftest finds
                  # what it needs from there)
    module: str   # what must import
    version: str  # its version, as the module says it
    subset: tuple = ()  # by default only these, inside `inside` (--all: every test)
    # tests left out of both runs, by node id inside `inside`, each with why: a test that hangs
    # with the peer's own resource would spend both runs' time and hide every test after it
    deselected: tuple = ()


PEERS = {
    "rmm": Peer("RMM's own tests", "RMM's default resource", ".rmm-tests", "tests", "rmm",
                "rmm.__version__"),
    # What allocates: buffers, streams, launches, DLPack, graphs, IPC, and the files whose
    # tests allocate through the Device's own memory resource (Device.allocate: the one that
    # emmpool replaces; most buffer tests make resources of their own); not the compiler or
    # layouts (thousands of tests of their own that never allocate).
    "cuda-core": Peer("cuda.core's own tests", "cuda.core's default memory resource",
                      ".cuda-core-tests", "cuda_core/tests", "cuda.core",
                      "cuda.core.__version__",
                      ("test_memory.py", "test_device.py", "test_stream.py", "test_event.py",
                       "test_launcher.py", "test_utils_dlpack.py", "test_memory_peer_access.py",
                       "test_tensor_map.py", "test_green_context.py",
                       "graph", "memory", "memory_ipc"),
                      (("memory_ipc/test_send_buffers.py::TestIpcReexport",
                        "hangs with cuda.core's own resource at 1.2.0: both runs stopped there"),)),
}
RUNS = ("default", "emmpool")


def run_suite(peer: str, run: str, root: Path, out: Path, seconds: float,
              every_test: bool = False) -> tuple:
    """pytest -v over the peer's tests in root (its subset unless `every_test`) into
    <peer>-<run>.log; (exit status, seconds)."""
    t0 = time.monotonic()
    p = PEERS[peer]
    paths = [p.inside] if every_test or not p.subset else [f"{p.inside}/{s}" for s in p.subset]
    paths += [f"--deselect={p.inside}/{test}" for test, _ in p.deselected]
    # A test file that does not import here (one newer than the installed release, one needing
    # a build step) costs its own tests, not the run's: pytest would stop before the first test.
    cmd = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider",
           "-p", "no:randomly", "-v", "--continue-on-collection-errors", "--rootdir", str(root),
           "-c", str(root / "pytest.ini"), *paths]
    env = dict(os.environ, EMMCI_PEER_SUITE=peer, EMMCI_PEER_RUN=run,
               EMMCI_PEER_SUITE_OUT=str(out), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    with open(out / f"{peer}-{run}.log", "w") as log:
        log.write(f"## {shlex.join(cmd)}\n")
        log.flush()
        child = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        rc = wait_or_stop(child, seconds)
    return rc, round(time.monotonic() - t0)


def preflight(peer: Peer) -> tuple[str | None, dict]:
    """(Why the peer's tests cannot run here or None, {"version": ..., "gpus": count})."""
    code = (f"import json, {peer.module}\n"
            "from cuda.bindings import runtime\n"
            "err, n = runtime.cudaGetDeviceCount()\n"
            f"print(json.dumps({{'version': {peer.version}, 'gpus': n if err == 0 else 0}}))\n")
    return preflight_child(code, f"{peer.module} does not import: bring its wheels in .whl")


def record(out: Path, run: str) -> dict:
    path = out / f"{run}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def report(args, root: Path, out: Path, status: dict, why_not: str | None,
           info: dict) -> tuple[str, bool]:
    """<peer>-suite.txt's text, and whether the comparison holds."""
    peer = PEERS[args.peer]
    tag = (root / "TAG").read_text().strip() if (root / "TAG").exists() else "?"
    results = {run: outcomes(out / f"{args.peer}-{run}.log") for run in RUNS}
    lines = [f"# {peer.title} ({tag}): {peer.default} vs emmpool's", "",
             f"{peer.module} {info.get('version', '?')}; GPUs: {info.get('gpus', '?')}",
             f"command: python3 .ci/peer_suite.py --peer {args.peer} --timeout {args.timeout}"
             + (" --all" if args.all else ""),
             f"tests: {', '.join(peer.subset) if peer.subset and not args.all else 'all'}"]
    lines += [f"left out of both runs: {test} ({why})" for test, why in peer.deselected]
    lines += [""]
    if why_not:
        lines += [f"NOT RUN: {why_not}", ""]
    lines += run_lines(RUNS, status, results, lambda run: out / f"{args.peer}-{run}.log")
    ours = record(out, "emmpool")
    used = ours.get("allocations", 0) > 0 and ours.get("tests_on_emmpool", 0) > 0
    lines += ["", f"emmpool run: {ours.get('tests_on_emmpool', 0)} tests on emmpool's resource "
              f"({ours.get('how') or '-'}); allocations through emmpool: "
              f"{ours.get('allocations', 0)}",
              f"emmpool really used: {'yes' if used else 'NO'}", ""]
    comparison, regressions = compare(results["default"], results["emmpool"], peer.default,
                                      list_not_reached=True)
    lines += comparison
    both_ran = all(results[run] for run in RUNS)
    return "\n".join(lines) + "\n", both_ran and used and not regressions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", choices=sorted(PEERS), required=True)
    ap.add_argument("--tests", help="the folder .ci/gpu-<peer>-tests made [.rmm-tests, "
                                    ".cuda-core-tests]")
    ap.add_argument("--out", default="peer-suite-out")
    ap.add_argument("--timeout", type=int, default=300, help="seconds for both runs [300]")
    ap.add_argument("--all", action="store_true",
                    help="every test of the peer's, not only those that allocate")
    args = ap.parse_args(argv)
    peer = PEERS[args.peer]
    root, out = Path(args.tests or peer.tests).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json"):
        old.unlink()
    tests = root / peer.inside
    why_not, info = (None, {}) if tests.is_dir() else (f"no {tests}", {})
    if not why_not:
        why_not, info = preflight(peer)
    status = {}
    if not why_not:
        t0 = time.monotonic()
        status["default"] = run_suite(args.peer, "default", root, out, args.timeout / 2,
                                      args.all)
        status["emmpool"] = run_suite(args.peer, "emmpool", root, out,
                                      args.timeout - (time.monotonic() - t0), args.all)
    text, ok = report(args, root, out, status, why_not, info)
    (out / f"{args.peer}-suite.txt").write_text(text)
    print(text[:8000])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

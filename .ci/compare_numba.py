#!/usr/bin/env python3
"""Compare Numba CUDA test-suite runs: Numba's default memory manager vs. an EMM plugin.

Reads the ``-v`` output of ``python -m numba.runtests`` (numba-cuda's suite, serial or ``-m N``
parallel) or of ``pytest -v`` (numba-cuda-mlir's suite, with or without pytest-xdist), one or
more logs per side, and answers: does every test that passes with Numba's own manager also pass
with the plugin?  Tests are named by their full unittest id
(``numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle``) or pytest node id
(``tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::test_host_alloc_pinned``).

Usage::

    compare_numba.py [options] --base LOG [LOG ...] --plugin LOG [LOG ...]
    compare_numba.py [options] BASE_LOG [BASE_LOG ...] -- PLUGIN_LOG [PLUGIN_LOG ...]
    compare_numba.py --selftest

Options::

    --mode MODE        the plugin's EMMPOOL_MODE; in a sub-allocating mode (pool) the tests that
                       assume one cuMemAlloc per allocation may fail (KNOWN_SUBALLOC_FAILS)
    --label TEXT       title for the report (default: MODE or "plugin")
    --all              every test the base ran is in scope (the plugin ran the same full suite);
                       default: only modules the plugin logs mention are in scope (targeted runs)
    --allow-incomplete exit 0 even if a log has no final "Ran N tests" line (killed, timed out)
    --expect-fail ID   add a test id (fnmatch pattern) that may fail with the plugin; repeatable

Several logs on one side are merged in the order given; a test seen in more than one log takes
its outcome from the LAST log naming it.  Give the parallel (-m) log first and the serial
subprocess-test log after it: tests such as test_ipc break under -m and the serial run decides.

Outcomes: ok, expected failure (both "pass"), skipped, FAIL, ERROR, unexpected success, and
unknown (a test header with no status: the run ended inside that test, or its output swallowed
the status).  Setup errors (``setUpClass (mod.Class) ... ERROR``) and import failures
(``unittest.loader._FailedTest``) count as tests named ``mod.Class.setUpClass`` etc.; in pytest
logs a module that fails to collect counts as a test named by its path.  A pytest-xdist run cut
off (no final summary line) leaves tests in flight on its workers: those count as not run, not
as unknown, and the log makes the comparison inconclusive.

Exit status: 0 no unexpected regression and every log complete; 1 unexpected regressions;
2 usage error; 3 no regression found but a log is missing or incomplete (inconclusive).
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import re
import sys
from collections import Counter, OrderedDict

# ---------------------------------------------------------------------------------------------
# Known differences (numba-cuda 0.30.4: unittest ids; numba-cuda-mlir 0.6.0: pytest node ids)

_MLIR_DEALLOC = "tests/numba_cuda_tests/cudadrv/test_deallocations.py::TestDeallocation::"

# Tests of Numba's own deferred-deallocation bookkeeping, which any external manager bypasses:
# skipped whenever NUMBA_CUDA_MEMORY_MANAGER != "default" (testing.skip_if_external_memmgr),
# except numba-cuda-mlir's test_ownership, which lost that decorator and fails instead (it
# counts entries in the manager's `deallocations`, which only Numba's own memalloc adds).
KNOWN_EXTERNAL_SKIPS = (
    "numba.cuda.tests.cudadrv.test_deallocations.TestDeallocation.test_max_pending_count",
    "numba.cuda.tests.cudadrv.test_deallocations.TestDeallocation.test_max_pending_bytes",
    "numba.cuda.tests.cudadrv.test_deallocations.TestDeallocation.test_defer_cleanup",
    "numba.cuda.tests.cudadrv.test_deallocations.TestDeallocation.test_nested_defer_cleanup",
    "numba.cuda.tests.cudadrv.test_deallocations.TestDeallocation.test_exception",
    "numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_ownership",
    _MLIR_DEALLOC + "test_max_pending_count",
    _MLIR_DEALLOC + "test_max_pending_bytes",
    _MLIR_DEALLOC + "test_defer_cleanup",
    _MLIR_DEALLOC + "test_nested_defer_cleanup",
    _MLIR_DEALLOC + "test_exception",
    "tests/numba_cuda_tests/cudapy/test_cuda_array_interface.py::TestCudaArrayInterface::test_ownership",
)

# Assume one cuMemAlloc per allocation: may fail in a sub-allocating mode (docs/design.md, Modes).
# numba-cuda's test_host_alloc_pinned is no longer one: the plugin's device_extents answers with
# the array's block (python/emmpool/_numba_extents.py; it passes with the plugin on an H200,
# benchmarks/results/H200/numba-suite.txt). numba-cuda-mlir's has the same wrapper but has not
# been run on a GPU with it, so it stays excused.
KNOWN_SUBALLOC_FAILS = (
    "numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle",
    "tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::test_host_alloc_pinned",
)
SUBALLOC_MODES = ("pool",)

PASS = ("ok", "expected failure")
# Worst first: used to merge subtests / summary blocks into one outcome per test and log.
SEVERITY = ["ERROR", "FAIL", "unexpected success", "unknown", "ok", "expected failure", "skipped"]
RANK = {name: i for i, name in enumerate(SEVERITY)}

# ---------------------------------------------------------------------------------------------
# Parsing

# "test_foo (pkg.mod.Class.test_foo) ... ok"         (Python >= 3.11)
# "test_foo (pkg.mod.Class) ... ok"                  (Python <= 3.10)
# "  test_foo (pkg.mod.Class.test_foo) (i=1) ... FAIL"  (subtest)
# "setUpClass (pkg.mod.Class) ... ERROR"
# "pkg.mod (unittest.loader._FailedTest.pkg.mod) ... ERROR"
# "test_doc (pkg.mod.Class.test_doc)\nFirst docstring line ... ok"
_HEADER = re.compile(r"^(?P<indent>  )?(?P<meth>[A-Za-z_][\w.]*) \((?P<paren>[A-Za-z_][\w.]*)\)(?P<rest>.*)$")
_STATUS = re.compile(r"^(ok|FAIL|ERROR|expected failure|unexpected success|skipped(?: .*)?)\s*$")
_BLOCK = re.compile(r"^(ERROR|FAIL|UNEXPECTED SUCCESS): (?P<meth>[A-Za-z_][\w.]*) \((?P<paren>[A-Za-z_][\w.]*)\)")
_RAN = re.compile(r"^Ran (\d+) tests? in ([\d.]+)s\s*$")
_FINAL = re.compile(r"^(OK|FAILED)(?: \((.*)\))?\s*$")
_PARALLEL = re.compile(r"^Parallel: (\d+)\. Serial: (\d+)\s*$")
_CI_RC = re.compile(r"^\[\.ci/gpu[\w-]*\] .*\brc=(\d+)")

# pytest -v, with pytest-xdist or without (a node id may hold spaces, in its parameters):
# "[gw3] [ 12%] PASSED tests/test_x.py::TestX::test_y"
# "tests/test_x.py::TestX::test_y PASSED                                    [ 12%]"
# "[gw1] [ 66%] SUBFAILED(i='1') tests/test_x.py::TestX::test_sub"        (a failing subtest)
# "tests/test_x.py::TestX::test_y"        (a test starting: its status comes on a later line)
# "______ ERROR collecting tests/test_x.py ______"                  (a module that cannot load)
# "== 5 failed, 1200 passed, 3 skipped in 201.12s (0:03:21) =="
_PT_SESSION = re.compile(r"^=+ test session starts =+$", re.M)
_PT_NODE = r"(?P<nid>[^\s\[\]]+\.py(?:::.*?)?)"
_PT_XDIST = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (?P<status>[A-Z]+)(?P<detail>.*?) " + _PT_NODE + r"\s*$")
_PT_SERIAL = re.compile(r"^" + _PT_NODE + r" (?P<status>[A-Z]+)(?P<detail>.*?)\s+\[\s*\d+%\]$")
_PT_START = re.compile(r"^(?P<nid>[^\s\[\]]+\.py::\S.*?)\s*$")
_PT_COLLECT = re.compile(r"^_+ ERROR collecting (?P<nid>\S+) _+$")
# The short summary (-rfE, pytest's default): without xdist, a failing unittest subTest shows
# only there ("SUBFAILED(i=1) tests/test_x.py::TestX::test_sub - AssertionError: ...").
_PT_SUMMARY = re.compile(r"^(?P<status>FAILED|ERROR|XPASS|SUBFAILED)(?P<detail>[\[(].*?)? "
                         + _PT_NODE + r"(?: - .*)?$")
_PT_WORKERS = re.compile(r"^(?:created: (\d+)/\d+ workers?|(\d+) workers? \[\d+ items?\])\s*$")
_PT_FINAL = re.compile(r"^=+ (?P<body>.*?) in (?P<secs>[\d.]+)s(?: \([\d:]+\))? =+$")
_PT_COUNT = re.compile(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?)\b")
# A status word: its outcome, or None for one that decides nothing (a passing subtest, a rerun).
_PT_STATUS = {"PASSED": "ok", "FAILED": "FAIL", "ERROR": "ERROR", "SKIPPED": "skipped",
              "XFAIL": "expected failure", "XPASS": "unexpected success", "SUBFAILED": "FAIL",
              "SUBPASSED": None, "SUBSKIPPED": None, "SUBXFAIL": None, "SUBXPASS": None,
              "RERUN": None}


def _test_id(meth: str, paren: str) -> str:
    if paren == meth or paren.endswith("." + meth):
        return paren
    return paren + "." + meth


def _status_name(text: str) -> str:
    return "skipped" if text.startswith("skipped") else text


def _worse(a: str | None, b: str) -> str:
    if a is None:
        return b
    return a if RANK[a] <= RANK[b] else b


class LogResult:
    """Outcomes parsed from one numba.runtests -v log."""

    def __init__(self, path: str):
        self.path = path
        self.outcomes: "OrderedDict[str, str | None]" = OrderedDict()
        self.skip_reasons: dict[str, str] = {}
        self.ran: int | None = None
        self.seconds: float | None = None
        self.final: str | None = None
        self.parallel: tuple[int, int] | None = None
        self.ci_rc: int | None = None
        self.missing = False
        self.workers: int | None = None  # pytest-xdist workers
        self.in_flight: list[str] = []  # tests a cut-off pytest-xdist run was running

    @property
    def complete(self) -> bool:
        return self.ran is not None and not self.missing

    def _set(self, tid: str, status: str) -> None:
        self.outcomes[tid] = _worse(self.outcomes.get(tid), status)

    def parse(self, text: str) -> "LogResult":
        pending = None  # test id whose status has not been seen yet
        for raw in text.splitlines():
            line = raw.rstrip("\r\n")
            m = _HEADER.match(line)
            if m:
                tid = _test_id(m.group("meth"), m.group("paren"))
                rest = m.group("rest")
                if " ... " in rest or rest.endswith(" ..."):
                    extra, _, tail = rest.partition(" ...")
                    tail = tail[1:] if tail.startswith(" ") else tail
                else:
                    extra, tail = rest, ""
                is_sub = bool(m.group("indent")) and extra.strip() != ""
                sm = _STATUS.match(tail)
                if is_sub:
                    # a subtest outcome folds into its test; the test line itself had no status
                    if sm:
                        status = _status_name(sm.group(1))
                        if status != "skipped":  # a skipped subtest does not skip the test
                            self._set(tid, status)
                    if tid not in self.outcomes:
                        self.outcomes[tid] = None
                    pending = None
                    continue
                if tid not in self.outcomes:
                    self.outcomes[tid] = None
                if sm:
                    status = _status_name(sm.group(1))
                    self._set(tid, status)
                    if status == "skipped":
                        self.skip_reasons[tid] = sm.group(1)[len("skipped"):].strip()
                    pending = None
                else:
                    pending = tid  # docstring line, or the test's own output, comes first
                continue
            if pending is not None:
                tail = None
                if _STATUS.match(line):
                    tail = line
                elif " ... " in line:
                    tail = line.rsplit(" ... ", 1)[1]
                elif line.endswith(" ..."):
                    tail = ""
                if tail is not None:
                    sm = _STATUS.match(tail)
                    if sm:
                        status = _status_name(sm.group(1))
                        self._set(pending, status)
                        if status == "skipped":
                            self.skip_reasons[pending] = sm.group(1)[len("skipped"):].strip()
                        pending = None
                        continue
            m = _BLOCK.match(line)
            if m:
                kind = {"UNEXPECTED SUCCESS": "unexpected success"}.get(m.group(1), m.group(1))
                self._set(_test_id(m.group("meth"), m.group("paren")), kind)
                pending = None
                continue
            m = _RAN.match(line)
            if m:
                self.ran, self.seconds = int(m.group(1)), float(m.group(2))
                pending = None
                continue
            m = _FINAL.match(line)
            if m and self.ran is not None:
                self.final = line.strip()
                continue
            m = _PARALLEL.match(line)
            if m:
                self.parallel = (int(m.group(1)), int(m.group(2)))
                continue
            m = _CI_RC.match(line)
            if m:
                self.ci_rc = int(m.group(1))
        for tid, status in self.outcomes.items():
            if status is None:
                self.outcomes[tid] = "unknown"
        return self

    def parse_pytest(self, text: str) -> "LogResult":
        started = []  # tests seen starting (xdist prints that), in order
        for raw in text.splitlines():
            line = raw.rstrip("\r\n")
            m = _PT_XDIST.match(line) or _PT_SERIAL.match(line)
            if m and m.group("status") in _PT_STATUS:
                tid, status = m.group("nid"), _PT_STATUS[m.group("status")]
                if tid not in self.outcomes:
                    self.outcomes[tid] = None
                if status is not None:
                    self._set(tid, status)
                    if status == "skipped" and m.group("detail").strip():
                        self.skip_reasons[tid] = m.group("detail").strip()
                continue
            m = _PT_START.match(line)
            if m:
                started.append(m.group("nid"))
                continue
            m = _PT_SUMMARY.match(line)
            if m:
                self._set(m.group("nid"), _PT_STATUS[m.group("status")])
                continue
            m = _PT_COLLECT.match(line)
            if m:
                self._set(m.group("nid"), "ERROR")
                continue
            m = _PT_WORKERS.match(line)
            if m:
                self.workers = int(m.group(1) or m.group(2))
                continue
            m = _PT_FINAL.match(line)
            if m:
                self.final = m.group("body")
                self.ran = sum(int(n) for n, _ in _PT_COUNT.findall(m.group("body")))
                self.seconds = float(m.group("secs"))
                continue
            m = _CI_RC.match(line)
            if m:
                self.ci_rc = int(m.group(1))
        for tid in started:
            self.outcomes.setdefault(tid, None)
        for tid, status in list(self.outcomes.items()):
            if status is None:
                if self.workers and self.ran is None:
                    # Cut off with N workers busy: N tests in flight prove nothing either way.
                    del self.outcomes[tid]
                    self.in_flight.append(tid)
                else:
                    self.outcomes[tid] = "unknown"
        return self

    def describe(self) -> str:
        name = os.path.basename(self.path)
        if self.missing:
            return f"{name}: MISSING"
        bits = [f"{len(self.outcomes)} parsed"]
        if self.parallel:
            bits.append(f"parallel {self.parallel[0]} / serial {self.parallel[1]}")
        if self.workers:
            bits.append(f"{self.workers} pytest-xdist workers")
        if self.ran is not None:
            bits.append(f"Ran {self.ran} in {self.seconds:.0f}s")
            if self.final:
                bits.append(self.final)
        else:
            bits.append("INCOMPLETE (no 'Ran N tests' line)")
        if self.ci_rc is not None:
            bits.append(f"rc={self.ci_rc}" + (" (timeout)" if self.ci_rc in (124, 137) else ""))
        if self.in_flight:
            bits.append(f"{len(self.in_flight)} tests in flight when it ended (not run)")
        return f"{name}: " + "; ".join(bits)


def parse_text(text: str, path: str = "<text>") -> LogResult:
    """A numba.runtests log, or a pytest one (it has pytest's session header)."""
    if _PT_SESSION.search(text):
        return LogResult(path).parse_pytest(text)
    return LogResult(path).parse(text)


def parse_logs(paths):
    logs, merged = [], OrderedDict()
    for p in paths:
        try:
            with open(p, encoding="utf-8", errors="replace") as f:
                lr = parse_text(f.read(), p)
        except OSError:
            lr = LogResult(p)
            lr.missing = True
        logs.append(lr)
        for tid, status in lr.outcomes.items():
            merged.pop(tid, None)
            merged[tid] = status  # last log wins
    return logs, merged


def module_of(tid: str) -> str:
    if "::" in tid or tid.endswith(".py"):  # a pytest node id: its file
        return tid.split("::", 1)[0]
    parts = tid.split(".")
    return ".".join(parts[:-2]) if len(parts) > 2 else tid


# ---------------------------------------------------------------------------------------------
# Comparison


def compare(base_logs, base, plug_logs, plug, mode=None, full_scope=False, expect_fail=()):
    suballoc = mode in SUBALLOC_MODES
    allowed = list(expect_fail)
    plug_complete = all(lr.complete for lr in plug_logs) and bool(plug_logs)
    base_complete = all(lr.complete for lr in base_logs) and bool(base_logs)
    plug_modules = {module_of(t) for t in plug}

    def in_scope(tid):
        return full_scope or module_of(tid) in plug_modules

    res = {k: [] for k in ("unexpected", "known_skip", "known_suballoc", "expected_fail",
                           "not_run", "not_reached", "new_pass", "new_fail", "other")}
    out_of_scope = 0
    for tid, b in base.items():
        p = plug.get(tid)
        if b not in PASS:
            if p in PASS:
                res["new_pass"].append((tid, b, p))
            elif p is not None and p != b:
                res["other"].append((tid, b, p))
            continue
        if p in PASS:
            continue
        if p is None and not in_scope(tid):
            out_of_scope += 1
            continue
        if tid in KNOWN_EXTERNAL_SKIPS:
            res["known_skip"].append((tid, b, p or "not run"))
            continue
        if p is None:
            if plug_complete:
                res["unexpected"].append((tid, b, "not run"))
            else:
                res["not_run"].append((tid, b, "not run"))
            continue
        if suballoc and tid in KNOWN_SUBALLOC_FAILS:
            res["known_suballoc"].append((tid, b, p))
        elif any(fnmatch.fnmatchcase(tid, pat) for pat in allowed):
            res["expected_fail"].append((tid, b, p))
        else:
            res["unexpected"].append((tid, b, p))
    for tid, p in plug.items():
        if tid in base:
            continue
        if p in ("FAIL", "ERROR", "unexpected success", "unknown"):
            if any(fnmatch.fnmatchcase(tid, pat) for pat in allowed):
                res["expected_fail"].append((tid, "not run", p))
            else:
                res["new_fail" if base_complete else "not_reached"].append((tid, "not run", p))
        elif p in PASS:
            res["new_pass"].append((tid, "not run", p))
    # Known tests for the record, also when they pass.
    known_status = []
    for tid in KNOWN_EXTERNAL_SKIPS + KNOWN_SUBALLOC_FAILS:
        if tid in base or tid in plug:
            known_status.append((tid, base.get(tid, "not run"), plug.get(tid, "not run")))
    res["known_status"] = known_status
    res["out_of_scope"] = out_of_scope
    res["plug_complete"] = plug_complete
    res["base_complete"] = base_complete
    res["suballoc"] = suballoc
    return res


def counts_line(outcomes) -> str:
    c = Counter(outcomes.values())
    order = ["ok", "expected failure", "skipped", "FAIL", "ERROR", "unexpected success", "unknown"]
    return f"tests={len(outcomes)} " + " ".join(f"{k.replace(' ', '_')}={c.get(k, 0)}" for k in order)


def report(label, base_logs, base, plug_logs, plug, res, full_scope) -> tuple[str, int]:
    regressions = res["unexpected"] + res["new_fail"]
    if regressions:
        verdict, code = f"FAIL: {len(regressions)} unexpected regression(s)", 1
    elif not (res["plug_complete"] and res["base_complete"]):
        verdict, code = "INCONCLUSIVE: no unexpected regression in what ran, but a log is missing or incomplete", 3
    else:
        verdict, code = "PASS: every test that passes with Numba's default manager passes with the plugin", 0
    L = [f"== Numba CUDA suite: default manager vs emmpool.plugin [{label}] =="]
    L.append("base   " + counts_line(base))
    for lr in base_logs:
        L.append("         " + lr.describe())
    L.append("plugin " + counts_line(plug))
    for lr in plug_logs:
        L.append("         " + lr.describe())
    scope = "all base tests" if full_scope else f"modules the plugin run covered ({len({module_of(t) for t in plug})})"
    L.append(f"scope: {scope}; base-passing tests out of scope: {res['out_of_scope']}")
    ks = sum(1 for t, b, p in res["known_skip"] if p == "skipped")
    L.append(
        f"unexpected regressions: {len(res['unexpected'])} (+{len(res['new_fail'])} failing only with plugin); "
        f"known ext-manager skips: {ks}/{len(res['known_skip'])}; "
        f"known sub-allocation failures: {len(res['known_suballoc'])}"
        f"{' (allowed in this mode)' if res['suballoc'] else ''}; "
        f"allowed by --expect-fail: {len(res['expected_fail'])}; "
        f"not run (plugin log incomplete): {len(res['not_run'])}; "
        f"failing with plugin, not reached by the incomplete base: {len(res['not_reached'])}; "
        f"pass only with plugin: {len(res['new_pass'])}"
    )
    L.append("RESULT: " + verdict)

    def section(title, rows):
        if not rows:
            return
        L.append("")
        L.append(f"-- {title} ({len(rows)}) --")
        for tid, b, p in sorted(rows):
            L.append(f"  {tid}: {b} -> {p}")

    section("UNEXPECTED: pass with default, not with plugin", res["unexpected"])
    section("UNEXPECTED: fail with plugin, absent from base logs", res["new_fail"])
    section("known: Numba's own deallocation bookkeeping, skipped for any external manager "
            "(skip_if_external_memmgr; numba-cuda-mlir's test_ownership fails instead)", res["known_skip"])
    section("known: assume one cuMemAlloc per allocation (docs/design.md, Modes), " +
            ("expected in this mode" if res["suballoc"] else "NOT expected in this mode"), res["known_suballoc"])
    section("allowed by --expect-fail", res["expected_fail"])
    section("not run with plugin (its log is incomplete)", res["not_run"])
    section("fail with plugin, not reached by the base run (its log is incomplete)", res["not_reached"])
    section("pass with plugin, not with default", res["new_pass"])
    section("other differences (neither side passes)", res["other"])
    section("status of the known tests (base -> plugin)", res["known_status"])
    return "\n".join(L) + "\n", code


# ---------------------------------------------------------------------------------------------
# Self-test: samples crafted from the output of numba.runtests -v (Python 3.11/3.12 unittest,
# numba 0.68 ParallelTestRunner), serial and parallel.

_SAMPLE_BASE_PARALLEL = """\
Parallel: 12. Serial: 0
test_host_alloc_driver (numba.cuda.tests.cudadrv.test_host_alloc.TestHostAlloc.test_host_alloc_driver) ... ok
test_host_alloc_pinned (numba.cuda.tests.cudadrv.test_host_alloc.TestHostAlloc.test_host_alloc_pinned) ... ok
some output a worker printed
test_max_pending_count (numba.cuda.tests.cudadrv.test_deallocations.TestDeallocation.test_max_pending_count) ... ok
test_ownership (numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_ownership) ... ok
test_array_views (numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_array_views)
Views created via array interface support: ... ok
test_ipc_handle (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle) ... ERROR
test_sub (numba.cuda.tests.cudapy.test_x.TestX.test_sub) ... ok
test_flaky (numba.cuda.tests.cudapy.test_x.TestX.test_flaky) ... FAIL
test_skipme (numba.cuda.tests.cudapy.test_x.TestX.test_skipme) ... skipped 'not on this GPU'
test_xf (numba.cuda.tests.cudapy.test_x.TestX.test_xf) ... expected failure
test_gone (numba.cuda.tests.cudapy.test_x.TestX.test_gone) ... ok
test_other (numba.cuda.tests.cudapy.test_y.TestY.test_other) ... ok

======================================================================
ERROR: test_ipc_handle (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle)
----------------------------------------------------------------------
Traceback (most recent call last):
AssertionError: daemonic processes are not allowed to have children

======================================================================
FAIL: test_flaky (numba.cuda.tests.cudapy.test_x.TestX.test_flaky)
----------------------------------------------------------------------
AssertionError: 1 != 2

----------------------------------------------------------------------
Ran 12 tests in 201.532s

FAILED (failures=1, errors=1, skipped=1, expected failures=1)
=== Resource Infos ===
=== End Resource Infos ===
"""

_SAMPLE_BASE_SERIAL = """\
test_ipc_array (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_array) ... ok
test_ipc_handle (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle) ... ok
test_init_reset (numba.cuda.tests.cudadrv.test_init.TestInit.test_init_reset) ... ok

----------------------------------------------------------------------
Ran 3 tests in 12.000s

OK
"""

_SAMPLE_PLUGIN_PARALLEL = """\
Parallel: 12. Serial: 0
test_host_alloc_driver (numba.cuda.tests.cudadrv.test_host_alloc.TestHostAlloc.test_host_alloc_driver) ... ok
test_host_alloc_pinned (numba.cuda.tests.cudadrv.test_host_alloc.TestHostAlloc.test_host_alloc_pinned) ... ERROR
test_max_pending_count (numba.cuda.tests.cudadrv.test_deallocations.TestDeallocation.test_max_pending_count) ... skipped 'Deallocation specific to Numba memory management'
test_ownership (numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_ownership) ... skipped 'Ownership not relevant with external memmgr'
test_array_views (numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_array_views)
Views created via array interface support: ... FAIL
test_ipc_handle (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle) ... ERROR
test_sub (numba.cuda.tests.cudapy.test_x.TestX.test_sub) ... 
  test_sub (numba.cuda.tests.cudapy.test_x.TestX.test_sub) (i=1) ... FAIL
  test_sub (numba.cuda.tests.cudapy.test_x.TestX.test_sub) (i=2) ... skipped 'meh'
test_flaky (numba.cuda.tests.cudapy.test_x.TestX.test_flaky) ... ok
test_skipme (numba.cuda.tests.cudapy.test_x.TestX.test_skipme) ... skipped 'not on this GPU'
test_xf (numba.cuda.tests.cudapy.test_x.TestX.test_xf) ... unexpected success
numba.cuda.tests.cudapy.test_z (unittest.loader._FailedTest.numba.cuda.tests.cudapy.test_z) ... ERROR
test_other (numba.cuda.tests.cudapy.test_y.TestY.test_other) ... ok

======================================================================
ERROR: test_host_alloc_pinned (numba.cuda.tests.cudadrv.test_host_alloc.TestHostAlloc.test_host_alloc_pinned)
----------------------------------------------------------------------
CudaAPIError: [1] Call to cuMemsetD8 results in CUDA_ERROR_INVALID_VALUE

======================================================================
FAIL: test_sub (numba.cuda.tests.cudapy.test_x.TestX.test_sub) [<object object at 0x7f5f97d9db50>] (i=1)
----------------------------------------------------------------------
AssertionError: 1 not less than 1

======================================================================
UNEXPECTED SUCCESS: test_xf (numba.cuda.tests.cudapy.test_x.TestX.test_xf)
----------------------------------------------------------------------
Ran 12 tests in 190.001s

FAILED (failures=2, errors=3, skipped=3, unexpected successes=1)
"""

# Serial run killed by `timeout` inside a test: the test's own output, then nothing.
_SAMPLE_PLUGIN_SERIAL = """\
test_ipc_array (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_array) ... ok
test_ipc_handle (numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle) ... /x/numba/cuda/dispatcher.py:600: NumbaPerformanceWarning: Grid size 1 will likely result in GPU under-utilization due to low occupancy.
  warn(NumbaPerformanceWarning(msg))
FAIL
test_init_reset (numba.cuda.tests.cudadrv.test_init.TestInit.test_init_reset) ... some output
[.ci/gpu] suite-pool-serial: rc=124 after 240s
"""

_SAMPLE_SETUPCLASS = """\
setUpClass (numba.cuda.tests.cudapy.test_q.TestQ) ... ERROR
test_print (numba.cuda.tests.cudapy.test_q.TestP.test_print) ... printed text
warn text
ok
test_old (numba.cuda.tests.cudapy.test_q.TestP) ... ok

======================================================================
ERROR: setUpClass (numba.cuda.tests.cudapy.test_q.TestQ)
----------------------------------------------------------------------
RuntimeError: setup failed

----------------------------------------------------------------------
Ran 2 tests in 0.002s

FAILED (errors=1)
"""

# pytest -v with pytest-xdist (pytest 9.2, xdist 3.8), as numba-cuda-mlir's suite is run by
# .ci/gpu.py (step mlir): the default manager, complete; the plugin, complete; the plugin, cut off.
_MLIR_HA = "tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::"
_SAMPLE_PYTEST_BASE = """\
============================= test session starts ==============================
platform linux -- Python 3.12.3, pytest-9.2.0, pluggy-1.7.0 -- /usr/bin/python3
rootdir: /tmp/mlir-tests
configfile: pyproject.toml
plugins: xdist-3.8.0
created: 3/3 workers
3 workers [9 items]

scheduling tests via LoadScopeScheduling
tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::test_host_alloc_pinned 
tests/test_array.py::test_param[a b] 
tests/numba_cuda_tests/cudadrv/test_deallocations.py::TestDeallocation::test_max_pending_count 
[gw0] [ 11%] PASSED tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::test_host_alloc_pinned 
[gw1] [ 22%] PASSED tests/test_array.py::test_param[a b] 
[gw2] [ 33%] PASSED tests/numba_cuda_tests/cudadrv/test_deallocations.py::TestDeallocation::test_max_pending_count 
tests/test_array.py::test_param[x::y] 
[gw1] [ 44%] PASSED tests/test_array.py::test_param[x::y] 
tests/numba_cuda_tests/cudapy/test_cuda_array_interface.py::TestCudaArrayInterface::test_ownership 
[gw2] [ 55%] PASSED tests/numba_cuda_tests/cudapy/test_cuda_array_interface.py::TestCudaArrayInterface::test_ownership 
tests/test_array.py::TestSub::test_sub 
[gw1] [ 66%] SUBPASSED(i='0') tests/test_array.py::TestSub::test_sub 
[gw1] [ 66%] PASSED tests/test_array.py::TestSub::test_sub 
tests/test_numpy.py::test_np_elementwise_ops 
[gw0] [ 77%] SUBPASSED[add] (shape=(3,)) tests/test_numpy.py::test_np_elementwise_ops 
[gw0] [ 77%] PASSED tests/test_numpy.py::test_np_elementwise_ops 
tests/test_array.py::test_gone 
[gw1] [ 88%] PASSED tests/test_array.py::test_gone 
tests/test_array.py::test_skipme 
[gw1] [100%] SKIPPED tests/test_array.py::test_skipme 

==================================== ERRORS ====================================
__________ ERROR collecting tests/numba_cuda_tests/cudapy/test_bfloat16.py __________
E   ModuleNotFoundError: No module named 'ml_dtypes'
=========================== short test summary info ============================
ERROR tests/numba_cuda_tests/cudapy/test_bfloat16.py - ModuleNotFoundError: No module named 'ml_dtypes'
SKIPPED [1] tests/test_array.py:40: needs two GPUs
= 8 passed, 1 skipped, 1 error, 2 subtests passed in 61.20s (0:01:01) =
"""

_SAMPLE_PYTEST_PLUGIN = """\
============================= test session starts ==============================
created: 3/3 workers
3 workers [9 items]
[gw0] [ 11%] FAILED tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::test_host_alloc_pinned 
[gw1] [ 22%] FAILED tests/test_array.py::test_param[a b] 
[gw2] [ 33%] SKIPPED tests/numba_cuda_tests/cudadrv/test_deallocations.py::TestDeallocation::test_max_pending_count 
[gw1] [ 44%] PASSED tests/test_array.py::test_param[x::y] 
[gw2] [ 55%] FAILED tests/numba_cuda_tests/cudapy/test_cuda_array_interface.py::TestCudaArrayInterface::test_ownership 
[gw1] [ 66%] SUBFAILED(i='0') tests/test_array.py::TestSub::test_sub 
[gw1] [ 66%] PASSED tests/test_array.py::TestSub::test_sub 
[gw0] [ 77%] PASSED tests/test_numpy.py::test_np_elementwise_ops 
[gw1] [ 88%] ERROR tests/test_array.py::test_gone 
[gw1] [100%] SKIPPED tests/test_array.py::test_skipme 
__________ ERROR collecting tests/numba_cuda_tests/cudapy/test_bfloat16.py __________
= 4 failed, 3 passed, 2 skipped, 2 errors in 64.00s (0:01:04) =
"""

# Without xdist: a failing unittest subTest shows only in the short summary.
_SAMPLE_PYTEST_SERIAL = """\
============================= test session starts ==============================
collecting ... collected 3 items / 1 error

tests/test_array.py::TestSub::test_sub 
tests/test_array.py::TestSub::test_sub PASSED                            [ 33%]
tests/test_array.py::test_param[a b] PASSED                              [ 66%]
tests/test_array.py::test_skipme SKIPPED (needs two GPUs)                [100%]

=========================== short test summary info ============================
SUBFAILED(i=1) tests/test_array.py::TestSub::test_sub - AssertionError: 1 != 0
ERROR tests/numba_cuda_tests/cudapy/test_bfloat16.py
SKIPPED [1] tests/test_array.py:40: needs two GPUs
= 1 failed, 2 passed, 1 skipped, 1 error in 0.07s =
"""

_SAMPLE_PYTEST_CUT = """\
============================= test session starts ==============================
created: 3/3 workers
3 workers [9 items]
tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::test_host_alloc_pinned 
tests/test_array.py::test_param[a b] 
[gw1] [ 22%] PASSED tests/test_array.py::test_param[a b] 
tests/test_array.py::test_param[x::y] 
[.ci/gpu] mlir pool: rc=124 after 300s (timeout)
"""


def _selftest() -> int:
    import tempfile

    x = "numba.cuda.tests.cudapy.test_x.TestX."
    bp = parse_text(_SAMPLE_BASE_PARALLEL, "base-par")
    assert bp.complete and bp.ran == 12 and bp.parallel == (12, 0), bp.describe()
    assert bp.outcomes["numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_array_views"] == "ok"
    assert bp.outcomes[x + "test_flaky"] == "FAIL"
    assert bp.outcomes[x + "test_skipme"] == "skipped"
    assert bp.skip_reasons[x + "test_skipme"] == "'not on this GPU'"
    assert bp.outcomes[x + "test_xf"] == "expected failure"
    assert len(bp.outcomes) == 12, len(bp.outcomes)

    pp = parse_text(_SAMPLE_PLUGIN_PARALLEL, "plug-par")
    assert pp.outcomes[x + "test_sub"] == "FAIL", pp.outcomes[x + "test_sub"]
    assert pp.outcomes[x + "test_xf"] == "unexpected success"
    assert pp.outcomes["unittest.loader._FailedTest.numba.cuda.tests.cudapy.test_z"] == "ERROR"
    assert pp.outcomes["numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_array_views"] == "FAIL"

    ps = parse_text(_SAMPLE_PLUGIN_SERIAL, "plug-ser")
    assert not ps.complete and ps.ci_rc == 124
    assert ps.outcomes["numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle"] == "FAIL"
    assert ps.outcomes["numba.cuda.tests.cudadrv.test_init.TestInit.test_init_reset"] == "unknown"

    sc = parse_text(_SAMPLE_SETUPCLASS, "setup")
    assert sc.outcomes["numba.cuda.tests.cudapy.test_q.TestQ.setUpClass"] == "ERROR"
    assert sc.outcomes["numba.cuda.tests.cudapy.test_q.TestP.test_print"] == "ok"
    assert sc.outcomes["numba.cuda.tests.cudapy.test_q.TestP.test_old"] == "ok"  # Python <= 3.10 form

    with tempfile.TemporaryDirectory() as d:
        paths = {}
        for name, text in (("bp", _SAMPLE_BASE_PARALLEL), ("bs", _SAMPLE_BASE_SERIAL),
                           ("pp", _SAMPLE_PLUGIN_PARALLEL), ("ps", _SAMPLE_PLUGIN_SERIAL)):
            paths[name] = os.path.join(d, name + ".txt")
            with open(paths[name], "w") as f:
                f.write(text)
        base_logs, base = parse_logs([paths["bp"], paths["bs"]])
        # last log wins: the serial run decides test_ipc_handle for the base
        assert base["numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle"] == "ok"

        plug_logs, plug = parse_logs([paths["pp"], paths["ps"]])
        res = compare(base_logs, base, plug_logs, plug, mode="pool", full_scope=True)
        unexpected = {t for t, _, _ in res["unexpected"]}
        assert unexpected == {
            "numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_array_views",
            x + "test_sub", x + "test_xf",
            "numba.cuda.tests.cudadrv.test_init.TestInit.test_init_reset",  # unknown: run ended in it
            # excused no more: the plugin sizes an array's allocation as its block
            "numba.cuda.tests.cudadrv.test_host_alloc.TestHostAlloc.test_host_alloc_pinned",
        }, unexpected
        assert {t for t, _, _ in res["not_run"]} == {x + "test_gone"}  # plugin incomplete
        assert {t for t, _, _ in res["known_skip"]} == {
            "numba.cuda.tests.cudadrv.test_deallocations.TestDeallocation.test_max_pending_count",
            "numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_ownership"}
        assert {t for t, _, _ in res["known_suballoc"]} == {
            "numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle"}
        assert {t for t, _, _ in res["new_pass"]} == {x + "test_flaky"}
        assert {t for t, _, _ in res["new_fail"]} == {
            "unittest.loader._FailedTest.numba.cuda.tests.cudapy.test_z"}
        text, code = report("pool", base_logs, base, plug_logs, plug, res, True)
        assert code == 1 and "RESULT: FAIL" in text, text

        # passthrough: the sub-allocation tests are no longer excused
        res = compare(base_logs, base, plug_logs, plug, mode="passthrough", full_scope=True)
        unexpected = {t for t, _, _ in res["unexpected"]}
        assert "numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle" in unexpected
        assert not res["known_suballoc"]

        # identical logs: PASS, exit 0; targeted scope leaves other modules out
        res = compare(base_logs, base, base_logs, base, mode="pool", full_scope=True)
        text, code = report("same", base_logs, base, base_logs, base, res, True)
        assert code == 0 and not res["unexpected"], text
        tl, tgt = parse_logs([paths["bs"]])
        res = compare(base_logs, base, tl, tgt, mode="passthrough", full_scope=False)
        text, code = report("targeted", base_logs, base, tl, tgt, res, False)
        assert code == 0 and res["out_of_scope"] == 9, (res["out_of_scope"], text)

        # a missing plugin log: inconclusive
        ml, mp = parse_logs([paths["bs"], os.path.join(d, "nope.txt")])
        res = compare(base_logs, base, ml, mp, full_scope=False)
        text, code = report("missing", base_logs, base, ml, mp, res, False)
        assert code == 3 and "MISSING" in text, text

        # CLI, both forms
        rc = main(["--mode", "pool", "--all", "--base", paths["bp"], paths["bs"],
                   "--plugin", paths["bp"], paths["bs"]], out=open(os.devnull, "w"))
        assert rc == 0, rc
        rc = main([paths["bp"], paths["bs"], "--", paths["pp"], paths["ps"], "--mode", "pool"],
                  out=open(os.devnull, "w"))
        assert rc == 1, rc

    # pytest logs (numba-cuda-mlir's suite)
    pb = parse_text(_SAMPLE_PYTEST_BASE, "mlir-base")
    arr = "tests/test_array.py::"
    assert pb.complete and pb.ran == 10 and pb.workers == 3, pb.describe()
    assert pb.outcomes[arr + "test_param[a b]"] == "ok" and pb.outcomes[arr + "test_param[x::y]"] == "ok"
    assert pb.outcomes[arr + "test_skipme"] == "skipped"
    assert pb.outcomes["tests/numba_cuda_tests/cudapy/test_bfloat16.py"] == "ERROR"
    assert pb.outcomes["tests/test_numpy.py::test_np_elementwise_ops"] == "ok"
    assert len(pb.outcomes) == 10, pb.outcomes
    pq = parse_text(_SAMPLE_PYTEST_PLUGIN, "mlir-pool")
    assert pq.complete and pq.ran == 11, pq.describe()
    assert pq.outcomes[arr + "TestSub::test_sub"] == "FAIL"  # a failing subtest fails its test
    assert pq.outcomes[arr + "test_param[a b]"] == "FAIL"
    ps = parse_text(_SAMPLE_PYTEST_SERIAL, "mlir-serial")
    assert ps.complete and ps.workers is None and ps.ran == 5, ps.describe()
    assert ps.outcomes == {arr + "TestSub::test_sub": "FAIL", arr + "test_param[a b]": "ok",
                           arr + "test_skipme": "skipped",
                           "tests/numba_cuda_tests/cudapy/test_bfloat16.py": "ERROR"}, ps.outcomes
    assert ps.skip_reasons[arr + "test_skipme"] == "(needs two GPUs)"
    assert parse_text("== test session starts ==\ncreated: 1/1 worker\n", "one").workers == 1
    pc = parse_text(_SAMPLE_PYTEST_CUT, "mlir-cut")
    assert not pc.complete and pc.ci_rc == 124 and pc.workers == 3
    assert pc.outcomes == {arr + "test_param[a b]": "ok"}, pc.outcomes
    assert sorted(pc.in_flight) == [_MLIR_HA + "test_host_alloc_pinned", arr + "test_param[x::y]"]
    assert "2 tests in flight" in pc.describe()
    assert module_of(arr + "test_param[x::y]") == "tests/test_array.py"
    with tempfile.TemporaryDirectory() as d:
        paths = {}
        for name, text in (("base", _SAMPLE_PYTEST_BASE), ("plug", _SAMPLE_PYTEST_PLUGIN),
                           ("cut", _SAMPLE_PYTEST_CUT)):
            paths[name] = os.path.join(d, name + ".txt")
            with open(paths[name], "w") as f:
                f.write(text)
        base_logs, base = parse_logs([paths["base"]])
        plug_logs, plug = parse_logs([paths["plug"]])
        res = compare(base_logs, base, plug_logs, plug, mode="pool", full_scope=True)
        assert {t for t, _, _ in res["unexpected"]} == {
            arr + "test_param[a b]", arr + "TestSub::test_sub", arr + "test_gone"}, res["unexpected"]
        assert {t for t, _, _ in res["known_skip"]} == {
            _MLIR_DEALLOC + "test_max_pending_count",
            "tests/numba_cuda_tests/cudapy/test_cuda_array_interface.py::TestCudaArrayInterface::test_ownership"}
        assert {t for t, _, _ in res["known_suballoc"]} == {_MLIR_HA + "test_host_alloc_pinned"}
        text, code = report("mlir", base_logs, base, plug_logs, plug, res, True)
        assert code == 1, text
        # cut off: what finished is compared, what was in flight or not reached is not run
        cut_logs, cut = parse_logs([paths["cut"]])
        res = compare(base_logs, base, cut_logs, cut, mode="pool", full_scope=True)
        assert not res["unexpected"] and len(res["not_run"]) == 5, res
        text, code = report("mlir-cut", base_logs, base, cut_logs, cut, res, True)
        assert code == 3 and "INCONCLUSIVE" in text, text
        # the base cut off: a plugin failure it never reached is no regression, nor a pass
        res = compare(cut_logs, cut, plug_logs, plug, mode="pool", full_scope=True)
        assert {t for t, _, _ in res["unexpected"]} == {arr + "test_param[a b]"}, res
        assert arr + "test_gone" in {t for t, _, _ in res["not_reached"]} and not res["new_fail"]
        text, code = report("base-cut", cut_logs, cut, plug_logs, plug, res, True)
        assert code == 1, text
    print("compare_numba.py selftest: OK")
    return 0


# ---------------------------------------------------------------------------------------------


def main(argv=None, out=None) -> int:
    out = out or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--selftest" in argv:
        return _selftest()
    positional_plugin = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
        # options may follow the plugin logs too
        while rest and not rest[0].startswith("--"):
            positional_plugin.append(rest.pop(0))
        argv += rest
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base_pos", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--base", nargs="+", default=[])
    ap.add_argument("--plugin", nargs="+", default=[])
    ap.add_argument("--mode", default=None)
    ap.add_argument("--label", default=None)
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--allow-incomplete", action="store_true")
    ap.add_argument("--expect-fail", action="append", default=[])
    ap.add_argument("--selftest", action="store_true")
    a = ap.parse_args(argv)
    base_paths = a.base + a.base_pos
    plug_paths = a.plugin + positional_plugin
    if not base_paths or not plug_paths:
        ap.error("need base logs and plugin logs (--base ... --plugin ..., or BASE... -- PLUGIN...)")
    base_logs, base = parse_logs(base_paths)
    plug_logs, plug = parse_logs(plug_paths)
    res = compare(base_logs, base, plug_logs, plug, mode=a.mode, full_scope=a.all,
                  expect_fail=a.expect_fail)
    text, code = report(a.label or a.mode or "plugin", base_logs, base, plug_logs, plug, res, a.all)
    out.write(text)
    out.flush()
    if code == 3 and a.allow_incomplete:
        code = 0
    return code


if __name__ == "__main__":
    sys.exit(main())

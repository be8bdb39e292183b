#!/usr/bin/env python3
"""Compare Numba CUDA test-suite runs: Numba's default memory manager vs. an EMM plugin.

Reads the ``-v`` output of ``python -m numba.runtests`` (numba-cuda's suite, serial or ``-m N``
parallel) or of ``pytest -v`` (numba-cuda-mlir's suite, with or without pytest-xdist), one or
more logs per side, and answers: does every test that passes with Numba's own manager also pass
with the plugin?  Tests are named by their full unittest id
(``numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle``) or pytest node id
(``tests/numba_cuda_tests/cudadrv/test_host_alloc.py::TestHostAlloc::test_host_alloc_pinned``).

Usage (the options: --help)::

    compare_numba.py [options] --base LOG [LOG ...] --plugin LOG [LOG ...]
    compare_numba.py [options] BASE_LOG [BASE_LOG ...] -- PLUGIN_LOG [PLUGIN_LOG ...]

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
_DEALLOC = ("test_max_pending_count", "test_max_pending_bytes", "test_defer_cleanup",
            "test_nested_defer_cleanup", "test_exception")  # in each suite's TestDeallocation

# Tests of Numba's own deferred-deallocation bookkeeping, which any external manager bypasses:
# skipped whenever NUMBA_CUDA_MEMORY_MANAGER != "default" (testing.skip_if_external_memmgr),
# except numba-cuda-mlir's test_ownership, which lost that decorator and fails instead (it
# counts entries in the manager's `deallocations`, which only Numba's own memalloc adds).
KNOWN_EXTERNAL_SKIPS = (
    *("numba.cuda.tests.cudadrv.test_deallocations.TestDeallocation." + t for t in _DEALLOC),
    "numba.cuda.tests.cudapy.test_cuda_array_interface.TestCudaArrayInterface.test_ownership",
    *(_MLIR_DEALLOC + t for t in _DEALLOC),
    "tests/numba_cuda_tests/cudapy/test_cuda_array_interface.py::TestCudaArrayInterface::test_ownership",
)

# Assume one cuMemAlloc per allocation: may fail in a sub-allocating mode (docs/design.md, Modes).
# Not numba-cuda's test_host_alloc_pinned: the plugin's device_extents answers with the array's
# block (python/emmpool/_numba_extents.py). numba-cuda-mlir's has the same wrapper, but no GPU
# run has shown it passing yet: it stays excused.
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
    return b if a is None or RANK[b] < RANK[a] else a


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

    def _set_status(self, tid: str, match: re.Match) -> None:
        """A test's status line (_STATUS), with the reason of a skip."""
        status = _status_name(match.group(1))
        self._set(tid, status)
        if status == "skipped":
            self.skip_reasons[tid] = match.group(1)[len("skipped"):].strip()

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
                    self.outcomes.setdefault(tid, None)
                    pending = None
                    continue
                self.outcomes.setdefault(tid, None)
                if sm:
                    self._set_status(tid, sm)
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
                sm = _STATUS.match(tail) if tail is not None else None
                if sm:
                    self._set_status(pending, sm)
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
                self.outcomes.setdefault(tid, None)
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
    res["known_status"] = [(tid, base.get(tid, "not run"), plug.get(tid, "not run"))
                           for tid in KNOWN_EXTERNAL_SKIPS + KNOWN_SUBALLOC_FAILS
                           if tid in base or tid in plug]
    res.update(out_of_scope=out_of_scope, plug_complete=plug_complete,
               base_complete=base_complete, suballoc=suballoc)
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
    L += ["         " + lr.describe() for lr in base_logs]
    L.append("plugin " + counts_line(plug))
    L += ["         " + lr.describe() for lr in plug_logs]
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
        L.extend(["", f"-- {title} ({len(rows)}) --"])
        L.extend(f"  {tid}: {b} -> {p}" for tid, b, p in sorted(rows))

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


def main(argv=None, out=None) -> int:
    out = out or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
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
    ap.add_argument("--mode", help="the plugin's EMMPOOL_MODE; in a sub-allocating mode (pool) the "
                    "tests that assume one cuMemAlloc per allocation may fail")
    ap.add_argument("--label", help="title for the report [MODE, else plugin]")
    ap.add_argument("--all", action="store_true", help="every test the base ran is in scope (the "
                    "plugin ran the same suite) [only the modules the plugin logs mention]")
    ap.add_argument("--expect-fail", action="append", default=[], metavar="ID",
                    help="a test id (fnmatch pattern) that may fail with the plugin; repeatable")
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
    return code


if __name__ == "__main__":
    sys.exit(main())

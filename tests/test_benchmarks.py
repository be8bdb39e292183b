"""The benchmarks' own bookkeeping, checked without a GPU: bench_numba's interleaved rounds stop
at a deadline with what they finished (a GPU step cut off by its timeout would keep nothing),
and its report says so; the in-process pairing times the managers' blocks in turns and takes
each ratio within a round. Each child (one process per manager, or per emmpool build, and
round) is replaced by a fake that takes a known time. mixed_programs.py: its options, search,
tables, merge and children, and its programs' logic on the CPU."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from tests.conftest import benchmark_module, needs_repository, require

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if not BENCHMARKS.is_dir():  # a wheel's test run takes tests/ alone
    pytest.skip(needs_repository("benchmarks/"), allow_module_level=True)


@pytest.fixture
def bench_numba(monkeypatch):
    require("numba.cuda")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_numba

    return bench_numba


@pytest.fixture
def numba_cases(bench_numba):
    """bench_numba's child side: the cases and their timing."""
    return bench_numba.numba_cases


def fake_children(bench_numba, monkeypatch, seconds):
    """Every child sleeps `seconds` and reports 10 us per op (the floor) or 11 (the others)."""
    ran = []

    def run_child(name, extra_env, args, guests=None):
        ran.append(name)
        time.sleep(seconds)
        us = 10.0 if name == bench_numba.FLOOR else 11.0
        return {"manager": name, "gpu": "fake GPU", "versions": {}, "checks": {},
                "cases": {c: {"us_per_op": us} for c in bench_numba.numba_cases.CASES},
                "wall_s": seconds}

    monkeypatch.setattr(bench_numba, "_run_child", run_child)
    return ran


def run_parent(bench_numba, tmp_path, *args):
    """The process pairing (one child per manager and round); returns its JSON report."""
    argv = ["--out", str(tmp_path), "--cpus", "0", "--managers", "nothing", "emmpool",
            "--pairing", "process", *args]
    assert bench_numba.main(argv) == 0
    return json.loads((tmp_path / "bench_numba_process.json").read_text())


def test_rounds_stop_at_the_time_limit_and_keep_what_ran(bench_numba, monkeypatch, tmp_path):
    monkeypatch.delenv("EMMCI_BENCH_DEADLINE", raising=False)
    ran = fake_children(bench_numba, monkeypatch, 0.2)
    # A round takes 0.4 s: two fit in 1.0 s, a third would end at 1.2 s.
    report = run_parent(bench_numba, tmp_path, "--rounds", "5", "--time-limit", "1.0")
    assert ran == ["nothing", "emmpool"] * 2
    assert report["rounds"] == 2 and report["rounds_asked"] == 5
    cell = report["managers"]["emmpool"]["cases"]["churn"]
    assert cell["rounds_us"] == [11.0, 11.0] and cell["us_per_op"] == 11.0
    md = (tmp_path / "bench_numba_process.md").read_text()
    assert "stopped after 2 of 5 rounds" in md and "2 rounds for the floor" in md


def test_the_deadline_from_the_environment_and_at_least_one_round(bench_numba, monkeypatch,
                                                                  tmp_path):
    monkeypatch.setenv("EMMCI_BENCH_DEADLINE", str(time.time() - 1))  # already passed
    ran = fake_children(bench_numba, monkeypatch, 0.0)
    report = run_parent(bench_numba, tmp_path, "--rounds", "3")
    assert ran == ["nothing", "emmpool"] and report["rounds"] == 1


def test_without_a_limit_every_round_runs(bench_numba, monkeypatch, tmp_path):
    monkeypatch.delenv("EMMCI_BENCH_DEADLINE", raising=False)
    ran = fake_children(bench_numba, monkeypatch, 0.0)
    report = run_parent(bench_numba, tmp_path, "--rounds", "3")
    assert ran == ["nothing", "emmpool"] * 3 and report["rounds"] == 3
    assert "stopped after" not in (tmp_path / "bench_numba_process.md").read_text()


def test_pool_counters_are_per_timed_op_and_noted(bench_numba, numba_cases, monkeypatch,
                                                  tmp_path):
    # _measure: the counters' change over the timed blocks only (not warm-up or calibration),
    # divided by the timed ops.
    done = {"ops": 0}

    def run(n):
        done["ops"] += n

    def counters():  # one fence per five ops
        return {"batches_closed": done["ops"] // 5}

    knobs = dict(numba_cases.QUICK, warmup_s=0.0, budget=0.01)
    c = numba_cases._measure(run, lambda: None, knobs, counters)
    timed = c["ops_per_block"] * c["blocks"]
    assert done["ops"] > 1.2 * timed  # warm-up and calibration ran ops too: not counted
    assert c["pool_per_op"]["batches_closed"] == pytest.approx(0.2, abs=1.0 / timed)
    assert "pool_per_op" not in numba_cases._measure(run, lambda: None, knobs)

    # The markdown notes them for the managers that report them.
    def run_child(name, extra_env, args, guests=None):
        cases = {k: {"us_per_op": 10.0} for k in numba_cases.CASES}
        if name == "emmpool":
            cases["churn"]["pool_per_op"] = {"batches_closed": 0.25, "fence_queries": 0.0}
            cases["alloc_axpy"]["pool_per_op"] = {"batches_closed": 0.0}
        return {"manager": name, "gpu": "fake GPU", "versions": {}, "checks": {},
                "cases": cases, "wall_s": 0.0}

    monkeypatch.delenv("EMMCI_BENCH_DEADLINE", raising=False)
    monkeypatch.setattr(bench_numba, "_run_child", run_child)
    run_parent(bench_numba, tmp_path, "--rounds", "1")
    md = (tmp_path / "bench_numba_process.md").read_text()
    assert "`emmpool` pool work per op" in md
    assert "churn: 0.25 batches_closed;" in md and "alloc_axpy: none" in md


def test_pool_counters_are_emmpools_alone_and_per_op(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import emmpool
    import pool_counters

    assert pool_counters.reader("rmm-async", ("fence_waits",)) is None
    counts = {"fence_waits": 3, "segments": 1}
    monkeypatch.setattr(emmpool, "stats", lambda device: dict(counts))
    read = pool_counters.reader("emmpool-growable", ("fence_waits", "page_maps"))
    before = read()
    assert before == {"fence_waits": 3}  # a counter this build lacks is skipped
    counts["fence_waits"] = 11
    assert pool_counters.per_op(before, read(), 4) == {"fence_waits": 2.0}


def test_paired_blocks_take_turns_and_ratios_are_block_by_block(numba_cases, monkeypatch):
    # Three managers, the floor first: blocks in the order A B C, C B A, ... with the manager
    # switched in before each, and each ratio the block's time over the floor's block of the
    # same turn, so that a host that slows down half-way changes no ratio.
    clock = {"t": 0.0, "slow": 1.0}
    log = []
    current = {"name": None}
    cost = {"nothing": 1e-6, "emmpool": 1.05e-6, "cupy-pool": 2e-6}

    def make_run(name):
        def run(n):
            assert current["name"] == name  # the manager it times is the one in place
            log.append(name)
            clock["t"] += n * cost[name] * clock["slow"]
        return run

    def switch(name):
        current["name"] = name

    knobs = dict(numba_cases.QUICK, warmup_s=0.0, repeats=4)
    ticks = iter(range(10**6))

    def fake_clock():
        # the host halves its speed after a while (every call to the clock is a tick)
        if next(ticks) == 60:
            clock["slow"] = 2.0
        return clock["t"]

    runs = {n: make_run(n) for n in cost}
    monkeypatch.setattr(numba_cases.time, "perf_counter", fake_clock)
    out = numba_cases._measure_paired(runs, switch, lambda: None, knobs)
    timed = log[-12:]
    assert timed == ["nothing", "emmpool", "cupy-pool", "cupy-pool", "emmpool", "nothing"] * 2
    assert "ratio_to_floor" not in out["nothing"]
    assert out["emmpool"]["ratio_to_floor"] == pytest.approx(1.05)
    assert out["cupy-pool"]["ratio_to_floor"] == pytest.approx(2.0)
    assert len(out["emmpool"]["block_ratios"]) == 4
    # the slowdown came half-way through the timed blocks: the figures moved, the ratios not
    assert max(out["nothing"]["block_means_us"]) == pytest.approx(2 * 1.0)
    assert min(out["nothing"]["block_means_us"]) == pytest.approx(1.0)


def test_paired_rounds_quote_the_median_ratio_within_processes(bench_numba, monkeypatch,
                                                               tmp_path):
    # Round figures of the floor and emmpool drift together (the host's speed), the ratio
    # within each process does not: the quoted ratio is the median of the rounds' ratios, not
    # the ratio of the medians. A later emmpool build gets its own child, with the floor.
    monkeypatch.delenv("EMMCI_BENCH_DEADLINE", raising=False)
    calls = []
    speeds = iter([1.0, 1.6, 1.0, 1.6, 1.0])

    def run_child(name, extra_env, args, guests=None):
        calls.append((name, guests))
        speed = next(speeds) if name == "emmpool" else 1.0
        paired = [bench_numba.FLOOR, name] + [g for g in guests if g != bench_numba.FLOOR]
        cases = {}
        for case in bench_numba.numba_cases.CASES:
            cell = {bench_numba.FLOOR: {"us_per_op": 10.0 * speed}}
            cell[name] = {"us_per_op": 10.4 * speed, "ratio_to_floor": 1.04}
            for g in paired[2:]:
                cell[g] = {"us_per_op": 20.0 * speed, "ratio_to_floor": 2.0}
            cases[case] = cell
        return {"manager": name, "gpu": "fake GPU", "versions": {}, "paired": paired,
                "checks": {n: {} for n in paired}, "cases": cases, "wall_s": 0.0,
                "skipped_guests": {"cupy-pool": "ImportError: no cupy"}
                if "cupy-pool" in guests else {}}

    monkeypatch.setattr(bench_numba, "_run_child", run_child)
    argv = ["--out", str(tmp_path), "--cpus", "0", "--rounds", "5",
            "--managers", "nothing", "emmpool", "cudamalloc", "cupy-pool"]
    assert bench_numba.main(argv) == 0
    report = json.loads((tmp_path / "bench_numba.json").read_text())
    assert calls == [("emmpool", ["nothing", "cudamalloc", "cupy-pool"])] * 5
    assert report["pairing"] == "in-process" and report["rounds"] == 5
    emm = report["managers"]["emmpool"]["cases"]["alloc_free_256B"]
    assert emm["ratio_to_floor"] == 1.04 and emm["rounds_ratio"] == [1.04] * 5
    assert emm["rounds_us"] == pytest.approx([10.4, 16.64, 10.4, 16.64, 10.4])
    assert report["managers"]["cudamalloc"]["cases"]["churn"]["ratio_to_floor"] == 2.0
    assert report["managers"]["cupy-pool"]["skipped"] == "ImportError: no cupy"
    md = (tmp_path / "bench_numba.md").read_text()
    assert "| emmpool | 10.4 (1.04×) 1.04–1.04 |" in md
    assert "`cupy-pool` skipped" in md


def test_paired_mode_needs_emmpool(bench_numba, tmp_path):
    with pytest.raises(SystemExit, match="needs an emmpool manager"):
        bench_numba.main(["--out", str(tmp_path), "--cpus", "0",
                          "--managers", "nothing", "cupy-pool"])


def test_a_case_that_raises_is_recorded_as_its_error(numba_cases, capsys):
    # One case's failure must not stop the child's other cases: the error is its cell.
    def fails():
        raise RuntimeError("out of memory")

    failed = numba_cases._timed_case("emmpool churn", fails)
    assert failed == {"error": "RuntimeError: out of memory"}
    ok = {"us_per_op": 1.5, "blocks": 7, "ops_per_block": 100}
    assert numba_cases._timed_case("emmpool churn", lambda: ok) is ok
    err = capsys.readouterr().err
    assert "[bench]   emmpool churn: RuntimeError: out of memory" in err
    assert "[bench]   emmpool churn: 1.50 us/op (7 x 100 ops)" in err


# dask_spill.py: its setups, sizes and closed form, the table and goals from fake children, and
# a child killed with its own children at its time limit.


@pytest.fixture
def dask_spill(monkeypatch):
    require("distributed")
    require("numba.cuda")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import dask_spill

    return dask_spill


def test_dask_spill_setups_sizes_and_closed_form(dask_spill):
    import numpy as np

    assert dask_spill.parse_setup("emmpool") == ("emmpool", 1.0)
    assert dask_spill.parse_setup("rmm-pool@0.75") == ("rmm-pool", 0.75)
    for bad in ["rmm", "none@0", "none@1.5", "emmpool@x"]:
        with pytest.raises(ValueError, match="setup"):
            dask_spill.parse_setup(bad)
    # 13 x 13 chunks of 288 MiB: 47.5 GiB, 1.48 times two 16 GiB caps
    assert dask_spill.sizes(16 << 30, 2, 1.5, 6144) == 13
    n = 7
    d = np.subtract.outer(np.arange(n), np.arange(n)).astype(float)
    s = (dask_spill.A * d + dask_spill.B) ** 2 + (-dask_spill.A * d + dask_spill.B) ** 2
    assert s.sum() == dask_spill.closed_form_sum(n)
    checks = np.array([[s.sum() / 4, 0, s.sum() / 4, 0], [s.sum() / 4, 0, s.sum() / 4, 1]])
    assert dask_spill.verify(checks, 2, 7)["wrong_elements"] == 1  # n = 2 x 7: sums off too
    assert not dask_spill.verify(checks, 2, 7)["result_ok"]


def fake_setups(dask_spill, monkeypatch, outcomes):
    """Children that return `outcomes[spec]` at once, on two fake GPUs whose peak in the job is
    the outcome's `peak` (GiB), and 40 GiB over the setup's life."""
    ran = []
    samplers = []

    class Sampler:
        def __init__(self, gpus):
            samplers.append(self)

        def stop(self):
            return [40 << 30] * 2

        def peak_within(self, start, end):
            assert (start, end) == (1.0, 2.0)
            return [self.peak * 2**30] * 2

    def run_child(job, timeout, log):
        ran.append((job["setup"], job["blocks"]))
        r = dict(outcomes[job["setup"]])
        samplers[-1].peak = r.pop("peak", 1)
        return {"setup": job["setup"], "device_memory_limit": 16 << 30, "job_start": 1.0,
                "job_end": 2.0, **r}

    gpus = [types.SimpleNamespace(index=i, name="fake GPU", uuid=f"GPU-{i}", total=80 << 30,
                                  used=lambda: 0, settle=lambda idle, **_: 0) for i in (0, 1)]
    monkeypatch.setattr(dask_spill.nvml, "gpus", lambda devices: gpus)
    monkeypatch.setattr(dask_spill, "PeakSampler", Sampler)
    monkeypatch.setattr(dask_spill, "_run_child", run_child)
    monkeypatch.delenv("EMMCI_BENCH_DEADLINE", raising=False)
    return ran


def test_dask_spill_reports_each_setup_and_the_goals(dask_spill, monkeypatch, tmp_path):
    ok = {"result_ok": True, "error": None, "tasks_failed": 0, "persist_s": 8.0,
          "check_s": 2.0, "cluster_start_s": 3.0}
    spills = {"w1": {"to_host_bytes": 4 << 30, "to_device_bytes": 2 << 30,
                     "oom_spilled_bytes": 1 << 30}}
    outcomes = {
        "none": {**ok, "wall_s": 1.0},  # the warm-up
        "emmpool": {**ok, "wall_s": 10.0, "peak": 16.5, "spills": spills,
                    "emmpool": {"w1": {"0": {"peak_bytes_reserved": 16 << 30}}}},
        "rmm-pool": {**ok, "result_ok": False, "wall_s": 4.0, "tasks_failed": 5,
                     "error": "5 of S's chunks erred", "check_s": None,
                     "task_errors": ["OutOfMemoryError('out of memory allocating 301989888')"]},
        "rmm-pool@0.75": {**ok, "wall_s": 12.0, "peak": 16.6},
        "rmm-async": {**ok, "result_ok": False, "wall_s": 20.0, "tasks_failed": 3, "check_s": None,
                      "stalled": True, "error": "stalled: tasks failed and none finished"},
    }
    ran = fake_setups(dask_spill, monkeypatch, outcomes)
    argv = ["--out", str(tmp_path), "--setups", "emmpool", "rmm-pool", "rmm-pool@0.75",
            "rmm-async"]
    assert dask_spill.main(argv) == 0
    assert ran == [("none", 2), ("emmpool", 13), ("rmm-pool", 13), ("rmm-pool@0.75", 13),
                   ("rmm-async", 13)]
    md = (tmp_path / "dask_spill.md").read_text()
    assert "| emmpool | 16.00 | ok | 0 | 10.0 | 8.0 | 2.0 | 16.50, 16.50 | 16.00 reserved " \
           "| 4.00 | 1.00 | 2.00 | 3.0 |" in md
    assert "| rmm-pool | 16.00 | FAILED: 5 tasks | 5 |" in md
    assert "| rmm-async | 16.00 | FAILED: 3 tasks, then stalled | 3 |" in md
    assert "  - against rmm-pool: it did not finish (FAILED: 5 tasks)" in md
    assert "  - against rmm-pool@0.75: wall 10.0 s vs 12.0 s ✓; peak 16.50 vs 16.60 GiB ✓" in md
    assert "- rmm-pool: a failed task: `OutOfMemoryError('out of memory allocating" in md
    report = json.loads((tmp_path / "dask_spill.json").read_text())
    assert report["job"]["blocks"] == 13 and report["warmup"]["setup"] == "none"
    assert [r["setup"] for r in report["results"]] == ["emmpool", "rmm-pool", "rmm-pool@0.75",
                                                       "rmm-async"]
    assert report["results"][0]["peak_whole"] == {"0": 40 << 30, "1": 40 << 30}


def test_dask_spill_skips_setups_past_the_deadline_and_fails_on_emmpool(dask_spill,
                                                                        monkeypatch, tmp_path):
    outcomes = {"emmpool": {"tasks_failed": 2, "error": "2 of S's chunks erred", "wall_s": 5.0}}
    ran = fake_setups(dask_spill, monkeypatch, outcomes)
    clock = [1000.0]
    run_child = dask_spill._run_child

    def slow_child(job, timeout, log):  # takes 50 of the run's 100 s
        clock[0] += 50
        return run_child(job, timeout, log)

    monkeypatch.setattr(dask_spill, "_run_child", slow_child)
    monkeypatch.setattr(dask_spill, "time", types.SimpleNamespace(
        time=lambda: clock[0], perf_counter=time.perf_counter, monotonic=time.monotonic,
        sleep=time.sleep))
    argv = ["--out", str(tmp_path), "--no-warmup", "--setups", "emmpool", "none",
            "--time-limit", "100", "--min-setup-time", "60"]
    assert dask_spill.main(argv) == 1  # emmpool's tasks failed
    assert ran == [("emmpool", 13)]
    md = (tmp_path / "dask_spill.md").read_text()
    assert "| none | | skipped (50 s left) |" in md
    assert "- emmpool: FAILED: 2 tasks ✗" in md


def test_dask_spill_kills_a_child_with_its_children_at_its_time_limit(dask_spill, monkeypatch,
                                                                       tmp_path):
    # The child's workers are its own children: they go with it.
    script = tmp_path / "child.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n")
    monkeypatch.setattr(dask_spill, "__file__", str(script))
    log = tmp_path / "log.txt"
    t = time.monotonic()
    r = dask_spill._run_child({"setup": "emmpool"}, 2.0, log)
    assert time.monotonic() - t < 20
    assert r["timed_out"] and "killed at the setup's time limit (2 s)" in r["error"]
    assert dask_spill.outcome(r) == "timed out"
    grandchild = Path(f"/proc/{int(log.read_text().split()[0])}/stat")
    for _ in range(50):
        if not grandchild.exists() or grandchild.read_text().split(") ")[1][0] in "ZX":
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the child's own child outlived it")


def test_dask_spill_waits_until_tasks_fail_and_nothing_moves(dask_spill, monkeypatch):
    import distributed

    class Future:
        def __init__(self, status):
            self.status = status

        def done(self):
            return self.status != "pending"

    def wait(futures, timeout):
        time.sleep(0.01)
        raise TimeoutError

    monkeypatch.setattr(distributed, "wait", wait)
    stuck = [Future("error"), Future("pending")]
    with pytest.raises(dask_spill.Stalled, match="stalled"):
        dask_spill.wait_for_progress(stuck, time.perf_counter() + 10, stall=0.05)
    # without a failure, nothing stalls: the deadline ends it
    slow = [Future("finished"), Future("pending")]
    with pytest.raises(TimeoutError):
        dask_spill.wait_for_progress(slow, time.perf_counter() + 0.2, stall=0.05)


def test_dask_spill_peak_within_the_job(dask_spill):
    sampler = object.__new__(dask_spill.PeakSampler)  # no NVML: samples set by hand
    sampler.baseline = [100, 200]
    sampler.samples = [(1.0, [900, 200]), (2.0, [300, 700]), (3.0, [150, 250])]
    assert sampler.peak_within(1.5, 3.0) == [200, 500]
    assert sampler.peak_within(5.0, 6.0) is None


# mixed_programs.py: its options, the capacity search, the tables and goals from a synthetic
# document, the merge, the children's outcomes, and the programs' own logic on the CPU. The GPU
# run is tests/test_gpu_mixed_programs.py.


@pytest.fixture
def mixed(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import mixed_programs

    return mixed_programs


@pytest.fixture
def report(mixed):
    import mixed_report

    return mixed_report


@pytest.fixture
def children(mixed):
    import mixed_children

    return mixed_children


def test_mixed_options_defaults_quick_and_errors(mixed, capsys):
    a = mixed.parse_args(["--out", "x"])
    assert a.programs == ["cupy_torch", "numba_cupy_torch", "rapids"]
    assert a.setups == list(mixed.work.SETUPS)
    assert (a.rounds, a.cycles, a.probes, a.budget) == (3, 8, 5, 8 << 30)
    assert a.scales == {"cupy_torch": 16, "numba_cupy_torch": 16, "rapids": 16}
    q = mixed.parse_args(["--out", "x", "--quick", "--programs", "c,a",
                          "--setups", "emmpool,separate", "rmm-pool", "--scales", "a=3",
                          "--rmm-initial-pool", "1GiB", "--devices", "0,2"])
    assert q.programs == ["rapids", "cupy_torch"]
    assert q.setups == ["emmpool", "separate", "rmm-pool"]
    assert (q.rounds, q.cycles, q.probes, q.budget) == (1, 2, 3, 2 << 30)
    assert q.scales == {"rapids": 1, "cupy_torch": 3}
    assert q.rmm_initial_pool == 1 << 30 and q.devices == [0, 2]
    assert mixed.parse_size("1.5GiB") == 3 << 29 and mixed.parse_size("512") == 512
    bad = [
        (["--programs", "d"], "unknown program 'd'"),
        (["--setups", "rmm"], "unknown setup 'rmm'"),
        (["--scales", "a=0"], "PROGRAM=SCALE"),
        (["--skip-capacity", "--capacity-only"], "exclude each other"),
        (["--rmm-initial-pool", "lots"], "is not a size"),
        (["--grow", "1"], "--grow"),
        (["--devices", "x"], "NVML indices"),
    ]
    for extra, message in bad:
        with pytest.raises(SystemExit):
            mixed.parse_args(["--out", "x", *extra])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mixed.parse_args([])
    assert "--out DIR is required" in capsys.readouterr().err


def threshold(limit, errors=()):
    """A fake probe: scales up to `limit` fit, larger ones run out of memory, `errors` fail
    otherwise; it records what it was asked."""
    asked = []

    def probe(scale):
        asked.append(scale)
        if scale in errors:
            return "error"
        return "ok" if scale <= limit else "oom"

    return probe, asked


@pytest.mark.parametrize("limit", [1, 2, 7, 30, 31, 64, 100, 333])
@pytest.mark.parametrize("start", [1, 10, 40, 500])
def test_mixed_search_brackets_the_limit_and_stays_consistent(mixed, limit, start):
    probe, asked = threshold(limit)
    found = mixed.search_capacity(probe, start, max_probes=40, resolution=0.0)
    # enough probes and no tolerance: the exact limit, bracketed by the next scale
    assert found["largest"] == limit and found["smallest_failing"] == limit + 1
    assert found["stopped"] is None
    # every probe after the first lies strictly inside what the earlier ones left open
    lo, hi = 0, None
    for scale, outcome in found["probes"]:
        assert scale > lo and (hi is None or scale < hi), found["probes"]
        assert outcome == ("ok" if scale <= limit else "oom")
        if outcome == "ok":
            lo = scale
        else:
            hi = scale
    assert asked == [s for s, _ in found["probes"]]


def test_mixed_search_stops_at_its_probes_and_resolution(mixed):
    probe, asked = threshold(1000)
    found = mixed.search_capacity(probe, 700, grow=1.25, max_probes=6, resolution=0.03)
    assert len(asked) <= 6
    assert found["largest"] <= 1000 < (found["smallest_failing"] or 10**9)
    if found["smallest_failing"] is not None:
        res = (found["smallest_failing"] - found["largest"]) / found["largest"]
        assert found["resolution"] == pytest.approx(res)
    # 700 ok, 875 ok, 1094 oom, then bisection: 984, 1039, 1011 -> a bracket of 3%, the 6th
    assert found["probes"] == [[700, "ok"], [875, "ok"], [1094, "oom"], [984, "ok"],
                               [1039, "oom"], [1011, "oom"]]
    # (1011 - 984) / 984 = 2.7%: within the resolution asked, in the 6 probes allowed
    assert found["largest"] == 984 and found["stopped"] is None
    assert found["resolution"] == pytest.approx(27 / 984)
    # a finer resolution than 6 probes reach: said so
    probe, _ = threshold(1000)
    found = mixed.search_capacity(probe, 700, max_probes=6, resolution=0.005)
    assert found["stopped"] == "6 probes made" and found["largest"] == 984


def test_mixed_search_errors_are_never_fits(mixed):
    probe, asked = threshold(50, errors={40})
    found = mixed.search_capacity(probe, 32, max_probes=10)
    assert asked == [32, 40]
    assert found["largest"] == 32 and found["smallest_failing"] is None
    assert found["stopped"] == "error at scale 40"
    # nothing fits at all: down to scale 1, then no more
    probe, asked = threshold(0)
    found = mixed.search_capacity(probe, 5, max_probes=10)
    assert found["largest"] == 0 and found["smallest_failing"] == 1 and asked[-1] == 1
    # the time limit
    probe, asked = threshold(50)
    calls = iter([False, False, True])
    found = mixed.search_capacity(probe, 8, max_probes=10, out_of_time=lambda: next(calls))
    assert len(asked) == 2 and found["stopped"] == "the run's time limit"


def test_mixed_search_starts_where_the_timing_peak_predicts(mixed):
    # 16 units used 4 GiB beyond a 0.5 GiB context: 8 GiB predicts 32, at 95%: 30
    timing = {"peak": int(4.5 * (1 << 30)), "context": 1 << 29, "scale": 16}
    assert mixed.predict_start(8 << 30, timing, 1 << 30) == 30
    assert mixed.predict_start(8 << 30, None, 1 << 29) == 16
    assert mixed.predict_start(1 << 20, None, 1 << 30) == 1


def test_mixed_failure_classification(mixed):
    classify = mixed.work.classify_failure

    class OutOfMemoryError(RuntimeError):   # torch.OutOfMemoryError's name
        pass

    class CudaAPIError(Exception):          # Numba's, with its code
        def __init__(self, code, msg):
            super().__init__(msg)
            self.code = code

    class CUBLASError(RuntimeError):
        pass

    assert classify(MemoryError("Out of memory allocating 1,024 bytes")) == "oom"
    assert classify(OutOfMemoryError("CUDA out of memory. Tried to allocate")) == "oom"
    assert classify(CudaAPIError(2, "[CUresult.CUDA_ERROR_OUT_OF_MEMORY] cuMemAlloc")) == "oom"
    assert classify(CudaAPIError(1, "CUDA_ERROR_INVALID_VALUE")) == "error"
    assert classify(CUBLASError("CUBLAS_STATUS_ALLOC_FAILED")) == "oom"
    assert classify(RuntimeError("std::bad_alloc: out_of_memory: RMM failure")) == "oom"
    assert classify(ValueError("shapes (3,4) and (5,) not aligned")) == "error"
    assert classify(KeyboardInterrupt()) == "error"
    try:
        try:
            raise MemoryError("out of memory")
        except MemoryError as e:
            raise RuntimeError("a kernel launch failed") from e
    except RuntimeError as e:
        assert classify(e) == "oom"   # its cause


def test_mixed_setups_not_run_and_environments(mixed):
    work = mixed.work
    assert mixed.importable("json") and not mixed.importable("no_such_module.sub")
    everything = lambda module: True  # noqa: E731
    assert work.not_run_reason("rapids", "separate-expandable", everything) == \
        "the program uses no PyTorch: the same as separate"
    assert work.not_run_reason("rapids", "torch-under-cupy", everything) is None
    assert work.libraries_of("rapids", "torch-under-cupy") == ("rmm", "cupy", "numba", "torch")
    no_rmm = lambda module: module != "rmm"  # noqa: E731
    assert work.not_run_reason("cupy_torch", "rmm-async", no_rmm) == "rmm is not installed here"
    assert work.not_run_reason("cupy_torch", "emmpool", no_rmm) is None
    assert work.setup_environment("emmpool") == {"PYTORCH_CUDA_ALLOC_CONF": None,
                                                 "EMMPOOL_SEGMENTS": "fixed"}
    assert work.setup_environment("emmpool-growable")["EMMPOOL_SEGMENTS"] == "growable"
    assert work.setup_environment("separate-expandable")["PYTORCH_CUDA_ALLOC_CONF"] == \
        "expandable_segments:True"
    assert work.setup_environment("separate") == {"PYTORCH_CUDA_ALLOC_CONF": None,
                                                  "EMMPOOL_SEGMENTS": None}
    assert [work.batch(100, i) for i in range(5)] == [60, 100, 35, 80, 60]
    order = mixed.round_order([("a", "x"), ("a", "y"), ("a", "z"), ("b", "x")], 1)
    assert order == [("a", "y"), ("a", "z"), ("a", "x"), ("b", "x")]


GiB = 1 << 30


def synthetic_round(setup, peak_gib, ms, checks, allocator, r=0, timeline=True):
    """One timing child's result as mixed_programs records it, made up for the tests."""
    peak = int(peak_gib * GiB)
    memory = {"source": "device", "peak": peak, "peak_device": peak, "peak_process": None,
              "context": GiB // 2, "baseline": 0}
    if timeline:
        memory["timeline"] = [[100.0, 0, None], [100.5, peak, None], [101.0, GiB, None]]
    return {"setup": setup, "outcome": "ok", "round": r, "checks": checks,
            "cycle_s": [4 * ms / 1e3] * 3, "marks": {"context": 100.0},
            "allocator": {"counted": allocator, "uncounted": [],
                          "total": sum(allocator.values())},
            "serves": {"cupy": "its own", "torch": "its own"}, "memory": memory}


def synthetic_doc(gpu="synthetic GPU (test data)", budget=8 * GiB, run="run A"):
    """A hand-made mixed_programs document: synthetic test data, not a measurement."""
    checks = [2.5, 2.25, 2.0]
    table = {   # setup: peak GiB, ms per step, allocators, largest scale in B
        "separate": (4.0, 10.0, {"cupy": GiB, "torch": 2 * GiB}, 30),
        "separate-expandable": (3.5, 10.4, {"cupy": GiB, "torch": int(1.5 * GiB)}, 33),
        "rmm-pool": (3.2, 12.0, {"rmm pool": 3 * GiB}, 36),
        "rmm-async": (2.9, 11.0, {"rmm async": int(2.5 * GiB)}, 40),
        "torch-under-cupy": (3.0, 13.0, {"torch+cupy": int(2.6 * GiB)}, 38),
        "emmpool": (2.5, 10.1, {"emmpool": 2 * GiB}, 44),
        "emmpool-growable": (2.95, 10.3, {"emmpool": int(1.9 * GiB)}, 40),
    }
    setups = {}
    for setup, (peak, ms, allocator, largest) in table.items():
        mine = [c * (1.01 if setup == "torch-under-cupy" else 1) for c in checks]
        rounds = [synthetic_round(setup, peak, ms * f, mine, allocator, r, timeline=r == 0)
                  for r, f in enumerate((1.0, 1.2, 0.9))]
        if setup == "emmpool":
            rounds[-1]["pool_work"] = {"page_maps": 2.5, "page_unmaps": 0.0, "fence_waits": 0.25}
        if setup == "emmpool-growable":
            rounds[-1]["pool_work"] = {"page_maps": 0.0}
        setups[setup] = {
            "timing": {"scale": 16, "run": run, "rounds": rounds},
            "capacity": {"largest": largest, "smallest_failing": largest + 1,
                         "resolution": 1 / largest, "budget": budget, "stopped": None,
                         "probes": [[largest, "ok"], [largest + 1, "oom"]], "run": run}}
    rapids = {"separate-expandable": {"not_run": "the program uses no PyTorch: the same as "
                                                 "separate"},
              "emmpool": {"timing": {"scale": 4, "run": run, "rounds": [
                  {"setup": "emmpool", "outcome": "oom", "error": "MemoryError: out of memory"}]}}}
    run_info = {"date": "synthetic", "phases": ["timing", "capacity"], "driver": "0.0",
                "start": "fork", "rounds": 3, "cycles": 3, "warmup_cycles": 1,
                "scales": {"cupy_torch": 16}, "wall_s": 1.0, "versions": {"emmpool": "test"},
                "budget": budget, "memory_sources": ["device"], "notes": []}
    return {"benchmark": "mixed_programs", "gpu": gpu, "runs": {run: run_info},
            "results": {"cupy_torch": setups, "rapids": rapids}, "warmup": []}


def test_mixed_tables_ratios_and_goals_from_a_synthetic_document(mixed, report, tmp_path):
    doc = synthetic_doc()
    table = report.program_table(doc, "cupy_torch")
    rows = table["rows"]
    # the median round is the 1.0 one, the best the 0.9 one; separate is the fastest
    assert rows["separate"]["ms_median"] == pytest.approx(10.0)
    assert rows["separate"]["ms_best"] == pytest.approx(9.0)
    assert rows["emmpool"]["x_fastest"] == pytest.approx(1.01)
    assert rows["emmpool"]["x_separate_peak"] == pytest.approx(2.5 / 4.0)
    assert rows["emmpool"]["x_separate_capacity"] == pytest.approx(44 / 30)
    assert rows["torch-under-cupy"]["check_diff"] == pytest.approx(0.01 / 1.01)
    md = report.markdown(doc, {"cupy_torch": "mixed_programs_cupy_torch.png"})
    assert ("| emmpool | ok | 2.50 (0.62×) | emmpool 2.00 | 10.10 (1.010×) | 9.09 (1.010×) "
            "| 44 ±2% (1.47×) |") in md
    assert ("| separate | ok | 4.00 (1.00×) | cupy 1.00 + torch 2.00 = 3.00 | 10.00 (1.000×) "
            "| 9.00 (1.000×) | 30 ±3% (1.00×) |") in md
    assert "| torch-under-cupy | DIFFERS from separate (rel. 9.9e-03) |" in md
    assert "| separate-expandable | not run: the program uses no PyTorch: the same as " \
           "separate |" in md
    assert "| emmpool | FAILED: oom: MemoryError: out of memory |" in md
    # the goals: against the lower separate peak (3.5), every bridge, the larger separate
    # capacity (33), the fastest median (10.0)
    assert ("- emmpool: peak 0.71× the separate pools' (≤ 0.8) ✓; 0.78× rmm-pool's (≤ 1) ✓; "
            "0.86× rmm-async's (≤ 1) ✓; 0.83× torch-under-cupy's (≤ 1) ✓; largest scale in B "
            "1.33× the separate pools' (≥ 1.25) ✓; time per step 1.010× the fastest setup's, "
            "median round (≤ 1.02) ✓") in md
    growable = next(line for line in md.splitlines() if line.startswith("- emmpool-growable"))
    assert "peak 0.84× the separate pools' (≤ 0.8) ✗" in growable
    assert "1.02× rmm-async's (≤ 1) ✗" in growable
    assert "largest scale in B 1.21× the separate pools' (≥ 1.25) ✗" in growable
    assert "![GPU memory over time, cupy_torch](mixed_programs_cupy_torch.png)" in md
    assert "\n- emmpool: 2.5 page_maps, 0.25 fence_waits\n- emmpool-growable: none\n" in md
    assert "| setup | CuPy | PyTorch | Numba | RMM |" in md
    assert "| emmpool | its own | its own |  |  |" in md
    assert report.failed(doc) == ["cupy_torch torch-under-cupy: check differs",
                                 "rapids emmpool: oom: MemoryError: out of memory"]


def test_mixed_pictures_one_per_program(mixed, report, tmp_path):
    pytest.importorskip("matplotlib", reason="the pictures need matplotlib")
    text = report.write_outputs(synthetic_doc(), tmp_path)
    assert (tmp_path / "mixed_programs_cupy_torch.png").stat().st_size > 1000
    assert not (tmp_path / "mixed_programs_rapids.png").exists()   # no timeline there
    assert json.loads((tmp_path / "mixed_programs.json").read_text())["gpu"] == \
        "synthetic GPU (test data)"
    assert text == (tmp_path / "mixed_programs.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mixed_programs.json", "mixed_programs.md", "mixed_programs_cupy_torch.png"]


def test_mixed_merge_of_runs(mixed, report, tmp_path):
    a, b = synthetic_doc(run="run A"), synthetic_doc(run="run B")
    for entry in a["results"]["cupy_torch"].values():
        del entry["capacity"]                     # A: timing only
    for entry in b["results"]["cupy_torch"].values():
        entry["timing"]["rounds"][0]["checks"] = [9.0, 9.0, 9.0]
        del entry["timing"]                       # B: capacity only
    b["results"]["rapids"] = {}
    merged = report.merge_docs([a, b])
    assert list(merged["runs"]) == ["run A", "run B"]
    sep = merged["results"]["cupy_torch"]["separate"]
    assert sep["timing"]["run"] == "run A" and sep["capacity"]["run"] == "run B"
    assert merged["results"]["rapids"]["separate-expandable"]["not_run"]
    assert "notes" not in merged["runs"]["run B"] or not merged["runs"]["run B"]["notes"]
    # the same pair in both: the later one, said so
    again = report.merge_docs([synthetic_doc(run="run A"), synthetic_doc(run="run C")])
    assert again["results"]["cupy_torch"]["emmpool"]["timing"]["run"] == "run C"
    assert "taken from the later run: cupy_torch separate timing" in \
        again["runs"]["run C"]["notes"][-1]
    with pytest.raises(ValueError, match="different GPUs"):
        report.merge_docs([a, synthetic_doc(gpu="another synthetic GPU")])
    with pytest.raises(ValueError, match="different budgets"):
        report.merge_docs([synthetic_doc(), synthetic_doc(budget=4 * GiB, run="run D")])
    # from the command line, into files
    paths = []
    for i, doc in enumerate((a, b)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(doc))
    out = tmp_path / "merged"
    assert mixed.main(["--merge", *map(str, paths), "--out", str(out)]) == 1  # the rapids failure
    md = (out / "mixed_programs.md").read_text()
    assert "| emmpool | ok | 2.50 (0.62×) |" in md and "44 ±2% (1.47×)" in md


class FakeGpu:
    """NVML's view of a GPU, made up: nothing ever uses it."""

    def __init__(self, index):
        self.index, self.name, self.uuid = index, "fake GPU", f"GPU-fake-{index}"
        self.total, self.driver = 80 * GiB, "0.0"

    def used(self):
        return 0

    def settle(self, idle, timeout=15.0):
        return 0


def fake_mixed_children(mixed, monkeypatch, fits, failing=()):
    """Children that return at once: timing figures by setup, probes that fit up to
    fits[setup], and a sampler whose peak is the scale in GiB / 4 (emmpool: / 8)."""
    calls = []
    last = {}

    class Launcher:
        mode = "fork"
        info = {"import_s": 1.0, "missing": {}}

        def __init__(self, uuid):
            self.uuid = uuid

        def run(self, job, timeout, on_start=None):
            calls.append((self.uuid, job["kind"], job["program"], job["setup"], job["scale"]))
            last["job"] = job
            if on_start:
                on_start(1234)
            base = {"program": job["program"], "setup": job["setup"], "kind": job["kind"],
                    "scale": job["scale"], "context": {"free": 79 * GiB, "total": 80 * GiB},
                    "marks": {"context": 5.0}}
            if job["setup"] in failing:
                return {**base, "outcome": "error", "error": "RuntimeError: broken"}
            if job["kind"] == "probe":
                time.sleep(0.05)   # long enough for every device's thread to take a search
                ok = job["scale"] <= fits[job["setup"]]
                return {**base, "outcome": "ok" if ok else "oom"}
            ms = 10.0 if job["setup"].startswith("emmpool") else 11.0
            return {**base, "outcome": "ok", "checks": [1.0, 2.0],
                    "cycle_s": [4 * ms / 1e3] * job["cycles"],
                    "serves": {"cupy": job["setup"]},
                    "allocator": {"counted": {"x": GiB}, "uncounted": [], "total": GiB}}

        def close(self):
            calls.append((self.uuid, "closed"))

    class Sampler:
        def __init__(self, gpu, period):
            self.pid = None

        def stop(self):
            job = last["job"]
            per = 8 if job["setup"].startswith("emmpool") else 4
            peak = GiB + job["scale"] * GiB // per
            return {"source": "device", "peak": peak, "baseline": 0, "samples": 2,
                    "timeline": [[5.0, 0], [6.0, peak]]}

    monkeypatch.setattr(mixed, "Gpu", FakeGpu)
    monkeypatch.setattr(mixed, "MemorySampler", Sampler)
    monkeypatch.setattr(mixed, "make_launcher", lambda mode, uuid, workdir, notes:
                        Launcher(uuid))
    monkeypatch.setattr(mixed.cpus, "pin_near_gpu", lambda n, device=0: [])
    monkeypatch.setattr(mixed, "importable", lambda module: True)  # as on a GPU host
    monkeypatch.delenv("EMMCI_BENCH_DEADLINE", raising=False)
    return calls


def test_mixed_run_interleaves_rounds_and_searches_from_the_timing_peak(mixed, monkeypatch,
                                                                        tmp_path):
    fits = {"separate": 20, "emmpool": 41}
    calls = fake_mixed_children(mixed, monkeypatch, fits)
    argv = ["--out", str(tmp_path), "--programs", "a", "--setups", "separate,emmpool",
            "--rounds", "2", "--scales", "a=8", "--budget-gib", "4", "--probes", "8"]
    before = signal.getsignal(signal.SIGTERM)
    assert mixed.main(argv) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # a later SIGTERM is not the run's
    runs = [c for c in calls if c[1] != "closed"]
    assert runs[:2] == [("GPU-fake-0", "warmup", "cupy_torch", "separate", 1),
                        ("GPU-fake-0", "warmup", "cupy_torch", "emmpool", 1)]
    timing = [(c[3], c[4]) for c in runs if c[1] == "timing"]
    assert timing == [("separate", 8), ("emmpool", 8), ("emmpool", 8), ("separate", 8)]
    # separate: 8 units took 2 GiB above the 1 GiB context: 4 GiB predicts 16, 95%: 15
    probes = [(c[3], c[4]) for c in runs if c[1] == "probe"]
    assert probes[0] == ("separate", 15)
    assert [s for _, s in probes if _ == "emmpool"][0] == 30
    doc = json.loads((tmp_path / "mixed_programs.json").read_text())
    sep = doc["results"]["cupy_torch"]["separate"]
    assert sep["capacity"]["largest"] == 20 and sep["capacity"]["smallest_failing"] == 21
    assert doc["results"]["cupy_torch"]["emmpool"]["capacity"]["largest"] == 41
    rounds = sep["timing"]["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    assert "timeline" in rounds[0]["memory"] and "timeline" not in rounds[1]["memory"]
    (run,) = doc["runs"].values()
    assert run["rounds"] == 2 and run["budget"] == 4 * GiB and run["start"] == "fork"
    md = (tmp_path / "mixed_programs.md").read_text()
    assert "| emmpool | ok | 2.00 (0.67×) |" in md
    assert "41 ±2% (2.05×)" in md


def test_mixed_capacity_on_several_devices_and_failures(mixed, monkeypatch, tmp_path):
    fits = {"separate": 3, "emmpool": 5, "rmm-pool": 4}
    calls = fake_mixed_children(mixed, monkeypatch, fits, failing=("rmm-async",))
    argv = ["--out", str(tmp_path), "--programs", "a", "--capacity-only", "--no-warmup",
            "--setups", "separate", "emmpool", "rmm-pool", "rmm-async", "--devices", "0,1",
            "--budget-gib", "1"]
    monkeypatch.setattr(mixed.work, "not_run_reason", lambda program, setup, importable: None)
    assert mixed.main(argv) == 0   # only an emmpool failure or a differing check fails the run
    probes = [c for c in calls if c[1] == "probe"]
    assert {c[0] for c in probes} == {"GPU-fake-0", "GPU-fake-1"}
    assert not [c for c in calls if c[1] == "timing"]
    doc = json.loads((tmp_path / "mixed_programs.json").read_text())
    results = doc["results"]["cupy_torch"]
    assert results["rmm-async"]["capacity"]["stopped"].startswith("error at scale")
    assert results["rmm-async"]["capacity"]["largest"] == 0
    assert results["emmpool"]["capacity"]["largest"] == 5
    assert ("GPU-fake-1", "closed") in calls and ("GPU-fake-0", "closed") in calls


# What a program of mixed_workloads.py uses, on the CPU: NumPy for CuPy, PyTorch on the CPU,
# Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1), NumPy arrays for RMM's buffers.
CPU_ENV = """
class CpuEnv(w.GpuEnv):
    def __init__(self, libs):
        import numpy, torch
        from numba import cuda
        self.xp, self.libs, self.torch, self.cuda, self.rmm = numpy, libs, torch, cuda, None
        self.device = "cpu"
    def sync(self):
        pass
    def buffer(self, nbytes):
        return self.xp.empty(nbytes, self.xp.uint8)
    def numba_view(self, buf, dtype):
        return buf.view(dtype)
    def from_numba(self, array):
        return array.copy_to_host()
    def cupy_pool_bytes(self):
        return 0
    def torch_max_reserved(self):
        return 0
def cpu_check(program, scale, steps):
    env = CpuEnv(w.PROGRAMS[program].libraries)
    runner = getattr(w, w.PROGRAMS[program].factory)(env, scale)
    return [runner.step(i) for i in range(steps)]
"""


def test_mixed_programs_compute_the_same_twice_on_the_cpu(tmp_path):
    # The programs' own logic (shapes, the seeded batches, the Numba kernels, the training
    # step) run on NumPy, PyTorch on the CPU and Numba's CUDA simulator, twice: the check values
    # must be finite and repeat exactly (every setup is compared on them).
    pytest.importorskip("torch", reason="the programs' CPU check needs PyTorch (CPU is enough)")
    pytest.importorskip("numba.cuda", reason="the programs' CPU check needs numba-cuda")
    script = (
        "import json, math, sys\n"
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        "import mixed_workloads as w\n"
        + CPU_ENV +
        "out = {}\n"
        "for p, s in [('cupy_torch', 1/64), ('numba_cupy_torch', 1/256), ('rapids', 1/4096)]:\n"
        "    out[p] = [cpu_check(p, s, 4), cpu_check(p, s, 4)]\n"
        "# a timing job's loop, on the CPU: its context and GPU libraries made up\n"
        "w.open_context = lambda: {'free': 1, 'total': 2}\n"
        "w.GpuEnv = CpuEnv\n"
        "job = {'program': 'rapids', 'setup': 'separate', 'kind': 'timing', 'scale': 1/4096,\n"
        "       'warmup_cycles': 1, 'cycles': 2}\n"
        "out['job'] = w.run_job(job)\n"
        "print(json.dumps(out))\n")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    job = out.pop("job")
    assert job["outcome"] == "ok", job
    assert job["checks"][:4] == out["rapids"][0]   # the same batches as cpu_check's
    assert len(job["checks"]) == 12 and len(job["cycle_s"]) == 2 and len(job["step_s"]) == 8
    assert list(job["marks"]) == ["start", "context", "installed", "built", "timed", "done",
                                  "end"]
    assert job["serves"] == {"rmm": "its own", "cupy": "its own", "numba": "its own"}
    assert job["allocator"] == {"counted": {"cupy": 0}, "total": 0, "uncounted": [
        "numba (its own manager: cuMemAlloc per array)",
        "rmm (its default resource: cudaMalloc per buffer)"]}
    for program, (first, second) in out.items():
        assert len(first) == 4 and all(math.isfinite(v) for v in first), program
        assert first == second, program


def test_mixed_zygote_forks_fresh_children_with_their_setup(children, tmp_path):
    # The zygote imports what it can here, forks one child per job into its own process, with
    # the setup's environment; without a GPU the child's CUDA context fails, as an error (not
    # out of memory), and its log says why.
    from tests.conftest import gpu_unavailable_reason

    try:
        launcher = children.ForkLauncher("GPU-test-uuid", tmp_path, ready_timeout=300)
    except children.ForkUnsafe as e:
        if gpu_unavailable_reason() is None:  # a GPU host: an import started CUDA's threads
            pytest.skip(f"the zygote cannot fork here ({e}); the benchmark starts each job in "
                        "a fresh process (tests/test_gpu_mixed_programs.py)")
        raise
    try:
        assert launcher.info["fork_unsafe"] is None and len(launcher.info["threads"]) == 1
        job = {"program": "cupy_torch", "setup": "emmpool-growable", "kind": "probe",
               "scale": 1, "cycles": 1, "warmup_cycles": 0, "budget": 1 << 30}
        started = []
        result = launcher.run(job, 120, started.append)
        assert result["pid"] == started[0] != os.getpid()
        assert result["pid"] != launcher.proc.pid
        assert result["environment"] == {"PYTORCH_CUDA_ALLOC_CONF": None,
                                         "EMMPOOL_SEGMENTS": "growable",
                                         "CUDA_VISIBLE_DEVICES": "GPU-test-uuid"}
        if result["outcome"] != "ok":   # no GPU here
            assert result["outcome"] == "error" and result["log_tail"]
        second = launcher.run({**job, "setup": "separate-expandable"}, 120)
        assert second["pid"] != result["pid"]
        assert second["environment"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert second["environment"]["EMMPOOL_SEGMENTS"] is None
    finally:
        launcher.close()
    assert launcher.proc.returncode == 0


def test_mixed_fresh_children_that_hang_crash_or_say_nothing(children, monkeypatch, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "how = os.environ['HOW']\n"
        "if how == 'hang': time.sleep(60)\n"
        "if how == 'crash': os.kill(os.getpid(), signal.SIGSEGV)\n"
        "sys.exit(3)\n")
    monkeypatch.setattr(children, "__file__", str(script))
    launcher = children.ExecLauncher("GPU-x", tmp_path)
    job = {"program": "rapids", "setup": "separate", "kind": "probe", "scale": 2}
    expected = {"hang": "killed at its time limit", "crash": "killed by signal 11 (SIGSEGV)",
                "quiet": "exited (3) without a result"}
    for how, why in expected.items():
        monkeypatch.setenv("HOW", how)
        t = time.monotonic()
        result = launcher.run(job, 2.0)
        assert time.monotonic() - t < 30
        assert result["outcome"] == "error" and result["error"] == why, result


def test_mixed_memory_samples_and_one_source_per_table(mixed, report):
    # (time, device used, process used or None): bins of 20 ms keep their largest sample
    samples = [(10.000, 100, None), (10.005, 300, 150), (10.012, 200, 180), (10.031, 150, None)]
    m = mixed.summarize_samples(samples, baseline=100)
    assert m["timeline"] == [[10.0, 200, 180], [10.02, 50, None]]
    assert (m["peak_device"], m["peak_process"], m["peak"], m["source"]) == \
        (200, 180, 180, "process")
    assert mixed.summarize_samples([(1.0, 500, None)], 100)["source"] == "device"
    # a table quotes the process figure only where every child had one
    doc = synthetic_doc()
    for entry in doc["results"]["cupy_torch"].values():
        for r in entry["timing"]["rounds"]:
            r["memory"]["peak_process"] = r["memory"]["peak"] - GiB // 4
    table = report.program_table(doc, "cupy_torch")
    assert table["source"] == "process"
    assert table["rows"]["separate"]["peak"] == int(3.75 * GiB)
    doc["results"]["cupy_torch"]["emmpool"]["timing"]["rounds"][1]["memory"]["peak_process"] = None
    table = report.program_table(doc, "cupy_torch")
    assert table["source"] == "device" and table["rows"]["separate"]["peak"] == 4 * GiB
    assert "peak GPU memory: the device's above its value before the child (NVML)" in \
        report.markdown(doc, {})


def test_mixed_run_stopped_early_keeps_what_ran(mixed, monkeypatch, tmp_path):
    calls = fake_mixed_children(mixed, monkeypatch, {"separate": 9, "emmpool": 9})
    real = mixed.run_timed

    def stopped_at_the_third(launcher, gpu, idle, job, args):
        if sum(c[1] == "timing" for c in calls) == 2:
            raise mixed.Stopped("signal SIGTERM")
        return real(launcher, gpu, idle, job, args)

    monkeypatch.setattr(mixed, "run_timed", stopped_at_the_third)
    argv = ["--out", str(tmp_path), "--programs", "a", "--setups", "separate,emmpool",
            "--rounds", "2", "--no-warmup"]
    assert mixed.main(argv) == 1
    doc = json.loads((tmp_path / "mixed_programs.json").read_text())
    (run,) = doc["runs"].values()
    assert run["notes"] == ["the run stopped early: Stopped: signal SIGTERM"]
    assert len(doc["results"]["cupy_torch"]["separate"]["timing"]["rounds"]) == 1
    assert "capacity" not in doc["results"]["cupy_torch"]["separate"]
    assert "  - the run stopped early: Stopped: signal SIGTERM" in \
        (tmp_path / "mixed_programs.md").read_text()


def test_bench_rmm_merges_rounds_and_quotes_its_ratios():
    bench = benchmark_module("bench_rmm")
    rounds = [
        {"buffer:0": dict.fromkeys(bench.RESOURCES, 500.0),
         "buffer:4096": {"emmpool": 2000.0 + k, "callback": 6000.0, "rmm-pool": 4000.0,
                         "rmm-async": 5000.0, "cudaMalloc": 9000.0},
         "threads": {"emmpool": 4e6, "callback": 0.5e6, "rmm-pool": 2e6, "rmm-async": 3e6,
                     "cudaMalloc": 1e5}}
        for k in (0, 100, 200)
    ]
    merged = bench.merge(rounds)
    assert merged["buffer:4096"]["emmpool"] == 2100.0  # the median round
    text = bench.table(merged, 3)
    assert "| DeviceBuffer 4 KiB (µs) | 2.10 | 6.00 | 4.00 | 5.00 | 9.00 | 0.42 | 0.53 |" in text
    assert "| 8 C++ threads (M/s) | 4.00 | 0.50 | 2.00 | 3.00 | 0.10 | 1.33 | 2.00 |" in text
    assert "moves 8.0× the callback resource's" in text


def test_the_training_trace_frees_all_but_its_state_and_steady_steps_repeat():
    trace = benchmark_module("training_trace")
    ops, starts, kept = trace.make(6, seed=3)
    live = {}
    for kind, key, size in ops:
        if kind == "alloc":
            assert key not in live
            live[key] = size
        elif kind == "free":
            del live[key]
    assert sorted(live) == sorted(kept) and len(kept) == 2 * trace.LAYERS
    assert len(starts) == 6 and ops[starts[-1] - 1] == ("sync", 0, 0)

    def sizes(ops, lo, hi):
        return [op[2] for op in ops[lo:hi] if op[0] == "alloc"]

    steady, starts, _ = trace.make(3, seed=3, steady=True)
    shape = [sorted(sizes(steady, a, b)) for a, b in zip(starts, starts[1:] + [len(steady)])]
    assert shape[0] != [] and shape[1] == shape[2]
    changing = [sizes(ops, a, b) for a, b in zip(starts, starts[1:])]
    assert len({tuple(s) for s in changing}) > 1  # shapes change from step to step

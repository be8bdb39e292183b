"""The benchmarks' own bookkeeping, checked without a GPU: bench_numba's interleaved rounds stop
at a deadline with what they finished (a GPU step cut off by its timeout would keep nothing),
and its report says so; the in-process pairing times the managers' blocks in turns and takes
each ratio within a round. Each child (one process per manager, or per emmpool build, and
round) is replaced by a fake that takes a known time."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if not BENCHMARKS.is_dir():  # a wheel's test run takes tests/ alone
    pytest.skip("benchmarks/ is not shipped here", allow_module_level=True)


@pytest.fixture
def bench_numba(monkeypatch):
    pytest.importorskip("numba.cuda", reason="bench_numba imports numba.cuda")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_numba

    return bench_numba


def fake_children(bench_numba, monkeypatch, seconds):
    """Every child sleeps `seconds` and reports 10 us per op (the floor) or 11 (the others)."""
    ran = []

    def run_child(name, extra_env, args, guests=None):
        ran.append(name)
        time.sleep(seconds)
        us = 10.0 if name == bench_numba.FLOOR else 11.0
        return {"manager": name, "gpu": "fake GPU", "versions": {}, "checks": {},
                "cases": {c: {"us_per_op": us} for c in bench_numba.CASES},
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


def test_pool_counters_are_per_timed_op_and_noted(bench_numba, monkeypatch, tmp_path):
    # _measure: the counters' change over the timed blocks only (not warm-up or calibration),
    # divided by the timed ops.
    done = {"ops": 0}

    def run(n):
        done["ops"] += n

    def counters():  # one fence per five ops
        return {"batches_closed": done["ops"] // 5}

    knobs = dict(bench_numba.QUICK, warmup_s=0.0, budget=0.01)
    c = bench_numba._measure(run, lambda: None, knobs, counters)
    timed = c["ops_per_block"] * c["blocks"]
    assert done["ops"] > 1.2 * timed  # warm-up and calibration ran ops too: not counted
    assert c["pool_per_op"]["batches_closed"] == pytest.approx(0.2, abs=1.0 / timed)
    assert "pool_per_op" not in bench_numba._measure(run, lambda: None, knobs)

    # The markdown notes them for the managers that report them.
    def run_child(name, extra_env, args, guests=None):
        cases = {k: {"us_per_op": 10.0} for k in bench_numba.CASES}
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


def test_paired_blocks_take_turns_and_ratios_are_block_by_block(bench_numba, monkeypatch):
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

    knobs = dict(bench_numba.QUICK, warmup_s=0.0, repeats=4)
    ticks = iter(range(10**6))

    def fake_clock():
        # the host halves its speed after a while (every call to the clock is a tick)
        if next(ticks) == 60:
            clock["slow"] = 2.0
        return clock["t"]

    runs = {n: make_run(n) for n in cost}
    monkeypatch.setattr(bench_numba.time, "perf_counter", fake_clock)
    out = bench_numba._measure_paired(runs, switch, lambda: None, knobs)
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
        for case in bench_numba.CASES:
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


def test_a_case_that_raises_is_recorded_as_its_error(bench_numba, capsys):
    # One case's failure must not stop the child's other cases: the error is its cell.
    def fails():
        raise RuntimeError("out of memory")

    failed = bench_numba._timed_case("emmpool churn", fails)
    assert failed == {"error": "RuntimeError: out of memory"}
    ok = {"us_per_op": 1.5, "blocks": 7, "ops_per_block": 100}
    assert bench_numba._timed_case("emmpool churn", lambda: ok) is ok
    err = capsys.readouterr().err
    assert "[bench]   emmpool churn: RuntimeError: out of memory" in err
    assert "[bench]   emmpool churn: 1.50 us/op (7 x 100 ops)" in err


# dask_spill.py: its setups, sizes and closed form, the table and goals from fake children, and
# a child killed with its own children at its time limit.


@pytest.fixture
def dask_spill(monkeypatch):
    pytest.importorskip("distributed", reason="dask_spill imports distributed")
    pytest.importorskip("numba.cuda", reason="dask_spill imports numba.cuda")
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
        def __init__(self, handles):
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

    gpu = {"handle": None, "name": "fake GPU", "uuid": "GPU-0", "total": 80 << 30}
    monkeypatch.setattr(dask_spill, "_gpus", lambda devices: ([0, 1], {0: gpu, 1: gpu}))
    monkeypatch.setattr(dask_spill, "_used", lambda nvml: {0: 0, 1: 0})
    monkeypatch.setattr(dask_spill, "JobPeakSampler", Sampler)
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
    import types

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
    sampler = object.__new__(dask_spill.JobPeakSampler)  # no NVML: samples set by hand
    sampler.baseline = [100, 200]
    sampler.samples = [(1.0, [900, 200]), (2.0, [300, 700]), (3.0, [150, 250])]
    assert sampler.peak_within(1.5, 3.0) == [200, 500]
    assert sampler.peak_within(5.0, 6.0) is None

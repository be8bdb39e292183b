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
    monkeypatch.delenv("EMMPOOL_BENCH_DEADLINE", raising=False)
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
    monkeypatch.setenv("EMMPOOL_BENCH_DEADLINE", str(time.time() - 1))  # already passed
    ran = fake_children(bench_numba, monkeypatch, 0.0)
    report = run_parent(bench_numba, tmp_path, "--rounds", "3")
    assert ran == ["nothing", "emmpool"] and report["rounds"] == 1


def test_without_a_limit_every_round_runs(bench_numba, monkeypatch, tmp_path):
    monkeypatch.delenv("EMMPOOL_BENCH_DEADLINE", raising=False)
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

    monkeypatch.delenv("EMMPOOL_BENCH_DEADLINE", raising=False)
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
    monkeypatch.delenv("EMMPOOL_BENCH_DEADLINE", raising=False)
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

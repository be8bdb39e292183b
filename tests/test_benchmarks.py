"""The benchmarks' own bookkeeping, checked without a GPU: bench_numba's interleaved rounds stop
at a deadline with what they finished (a GPU step cut off by its timeout would keep nothing),
and its report says so. Each child (one process per manager and round) is replaced by a fake
that takes a known time."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench_numba(monkeypatch):
    pytest.importorskip("numba.cuda", reason="bench_numba imports numba.cuda")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_numba

    return bench_numba


def fake_children(bench_numba, monkeypatch, seconds):
    """Every child sleeps `seconds` and reports 10 us per op (the floor) or 11 (the others)."""
    ran = []

    def run_child(name, extra_env, args):
        ran.append(name)
        time.sleep(seconds)
        us = 10.0 if name == bench_numba.FLOOR else 11.0
        return {"manager": name, "gpu": "fake GPU", "versions": {}, "checks": {},
                "cases": {c: {"us_per_op": us} for c in bench_numba.CASES},
                "wall_s": seconds}

    monkeypatch.setattr(bench_numba, "_run_child", run_child)
    return ran


def run_parent(bench_numba, tmp_path, *args):
    argv = ["--out", str(tmp_path), "--cpus", "0", "--managers", "nothing", "emmpool", *args]
    assert bench_numba.main(argv) == 0
    return json.loads((tmp_path / "bench_numba.json").read_text())


def test_rounds_stop_at_the_time_limit_and_keep_what_ran(bench_numba, monkeypatch, tmp_path):
    monkeypatch.delenv("EMMPOOL_BENCH_DEADLINE", raising=False)
    ran = fake_children(bench_numba, monkeypatch, 0.2)
    # A round takes 0.4 s: two fit in 1.0 s, a third would end at 1.2 s.
    report = run_parent(bench_numba, tmp_path, "--rounds", "5", "--time-limit", "1.0")
    assert ran == ["nothing", "emmpool"] * 2
    assert report["rounds"] == 2 and report["rounds_asked"] == 5
    cell = report["managers"]["emmpool"]["cases"]["churn"]
    assert cell["rounds_us"] == [11.0, 11.0] and cell["us_per_op"] == 11.0
    md = (tmp_path / "bench_numba.md").read_text()
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
    assert "stopped after" not in (tmp_path / "bench_numba.md").read_text()


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
    def run_child(name, extra_env, args):
        cases = {k: {"us_per_op": 10.0} for k in bench_numba.CASES}
        if name == "emmpool":
            cases["churn"]["pool_per_op"] = {"batches_closed": 0.25, "fence_queries": 0.0}
            cases["alloc_axpy"]["pool_per_op"] = {"batches_closed": 0.0}
        return {"manager": name, "gpu": "fake GPU", "versions": {}, "checks": {},
                "cases": cases, "wall_s": 0.0}

    monkeypatch.delenv("EMMPOOL_BENCH_DEADLINE", raising=False)
    monkeypatch.setattr(bench_numba, "_run_child", run_child)
    run_parent(bench_numba, tmp_path, "--rounds", "1")
    md = (tmp_path / "bench_numba.md").read_text()
    assert "`emmpool` pool work per op" in md
    assert "churn: 0.25 batches_closed;" in md and "alloc_axpy: none" in md

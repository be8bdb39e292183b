"""Allocation trace, replay and the command-line tool, on the host driver (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import emmpool
from emmpool import _config, _core, replay, trace


def traced_workload():
    host = _core.HostDriver(devices=1, capacity=1 << 40)
    host.set_auto_complete(True)
    pool = _core.DevicePool(host, 0)
    pool.set_tracing(True)
    live = []
    for i in range(300):
        live.append(pool.allocate(1000 + 4096 * (i % 37), _core.LEGACY_STREAM,
                                  i % len(trace.LIBRARIES)))
        if i % 3 == 2:
            pool.deallocate(live.pop(0))
    for p in live:
        pool.deallocate(p)
    pool.set_tracing(False)
    pool.allocate(12345)  # not traced
    return pool


def test_trace_records_every_call_in_order():
    pool = traced_workload()
    records = trace.collect([pool])
    assert len(records) == 600
    assert [r.op for r in records].count("alloc") == 300
    assert all(a.time_ns <= b.time_ns for a, b in zip(records, records[1:]))
    assert {r.library for r in records} == set(trace.LIBRARIES)
    first = records[0]
    assert first.op == "alloc" and first.size == 1000 and first.device == 0
    assert trace.collect([pool]) == []  # taken


def test_trace_csv_round_trip_and_replay(tmp_path):
    records = trace.collect([traced_workload()])
    path = tmp_path / "t.csv"
    assert trace.write_csv(path, records) == 600
    again = trace.read_csv(path)
    assert again == records
    ops = replay.from_records(again)
    assert len(ops) == 600
    r = replay.run(ops, "emmpool-host")
    peak = 0
    live = 0
    sizes = {}
    for op, key, size in ops:  # the peak of live bytes, computed independently
        if op == "alloc":
            sizes[key] = size
            live += size
            peak = max(peak, live)
        else:
            live -= sizes.pop(key)
    assert r["peak_live"] == peak
    assert r["peak_reserved"] >= peak and r["ratio"] >= 1.0


def test_read_csv_names_bad_input(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an emmpool trace"):
        trace.read_csv(bad)
    bad.write_text(",".join(trace.FIELDS) + "\n1,0,alloc,5,10,1,numba\n2,0,steal,5,0,1,numba\n")
    with pytest.raises(ValueError, match=r"bad.csv:3"):
        trace.read_csv(bad)


def test_replay_rejects_unknown_backend_and_empty_trace():
    with pytest.raises(ValueError, match="backend"):
        replay.run([("alloc", 0, 1)], "nvidia-magic")
    with pytest.raises(ValueError, match="no allocation"):
        replay.run([], "emmpool-host")


def test_from_slots_builds_a_churn():
    ops = replay.from_slots([10, 20], [1, 0], [30, 40])
    assert ops == [("alloc", 0, 10), ("alloc", 1, 20), ("free", 1, 0), ("alloc", 2, 30),
                   ("free", 0, 0), ("alloc", 3, 40)]


def test_trace_environment_variable_names_an_unwritable_path(monkeypatch):
    monkeypatch.setenv("EMMPOOL_TRACE", "/nonexistent-dir/trace.csv")
    monkeypatch.setattr(_config, "_applied", None)
    with pytest.raises(ValueError, match="EMMPOOL_TRACE"):
        emmpool.configure()


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "emmpool", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_cli_replay(tmp_path):
    path = tmp_path / "t.csv"
    trace.write_csv(path, trace.collect([traced_workload()]))
    p = run_cli("replay", str(path), "--backends", "emmpool-host")
    assert p.returncode == 0, p.stderr
    assert "600 operations" in p.stdout and "| emmpool-host |" in p.stdout


def test_cli_info_and_gpu_commands_without_gpu():
    from tests.conftest import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is present: tests/test_gpu_cli.py covers the commands there")
    p = run_cli("info")
    assert "emmpool" in p.stdout and "driver: unavailable" in p.stdout and p.returncode == 1
    assert "mode='pool'" in p.stdout and "numba-cuda-mlir" in p.stdout
    for command in ("selftest", "bench"):
        p = run_cli(command)
        assert p.returncode == 1 and "libcuda" in (p.stdout + p.stderr)


def test_cli_usage_error():
    p = run_cli("frobnicate")
    assert p.returncode == 2 and "invalid choice" in p.stderr

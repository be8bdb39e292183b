"""Allocation trace, replay and the command-line tool, on the host driver (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from emmpool import _core, replay, trace
from tests.conftest import needs


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
    for op, key, size, *_ in ops:  # the peak of live bytes, computed independently
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


def test_the_anchors_skip_saying_why_where_they_cannot_run():
    from tests.conftest import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is here: the anchors run (benchmarks/replay.py on the GPU runner)")
    ops = [("alloc", 0, 1 << 20), ("free", 0, 0)]
    for backend in ("driver-pool", "torch-expandable"):
        with pytest.raises(replay.Skip) as e:
            replay.run(ops, backend)
        assert str(e.value), backend  # a reason, said


def test_the_replay_table_names_emmpools_default_segments(benchmark_replay):
    assert benchmark_replay.default_backends() == {"emmpool-growable", "emmpool-host-growable"}


@pytest.fixture
def benchmark_replay():
    from tests.conftest import benchmark_module

    return benchmark_module("replay")


def test_from_slots_builds_a_churn():
    ops = replay.from_slots([10, 20], [1, 0], [30, 40])
    assert ops == [("alloc", 0, 10), ("alloc", 1, 20), ("free", 1, 0), ("alloc", 2, 30),
                   ("free", 0, 0), ("alloc", 3, 40)]


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "emmpool", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_cli_replay(tmp_path):
    path = tmp_path / "t.csv"
    trace.write_csv(path, trace.collect([traced_workload()]))
    p = run_cli("replay", str(path), "--backends", "emmpool-host")
    assert p.returncode == 0, p.stderr
    assert "600 operations" in p.stdout and "| emmpool-host |" in p.stdout


def _environment(**variables):
    """This process's environment without emmpool's or Numba's manager settings, plus these."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("EMMPOOL_") and k != "NUMBA_CUDA_MEMORY_MANAGER"}
    return {**env, **variables}


def test_cli_info_says_what_is_in_force_and_where_it_came_from():
    from tests.conftest import gpu_unavailable_reason

    p = run_cli("info", env=_environment(EMMPOOL_MODE="passthrough",
                                         EMMPOOL_INITIAL_POOL_SIZE="1GiB",
                                         NUMBA_CUDA_MEMORY_MANAGER="emmpool.plugin"))
    lines = {line.split()[0]: line for line in p.stdout.splitlines() if line.startswith("  ")}
    assert " passthrough " in lines["mode"], p.stdout
    assert lines["mode"].endswith("from EMMPOOL_MODE='passthrough'")
    assert " 1 GiB (1073741824 bytes) " in lines["initial_pool_size"]
    assert lines["initial_pool_size"].endswith("from EMMPOOL_INITIAL_POOL_SIZE='1GiB'")
    assert " no cap but the device's memory " in lines["maximum_pool_size"]
    assert lines["maximum_pool_size"].endswith("from default")
    assert " a quarter of physical memory, " in lines["pinned_limit"]
    assert lines["numba-cuda"].split()[1][0].isdigit()  # a version
    assert "Numba: emmpool (NUMBA_CUDA_MEMORY_MANAGER=emmpool.plugin)" in p.stdout
    if gpu_unavailable_reason() is None:
        assert "driver: CUDA, " in p.stdout and p.returncode == 0, p.stdout + p.stderr
    else:
        assert "driver: unavailable: No NVIDIA driver" in p.stdout or \
            "driver: unavailable: The NVIDIA driver" in p.stdout, p.stdout
        # A machine without a GPU is a line of the report, not a failure: the settings are good.
        assert p.returncode == 0, p.stdout + p.stderr
    assert max(len(line) for line in p.stdout.splitlines()) <= 100, p.stdout


def test_cli_info_reports_a_bad_environment_and_goes_on():
    p = run_cli("info", env=_environment(EMMPOOL_MODE="bogus"))
    assert "  error: EMMPOOL_MODE='bogus': expected 'pool' or 'passthrough'" in p.stdout
    assert "numba-cuda" in p.stdout and "driver: " in p.stdout and p.returncode == 1, p.stderr


def test_info_names_what_this_process_installed():
    code = "import emmpool, emmpool._info; emmpool.use_for_numba(); emmpool._info.print_report()"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=_environment())
    assert "Numba: emmpool (installed in this process)" in p.stdout, p.stdout + p.stderr


def test_cli_gpu_commands_without_gpu():
    from tests.conftest import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip(needs("a machine without a GPU", "tests/test_gpu_cli.py covers the commands on one"))
    for command in ("selftest", "bench"):
        p = run_cli(command)
        assert p.returncode == 1 and "libcuda" in (p.stdout + p.stderr)


def test_cli_usage_error():
    p = run_cli("frobnicate")
    assert p.returncode == 2 and "invalid choice" in p.stderr


def test_marks_of_synchronization_are_collected_in_time_order(monkeypatch):
    host = _core.HostDriver(devices=1, capacity=1 << 40)
    pool = _core.DevicePool(host, 0)
    monkeypatch.setattr(_core, "pools", lambda: [pool])  # collect()'s process-wide pools
    pool.set_tracing(True)
    a = pool.allocate(1000)
    trace.mark_synchronize()  # steady clock on both sides: the mark sits between the two
    pool.deallocate(a)
    pool.set_tracing(False)
    records = trace.collect()
    assert [r.op for r in records] == ["alloc", "sync", "free"]
    assert trace.collect() == []  # marks are taken with the records


MiB = 1 << 20
BIG = 64 * MiB
SMALL = 2 * MiB  # one small segment


@pytest.mark.parametrize(
    "ops, idle, behind",
    [
        # Numba's kind (no stream named): a GPU behind keeps the freed block until a sync...
        ([("alloc", 0, BIG), ("free", 0, 0), ("alloc", 1, BIG)], BIG, 2 * BIG),
        # ... that follows its fence (recorded at the next allocation that misses: the 1 KiB)
        ([("alloc", 0, BIG), ("free", 0, 0), ("sync", 0, 0), ("alloc", 1, BIG)], BIG, 2 * BIG),
        ([("alloc", 0, BIG), ("free", 0, 0), ("alloc", 1, 1024), ("sync", 0, 0),
          ("alloc", 2, BIG)], BIG + SMALL, BIG + SMALL),
        # a named stream takes back its own block at once, behind or not
        ([("alloc", 0, BIG, 0), ("free", 0, 0), ("alloc", 1, BIG, 0)], BIG, BIG),
        # another named stream must wait for the fence
        ([("alloc", 0, BIG, 0), ("free", 0, 0), ("alloc", 1, BIG, 77)], BIG, 2 * BIG),
    ],
)
def test_replay_models_an_idle_gpu_and_one_a_step_behind(ops, idle, behind, clean_config,
                                                         monkeypatch):
    """Behind: an event completes at the first sync after it was recorded. Fixed segments
    grow past what waits; the growable segment, at a new peak that its own stream's waiting
    frees could cover, waits for them instead: the same peak either way (64 MiB in 20 MiB
    pages). Another stream's frees it does not wait for: it grows as fixed segments do."""
    monkeypatch.setenv("EMMPOOL_SEGMENTS", "fixed")
    assert replay.run(ops, "emmpool-host")["peak_reserved"] == idle
    assert replay.run(ops, "emmpool-host-behind")["peak_reserved"] == behind
    monkeypatch.setenv("EMMPOOL_SEGMENTS", "growable")
    growable = replay.run(ops, "emmpool-host")["peak_reserved"]
    assert growable == 80 * MiB + (idle - BIG)
    other_stream = ops[-1][3:4] == (77,)
    expected = 140 * MiB if other_stream else growable  # the second from 64 MiB: 60 MiB more
    assert replay.run(ops, "emmpool-host-behind")["peak_reserved"] == expected


def test_from_records_keeps_named_streams_and_marks():
    rec = trace.TraceRecord
    records = [rec(1, 0, "alloc", 10, 5, _core.LEGACY_STREAM, "numba"),
               rec(2, 0, "alloc", 20, 6, 0, "torch"),
               rec(3, 0, "sync", 0, 0, 0, ""),
               rec(4, 0, "free", 20, 6, 0, "torch")]
    numba, torch = trace.LIBRARIES.index("numba"), trace.LIBRARIES.index("torch")
    assert replay.from_records(records) == [("alloc", 0, 5, None, numba), ("alloc", 1, 6, 0, torch),
                                            ("sync", 0, 0), ("free", 1, 0)]


def test_replay_serves_every_library_alike():
    """A recorded Numba block above 1 MiB goes to the growable segment as any library's does
    (its pages are shared for IPC), a small one to a fixed segment."""
    numba = trace.LIBRARIES.index("numba")
    for size in (3 * MiB, MiB // 2):
        tagged = replay.run([("alloc", 0, size, None, numba)], "emmpool-host-growable")
        plain = replay.run([("alloc", 0, size)], "emmpool-host-growable")
        assert tagged["page_maps"] == plain["page_maps"]
        assert (tagged["page_maps"] > 0) == (size > MiB)

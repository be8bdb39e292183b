"""Growable segments (EMMPOOL_SEGMENTS=growable) over the host driver's model of CUDA's virtual
memory management: no GPU needed. The C++ tests (cpp/tests/test_growable_segment.cpp) cover the
page logic in depth; these cover the Python surface, the fallback, IPC and the replay figure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from emmpool import _config, _core, replay
from tests.conftest import benchmark_module, require

MiB = 1 << 20
NUMBA_TAG, CUPY_TAG = 1, 2


def growable_pool(vmm=True, **options):
    drv = _core.HostDriver(devices=1, capacity=1 << 36)
    drv.set_vmm_supported(vmm)
    options.setdefault("growable_room", 0)  # exactly the pages each block needs: counted below
    options.setdefault("growable_page_size", 0)  # the driver's 2 MiB pages: counted below
    return drv, _core.DevicePool(drv, 0, segments="growable", **options)


def test_pages_are_mapped_on_demand_and_unmapped_by_trim():
    drv, pool = growable_pool()
    assert pool.growable and pool.options["segments"] == "growable"
    a = pool.allocate(3 * MiB)
    b = pool.allocate(3 * MiB)
    assert b == a + 3 * MiB
    st = pool.stats()
    assert st["bytes_reserved"] == 6 * MiB == drv.stats()["bytes_mapped"]  # 3 pages of 2 MiB
    assert st["page_maps"] == 3
    assert drv.accessible(0, a, 6 * MiB)
    pool.deallocate(a)
    pool.trim()  # a's whole page goes; the page a and b share stays
    assert pool.stats()["bytes_reserved"] == 4 * MiB
    assert drv.accessible(0, b, 3 * MiB) and not drv.accessible(0, a, 2 * MiB)
    pool.deallocate(b)
    pool.trim()
    assert pool.stats()["bytes_reserved"] == 0 and drv.stats()["live_mappings"] == 0


def test_falls_back_to_fixed_segments_without_vmm():
    drv, pool = growable_pool(vmm=False)
    assert not pool.growable
    pool.allocate(3 * MiB)
    assert pool.stats()["bytes_reserved"] == 20 * MiB  # a fixed large segment
    assert drv.stats()["live_reservations"] == 0


def test_growable_blocks_of_every_library_refuse_legacy_ipc_clearly():
    _, pool = growable_pool()
    for tag in (NUMBA_TAG, CUPY_TAG):
        b = pool.allocate(3 * MiB, tag=tag)
        with pytest.raises(_core.PoolError, match="growable segment.*EMMPOOL_SEGMENTS=fixed"):
            pool.ipc_handle(b)
        assert pool.share_pages(b) is not None
    small = pool.allocate(MiB // 2, tag=NUMBA_TAG)  # small segments are fixed: legacy handles
    handle, base, size, offset = pool.ipc_handle(small)
    assert size == 2 * MiB and offset == small - base


def test_out_of_memory_leaves_nothing_mapped_half_way():
    drv, pool = growable_pool(maximum_size=16 * MiB)
    a = pool.allocate(10 * MiB)
    with pytest.raises(MemoryError):
        pool.allocate(8 * MiB)
    assert pool.stats()["bytes_reserved"] == drv.stats()["bytes_mapped"] == 10 * MiB
    pool.deallocate(a)
    pool.allocate(16 * MiB)  # the ladder gives a's pages back first


def _benchmark_trace():
    require("numpy")
    return replay.from_slots(*benchmark_module("replay").make_trace())


def test_replay_figure_of_growable_segments(clean_config, monkeypatch):
    """The fixed replay trace (40k operations, 256 live, 256 B - 64 MiB): growable segments
    keep peak reserved / peak live at most 1.10 with 2 MiB pages, less than fixed segments
    (1.22) with the default 20 MiB ones, coarser."""
    ops = _benchmark_trace()
    fixed = replay.run(ops, "emmpool-host-fixed")
    default = replay.run(ops, "emmpool-host-growable")
    monkeypatch.setenv("EMMPOOL_GROWABLE_PAGE_SIZE", "2MiB")
    small = replay.run(ops, "emmpool-host-growable")
    assert small["ratio"] <= 1.10, small
    assert small["ratio"] < default["ratio"] < fixed["ratio"], (small, default, fixed)


@pytest.mark.parametrize("program", ["cupy_torch", "numba_cupy_torch", "rapids"])
def test_the_mixed_programs_recorded_allocations_replay_close_to_their_live_bytes(
        clean_config, program):
    """benchmarks/traces: what the mixed programs allocated on a GPU (mixed_programs.py
    --traces). Replayed on an idle GPU's model, the default growable segment reserves at most
    1.08 times the live bytes and less than fixed segments do, mapping at most 2 pages per step
    after the warm-up (benchmarks/results/*/replay.md has the figures; placement by best fit
    alone maps more); the GPU a step behind (events complete at the recorded synchronizations
    only) costs more memory, never less."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / f"{program}.csv"
    if not path.exists():
        pytest.skip("needs the repository's benchmarks/traces")
    require("numpy")  # benchmarks/replay.py's
    from emmpool import trace

    ops = replay.from_records(trace.read_csv(path))
    default = replay.run(ops, "emmpool-host-growable")
    fixed = replay.run(ops, "emmpool-host-fixed")
    behind = replay.run(ops, "emmpool-host-behind")
    assert default["ratio"] <= 1.08, default
    assert default["ratio"] < fixed["ratio"], (default, fixed)
    results = {"emmpool-host-growable": {"status": "ok", **default}}
    benchmark_module("replay").maps_per_step(results, 4)  # the recordings' warm-up: 4 steps
    assert results["emmpool-host-growable"]["page_maps_per_step"] <= 2.0, results
    assert behind["ratio"] >= default["ratio"], (behind, default)


def test_config_reads_emmpool_segments(clean_config, monkeypatch):
    assert _config.config().segments == "growable"  # the default
    monkeypatch.setenv("EMMPOOL_SEGMENTS", "fixed")
    assert _config.config().segments == "fixed"
    line = {s.option: s for s in _config.report()}["segments"]
    assert line.value.startswith("fixed") and line.source == "EMMPOOL_SEGMENTS='fixed'"
    monkeypatch.setenv("EMMPOOL_SEGMENTS", "elastic")
    with pytest.raises(ValueError, match="EMMPOOL_SEGMENTS"):
        _config.check_environment()
    assert _config.resolve({"segments": "fixed"}, _config.Config()).segments == "fixed"
    monkeypatch.setenv("EMMPOOL_SEGMENTS", "growable")
    monkeypatch.setenv("EMMPOOL_GROWABLE_FREE_LIMIT", "16MiB")
    assert _config.config().growable_free_limit == 16 << 20
    monkeypatch.setenv("EMMPOOL_GROWABLE_FREE_LIMIT", "lots")
    with pytest.raises(ValueError, match="EMMPOOL_GROWABLE_FREE_LIMIT"):
        _config.check_environment()


def test_emmpool_host_replay_follows_the_variable(clean_config, monkeypatch):
    ops = [("alloc", 0, 3 * MiB), ("alloc", 1, 3 * MiB), ("free", 0, 0)]
    assert replay.run(ops, "emmpool-host")["segments"] == "growable"  # the default
    monkeypatch.setenv("EMMPOOL_SEGMENTS", "fixed")
    assert replay.run(ops, "emmpool-host")["segments"] == "fixed"


def test_cli_info_reports_segments():
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMMPOOL_")}
    env["EMMPOOL_SEGMENTS"] = "growable"
    p = subprocess.run([sys.executable, "-m", "emmpool", "info"], capture_output=True, text=True,
                       timeout=120, env=env)
    lines = {line.split()[0]: line for line in p.stdout.splitlines() if line.startswith("  ")}
    assert " growable " in lines["segments"], p.stdout
    assert lines["segments"].endswith("from EMMPOOL_SEGMENTS='growable'")


def test_pages_move_rather_than_come_and_go_on_a_torch_like_loop():
    """benchmarks/growable_steps.py: a PyTorch-like loop whose shapes change every step. Free
    pages beyond the limit move under the requests that lack pages (no page made, none
    released); kept, they are not unmapped at all. The default lies between."""
    bench = benchmark_module("growable_steps")
    moved = bench.run("growable", 0, steps=60, seed=1)
    default = bench.run("growable", None, steps=60, seed=1)
    kept = bench.run("growable", 1 << 40, steps=60, seed=1)
    assert moved["page_creates_per_step"] * 4 <= moved["page_maps_per_step"], moved
    assert kept["page_unmaps_per_step"] == 0, kept
    assert kept["page_maps_per_step"] < default["page_maps_per_step"] \
        <= moved["page_maps_per_step"], (kept, default, moved)
    assert moved["peak_reserved_mib"] < kept["peak_reserved_mib"], (moved, kept)
    limit = _core.DevicePool(_core.HostDriver(devices=1), 0).options["growable_free_limit"]
    assert limit == 64 << 20

def test_larger_pages_make_fewer_driver_maps_on_the_same_loop():
    """growable_page_size: the same loop with 8 MiB pages maps a fraction of the pages that 2
    MiB ones take (each one driver call), the configuration carries it, and it rounds up to the
    driver's granularity."""
    bench = benchmark_module("growable_steps")
    small = bench.run("growable", None, steps=60, seed=1)
    large = bench.run("growable", None, steps=60, seed=1, page_size=8 << 20)
    assert large["page_mib"] == 8 and small["page_mib"] == 2
    assert large["page_maps_per_step"] * 2 < small["page_maps_per_step"], (large, small)
    pool = _core.DevicePool(_core.HostDriver(devices=1), 0, segments="growable",
                            growable_page_size=3 << 20, growable_room=0)
    pool.allocate(3 << 19)  # 1.5 MiB: a growable block (a small one would take a fixed segment)
    assert pool.stats()["bytes_reserved"] == 4 << 20  # 3 MiB rounds up to two 2 MiB granules
    assert pool.options["growable_page_size"] == 3 << 20
    with pytest.raises(ValueError, match="growable_page_size must be at most 1 GiB"):
        _core.DevicePool(_core.HostDriver(devices=1), 0, segments="growable",
                         growable_page_size=(1 << 30) + 1)


def test_the_page_size_comes_from_the_environment(monkeypatch):
    monkeypatch.setattr(_config, "_applied", None)
    monkeypatch.setenv("EMMPOOL_GROWABLE_PAGE_SIZE", "8MiB")  # not the default (20 MiB)
    assert _config.config().growable_page_size == 8 << 20
    for bad in ("big", "2GiB"):
        monkeypatch.setenv("EMMPOOL_GROWABLE_PAGE_SIZE", bad)
        with pytest.raises(ValueError, match="EMMPOOL_GROWABLE_PAGE_SIZE"):
            _config.config()

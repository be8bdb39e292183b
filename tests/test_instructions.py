"""benchmarks/instructions.py without valgrind: how it reads a callgrind dump (calls and
inclusive instructions of the core's allocate and deallocate, from every call site, names given
once and then by number), takes each row's median over runs, and pairs a baseline's rows by
label, renamed where a configuration's name changed."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import benchmark_module

DUMP = """\
# callgrind format
events: Ir
fn=(1) main
0 5
cfn=(2) emmpool::device_pool::allocate(unsigned long, unsigned long, emmpool::alloc_tag)
calls=3 0
0 300
cfn=(3) emmpool::device_pool::deallocate(unsigned long, unsigned long, emmpool::block_owner)
calls=4 0
0 200
cfn=(4) emmpool::device_pool::stats() const
calls=1 0
0 999

fn=(5) other_caller()
cfn=(2)
calls=1 0
0 140
"""


@pytest.fixture
def tool():
    return benchmark_module("instructions")


def test_a_dump_gives_each_calls_count_and_inclusive_instructions(tool):
    assert tool.per_call(DUMP) == {"allocate": (4, 440), "deallocate": (4, 200)}


def test_rows_are_medians_over_runs_with_their_range(tool):
    run = [{"row": "pool", "size": "256 B", "allocate": a, "deallocate": 100, "pair": a + 100,
            "pairs": 10} for a in (300, 500, 310)]
    rows = tool.medians([[r] for r in run])
    assert rows == [{"row": "pool", "size": "256 B", "allocate": 310, "deallocate": 100,
                     "pair": 410, "pairs": 10, "range": [400, 600]}]


def test_a_baseline_pairs_by_label_after_its_renames(tool):
    renames = [("pool (host)", "pool (host, fixed)"), ("pool (host, growable)", "pool (host)")]
    assert tool.renamed("pool (host), stream-ordered", renames) == \
        "pool (host, fixed), stream-ordered"
    assert tool.renamed("pool (host, growable)", renames) == "pool (host)"
    assert tool.renamed("passthrough", renames) == "passthrough"

    def row(label, pair):
        return {"row": label, "size": "4 MiB", "allocate": pair - 50, "deallocate": 50,
                "pair": pair, "range": [pair, pair]}

    text = tool.table([row("pool (host)", 450), row("new row", 10)],
                      [row("pool (host)", 500), row("gone", 7)])
    assert "| pool (host) | 4 MiB | 400.0 | 50.0 | 450.0 | 450–450 | 500.0 | 0.900 |" in text
    assert "| new row | 4 MiB | -40.0 | 50.0 | 10.0 | 10–10 | — | — |" in text
    assert "gone" not in text


def test_timed_rounds_pair_each_round_with_the_baselines_own(tool, tmp_path):
    # A stand-in bench_core: each run writes its row's ns from a file of counts it consumes, so
    # the host "drifts" between rounds as a shared GPU host does.
    script = tmp_path / "bench"
    script.write_text(f"""#!{sys.executable}
import json, sys
from pathlib import Path
q = Path({str(tmp_path / "queue")!r}); ns = q.read_text().split(); q.write_text(" ".join(ns[1:]))
rows = [{{"allocator": "emmpool pool", "size": 65536, "min_ns": float(ns[0]), "median_ns": 0}},
        {{"allocator": "fence", "size": 0, "min_ns": 100.0}}]
Path(sys.argv[sys.argv.index("--out") + 1]).write_text(json.dumps({{"results": rows}}))
""")
    script.chmod(0o755)
    # runs in order: this build, baseline; then baseline, this build (the order turns each
    # round); the host slows down twice as much in round 2
    (tmp_path / "queue").write_text("100 110 220 200 105 100")
    cur, base = tool.timed_runs([str(script), str(script)], 3)
    rows = tool.paired(cur, base)
    pool = rows[0]
    assert (pool["row"], pool["size"], pool["ns"], pool["range"]) == \
        ("emmpool pool", "64 KiB", 105, [100, 200])
    assert pool["ratio_range"] == [100 / 110, 1.05] and pool["ratio"] == 100 / 110
    assert rows[1]["size"] == "-" and rows[1]["ratio"] == 1.0
    assert "| emmpool pool | 64 KiB | 105 | 100–200 | 0.909 | 0.909–1.050 |" in \
        tool.timed_table(rows)

"""benchmarks/mixed_programs.py end to end on a GPU, at its smallest (four children, under a
minute): program a under each library's own pools and under emmpool, one round of one cycle,
and one capacity probe each with its filler allocation (skipped, with the reason, where there is
no GPU, CuPy, PyTorch or NVML). The full matrix is a benchmark run, not a test: see
benchmarks/README.md."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "mixed_programs.py"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ is not shipped here"),
    *[pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"needs {what}")
      for name, what in (("cupy", "CuPy"), ("torch", "PyTorch"), ("pynvml", "nvidia-ml-py"))],
]


def test_mixed_programs_quick_run(tmp_path):
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--quick", "--programs", "a",
         "--setups", "separate", "emmpool", "--cycles", "1", "--probes", "1", "--no-warmup",
         "--budget-gib", "1", "--cpus", "0"],
        capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    doc = json.loads((tmp_path / "mixed_programs.json").read_text())
    results = doc["results"]["cupy_torch"]
    for setup in ("separate", "emmpool"):
        (round_,) = results[setup]["timing"]["rounds"]
        assert round_["outcome"] == "ok", round_
        assert round_["memory"]["peak"] > 0 and round_["allocator"]["total"] > 0
        capacity = results[setup]["capacity"]
        assert capacity["probes"] and all(o in ("ok", "oom") for _, o in capacity["probes"])
        probe = capacity["runs"][0]
        # the filler left about B (1 GiB) free to the probe, before its setup started
        assert abs(probe["filler"]["free_after"] - (1 << 30)) < 64 << 20, probe["filler"]
    assert results["emmpool"]["timing"]["rounds"][0]["serves"]["torch"].startswith("emmpool")
    md = (tmp_path / "mixed_programs.md").read_text()
    assert "| separate | ok |" in md and "| emmpool | ok |" in md

"""The results copier (.ci/gpu-results): which files of a GPU run go into benchmarks/results/ and
under which names, without the rows of earlier builds timed beside this one; and the committed
results hold none of those."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import sys
import tarfile
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[1] / ".ci"


@pytest.fixture(scope="module")
def results():
    if not (CI / "gpu-results").exists():
        pytest.skip(".ci/ is not shipped here")  # an sdist
    loader = importlib.machinery.SourceFileLoader("gpu_results", str(CI / "gpu-results"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_results", loader))
    sys.modules["gpu_results"] = module
    loader.exec_module(module)
    return module


BENCH_MD = """\
| manager | 256B |
|---|---:|
| emmpool | 1.02x |
| emmpool@before | 1.03x |
| cupy/emmpool@before | 0.9x |
| emmpool@beforehand | 1.1x |

- `emmpool` pool work per op: 1
- `emmpool@before` pool work per op: 2

A build other than the first (`emmpool@NAME`, benchmarks/baselines.py) runs in its own process.
"""


def test_rows_of_earlier_builds_are_left_out_of_results(results):
    md, dropped = results.without_baselines("bench_numba.md", BENCH_MD.encode(), {"before"})
    assert dropped == 3
    assert md.decode() == BENCH_MD.replace("| emmpool@before | 1.03x |\n", "").replace(
        "| cupy/emmpool@before | 0.9x |\n", "").replace(
        "- `emmpool@before` pool work per op: 2\n", "")
    report = {"managers": {"emmpool": {"us": 1}, "emmpool@before": {"us": 2}},
              "cupy/emmpool@before": {"256": 1}, "dask/emmpool@0.75": {"256": 1},
              "rows": [{"config": "native"}, {"config": "emmpool@before", "x": 1}]}
    text = json.dumps(report, indent=1) + "\n"
    data, dropped = results.without_baselines("bench.json", text.encode(), {"before"})
    assert dropped == 3
    assert data.decode() == json.dumps({"managers": {"emmpool": {"us": 1}},
                                        "dask/emmpool@0.75": {"256": 1},
                                        "rows": [{"config": "native"}]}, indent=1) + "\n"
    assert results.without_baselines("bench.json", text.encode(), set()) == (text.encode(), 0)


def test_the_run_names_its_earlier_builds(results):
    files = {"summary.txt": b"step rc secs note\nbaseline-pre20  0  40  abc\nbench-core 0 3\n"}
    assert results.baseline_names(files, {"baseline-before.txt": "", "env.txt": ""}) == {
        "pre20", "before"}


def make_run(outdir: Path, loose: dict[str, str], logs: dict[str, str]):
    outdir.mkdir()
    staging = outdir.parent / "staging"
    (staging / "logs").mkdir(parents=True)
    for name, text in {**loose, **{f"logs/{n}": t for n, t in logs.items()}}.items():
        (staging / name).write_text(text)
    with tarfile.open(outdir / "logs.tar.gz", "w:gz") as tar:
        tar.add(staging, arcname=".")
    for name, text in loose.items():
        (outdir / name).write_text(text)


def test_results_are_copied_under_fixed_names_without_earlier_builds(results, tmp_path, capsys):
    env = "date: 1999-01-02T03:04:05Z\nGPU 0: NVIDIA H200 (UUID: GPU-x)\n" \
          "NVIDIA H200, 580.1, 143771 MiB, 0 MiB\nnumba-cuda           0.30.4\n"
    make_run(tmp_path / "out",
             {"summary.txt": "step rc secs note\nbaseline-before 0 40\n",
              "bench_numba.md": BENCH_MD, "compare-pool.txt": "RESULT: PASS\n",
              "H200-1999-01-02-cupy-suite.txt": "REGRESSIONS: 0\n"},
             {"env.txt": env, "baseline-before.txt": ""})
    dest = tmp_path / "results"
    assert results.main([str(tmp_path / "out"), "--results", str(dest)]) == 0
    assert sorted(p.name for p in (dest / "H200").iterdir()) == [
        "bench_numba.md", "cupy-suite.txt", "numba-suite.txt"]
    assert "emmpool@before" not in (dest / "H200/bench_numba.md").read_text().replace(
        "emmpool@beforehand", "")
    assert (dest / "H200/numba-suite.txt").read_text().startswith(
        "# NVIDIA H200 (1 GPU), driver 580.1, numba-cuda 0.30.4; .ci/gpu.py run of "
        "1999-01-02T03:04:05Z\nRESULT: PASS")
    assert "row(s) of earlier builds (before) left out" in capsys.readouterr().out


def test_a_cuda12_run_has_results_of_its_own(results, tmp_path):
    env = "date: 1999-01-02T03:04:05Z\nGPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-x)\n"
    stack = "CUDA 12 stack: cuda-bindings 12.9.10; cudart 12.9 (carried)"
    make_run(tmp_path / "out", {"compare-pool.txt": "RESULT: PASS\n"},
             {"env.txt": env, "cuda12.txt": f"numba-cuda 0.30.4\n{stack}\n"})
    dest = tmp_path / "results"
    assert results.main([str(tmp_path / "out"), "--results", str(dest)]) == 0
    text = (dest / "H100-cuda12/numba-suite.txt").read_text()
    assert text.splitlines()[1:] == [f"# {stack}", "RESULT: PASS"], text
    assert not (dest / "H100").exists()


def test_committed_results_hold_no_rows_of_earlier_builds():
    root = CI.parent / "benchmarks" / "results"
    if not root.is_dir():
        pytest.skip("benchmarks/results is not shipped here")
    found = []
    for path in sorted(root.rglob("*")):
        if path.suffix in (".md", ".json"):
            text = path.read_text()
            # emmpool@<fraction> is a setup of dask_spill (a pool cap), not a build
            for label in set(re.findall(r"emmpool@([A-Za-z][\w.-]*)", text)):
                if label != "NAME":
                    found.append(f"{path.relative_to(root)}: emmpool@{label}")
    assert not found, found


def test_mixed_programs_outputs_keep_their_names(results):
    for name in ("mixed_programs.md", "mixed_programs.json", "mixed_programs_rapids.png",
                 "mixed_programs_cupy_torch.png"):
        assert results.target_name(name) == name
    for name in ("mixed_programs.txt", "mixed_programs_rapids.json", "mixed_programs_a b.png"):
        assert results.target_name(name) is None

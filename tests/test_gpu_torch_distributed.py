"""PyTorch distributed with emmpool's default under it (benchmarks/torch_ddp.py): DDP training
over NCCL whose losses are PyTorch's own bit for bit, the collectives at every size class emmpool
has, and a CuPy array reduced through NCCL by DLPack. On one GPU where that is all there is
(world size 1: NCCL all the same); on two with the multi_gpu mark. Without a GPU the same runs
over gloo on the CPU, which checks the runner and the checks themselves, not the allocator."""

from __future__ import annotations

import pytest

from tests.conftest import benchmark_module, gpu_unavailable_reason, require, requires


def ddp(tmp_path, *args: str) -> dict:
    bench = benchmark_module("torch_ddp")
    rc = bench.main(["--out", str(tmp_path), "--steps", "12", "--rounds", "1", *args])
    import json

    stem = "torch_ddp_nccl_register" if "--nccl-register" in args else "torch_ddp"
    summary = json.loads((tmp_path / f"{stem}.json").read_text())["summary"]
    assert rc == 0, (tmp_path / f"{stem}.md").read_text()
    assert summary["losses_identical"], summary
    for setup in ("native", "emmpool"):
        assert summary[setup]["checks_ok"], summary[setup]["checks"]
    return summary


@requires("torch")
def test_the_runner_and_its_checks_over_gloo_on_the_cpu(tmp_path):
    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is here: the GPU tests below run the real thing")
    summary = ddp(tmp_path, "--device", "cpu", "--gpus", "2")
    assert [c["bytes"] for c in summary["native"]["checks"]] == list(
        benchmark_module("torch_ddp").SIZES)


def _on_gpus(tmp_path, gpus: int, *args: str) -> None:
    torch = require("torch")
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs: this machine has {torch.cuda.device_count()}")
    summary = ddp(tmp_path, "--gpus", str(gpus), *args)
    assert summary["emmpool"]["allocator"] != summary["native"]["allocator"], summary
    assert summary["emmpool"]["by_library_rank0"].get("torch", 0) > 0, summary


@pytest.mark.gpu
@pytest.mark.torch
def test_ddp_and_collectives_on_one_gpu(tmp_path):
    _on_gpus(tmp_path, 1)


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.multi_gpu
def test_ddp_and_collectives_over_nccl_on_two_gpus(tmp_path):
    _on_gpus(tmp_path, 2)


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.multi_gpu
def test_ddp_with_nccl_user_buffer_registration_on_two_gpus(tmp_path):
    # PyTorch registers the segments its allocator reports with NCCL (ncclCommRegister): on
    # emmpool, the runs of a growable segment's blocks in use, and its page maps.
    _on_gpus(tmp_path, 2, "--nccl-register")

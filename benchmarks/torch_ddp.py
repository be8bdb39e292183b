"""PyTorch distributed over NCCL with PyTorch's allocator ("native") and with emmpool's default
under it, in the same run: DDP training, the collectives, and a CuPy array reduced by DLPack.

    python benchmarks/torch_ddp.py --out DIR [--gpus N] [--steps 40] [--rounds 2] [--device cpu]

Each setup runs as ``torch.distributed.run --standalone --nproc_per_node=GPUS`` of this file in
worker mode, rounds interleaving the setups (each round in the other order). A worker trains a
deterministic MLP with DistributedDataParallel (the same seed, data and cuBLAS workspace in both
setups, so the losses must be identical bit for bit), then checks all_reduce, all_gather,
broadcast and all_to_all on tensors of every size class emmpool has (a few bytes: small
segments; 2 MiB; 64 MiB: the growable segment) and, where CuPy is, a CuPy array through DLPack.
Rank 0 writes the round's result: losses, ms per step (median after warm-up), every rank's peak
reserved (torch.cuda.max_memory_reserved) and, on emmpool, what each library allocated. Without
GPUs (``--device cpu``) the same runs over gloo on the CPU: the plumbing, not the allocator.
Writes DIR/torch_ddp.json and DIR/torch_ddp.md; with ``--nccl-register``, both setups under
NCCL user-buffer registration, into DIR/torch_ddp_nccl_register.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

SETUPS = ("native", "emmpool")
# Bytes of the collectives' tensors: emmpool's small segments, a 2 MiB block, the growable
# segment's pages.
SIZES = (4, 4096, 2 << 20, 64 << 20)
WARM = 5


# ------------------------------------------------------------------------------------------
# worker (one process per GPU, under torch.distributed.run)


def worker(args) -> None:
    on_emmpool = args.setup == "emmpool" and args.device == "cuda"
    if on_emmpool:
        import emmpool

        emmpool.use_for_torch()  # before PyTorch's first CUDA allocation
        try:
            emmpool.use_for_cupy()
        except ImportError:
            pass
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    torch.use_deterministic_algorithms(True)
    losses, times = train(torch, dist, device, rank, args.steps)
    checks = collectives(torch, dist, device, rank, world)
    if cuda:
        checks += cupy_through_dlpack(torch, dist, device, world)
    peak = torch.tensor([torch.cuda.max_memory_reserved(device) if cuda else 0], device=device)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    by_library = {}
    if on_emmpool:
        import emmpool

        by_library = {lib: t["allocations"]
                      for lib, t in emmpool.stats(device.index or 0)["by_library"].items()
                      if t["allocations"]}
    if rank == 0:
        Path(args.result).write_text(json.dumps({
            "setup": args.setup, "world": world, "device": args.device,
            "losses": losses, "ms_per_step": statistics.median(times[WARM:]) * 1e3,
            "peak_reserved": [int(p.item()) for p in peaks], "checks": checks,
            "by_library_rank0": by_library,
            "allocator": torch.cuda.get_allocator_backend() if cuda else "cpu"}))
    dist.barrier()
    dist.destroy_process_group()


def train(torch, dist, device, rank: int, steps: int) -> tuple[list[float], list[float]]:
    """DDP over a 4-layer MLP; every rank a shard of the same seeded data. Rank 0's losses (as
    exact floats) and the seconds of each step."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
        torch.nn.ReLU(), torch.nn.Linear(4096, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                  else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [(torch.randn(256, 1024, generator=g), torch.randint(0, 10, (256,), generator=g))
               for _ in range(4)]
    losses, times = [], []
    for i in range(steps):
        x, y = (t.to(device) for t in batches[i % len(batches)])
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # a synchronization each step, as a training loop logs
        times.append(time.perf_counter() - t0)
    return losses, times


def collectives(torch, dist, device, rank: int, world: int) -> list[dict]:
    """Each collective at each size, its result checked exactly (small integers in float32)."""
    out = []
    for nbytes in SIZES:
        n = max(1, nbytes // 4)
        x = torch.full((n,), float(rank + 1), device=device)
        dist.all_reduce(x)
        ok = bool((x == world * (world + 1) / 2).all())
        gathered = torch.empty(n * world, device=device)
        dist.all_gather_into_tensor(gathered, torch.full((n,), float(rank), device=device))
        ok_gather = bool((gathered.view(world, n) ==
                          torch.arange(world, device=device).view(world, 1)).all())
        b = torch.full((n,), float(rank), device=device)
        dist.broadcast(b, src=world - 1)
        ok_broadcast = bool((b == world - 1).all())
        m = max(1, n // world) * world
        send = torch.full((m,), float(rank), device=device)
        recv = torch.empty(m, device=device)
        dist.all_to_all_single(recv, send)
        ok_all_to_all = bool((recv.view(world, -1) ==
                              torch.arange(world, device=device).view(world, 1)).all())
        out.append({"bytes": nbytes, "all_reduce": ok, "all_gather": ok_gather,
                    "broadcast": ok_broadcast, "all_to_all": ok_all_to_all})
    return out


def cupy_through_dlpack(torch, dist, device, world: int) -> list[dict]:
    """A CuPy array reduced through NCCL as a torch tensor sharing its memory (DLPack)."""
    try:
        import cupy
    except ImportError:
        return []
    with cupy.cuda.Device(device.index):
        a = cupy.full(1 << 20, 2.0, dtype=cupy.float32)
        t = torch.from_dlpack(a)
        torch.cuda.current_stream(device).wait_stream(torch.cuda.default_stream(device))
        dist.all_reduce(t)
        torch.cuda.synchronize(device)
        ok = bool((a == 2.0 * world).all())
    return [{"bytes": a.nbytes, "cupy_dlpack_all_reduce": ok}]


# ------------------------------------------------------------------------------------------
# runner


def run_setup(setup: str, gpus: int, steps: int, device: str, timeout: float,
              nccl_register: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", NCCL_DEBUG="WARN")
        if nccl_register:
            # ProcessGroupNCCL registers every segment the allocator reports (its trace's
            # SEGMENT_ALLOC, and its snapshot's at a communicator's start) with NCCL
            # (ncclCommRegister): user-buffer registration, for zero-copy collectives.
            env["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={gpus}", str(Path(__file__).resolve()), "--worker",
               "--setup", setup, "--steps", str(steps), "--device", device,
               "--result", str(result)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if p.returncode != 0 or not result.exists():
            raise RuntimeError(f"{setup} failed ({p.returncode}):\n{p.stderr[-4000:]}")
        return json.loads(result.read_text())


def summarize(rounds: list[dict]) -> dict:
    """Per setup: losses (the same every round, or None), median ms per step, largest peak
    reserved of any rank, every check; and emmpool's ratios to native."""
    s = {}
    for setup in SETUPS:
        runs = [r[setup] for r in rounds if setup in r]
        if not runs:
            continue
        same = all(r["losses"] == runs[0]["losses"] for r in runs)
        s[setup] = {"losses": runs[0]["losses"] if same else None,
                    "ms_per_step": statistics.median(r["ms_per_step"] for r in runs),
                    "peak_reserved": max(max(r["peak_reserved"]) for r in runs),
                    "checks_ok": all(all(v for k, v in c.items() if k != "bytes")
                                     for r in runs for c in r["checks"]),
                    "checks": runs[-1]["checks"], "allocator": runs[-1]["allocator"],
                    "by_library_rank0": runs[-1]["by_library_rank0"]}
    if "native" in s and "emmpool" in s:
        n, e = s["native"], s["emmpool"]
        s["losses_identical"] = n["losses"] is not None and n["losses"] == e["losses"]
        s["time_ratio"] = e["ms_per_step"] / n["ms_per_step"]
        s["peak_reserved_ratio"] = (e["peak_reserved"] / n["peak_reserved"]
                                    if n["peak_reserved"] else None)
    return s


def table(s: dict, gpus: int, steps: int, rounds: int, device: str = "cuda") -> str:
    over = f"{gpus} GPU{'s' if gpus > 1 else ''} (NCCL)" if device == "cuda" else \
        f"{gpus} CPU processes (gloo: the plumbing, not the allocator)"
    lines = [f"# torch_ddp: DDP over {over}, {steps} steps, {rounds} rounds",
             "",
             "| setup | allocator | ms / step | peak reserved (GiB, largest rank) | "
             "collectives and DLPack | final loss |",
             "|---|---|---:|---:|---|---:|"]
    for setup in SETUPS:
        if setup not in s:
            continue
        r = s[setup]
        loss = f"{r['losses'][-1]:.6f}" if r["losses"] else "differs between rounds"
        lines.append(f"| {setup} | {r['allocator']} | {r['ms_per_step']:.2f} | "
                     f"{harness.gib(r['peak_reserved'])} | "
                     f"{'all correct' if r['checks_ok'] else 'WRONG'} | {loss} |")
    if "time_ratio" in s:
        ratio = s["peak_reserved_ratio"]
        lines += ["", f"emmpool / native: time per step {s['time_ratio']:.3f}, peak reserved "
                  f"{'-' if ratio is None else f'{ratio:.3f}'}; losses identical bit for bit: "
                  f"{'yes' if s['losses_identical'] else 'NO'}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--gpus", type=int, help="processes, one GPU each [the GPUs here, at most 2]")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: gloo on the CPU, the plumbing only [cuda]")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per setup and round")
    ap.add_argument("--nccl-register", action="store_true",
                    help="both setups with NCCL user-buffer registration "
                         "(TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.gpus is None:
        import torch

        args.gpus = min(2, torch.cuda.device_count()) if args.device == "cuda" else 2
        if args.gpus == 0:
            print("torch_ddp: no CUDA GPU here (--device cpu runs the plumbing on the CPU)")
            return 1
    rounds = []
    for i in range(args.rounds):
        order = SETUPS if i % 2 == 0 else SETUPS[::-1]
        rounds.append({setup: run_setup(setup, args.gpus, args.steps, args.device, args.timeout,
                                        args.nccl_register)
                       for setup in order})
    s = summarize(rounds)
    stem = "torch_ddp_nccl_register" if args.nccl_register else "torch_ddp"
    text = table(s, args.gpus, args.steps, args.rounds, args.device)
    if args.nccl_register:
        text += ("\nBoth setups with NCCL user-buffer registration "
                 "(TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1).\n")
    harness.write_results(args.out, stem, {"gpus": args.gpus, "steps": args.steps,
                                           "nccl_register": args.nccl_register,
                                           "rounds": rounds, "summary": s}, text)
    ok = s.get("losses_identical", False) and all(s[x]["checks_ok"] for x in SETUPS if x in s)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

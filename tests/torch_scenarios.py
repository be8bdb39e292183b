"""Scenarios for tests/test_gpu_torch.py, each run in a fresh interpreter (emmpool must become
PyTorch's allocator before PyTorch's first CUDA allocation):

    python tests/torch_scenarios.py SCENARIO ALLOCATOR

ALLOCATOR: ``native`` (PyTorch's own allocator), ``extension`` or ``pluggable`` (emmpool's two
ways, emmpool._torch). A scenario prints ``RESULT <json>`` lines and ends with ``OK``; what it
cannot do under this allocator it reports as ``RAISES <type>: <message>``.
"""

from __future__ import annotations

import json
import os
import sys


def setup(allocator: str):
    import torch

    if allocator != "native":
        import emmpool

        how = emmpool.use_for_torch(allocator)
        assert how == allocator, (how, allocator)
    return torch


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def raises(e: BaseException):
    print(f"RAISES {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)


def cudnn_benchmark(torch, allocator):
    """A few training steps of a small conv net with cudnn.benchmark on: the losses."""
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(32, 3, 32, 32, generator=g).cuda()
    y = torch.randint(0, 10, (32,), generator=g).cuda()
    losses = []
    try:
        for _ in range(4):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    except RuntimeError as e:
        raises(e)
        return
    result(losses=losses)


def memory_stats(torch, allocator):
    """torch.cuda.memory_allocated / memory_stats / max_memory_reserved / reset / empty_cache."""
    MiB = 1 << 20
    torch.cuda.init()
    try:
        before = torch.cuda.memory_allocated()
    except RuntimeError as e:
        raises(e)
        return
    x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    after = torch.cuda.memory_allocated()
    stats = torch.cuda.memory_stats()
    reserved = torch.cuda.memory_reserved()
    peak_reserved = torch.cuda.max_memory_reserved()
    del x
    freed = torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    peak_after_reset = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()
    reserved_after_empty = torch.cuda.memory_reserved()
    free, total = torch.cuda.mem_get_info()
    result(delta=after - before, back=freed - before, reserved=reserved,
           peak_reserved=peak_reserved, peak=peak, peak_after_reset=peak_after_reset,
           reserved_after_empty=reserved_after_empty, free=free, total=total,
           keys=sorted(k for k in stats if k.startswith("allocated_bytes.all")),
           summary_ok=bool(torch.cuda.memory_summary()))


def record_stream(torch, allocator):
    """A block used on a side stream and declared with record_stream must not be handed out
    again while that stream's work runs: the next allocation of its size on the default stream
    gets another address (with record_stream ignored it gets the same one at once)."""
    n = 4 << 20
    side = torch.cuda.Stream()
    # Load both kernels first: a kernel's first launch loads its module, which may wait for the
    # device (lazy loading), and the side stream's sleep would be over before the free.
    w = torch.ones(16, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(1000)
        w.mul_(2)
    x = torch.ones(n, device="cuda")
    torch.cuda.synchronize()
    del w
    ptr = x.data_ptr()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the side stream
        x.mul_(2)
    x.record_stream(side)
    del x
    y = torch.empty(n, device="cuda")
    # Reuse is wrong only while the side stream's work still runs: a pool that synchronized
    # (a fence on the whole device, say) may hand the block out again, correctly.
    side_busy = not side.query()
    reused_while_busy = y.data_ptr() == ptr and side_busy
    torch.cuda.synchronize()
    stats = {}
    if allocator != "native":
        import emmpool

        s = emmpool.stats(0)
        stats = {k: s[k] for k in ("dormant_fences", "batches_closed", "same_stream_reuses",
                                   "segment_allocations", "segment_releases") if k in s}
    result(reused_while_busy=reused_while_busy, reused=y.data_ptr() == ptr,
           side_busy_after_allocation=side_busy, stats=stats)


def cuda_graph(torch, allocator):
    """Capture, replay with new inputs, eager allocations made after the capture survive
    replays, the graph's memory is given back when it is destroyed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 256)).cuda()
    static_in = torch.randn(64, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = model(static_in)
    # eager tensors allocated after the capture: a replay must not write into them
    sentinels = [torch.full((64, 512), 7.0, device="cuda") for _ in range(8)]
    ok = True
    for _ in range(3):
        new = torch.randn(64, 256, device="cuda")
        static_in.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        ok = ok and torch.allclose(static_out, model(new), atol=1e-5)
    intact = all(bool((s == 7.0).all()) for s in sentinels)
    del g, static_out
    torch.cuda.synchronize()
    result(replay_matches=ok, sentinels_intact=intact)


def compiled(torch, allocator):
    """torch.compile, default and max-autotune-no-cudagraphs, matches eager."""
    import torch._inductor.config as cfg

    cfg.max_autotune_gemm_backends = "TRITON,ATEN"
    torch.manual_seed(0)
    a = torch.randn(256, 256, device="cuda")
    b = torch.randn(256, 256, device="cuda")

    def f(a, b):
        return torch.nn.functional.gelu(a @ b) + a.sum(0)

    out = {}
    for mode in ("default", "max-autotune-no-cudagraphs"):
        try:
            got = torch.compile(f, mode=mode)(a, b)
            out[mode] = bool(torch.allclose(got, f(a, b), atol=1e-2, rtol=1e-2))
        except Exception as e:  # noqa: BLE001 - reported, judged by the test
            out[mode] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    result(**out)


def ipc_child(queue, done, allocator):
    torch = setup(allocator)
    t = queue.get()
    total = float(t.sum().item())
    t.add_(1)
    torch.cuda.synchronize()
    done.put(total)
    del t


def ipc(torch, allocator):
    """torch.multiprocessing: a CUDA tensor sent to a child (spawned; the child uses the same
    allocator kind), read and written there."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    # a tensor in the middle of a segment: the handle's offset matters
    pad = torch.zeros(1000, device="cuda")  # noqa: F841
    # EMMPOOL_TEST_IPC_ELEMENTS: a tensor above 1 MiB lands in a growable segment, if enabled
    n = int(os.environ.get("EMMPOOL_TEST_IPC_ELEMENTS", "1024"))
    t = torch.arange(n, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    child_allocator = sys.argv[3] if len(sys.argv) > 3 else allocator
    try:
        # what queue.put does in its feeder thread, here, so that a failure is seen
        from multiprocessing.reduction import ForkingPickler

        ForkingPickler.dumps(t)
    except RuntimeError as e:
        raises(e)
        return
    p = ctx.Process(target=ipc_child, args=(queue, done, child_allocator))
    p.start()
    queue.put(t)
    seen = done.get(timeout=120)
    p.join(timeout=120)
    torch.cuda.synchronize()
    result(child_sum=seen, expected=float(n * (n - 1) // 2), child_exit=p.exitcode,
           written_back=bool((t == torch.arange(n, device="cuda") + 1).all()))


def memory_fraction(torch, allocator):
    try:
        torch.cuda.set_per_process_memory_fraction(0.5)
        result(set=True)
    except RuntimeError as e:
        raises(e)


def out_of_memory(torch, allocator):
    """EMMPOOL_MAXIMUM_POOL_SIZE set small by the test: a request past it."""
    try:
        torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        result(allocated=True)
    except torch.OutOfMemoryError as e:
        print(f"OOM {str(e).splitlines()[0][:300]}", flush=True)
    except RuntimeError as e:
        raises(e)


SCENARIOS = {f.__name__: f for f in (cudnn_benchmark, memory_stats, record_stream, cuda_graph,
                                     compiled, ipc, memory_fraction, out_of_memory)}

if __name__ == "__main__":
    name, allocator = sys.argv[1], sys.argv[2]
    torch = setup(allocator)
    SCENARIOS[name](torch, allocator)
    print("OK", flush=True)

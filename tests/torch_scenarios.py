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

        how = emmpool.use_for_torch(allocator).how
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


def accumulated_stats(torch, allocator):
    """reset_accumulated_memory_stats(), then one allocation and its free: the accumulated
    counts are that block's alone."""
    MiB = 1 << 20
    torch.cuda.init()
    torch.empty(MiB, device="cuda")  # what a first use allocates, before the reset
    torch.cuda.reset_accumulated_memory_stats()
    y = torch.empty(MiB + 100, dtype=torch.uint8, device="cuda")
    del y
    s = torch.cuda.memory_stats()
    allocated, freed = s["allocated_bytes.all.allocated"], s["allocated_bytes.all.freed"]
    requested = (s["requested_bytes.all.allocated"], s["requested_bytes.all.freed"])
    result(one_allocation=s["allocation.all.allocated"] == 1,
           one_free=s["allocation.all.freed"] == 1,
           bytes_as_the_pool_rounds=MiB + 100 <= allocated == freed < MiB + 1024,
           bytes_as_requested=requested == (MiB + 100, MiB + 100),
           stats={k: v for k, v in s.items() if k.endswith((".all.allocated", ".all.freed"))})


def profiler_sizes(torch, allocator):
    """torch.profiler's memory records (profile_memory=True): a block's allocation and its free
    are reported with one size, the block's."""
    from torch.profiler import ProfilerActivity, profile

    n = (3 << 20) + 100
    torch.cuda.init()
    torch.empty(1, device="cuda")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = torch.empty(n, dtype=torch.uint8, device="cuda")
        del y
    sizes = [getattr(e, "device_memory_usage", 0) or getattr(e, "cuda_memory_usage", 0)
             for e in prof.events()]
    sizes = [size for size in sizes if size]
    block = max(sizes, default=0)
    result(allocation_reported=n <= block < n + 1024, free_reported=-block in sizes,
           sizes=sizes)


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
    # memory_allocated() counts a graph's live blocks, not those freed within the capture (the
    # graph's pool keeps them, as cached memory)
    big_in = torch.ones(1 << 24, device="cuda")  # 64 MiB
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        tmp = big_in * 2
        big_out = tmp + 1
        del tmp
    grown = (torch.cuda.memory_allocated() - before) / 2**20
    del g, g2, static_out, big_out
    torch.cuda.synchronize()
    result(replay_matches=ok, sentinels_intact=intact,
           graph_allocated_is_its_live_blocks=64 <= grown < 80, graph_allocated_mib=grown)


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
    # EMMCI_TEST_IPC_ELEMENTS: a tensor above 1 MiB lands in a growable segment, if enabled
    n = int(os.environ.get("EMMCI_TEST_IPC_ELEMENTS", "1024"))
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


def ipc_both_ways_child(inbox, outbox, allocator):
    import no_ptrace  # the filter came with the process (seccomp outlives execve): check it

    torch = setup(allocator)
    refused = no_ptrace.pidfd_getfd_refused(os.getppid())
    t = inbox.get()  # the parent's tensor: its pages over the parent's IPC service
    total = float(t.sum().item())
    t.add_(1)
    mine = torch.full((1 << 20,), 7.0, device="cuda")  # 4 MiB: pages of this process
    torch.cuda.synchronize()
    outbox.put((refused, total, mine))
    inbox.get()  # PyTorch's producer keeps its tensor alive until the consumer is done
    del t


def ipc_without_ptrace(torch, allocator):
    """torch.multiprocessing both ways between processes on emmpool that may not copy each
    other's descriptors (pidfd_getfd refused by a seccomp filter, as Yama's ptrace_scope=1 or a
    container without CAP_SYS_PTRACE refuses it): 4 MiB tensors, growable pages, which pass
    over the sender's IPC service."""
    import torch.multiprocessing as mp

    import no_ptrace

    no_ptrace.deny_pidfd_getfd()  # this process and every child it starts
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    n = 1 << 20
    t = torch.arange(n, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    p = ctx.Process(target=ipc_both_ways_child, args=(inbox, outbox, allocator))
    p.start()
    inbox.put(t)
    child_refused, seen, theirs = outbox.get(timeout=120)
    back = float(theirs.sum().item())  # the child's tensor, mapped here
    torch.cuda.synchronize()
    written = bool((t == torch.arange(n, device="cuda") + 1).all())
    del theirs
    inbox.put("done")
    p.join(timeout=120)
    result(parent_refused=no_ptrace.pidfd_getfd_refused(os.getppid()),
           child_refused=child_refused, child_sum=seen, expected=float(n * (n - 1) // 2),
           back=back, back_expected=7.0 * n, written_back=written, child_exit=p.exitcode)


def memory_fraction(torch, allocator):
    """set_per_process_memory_fraction caps the pool: a request past it fails, a cap below what
    is in use is refused, and the cap can be raised again."""
    total = torch.cuda.get_device_properties(0).total_memory
    keep = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    try:
        torch.cuda.set_per_process_memory_fraction(0.25)
    except RuntimeError as e:
        raises(e)
        return
    fraction = torch.cuda.get_per_process_memory_fraction(0) if hasattr(
        torch.cuda, "get_per_process_memory_fraction") else None
    try:
        torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
        over = "allocated"
    except torch.OutOfMemoryError:
        over = "OutOfMemoryError"
    try:
        torch.cuda.set_per_process_memory_fraction(1e-4)  # below the 256 MiB held
        below = "set"
    except RuntimeError as e:
        below = str(e).splitlines()[0][:300]
    torch.cuda.set_per_process_memory_fraction(1.0)
    big = torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
    result(fraction=fraction, over=over, below=below, raised_again=big.numel() > 0)
    del keep, big


def out_of_memory(torch, allocator):
    """EMMPOOL_MAXIMUM_POOL_SIZE set small by the test: a request past it."""
    try:
        torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        result(allocated=True)
    except torch.OutOfMemoryError as e:
        print(f"OOM {str(e).splitlines()[0][:300]}", flush=True)
    except RuntimeError as e:
        raises(e)


def oom_observers_after_use_on_oom(torch, allocator):
    """EMMPOOL_MAXIMUM_POOL_SIZE set small by the test: a MemPool made with use_on_oom keeps a
    free 64 MiB block while the rest of the cap is filled; a request the cap refuses is served
    from that block, and no OOM observer hears of it (PyTorch tries such pools before telling
    its observers); a request neither serves raises, and the observers hear of it once."""
    heard = []
    torch._C._cuda_attach_out_of_memory_observer(lambda device, *rest: heard.append(device))
    pool = torch.cuda.MemPool(use_on_oom=True)
    with torch.cuda.use_mem_pool(pool):
        kept = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del kept  # the MemPool keeps its block
    fill = []
    try:
        while True:  # 16 MiB: too small for the MemPool's block (at most twice the request)
            fill.append(torch.empty(16 << 20, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        pass
    heard.clear()
    served = torch.empty(48 << 20, dtype=torch.uint8, device="cuda")
    in_pool = {addr for seg in pool.snapshot() for addr, _ in _block_addresses(seg)}
    quiet = not heard
    try:
        torch.empty(200 << 20, dtype=torch.uint8, device="cuda")
        raised = False
    except torch.OutOfMemoryError:
        raised = True
    result(filled=len(fill), served_from_pool=served.data_ptr() in in_pool,
           observers_quiet=quiet, raised=raised, heard=len(heard))


def _losses_match(a, b, tol=1e-3):
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b)) and len(a) == len(b)


def reduce_overhead(torch, allocator):
    """torch.compile(mode="reduce-overhead") (CUDA graph trees over private pools): inference
    and training of a small transformer block and of a CNN, each against eager; with the
    cudagraph trees' own pool checks on (checkPoolLiveAllocations, snapshots)."""
    import torch._inductor.config as cfg

    cfg.triton.slow_path_cudagraph_asserts = os.environ.get("EMMCI_TEST_SLOW_ASSERTS") == "1"
    out = {}

    def models():
        torch.manual_seed(0)
        block = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0).cuda()
        cnn = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1, stride=2), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10)).cuda()
        return {"transformer": (block, (8, 32, 128)), "cnn": (cnn, (16, 3, 32, 32))}

    g = torch.Generator(device="cpu").manual_seed(1)
    for name, (model, shape) in models().items():
        xs = [torch.randn(*shape, generator=g).cuda() for _ in range(4)]
        try:
            model.eval()
            compiled = torch.compile(model, mode="reduce-overhead")
            with torch.no_grad():
                ok = all(torch.allclose(compiled(x).clone(), model(x), atol=1e-3, rtol=1e-3)
                         for x in xs * 2)
            out[f"{name}_inference"] = bool(ok)
        except Exception as e:  # noqa: BLE001 - reported, judged by the test
            out[f"{name}_inference"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    # training: the same steps eager and compiled, from the same weights
    for name in ("transformer", "cnn"):
        losses = {}
        for how in ("eager", "compiled"):
            model, shape = models()[name]
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            step_model = torch.compile(model, mode="reduce-overhead") if how == "compiled" else model
            g = torch.Generator(device="cpu").manual_seed(2)
            losses[how] = []
            try:
                for _ in range(6):
                    x = torch.randn(*shape, generator=g).cuda()
                    opt.zero_grad(set_to_none=True)
                    loss = step_model(x).float().pow(2).mean()
                    loss.backward()
                    opt.step()
                    losses[how].append(loss.item())
            except Exception as e:  # noqa: BLE001
                losses[how] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        out[f"{name}_training"] = (_losses_match(losses["compiled"], losses["eager"])
                                   if isinstance(losses["compiled"], list) else losses["compiled"])
    result(**out)


def shared_pool_graphs(torch, allocator):
    """Two graphs captured into one pool (graph_pool_handle), the second reading the first's
    output, one of them forking work onto a second stream inside the capture; replayed in
    capture order with new inputs; then destroyed, their memory given back."""
    torch.manual_seed(0)
    lin1 = torch.nn.Linear(512, 512).cuda()
    lin2 = torch.nn.Linear(512, 512).cuda()
    x = torch.randn(64, 512, device="cuda")
    side = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        lin2(torch.relu(lin1(x)))
    torch.cuda.current_stream().wait_stream(warm)
    # cuBLAS keeps a workspace per stream, allocated at the stream's first matmul (the side
    # stream's during the capture): not the graphs' memory
    torch._C._cuda_clearCublasWorkspaces()
    before = torch.cuda.memory_allocated()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, pool=pool):
        h = torch.relu(lin1(x))
    with torch.cuda.graph(g2, pool=pool):
        fork = torch.cuda.current_stream()
        side.wait_stream(fork)
        with torch.cuda.stream(side):
            a = lin2(h) * 2
        b = lin2(h) + 1
        fork.wait_stream(side)
        y = a + b
    ok = True
    for _ in range(3):
        x.copy_(torch.randn(64, 512, device="cuda"))
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            ref = lin2(torch.relu(lin1(x)))
        ok = ok and bool(torch.allclose(y, ref * 3 + 1, atol=1e-4))
    del g1, g2, h, a, b, y, ref
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    result(replays_match=ok, given_back=torch.cuda.memory_allocated() <= before)


def mem_pool(torch, allocator):
    """torch.cuda.MemPool and use_mem_pool: allocations inside go to the pool (its snapshot
    shows them), allocations outside do not, and its memory returns when it dies."""
    pool = torch.cuda.MemPool()
    outside_before = torch.empty(1 << 20, device="cuda")
    with torch.cuda.use_mem_pool(pool):
        inside = [torch.empty(1 << 20, device="cuda") for _ in range(3)]
    outside_after = torch.empty(1 << 20, device="cuda")
    segments = pool.snapshot()
    in_pool = {addr for seg in segments for addr, _ in _block_addresses(seg)}
    ptrs = [t.data_ptr() for t in inside]
    result(use_count=pool.use_count(), inside_in_pool=all(p in in_pool for p in ptrs),
           outside_not_in_pool=outside_before.data_ptr() not in in_pool
           and outside_after.data_ptr() not in in_pool,
           pool_ids={str(tuple(s["segment_pool_id"])) for s in segments} == {str(pool.id)})
    held = torch.cuda.memory_allocated()
    del inside, segments
    del pool
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    result(returned=torch.cuda.memory_allocated() < held)


def history_snapshot(torch, allocator):
    """_record_memory_history -> allocations and frees -> _snapshot(): blocks tile segments,
    alloc and free_completed pair in the trace with Python stacks, _dump_snapshot and
    _memory_viz work on it."""
    import pickle
    import tempfile

    torch.cuda.memory._record_memory_history(max_entries=10000)
    kept = [torch.empty(n, device="cuda") for n in (1000, 300_000, 5_000_000)]
    gone = torch.empty(2_000_000, device="cuda")
    del gone
    s = torch.cuda.memory._snapshot()
    tiled = all(sum(b["size"] for b in seg["blocks"]) == seg["total_size"] for seg in s["segments"])
    trace = s["device_traces"][0]
    allocs = {e["addr"] for e in trace if e["action"] == "alloc"}
    freed = {e["addr"] for e in trace if e["action"] == "free_completed"}
    with_frames = any(e.get("frames") for e in trace if e["action"] == "alloc")
    live = {b_addr for seg in s["segments"]
            for b_addr, b in _block_addresses(seg) if b["state"] == "active_allocated"}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "snap.pickle")
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            loaded = pickle.load(f)
    from torch.cuda import _memory_viz

    html = _memory_viz.trace_plot(loaded)
    segs = _memory_viz.segment_plot(loaded)
    torch.cuda.memory._record_memory_history(enabled=None)
    result(tiled=tiled, all_kept_live=all(t.data_ptr() in live for t in kept),
           freed_paired=bool(freed) and freed <= allocs, frames=with_frames,
           viz=len(html) > 1000 and len(segs) > 1000,
           actions=sorted({e["action"] for e in trace}))


def _block_addresses(seg):
    addr = seg["address"]
    for b in seg["blocks"]:
        yield addr, b
        addr += b["size"]


def mixed_snapshot(torch, allocator):
    """One process, Numba, CuPy and PyTorch on emmpool: emmpool.torch_snapshot() names every
    block's library."""
    import emmpool

    os.environ.setdefault("NUMBA_CUDA_MEMORY_MANAGER", "emmpool.plugin")
    import cupy
    from numba import cuda

    emmpool.use_for_cupy()
    n = cuda.device_array(100_000)
    c = cupy.ones(200_000)
    t = torch.ones(300_000, device="cuda")
    s = emmpool.torch_snapshot()
    libraries = {}
    for seg in s["segments"]:
        for addr, b in _block_addresses(seg):
            if "library" in b:
                libraries[addr] = b["library"]
    result(numba=libraries.get(n.device_ctypes_pointer.value),
           cupy=libraries.get(c.data.ptr), torch=libraries.get(t.data_ptr()))


def capture_beside_threads(torch, allocator):
    """A CUDA graph captured in each capture mode, again and again, while a CuPy thread and a
    Numba thread allocate, compute and free on streams of their own, all from one pool (their
    own pools under ``native``). Each thread's kernels and buffers are warmed up before the
    first capture, and a thread waits for its stream only outside captures, so that only
    allocating and freeing can break a capture: in "global" mode CUDA forbids other threads any
    call that could synchronize (cudaMalloc, cudaFree, cuStreamSynchronize) while it runs. Each
    capture waits until both threads have allocated inside it. Reports, per mode, the captures
    whose replays computed the right values, and every error any thread met."""
    import threading

    import numpy as np

    if allocator != "native":
        os.environ.setdefault("NUMBA_CUDA_MEMORY_MANAGER", "emmpool.plugin")
    import cupy
    from numba import cuda

    if allocator != "native":
        import emmpool

        emmpool.use_for_cupy()
    # Sizes in each of the pool's classes: small blocks, a mid block, growable pages (> 1 MiB).
    sizes = (1_000, 150_000, 3_000_000)
    stop, wanted, capturing = threading.Event(), threading.Event(), threading.Event()
    names = ("cupy", "numba")
    parked = {n: threading.Event() for n in names}  # not synchronizing until `wanted` clears
    inside = {n: threading.Event() for n in names}  # allocated while a capture ran
    errors, overlapped = [], dict.fromkeys(names, 0)
    ready = threading.Barrier(3)

    @cuda.jit
    def affine(out, k):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = 2.0 * i + k

    def cupy_round(stream, host, k, check):
        for n in sizes:
            a = cupy.arange(n, dtype=cupy.float32) * 2 + k
            # blocking=False: CuPy's default waits for the stream, which a global capture
            # forbids every other thread; a check round synchronizes below instead
            cupy.asnumpy(a, stream=stream, out=host[:n], blocking=False)
            if check:
                stream.synchronize()
                if host[n - 1] != 2 * (n - 1) + k:
                    errors.append(f"cupy: wrong value {host[n - 1]} at {n}")
            del a

    def numba_round(stream, host, k, check):
        for n in sizes:
            d = cuda.device_array(n, np.float32, stream=stream)
            affine[(n + 255) // 256, 256, stream](d, k)
            d.copy_to_host(host[:n], stream=stream)
            if check:
                stream.synchronize()
                if host[n - 1] != 2 * (n - 1) + k:
                    errors.append(f"numba: wrong value {host[n - 1]} at {n}")
            del d

    def worker(name, one_round, stream, host):
        k, warm = 0, False
        while not stop.is_set():
            if wanted.is_set():  # a capture is coming: allocate and free, never synchronize
                parked[name].set()
                while wanted.is_set() and not stop.is_set():
                    was = capturing.is_set()
                    one_round(stream, host, k, check=False)
                    if was and capturing.is_set():
                        overlapped[name] += 1
                        inside[name].set()
                parked[name].clear()
                continue
            one_round(stream, host, k, check=True)
            k = (k + 1) % 7
            if not warm:
                warm = True
                ready.wait()

    def cupy_worker():
        stream = cupy.cuda.Stream(non_blocking=True)
        host = np.frombuffer(cupy.cuda.alloc_pinned_memory(max(sizes) * 4), np.float32,
                             max(sizes))
        with stream:
            worker("cupy", cupy_round, stream, host)

    def numba_worker():
        raw = cupy.cuda.Stream(non_blocking=True)
        worker("numba", numba_round, cuda.external_stream(raw.ptr),
               cuda.pinned_array(max(sizes), np.float32))

    def guarded(work, name):
        def run():
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - every error is the result
                errors.append(f"{name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
                if not ready.broken:
                    ready.abort()
                stop.set()
        return run

    threads = [threading.Thread(target=guarded(cupy_worker, "cupy")),
               threading.Thread(target=guarded(numba_worker, "numba"))]
    for t in threads:
        t.start()
    x = torch.randn(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up the graph's kernels outside the capture
        for _ in range(3):
            (x * 2 + 1).sum()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        ready.wait(timeout=120)
    except threading.BrokenBarrierError:
        pass
    per_mode = {}
    for mode in ("global", "thread_local", "relaxed"):
        correct, failed = 0, []
        for _ in range(7):
            if stop.is_set():  # a thread failed: its error is the result
                break
            graph = torch.cuda.CUDAGraph()
            wanted.set()
            for n in names:  # every thread past its last synchronization
                parked[n].wait(timeout=30)
                inside[n].clear()
            try:
                with torch.cuda.graph(graph, capture_error_mode=mode):
                    capturing.set()
                    y = x * 2 + 1
                    z = torch.empty(3 << 20, device="cuda")  # a growable block, inside the graph
                    z.fill_(3.0)
                    for n in names:  # the other threads allocate inside the capture
                        inside[n].wait(timeout=10)
                    out = y.sum() + z[:10].sum()
                    capturing.clear()
                wanted.clear()
                for value in (1.0, -2.0):
                    x.fill_(value)
                    graph.replay()
                    torch.cuda.synchronize()
                    expected = (2 * value + 1) * x.numel() + 30.0
                    if abs(out.item() - expected) > 1e-3 * abs(expected):
                        raise AssertionError(f"replay gave {out.item()}, expected {expected}")
                correct += 1
            except Exception as e:  # noqa: BLE001 - a failed capture is the result
                capturing.clear()
                wanted.clear()
                failed.append(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
                try:
                    torch.cuda.synchronize()
                except RuntimeError:
                    pass
            del graph
        per_mode[mode] = {"captures": 7, "correct": correct, "failed": failed[:3]}
    stop.set()
    wanted.clear()
    for t in threads:
        t.join(timeout=120)
    result(modes=per_mode, thread_errors=errors[:10], overlapped=overlapped,
           threads_done=not any(t.is_alive() for t in threads))

SCENARIOS = {f.__name__: f for f in (cudnn_benchmark, memory_stats, accumulated_stats,
                                     profiler_sizes, record_stream, cuda_graph,
                                     compiled, ipc, ipc_without_ptrace, memory_fraction,
                                     out_of_memory, oom_observers_after_use_on_oom,
                                     reduce_overhead, shared_pool_graphs, mem_pool,
                                     history_snapshot, mixed_snapshot, capture_beside_threads)}

if __name__ == "__main__":
    name, allocator = sys.argv[1], sys.argv[2]
    torch = setup(allocator)
    SCENARIOS[name](torch, allocator)
    print("OK", flush=True)

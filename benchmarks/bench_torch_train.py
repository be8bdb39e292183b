"""Real training with PyTorch's caching allocator ("native") and with emmpool, in the same run.

    python benchmarks/bench_torch_train.py --out DIR [--quick] [--models resnet18,transformer]
        [--compile MODE] [--expandable] [--pluggable] [--trace]

Each configuration (native, emmpool, emmpool@NAME, ...) runs in its own child process (an
allocator is fixed at PyTorch's first CUDA allocation), rounds interleaving them, each round in
the other order. benchmarks/README.md says what the models are and what is measured. Writes
DIR/bench_torch_train.{json,md} (DIR/bench_torch_compile.* with --compile); with --trace,
DIR/trace-<model>.csv and DIR/trace-replay.md instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import baselines
import cpus
import harness

MODELS = ("resnet18", "transformer", "llama")


# ------------------------------------------------------------------------------------------
# child


def trainer(opt, batches: list, loss_of):
    """step(i): a training step on the i-th of a few batches made once; loss_of(batch): its
    loss."""

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(batches[i % len(batches)])
        loss.backward()
        opt.step()
        return loss

    return step


def make_resnet(torch, wrap):
    import torchvision

    model = torchvision.models.resnet18(num_classes=100).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator(device="cpu").manual_seed(1)
    batches = [(torch.randn(64, 3, 64, 64, generator=g).cuda(),
                torch.randint(0, 100, (64,), generator=g).cuda()) for _ in range(4)]
    return trainer(opt, batches,
                   lambda xy: torch.nn.functional.cross_entropy(wrap(model)(xy[0]), xy[1]))


def make_transformer(torch, wrap):
    vocab, d, seq, batch = 8000, 512, 128, 32

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d)
            layer = torch.nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, batch_first=True,
                                                     norm_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
            self.head = torch.nn.Linear(d, vocab)
            self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq))

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens), mask=self.mask, is_causal=True))

    model = LM().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=g).cuda() for _ in range(4)]

    def loss_of(t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = wrap(model)(t[:, :-1])
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab),
                                                 t[:, 1:].reshape(-1))

    return trainer(opt, batches, loss_of)


def make_llama(torch, wrap):
    """A Hugging Face Llama of 8 small layers at a short sequence, bf16 autocast: launch-bound,
    so that the allocator's cost per call shows (needs transformers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, seq, batch = 8000, 64, 8
    config = LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1376,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=seq)
    model = LlamaForCausalLM(config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq), generator=g).cuda() for _ in range(4)]

    def loss_of(t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return wrap(model)(input_ids=t, labels=t).loss

    return trainer(opt, batches, loss_of)


MAKERS = {"resnet18": make_resnet, "transformer": make_transformer, "llama": make_llama}


def compiler(torch, mode: str | None):
    """wrap(model): the model, or with `mode` its torch.compile'd self (made once)."""
    compiled = {}

    def wrap(m):
        if mode is None:
            return m
        if id(m) not in compiled:
            compiled[id(m)] = torch.compile(m, mode=mode)
        return compiled[id(m)]

    return wrap


def child(model: str, config: str, warmup: int, steps: int, trace_to: Path | None = None,
          compile_mode: str | None = None) -> None:
    import torch

    how = None
    if config.startswith("emmpool"):
        baselines.check_imported()  # emmpool@NAME: the earlier build, or fail
        import emmpool

        installed = emmpool.use_for_torch("pluggable" if config == "emmpool-pluggable" else "extension")
        how = getattr(installed, "how", installed)  # an earlier build (emmpool@NAME) says a str
    if trace_to is not None:
        import emmpool.trace

        emmpool.trace.start()  # before the model's first allocation: the whole lifetime
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    step = MAKERS[model](torch, compiler(torch, compile_mode))
    losses, times = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        if compile_mode is not None:
            torch.compiler.cudagraph_mark_step_begin()
        loss = step(i)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        if trace_to is not None:
            emmpool.trace.mark_synchronize()
        losses.append(loss.item())
        if i >= warmup:
            times.append((t1 - t0) * 1e3)
    out = {"model": model, "config": config, "how": how, "losses": losses,
           "ms_per_step": statistics.median(times), "ms_min": min(times),
           "peak_allocated": None, "peak_reserved": None}
    try:
        out["peak_reserved"] = torch.cuda.max_memory_reserved()
        out["peak_allocated"] = torch.cuda.max_memory_allocated()
    except RuntimeError as e:  # the pluggable allocator answers no statistics
        out["stats_error"] = str(e).splitlines()[0]
    if config.startswith("emmpool"):
        import emmpool

        s = emmpool.stats(0)
        out["emmpool_peak_reserved"] = s["peak_bytes_reserved"]
        out["emmpool_peak_in_use"] = s["peak_bytes_in_use"]
        # where time and reserved memory go: segments made and given back (cuMemFree
        # synchronizes the device), fences, blocks reused in stream order
        out["emmpool_counts"] = {k: s.get(k) for k in (
            "allocations", "segment_allocations", "segment_releases", "batches_closed",
            "same_stream_reuses", "dormant_fences")}
        if out["peak_reserved"] is None:
            out["peak_reserved"] = s["peak_bytes_reserved"]
    if trace_to is not None:
        out["trace_rows"] = emmpool.trace.write_csv(trace_to, emmpool.trace.stop())
    harness.emit(out)


# ------------------------------------------------------------------------------------------
# parent


def compile_env() -> dict[str, str]:
    """Inductor compiles in the child itself. With its pool of compile workers beside them on
    the same pinned CPUs, a child's timed steps (bound by the host) ran 1.10-1.22x slower,
    every operator alike, when its graphs came from the cache (benchmarks/README.md)."""
    return {"TORCHINDUCTOR_COMPILE_THREADS": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "1")}


def run_child(model, config, args, trace_to: Path | None = None,
              env: dict[str, str] | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", model, config, "--warmup", str(args.warmup),
           "--steps", str(args.steps)]
    if args.compile:
        cmd += ["--compile", args.compile]
        env = {**compile_env(), **(env or {})}
    if config == "native-expandable":
        env = {**(env or {}), "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    if trace_to is not None:
        cmd += ["--trace-to", str(trace_to)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, **env} if env else None)
    return harness.result_of(p.stdout) or {"model": model, "config": config,
                                           "error": (p.stdout + p.stderr)[-1500:]}


def summarize(runs: list[dict], configs: list[str]) -> tuple[list[dict], str]:
    GiB = 1 << 30
    rows, lines = [], ["| model | allocator | ms/step (best round) | vs native | ms/step (median "
                       "round) | vs native | fastest step | vs native | peak reserved (median "
                       "round; range) | vs native | losses vs native's first round |",
                       "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for model in MODELS:
        ok = {c: [r for r in runs if r["model"] == model and r["config"] == c and "error" not in r]
              for c in configs}
        if not ok["native"]:
            continue

        def figures(rs):  # best round, median round, fastest step, median peak reserved
            return (min(r["ms_per_step"] for r in rs),
                    statistics.median(r["ms_per_step"] for r in rs),
                    min(r["ms_min"] for r in rs), statistics.median(r["peak_reserved"] for r in rs))

        base_ms, base_med, base_min, base_res = figures(ok["native"])
        base_losses = ok["native"][0]["losses"]
        for c in configs:
            if not ok[c]:
                err = next((r["error"] for r in runs if r["model"] == model and r["config"] == c), "")
                lines.append(f"| {model} | {c} | failed | | | | | | | | {err.splitlines()[-1][:120] if err else ''} |")
                continue
            ms, med, fastest, res = figures(ok[c])
            lo, hi = min(r["peak_reserved"] for r in ok[c]), max(r["peak_reserved"] for r in ok[c])
            # every round against native's first (compiled kernels may differ run to run:
            # native's own rounds show by how much)
            diff = max(abs(a - b) for r in ok[c] for a, b in zip(r["losses"], base_losses))
            equal = all(r["losses"] == base_losses for r in ok[c])
            row = {"model": model, "config": c, "ms_per_step": ms, "time_ratio": ms / base_ms,
                   "ms_per_step_median_round": med, "time_ratio_median_round": med / base_med,
                   "fastest_step_ms": fastest, "fastest_step_ratio": fastest / base_min,
                   "peak_reserved": res, "reserved_ratio": res / base_res,
                   "losses_equal": equal, "max_loss_diff": diff,
                   "rounds_ms": [r["ms_per_step"] for r in ok[c]],
                   "rounds_reserved": [r["peak_reserved"] for r in ok[c]]}
            rows.append(row)
            lines.append(f"| {model} | {c} | {ms:.2f} | {ms / base_ms:.3f}x | {med:.2f} | "
                         f"{med / base_med:.3f}x | {fastest:.2f} | {fastest / base_min:.3f}x | "
                         f"{res / GiB:.3f} GiB ({lo / GiB:.3f}-{hi / GiB:.3f}) | "
                         f"{res / base_res:.3f}x | {'yes' if equal else f'within {diff:.1e}'} |")
    return rows, "\n".join(lines)


REPLAY_BACKENDS = ("torch", "emmpool-fixed", "emmpool-host", "emmpool-host-behind")


def trace_and_replay(args, models) -> None:
    """--trace: a traced emmpool child per model, then each trace replayed
    (benchmarks/README.md)."""
    args.out.mkdir(parents=True, exist_ok=True)
    report = ["# bench_torch_train --trace", ""]
    for model in models:
        path = args.out / f"trace-{model}.csv"
        res = run_child(model, "emmpool", args, trace_to=path)
        if "error" in res:
            report += [f"## {model}: the traced run failed", "", "```", res["error"], "```", ""]
            continue
        report += [f"## {model}", "",
                   f"Traced run ({args.warmup} + {args.steps} steps): peak reserved "
                   f"{res['peak_reserved'] / 2**20:.1f} MiB (emmpool's own peak "
                   f"{res['emmpool_peak_reserved'] / 2**20:.1f} MiB), {res['trace_rows']} rows, "
                   f"counts {json.dumps(res['emmpool_counts'])}.", ""]
        p = subprocess.run([sys.executable, "-m", "emmpool", "replay", str(path), "--backends",
                            *REPLAY_BACKENDS], capture_output=True, text=True, timeout=600)
        report += [p.stdout.strip(), p.stderr.strip()[-2000:], ""]
        print("\n".join(report[-4:]), flush=True)
    (args.out / "trace-replay.md").write_text("\n".join(report) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="2 rounds, fewer steps (< 2 minutes)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--models", default="resnet18,transformer",
                    help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--pluggable", action="store_true", help="also the CUDAPluggableAllocator")
    ap.add_argument("--compile", metavar="MODE", help="torch.compile(model, mode=MODE)")
    ap.add_argument("--expandable", action="store_true",
                    help="also PyTorch's allocator with expandable segments")
    ap.add_argument("--cpus", type=int, default=8, help="pin to this many CPUs near the GPU")
    ap.add_argument("--trace", action="store_true",
                    help="record and replay each model's allocation trace (README.md)")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    ap.add_argument("--trace-to", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child, args.warmup, args.steps, args.trace_to, args.compile)
        return
    if args.out is None:
        ap.error("--out DIR is required")
    rounds = args.rounds or (2 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (8 if args.quick else 15)
    args.steps = args.steps or (25 if args.quick else 60)
    pinned = cpus.pin_near_gpu(args.cpus)
    if args.trace:
        trace_and_replay(args, [m for m in args.models.split(",") if m])
        return
    earlier = {f"emmpool@{name}": baselines.child_env(path)
               for name, path in baselines.baselines()}  # EMMCI_BENCH_BASELINES
    configs = (["native"] + (["native-expandable"] if args.expandable else []) + ["emmpool"] +
               list(earlier) + (["emmpool-pluggable"] if args.pluggable else []))
    models = [m for m in args.models.split(",") if m]
    runs = []
    t0 = time.time()
    for r in range(rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for model in models:
            for c in order:
                res = run_child(model, c, args, env=earlier.get(c))
                res["round"] = r
                runs.append(res)
                brief = (f"{res['ms_per_step']:.2f} ms/step, peak reserved "
                         f"{res['peak_reserved'] / 2**20:.0f} MiB"
                         f"{' ' + json.dumps(res['emmpool_counts']) if 'emmpool_counts' in res else ''}"
                         if "error" not in res
                         else "FAILED " + res["error"].splitlines()[-1][:200])
                print(f"round {r} {model:12s} {c:18s} {brief}", flush=True)
    rows, table = summarize(runs, configs)
    import torch

    name = "bench_torch_compile" if args.compile else "bench_torch_train"
    head = (f"# {name}\n\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
            f"{'torch.compile(mode=' + repr(args.compile) + '), ' if args.compile else ''}"
            f"{rounds} rounds x (warm-up {args.warmup} + {args.steps} steps), cuDNN benchmark "
            f"off, CPUs pinned: {pinned or 'no'}, {time.time() - t0:.0f} s\n\n")
    harness.write_results(args.out, name, {
        "rows": rows, "runs": runs, "rounds": rounds, "warmup": args.warmup,
        "steps": args.steps, "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "compile": args.compile}, head + table + "\n")


if __name__ == "__main__":
    main()

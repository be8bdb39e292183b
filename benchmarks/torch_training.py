#!/usr/bin/env python
"""A PyTorch training loop's peak reserved memory: PyTorch's caching allocator against emmpool.

    python benchmarks/torch_training.py --out DIR [--steps N] [--rounds R] [--free-limits SIZE ...]

Configurations (each in a fresh process, --rounds times, interleaved): torch, torch-expandable,
emmpool-fixed, emmpool-growable, and emmpool-growable-free-SIZE for each of --free-limits;
benchmarks/README.md says what the loop is and what is reported. Writes DIR/torch_training.json
(every round) and DIR/torch_training.md (the table, also printed).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import harness

CONFIGS = {
    "torch": {},
    "torch-expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "emmpool-fixed": {"EMMPOOL_SEGMENTS": "fixed"},
    "emmpool-growable": {"EMMPOOL_SEGMENTS": "growable"},
}
MiB = 1 << 20


COUNTERS = ("page_maps", "page_unmaps", "fence_waits")  # emmpool's, per timed step


def child(name, steps, warmup):
    import time

    if name.startswith("emmpool"):
        import emmpool

        emmpool.use_for_torch()
    import torch

    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(99)
    dev = torch.device("cuda", 0)
    mlp = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(4096, 4096),
                                                               torch.nn.GELU())]).to(dev)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(128, 10)).to(dev)
    opt = torch.optim.Adam(list(mlp.parameters()) + list(conv.parameters()), lr=1e-4)

    def counters():
        if not name.startswith("emmpool"):
            return {}
        st = emmpool.stats(0)
        return {k: st.get(k, 0) for k in COUNTERS}

    for step in range(steps):
        if step == warmup:  # the clock starts once the first shapes have been seen
            torch.cuda.synchronize()
            t0, before = time.perf_counter(), counters()
        b = int(torch.randint(16, 513, (1,), generator=gen))
        x = torch.randn(b, 4096, device=dev)
        img = torch.randn(b // 4 + 1, 3, 64 + (b % 5) * 16, 64 + (b % 3) * 16, device=dev)
        loss = mlp(x).square().mean() + conv(img).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    timed = steps - warmup
    out = {"seconds_per_step": (time.perf_counter() - t0) / timed}
    if name.startswith("emmpool"):
        st = emmpool.stats(0)
        after = counters()
        out.update(peak_reserved=st["peak_bytes_reserved"], peak_in_use=st["peak_bytes_in_use"],
                   growable=bool(emmpool._core.pool(0).growable),
                   **{f"{k}_per_step": (after[k] - before[k]) / timed for k in COUNTERS})
    else:
        out.update(peak_reserved=torch.cuda.max_memory_reserved(dev),
                   peak_in_use=torch.cuda.max_memory_allocated(dev), growable=None)
    print(json.dumps(out))


def summarize(runs):
    """One configuration's rounds: medians, with the range of time and peak."""
    s = {k: statistics.median([r[k] for r in runs]) for k in ("seconds_per_step", "peak_reserved",
                                                      "peak_in_use")}
    s["seconds_range"] = [min(r["seconds_per_step"] for r in runs),
                          max(r["seconds_per_step"] for r in runs)]
    s["peak_reserved_range"] = [min(r["peak_reserved"] for r in runs),
                                max(r["peak_reserved"] for r in runs)]
    for k in COUNTERS:
        if runs[0].get(f"{k}_per_step") is not None:
            s[f"{k}_per_step"] = statistics.median([r[f"{k}_per_step"] for r in runs])
    return s


def _cells(name, s, fastest):
    if "page_maps_per_step" in s:
        moves = (f"{s['page_maps_per_step']:.1f} / {s['page_unmaps_per_step']:.1f} / "
                 f"{s['fence_waits_per_step']:.2f}")
    else:
        moves = ""
    lo, hi = (x / MiB for x in s["peak_reserved_range"])
    tlo, thi = (x * 1e3 for x in s["seconds_range"])
    return (f"| {name} | {s['peak_reserved'] / MiB:.0f} ({lo:.0f}-{hi:.0f}) | "
            f"{s['peak_in_use'] / MiB:.0f} | {s['peak_reserved'] / max(s['peak_in_use'], 1):.3f} | "
            f"{s['seconds_per_step'] * 1e3:.2f} ({tlo:.2f}-{thi:.2f}) | "
            f"{s['seconds_per_step'] / fastest:.3f} | {moves} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20,
                    help="steps before the clock starts (their memory counts in the peak)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of each configuration, interleaved: medians reported")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--free-limits", nargs="+", default=[], metavar="SIZE",
                    help="also run growable segments with each of these free limits "
                         "(EMMPOOL_GROWABLE_FREE_LIMIT's syntax: 512MiB, 2GiB, 0)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        ap.error("--warmup must be below --steps")
    if args.child:
        child(args.child, args.steps, args.warmup)
        return 0
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError("torch.cuda.is_available() is False")
    except ImportError as e:
        print(f"skipped: {e}")
        return 0
    configs = {name: CONFIGS[name] for name in args.configs}
    for size in args.free_limits:
        configs[f"emmpool-growable-free-{size}"] = {"EMMPOOL_SEGMENTS": "growable",
                                                    "EMMPOOL_GROWABLE_FREE_LIMIT": size}
    runs = {name: [] for name in configs}
    errors = {}
    for _ in range(args.rounds):  # interleaved: a drift in clocks touches every setup alike
        for name, config in configs.items():
            if name in errors:
                continue
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith("EMMPOOL_") and k != "PYTORCH_CUDA_ALLOC_CONF"}
            env.update(config)
            p = subprocess.run([sys.executable, __file__, "--out", args.out, "--steps",
                                str(args.steps), "--warmup", str(args.warmup), "--child", name],
                               env=env, capture_output=True, text=True, timeout=600)
            if p.returncode != 0:
                errors[name] = p.stderr[-2000:]
            else:
                runs[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
    results = {name: {"status": "error", "reason": errors[name]} if name in errors else
               {"status": "ok", **summarize(runs[name]), "rounds": runs[name]}
               for name in configs}
    ok = [r["seconds_per_step"] for r in results.values() if r["status"] == "ok"]
    fastest = min(ok) if ok else 1.0
    lines = [f"PyTorch training loop, {args.steps} steps ({args.warmup} untimed), batch 16..512 "
             f"(shapes change every step); medians of {args.rounds} interleaved rounds (range)",
             "", "| allocator | peak reserved (MiB) | peak in use (MiB) | reserved / in use | "
             "ms / step | vs fastest | page maps / unmaps / fence waits per step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(_cells(name, r, fastest) if r["status"] == "ok"
                     else f"| {name} | error: {r['reason'][-300:]!r} | | | | | |")
    harness.write_results(args.out, "torch_training", {
        "benchmark": "torch_training", "steps": args.steps, "warmup": args.warmup,
        "rounds": args.rounds, "torch": torch.__version__, "results": results},
        "\n".join(lines) + "\n", indent=2)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

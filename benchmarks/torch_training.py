#!/usr/bin/env python
"""A PyTorch training loop's peak reserved memory: PyTorch's caching allocator against emmpool.

    python benchmarks/torch_training.py --out DIR [--steps N]

The loop (fixed seed): a 6-layer MLP (4096 wide) and a small conv net trained with Adam on
batches whose size changes every step (16..512, uniformly drawn), the shifting shapes that
fragment a caching allocator; activations, gradients and optimizer state all come from the
allocator under test. Each configuration runs in a fresh process (an allocator is chosen
before PyTorch's first CUDA allocation):

  torch                 PyTorch's own caching allocator; peak = torch.cuda.max_memory_reserved()
  torch-expandable      the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  emmpool-fixed         emmpool.use_for_torch(), EMMPOOL_SEGMENTS=fixed; peak = peak_bytes_reserved
  emmpool-growable      the same with EMMPOOL_SEGMENTS=growable

Also reported: peak bytes in use (what the tensors needed) and seconds per step. Writes
DIR/torch_training.json and DIR/torch_training.md (the table, also printed).
"""

import argparse
import json
import os
import subprocess
import sys

CONFIGS = {
    "torch": {},
    "torch-expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "emmpool-fixed": {"EMMPOOL_SEGMENTS": "fixed"},
    "emmpool-growable": {"EMMPOOL_SEGMENTS": "growable"},
}
MiB = 1 << 20


def child(name, steps):
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
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        b = int(torch.randint(16, 513, (1,), generator=gen))
        x = torch.randn(b, 4096, device=dev)
        img = torch.randn(b // 4 + 1, 3, 64 + (b % 5) * 16, 64 + (b % 3) * 16, device=dev)
        loss = mlp(x).square().mean() + conv(img).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    if name.startswith("emmpool"):
        import emmpool

        st = emmpool.stats(0)
        peak_reserved, peak_in_use = st["peak_bytes_reserved"], st["peak_bytes_in_use"]
        growable = bool(emmpool._core.pool(0).growable)
        maps, unmaps = st.get("page_maps", 0) / steps, st.get("page_unmaps", 0) / steps
    else:
        peak_reserved = torch.cuda.max_memory_reserved(dev)
        peak_in_use = torch.cuda.max_memory_allocated(dev)
        growable = None
        maps = unmaps = None
    print(json.dumps({"peak_reserved": peak_reserved, "peak_in_use": peak_in_use,
                      "seconds_per_step": seconds, "growable": growable,
                      "page_maps_per_step": maps, "page_unmaps_per_step": unmaps}))


def _per_step(r):
    m, u = r.get("page_maps_per_step"), r.get("page_unmaps_per_step")
    return "" if m is None else f"{m:.1f} / {u:.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.steps)
        return 0
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError("torch.cuda.is_available() is False")
    except ImportError as e:
        print(f"skipped: {e}")
        return 0
    results = {}
    for name in args.configs:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("EMMPOOL_") and k != "PYTORCH_CUDA_ALLOC_CONF"}
        env.update(CONFIGS[name])
        p = subprocess.run([sys.executable, __file__, "--out", args.out, "--steps",
                            str(args.steps), "--child", name], env=env, capture_output=True,
                           text=True, timeout=600)
        if p.returncode != 0:
            results[name] = {"status": "error", "reason": p.stderr[-2000:]}
        else:
            results[name] = {"status": "ok", **json.loads(p.stdout.strip().splitlines()[-1])}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "torch_training.json"), "w") as f:
        json.dump({"benchmark": "torch_training", "steps": args.steps,
                   "torch": torch.__version__, "results": results}, f, indent=2)
    lines = [f"PyTorch training loop, {args.steps} steps, batch 16..512 (shapes change every step)",
             "", "| allocator | peak reserved (MiB) | peak in use (MiB) | reserved / in use | "
             "ms / step | page maps / unmaps per step |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        if r["status"] != "ok":
            lines.append(f"| {name} | error: {r['reason'][-300:]!r} | | | | |")
            continue
        lines.append(f"| {name} | {r['peak_reserved'] / MiB:.1f} | {r['peak_in_use'] / MiB:.1f} | "
                     f"{r['peak_reserved'] / max(r['peak_in_use'], 1):.3f} | "
                     f"{r['seconds_per_step'] * 1e3:.2f} | {_per_step(r)} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "torch_training.md"), "w") as f:
        f.write(table)
    print(table, end="")
    return 1 if any(r["status"] != "ok" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

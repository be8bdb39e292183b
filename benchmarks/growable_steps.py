"""Page maps and unmaps per step of a PyTorch-like training loop over the host driver (no GPU):
emmpool's growable segments with and without the hysteresis (issue #18 follow-up), fixed
segments for reference.

The loop: parameters and optimizer state held throughout; per step a batch shape drawn anew
(sequence length and batch size change every step, as in torch_training.py), activations
allocated layer by layer (forward, with a temporary per layer), then per layer in reverse a
gradient allocated and the activation freed (backward), then the optimizer's temporaries. The
GPU keeps up (every fence completes at once). On an H100, every page map/unmap is a
cuMemCreate+cuMemMap+cuMemSetAccess / cuMemUnmap+cuMemRelease: what made the growable loop
32.8 ms/step vs 15.8 fixed (benchmarks/results/NVIDIA-H100-2026-11-23-torch-training.md).

    python benchmarks/growable_steps.py [--steps 200] [--seed 1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import random

from emmpool import _core

MiB = 1 << 20


def run(segments: str, hysteresis: bool, steps: int, seed: int, warm: int = 10) -> dict:
    drv = _core.HostDriver(devices=1, capacity=1 << 40)
    pool = _core.DevicePool(drv, 0, segments=segments, growable_hysteresis=hysteresis)
    rng = random.Random(seed)
    layers = 24
    width = [rng.choice([1, 2, 3, 4, 6, 8]) for _ in range(layers)]  # MiB per unit of shape
    params = [pool.allocate(w * 2 * MiB) for w in width]
    state = [pool.allocate(w * 4 * MiB) for w in width]  # Adam's two moments
    maps0 = unmaps0 = 0
    for step in range(warm + steps):
        if step == warm:
            s = pool.stats()
            maps0, unmaps0 = s["page_maps"], s["page_unmaps"]
            pool.reset_peaks()
        shape = rng.randint(4, 16) * rng.choice([1, 2])  # sequence length x batch, in units
        acts = []
        for w in width:  # forward
            tmp = pool.allocate(w * shape * MiB // 8 + rng.randrange(64) * 256)
            acts.append(pool.allocate(w * shape * MiB // 4 + rng.randrange(64) * 256))
            pool.deallocate(tmp)
            drv.complete_all_events()
        grad = None
        grads = []
        for w, a in zip(reversed(width), reversed(acts)):  # backward
            g = pool.allocate(w * shape * MiB // 4)
            grads.append(pool.allocate(w * 2 * MiB))  # parameter gradient
            pool.deallocate(a)
            if grad is not None:
                pool.deallocate(grad)
            grad = g
            drv.complete_all_events()
        pool.deallocate(grad)
        for g in grads:  # optimizer step: a temporary per parameter, then the gradients go
            t = pool.allocate(2 * MiB * 2)
            pool.deallocate(t)
            pool.deallocate(g)
        drv.complete_all_events()
    s = pool.stats()
    for p in params + state:
        pool.deallocate(p)
    return {
        "segments": segments,
        "hysteresis": hysteresis if segments == "growable" else None,
        "steps": steps,
        "page_maps_per_step": (s["page_maps"] - maps0) / steps,
        "page_unmaps_per_step": (s["page_unmaps"] - unmaps0) / steps,
        "peak_in_use_mib": s["peak_bytes_in_use"] / MiB,
        "peak_reserved_mib": s["peak_bytes_reserved"] / MiB,
        "reserved_over_live": s["peak_bytes_reserved"] / s["peak_bytes_in_use"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", help="write the results as JSON")
    a = ap.parse_args()
    rows = [
        run("fixed", True, a.steps, a.seed),
        run("growable", False, a.steps, a.seed),
        run("growable", True, a.steps, a.seed),
    ]
    print(f"PyTorch-like training loop over the host driver: {a.steps} steps, seed {a.seed}\n")
    print("| segments | hysteresis | page maps / step | page unmaps / step | peak in use (MiB) "
          "| peak reserved (MiB) | reserved / in use |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        hy = "-" if r["hysteresis"] is None else ("on" if r["hysteresis"] else "off")
        print(f"| {r['segments']} | {hy} | {r['page_maps_per_step']:.1f} | "
              f"{r['page_unmaps_per_step']:.1f} | {r['peak_in_use_mib']:.0f} | "
              f"{r['peak_reserved_mib']:.0f} | {r['reserved_over_live']:.3f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"benchmark": "growable_steps", "seed": a.seed, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()

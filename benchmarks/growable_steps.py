"""Page maps, unmaps and creations per step of a PyTorch-like training loop over the host driver
(no GPU), or over the CUDA driver with --cuda: emmpool's growable segments under several limits
on the free pages they keep, and with pages larger than the driver's 2 MiB; fixed segments for
reference. benchmarks/README.md says what the loop allocates and what each page move costs.

    python benchmarks/growable_steps.py [--steps 200] [--seed 1] [--steady] [--out FILE.json|DIR]
        [--cuda]

With --out DIR (as .ci/gpu.py runs benchmarks) it writes DIR/growable_steps.json and .md, over
the CUDA driver where a GPU with virtual memory management is usable, else the host driver.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from emmpool import _core

import training_trace

MiB = 1 << 20
DEFAULT_LIMIT = _core.DevicePool(_core.HostDriver(devices=1), 0).options["growable_free_limit"]
# growable_free_limit values compared: every free page moved; the default; all of them kept
LIMITS = [0, None, 1 << 40]
# growable_page_size values compared at the default limit, beyond the driver's own 2 MiB
PAGE_SIZES = [8 * MiB, 20 * MiB]


def run(segments: str, free_limit: int | None, steps: int, seed: int, warm: int = 10,
        cuda: bool = False, page_size: int = 0, steady: bool = False) -> dict:
    drv = None if cuda else _core.HostDriver(devices=1, capacity=1 << 40)
    pool = _core.DevicePool(drv, 0, segments=segments, growable_free_limit=free_limit,
                            growable_page_size=page_size)
    complete = (lambda: None) if cuda else drv.complete_all_events
    ops, starts, kept = training_trace.make(warm + steps, seed, steady)
    handles = {}
    maps0 = unmaps0 = creates0 = 0
    t0 = time.perf_counter()
    for i, (kind, key, size) in enumerate(ops):
        if i == starts[warm]:
            s = pool.stats()
            maps0, unmaps0, creates0 = s["page_maps"], s["page_unmaps"], s["page_creates"]
            pool.reset_peaks()
            t0 = time.perf_counter()
        if kind == "alloc":
            handles[key] = pool.allocate(size)
        elif kind == "free":
            pool.deallocate(handles.pop(key))
        else:  # the GPU catches up
            complete()
    pool.synchronize()
    seconds = time.perf_counter() - t0
    s = pool.stats()
    for key in kept:
        pool.deallocate(handles.pop(key))
    pool.trim()
    return {
        "driver": "cuda" if cuda else "host",
        "segments": segments,
        "free_limit_mib": (pool.options["growable_free_limit"] / MiB
                           if segments == "growable" else None),
        # the page the pool maps: the request rounded up to the driver's 2 MiB granularity
        "page_mib": (-(-max(page_size, 2 * MiB) // (2 * MiB)) * 2 if segments == "growable"
                     else None),
        "steps": steps,
        "page_maps_per_step": (s["page_maps"] - maps0) / steps,
        "page_unmaps_per_step": (s["page_unmaps"] - unmaps0) / steps,
        "page_creates_per_step": (s["page_creates"] - creates0) / steps,
        "peak_in_use_mib": s["peak_bytes_in_use"] / MiB,
        "peak_reserved_mib": s["peak_bytes_reserved"] / MiB,
        "reserved_over_live": s["peak_bytes_reserved"] / s["peak_bytes_in_use"],
        "ms_per_step": seconds * 1e3 / steps,
        "growable": bool(pool.growable),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--cuda", action="store_true", help="the CUDA driver, device 0")
    ap.add_argument("--steady", action="store_true",
                    help="every step the same shape and sizes (a loop whose sizes never change)")
    a = ap.parse_args()
    out_dir = a.out if a.out and (os.path.isdir(a.out) or not a.out.endswith(".json")) else None
    if out_dir and not a.cuda:
        try:
            a.cuda = bool(_core.DevicePool(None, 0, segments="growable").growable)
        except Exception:  # no GPU, no driver: the host driver
            a.cuda = False
    rows = [run("fixed", None, a.steps, a.seed, cuda=a.cuda, steady=a.steady)]
    rows += [run("growable", limit, a.steps, a.seed, cuda=a.cuda, steady=a.steady)
             for limit in LIMITS]
    rows += [run("growable", None, a.steps, a.seed, cuda=a.cuda, page_size=size, steady=a.steady)
             for size in PAGE_SIZES]
    where = "the CUDA driver" if a.cuda else "the host driver"
    shapes = "one shape throughout" if a.steady else f"seed {a.seed}"
    lines = [f"PyTorch-like training loop over {where}: {a.steps} steps, {shapes}", "",
             "| segments | free pages kept (MiB) | page (MiB) | page maps / step "
             "| page unmaps / step | pages made / step | peak in use (MiB) | peak reserved (MiB) "
             "| reserved / in use | ms / step |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        limit = "-" if r["free_limit_mib"] is None else f"{r['free_limit_mib']:.0f}"
        if r["segments"] == "growable" and r["free_limit_mib"] == DEFAULT_LIMIT / MiB:
            limit += " (default)"
        page = "-" if r.get("page_mib") is None else f"{r['page_mib']:.0f}"
        lines.append(f"| {r['segments']} | {limit} | {page} | {r['page_maps_per_step']:.1f} | "
                     f"{r['page_unmaps_per_step']:.1f} | {r['page_creates_per_step']:.1f} | "
                     f"{r['peak_in_use_mib']:.0f} | {r['peak_reserved_mib']:.0f} | "
                     f"{r['reserved_over_live']:.3f} | {r['ms_per_step']:.2f} |")
    print("\n".join(lines))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "growable_steps.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        a.out = os.path.join(out_dir, "growable_steps.json")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"benchmark": "growable_steps", "driver": "cuda" if a.cuda else "host",
                       "seed": a.seed, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()

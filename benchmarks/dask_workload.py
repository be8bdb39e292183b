"""A Dask workload on every GPU of a LocalCUDACluster: emmpool's plugin against dask-cuda's RMM
setup and against no pool setup, in one run.

    python benchmarks/dask_workload.py --out DIR [--devices 0,1] [--rounds 5]

Needs dask, distributed, dask-cuda, CuPy, numba-cuda, nvidia-ml-py (and RMM for the rmm setups).
benchmarks/README.md says what runs, what is measured and what is checked. Writes
DIR/dask_workload.md (also printed) and DIR/dask_workload.json; exit status 1 where a check
fails.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from distributed import WorkerPlugin
from numba import cuda  # makes no CUDA context: the client never launches or allocates

import harness
import nvml
from harness import gib
from nvml import PeakSampler

# emmpool: its worker plugin for Numba and CuPy; rmm: dask-cuda's rmm_pool_size with CuPy on RMM
# and Numba on RMM's EMM plugin (one pool); rmm-cupy: dask-cuda's setup as it is, Numba on its own
# allocator beside RMM's pool; none: CuPy's default pool and Numba's default allocator.
SETUPS = ("emmpool", "rmm", "rmm-cupy", "none")
A, B = 2.0, 1.0  # y = A x + B

# ---------------------------------------------------------------------------------------------
# Run on the workers. main() imports this file as the module dask_workload, so that tasks name
# these functions (the workers import it: spawned processes inherit sys.path) and each worker
# compiles the kernel once.


@cuda.jit
def axpb(x, out, a, b):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = a * x[i] + b


def arange_block(block_info=None):
    """The chunk of 0, 1, ..., n-1 this block holds, made by CuPy."""
    import cupy

    ((start, stop),) = block_info[None]["array-location"]
    return cupy.arange(start, stop, dtype=cupy.float64)


def numba_axpb(x, a, b):
    """a x + b by a Numba kernel, into an array Numba allocates; returned as a CuPy view."""
    import cupy

    out = cuda.device_array(x.shape, dtype=np.float64)
    threads = 256
    axpb[(x.size + threads - 1) // threads, threads](x, out, a, b)
    return cupy.asarray(out)


def check_block(y, block_info=None):
    """[sum of y, number of elements that differ from A i + B], on the host."""
    import cupy

    ((start, stop),) = block_info[0]["array-location"]
    expected = A * cupy.arange(start, stop, dtype=cupy.float64) + B
    wrong = int(cupy.count_nonzero(y != expected))
    return np.array([[float(y.sum()), wrong]])


def worker_device() -> dict:
    """The worker's CUDA_VISIBLE_DEVICES and the UUID of its device 0, as Numba sees it."""
    return {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "uuid": str(cuda.get_current_device().uuid)}


def cupy_pool_bytes() -> int:
    import cupy

    return int(cupy.get_default_memory_pool().total_bytes())


class RmmForNumba(WorkerPlugin):
    """Numba on RMM's EMM plugin: what a user of dask-cuda's RMM pool adds for Numba."""

    name = "rmm-for-numba"

    def setup(self, worker):
        from rmm.allocators.numba import RMMNumbaManager

        cuda.set_memory_manager(RMMNumbaManager)


# ---------------------------------------------------------------------------------------------
# The client.


def one_round(client, elements: int, chunk: int) -> tuple[float, bool]:
    """One workload round: its wall time and whether every result was right."""
    import dask.array as da

    blocks = elements // chunk
    # meta: the chunks are CuPy arrays, described by NumPy ones so that the client needs no
    # CuPy (a CuPy meta would make a CUDA context on the client's GPU 0)
    x = da.map_blocks(arange_block, chunks=((chunk,) * blocks,), dtype=np.float64,
                      meta=np.empty((0,)))
    y = x.map_blocks(numba_axpb, A, B, dtype=np.float64, meta=np.empty((0,)))
    checks = y.map_blocks(check_block, chunks=((1,) * blocks, (2,)), new_axis=1,
                          dtype=np.float64, meta=np.empty((0, 0)))
    t = time.perf_counter()
    result = client.compute(checks).result()
    wall = time.perf_counter() - t
    n = blocks * chunk
    expected_sum = A * n * (n - 1) / 2 + B * n  # exact in float64 for n <= 2**26
    return wall, bool(result[:, 0].sum() == expected_sum and not result[:, 1].any())


def run_setup(name: str, args, gpus: list) -> dict:
    """One setup in a cluster of its own: timings, per-worker figures and checks."""
    from dask_cuda import LocalCUDACluster
    from distributed import Client, get_task_stream

    import emmpool.dask

    cluster_options: dict = {}
    plugins: list = []
    if name == "emmpool":
        plugins = [emmpool.dask.EmmPool(numba=True, cupy=True)]
    elif name.startswith("rmm"):
        cluster_options = {"rmm_pool_size": args.rmm_pool_size,
                           "rmm_allocator_external_lib_list": ["cupy"]}
        if name == "rmm":
            plugins = [RmmForNumba()]
    sampler = PeakSampler(gpus)
    t0 = time.perf_counter()
    try:
        with LocalCUDACluster(CUDA_VISIBLE_DEVICES=args.devices, n_workers=len(args.devices),
                              threads_per_worker=1, dashboard_address=None,
                              **cluster_options) as cluster, Client(cluster) as client:
            client.wait_for_workers(len(args.devices), timeout=120)
            for plugin in plugins:
                client.register_plugin(plugin)
            start = time.perf_counter() - t0
            rounds = []
            with get_task_stream(client) as stream:
                for _ in range(args.rounds):
                    rounds.append(one_round(client, args.elements, args.chunk))
            devices = client.run(worker_device)
            pool_stats = emmpool.dask.stats(client) if name == "emmpool" else None
            cupy_held = client.run(cupy_pool_bytes) if name == "none" else None
    finally:
        peaks = sampler.stop()
    task_time: dict[str, float] = {}
    for task in stream.data:
        for ss in task["startstops"]:
            if ss["action"] == "compute":
                task_time[task["worker"]] = task_time.get(task["worker"], 0.0) + (
                    ss["stop"] - ss["start"])
    peak_by_gpu = dict(zip(args.devices, peaks))
    by_uuid = {g.uuid: g.index for g in gpus}
    workers, problems = {}, []
    for address, dev in sorted(devices.items()):
        gpu = by_uuid.get(dev["uuid"])
        first = dev["cuda_visible_devices"].split(",")[0]
        if gpu is None or str(gpu) != first:
            problems.append(f"{address}: device 0 is {dev['uuid']} (NVML GPU {gpu}), but "
                            f"CUDA_VISIBLE_DEVICES={dev['cuda_visible_devices']}")
        w = {"cuda_visible_devices": dev["cuda_visible_devices"], "gpu": gpu,
             "uuid": dev["uuid"], "task_time_s": task_time.get(address, 0.0),
             "nvml_peak_above_baseline": peak_by_gpu.get(gpu)}
        if pool_stats is not None:
            pools = pool_stats[address]
            w["emmpool"] = pools
            s = pools.get(0)
            if set(pools) != {0}:
                problems.append(f"{address}: emmpool pools on devices {sorted(pools)}, not on "
                                f"device 0 alone")
            elif not (s["by_library"]["numba"]["allocations"]
                      and s["by_library"]["cupy"]["allocations"]):
                problems.append(f"{address}: the pool did not serve both Numba and CuPy: "
                                f"{s['by_library']}")
        if cupy_held is not None:
            w["cupy_pool_bytes_at_end"] = cupy_held[address]
        workers[address] = w
    if len({w["gpu"] for w in workers.values()}) != len(workers):
        problems.append("two workers share a GPU")
    if not all(ok for _, ok in rounds):
        problems.append("wrong results in round(s) "
                        f"{[i + 1 for i, (_, ok) in enumerate(rounds) if not ok]}")
    return {"setup": name, "cluster_start_s": start, "rounds_s": [w for w, _ in rounds],
            "results_ok": all(ok for _, ok in rounds), "workers": workers,
            "summary": emmpool.dask.summary(pool_stats) if pool_stats is not None else None,
            "problems": problems}


def summaries(results: list[dict]) -> list[str]:
    """Each emmpool setup's emmpool.dask.summary, in markdown."""
    return [line for r in results if r.get("summary") for line in (
        "", f"emmpool per worker ({r['setup']}, emmpool.dask.summary):", "", "```", r["summary"],
        "```")]


def markdown(results: list[dict], header: dict, args) -> str:
    n, chunk = args.elements, args.chunk
    lines = [
        f"## Dask workload, {len(args.devices)} × {header['gpu']} (LocalCUDACluster), "
        f"{header['date']}",
        "",
        f"{n:,} float64 ({n * 8 / 2**20:,.0f} MiB per array) in {n // chunk} chunks of "
        f"{chunk * 8 / 2**20:,.0f} MiB; per round: CuPy arange per chunk, Numba kernel y = 2x + 1 "
        f"into a Numba array (map_blocks), CuPy check of every element and the sum. "
        f"{args.rounds} rounds per setup; round 1 includes Numba's compilation. Peak: NVML used "
        f"memory of the GPU (the worker's CUDA context included) above its value before the "
        f"cluster started, sampled every 5 ms. Versions: {header['versions']}.",
        "",
        "| setup | cluster start (s) | round 1 (s) | best later round (s) | results | worker → GPU "
        "| task time (s) | peak used above baseline (GiB, NVML) | allocator's own figure (GiB) |",
        "|---|---:|---:|---:|---|---|---:|---:|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['setup']} | failed: {r['error']} |||||||")
            continue
        later = r["rounds_s"][1:] or r["rounds_s"]
        for i, (address, w) in enumerate(sorted(r["workers"].items())):
            if "emmpool" in w:
                own = "emmpool peak reserved " + gib(
                    w["emmpool"].get(0, {}).get("peak_bytes_reserved"))
            elif "cupy_pool_bytes_at_end" in w:
                own = "CuPy pool holds at end " + gib(w["cupy_pool_bytes_at_end"])
            elif r["setup"].startswith("rmm"):
                own = f"rmm_pool_size {args.rmm_pool_size}"
            else:
                own = "-"
            setup = [r["setup"], f"{r['cluster_start_s']:.1f}", f"{r['rounds_s'][0]:.2f}",
                     f"{min(later):.2f}", "ok" if r["results_ok"] else "WRONG"]
            worker = [f"{address} → GPU {w['gpu']}", f"{w['task_time_s']:.2f}",
                      gib(w["nvml_peak_above_baseline"]), own]
            cells = (setup if i == 0 else [""] * len(setup)) + worker
            lines.append("| " + " | ".join(cells) + " |")
    lines += summaries(results)
    problems = [f"- {r['setup']}: {p}" for r in results for p in r["problems"]]
    lines += ["", "Checks: " + ("all passed (results; emmpool: one pool per worker, on its own "
                                "GPU, serving Numba and CuPy)" if not problems else "FAILED")]
    lines += problems
    return "\n".join(lines) + "\n"


def versions() -> str:
    return ", ".join(f"{k} {v}" for k, v in harness.versions(
        ("emmpool", "dask", "distributed", "dask-cuda", "cupy-cuda13x", "numba-cuda",
         "rmm-cu13")).items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--devices", help="GPUs, one worker each, e.g. 0,1 [every GPU]")
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--elements", type=int, default=2**26, help="float64 elements [2**26]")
    p.add_argument("--chunk", type=int, default=2**22, help="elements per chunk [2**22]")
    p.add_argument("--rmm-pool-size", default="4GiB", help="dask-cuda's rmm_pool_size [4GiB]")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the unreported warm-up cluster (one round of the `none` setup)")
    args = p.parse_args(argv)
    if args.elements % args.chunk or args.elements > 2**26:
        p.error("--elements must be a multiple of --chunk and at most 2**26 (exact sums)")
    # CUDA numbers GPUs fastest first, NVML by PCI bus: one order for both (the workers inherit
    # it), so that CUDA_VISIBLE_DEVICES and NVML's indices name the same GPUs.
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"

    gpus = nvml.gpus([int(d) for d in args.devices.split(",")] if args.devices else None)
    args.devices = [g.index for g in gpus]
    header = {"gpu": gpus[0].name, "versions": versions(),
              "date": datetime.date.today().isoformat()}

    if args.warmup:
        # The first cluster of a run pays what every later one finds warm (imports, Numba's
        # compilation cache on disk, the driver's first contexts): without this, that cost lands
        # on whichever setup runs first. Its figures are not reported.
        print("[dask_workload] warm-up (none, 1 round, not reported) ...", flush=True)
        try:
            run_setup("none", argparse.Namespace(**{**vars(args), "rounds": 1}), gpus)
        except Exception:  # noqa: BLE001 - the setups below report their own failures
            traceback.print_exc()
    results = []
    for name in args.setups:
        print(f"[dask_workload] {name} ...", flush=True)
        try:
            r = run_setup(name, args, gpus)
        except Exception as e:  # noqa: BLE001 - reported; the other setups still run
            traceback.print_exc()
            r = {"setup": name, "error": f"{type(e).__name__}: {e}".replace("\n", " ")[:300]}
            r["problems"] = [r["error"]]
        else:
            print(f"[dask_workload] {name}: start {r['cluster_start_s']:.1f} s, rounds "
                  f"{', '.join(f'{t:.2f}' for t in r['rounds_s'])} s", flush=True)
        print(f"[dask_workload] {name}: problems: {r['problems'] or 'none'}", flush=True)
        results.append(r)
    harness.write_results(args.out, "dask_workload", {"header": header, "args": vars(args),
                                                      "results": results},
                          markdown(results, header, args))
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    # Run as a script, this file is __main__, whose functions Dask would ship by value: import
    # it under its own name instead, so that tasks name dask_workload.* and the workers import it.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dask_workload

    sys.exit(dask_workload.main())

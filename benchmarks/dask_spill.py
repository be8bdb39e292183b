"""A Dask job with more data than its GPUs may hold, on every GPU of a LocalCUDACluster:
emmpool's spilling against dask-cuda's RMM setups and against no setup, each capped alike.

    python benchmarks/dask_spill.py --out DIR [--devices 0,1] [--cap 16GiB] [--scale 1.5]
        [--setups emmpool rmm-pool@0.75 rmm-pool rmm-async none emmpool@0.75]

Needs dask, distributed, dask-cuda, CuPy, numba-cuda, nvidia-ml-py (and RMM for the rmm setups).
benchmarks/README.md says what the setups are, what the job computes and what is reported.
Each setup runs in a child process of its own (an allocator is fixed per process), which this
process kills with its workers at ``--setup-timeout`` or at the run's deadline (``--time-limit``,
or EMMCI_BENCH_DEADLINE); a setup that would start too close to the deadline is reported
skipped. Writes DIR/dask_spill.md (also printed), DIR/dask_spill.json and each setup's log under
DIR/dask_spill-logs/. Exit status 1 where an emmpool setup did not finish with 0 failed tasks,
or a setup's results are wrong.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

import dask_workload
import harness
import nvml
from dask_workload import A, B, RmmForNumba
from harness import gib
from nvml import MiB, PeakSampler

SETUPS = ("emmpool", "rmm-pool", "rmm-async", "none")
# every setup at device_memory_limit = the cap, and the RMM pool and emmpool at 3/4 of it
DEFAULT_SETUPS = ("emmpool", "rmm-pool@0.75", "rmm-pool", "rmm-async", "none", "emmpool@0.75")
GiB = 1 << 30

# ---------------------------------------------------------------------------------------------
# Run on the workers (main() imports this file as the module dask_spill, as dask_workload does).


def _i_minus_j(location):
    """i - j over a chunk's ((row start, stop), (column start, stop)), as float64, in CuPy."""
    import cupy

    (r0, r1), (c0, c1) = location
    return cupy.subtract(cupy.arange(r0, r1, dtype=cupy.float64)[:, None],
                         cupy.arange(c0, c1, dtype=cupy.float64)[None, :])


def differences(block_info=None):
    """X's chunk: X[i, j] = i - j."""
    return _i_minus_j(block_info[None]["array-location"])


def numba_axpb_2d(x):
    """A x + B by dask_workload's Numba kernel, over a C-contiguous 2-D chunk."""
    return dask_workload.numba_axpb(x.ravel(), A, B).reshape(x.shape)


def check_chunk(s, block_info=None):
    """[[sum of S's chunk, number of its elements that differ from the closed form]]."""
    import cupy

    expected = _i_minus_j(block_info[0]["array-location"])
    expected *= expected
    expected *= 2 * A * A
    expected += 2 * B * B   # (A d + B)**2 + (-A d + B)**2, d = i - j
    wrong = int(cupy.count_nonzero(s != expected))
    return np.array([[float(s.sum()), wrong]])


# Bytes the worker's DeviceHostFile moved, by worker address (one worker per process).
_moved: dict[str, dict[str, int]] = {}


def watch_spilling(dask_worker) -> bool:
    """Count what the worker's device buffer moves to host and back (zict's callbacks run for
    every move: the buffer's own, past device_memory_limit, and emmpool's spiller's)."""
    from distributed.sizeof import safe_sizeof

    buffer = getattr(dask_worker.data, "device_buffer", None)
    if not hasattr(buffer, "fast_to_slow_callbacks"):
        return False  # no device_memory_limit: nothing moves
    counts = _moved.setdefault(dask_worker.address, dict.fromkeys(
        ("to_host_bytes", "to_host_keys", "to_device_bytes", "to_device_keys"), 0))

    def to_host(key, value):
        counts["to_host_bytes"] += safe_sizeof(value)
        counts["to_host_keys"] += 1

    def to_device(key, value):
        counts["to_device_bytes"] += safe_sizeof(value)
        counts["to_device_keys"] += 1

    buffer.fast_to_slow_callbacks.append(to_host)
    buffer.slow_to_fast_callbacks.append(to_device)
    return True


def spill_counts(dask_worker) -> dict:
    counts = dict(_moved.get(dask_worker.address, {}))
    plugin = dask_worker.plugins.get("emmpool")
    spiller = getattr(plugin, "spiller", None)
    if spiller is not None:
        counts["oom_spilled_bytes"] = spiller.spilled_bytes
        counts["oom_spills"] = spiller.spills
    return counts


# ---------------------------------------------------------------------------------------------
# The job, on a client.


def job_arrays(blocks: int, chunk: int):
    """S = Z + Z.T, Z = (A X + B)**2, X[i, j] = i - j: lazily, CuPy chunks with NumPy metas
    (a CuPy meta would make a CUDA context on the client)."""
    import dask.array as da

    x = da.map_blocks(differences, chunks=((chunk,) * blocks,) * 2, dtype=np.float64,
                      meta=np.empty((0, 0)))
    y = x.map_blocks(numba_axpb_2d, dtype=np.float64, meta=np.empty((0, 0)))
    z = y * y
    return z + z.T


def checks_of(s, blocks: int):
    return s.map_blocks(check_chunk, chunks=((1,) * blocks, (2,) * blocks), dtype=np.float64,
                        meta=np.empty((0, 0)))


def closed_form_sum(n: int) -> int:
    """The sum of 2 A**2 (i - j)**2 + 2 B**2 over 0 <= i, j < n; sum (i - j)**2 = n**2 (n**2 - 1)
    / 6, and n**2 (n**2 - 1) is a multiple of 3 (n - 1, n, n + 1)."""
    a, b = int(A), int(B)
    return a * a * n * n * (n * n - 1) // 3 + 2 * b * b * n * n


def verify(checks, blocks: int, chunk: int) -> dict:
    per_chunk = np.asarray(checks).reshape(blocks, blocks, 2)
    wrong = int(per_chunk[..., 1].sum())
    expected = closed_form_sum(blocks * chunk)
    rel = abs(float(per_chunk[..., 0].sum()) - expected) / expected
    return {"wrong_elements": wrong, "sum_rel_error": rel, "result_ok": wrong == 0 and rel < 1e-9}


class Stalled(Exception):
    """Tasks failed and none has finished since for a while: a worker that cannot receive a
    task's input (out of memory as it arrives) leaves that task waiting for ever."""


def wait_for_progress(futures: list, deadline: float, stall: float) -> None:
    """distributed.wait(futures) until `deadline` (then TimeoutError), or Stalled."""
    from distributed import wait

    done, since = -1, time.perf_counter()
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise TimeoutError
        try:
            wait(futures, timeout=min(left, 2.0))
            return
        except TimeoutError:
            pass
        finished = sum(f.done() for f in futures)
        if finished != done:
            done, since = finished, time.perf_counter()
        elif (time.perf_counter() - since > stall
              and any(f.status == "error" for f in futures)):
            raise Stalled(f"stalled: tasks failed and none finished for {stall:.0f} s")


def run_job(client, blocks: int, chunk: int, deadline: float, measure=None,
            stall: float = 15.0) -> dict:
    """Persist S, then check it: times, failed tasks and the check, or the error that ended it;
    and what `measure(client)` returns, asked while S is still held (a worker that lets go of
    data spilled to host reads it back first, which is no part of the job)."""
    from distributed import futures_of, get_task_stream

    out: dict = {"persist_s": None, "check_s": None, "result_ok": False, "error": None,
                 "timed_out": False, "stalled": False}
    persisted = None
    out["job_start"] = time.time()
    t0 = time.perf_counter()
    with get_task_stream(client) as stream:
        try:
            persisted = job_arrays(blocks, chunk).persist()
            wait_for_progress(futures_of(persisted), deadline, stall)
            out["persist_s"] = time.perf_counter() - t0
            erred = [f for f in futures_of(persisted) if f.status == "error"]
            out["keys_erred"] = len(erred)
            if erred:
                out["error"] = f"{len(erred)} of S's chunks erred"
            else:
                t1 = time.perf_counter()
                checks = client.compute(checks_of(persisted, blocks)).result(
                    timeout=max(deadline - time.perf_counter(), 1))
                out["check_s"] = time.perf_counter() - t1
                out.update(verify(checks, blocks, chunk))
        except TimeoutError:
            out["timed_out"] = True
            out["error"] = f"timed out after {time.perf_counter() - t0:.0f} s"
        except Stalled as e:
            out["stalled"] = True
            out["error"] = str(e)
        except Exception as e:  # noqa: BLE001 - the setup's outcome, reported
            out["error"] = f"{type(e).__name__}: {e}"[:300]
        out["wall_s"] = time.perf_counter() - t0
        out["job_end"] = time.time()
    failed = [t for t in stream.data if t.get("status") == "error"]
    out["tasks_run"] = len(stream.data) - len(failed)
    out["tasks_failed"] = len(failed)
    texts: list[str] = []
    for t in failed:
        text = str(t.get("exception_text", "?"))[:200]
        if text not in texts:
            texts.append(text)
    out["task_errors"] = texts[:3]
    if measure is not None:
        out.update(measure(client))
    if persisted is not None and out["error"]:
        client.cancel(persisted)
    return out


# ---------------------------------------------------------------------------------------------
# One setup, in a child process.


def parse_setup(spec: str) -> tuple[str, float]:
    """'NAME' or 'NAME@F' -> (NAME, F): device_memory_limit = F x the cap."""
    name, _, fraction = spec.partition("@")
    if name not in SETUPS:
        raise ValueError(f"setup {spec!r}: one of {', '.join(SETUPS)}, with @F for a "
                         f"device_memory_limit of F times the cap")
    try:
        f = float(fraction) if fraction else 1.0
    except ValueError:
        f = -1.0
    if not 0 < f <= 1:
        raise ValueError(f"setup {spec!r}: F in NAME@F is a fraction of the cap, in (0, 1]")
    return name, f


def cluster_setup(name: str, cap: int) -> tuple[dict, list]:
    """LocalCUDACluster's options and the worker plugins of a setup."""
    if name == "emmpool":
        import emmpool.dask

        return {}, [emmpool.dask.EmmPool(maximum_pool_size=cap, numba=True, cupy=True,
                                         rmm=True, spill=True)]
    if name == "rmm-pool":
        return {"rmm_pool_size": cap, "rmm_maximum_pool_size": cap,
                "rmm_allocator_external_lib_list": ["cupy"]}, [RmmForNumba()]
    if name == "rmm-async":
        return {"rmm_async": True, "rmm_maximum_pool_size": cap, "rmm_release_threshold": cap,
                "rmm_allocator_external_lib_list": ["cupy"]}, [RmmForNumba()]
    return {}, []


def run_setup(job: dict) -> dict:
    """A setup's cluster and job (in the child process): its figures."""
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    import emmpool.dask

    name, fraction = parse_setup(job["setup"])
    cap = job["cap"]
    limit = int(fraction * cap)
    options, plugins = cluster_setup(name, cap)
    n = len(job["devices"])
    t0 = time.perf_counter()
    deadline = t0 + job["timeout"]
    result: dict = {"setup": job["setup"], "device_memory_limit": limit}
    with LocalCUDACluster(CUDA_VISIBLE_DEVICES=job["devices"], n_workers=n,
                          threads_per_worker=1, dashboard_address=None,
                          device_memory_limit=limit, **options) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(n, timeout=120)
        for plugin in plugins:
            client.register_plugin(plugin)
        watched = client.run(watch_spilling)
        result["cluster_start_s"] = time.perf_counter() - t0
        print(f"[dask_spill] {job['setup']}: cluster up in {result['cluster_start_s']:.1f} s; "
              f"device buffers watched: {watched}", flush=True)

        def measure(client) -> dict:
            m = {"spills": client.run(spill_counts),
                 "workers": client.run(dask_workload.worker_device)}
            if name == "emmpool":
                m["emmpool"] = emmpool.dask.stats(client)
                m["summary"] = emmpool.dask.summary(m["emmpool"])
            return m

        result.update(run_job(client, job["blocks"], job["chunk"], deadline, measure))
        print(f"[dask_spill] {job['setup']}: persist {result['persist_s']} s, check "
              f"{result['check_s']} s, {result['tasks_failed']} tasks failed, error: "
              f"{result['error']}", flush=True)
        # written before the cluster closes: a close that hangs loses nothing
        Path(job["result"]).write_text(json.dumps(result, default=str))
    return result


def child_main(job_file: Path) -> int:
    spec = json.loads(job_file.read_text())
    job = {**spec["job"], "result": spec["result"]}
    try:
        run_setup(job)
    except Exception as e:  # noqa: BLE001 - the setup's outcome, reported
        traceback.print_exc()
        if not Path(job["result"]).is_file():  # else it failed as its cluster closed
            Path(job["result"]).write_text(json.dumps(
                {"setup": job["setup"], "error": f"{type(e).__name__}: {e}"[:300]}))
    return 0


def _run_child(job: dict, timeout: float, log: Path) -> dict:
    """Run a setup in a child process (its workers go with it at its time limit); its result,
    or the reason there is none."""
    result, rc = harness.run_script(__file__, job, timeout, log)
    if result is None:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        why = (f"killed at the setup's time limit ({timeout:.0f} s)" if rc is None
               else f"exited {rc} without a result: {tail[0][:200]}")
        result = {"setup": job["setup"], "error": why, "timed_out": rc is None}
    return result


# ---------------------------------------------------------------------------------------------
# The parent: NVML, the setups in turn, the table.


def run_setups(specs: list[str], job: dict, args, gpus: list, idle: list,
               deadline: float | None) -> list:
    """Each setup in turn, in a child, once the GPUs' used memory is back near `idle`; a setup
    that would start too close to the deadline is skipped."""
    results = []
    for spec in specs:
        timeout = args.setup_timeout
        if deadline is not None:
            timeout = min(timeout, deadline - time.time())
            if timeout < args.min_setup_time:
                print(f"[dask_spill] {spec}: skipped ({timeout:.0f} s left)", flush=True)
                results.append({"setup": spec, "skipped": f"{max(timeout, 0):.0f} s left"})
                continue
        print(f"[dask_spill] {spec} (at most {timeout:.0f} s) ...", flush=True)
        for gpu, used in zip(gpus, idle):  # an exited child's memory goes back shortly after
            gpu.settle(used, timeout=20.0, slack=256 * MiB)
        sampler = PeakSampler(gpus)
        name = job.get("label", "") + spec.replace("@", "_at_")
        log = args.out / "dask_spill-logs" / f"{name}.txt"
        t = time.perf_counter()
        try:
            r = _run_child({**job, "setup": spec, "timeout": max(timeout - 25, 10)}, timeout, log)
        finally:
            peaks = sampler.stop()
        r["child_s"] = time.perf_counter() - t
        devices = [g.index for g in gpus]
        r["peak_whole"] = dict(zip(devices, peaks))  # the child's whole life
        if "job_start" in r and "job_end" in r:
            in_job = sampler.peak_within(r["job_start"], r["job_end"])
            r["peak"] = dict(zip(devices, in_job)) if in_job else None
        print(f"[dask_spill] {spec}: {outcome(r)}, wall {_s(r.get('wall_s'))} s, peak in the "
              f"job {', '.join(gib(p) for p in (r.get('peak') or {}).values())} GiB, in the "
              f"setup's life {', '.join(gib(p) for p in peaks)} GiB", flush=True)
        results.append(r)
    return results


def outcome(r: dict) -> str:
    if "skipped" in r:
        return f"skipped ({r['skipped']})"
    failed = r.get("tasks_failed", 0)
    if r.get("timed_out"):
        return "timed out" + (f", {failed} tasks failed" if failed else "")
    if failed:
        return f"FAILED: {failed} tasks" + (", then stalled" if r.get("stalled") else "")
    if r.get("error"):
        return "FAILED: " + r["error"][:120]
    return "ok" if r.get("result_ok") else "WRONG"


def _s(t) -> str:
    return "-" if t is None else f"{t:.1f}"


def _moved_total(r: dict, key: str) -> int | None:
    spills = r.get("spills")
    if not spills:
        return None
    return sum(w.get(key, 0) for w in spills.values())


def _allocator_peak(r: dict, cap: int) -> str:
    name = r["setup"].partition("@")[0]
    if name == "emmpool" and r.get("emmpool"):
        peak = max(p.get("peak_bytes_reserved", 0) for pools in r["emmpool"].values()
                   for p in pools.values())
        return f"{gib(peak)} reserved"
    if name == "rmm-pool":
        return f"{gib(cap)} (the pool)"
    return "-"


def markdown(results: list[dict], header: dict, job: dict) -> str:
    cap, blocks, chunk, gpus = job["cap"], job["blocks"], job["chunk"], len(job["devices"])
    n = blocks * chunk
    data = n * n * 8
    lines = [
        f"## Dask with more data than the GPUs may hold, {gpus} × {header['gpu']} "
        f"(LocalCUDACluster), {header['date']}",
        "",
        f"Every setup may use {gib(cap)} GiB per GPU (its allocator's limit, and "
        f"device_memory_limit {gib(cap)} GiB, or F × that for NAME@F). The job: "
        f"X[i, j] = i − j, "
        f"{n:,}² float64 ({gib(data)} GiB, {data / (cap * gpus):.2f}× the cap of {gpus} GPUs) "
        f"in {blocks}×{blocks} chunks of {chunk * chunk * 8 / 2**20:,.0f} MiB (CuPy); Y = 2X + 1 "
        f"(Numba kernel); Z = Y·Y (CuPy); S = Z + Zᵀ (transpose shuffle), persisted; every "
        f"chunk of S checked on its worker against 8(i − j)² + 2. dask-cuda 26.10 has no "
        f"JIT-unspill: the RMM setups spill only through the DeviceHostFile, past "
        f"device_memory_limit; emmpool's also when an allocation finds the pool full (emmpool "
        f"serves Numba, CuPy and RMM, whose buffers distributed receives and unspills into).",
        "",
        "Wall: persist + check. Peak: NVML used memory of each GPU (every process, the workers' "
        "CUDA contexts included) during the job, above its value before the setup, sampled "
        "every 5 ms. To host / back to device: bytes the workers' device buffers moved during "
        "the job (both workers); on OOM: emmpool's spiller's share. A setup whose tasks failed "
        "and that then made no progress for 15 s is stopped (stalled). Versions: "
        f"{header['versions']}.",
        "",
        "| setup | device_memory_limit (GiB) | outcome | tasks failed | wall (s) | persist (s) "
        "| check (s) | peak GPU memory (GiB, per GPU) | allocator's peak (GiB) | to host (GiB) "
        "| of which on OOM (GiB) | back to device (GiB) | cluster start (s) |",
        "|---|---:|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['setup']} | | {outcome(r)} |||||||||||")
            continue
        peaks = r.get("peak") or {}
        oom = _moved_total(r, "oom_spilled_bytes") if r["setup"].startswith("emmpool") else None
        cells = [r["setup"], gib(r.get("device_memory_limit")), outcome(r),
                 str(r.get("tasks_failed", "-")), _s(r.get("wall_s")), _s(r.get("persist_s")),
                 _s(r.get("check_s")), ", ".join(gib(p) for p in peaks.values()) or "-",
                 _allocator_peak(r, cap), gib(_moved_total(r, "to_host_bytes")), gib(oom),
                 gib(_moved_total(r, "to_device_bytes")), _s(r.get("cluster_start_s"))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *goals(results)]
    notes = []
    for r in results:
        for text in r.get("task_errors", []):
            notes.append(f"- {r['setup']}: a failed task: `{text.strip().splitlines()[-1]}`")
        if r.get("error") and not r.get("task_errors"):
            notes.append(f"- {r['setup']}: {r['error']}")
    if notes:
        lines += ["", "Errors:", "", *notes]
    return "\n".join(lines + dask_workload.summaries(results)) + "\n"


def goals(results: list[dict]) -> list[str]:
    """emmpool's goals against dask-cuda's RMM pool: 0 failed tasks, no more time, no more
    peak memory."""
    done = {r["setup"]: r for r in results if outcome(r) == "ok"}
    mine = [r for r in results if r["setup"].startswith("emmpool") and "skipped" not in r]
    theirs = [r for r in results if r["setup"].startswith("rmm-pool") and "skipped" not in r]
    if not mine:
        return ["Goals: no emmpool setup ran."]
    lines = ["Goals (emmpool against dask-cuda's RMM pool: 0 failed tasks, wall time and peak "
             "GPU memory no more than the RMM pool's):", ""]
    for r in mine:
        ok = r["setup"] in done
        lines.append(f"- {r['setup']}: {outcome(r)}" + ("" if ok else " ✗"))
        for o in theirs:
            if o["setup"] not in done:
                lines.append(f"  - against {o['setup']}: it did not finish ({outcome(o)})")
                continue
            if not ok:
                continue
            wall = r["wall_s"] <= o["wall_s"]
            mine_peak = max((r.get("peak") or {0: 0}).values())
            their_peak = max((o.get("peak") or {0: 0}).values())
            lines.append(
                f"  - against {o['setup']}: wall {r['wall_s']:.1f} s vs {o['wall_s']:.1f} s "
                f"{'✓' if wall else '✗'}; peak {gib(mine_peak)} vs {gib(their_peak)} GiB "
                f"{'✓' if mine_peak <= their_peak else '✗'}")
    return lines


def sizes(cap: int, gpus: int, scale: float, chunk: int) -> int:
    """Chunks per side, so that the data is about scale x cap per GPU."""
    return max(2, round(math.sqrt(scale * cap * gpus / (chunk * chunk * 8))))


def main(argv: list[str] | None = None) -> int:
    from dask.utils import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="output directory")
    p.add_argument("--devices", help="GPUs, one worker each, e.g. 0,1 [every GPU]")
    p.add_argument("--setups", nargs="+", default=list(DEFAULT_SETUPS),
                   help=f"NAME or NAME@F, NAME one of {' '.join(SETUPS)}; F: device_memory_limit"
                        f" as a fraction of the cap [{' '.join(DEFAULT_SETUPS)}]")
    p.add_argument("--cap", default="16GiB", help="device memory per GPU, every setup [16GiB]")
    p.add_argument("--scale", type=float, default=1.5, help="data / cap per GPU [1.5]")
    p.add_argument("--chunk", type=int, default=6144,
                   help="chunk side: C x C float64 (288 MiB at 6144) [6144]")
    p.add_argument("--setup-timeout", type=float, default=90.0,
                   help="seconds a setup may take, its cluster's start and close included [90]")
    p.add_argument("--min-setup-time", type=float, default=35.0,
                   help="a setup with less time than this before the deadline is skipped [35]")
    p.add_argument("--time-limit", type=float,
                   help="seconds the whole run may take [EMMCI_BENCH_DEADLINE, else none]")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the unreported warm-up (none, a small job)")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    if args.out is None:
        p.error("--out is required")
    try:
        cap = parse_bytes(args.cap)
        for spec in args.setups:
            parse_setup(spec)
    except ValueError as e:
        p.error(str(e))
    deadline = harness.Deadline(args.time_limit, now=time.time()).at
    (args.out / "dask_spill-logs").mkdir(parents=True, exist_ok=True)
    # CUDA numbers GPUs fastest first, NVML by PCI bus: one order for both (the children and
    # their workers inherit it), so that CUDA_VISIBLE_DEVICES and NVML's indices agree.
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    gpus = nvml.gpus([int(d) for d in args.devices.split(",")] if args.devices else None)
    devices = [g.index for g in gpus]
    blocks = sizes(cap, len(devices), args.scale, args.chunk)
    job = {"devices": devices, "cap": cap, "blocks": blocks, "chunk": args.chunk}
    header = {"gpu": gpus[0].name if gpus else "?",
              "versions": dask_workload.versions(), "date": datetime.date.today().isoformat()}

    idle = [g.used() for g in gpus]
    warmup = None
    if args.warmup:
        # The first setup of a run would pay what the later ones find warm (CuPy's kernel cache
        # on disk, the driver's first contexts, imports): a small job takes it, unreported.
        print("[dask_spill] warm-up (none, a small job, not reported) ...", flush=True)
        small = {**job, "blocks": 2, "chunk": 1024, "label": "warmup-"}
        [warmup] = run_setups(["none"], small, args, gpus, idle, deadline)
    results = run_setups(args.setups, job, args, gpus, idle, deadline)
    harness.write_results(args.out, "dask_spill", {"header": header, "job": job,
                                                   "warmup": warmup, "args": vars(args),
                                                   "results": results},
                          markdown(results, header, job))
    bad = [r for r in results if (r["setup"].startswith("emmpool") and outcome(r) != "ok")
           or (r.get("check_s") is not None and not r.get("result_ok"))]
    return 1 if bad else 0


if __name__ == "__main__":
    # Imported under its own name, so that tasks name dask_spill.* and the workers import it
    # (spawned processes inherit sys.path), as dask_workload does.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dask_spill

    sys.exit(dask_spill.main())

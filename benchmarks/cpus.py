"""Pin a benchmark (and the child processes it starts, which inherit it) to a few CPUs of the
GPU's NUMA node.

Allocation benchmarks time host code of one to two microseconds per op. Left to the scheduler,
a child process may land on the other socket of a two-socket host, or migrate mid-run: on a
two-GPU host the same configuration measured 2.0 µs in one round and 4.3 µs in the next. Every
configuration pinned to the same few CPUs near the GPU keeps such moves out of the ratios.
"""

from __future__ import annotations

import os
import subprocess


def _parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}"""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_local_cpus(device: int = 0) -> set[int]:
    """The CPUs of the NUMA node of GPU `device` (by nvidia-smi's PCI bus id and sysfs), or an
    empty set if that cannot be found out."""
    try:
        bus = subprocess.run(
            ["nvidia-smi", f"--id={device}", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()
        domain, _, rest = bus.partition(":")  # 00000000:19:00.0 -> 0000:19:00.0 in sysfs
        path = f"/sys/bus/pci/devices/{domain[-4:]}:{rest}".lower() + "/local_cpulist"
        with open(path) as f:
            return _parse_cpulist(f.read())
    except (OSError, ValueError, subprocess.SubprocessError):
        return set()


def pin_near_gpu(count: int = 4, device: int = 0) -> list[int]:
    """Restrict this process to `count` CPUs of GPU `device`'s NUMA node that it may use,
    leaving out the node's first CPU (interrupts often land there). Returns the CPUs chosen;
    [] (and no change) where affinity or the GPU's node cannot be known."""
    if count <= 0 or not hasattr(os, "sched_setaffinity"):
        return []
    allowed = os.sched_getaffinity(0)
    near = sorted(gpu_local_cpus(device) & allowed)
    chosen = (near[1:] if len(near) > count else near)[:count]
    if not chosen:
        return []
    os.sched_setaffinity(0, chosen)
    return chosen


if __name__ == "__main__":
    # `python3 benchmarks/cpus.py N`: the CPUs pin_near_gpu(N) would choose, comma-separated
    # (empty if unknown), for `taskset -c` in front of a benchmark that is not Python
    # (bench_core in .ci/gpu.py).
    import sys

    print(",".join(map(str, pin_near_gpu(int(sys.argv[1]) if len(sys.argv) > 1 else 1))))

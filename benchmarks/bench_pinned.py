#!/usr/bin/env python
"""Pinned and mapped host memory through Numba: emmpool's pinned cache against anchors.

    python benchmarks/bench_pinned.py --out DIR [--quick]

The pinned suite of bench_numba.py (same children, rounds and table; see benchmarks/README.md):
``cuda.pinned_array`` / ``cuda.mapped_array`` + ``del`` at 4 KiB, 1 MiB and 64 MiB, and a pinned
staging buffer dropped while its copy runs, under Numba's own allocator, CuPy's pinned-memory
pool, the allocate-nothing floor and emmpool (EMMPOOL_PINNED=pool). Writes DIR/bench_pinned.json
and DIR/bench_pinned.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_numba  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_numba.main(["--suite", "pinned", *sys.argv[1:]]))

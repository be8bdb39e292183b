#!/usr/bin/env python
"""Pinned and mapped host memory through Numba: emmpool's pinned cache against anchors.

    python benchmarks/bench_pinned.py --out DIR [--quick]

The pinned suite of bench_numba.py (same children, rounds and table; benchmarks/README.md says
what it times). Writes DIR/bench_pinned.json and DIR/bench_pinned.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_numba  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_numba.main(["--suite", "pinned", *sys.argv[1:]]))

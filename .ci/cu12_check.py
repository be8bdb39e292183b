#!/usr/bin/env python3
"""Is the CUDA 12 stack in force? (.ci/gpu.py --cuda 12, step cuda12; needs no GPU.)

    python3 .ci/cu12_check.py [--site DIR]

Imports cuda.bindings (it must be 12.x) and asks each CUDA library the stack uses for its
version: cudart, NVRTC, NVVM (the release that compiled a kernel to PTX through Numba) and
nvJitLink. Then it
reads which files of those libraries this process loaded (/proc/self/maps) and says, for each,
whether it came from DIR (the CUDA 12 site the run carried, default /tmp/site-cu12) or from the
host: a library not carried is found where cuda-pathfinder finds it, a CUDA 13 host's own
(.ci/cu12_sitecustomize.py). The last line starts "CUDA 12 stack:" and sums it up.

Exit status 0 when cuda.bindings is 12.x and no library is loaded twice (two major versions of
one library in one process); 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import sys

LIBRARIES = {"cudart": "libcudart.so", "NVRTC": "libnvrtc.so", "NVVM": "libnvvm.so",
             "nvJitLink": "libnvJitLink.so"}


def loaded_files() -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if "/" in line.split()[-1]})


def versions() -> dict[str, str]:
    """What each library says of itself ("?: why" when it cannot be asked)."""
    out = {}
    try:
        from cuda.bindings import runtime

        err, v = runtime.cudaRuntimeGetVersion()
        out["cudart"] = f"{v // 1000}.{v % 1000 // 10}" if v else f"? ({err})"
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["cudart"] = f"? ({type(e).__name__}: {e})"
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        out["NVRTC"] = f"{major}.{minor}"
    except Exception as e:  # noqa: BLE001
        out["NVRTC"] = f"? ({type(e).__name__}: {e})"
    try:
        from numba import cuda

        def inc(a):
            i = cuda.grid(1)
            if i < a.size:
                a[i] += 1

        # A compute capability of its own: no device is asked (and both CUDA 12 and 13 have it)
        ptx, _ = cuda.compile_ptx(inc, "void(float64[:])", cc=(7, 5))
        release = re.search(r"^// Cuda compilation tools, release (\S+?),", ptx, re.M)
        ptx_version = re.search(r"^\.version (\S+)", ptx, re.M)
        out["NVVM"] = release[1] if release else "?"
        out["PTX"] = ptx_version[1] if ptx_version else "?"
    except Exception as e:  # noqa: BLE001
        out["NVVM"] = f"? ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    try:
        from cuda.bindings import nvjitlink

        out["nvJitLink"] = ".".join(map(str, nvjitlink.version()))
    except Exception as e:  # noqa: BLE001
        out["nvJitLink"] = f"? ({type(e).__name__}: {e})"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", default="/tmp/site-cu12")
    site = os.path.realpath(ap.parse_args().site) + os.sep

    import cuda.bindings

    bindings = md.version("cuda-bindings")
    where = os.path.dirname(cuda.bindings.__file__)
    print(f"cuda-bindings {bindings} from {where}")
    for dist in ("numba-cuda", "cuda-core", "cuda-pathfinder", "cupy-cuda12x", "rmm-cu12"):
        try:
            print(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            print(f"{dist} -")
    found = versions()
    files = loaded_files()
    summary, twice = [f"cuda-bindings {bindings}"], []
    for name, stem in LIBRARIES.items():
        paths = [p for p in files if os.path.basename(p).startswith(stem)]
        for path in paths:
            print(f"{name}: {path}")
        origin = ("carried" if paths and all(os.path.realpath(p).startswith(site) for p in paths)
                  else "host's" if paths else "not loaded")
        if len(paths) > 1:
            twice.append(name)
        summary.append(f"{name} {found.get(name, '?')} ({origin})")
    summary.append(f"PTX .version {found.get('PTX', '?')}")
    ok = bindings.startswith("12.") and not twice
    if not bindings.startswith("12."):
        print(f"cuda.bindings is {bindings}, not 12.x: the CUDA 12 site is not first on "
              f"PYTHONPATH (or carries no cuda-bindings 12)")
    if twice:
        print(f"loaded twice (two major versions in one process): {', '.join(twice)}")
    print("CUDA 12 stack: " + "; ".join(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

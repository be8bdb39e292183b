"""sitecustomize of the CUDA 12 site directory of `.ci/gpu.py --cuda 12` (copied there as
sitecustomize.py; that directory is first on PYTHONPATH, so every Python process of the run
loads this at startup).

It loads the CUDA 12 libraries carried in this directory (cudart, nvJitLink, NVRTC, NVVM) before
anything asks for them. cuda-bindings and numba-cuda find them through cuda-pathfinder, which
looks first for a library already loaded, then in site-packages, where a CUDA 13 host has its
own (libnvrtc.so.13 ahead of libnvrtc.so.12, whatever the bindings): loaded here first, the
CUDA 12 ones are those found. A library not carried is left to that search (.ci/cu12_check.py
says where each one came from). Then the sitecustomize this one shadows, if any, runs.
"""

import ctypes
import glob
import os
import runpy
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARIES = (
    "nvidia/cuda_runtime/lib/libcudart.so.12",
    "nvidia/nvjitlink/lib/libnvJitLink.so.12",
    "nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.*",
    "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
    "nvidia/cuda_nvcc/nvvm/lib64/libnvvm.so",
)


def _preload() -> None:
    for pattern in LIBRARIES:
        for path in sorted(glob.glob(os.path.join(_HERE, pattern)))[-1:]:
            try:
                ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
            except OSError as e:  # said, not fatal: the check step reports what loaded
                print(f"cu12 sitecustomize: cannot load {path}: {e}", file=sys.stderr)


def _chain() -> None:
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == _HERE:
            continue
        shadowed = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(shadowed):
            runpy.run_path(shadowed, run_name="sitecustomize")
            return


_preload()
_chain()

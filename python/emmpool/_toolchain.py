"""What building emmpool's extensions on the user's machine needs from the CUDA toolkit, found
once for both (the PyTorch extension, emmpool._torch; the native RMM resource, emmpool._rmm)."""

from __future__ import annotations

import shutil
from pathlib import Path


def cuda_home(*guesses: str | None) -> Path | None:
    """The first of `guesses`, nvcc's real folder (nvcc is often a link:
    /usr/local/bin/nvcc -> /usr/local/cuda/bin/nvcc) and /usr/local/cuda that holds
    include/cuda_runtime_api.h; None if none does."""
    candidates = [g for g in guesses if g]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if (Path(c) / "include" / "cuda_runtime_api.h").exists():
            return Path(c)
    return None

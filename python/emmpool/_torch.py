"""emmpool as PyTorch's CUDA allocator.

Two ways, chosen by ``EMMPOOL_TORCH_ALLOCATOR`` (or ``use_for_torch(allocator=...)``):

``extension`` (the default where it can be built)
    A small C++ PyTorch extension shipped as source (``torch_extension/``, from the repository's
    ``cpp/torch/``), compiled on first use against the installed PyTorch with
    ``torch.utils.cpp_extension.load`` (cached in PyTorch's
    extension directory, ``TORCH_EXTENSIONS_DIR``; needs a C++ compiler, ninja and the CUDA
    toolkit's headers, ``CUDA_HOME``). It implements PyTorch's allocator interface over emmpool's
    C entry points: ``record_stream``, ``torch.cuda.memory_stats()`` and friends, cuDNN's benchmark
    mode, ``torch.multiprocessing`` of CUDA tensors, CUDA graph private pools and
    ``torch.cuda.empty_cache()`` all work.
``pluggable``
    PyTorch's ``CUDAPluggableAllocator`` over the same entry points (no compiler needed). PyTorch
    then raises "does not yet support ..." for ``memory_stats()``, cuDNN's benchmark mode and
    IPC, and ``tensor.record_stream`` is ignored; see README's PyTorch section.
``auto`` (default)
    The extension; where it cannot be built, a warning saying why and the pluggable allocator.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import warnings
from pathlib import Path

from . import _config, _core, _toolchain
from ._config import ensure_configured, log

EXTENSION = Path(__file__).with_name("torch_extension")
SOURCE = EXTENSION / "allocator.cpp"
# emmpool/torch_api.h, the C interface it shares with _core, and the core's headers it includes
INCLUDE = EXTENSION / "include"
# What SOURCE includes: part of the build cache's key with it.
HEADERS = (*(EXTENSION / f"{part}.hpp"
             for part in ("entry_points", "pool_routes", "history", "snapshot", "ipc")),
           *(INCLUDE / "emmpool" / name for name in ("torch_api.h", "round_up.hpp")))
CHOICES = _config.TORCH_ALLOCATORS
# After PyTorch's own flags. No -std: PyTorch passes the standard its headers need (C++17 up to
# 2.11, C++20 from 2.12; 2.14's headers fail in C++17), which one here would override
# (.ci/torch-compat compiles the source with these against several releases' headers).
EXTRA_CFLAGS = ["-O2"]

_installed: list = []  # the allocator object(s) PyTorch was given, kept alive
_how: str | None = None  # "extension" or "pluggable" once installed


class TorchExtensionError(RuntimeError):
    """emmpool's PyTorch extension cannot be built or loaded here (the message says why)."""


def how_installed() -> str | None:
    """``"extension"``, ``"pluggable"`` or None: how emmpool serves PyTorch in this process."""
    return _how


def _choice(allocator: str | None) -> str:
    """``allocator`` checked, else the configuration's (``EMMPOOL_TORCH_ALLOCATOR``,
    ``configure(torch_allocator=...)``)."""
    if allocator is None:
        return _config.config().torch_allocator
    return _config.parse_torch_allocator(allocator, "allocator")


def _build_problem() -> str | None:
    """Why the extension cannot be compiled here, or None."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} is not on PATH; set CXX)"
    home = _toolchain.cuda_home(cpp_extension.CUDA_HOME)
    if home is None:
        if cpp_extension.CUDA_HOME is None:
            return "no CUDA toolkit found (set CUDA_HOME; its headers are needed)"
        return f"CUDA_HOME={cpp_extension.CUDA_HOME} has no include/cuda_runtime_api.h"
    # PyTorch guesses CUDA_HOME from nvcc's folder, which is wrong where nvcc is a link
    # (/usr/local/bin/nvcc -> /usr/local/cuda/bin/nvcc): give it the toolkit that has the headers.
    cpp_extension.CUDA_HOME = str(home)
    return None


def extension_name(torch) -> str:
    """The module's name: one per emmpool source, flags and PyTorch version (the build cache
    key)."""
    text = b"".join(f.read_bytes() for f in (SOURCE, *HEADERS))
    digest = hashlib.sha256(text + repr(EXTRA_CFLAGS).encode()).hexdigest()[:12]
    version = torch.__version__.split("+")[0].replace(".", "_")
    return f"emmpool_torch_{version}_{digest}"


def build_extension(verbose: bool = False):
    """Compile (or load from the cache) emmpool's PyTorch extension and return the module.

    Raises TorchExtensionError saying what is missing or what the compiler said."""
    import torch
    from torch.utils import cpp_extension

    problem = _build_problem()
    if problem is not None:
        raise TorchExtensionError(f"emmpool's PyTorch extension cannot be built: {problem}")
    # The extension has no CUDA kernels, but cpp_extension asks for an architecture list even so,
    # and finds none without a GPU (a build machine): any value does.
    arch_was = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not arch_was:
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    try:
        name = extension_name(torch)
        with _build_lock(cpp_extension, name, verbose):
            return cpp_extension.load(
                name=name,
                sources=[str(SOURCE)],
                extra_include_paths=[str(INCLUDE)],
                extra_cflags=EXTRA_CFLAGS,
                with_cuda=True,
                verbose=verbose,
            )
    except Exception as e:  # noqa: BLE001 - the compiler's message is the useful part
        raise TorchExtensionError(
            f"emmpool's PyTorch extension did not build against torch {torch.__version__}: "
            f"{str(e).strip()[-2000:]}"
        ) from e
    finally:
        if not arch_was:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


@contextlib.contextmanager
def _build_lock(cpp_extension, name: str, verbose: bool):
    """Serialize emmpool's builds on an OS lock (released by the kernel when its holder dies),
    and remove the ``lock`` file a killed build left behind: PyTorch 2.9-2.11's FileBaton waits
    for it forever (pytorch/pytorch#189245), so one build killed by the OOM killer, Slurm or a
    timeout would hang every later ``use_for_torch()``. Under the OS lock no other emmpool build
    runs, so a baton file there is stale."""
    get_dir = getattr(cpp_extension, "_get_build_directory", None)
    if get_dir is None:
        yield
        return
    build_dir = get_dir(name, verbose)
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "emmpool-build.flock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(build_dir, "lock"))
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def use_for_torch(allocator: str | None = None) -> str:
    """Install emmpool as PyTorch's CUDA allocator; return how (``"extension"`` or
    ``"pluggable"``). Must run before PyTorch's first CUDA allocation."""
    global _how
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "emmpool.use_for_torch() needs PyTorch: pip install 'emmpool[torch]'"
        ) from e
    choice = _choice(allocator)
    ensure_configured()
    if _how is not None:
        return _how
    if choice in ("auto", "extension"):
        try:
            module = build_extension()
        except TorchExtensionError as e:
            if choice == "extension":
                raise
            warnings.warn(
                f"{e}; emmpool falls back to PyTorch's CUDAPluggableAllocator, under which "
                "torch.cuda.memory_stats(), cuDNN's benchmark mode, torch.multiprocessing of "
                "CUDA tensors and tensor.record_stream do not work (EMMPOOL_TORCH_ALLOCATOR="
                "pluggable silences this)",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            module.install(_core.__file__)
            _installed.append(module)
            _how = "extension"
            log.info("PyTorch %s: emmpool's allocator extension %s", torch.__version__,
                     module.__name__)
            return _how
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(
        _core.__file__, "emmpool_torch_malloc", "emmpool_torch_free"
    )
    torch.cuda.memory.change_current_allocator(pluggable)
    _installed.append(pluggable)
    _how = "pluggable"
    log.info("PyTorch %s: CUDAPluggableAllocator", torch.__version__)
    return _how


def torch_snapshot(augment: bool = True) -> dict:
    """``torch.cuda.memory._snapshot()`` under emmpool's extension, with every block another
    library holds in the shared pool named: ``"library"`` (``"numba"``, ``"cupy"``,
    ``"cuda_core"``, ...) and one frame that says so, which PyTorch's viewer
    (https://pytorch.org/memory_viz) shows. PyTorch's own blocks keep the stacks its memory
    history recorded. ``augment=False``: PyTorch's snapshot as it is."""
    import torch

    if _how != "extension":
        raise RuntimeError("emmpool.torch_snapshot() needs emmpool's PyTorch extension installed "
                           "(emmpool.use_for_torch() returned "
                           f"{_how!r}): PyTorch's pluggable allocator takes no snapshot")
    snapshot = torch.cuda.memory._snapshot()
    if not augment:
        return snapshot
    module = _installed[0]
    owners: dict[int, dict[int, str]] = {}
    for segment in snapshot["segments"]:
        device = segment["device"]
        if device not in owners:
            owners[device] = dict(module.block_libraries(device))
        address = segment["address"]
        for block in segment["blocks"]:
            library = owners[device].get(address, "torch") if block["state"] != "inactive" else None
            if library is not None:
                block["library"] = library
                if library != "torch" and not block.get("frames"):
                    block["frames"] = [{"filename": f"<{library}>", "line": 0,
                                        "name": f"allocated by {library} from emmpool's pool"}]
            address += block["size"]
    return snapshot


def dump_torch_snapshot(filename: str = "dump_snapshot.pickle") -> None:
    """:func:`torch_snapshot`, pickled as ``torch.cuda.memory._dump_snapshot()`` writes it (for
    https://pytorch.org/memory_viz or ``python -m torch.cuda._memory_viz``)."""
    import pickle

    snapshot = torch_snapshot()  # first: where there is none to take, no file is left behind
    with open(filename, "wb") as f:
        pickle.dump(snapshot, f)

"""The packages that provide Numba's CUDA target, and where each keeps the EMM interface.

numba-cuda (``numba.cuda``) and its successor numba-cuda-mlir (``numba_cuda_mlir.cuda``, which
does not depend on ``numba``) carry the same External Memory Management layer, version 1:
``HostOnlyCUDAMemoryManager``, ``GetIpcHandleMixin``, ``MemoryPointer``, ``IpcHandle``, ...,
``set_memory_manager`` and the ``_memory_manager`` global it sets, which a context reads when it is
made. Each has them in its own module, so a process with both has two of each. This module is
the one place that knows those modules and the names emmpool takes from them; the plugin
(``plugin.py``) builds one manager class per package from them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from types import SimpleNamespace

__all__ = ["NUMBA_CUDA", "NUMBA_CUDA_MLIR", "PACKAGES", "Package", "by_name", "emm_api",
           "installed", "missing_error", "of_module"]


@dataclass(frozen=True)
class Package:
    """One package that provides Numba's CUDA target."""

    name: str    # the distribution, as pip spells it
    extra: str   # emmpool's extra that installs it: pip install "emmpool[<extra>]"
    root: str    # its top-level import package: how the __name__ of its modules starts
    probe: str   # a top-level module that only this package installs (found without importing)
    cuda: str    # the module its users import as ``cuda``
    driver: str  # the module that holds its EMM interface and its _memory_manager global


# numba-cuda's modules are numba.cuda.*, but ``numba`` alone (0.68 still ships a built-in
# numba.cuda) does not make numba-cuda: its own top-level ``numba_cuda`` does.
NUMBA_CUDA = Package("numba-cuda", "numba", "numba", "numba_cuda", "numba.cuda",
                     "numba.cuda.cudadrv.driver")
NUMBA_CUDA_MLIR = Package("numba-cuda-mlir", "numba-mlir", "numba_cuda_mlir", "numba_cuda_mlir",
                          "numba_cuda_mlir.cuda", "numba_cuda_mlir.numba_cuda.cudadrv.driver")
# In order of preference where a caller does not say which (numba-cuda: today's users).
PACKAGES = (NUMBA_CUDA, NUMBA_CUDA_MLIR)

# What the plugin takes from a package's driver module. numba-cuda 0.30 and numba-cuda-mlir 0.6
# spell every one the same (their EMM layers are the same code); a package that renames one
# is mapped here, and nowhere else.
_EMM_NAMES = (
    "BaseCUDAMemoryManager", "HostOnlyCUDAMemoryManager", "GetIpcHandleMixin",
    "set_memory_manager", "Context", "MemoryPointer", "MemoryInfo", "IpcHandle",
    "MappedMemory", "PinnedMemory", "CudaAPIError",
    "binding",  # cuda.bindings.driver, as the package imported it (CUresult, CUipcMemHandle)
)


def installed() -> tuple[Package, ...]:
    """The packages installed, in order of preference; none is imported to find out."""
    return tuple(p for p in PACKAGES if _findable(p.probe))


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that cannot be imported; a broken entry
        return False


def of_module(module_name: str) -> Package | None:
    """The package a module belongs to (by its ``__name__``), or None."""
    root = module_name.partition(".")[0]
    return next((p for p in PACKAGES if p.root == root), None)


def by_name(name: str) -> Package:
    """The package named ``name`` ("numba-cuda" or "numba-cuda-mlir")."""
    for p in PACKAGES:
        if p.name == name:
            return p
    raise ValueError(f"unknown package {name!r}: expected one of "
                     f"{', '.join(repr(p.name) for p in PACKAGES)}")


@functools.cache
def emm_api(package: Package) -> SimpleNamespace:
    """The package's EMM names (imports its driver module), plus ``driver``: that module.

    Raises ImportError saying what to install when the package is missing."""
    try:
        driver = importlib.import_module(package.driver)
    except ImportError as e:
        raise ImportError(f"{package.name} is not installed (importing {package.driver} failed: "
                          f"{e}); install it with: pip install 'emmpool[{package.extra}]'") from e
    return SimpleNamespace(driver=driver, **{n: getattr(driver, n) for n in _EMM_NAMES})


def missing_error() -> ImportError:
    """What to raise when no package provides Numba's CUDA target."""
    choices = " or ".join(f"{p.name} (pip install 'emmpool[{p.extra}]')" for p in PACKAGES)
    return ImportError(f"emmpool's Numba plugin needs {choices}; neither is installed")

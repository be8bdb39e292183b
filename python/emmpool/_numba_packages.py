"""The packages that provide Numba's CUDA target, and where each keeps the EMM interface.

numba-cuda (``numba.cuda``) and its successor numba-cuda-mlir (``numba_cuda_mlir.cuda``, which
does not depend on ``numba``) carry the same External Memory Management layer, version 1:
``HostOnlyCUDAMemoryManager``, ``GetIpcHandleMixin``, ``MemoryPointer``, ``IpcHandle``, ...,
``set_memory_manager`` and the ``_memory_manager`` global it sets, which a context reads when it is
made. Each has them in its own module, so a process with both has two of each. This module is
the one place that knows those modules and the names emmpool takes from them, and the releases
of each that emmpool is tested with; the plugin (``plugin.py``) builds one manager class per
package from them.

A package older than its ``minimum`` is refused (ImportError, saying how to upgrade); one of a
newer minor series than ``tested`` is used, with an :class:`UntestedVersionWarning` (once): the
EMM layer is a private part of each package and may change in any release.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import threading
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

__all__ = ["NUMBA_CUDA", "NUMBA_CUDA_MLIR", "PACKAGES", "Package", "UntestedVersionWarning",
           "by_name", "check_version", "emm_api", "installed", "installed_version",
           "missing_error", "of_module", "version_problem"]


@dataclass(frozen=True)
class Package:
    """One package that provides Numba's CUDA target."""

    name: str    # the distribution, as pip spells it
    extra: str   # emmpool's extra that installs it: pip install "emmpool[<extra>]"
    root: str    # its top-level import package: how the __name__ of its modules starts
    probe: str   # a top-level module that only this package installs (found without importing)
    cuda: str    # the module its users import as ``cuda``
    driver: str  # the module that holds its EMM interface and its _memory_manager global
    minimum: str  # the oldest release emmpool works with: an older one is refused
    tested: str   # the minor series emmpool is tested with ("0.30"): a newer one gets a warning

    @property
    def next_series(self) -> str:
        """The first minor series newer than ``tested`` ("0.31")."""
        major, minor = _release(self.tested)[:2]
        return f"{major}.{minor + 1}"


# numba-cuda's modules are numba.cuda.*, but ``numba`` alone (0.68 still ships a built-in
# numba.cuda) does not make numba-cuda: its own top-level ``numba_cuda`` does.
NUMBA_CUDA = Package("numba-cuda", "numba", "numba", "numba_cuda", "numba.cuda",
                     "numba.cuda.cudadrv.driver", minimum="0.30.4", tested="0.30")
NUMBA_CUDA_MLIR = Package("numba-cuda-mlir", "numba-mlir", "numba_cuda_mlir", "numba_cuda_mlir",
                          "numba_cuda_mlir.cuda", "numba_cuda_mlir.numba_cuda.cudadrv.driver",
                          minimum="0.6.0", tested="0.6")
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


# ---- versions --------------------------------------------------------------------------------
class UntestedVersionWarning(RuntimeWarning):
    """A package that provides Numba's CUDA target is newer than the releases emmpool is
    tested with: it is used, but its (private) EMM layer may have changed."""


def _release(version: str) -> tuple[int, ...] | None:
    """The release numbers a version starts with ("0.31.0rc1" -> (0, 31, 0)), or None."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(n) for n in m.group().split(".")) if m else None


def _at_least(release: tuple[int, ...], minimum: tuple[int, ...]) -> bool:
    width = max(len(release), len(minimum))  # 0.30 is 0.30.0
    return release + (0,) * (width - len(release)) >= minimum + (0,) * (width - len(minimum))


def installed_version(package: Package) -> str | None:
    """The installed distribution's version, from its metadata; None where it has none (a
    source tree on sys.path, say)."""
    import importlib.metadata  # here: a tenth of `import emmpool`'s time, for the plugin only

    try:
        return importlib.metadata.version(package.name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_problem(package: Package, version: str) -> str | None:
    """What is wrong with ``version`` of ``package`` for emmpool, in a few words; None when it
    is in the tested range."""
    release = _release(version)
    tested = f"emmpool is tested with {package.tested}.x"
    if release is None:
        return f"an unreadable version; {tested}"
    if not _at_least(release, _release(package.minimum)):
        return f"too old: emmpool needs {package.minimum} or later"
    if _at_least(release, _release(package.next_series)):
        return f"untested: {tested}"
    return None


_warned: set[str] = set()
_warned_lock = threading.Lock()


def check_version(package: Package) -> None:
    """Refuse a release of ``package`` older than its minimum (ImportError saying which is
    installed, which is needed and how to upgrade); warn once (:class:`UntestedVersionWarning`)
    for one newer than the tested series. A package whose version cannot be known passes."""
    version = installed_version(package)
    if version is None or version_problem(package, version) is None:
        return
    tested_range = f"{package.name}>={package.minimum},<{package.next_series}"
    release = _release(version)
    if release is not None and not _at_least(release, _release(package.minimum)):
        raise ImportError(
            f"{package.name} {version} is installed, but emmpool's Numba plugin needs "
            f"{package.name} {package.minimum} or later (it is tested with "
            f"{package.tested}.x): upgrade it with: pip install '{tested_range}'")
    with _warned_lock:
        if package.name in _warned:
            return
        _warned.add(package.name)  # before warning: where warnings are errors, still only once
    from ._config import caller_outside_emmpool

    warnings.warn(
        f"emmpool was tested with {package.name} {package.tested}.x; {version} is installed: "
        f"emmpool uses it, but if Numba's memory management misbehaves, install a tested "
        f"release (pip install '{tested_range}')", UntestedVersionWarning,
        stacklevel=caller_outside_emmpool())


@functools.cache
def emm_api(package: Package) -> SimpleNamespace:
    """The package's EMM names (imports its driver module), plus ``driver``: that module.

    Checks the package's version first (:func:`check_version`). Raises ImportError saying what
    to install when the package is missing or too old."""
    check_version(package)
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

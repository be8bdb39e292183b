"""emmpool's native RMM resource: built on first use against the RMM installed here, cached.

RMM's C++ callers (libcudf, ``rmm::device_buffer``, every ``resource_ref``) allocate through a
device's resource with no Python on the way; a resource built on Python callbacks
(``rmm.mr.CallbackMemoryResource``) takes the GIL and runs Python for each of their
allocations. The native one (``rmm_resource/``: ``resource.hpp``, a C++ class over _core's C
table ``emmpool/rmm_api.h``, and ``emmpool_rmm.pyx``, the Cython glue that makes it an
``rmm.mr.DeviceMemoryResource``) is compiled here because RMM's C++ symbols are versioned per
release: it must match the RMM installed, as the PyTorch extension matches PyTorch.

Supported: RMM 26.06 and later (older: the callback resource). What the build needs: Cython
(``pip install 'emmpool[rmm]'`` brings it), a C++20 compiler (``$CXX``, else ``c++``), RMM's
wheels (headers and ``librmm.so``) and the CUDA runtime's headers (a CUDA toolkit found by
``$CUDA_HOME``, ``$CUDA_PATH``, ``nvcc`` on ``PATH`` or ``/usr/local/cuda``; or the
``nvidia-cuda-runtime`` wheel). The module is cached under
``$EMMPOOL_RMM_CACHE`` (default ``~/.cache/emmpool/rmm``), one per source, RMM version and
Python, and built once under a file lock (several processes starting at once build it once).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from . import _core, _toolchain
from ._config import log

SOURCES = Path(__file__).with_name("rmm_resource")
PYX = SOURCES / "emmpool_rmm.pyx"
HEADERS = (SOURCES / "resource.hpp", SOURCES / "include" / "emmpool" / "rmm_api.h")
MODULE = "emmpool_rmm"  # the Cython module's name (its init function's)
# RMM's resources satisfy CCCL's cuda::mr concepts, and DeviceMemoryResource holds a
# resource_ref, from this release on; tests/test_rmm_native.py builds against the installed one.
OLDEST = (26, 6)
CXXFLAGS = ["-O2", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden"]
# The distributions RMM comes in: the CUDA 13 and CUDA 12 wheels share version numbers, and a
# conda or source install is "rmm".
RMM_DISTRIBUTIONS = ("rmm-cu13", "rmm-cu12", "rmm")


class RmmBuildError(RuntimeError):
    """The native RMM resource cannot be built or loaded here (the message says why)."""


_module = None  # the loaded module, once


def module():
    """The native resource's module (built or taken from the cache on the first call).

    Raises RmmBuildError saying what is missing or what the compiler said."""
    global _module
    if _module is None:
        _module = _load(_build())
    return _module


def resource(device: int):
    """A new native resource over ``device``'s pool (an ``rmm.mr.DeviceMemoryResource``)."""
    return module().EmmpoolMemoryResource(device, _core._rmm_api())


def cache_dir() -> Path:
    where = os.environ.get("EMMPOOL_RMM_CACHE")
    if where:
        return Path(where)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "emmpool" / "rmm"


def _rmm_parts():
    """(RMM's version, its .pxd files' root, librmm's include and lib directories,
    rapids_logger's include): all of the RMM this process imports."""
    try:
        import librmm
        import rapids_logger
        import rmm
    except ImportError as e:
        raise RmmBuildError(f"RMM is not importable: {e}") from None
    if _release(rmm.__version__) < OLDEST:
        raise RmmBuildError(
            f"RMM {rmm.__version__} predates {OLDEST[0]}.{OLDEST[1]:02}, the first release whose "
            f"resources the native one is built for (pip install 'rmm-cu13>=26.6')")
    include = Path(librmm.__file__).parent / "include"
    lib = Path(librmm.__file__).parent / "lib64"
    logger = Path(rapids_logger.__file__).parent / "include"
    missing = [str(p) for p in (include / "rmm", lib / "librmm.so", logger) if not p.exists()]
    if missing:
        raise RmmBuildError(f"RMM's wheels lack {', '.join(missing)} (a conda or source build of "
                            f"RMM keeps them elsewhere: set CPATH and LIBRARY_PATH)")
    return rmm.__version__, Path(rmm.__file__).parent.parent, include, lib, logger


def _release(version: str) -> tuple[int, int]:
    """(year, month) of an RMM version ("26.06.00", "26.10.00a5")."""
    try:
        year, month = version.split(".")[:2]
        return int(year), int("".join(c for c in month if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


def _cuda_include() -> Path:
    """The directory holding cuda_runtime_api.h."""
    home = _toolchain.cuda_home(os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"))
    if home is not None:
        return home / "include"
    for site in map(Path, sys.path):  # the nvidia-cuda-runtime wheel
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
            if (site / sub / "cuda_runtime_api.h").exists():
                return site / sub
    raise RmmBuildError("no CUDA runtime headers (cuda_runtime_api.h): install a CUDA toolkit "
                        "and set CUDA_HOME, or pip install nvidia-cuda-runtime")


def _key(version: str) -> str:
    """The sources, flags, RMM (its distribution: rmm-cu12 and rmm-cu13 share versions),
    Python and compiler a build depends on."""
    try:
        text = b"".join(p.read_bytes() for p in (PYX, *HEADERS))
    except OSError as e:
        raise RmmBuildError(f"emmpool's RMM resource sources are missing ({e}): reinstall "
                            "emmpool") from None
    text += repr((CXXFLAGS, version, _rmm_distributions(), sys.implementation.cache_tag,
                  _compiler_identity())).encode()
    return hashlib.sha256(text).hexdigest()[:16]


def _rmm_distributions() -> list[str]:
    """The RMM distributions installed, of those that ship it (each asked by name: scanning
    every distribution would cost a process a quarter second at its first RMM use)."""
    from importlib import metadata

    found = []
    for name in RMM_DISTRIBUTIONS:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return found


def _compiler() -> list[str]:
    """The C++ compiler's command ($CXX, which may carry a wrapper: "ccache g++")."""
    return shlex.split(os.environ.get("CXX") or "c++") or ["c++"]


def _compiler_identity() -> str:
    """The compiler's first line of --version (a module built by a newer compiler may need a
    newer C++ runtime than another machine sharing the cache has); "" if it will not say."""
    try:
        p = subprocess.run([*_compiler(), "--version"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (p.stdout.splitlines() or [""])[0]


def _suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def _target(version: str) -> Path:
    """Where the module built against RMM `version` is kept."""
    return cache_dir() / f"{MODULE}-{version}-{_key(version)}" / f"{MODULE}{_suffix()}"


def readiness() -> str | None:
    """What this process would give RMM, in a line (``python -m emmpool info``), with nothing
    built: the native resource (already built, or to be built on first use) or, with the
    reason, the callback resource; None where RMM is not installed."""
    try:
        import rmm  # noqa: F401
    except ImportError:
        return None
    try:
        target = _target(_rmm_parts()[0])
        if target.exists():
            return f"native resource, built in {target.parent}"
        _tools()
    except RmmBuildError as e:
        return f"callback resource: {str(e).splitlines()[0]}"
    return "native resource, to be built on first use (about 10 s) and cached"


def _tools() -> tuple[list[str], Path]:
    """(the C++ compiler, the CUDA runtime's headers) a build uses, Cython being there.
    Raises RmmBuildError naming the first that is missing."""
    if importlib.util.find_spec("Cython") is None:
        raise RmmBuildError("Cython is not installed: pip install 'emmpool[rmm]' (or cython)")
    cxx = _compiler()
    if shutil.which(cxx[0]) is None:
        raise RmmBuildError(f"no C++ compiler ({' '.join(cxx)}): install one, or set CXX")
    return cxx, _cuda_include()


def _build() -> Path:
    """The module's path in the cache, built there first if it is not."""
    version, pxd, include, lib, logger = _rmm_parts()
    target = _target(version)
    where = target.parent
    if target.exists():
        return target
    try:
        where.mkdir(parents=True, exist_ok=True)
        with open(where / "build.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
            if not target.exists():  # another process may have built it meanwhile
                _compile(target, pxd, include, lib, logger)
    except OSError as e:  # a cache that cannot be written: full, read-only, not ours
        raise RmmBuildError(f"cannot build in the cache {where}: {e} (set EMMPOOL_RMM_CACHE)"
                            ) from None
    return target


def _compile(target: Path, pxd: Path, include: Path, lib: Path, logger: Path) -> None:
    cxx, cuda = _tools()
    log.info("building emmpool's native RMM resource into %s (once: it is cached)", target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp)
        for f in (PYX, SOURCES / "resource.hpp"):
            shutil.copy(f, work / f.name)
        cpp = work / f"{MODULE}.cpp"
        _run([sys.executable, "-m", "cython", "--cplus", "-3", f"-I{pxd}",
              str(work / PYX.name), "-o", str(cpp)], "Cython")
        out = work / target.name
        _run([*cxx, *CXXFLAGS, str(cpp), "-o", str(out),
              f"-I{work}", f"-I{SOURCES / 'include'}", f"-I{include}", f"-I{include / 'rapids'}",
              f"-I{logger}", f"-I{cuda}", f"-I{sysconfig.get_paths()['include']}",
              f"-L{lib}", "-lrmm", f"-Wl,-rpath,{lib}"], "the C++ compiler")
        os.replace(out, target)  # whole or not at all, for the next process


def _run(cmd: list[str], who: str) -> None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RmmBuildError(f"{who} could not run: {e}") from None
    if p.returncode != 0:
        said = (p.stderr or p.stdout).strip()
        raise RmmBuildError(f"{who} failed building emmpool's native RMM resource "
                            f"({' '.join(cmd[:3])} ...):\n{said[-3000:]}")


def _load(path: Path):
    import rmm.mr  # noqa: F401 - loads librmm and the types the module subclasses first

    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        raise RmmBuildError(f"cannot load {path}")
    try:
        mod = importlib.util.module_from_spec(spec)  # dlopen: a file cut short fails here
        spec.loader.exec_module(mod)
    except (ImportError, ValueError) as e:  # ValueError: Cython's "size changed" check
        with contextlib.suppress(OSError):
            path.unlink()  # cut short, or built against another RMM: rebuilt on the next try
        raise RmmBuildError(f"emmpool's native RMM resource would not load: {e}") from None
    return mod

"""``python -m emmpool info``: the first thing to run when something is off.

Says what is in force and why: the configuration and where each value came from, the driver
(found, or why not), the devices, the versions of the libraries emmpool works with, and which
of them allocate from emmpool.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import textwrap
import warnings
from pathlib import Path
from typing import TextIO

from . import __version__, _config, _core, _installed, _numba_packages, _rmm
from ._args import format_bytes

# (name shown, distributions that provide it, first installed wins)
_LIBRARIES = [
    ("numba-cuda", ("numba-cuda",)),
    ("numba", ("numba",)),
    ("numba-cuda-mlir", ("numba-cuda-mlir",)),
    ("cuda-bindings", ("cuda-bindings",)),
    ("cuda-core", ("cuda-core",)),
    ("numpy", ("numpy",)),
    ("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")),
    ("torch", ("torch",)),
    ("rmm", ("rmm-cu13", "rmm-cu12", "rmm")),
    ("dask", ("dask",)),
    ("dask-cuda", ("dask-cuda",)),
]
_NUMBA_PACKAGES = {p.name: p for p in _numba_packages.PACKAGES}


WIDTH = 100  # the report's columns
_VALUES = 30  # the value column's width, past which a value is not aligned


def print_report(out: TextIO = sys.stdout) -> int:
    """Print the report; return 0 if the configuration is valid, else 1 (the report says why:
    a bad ``EMMPOOL_*`` value, options that contradict each other). A machine without a GPU or
    driver is a line of the report, not a failure: emmpool installs and imports there."""

    def say(text: str = "", indent: str = "") -> None:
        for line in text.split("\n"):  # each line wrapped to the width, its rest indented
            print("\n".join(textwrap.wrap(line, WIDTH, subsequent_indent=indent,
                                           break_on_hyphens=False)), file=out)

    say(f"emmpool {__version__} ({Path(__file__).parent})")

    say("\nconfiguration in force:")
    # Every setting, then every bad value (not just the first) and every variable emmpool does
    # not read: the report says them, so they are not also given as warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", _config.UnknownVariableWarning)
        settings, errors = _config.diagnose(_granularity())
    names = max(len(s.option) for s in settings)
    values = max((len(s.value) for s in settings if len(s.value) <= _VALUES), default=0)
    for s in settings:
        row = f"  {s.option:{names}}  {s.value:{values}}  from {s.source}"
        if len(row) <= WIDTH:
            print(row, file=out)
        else:  # where the source would pass the width, it goes under the value
            print(f"  {s.option:{names}}  {s.value}", file=out)
            print(f"  {'':{names}}  from {s.source}", file=out)
    for message in errors:
        say(f"  error: {message}", " " * 4)
    for message in _config.unknown_variables():
        say(f"  warning: {message}", " " * 4)

    say()
    _print_driver(say)

    say("\nlibraries:")
    for name, dists in _LIBRARIES:
        version = _version(dists)
        note = ""
        if version is not None and name in _NUMBA_PACKAGES:
            problem = _numba_packages.version_problem(_NUMBA_PACKAGES[name], version)
            note = f"  ({problem})" if problem else ""
        elif version is not None and name == "rmm":
            ready = _rmm.readiness()
            note = f"  (emmpool's {ready})" if ready else "  (does not import)"
        say(f"  {name:15} {version or 'not installed'}{note}", " " * 18)

    say("\nwho allocates from emmpool:")
    for line in _hooks():
        say(f"  {line}", " " * 4)
    return 1 if errors else 0


def _granularity() -> int:
    """The driver's page granularity on device 0, where there is a driver and a device."""
    try:
        return _core.vmm_page_size(0) or _config._GRANULARITY
    except (_core.DriverUnavailableError, _core.CudaError):  # the report says so below
        return _config._GRANULARITY


def _print_driver(say) -> None:
    try:
        n = _core.device_count()
    except _core.DriverUnavailableError as e:
        say(f"driver: unavailable: {e}", " " * 2)
        return
    except _core.CudaError as e:
        say(f"driver: error: {e}", " " * 2)
        return
    say(f"driver: CUDA, {n} device(s)")
    names = {}
    try:
        from numba import cuda

        names = {d.id: d.name.decode() if isinstance(d.name, bytes) else d.name
                 for d in cuda.list_devices()}
    except Exception:  # names are a nicety; the driver's own facts are what matter
        pass
    for d in range(n):
        free, total = _core.memory_info(d)
        say(f"  device {d}: {names.get(d, '?')}, {format_bytes(total)}, {format_bytes(free)} free")


def _version(dists: tuple[str, ...]) -> str | None:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _hooks() -> list[str]:
    """Which libraries use emmpool: Numba's manager (by environment, or installed in this
    process), the hooks installed in this process, and what each pool has served."""
    lines = []
    manager = os.environ.get("NUMBA_CUDA_MEMORY_MANAGER", "")
    numba_driver = sys.modules.get("numba.cuda.cudadrv.driver")
    installed = getattr(numba_driver, "_memory_manager", None)
    if installed is not None and installed.__module__ == "emmpool.plugin":
        lines.append("Numba: emmpool (installed in this process)")
    elif manager == "emmpool.plugin":
        lines.append("Numba: emmpool (NUMBA_CUDA_MEMORY_MANAGER=emmpool.plugin)")
    elif manager:
        lines.append(f"Numba: {manager} (NUMBA_CUDA_MEMORY_MANAGER)")
    else:
        lines.append("Numba: its own manager, unless the program calls emmpool.use_for_numba() "
                     "(or set NUMBA_CUDA_MEMORY_MANAGER=emmpool.plugin)")
    done = _installed.installed()
    libraries = ", ".join(f"{r.library} ({r.how})" for _, r in sorted(done.items()))
    lines.append(f"use_for_* in this process: {libraries or 'none'} (a program calls "
                 f"emmpool.use_for_cupy(), use_for_torch(), ...)")
    for pool in _core.pools():
        s = pool.stats()
        served = ", ".join(f"{lib} {t['allocations']}" for lib, t in s["by_library"].items()
                           if t["allocations"]) or "none"
        lines.append(f"pool of device {pool.device}: {format_bytes(s['bytes_reserved'])} reserved, "
                     f"{format_bytes(s['bytes_in_use'])} in use; allocations by library: {served}")
    return lines

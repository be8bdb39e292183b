"""Shared fixtures. GPU tests are marked `gpu` and skip, with the reason, where CUDA is absent."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """None when a CUDA GPU is usable from this process, else why not, in a few words."""
    import emmpool

    try:
        n = emmpool._core.device_count()
    except emmpool.CudaError as e:
        # The driver's message says what to install; its first clause says what is missing.
        return f"needs a CUDA GPU: {str(e).split(', so ')[0]}"
    if n == 0:
        return "needs a CUDA GPU: the CUDA driver reports no device"
    try:
        from numba import cuda

        if not cuda.is_available():
            return "needs a CUDA GPU: numba.cuda reports CUDA unavailable"
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"needs a CUDA GPU: numba.cuda is not usable: {e}"
    return None


def pytest_collection_modifyitems(items):
    """A test parametrized with mode "passthrough" carries the `passthrough` marker: the GPU
    runner's compute-sanitizer step selects those (-m), and a new one is covered without a mark
    of its own."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("mode") == "passthrough":
            item.add_marker(pytest.mark.passthrough)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """GPU tests skip where there is none, before any other mark or fixture of theirs is
    looked at. Raised here, in one place, so that pytest's summary counts them on one line
    instead of one per test."""
    if "gpu" in item.keywords:
        reason = gpu_unavailable_reason()
        if reason:
            pytest.skip(reason)


def benchmark_module(name: str):
    """benchmarks/<name>.py, loaded as a module; skip where benchmarks/ is not shipped (a wheel's
    test run takes tests/ alone)."""
    path = ROOT / "benchmarks" / f"{name}.py"
    if not path.exists():
        pytest.skip("benchmarks/ is not shipped here")
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed_or_skip(name: str):
    """The package (emmpool._numba_packages.Package) that provides Numba's CUDA target under
    this name, or skip the test, saying what to install."""
    from emmpool import _numba_packages as packages

    package = packages.by_name(name)
    if package not in packages.installed():
        pytest.skip(f"{name} is not installed (pip install 'emmpool[{package.extra}]')")
    return package


@pytest.fixture(params=["numba-cuda",
                        pytest.param("numba-cuda-mlir", marks=pytest.mark.numba_mlir)])
def numba_package(request):
    """Each package that provides Numba's CUDA target, where installed."""
    return installed_or_skip(request.param)


@pytest.fixture
def host():
    """A fake driver with one device of 1 GiB whose events the test completes."""
    import emmpool

    return emmpool._core.HostDriver(devices=1, capacity=1 << 30)

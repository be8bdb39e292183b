"""Shared fixtures. GPU tests are marked `gpu` and skip, with the reason, where CUDA is absent."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """None when a CUDA GPU is usable from this process, else why not."""
    import emmpool

    try:
        n = emmpool._core.device_count()
    except emmpool.CudaError as e:
        return f"no usable CUDA driver/GPU: {e}"
    if n == 0:
        return "the CUDA driver reports no device"
    try:
        from numba import cuda

        if not cuda.is_available():
            return "numba.cuda reports CUDA unavailable"
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"numba.cuda is not usable: {e}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            if reason is None:
                reason = gpu_unavailable_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def installed_or_skip(name: str):
    """The package (emmpool._numba_packages.Package) that provides Numba's CUDA target under
    this name, or skip the test, saying what to install."""
    from emmpool import _numba_packages as packages

    package = packages.by_name(name)
    if package not in packages.installed():
        pytest.skip(f"{name} is not installed (pip install 'emmpool[{package.extra}]')")
    return package


@pytest.fixture(params=["numba-cuda", "numba-cuda-mlir"])
def numba_package(request):
    """Each package that provides Numba's CUDA target, where installed."""
    return installed_or_skip(request.param)


@pytest.fixture
def host():
    """A fake driver with one device of 1 GiB whose events the test completes."""
    import emmpool

    return emmpool._core.HostDriver(devices=1, capacity=1 << 30)

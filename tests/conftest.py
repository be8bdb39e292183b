"""Shared fixtures and the tests' skip reasons. GPU tests are marked `gpu` and skip, with the
reason, where CUDA is absent."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# ---- skip reasons: one wording, "needs <what>: <why, or what to do>" --------------------------
def needs(what: str, why: str) -> str:
    """The reason of every skip here: what the test needs, then why it is missing or how to get
    it (``needs a CUDA GPU: <the driver's words>``, ``needs CuPy: pip install ...``)."""
    return f"needs {what}: {why}"


# What a test may need that a user installs: the name said, and how to install it.
_INSTALLS = {
    "cupy": ("CuPy", "pip install 'emmpool[cupy]'"),
    "torch": ("PyTorch", "pip install 'emmpool[torch]'"),
    "rmm": ("RMM", "pip install 'emmpool[rmm]'"),
    "Cython": ("Cython", "pip install 'emmpool[rmm]'"),
    "cuda.core": ("cuda.core", "pip install 'emmpool[numba]'"),
    "numba.cuda": ("numba-cuda", "pip install 'emmpool[numba]'"),
    "distributed": ("Dask's distributed", "pip install 'emmpool[dask]'"),
    "dask_cuda": ("dask-cuda", "pip install dask-cuda"),
    "numpy": ("NumPy", "pip install numpy"),
}


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package that is absent
        return True


def needs_module(module: str) -> str:
    """The skip reason for a test that needs ``module``."""
    name, install = _INSTALLS.get(module, (module, f"pip install {module}"))
    return needs(name, install)


def require(module: str):
    """``module`` imported, or skip the test saying what to install."""
    return pytest.importorskip(module, reason=needs_module(module))


def requires(*modules: str):
    """A mark: skip unless every one of ``modules`` is installed, naming the first missing."""
    missing = [m for m in modules if _missing(m)]
    return pytest.mark.skipif(bool(missing),
                              reason=needs_module(missing[0]) if missing else "")


def needs_repository(path: str) -> str:
    """The skip reason for a test of the repository's own files (benchmarks/, .ci/, ...),
    which an sdist or a wheel's test run does not ship."""
    return needs(f"the repository's {path}", "not shipped here (an sdist or a wheel's tests)")


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """None when a CUDA GPU is usable from this process, else why not, in a few words."""
    import emmpool

    try:
        n = emmpool._core.device_count()
    except emmpool.CudaError as e:
        # The driver's message says what to install; its first clause says what is missing.
        return needs("a CUDA GPU", str(e).split(", so ")[0])
    if n == 0:
        return needs("a CUDA GPU", "the CUDA driver reports no device")
    try:
        from numba import cuda

        if not cuda.is_available():
            return needs("a CUDA GPU", "numba.cuda reports CUDA unavailable")
    except Exception as e:  # pragma: no cover - depends on the machine
        return needs("a CUDA GPU", f"numba.cuda is not usable: {e}")
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


def pytest_runtest_logreport(report):
    """With EMMCI_TEST_REPORT_AT_ONCE set (the GPU runner sets it), each failure's report is
    written as it happens, not only in the final summary: a run its time limit cuts short
    still says what failed, and why."""
    if report.failed and os.environ.get("EMMCI_TEST_REPORT_AT_ONCE"):
        text = report.longreprtext[-6000:]
        sys.stdout.write(f"\n==== FAILED AT ONCE {report.nodeid} ({report.when})\n{text}\n"
                         f"==== END {report.nodeid}\n")
        sys.stdout.flush()


def benchmark_module(name: str):
    """benchmarks/<name>.py, loaded as a module; skip where benchmarks/ is not shipped (a wheel's
    test run takes tests/ alone)."""
    path = ROOT / "benchmarks" / f"{name}.py"
    if not path.exists():
        pytest.skip(needs_repository("benchmarks/"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    # as when run as a script: its folder first on the path, for the modules it shares
    # (benchmarks/harness.py and the like)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(module)
    return module


def installed_or_skip(name: str):
    """The package (emmpool._numba_packages.Package) that provides Numba's CUDA target under
    this name, or skip the test, saying what to install."""
    from emmpool import _numba_packages as packages

    package = packages.by_name(name)
    if package not in packages.installed():
        pytest.skip(needs_package(package))
    return package


def needs_package(package) -> str:
    """The skip reason for a test of a package that provides Numba's CUDA target: how to
    install it, where it can be installed on this Python."""
    if package.name == "numba-cuda-mlir" and sys.version_info < (3, 11):
        return needs(package.name, f"it needs Python 3.11 or newer (this is "
                                   f"{sys.version_info.major}.{sys.version_info.minor})")
    return needs(package.name, f"pip install 'emmpool[{package.extra}]'")


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


# ---- stand-ins for libraries this machine may lack (their real use is tested on a GPU) -------
@pytest.fixture
def fake_rmm(monkeypatch):
    """``rmm`` and ``rmm.mr`` as emmpool uses them: per-device resources, RMM's default
    (``CudaMemoryResource``) until one is set, ``CallbackMemoryResource`` keeping its callbacks;
    two devices, device 0 current. emmpool's own resources are forgotten after the test."""
    from emmpool import _core, _installed, hooks

    class CudaMemoryResource:
        pass

    class PoolMemoryResource:
        pass

    class CallbackMemoryResource:
        def __init__(self, allocate, deallocate):
            self.allocate, self.deallocate = allocate, deallocate

    resources: dict[int, object] = {}
    mr = types.ModuleType("rmm.mr")
    mr.CudaMemoryResource = CudaMemoryResource
    mr.PoolMemoryResource = PoolMemoryResource
    mr.CallbackMemoryResource = CallbackMemoryResource
    mr.get_per_device_resource = lambda d: resources.setdefault(d, CudaMemoryResource())
    mr.set_per_device_resource = resources.__setitem__
    rmm = types.ModuleType("rmm")
    rmm.mr = mr
    monkeypatch.setitem(sys.modules, "rmm", rmm)
    monkeypatch.setitem(sys.modules, "rmm.mr", mr)
    monkeypatch.setattr(_core, "device_count", lambda: 2)
    monkeypatch.setattr(_core, "current_device", lambda: 0)
    monkeypatch.setattr(hooks, "_rmm_resources", {})
    monkeypatch.setattr(hooks, "_native_rmm", lambda: None)  # a fake has nothing to build on
    monkeypatch.setattr(_installed, "_installed", {})
    return rmm


@pytest.fixture
def clean_config(monkeypatch):
    """emmpool's options as a fresh process reads them: no EMMPOOL_* variable, nothing applied,
    no pool yet (on a GPU machine earlier tests made the process-wide pools, whose options, not
    the environment's, are then in force)."""
    from emmpool import _config, _core

    for name in list(os.environ):
        if name.startswith("EMMPOOL_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(_config, "_applied", None)
    monkeypatch.setattr(_config, "_applied_sources", {})
    monkeypatch.setattr(_core, "pools", lambda: [])
    monkeypatch.setattr(_core, "pinned_pools", lambda: [])

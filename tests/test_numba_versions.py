"""The releases of numba-cuda and numba-cuda-mlir the plugin serves: an older one than the
tested range is refused, a newer minor series is served with a warning, once. The installed
versions are faked: nothing is installed (no GPU needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import emmpool
from emmpool import _numba_packages as packages
from tests.conftest import needs_repository
from tests.test_numba_packages import python

NUMBA_CUDA, MLIR = packages.NUMBA_CUDA, packages.NUMBA_CUDA_MLIR


@pytest.fixture
def installed(monkeypatch):
    """Fake the installed versions: ``installed[package.name] = "0.31.0"``."""
    versions: dict[str, str | None] = {}
    monkeypatch.setattr(packages, "installed_version", lambda package: versions[package.name])
    monkeypatch.setattr(packages, "_warned", set())
    return versions


def test_the_tested_range_is_said_once_on_each_package():
    assert (NUMBA_CUDA.minimum, NUMBA_CUDA.tested, NUMBA_CUDA.next_series) == (
        "0.30.4", "0.30", "0.31")
    assert (MLIR.minimum, MLIR.tested, MLIR.next_series) == ("0.6.0", "0.6", "0.7")


def test_pyprojects_lower_bounds_are_the_minimums():
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip(needs_repository("pyproject.toml"))
    text = pyproject.read_text()
    for package in packages.PACKAGES:
        bounds = re.findall(rf'"{re.escape(package.name)}(?:\[\w+\])?>=([\d.]+)', text)
        assert bounds, f"pyproject.toml names no lower bound for {package.name}"
        for bound in bounds:
            assert packages._at_least(packages._release(bound),
                                      packages._release(package.minimum)), (package.name, bound)


@pytest.mark.parametrize(
    "package, version",
    [(NUMBA_CUDA, "0.30.4"), (NUMBA_CUDA, "0.30.9"), (NUMBA_CUDA, "0.30.4.post1"),
     (NUMBA_CUDA, "0.30.5rc1"), (MLIR, "0.6"), (MLIR, "0.6.0"), (MLIR, "0.6.3+local"),
     (NUMBA_CUDA, None)],  # no metadata (a source tree on sys.path): nothing to check
)
def test_the_tested_range_passes_quietly(installed, package, version):
    installed[package.name] = version
    packages.check_version(package)  # warnings are errors here
    if version is not None:
        assert packages.version_problem(package, version) is None


@pytest.mark.parametrize(
    "package, version, needed",
    [(NUMBA_CUDA, "0.30.3", "0.30.4"), (NUMBA_CUDA, "0.29.0", "0.30.4"),
     (NUMBA_CUDA, "0.30", "0.30.4"), (MLIR, "0.5.9", "0.6.0"), (MLIR, "0.1.0.dev3", "0.6.0")],
)
def test_an_older_release_is_refused_saying_how_to_upgrade(installed, package, version, needed):
    installed[package.name] = version
    with pytest.raises(ImportError) as refused:
        packages.check_version(package)
    message = str(refused.value)
    assert message.startswith(f"{package.name} {version} is installed, but emmpool's Numba "
                              f"plugin needs {package.name} {needed} or later"), message
    assert f"tested with {package.tested}.x" in message
    assert message.endswith(f"upgrade it with: pip install "
                            f"'{package.name}>={needed},<{package.next_series}'"), message
    assert packages.version_problem(package, version) == (
        f"too old: emmpool needs {needed} or later")


@pytest.mark.parametrize(
    "package, version",
    [(NUMBA_CUDA, "0.31.0"), (NUMBA_CUDA, "0.31.0rc1"), (NUMBA_CUDA, "1.0"), (MLIR, "0.7.2"),
     (MLIR, "not-a-version")],
)
def test_a_newer_series_is_served_with_one_warning(installed, package, version):
    installed[package.name] = version
    with pytest.warns(emmpool.UntestedVersionWarning) as record:
        for _ in range(3):
            packages.check_version(package)
    assert len(record) == 1
    message = str(record[0].message)
    assert message.startswith(f"emmpool was tested with {package.name} {package.tested}.x; "
                              f"{version} is installed: "), message
    assert f"pip install '{package.name}>={package.minimum},<{package.next_series}'" in message
    assert issubclass(emmpool.UntestedVersionWarning, RuntimeWarning)
    assert record[0].filename == __file__  # the caller's line, not emmpool's
    packages.check_version(package)  # once: warnings are errors here, and none comes


def test_each_package_is_warned_of_on_its_own(installed):
    installed.update({NUMBA_CUDA.name: "0.31.0", MLIR.name: "0.7.0"})
    with pytest.warns(emmpool.UntestedVersionWarning) as record:
        for package in packages.PACKAGES * 2:
            packages.check_version(package)
    assert sorted(str(w.message).split()[4] for w in record) == ["numba-cuda", "numba-cuda-mlir"]


# ---- as the plugin loads: the versions faked in a fresh interpreter --------------------------
FAKE = """
from emmpool import _numba_packages as packages
packages.installed_version = lambda package: {versions!r}.get(package.name, "0.0.0")
"""


def test_use_for_numba_refuses_a_release_below_the_range(numba_package):
    out = python(FAKE.format(versions={numba_package.name: "0.1.0"}) + f"""
import emmpool
try:
    emmpool.use_for_numba()
except ImportError as e:
    print(e)
else:
    raise AssertionError("no ImportError")
assert {numba_package.driver!r} not in sys.modules, "the refused package was imported"
""", absent=[p for p in packages.PACKAGES if p is not numba_package])
    assert out.startswith(f"{numba_package.name} 0.1.0 is installed, but emmpool's Numba plugin "
                          f"needs {numba_package.name} {numba_package.minimum} or later"), out


def test_the_plugin_loaded_by_the_package_warns_once_of_a_newer_series(numba_package):
    newer = f"{numba_package.next_series}.0"
    out = python(FAKE.format(versions={numba_package.name: newer}) + f"""
import importlib, warnings
from emmpool import UntestedVersionWarning
driver = importlib.import_module({numba_package.driver!r})
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    driver._ensure_memory_manager()      # NUMBA_CUDA_MEMORY_MANAGER=emmpool.plugin: served...
    import emmpool.plugin
    emmpool.plugin.manager_for({numba_package.name!r})
assert issubclass(driver._memory_manager, driver.HostOnlyCUDAMemoryManager)
assert [w.category for w in record] == [UntestedVersionWarning], record  # ...with one warning
print(record[0].message)
""", absent=[p for p in packages.PACKAGES if p is not numba_package], plugin_by_environment=True)
    assert out.startswith(f"emmpool was tested with {numba_package.name} "
                          f"{numba_package.tested}.x; {newer} is installed"), out

"""The Numba plugin with numba-cuda, numba-cuda-mlir, both, or neither (no GPU needed).

Both packages are installed by the `test` extra. "Only one of them" runs in a fresh interpreter
in which the other cannot be imported (its modules set to None in sys.modules), and the
plugin is loaded exactly as the package loads it: NUMBA_CUDA_MEMORY_MANAGER=emmpool.plugin read
by the package's own _ensure_memory_manager(), which a context calls when it is made."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from emmpool import _numba_packages as packages
from tests.conftest import installed_or_skip

BOTH = packages.PACKAGES


@pytest.fixture
def both():
    for p in BOTH:
        installed_or_skip(p.name)


# Warnings are errors, as pyproject.toml's filterwarnings has them (-W cannot say "numba's
# modules": it matches one module's whole name).
WARNINGS = """import warnings
warnings.simplefilter("error")
warnings.filterwarnings("ignore", category=DeprecationWarning, module="numba")
"""


def python(code: str, *, absent=(), plugin_by_environment=False) -> str:
    """Run ``code`` in a fresh interpreter (warnings are errors) where the packages in
    ``absent`` cannot be imported; return its stdout. Fails the test on a non-zero exit."""
    block = {name for p in absent for name in (p.probe, p.root)}
    prelude = "import sys\n" + WARNINGS + "".join(f"sys.modules[{n!r}] = None\n"
                                                for n in sorted(block))
    env = dict(os.environ)
    env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    if plugin_by_environment:
        env["NUMBA_CUDA_MEMORY_MANAGER"] = "emmpool.plugin"
    p = subprocess.run([sys.executable, "-c", prelude + code], env=env,
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        pytest.fail(f"exit {p.returncode}\n--- stdout ---\n{p.stdout}\n--- stderr ---\n"
                    f"{p.stderr[-4000:]}", pytrace=False)
    return p.stdout


def _others(package):
    return [p for p in BOTH if p is not package]


def test_each_package_alone_loads_the_plugin_as_its_own_managers_subclass(numba_package):
    out = python(f"""
import importlib
driver = importlib.import_module({numba_package.driver!r})
assert driver.config.CUDA_MEMORY_MANAGER == "emmpool.plugin"
driver._ensure_memory_manager()             # what the package does when it makes a context
cls = driver._memory_manager
assert issubclass(cls, driver.HostOnlyCUDAMemoryManager), cls.__mro__
assert issubclass(cls, driver.GetIpcHandleMixin), cls.__mro__
manager = cls(context=None)                 # as set_memory_manager makes it: no CUDA touched
assert manager.interface_version == 1
manager.reset()                             # before initialize(): harmless
with manager.defer_cleanup():
    pass
import emmpool.plugin
assert emmpool.plugin._numba_memory_manager is cls   # the only package: the default too
assert emmpool.plugin.manager_for({numba_package.name!r}) is cls
names = {{}}
exec("from emmpool.plugin import *", names)  # only the installed package's class
assert sorted(n for n in names if n != "__builtins__") == sorted([cls.__name__, "manager_for"])
print(cls.__name__)
""", absent=_others(numba_package), plugin_by_environment=True)
    expected = {"numba-cuda": "EmmPoolManager", "numba-cuda-mlir": "EmmPoolMlirManager"}
    assert out.split() == [expected[numba_package.name]]


def test_use_for_numba_registers_with_the_only_package(numba_package):
    python(f"""
import importlib
import emmpool
emmpool.use_for_numba()
driver = importlib.import_module({numba_package.driver!r})
from emmpool.plugin import manager_for
assert driver._memory_manager is manager_for({numba_package.name!r}), driver._memory_manager
""", absent=_others(numba_package))


def test_with_both_each_package_loads_its_own_class_of_one_implementation(both):
    numba, mlir = packages.NUMBA_CUDA, packages.NUMBA_CUDA_MLIR
    python(f"""
import importlib
first = importlib.import_module({numba.driver!r})
first._ensure_memory_manager()
assert {mlir.root!r} not in sys.modules, "loading the plugin imported the other package"
second = importlib.import_module({mlir.driver!r})
second._ensure_memory_manager()
a, b = first._memory_manager, second._memory_manager
assert issubclass(a, first.HostOnlyCUDAMemoryManager)
assert not issubclass(a, second.BaseCUDAMemoryManager)
assert issubclass(b, second.HostOnlyCUDAMemoryManager)
assert not issubclass(b, first.BaseCUDAMemoryManager)
assert a(context=None).interface_version == b(context=None).interface_version == 1
from emmpool import plugin
assert (a, b) == (plugin.EmmPoolManager, plugin.EmmPoolMlirManager)
assert a.memalloc is b.memalloc and a.get_ipc_handle is b.get_ipc_handle  # one body
assert plugin._numba_memory_manager is a     # any other caller: the preferred package's
""", plugin_by_environment=True)


def test_with_both_use_for_numba_registers_with_each(both):
    python("""
import emmpool
emmpool.use_for_numba()
from emmpool import _numba_packages as packages, plugin
for p in packages.PACKAGES:
    got = packages.emm_api(p).driver._memory_manager
    assert got is plugin.manager_for(p.name), (p.name, got)
    assert issubclass(got, packages.emm_api(p).HostOnlyCUDAMemoryManager)
""")


def test_without_either_package_the_plugin_says_what_to_install():
    python("""
import emmpool                              # the pools work without Numba (CuPy, PyTorch)
assert emmpool.stats() == {}
for attempt in (lambda: __import__("emmpool.plugin"), emmpool.use_for_numba):
    try:
        attempt()
    except ImportError as e:
        message = str(e)
    else:
        raise AssertionError("no ImportError")
    assert "emmpool[numba]" in message and "emmpool[numba-mlir]" in message, message
""", absent=BOTH)


def test_a_manager_refuses_the_other_packages_context(both):
    from emmpool import plugin

    mlir_context = object.__new__(packages.emm_api(packages.NUMBA_CUDA_MLIR).Context)
    manager = plugin.EmmPoolManager(context=mlir_context)
    with pytest.raises(TypeError, match="for numba-cuda, but a numba_cuda_mlir.* context"):
        manager.initialize()
    with pytest.raises(TypeError, match="for numba-cuda, but"):
        manager.memalloc(256)


def test_every_emm_name_is_found_in_each_package(numba_package):
    from emmpool import plugin

    emm = packages.emm_api(numba_package)
    assert emm.driver.__name__ == numba_package.driver
    assert emm.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY == 2
    assert issubclass(plugin.manager_for(numba_package.name), emm.BaseCUDAMemoryManager)


def test_unknown_package_names_the_known_ones():
    from emmpool import plugin

    with pytest.raises(ValueError, match="'numba-cuda', 'numba-cuda-mlir'"):
        plugin.manager_for("numba-cuda-llvm")
    with pytest.raises(AttributeError, match="EmmPoolLegacyManager"):
        plugin.EmmPoolLegacyManager  # noqa: B018

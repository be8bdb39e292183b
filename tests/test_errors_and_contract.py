"""What works without a GPU: import, the Numba plugin contract, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

import emmpool
from emmpool import _core
from tests.conftest import installed_or_skip, needs, require


@pytest.mark.parametrize(
    "kind, exc",
    [
        ("cuda", emmpool.CudaError),
        ("driver", emmpool.DriverUnavailableError),
        ("oom", emmpool.OutOfMemoryError),
        ("pool", emmpool.PoolError),
        ("invalid", ValueError),
    ],
)
def test_exception_mapping(kind, exc):
    with pytest.raises(exc):
        _core._raise_for_test(kind)


def test_cuda_error_carries_code_and_call():
    with pytest.raises(emmpool.CudaError) as info:
        _core._raise_for_test("cuda")
    assert info.value.code == 2 and info.value.call == "cuTest"
    assert issubclass(emmpool.DriverUnavailableError, emmpool.CudaError)
    assert issubclass(emmpool.OutOfMemoryError, MemoryError)


def test_version_is_written_once():
    # pyproject.toml reads __version__ (scikit-build-core's regex provider): the installed
    # distribution and the package must agree.
    import importlib.metadata

    assert emmpool.__version__ == importlib.metadata.version("emmpool")


def test_import_touches_no_gpu():
    # A fresh interpreter: importing emmpool must not load libcuda (numba.cuda, which the
    # plugin imports, may load it by itself where a driver exists).
    code = (
        "import emmpool, sys\n"
        "maps = open('/proc/self/maps').read()\n"
        "sys.exit(1 if 'libcuda.so' in maps else 0)\n"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_plugin_contract_without_context(numba_package):
    from emmpool import _numba_packages as packages
    from emmpool.plugin import manager_for

    cls = manager_for(numba_package.name)
    mgr = cls(context=None)  # what set_memory_manager does: must touch no CUDA
    assert mgr.interface_version == 1
    mgr.reset()  # before initialize(): harmless
    with mgr.defer_cleanup():
        pass
    packages.emm_api(numba_package).set_memory_manager(cls)


def test_numba_cuda_keeps_its_manager_name():
    installed_or_skip("numba-cuda")
    from numba.cuda import HostOnlyCUDAMemoryManager

    from emmpool.plugin import EmmPoolManager, _numba_memory_manager

    assert _numba_memory_manager is EmmPoolManager  # numba-cuda is preferred where installed
    assert issubclass(EmmPoolManager, HostOnlyCUDAMemoryManager)


def test_no_driver_error_is_one_sentence_saying_what_to_do():
    try:
        _core.device_count()
    except emmpool.DriverUnavailableError as e:
        error = e
    else:
        pytest.skip(needs("no CUDA driver", "one is present, so its absence cannot be observed"))
    message = str(error)
    # What is missing, what it means, what to do; no error number or source path for a user
    # to decode (the code is still there as an attribute).
    assert message.startswith(("No NVIDIA driver found (libcuda.so.1",
                               "The NVIDIA driver is")), message
    assert "cannot use" in message and ("install" in message or "update" in message
                                        or "check" in message), message
    assert message.endswith(".") and message.count(". ") == 0, message
    assert ".cpp" not in message and "(100)" not in message, message
    assert error.code != 0 and error.call in ("dlopen", "dlsym", "cuInit")
    with pytest.raises(emmpool.DriverUnavailableError) as again:
        _core.pool(0)
    assert str(again.value) == message


def test_hooks_say_what_to_install_when_missing(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name in ("cupy", "torch"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="emmpool\\[cupy\\]"):
        emmpool.use_for_cupy()
    with pytest.raises(ImportError, match="emmpool\\[torch\\]"):
        emmpool.use_for_torch()


def test_stats_names_only_existing_pools():
    s = emmpool.stats()
    assert isinstance(s, dict) and all(isinstance(d, int) for d in s)
    assert set(s) == {p.device for p in _core.pools()}
    with pytest.raises(ValueError, match="no pool"):
        emmpool.stats(63)


@pytest.fixture
def no_driver_call(monkeypatch):
    """Fail the test if the driver would be asked: a type error must be found before that."""
    def asked(*args):
        raise AssertionError(f"the driver was asked, with {args}")

    for name in ("pool", "pools", "current_device", "device_count"):
        monkeypatch.setattr(_core, name, asked)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: emmpool.stats("0"), "device must be an integer .*, not str '0'"),
        (lambda: emmpool.stats(1.0), "device must be an integer .*, not float 1.0"),
        (lambda: emmpool.stats(True), "device must be an integer .*, not bool True"),
        (lambda: emmpool.record_stream("abc", 0), "ptr must be an integer .*, not str 'abc'"),
        (lambda: emmpool.record_stream(0x7000, "stream"), "stream must be an integer .*stream"),
        (lambda: emmpool.record_stream(0x7000, None), "stream must be an integer .*NoneType"),
        (lambda: emmpool.record_stream(0x7000, 0, device="0"), "device must be an integer"),
        (lambda: emmpool.rmm_resource("cuda:0"), "device must be an integer"),
        (lambda: emmpool.cuda_core_resource("0"), "device must be an integer"),
        (lambda: emmpool.use_for_cuda_core(0), r"devices must be a list of device ordinals"),
        (lambda: emmpool.use_for_cuda_core("01"), r"devices must be a list of device ordinals"),
        (lambda: emmpool.use_for_cuda_core([0, "1"]), "device must be an integer"),
        (lambda: emmpool.use_for_torch(1), "allocator must be 'auto', 'extension', 'pluggable'"),
        (lambda: emmpool.use_for_rmm(0), r"devices must be a list of device ordinals"),
        (lambda: emmpool.use_for_rmm([0, 1.0]), "device must be an integer"),
        (lambda: emmpool.record_stream(0x7000, 0, device=True), "device must be an integer"),
    ],
)
def test_a_wrong_type_is_a_type_error_before_the_driver_is_asked(no_driver_call, call, message):
    with pytest.raises(TypeError, match=message):
        call()


@pytest.mark.parametrize(
    "call",
    [lambda: emmpool.stats(-1), lambda: emmpool.record_stream(0x7000, 0, device=-1),
     lambda: emmpool.rmm_resource(-2), lambda: emmpool.cuda_core_resource(-1),
     lambda: emmpool.use_for_cuda_core([-1]), lambda: emmpool.use_for_rmm([-1])],
)
def test_a_negative_device_is_a_value_error(no_driver_call, call):
    with pytest.raises(ValueError, match="device must be a CUDA device ordinal"):
        call()


def test_integers_of_other_types_are_integers():
    np = require("numpy")
    with pytest.raises(ValueError, match="no pool exists for device 63"):
        emmpool.stats(np.int64(63))


def test_pool_errors_reach_numba_as_its_own_error_type(numba_package):
    from emmpool import _numba_packages as packages
    from emmpool import plugin

    emm = packages.emm_api(numba_package)
    oom = plugin._as_numba_error(emm, emmpool.OutOfMemoryError("pool holds 1 GiB"))
    assert isinstance(oom, emm.CudaAPIError) and oom.code == 2 and "holds" in str(oom)
    try:
        _core._raise_for_test("cuda")
    except emmpool.CudaError as e:
        mapped = plugin._as_numba_error(emm, e)
    assert isinstance(mapped, emm.CudaAPIError)
    assert mapped.code == emm.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY  # the test error's code


def test_cupy_allocator_turns_a_null_pointer_into_cupys_out_of_memory_error():
    class Memory:  # stands for the MemoryPointer of CuPy's CFunctionAllocator.malloc
        def __init__(self, ptr):
            self.ptr = ptr

    class OutOfMemory(MemoryError):  # CuPy's OutOfMemoryError(size, total)
        def __init__(self, size, total):
            super().__init__(f"out of memory allocating {size} bytes")
            self.size, self.total = size, total

    seen = []

    def c_malloc(size):
        seen.append(size)
        if size == 1536:
            raise ValueError("the allocator's own error")
        return Memory(0 if size == 0 or size > 1024 else 0x7000)

    malloc = _core.cupy_malloc(c_malloc, OutOfMemory)
    assert malloc(64).ptr == 0x7000
    assert malloc(0).ptr == 0                      # CuPy allocates nothing for size 0
    assert seen == [512, 0]                        # rounded to CuPy's unit, as its pool does
    with pytest.raises(OutOfMemory) as e:
        malloc(2000)
    assert (e.value.size, e.value.total) == (2000, -1)  # the size asked for
    with pytest.raises(ValueError, match="own error"):  # the allocator's own errors pass through
        malloc(1025)
    with pytest.raises(OverflowError):             # as CuPy's malloc(size_t)
        malloc(-1)
    with pytest.raises(AttributeError):
        _core.cupy_malloc(lambda size: object(), OutOfMemory)(8)
    unchecked = _core.cupy_malloc(c_malloc)        # where the entry point raises by itself
    assert unchecked(2000).ptr == 0 and seen[-1] == 2048


def test_cupy_entry_point_raises_its_failures_only_when_asked():
    import ctypes

    class OutOfMemory(MemoryError):
        pass

    # Called as CuPy calls it, with the GIL held (PYFUNCTYPE: the error flag is checked after).
    malloc = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(
        _core.c_function_addresses()["cupy_malloc"])
    try:
        _core.set_cupy_failure(OutOfMemory)
        with pytest.raises(ValueError, match="device"):
            malloc(None, 256, -1)
        try:
            _core.device_count()
            refused = ValueError, "too large"   # the request itself
        except emmpool.CudaError:
            refused = RuntimeError, "driver"    # no pool without a driver: any other error
        with pytest.raises(refused[0], match=refused[1]):
            malloc(None, (1 << 64) - 1, 0)
        _core.set_cupy_failure(None)
        assert malloc(None, 256, -1) is None          # NULL, and nothing raised
    finally:
        _core.set_cupy_failure(None)


def test_cupy_hook_lets_the_entry_point_raise_only_where_cupy_passes_it_on():
    cupy = require("cupy")
    from emmpool import hooks

    addresses = _core.c_function_addresses()
    try:
        _core.set_cupy_failure(cupy.cuda.memory.OutOfMemoryError)
        raises = hooks._cupy_passes_errors_on(cupy, addresses)
        _core.set_cupy_failure(None)
        assert not hooks._cupy_passes_errors_on(cupy, addresses)  # NULL: nothing to pass on
    finally:
        _core.set_cupy_failure(None)
    print(f"CuPy {cupy.__version__} passes the entry point's exceptions on: {raises}")


def test_cupy_stream_source_takes_only_cupys_stream_functions():
    import types
    import warnings

    from emmpool import hooks

    try:
        with pytest.raises(TypeError):
            _core.set_cupy_stream_source(42)
        # A CuPy that does not export the function: frees fall back to the legacy fence, loudly.
        fake = types.SimpleNamespace(__version__="0.0", cuda=types.SimpleNamespace(
            stream=types.SimpleNamespace()))
        with pytest.warns(RuntimeWarning, match="legacy default stream"):
            hooks._ask_cupy_for_its_stream(fake)
        try:
            import cupy.cuda.stream
        except ImportError:
            return
        import cupy_backends.cuda.stream

        capi = cupy.cuda.stream.__pyx_capi__
        with pytest.raises(ValueError, match="intptr_t \\(int\\)' or 'intptr_t \\(void\\)"):
            _core.set_cupy_stream_source(capi["get_current_stream"])
        _core.set_cupy_stream_source(capi["get_current_stream_ptr"])
        _core.set_cupy_stream_source(cupy_backends.cuda.stream.__pyx_capi__["get_stream_ptr"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hooks._ask_cupy_for_its_stream(cupy)     # this CuPy exports them: no warning
            hooks._ask_cupy_for_its_stream(cupy, cupy_backends.cuda.stream)
    finally:
        _core.set_cupy_stream_source(None)

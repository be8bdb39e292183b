"""emmpool's native RMM resource (emmpool._rmm), over the host driver: built against the RMM
installed, RMM's calls reach the pool with no Python on the way, tagged RMM's, in stream order;
its failures are RMM's exceptions, so that RMM's adaptors (statistics, limiting, failure
callback) stack on it; emmpool's out-of-memory callback still fires for RMM's requests; and
where it cannot be built, RMM gets the callback resource, with one line that says why.

Each case runs in a fresh interpreter whose process-wide pools take a host driver (RMM needs no
GPU to allocate through a resource). tests/test_gpu_rmm.py runs RMM's buffers and a C++ program
over librmm on a GPU."""

from __future__ import annotations

import os
import textwrap

import pytest

from tests.conftest import ROOT, benchmark_module, needs, requires
from tests.processes import run_python

pytestmark = [requires("rmm", "Cython"), pytest.mark.rmm]

PRELUDE = textwrap.dedent(
    """
    import gc, sys, warnings
    import emmpool, rmm, rmm.mr
    from emmpool import _core, _rmm, hooks
    MiB = 1 << 20
    host = _core.HostDriver(devices=1, capacity=256 * MiB)
    _core._use_driver_for_all_pools(host)
    _core.device_count = lambda: 1       # what hooks asks of the CUDA driver, which is absent
    _core.current_device = lambda: 0

    def stream_of(handle):               # an RMM stream over a stream of the host driver's
        class S:
            def __cuda_stream__(self):
                return (0, handle)
        return rmm.pylibrmm.stream.Stream(S())

    def rmm_stats():
        return emmpool.stats(0)["by_library"]["rmm"]
    """
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The native module, built once for this file's cases into a cache of its own."""
    from emmpool import _rmm

    where = tmp_path_factory.mktemp("rmm-cache")
    os.environ["EMMPOOL_RMM_CACHE"] = str(where)
    try:
        try:
            _rmm._cuda_include()
        except _rmm.RmmBuildError as e:
            pytest.skip(needs("the CUDA runtime's headers", str(e)))
        _rmm._build()  # a failure here is a failure: the compiler's words in the message
    finally:
        del os.environ["EMMPOOL_RMM_CACHE"]
    return where


def run(body: str, cache) -> str:
    env = dict(os.environ, EMMPOOL_RMM_CACHE=str(cache))
    p = run_python(["-c", PRELUDE + textwrap.dedent(body) + "\nprint('OK')\n"], timeout=120,
                   env=env)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr
    return p.stdout + p.stderr


def test_the_native_resource_allocates_from_the_pool_as_rmms(cache):
    run(
        """
        mr = emmpool.rmm_resource(0)
        assert type(mr).__name__ == "EmmpoolMemoryResource" and mr.device == 0, mr
        assert isinstance(mr, rmm.mr.DeviceMemoryResource)
        assert hooks.rmm_resource_kind() == "native resource"
        assert emmpool.rmm_resource(0) is mr                  # one per device
        p = mr.allocate(1000)
        assert rmm_stats() == {"bytes_in_use": 1024, "allocations": 1}, rmm_stats()
        b = rmm.DeviceBuffer(size=3 * MiB, mr=mr)             # RMM's own buffer, through it
        assert b.size == 3 * MiB and rmm_stats()["allocations"] == 2
        del b
        mr.deallocate(p, 1000)
        assert rmm_stats()["bytes_in_use"] == 0, rmm_stats()
        assert mr.allocate(0) == 0                            # as cudaMalloc(0): nothing
        mr.deallocate(0, 0)
        """,
        cache,
    )


def test_frees_are_fenced_on_rmms_stream_and_reused_in_its_order(cache):
    run(
        """
        mr = emmpool.rmm_resource(0)
        s, other = stream_of(host.create_stream()), stream_of(host.create_stream())
        host.set_auto_complete(False)                         # the GPU is behind
        p = mr.allocate(MiB, s)
        mr.deallocate(p, MiB, s)
        assert mr.allocate(MiB, s) == p                       # its own stream: at once
        assert emmpool.stats(0)["same_stream_reuses"] == 1
        mr.deallocate(p, MiB, s)
        q = mr.allocate(MiB, other)                           # another: not before the fence
        assert q != p, "a block handed to another stream before its free's work was done"
        host.complete_all_events()
        mr.deallocate(q, MiB, other)
        """,
        cache,
    )


def test_no_python_runs_per_allocation(cache):
    # Python functions entered while RMM allocates and frees 200 buffers: none through the
    # native resource, at least one per allocation through the callback one.
    run(
        """
        def python_calls(mr, n=200):
            calls = []
            def profile(frame, event, arg):
                if event == "call":
                    calls.append(frame.f_code.co_name)
            sys.setprofile(profile)
            try:
                for _ in range(n):
                    b = rmm.DeviceBuffer(size=4096, mr=mr)
                    del b
            finally:
                sys.setprofile(None)
            return calls

        native = emmpool.rmm_resource(0)
        assert python_calls(native) == [], python_calls(native)[:5]
        assert rmm_stats()["allocations"] == 200
        callback = rmm.mr.CallbackMemoryResource(*hooks._rmm_callbacks(lambda: _core.pool(0)))
        assert len(python_calls(callback)) >= 400             # an alloc and a free each
        """,
        cache,
    )


def test_failures_are_rmms_exceptions_and_rmms_adaptors_stack_on_it(cache):
    run(
        """
        mr = emmpool.rmm_resource(0)
        try:
            mr.allocate(1 << 40)
        except MemoryError as e:                              # rmm::out_of_memory
            assert "emmpool: out of memory" in str(e) and "out_of_memory" in str(e), e
        else:
            raise AssertionError("no MemoryError")
        # The failure-callback adaptor acts on rmm::out_of_memory only: it is what fails here.
        asked = []
        fc = rmm.mr.FailureCallbackResourceAdaptor(mr, lambda n: asked.append(n) or False)
        try:
            fc.allocate(1 << 40)
        except MemoryError:
            pass
        assert asked == [1 << 40], asked
        stats = rmm.mr.StatisticsResourceAdaptor(mr)
        p = stats.allocate(1000)
        assert stats.allocation_counts.current_bytes == 1000
        stats.deallocate(p, 1000)
        limit = rmm.mr.LimitingResourceAdaptor(mr, MiB)
        try:
            limit.allocate(2 * MiB)
        except MemoryError:
            pass
        else:
            raise AssertionError("the limiting adaptor let 2 MiB through a 1 MiB limit")
        q = limit.allocate(MiB // 2)
        limit.deallocate(q, MiB // 2)
        assert rmm_stats()["bytes_in_use"] == 0, rmm_stats()
        """,
        cache,
    )


def test_emmpools_out_of_memory_callback_fires_for_rmms_requests(cache):
    run(
        """
        mr = emmpool.rmm_resource(0)
        held = [mr.allocate(100 * MiB), mr.allocate(100 * MiB)]
        asked = []
        def free_one(device, size, stats):
            asked.append((device, size))
            if held:
                mr.deallocate(held.pop(), 100 * MiB)
                return True
            return False
        emmpool.set_out_of_memory_callback(free_one)
        p = mr.allocate(100 * MiB)                            # fits once one is given back
        assert asked and asked[0][0] == 0, asked
        mr.deallocate(p, 100 * MiB)
        for q in held:
            mr.deallocate(q, 100 * MiB)
        """,
        cache,
    )


def test_rmms_cpp_callers_allocate_from_eight_threads_while_python_holds_the_gil(cache):
    # benchmarks/rmm_threads.cpp: RMM's per-device resource, as libcudf finds it, from 8 C++
    # threads, called through ctypes.PyDLL, which holds the GIL until the call returns: an
    # allocation that needed the GIL would never end (the timeout says so).
    benchmark_module("rmm_threads")  # skips where benchmarks/ is not shipped
    run(
        f"""
        sys.path.insert(0, {str(ROOT / "benchmarks")!r})
        import rmm_threads
        mr = emmpool.rmm_resource(0)
        rmm.mr.set_per_device_resource(0, mr)
        f = rmm_threads.load({str(cache)!r}, hold_gil=True)
        rmm_threads.run(f, device=0, threads=8, iterations=5000, bytes=4096)
        assert rmm_stats() == {{"bytes_in_use": 0, "allocations": 40000}}, rmm_stats()
        """,
        cache,
    )


def test_a_daemon_thread_freeing_through_rmm_as_the_interpreter_exits_lets_it_exit(cache):
    # RMM frees from noexcept frames: a free that takes the GIL back as Python finalizes must
    # not end its thread with an unwind through them (std::terminate, exit status 134).
    benchmark_module("rmm_threads")  # skips where benchmarks/ is not shipped
    run(
        f"""
        import threading, time
        sys.path.insert(0, {str(ROOT / "benchmarks")!r})
        import rmm_threads
        rmm.mr.set_per_device_resource(0, emmpool.rmm_resource(0))
        churn = rmm_threads.churn({str(cache)!r})
        a, b = host.create_stream(), host.create_stream()
        started = threading.Event()

        def work():
            started.set()
            while True:
                churn(0, a, b, 100000)

        threading.Thread(target=work, daemon=True).start()
        started.wait()
        time.sleep(0.3)
        """,
        cache,
    )


def test_a_resource_from_another_build_is_refused(cache):
    run(
        """
        import ctypes
        module = _rmm.module()
        for bad in (None, "not a capsule"):
            try:
                module.EmmpoolMemoryResource(0, bad)
            except (TypeError, ValueError) as e:
                pass
            else:
                raise AssertionError(f"made over {bad!r}")
        table = (ctypes.c_int * 8)(99)                       # abi 99
        capsule = ctypes.pythonapi.PyCapsule_New
        capsule.restype, capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                                ctypes.c_void_p]
        try:
            module.EmmpoolMemoryResource(0, capsule(ctypes.addressof(table), b"emmpool.rmm_api",
                                                    None))
        except RuntimeError as e:
            assert "different versions" in str(e) and "ABI 99" in str(e), e
        else:
            raise AssertionError("a table of another ABI was taken")
        try:
            module.EmmpoolMemoryResource(-1, _core._rmm_api())
        except ValueError as e:
            assert "never negative" in str(e), e
        else:
            raise AssertionError("device -1 was taken")
        """,
        cache,
    )


def test_where_it_cannot_be_built_rmm_gets_the_callback_resource_and_one_line(tmp_path):
    env = dict(os.environ, EMMPOOL_RMM_CACHE=str(tmp_path), CXX="no-such-compiler")
    p = run_python(["-W", "always", "-c", PRELUDE + textwrap.dedent(
        """
        mr = emmpool.rmm_resource(0)
        assert type(mr) is rmm.mr.CallbackMemoryResource, mr
        assert emmpool.rmm_resource(0) is mr
        assert hooks.rmm_resource_kind() == "callback resource"
        p = mr.allocate(1000)
        assert rmm_stats()["allocations"] == 1
        mr.deallocate(p, 1000)
        print("OK")
        """)], timeout=120, env=env)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr
    warned = [line for line in p.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1, p.stderr
    assert "no C++ compiler (no-such-compiler)" in warned[0], warned
    assert "Python callback resource instead" in warned[0], warned


def test_a_cached_module_that_will_not_load_is_dropped_and_rmm_gets_the_callback(tmp_path):
    # A build cut short (a crash after the rename), or one a newer compiler made for a machine
    # sharing the cache: the callback resource this time, and the file gone for a rebuild.
    env = dict(os.environ, EMMPOOL_RMM_CACHE=str(tmp_path), CXX="no-such-compiler")
    p = run_python(["-c", PRELUDE + textwrap.dedent(
        """
        target = _rmm._target(_rmm._rmm_parts()[0])
        target.parent.mkdir(parents=True)
        target.write_bytes(b"not a shared object")
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            mr = emmpool.rmm_resource(0)
        assert type(mr) is rmm.mr.CallbackMemoryResource, mr
        assert any("would not load" in str(w.message) for w in said), [str(w) for w in said]
        assert not target.exists()
        print("OK")
        """)], timeout=120, env=env)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr


def test_rmm_releases_are_read_and_old_ones_refused(monkeypatch):
    from emmpool import _rmm

    assert _rmm._release("26.06.00") == (26, 6)
    assert _rmm._release("26.10.00a5") == (26, 10)
    assert _rmm._release("nonsense") == (0, 0)
    import rmm

    monkeypatch.setattr(rmm, "__version__", "26.04.00")
    with pytest.raises(_rmm.RmmBuildError, match=r"RMM 26.04.00 predates 26.06"):
        _rmm._rmm_parts()


def test_info_says_what_rmm_would_get_without_building_it(cache, tmp_path, monkeypatch):
    from emmpool import _rmm

    monkeypatch.setenv("EMMPOOL_RMM_CACHE", str(cache))
    built = _rmm._target(_rmm._rmm_parts()[0]).parent
    assert _rmm.readiness() == f"native resource, built in {built}"
    monkeypatch.setenv("EMMPOOL_RMM_CACHE", str(tmp_path))
    assert _rmm.readiness().startswith("native resource, to be built on first use")
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert _rmm.readiness() == "callback resource: no C++ compiler (no-such-compiler): install " \
                               "one, or set CXX"
    assert list(tmp_path.iterdir()) == []  # nothing was built, nor a folder made


def test_a_compiler_that_fails_is_one_warning_line_and_its_words_go_to_the_log(tmp_path):
    cxx = tmp_path / "broken-c++"
    cxx.write_text("#!/bin/sh\necho 'resource.hpp:1: error: something the compiler says' >&2\n"
                   "exit 1\n")
    cxx.chmod(0o755)
    env = dict(os.environ, EMMPOOL_RMM_CACHE=str(tmp_path / "cache"), CXX=str(cxx),
               EMMPOOL_LOG="debug")
    p = run_python(["-W", "always", "-c", PRELUDE + textwrap.dedent(
        """
        assert type(emmpool.rmm_resource(0)) is rmm.mr.CallbackMemoryResource
        print("OK")
        """)], timeout=180, env=env)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr
    warned = [line for line in p.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1, p.stderr
    assert "the C++ compiler failed building emmpool's native RMM resource" in warned[0]
    assert "EMMPOOL_LOG=debug shows why" in warned[0] and "error:" not in warned[0], warned
    assert "something the compiler says" in p.stderr  # the log's line, at debug level

"""emmpool.cuda_core without a GPU: the resource over the host driver.

cuda.core's Buffer needs a CUDA context to record a default stream (0, 1, 2) as its
deallocation stream, and takes cuda.core's own streams only, so most tests here give the
resource a recording stand-in (``RecordedBuffer``) and streams as objects with
``__cuda_stream__``; the last ones take cuda.core's own Buffer and Stream, over streams of the
host driver. Everything else is real: the process-wide pools over a HostDriver, and cuda.core's
own base classes. Each test runs in a fresh interpreter (the process-wide pools take their
driver once). On a GPU, tests/test_gpu_cuda_core.py runs the real thing."""

from __future__ import annotations

import textwrap

from tests.conftest import require
from tests.processes import run_python

require("cuda.core")

PRELUDE = textwrap.dedent(
    """
    import emmpool
    from emmpool import _core
    host = _core.HostDriver(devices=2, capacity=1 << 30)
    host.set_auto_complete(False)
    _core._use_driver_for_all_pools(host)
    from emmpool import cuda_core

    class RecordedBuffer:
        made = []
        fail = False

        @classmethod
        def from_handle(cls, ptr, size, mr=None, owner=None, *, stream=None):
            if cls.fail:
                raise RuntimeError("no context")
            b = cls()
            b.ptr, b.size, b.mr, b.stream = ptr, size, mr, stream
            cls.made.append(b)
            return b

        def close(self, stream=None):
            self.mr.deallocate(self.ptr, self.size, stream=self.stream if stream is None else stream)

    cuda_core.Buffer = RecordedBuffer

    class S:  # a stream as cuda.core passes it
        def __init__(self, handle):
            self.handle = handle
        def __cuda_stream__(self):
            return (0, self.handle)

    def in_use(library, device=0):
        return emmpool.stats(device)["by_library"][library]["bytes_in_use"]
    """
)


def run(body: str):
    p = run_python(["-c", PRELUDE + textwrap.dedent(body) + "\nprint('OK')\n"], timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr


def test_the_resource_is_a_cuda_core_memory_resource_of_its_device():
    run(
        """
        from cuda.core import MemoryResource
        mr = cuda_core.resource(1)
        assert isinstance(mr, MemoryResource) and mr is cuda_core.resource(1)
        assert (mr.device_id, mr.is_device_accessible, mr.is_host_accessible, mr.is_managed) == (1, True, False, False)
        assert mr.library == "cuda_core" and mr.pool is _core.pool(1)
        assert cuda_core.resource(1, library="numba") is not mr
        assert emmpool.cuda_core_resource(0) is cuda_core.resource(0)
        assert "device=1" in repr(mr)
        """
    )


def test_allocate_and_free_on_a_stream_go_through_the_pool():
    run(
        """
        mr = cuda_core.resource(0)
        s = S(host.create_stream())
        b = mr.allocate(1000, stream=s)
        assert (b.size, b.mr, b.stream) == (1000, mr, s) and b.ptr % 256 == 0
        assert in_use("cuda_core") == 1024 and in_use("numba") == 0
        queries = host.stats()["stream_id_queries"]
        b.close()  # on the allocation's stream, as cuda.core does by default
        assert host.stats()["stream_id_queries"] == queries  # its handle is not asked again
        assert emmpool.stats(0)["bytes_in_use"] == 0
        # the same stream takes it back at once, unfenced (stream order)
        assert mr.allocate(1000, stream=s).ptr == b.ptr
        assert emmpool.stats(0)["same_stream_reuses"] == 1
        """
    )


def test_a_free_on_another_stream_waits_for_its_fence():
    run(
        """
        mr = cuda_core.resource(0)
        a, other = S(host.create_stream()), S(host.create_stream())
        b = mr.allocate(1 << 20, stream=a)
        b.close(other)  # Buffer.close(stream): in that stream's order
        assert mr.allocate(1 << 20, stream=a).ptr != b.ptr      # not a's
        assert mr.allocate(1 << 20, stream=S(0)).ptr != b.ptr   # nor anyone's before the fence
        host.complete_all_events()
        got = {mr.allocate(1 << 20, stream=other).ptr for _ in range(3)}
        assert b.ptr in got  # other's own, at once
        """
    )


def test_a_free_on_the_allocations_stream_after_it_died_never_touches_it():
    run(
        """
        # Fixed segments: the growable one would wait for the free at its new peak (a
        # device synchronization) and then rightly hand b out again.
        emmpool.configure(segments="fixed")
        mr = cuda_core.resource(0)
        s = S(host.create_stream())
        b = mr.allocate(24 << 20, stream=s)
        host.destroy_stream(s.handle)
        b.close()  # the dead handle, as recorded in the Buffer
        reborn = S(host.create_stream())
        assert reborn.handle == s.handle  # another stream with the same handle
        got = [mr.allocate(24 << 20, stream=reborn).ptr for _ in range(2)]
        assert b.ptr not in got  # reborn does not follow the dead stream's work
        assert host.stats()["dead_stream_uses"] == 0
        emmpool.trim()  # a device synchronization fences it
        assert emmpool.stats(0)["bytes_waiting"] == 0
        """
    )


def test_no_stream_is_cuda_cores_default_and_the_free_waits_for_an_event():
    run(
        """
        mr = cuda_core.resource(0)
        b = mr.allocate(4096)
        assert b.stream is None
        mr.deallocate(b.ptr, b.size)  # no stream: the allocation's ("none named")
        assert emmpool.stats(0)["bytes_waiting"] == 4096
        assert mr.allocate(4096, stream=S(0)).ptr != b.ptr  # not even in stream order
        host.complete_all_events()
        mr.pool.synchronize()
        assert emmpool.stats(0)["bytes_waiting"] == 0
        """
    )


def test_zero_bytes_is_address_zero_and_its_free_is_nothing():
    run(
        """
        mr = cuda_core.resource(0)
        b = mr.allocate(0, stream=S(0))
        assert (b.ptr, b.size) == (0, 0) and emmpool.stats(0)["allocations"] == 0
        b.close()
        mr.deallocate(0, 0, stream=S(0))
        """
    )


def test_numba_library_counts_as_numba():
    run(
        """
        mr = cuda_core.resource(0, library="numba")
        b = mr.allocate(256, stream=S(0))
        assert in_use("numba") == 256 and in_use("cuda_core") == 0
        b.close()
        assert in_use("numba") == 0
        """
    )


def test_bad_input_gets_a_clear_error_and_loses_nothing():
    run(
        """
        import numpy as np
        mr = cuda_core.resource(0)
        for size, err in [(-1, ValueError), (1.5, TypeError), ("8", TypeError)]:
            try:
                mr.allocate(size, stream=S(0))
            except err as e:
                assert "size" in str(e) or "negative" in str(e), e
            else:
                raise AssertionError(size)
        assert mr.allocate(np.int64(512), stream=S(0)).size == 512  # any integer
        try:
            mr.allocate(8, stream=0)
        except TypeError as e:
            assert "stream must be" in str(e)
        else:
            raise AssertionError("stream=0")
        for bad, err in [(dict(library="tensorflow"), ValueError), (dict(device="0"), TypeError)]:
            try:
                cuda_core.EmmPoolMemoryResource(**bad)
            except err:
                pass
            else:
                raise AssertionError(bad)
        b = mr.allocate(300, stream=S(0))
        b.close()
        try:
            b.close()  # twice
        except emmpool.PoolError as e:
            assert "not a live allocation" in str(e)
        else:
            raise AssertionError("double free")
        try:  # a Buffer that cannot be made gives its block back
            RecordedBuffer.fail = True
            mr.allocate(1 << 20, stream=S(0))
        except RuntimeError:
            pass
        RecordedBuffer.fail = False
        assert emmpool.stats(0)["bytes_in_use"] == 512  # the np.int64 one only
        """
    )


def test_out_of_memory_is_cuda_cores_error_and_emmpools():
    run(
        """
        from cuda.core._utils.cuda_utils import CUDAError
        emmpool.configure(maximum_pool_size=64 << 20)
        mr = cuda_core.resource(0)
        keep = mr.allocate(48 << 20, stream=S(0))
        try:
            mr.allocate(32 << 20, stream=S(0))
        except CUDAError as e:
            assert isinstance(e, MemoryError) and isinstance(e, emmpool.OutOfMemoryError)
            msg = str(e)
            assert msg.startswith("CUDA_ERROR_OUT_OF_MEMORY") and "emmpool" in msg, msg
            assert "32.00 MiB" in msg and "device 0" in msg, msg
        else:
            raise AssertionError("no error")
        keep.close()
        assert mr.allocate(32 << 20, stream=S(0)).size == 32 << 20  # and it recovers
        """
    )


def test_install_on_a_device_object_and_from_numbas_plugin():
    run(
        """
        class Device:  # what install_on reads and writes of cuda.core's Device
            def __init__(self, i, mr):
                self.device_id, self.memory_resource = i, mr
        d = Device(1, object())
        mr = cuda_core.install_on(d)
        assert d.memory_resource is mr is cuda_core.resource(1)
        assert cuda_core.install_on(d) is mr  # idempotent
        numba = cuda_core.install_on(Device(1, mr), library="numba")
        assert numba is not mr and numba.library == "numba"
        # the plugin's bind: the cuda.core Device under numba's Device (numba's ._dev)
        from emmpool import plugin
        class NumbaDevice:
            _dev = Device(0, object())
        plugin._serve_cuda_core(NumbaDevice)
        assert NumbaDevice._dev.memory_resource is cuda_core.resource(0, library="numba")
        plugin._serve_cuda_core(object())  # a context attached from a third party: nothing
        """
    )


def test_use_for_cuda_core_keeps_another_resource_unless_asked_to_replace_it():
    run(
        """
        class Device:  # cuda.core's Device as install() uses it: one object per device
            made = {}
            def __new__(cls, i):
                if i not in cls.made:
                    d = cls.made[i] = object.__new__(cls)
                    d.device_id, d.memory_resource = i, cuda_core_default()
                return cls.made[i]
        def cuda_core_default():  # a resource of cuda.core's own: what emmpool takes over
            return type("DeviceMemoryResource", (), {"__module__": "cuda.core._memory"})()
        cuda_core.Device = Device

        done = emmpool.use_for_cuda_core([0, 1])
        assert isinstance(done, emmpool.Installed)
        assert (done.library, done.how, done.devices) == ("cuda_core", "memory resource", (0, 1))
        assert done.allocators == (cuda_core.resource(0), cuda_core.resource(1))
        assert all(Device(i).memory_resource is done.allocators[i] for i in (0, 1))
        assert emmpool.use_for_cuda_core([0, 1]) == done  # idempotent

        class TheirResource:  # another library's, set on device 1 by the program
            pass
        theirs = Device(1).memory_resource = TheirResource()
        Device(0).memory_resource = cuda_core_default()
        try:
            emmpool.use_for_cuda_core([0, 1])
        except emmpool.AllocatorConflictError as e:
            message = str(e)
        else:
            raise AssertionError("replaced another's resource")
        assert message.startswith("cuda.core's Device(1).memory_resource is "
                                  "__main__.TheirResource already. emmpool does not replace"), message
        assert "use_for_cuda_core(replace=True)" in message, message
        assert Device(1).memory_resource is theirs  # nothing changed, on either device
        assert type(Device(0).memory_resource).__name__ == "DeviceMemoryResource"
        assert emmpool.use_for_cuda_core([0, 1], replace=True) == done
        assert Device(1).memory_resource is done.allocators[1]
        """
    )


# cuda.core's own Buffer and Stream: a Buffer made over a stream other than a default-stream
# token (0, 1, 2) needs no CUDA context, so these run the resource's C allocate and deallocate
# (methods_for) as cuda.core calls them, Buffer.close() and garbage collection included.
REAL = """
from cuda.core import Buffer, Stream
cuda_core.Buffer = Buffer
real = lambda: Stream.from_handle(host.create_stream())
"""


def run_real(body: str):
    run(REAL + textwrap.dedent(body))


def test_cuda_cores_own_buffer_and_stream_go_through_the_c_methods():
    run_real(
        """
        mr = cuda_core.resource(0)
        builtin = type(len)
        assert type(mr.allocate) is builtin and type(mr.deallocate) is builtin
        s = real()
        b = mr.allocate(1000, stream=s)
        assert type(b) is Buffer and b.size == 1000 and b.memory_resource is mr
        assert b.handle % 256 == 0 and in_use("cuda_core") == 1024
        ptr = b.handle
        queries = host.stats()["stream_id_queries"]
        b.close()  # cuda.core calls deallocate(ptr, size, stream=<the allocation's Stream>)
        assert host.stats()["stream_id_queries"] == queries
        assert emmpool.stats(0)["bytes_in_use"] == 0
        assert mr.allocate(1000, stream=s).handle == ptr  # the same stream, at once
        assert emmpool.stats(0)["same_stream_reuses"] == 1
        assert emmpool.stats(0)["bytes_in_use"] == 0  # that Buffer, dropped: cuda.core freed it

        other = real()
        b = mr.allocate(1 << 20, stream=s)
        ptr = b.handle
        b.close(other)  # in other's order: fenced for s
        assert mr.allocate(1 << 20, stream=s).handle != ptr
        host.complete_all_events()
        assert ptr in {mr.allocate(1 << 20, stream=other).handle for _ in range(3)}

        b = mr.allocate(4096, stream=s)
        ptr = b.handle
        b.close()
        for stream in (s, None):
            try:
                mr.deallocate(ptr, 4096, stream=stream)  # a second free of the block
            except emmpool.PoolError as e:
                assert "not a live allocation" in str(e), e
            else:
                raise AssertionError("double free")

        # No Python frame of the resource's methods on this path; one where it falls back.
        import sys
        methods = {cuda_core.EmmPoolMemoryResource.allocate.__code__,
                   cuda_core.EmmPoolMemoryResource.deallocate.__code__}
        frames = []
        def profile(frame, event, arg):
            if event == "call" and frame.f_code in methods:
                frames.append(frame.f_code.co_name)
        sys.setprofile(profile)
        mr.allocate(1000, stream=s).close()
        sys.setprofile(None)
        assert frames == [], frames
        sys.setprofile(profile)
        mr.allocate(0, stream=s).close()  # zero bytes: the Python method's
        sys.setprofile(None)
        assert frames == ["allocate"], frames
        """
    )


def test_the_c_methods_leave_every_other_call_to_the_python_ones():
    run_real(
        """
        import numpy as np
        mr = cuda_core.resource(0)
        s = real()
        sizes = [(-1, ValueError), (1.5, TypeError), ("8", TypeError), (1 << 70, Exception)]
        for size, err in sizes:
            try:
                mr.allocate(size, stream=s)
            except err as e:
                assert err is Exception or "size" in str(e) or "negative" in str(e), e
            else:
                raise AssertionError(size)
        z = mr.allocate(0, stream=s)
        assert z.size == 0 and z.handle == 0 and emmpool.stats(0)["allocations"] == 0
        z.close()
        kept = mr.allocate(np.int64(512), stream=s)
        assert kept.size == 512
        for bad in (0, "s", object()):
            try:
                mr.allocate(8, stream=bad)
            except TypeError as e:
                assert "stream must be" in str(e), e
            else:
                raise AssertionError(bad)
        try:
            mr.allocate(8, s)  # stream is keyword-only
        except TypeError:
            pass
        else:
            raise AssertionError("positional stream")
        cuda_core.Buffer = RecordedBuffer  # a bare address to free by hand
        b = mr.allocate(300, stream=s)
        cuda_core.Buffer = Buffer
        # a NumPy address, a stream that is an object with __cuda_stream__
        mr.deallocate(np.uint64(b.ptr), 300, stream=S(host.create_stream()))
        assert emmpool.stats(0)["bytes_in_use"] == 512  # `kept` alone

        class Mine(cuda_core.EmmPoolMemoryResource):  # a subclass's own methods are kept
            def allocate(self, size, *, stream=None):
                return ("mine", size)
        mine = Mine(0)
        assert mine.allocate(8, stream=s) == ("mine", 8) and "allocate" not in vars(mine)
        """
    )


def test_the_c_allocate_raises_as_the_method_and_gives_back_what_it_cannot_hand_out():
    run_real(
        """
        from cuda.core._utils.cuda_utils import CUDAError
        emmpool.configure(maximum_pool_size=64 << 20)
        mr = cuda_core.resource(0)
        s = real()
        keep = mr.allocate(48 << 20, stream=s)
        try:
            mr.allocate(32 << 20, stream=s)
        except CUDAError as e:
            assert isinstance(e, MemoryError) and isinstance(e, emmpool.OutOfMemoryError)
            assert type(e) is cuda_core.OutOfMemoryError
            msg = str(e)
            assert msg.startswith("CUDA_ERROR_OUT_OF_MEMORY") and "32.00 MiB" in msg, msg
            assert isinstance(e.__context__, _core.OutOfMemoryError) and e.__suppress_context__
        else:
            raise AssertionError("no error")
        keep.close()

        cuda_core.Buffer = RecordedBuffer  # Buffer as the module has it at each call
        RecordedBuffer.fail = True
        try:
            mr.allocate(1 << 20, stream=s)
        except RuntimeError as e:
            assert str(e) == "no context"
        else:
            raise AssertionError("no error")
        RecordedBuffer.fail = False
        assert emmpool.stats(0)["bytes_in_use"] == 0  # the block went back
        b = mr.allocate(1 << 20, stream=s)
        assert type(b) is RecordedBuffer and b.stream is s
        """
    )


def test_a_resource_dropped_is_collected_with_its_c_methods():
    run(
        """
        import gc
        gc.collect()
        def count():
            return sum(type(o) is cuda_core.EmmPoolMemoryResource for o in gc.get_objects())
        before = count()
        for _ in range(100):
            cuda_core.EmmPoolMemoryResource(0)
        gc.collect()
        assert count() == before, (count(), before)
        """
    )


def test_the_resource_keeps_cuda_cores_interface_as_cuda_core_states_it():
    # Every member cuda.core's MemoryResource declares, overridden, with its parameters as the
    # base class names them (the stream keyword-only); the stream emmpool's methods also take as
    # None is an addition (cuda.core's callers always pass one).
    import inspect

    from cuda.core import MemoryResource

    from emmpool.cuda_core import EmmPoolMemoryResource

    declared = {n for n, v in vars(MemoryResource).items()
                if not n.startswith("_") and (callable(v) or isinstance(v, property)
                                              or inspect.isdatadescriptor(v))}
    assert {"allocate", "deallocate", "device_id", "is_device_accessible",
            "is_host_accessible", "is_managed"} <= declared, declared
    for name in declared:
        ours = inspect.getattr_static(EmmPoolMemoryResource, name)
        assert ours is not inspect.getattr_static(MemoryResource, name), f"{name} not overridden"
    for name in ("allocate", "deallocate"):
        base = inspect.signature(getattr(MemoryResource, name)).parameters
        mine = inspect.signature(getattr(EmmPoolMemoryResource, name)).parameters
        assert list(mine)[:len(base)] == list(base), (name, list(mine), list(base))
        for p in base:
            assert mine[p].kind == base[p].kind, (name, p, mine[p].kind, base[p].kind)
        assert mine["stream"].kind is inspect.Parameter.KEYWORD_ONLY

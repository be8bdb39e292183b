"""The PyTorch allocator extension's C entry points (c_api_torch.cpp) over the host driver, and
emmpool._torch's choices and messages; no GPU needed (tests/test_gpu_torch.py has the GPU side).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import needs, requires

pytestmark = pytest.mark.torch

C_ENTRIES = textwrap.dedent(
    """
    import ctypes as c
    import emmpool
    from emmpool import _core

    host = _core.HostDriver(devices=1, capacity=1 << 30)
    _core._use_driver_for_all_pools(host)
    emmpool.configure(maximum_pool_size="512MiB", segments="growable", growable_page_size="2MiB")
    lib = c.CDLL(_core.__file__)

    # emmpool/torch_api.h, read a second time: a layout that drifts from the header's shows.
    class Error(c.Structure):
        _fields_ = [("kind", c.c_int32), ("message", c.c_char * 512)]
    class Stats(c.Structure):
        _fields_ = [(n, c.c_uint64) for n in (
            "allocated_bytes peak_allocated_bytes reserved_bytes peak_reserved_bytes "
            "inactive_bytes blocks_in_use segments").split()]
    class Accumulated(c.Structure):
        _fields_ = [(n, c.c_uint64) for n in (
            "allocated_bytes freed_bytes requested_bytes requested_freed_bytes allocations "
            "frees segment_allocations segment_releases out_of_memory dormant_fences").split()]
    class Row(c.Structure):
        _fields_ = [("segment", c.c_uint64), ("segment_size", c.c_uint64), ("ptr", c.c_uint64),
                    ("size", c.c_uint64), ("stream", c.c_uint64), ("state", c.c_uint8),
                    ("library", c.c_uint8), ("kind", c.c_uint8), ("reserved_", c.c_uint8 * 5)]
    class Event(c.Structure):
        _fields_ = [("address", c.c_uint64), ("size", c.c_uint64), ("action", c.c_uint8),
                    ("kind", c.c_uint8), ("library", c.c_uint8), ("reserved_", c.c_uint8 * 5)]
    class Id(c.Structure):
        _fields_ = [("first", c.c_uint64), ("second", c.c_uint64)]
    class Pages(c.Structure):
        _fields_ = [(n, c.c_uint64) for n in "first_page page_size offset block_size pages".split()]
        _fields_ += [("key", c.c_ubyte * 16)]
    class Block(c.Structure):
        _fields_ = [("ptr", c.c_uint64), ("size", c.c_uint64), ("stream", c.c_uint64),
                    ("pool", Id), ("device", c.c_int32), ("live", c.c_uint8),
                    ("foreign", c.c_uint8), ("reserved_", c.c_uint8 * 2)]
    E = c.POINTER(Error)

    def fn(name, restype, *argtypes):
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, list(argtypes)
        return f
    abi = fn("emmpool_torch_abi_version", c.c_int)
    allocate = fn("emmpool_torch_allocate", c.c_void_p, c.c_size_t, c.c_int, c.c_void_p, E)
    free = fn("emmpool_torch_free", None, c.c_void_p, c.c_size_t, c.c_int, c.c_void_p)
    record = fn("emmpool_torch_record_stream", c.c_int, c.c_void_p, c.c_int, c.c_void_p, E)
    block_size = fn("emmpool_torch_block_size", c.c_size_t, c.c_void_p, c.c_int)
    stats_of = fn("emmpool_torch_stats_of", c.c_int, c.c_int, c.POINTER(Stats))
    accumulated_of = fn("emmpool_torch_accumulated_of", c.c_int, c.c_int,
                        c.POINTER(Accumulated))
    reset_peaks = fn("emmpool_torch_reset_peaks", None, c.c_int)
    reset_accumulated = fn("emmpool_torch_reset_accumulated", None, c.c_int)
    trim = fn("emmpool_torch_trim", c.c_size_t, c.c_int)
    largest = fn("emmpool_torch_largest_block", c.c_size_t, c.c_int)
    ipc = fn("emmpool_torch_ipc_handle", c.c_int, c.c_void_p, c.c_int, c.c_char_p,
             c.POINTER(c.c_size_t), E)
    set_max = fn("emmpool_torch_set_maximum", c.c_int, c.c_int, c.c_size_t, E)
    maximum = fn("emmpool_torch_maximum", c.c_size_t, c.c_int)
    layout = fn("emmpool_torch_layout", c.c_long, c.c_int, c.POINTER(Row), c.c_size_t)
    name = fn("emmpool_library_name", c.c_char_p, c.c_int)
    outside = fn("emmpool_torch_reserve_outside", c.c_int, c.c_int, c.c_longlong, E)
    watch = fn("emmpool_torch_watch_segments", None, c.c_int)
    events = fn("emmpool_torch_segment_events", c.c_long, c.c_int, c.POINTER(Event), c.c_size_t)
    p_create = fn("emmpool_private_create_or_incref", None, c.c_int, Id)
    p_begin = fn("emmpool_private_begin", c.c_int, c.c_int, Id, E)
    p_end = fn("emmpool_private_end", None, c.c_int, Id)
    p_allocate = fn("emmpool_private_allocate", c.c_void_p, Id, c.c_size_t, c.c_int, c.c_void_p, E)
    p_take = fn("emmpool_private_take", c.c_void_p, Id, c.c_size_t, c.c_int, c.c_void_p)
    p_adopt = fn("emmpool_private_adopt_foreign", c.c_int, Id, c.c_void_p, c.c_size_t, c.c_int,
                 c.c_void_p, E)
    p_free = fn("emmpool_private_free", None, c.c_void_p)
    p_release = fn("emmpool_private_release", None, Id)
    p_device = fn("emmpool_private_device_of", c.c_int, c.c_void_p)
    p_live = fn("emmpool_private_live_blocks", c.c_long, Id, c.POINTER(c.c_uint64), c.c_size_t)
    p_returned = fn("emmpool_private_returned_foreign", c.c_long, c.POINTER(Block), c.c_size_t)
    share_pages = fn("emmpool_ipc_share_pages", c.c_int, c.c_void_p, c.c_int,
                     c.POINTER(Pages), c.POINTER(c.c_int32), c.c_size_t, E)
    open_pages = fn("emmpool_ipc_open_pages", c.c_void_p, c.c_int, c.POINTER(c.c_int32),
                    c.c_size_t, c.c_uint64, E)
    close = fn("emmpool_ipc_close", None, c.c_void_p)
    service = fn("emmpool_ipc_service", c.c_long, c.c_char_p, c.c_size_t, E)
    open_offer = fn("emmpool_ipc_open_offer", c.c_void_p, c.c_int, c.c_char_p, c.c_size_t,
                    c.c_char_p, c.c_int, c.c_uint64, c.c_uint64, c.POINTER(c.c_int32),
                    c.c_size_t, E)
    assert abi() == 8

    def snapshot():
        v = Stats()
        assert stats_of(0, c.byref(v)) == 0
        return v

    def accumulated():
        v = Accumulated()
        assert accumulated_of(0, c.byref(v)) == 0
        return v

    def in_use():  # every library's blocks, as the pool counts them
        return emmpool.stats(0)["bytes_in_use"]

    MiB = 1 << 20
    s = host.create_stream()
    why = Error()
    assert stats_of(1, c.byref(Stats())) == -1  # no pool there, and none made
    watch(1)
    p = allocate(3 * MiB - 100, 0, s, c.byref(why))
    assert p, why.message
    v, a = snapshot(), accumulated()
    assert v.allocated_bytes == 3 * MiB == v.peak_allocated_bytes and v.blocks_in_use == 1, v
    assert v.reserved_bytes >= 3 * MiB and v.inactive_bytes == v.reserved_bytes - 3 * MiB
    assert a.allocations == 1 and a.allocated_bytes == 3 * MiB and a.freed_bytes == 0
    assert a.requested_bytes == 3 * MiB - 100  # as asked; the rest as the pool rounds
    assert block_size(p, 0) == 3 * MiB and block_size(p + 256, 0) == 0
    # the segment made for it, as a memory history reads it
    got = (Event * 8)()
    n = events(0, got, 8)
    # pages of the growable segment mapped for it and its room (a fixed segment's would be
    # action 0, made)
    mapped = [got[i] for i in range(n)]
    assert mapped and all(e.action == 2 and e.kind == 2 and e.library == 3 for e in mapped)
    assert mapped[0].address == p and sum(e.size for e in mapped) >= 3 * MiB
    assert events(0, got, 8) == 0  # taken
    # the cap (512 MiB): refused with the reason, kind 0 = out of memory
    q = allocate(1 << 30, 0, s, c.byref(why))
    assert q is None and why.kind == 0 and b"out of memory" in why.message, why.message
    assert emmpool.stats(0)["largest_free_block"] <= largest(0) <= 512 * MiB, largest(0)
    # record_stream: a pool block is accepted, another pointer refused with the reason
    other = host.create_stream()
    assert record(p, 0, other, c.byref(why)) == 0, why.message
    assert record(p + 256, 0, other, c.byref(why)) == -1 and why.message
    # IPC: a growable block shares its pages (a fixed one its segment's handle, below)
    pages, fds = Pages(), (c.c_int32 * 4)()
    assert share_pages(p + 4096, 0, c.byref(pages), fds, 4, c.byref(why)) == 0, why.message
    assert pages.first_page == p and pages.offset == 4096 and pages.pages == 2, pages.pages
    base = open_pages(0, fds, 2, pages.page_size, c.byref(why))
    assert base and base != p, why.message
    close(base)
    # ... and as a receiver on emmpool asks for them: of the sender's IPC service, by its
    # address and the block's key (the trailer of the extension's handle), no descriptor of
    # ours sent.
    address = c.create_string_buffer(8)
    n = service(address, 8, c.byref(why))
    assert n > 8, why.message  # the room was short: asked again with more
    address = c.create_string_buffer(n)
    assert service(address, n, c.byref(why)) == n and address.raw[0] == 0
    base = open_offer(0, address.raw, n, bytes(pages.key), 0, pages.first_page, pages.page_size,
                      fds, 2, c.byref(why))
    assert base and base != p, why.message
    close(base)
    assert not open_offer(0, address.raw, n, bytes(16), 0, pages.first_page, pages.page_size,
                          fds, 2, c.byref(why))
    assert b"does not share these pages" in why.message, why.message
    handle, offset = c.create_string_buffer(64), c.c_size_t(99)
    assert ipc(p, 0, handle, c.byref(offset), c.byref(why)) == -1
    assert b"no legacy IPC handle" in why.message, why.message
    small = allocate(4096, 0, s, c.byref(why))  # a small segment: fixed
    assert share_pages(small, 0, c.byref(pages), fds, 4, c.byref(why)) == 1
    assert ipc(small + 256, 0, handle, c.byref(offset), c.byref(why)) == 0, why.message
    assert offset.value == small + 256 - (small & ~((2 << 20) - 1)), offset.value
    free(small, 0, 0, s)
    assert ipc(12345, 0, handle, c.byref(offset), c.byref(why)) == -1
    assert b"not a block" in why.message
    # the layout: every block of every segment; p is torch's, on stream s, in a large segment
    n = layout(0, None, 0)
    rows = (Row * n)()
    assert layout(0, rows, n) == n >= 1
    mine = [r for r in rows if r.ptr == p]
    assert len(mine) == 1 and mine[0].size == 3 * MiB and mine[0].stream == s
    assert mine[0].state == 1 and mine[0].kind == 2  # the growable segment
    assert name(mine[0].library) == b"torch" and name(99) is None
    segments = {}
    for r in rows:  # the blocks of a segment tile it
        segments.setdefault((r.segment, r.segment_size), []).append(r.size)
    assert all(sum(sizes) == size for (_, size), sizes in segments.items()), segments
    # the cap: lowered below what is in use is refused with the reason; else it holds
    assert maximum(0) == 512 * MiB
    assert set_max(0, MiB, c.byref(why)) == -1 and b"in use" in why.message, why.message
    assert set_max(0, 64 * MiB, c.byref(why)) == 0 and maximum(0) == 64 * MiB
    assert allocate(100 * MiB, 0, s, c.byref(why)) is None and why.kind == 0
    assert set_max(0, 512 * MiB, c.byref(why)) == 0
    # another allocator's bytes count against the cap: what passes it is refused, counting
    # nothing; the pool cannot grow into what they hold, nor be capped below it
    held = 512 * MiB - snapshot().reserved_bytes - 50 * MiB  # leaves the pool 50 MiB
    assert outside(0, held + 51 * MiB, c.byref(why)) == 1
    assert outside(0, held, c.byref(why)) == 0
    assert allocate(100 * MiB, 0, s, c.byref(why)) is None and why.kind == 0
    assert b"reserved by another allocator" in why.message, why.message
    assert set_max(0, held, c.byref(why)) == -1 and b"another allocator" in why.message
    assert outside(0, -held, c.byref(why)) == 0
    q = allocate(100 * MiB, 0, s, c.byref(why))
    assert q, why.message
    free(q, 0, 0, s)
    # a private pool: begun (the pool captures), allocated to, checkpointed, released
    graph = Id(1, 0)
    assert p_begin(0, graph, c.byref(why)) == 0, why.message
    assert p_begin(0, graph, c.byref(why)) == -1 and b"already" in why.message
    b = p_allocate(graph, MiB, 0, s, c.byref(why))
    assert b and p_device(b) == 0 and p_device(p) == -1
    live = (c.c_uint64 * 4)()
    assert p_live(graph, live, 4) == 1 and live[0] == b
    assert block_size(b, 0) == MiB and snapshot().allocated_bytes == 4 * MiB
    p_end(0, graph)
    # free within its pool: still the pool's allocation, but PyTorch's cache, out of its bytes
    # and blocks in use and into its frees; taken again, in use again
    v, a, held = snapshot(), accumulated(), in_use()
    p_free(b)
    w, f = snapshot(), accumulated()
    assert in_use() == held and w.allocated_bytes == v.allocated_bytes - MiB, (v, w)
    assert w.blocks_in_use == v.blocks_in_use - 1 and f.frees == a.frees + 1
    assert f.freed_bytes == a.freed_bytes + MiB
    assert p_take(graph, MiB, 0, s) == b and snapshot().allocated_bytes == v.allocated_bytes
    assert accumulated().allocated_bytes == a.allocated_bytes + MiB
    p_free(b)
    # taken again for a smaller request: the whole cached block is handed out and counted, so
    # what was freed never goes back
    freed = accumulated().freed_bytes
    assert p_take(graph, 600 * 1024, 0, s) == b
    assert accumulated().freed_bytes == freed and snapshot().allocated_bytes == v.allocated_bytes
    p_free(b)
    p_release(graph)
    assert in_use() == held - MiB and p_device(b) == -1
    assert snapshot().allocated_bytes == w.allocated_bytes
    # a MemPool's own allocator's block: reserved as PyTorch counts, sized by the private pools,
    # handed back to be deleted once its pool is released
    mem_pool, foreign = Id(2, 0), 0x6000_0000_0000  # no address of the host driver
    reserved = snapshot().reserved_bytes
    p_create(0, mem_pool)
    assert p_adopt(mem_pool, foreign, 2 * MiB, 0, s, c.byref(why)) == 0, why.message
    assert block_size(foreign, 0) == 2 * MiB and p_device(foreign) == 0
    assert snapshot().reserved_bytes == reserved + 2 * MiB
    in_use_before = snapshot()  # live: PyTorch's allocated bytes and blocks, as its own
    p_free(foreign)
    assert snapshot().allocated_bytes == in_use_before.allocated_bytes - 2 * MiB
    assert snapshot().blocks_in_use == in_use_before.blocks_in_use - 1
    p_release(mem_pool)
    back = (Block * 4)()
    assert p_returned(back, 4) == 1 and back[0].ptr == foreign and back[0].foreign == 1
    assert snapshot().reserved_bytes == reserved and block_size(foreign, 0) == 0
    free(p, 0, 0, s)
    v = snapshot()
    assert v.allocated_bytes == 0 and v.peak_allocated_bytes >= 3 * MiB, v
    reset_peaks(0)
    assert snapshot().peak_allocated_bytes == 0
    # the accumulated counts start again; the pool's own go on
    allocations = emmpool.stats(0)["allocations"]
    reset_accumulated(0)
    assert all(getattr(accumulated(), n) == 0 for n, _ in Accumulated._fields_)
    q = allocate(MiB, 0, s, c.byref(why))
    free(q, 0, 0, s)
    a = accumulated()
    assert a.allocations == 1 and a.allocated_bytes == MiB == a.freed_bytes, a
    assert a.requested_bytes == MiB == a.requested_freed_bytes and a.frees == 1, a
    assert emmpool.stats(0)["allocations"] == allocations + 1
    while events(0, got, 8) == 8:  # what the calls above made and released
        pass
    host.complete_all_events()
    trim(0)
    n = events(0, got, 8)
    assert n >= 1 and all(got[i].action in (1, 3) for i in range(n))  # released or unmapped
    watch(0)
    print("OK")
    """
)


def test_c_entry_points_over_the_host_driver():
    p = subprocess.run([sys.executable, "-c", C_ENTRIES], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr


def test_choice_is_checked(monkeypatch):
    from emmpool import _config, _torch

    monkeypatch.setattr(_config, "_applied", None)  # the environment not yet read
    monkeypatch.setenv("EMMPOOL_TORCH_ALLOCATOR", "fast")
    with pytest.raises(ValueError, match="EMMPOOL_TORCH_ALLOCATOR='fast': expected 'auto' or "
                                         "'extension' or 'pluggable'"):
        _torch._choice(None)
    assert _torch._choice("Pluggable") == "pluggable"
    monkeypatch.delenv("EMMPOOL_TORCH_ALLOCATOR")
    assert _torch._choice(None) == "auto"


def test_extension_source_is_shipped_with_the_package():
    import ctypes
    import re

    from emmpool import _core, _torch

    for path in (_torch.SOURCE, *_torch.HEADERS):
        assert path.is_file(), path
    # the header's list of its functions (what the extension looks up) names exactly the
    # functions it declares, each once, and every one exists in _core
    header = (_torch.INCLUDE / "emmpool" / "torch_api.h").read_text()
    listed = re.findall(r"^  X\((emmpool_[a-z_]+)\) *\\?$", header, re.M)
    declared = re.findall(r"^[a-z][a-z_ ]*\** ?\*?\b(emmpool_[a-z_]+)\(", header, re.M)
    assert len(listed) > 30 and listed == declared, (listed, declared)
    table = re.search(r"^#define (\w+)\(X\)", header, re.M).group(1)  # the list's name
    assert table + "(" in (_torch.EXTENSION / "entry_points.hpp").read_text(), table
    lib = ctypes.CDLL(_core.__file__)
    for name in listed:
        assert hasattr(lib, name), name


@requires("torch")
def test_missing_toolkit_is_said(monkeypatch):
    from torch.utils import cpp_extension

    from emmpool import _toolchain, _torch

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(_toolchain, "cuda_home", lambda *guesses: None)  # none here either
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    with pytest.raises(_torch.TorchExtensionError, match="no CUDA toolkit found"):
        _torch.build_extension()
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(_torch.TorchExtensionError, match="ninja is not installed"):
        _torch.build_extension()


@requires("torch")
def test_extension_name_is_per_source_and_torch_version():
    import torch

    from emmpool import _torch

    name = _torch.extension_name(torch)
    assert name.startswith("emmpool_torch_" + torch.__version__.split("+")[0].replace(".", "_"))
    assert name == _torch.extension_name(torch)


BUILD = textwrap.dedent(
    """
    from emmpool import _torch
    module = _torch.build_extension()
    assert module.abi >= 1 and callable(module.install)
    print("ok")
    """
)


@requires("torch")
def test_extension_builds_against_the_installed_torch(tmp_path):
    # No GPU needed to compile and load it: what a user's `pip install torch` + first
    # use_for_torch() does, with the flags PyTorch itself chooses (its C++ standard moved from
    # 17 to 20 in 2.12, and 2.14's headers need 20: a -std of ours made every build fail).
    import torch

    from emmpool import _torch

    if torch.version.cuda is None:
        pytest.skip(needs("a CUDA build of PyTorch", f"torch {torch.__version__} is a CPU build"))
    problem = _torch._build_problem()
    if problem is not None:
        pytest.skip(needs("the tools that build emmpool's PyTorch extension", problem))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]

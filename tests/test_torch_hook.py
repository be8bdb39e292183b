"""The PyTorch allocator extension's C entry points (c_api_torch.cpp) over the host driver, and
emmpool._torch's choices and messages; no GPU needed (tests/test_gpu_torch.py has the GPU side).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.torch

C_ENTRIES = textwrap.dedent(
    """
    import ctypes
    import emmpool
    from emmpool import _core

    host = _core.HostDriver(devices=1, capacity=1 << 30)
    _core._use_driver_for_all_pools(host)
    emmpool.configure(maximum_pool_size="512MiB")
    lib = ctypes.CDLL(_core.__file__)
    c = ctypes
    def fn(name, restype, *argtypes):
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, list(argtypes)
        return f
    abi = fn("emmpool_torch_abi_version", c.c_int)
    allocate = fn("emmpool_torch_allocate", c.c_void_p, c.c_size_t, c.c_int, c.c_void_p,
                  c.POINTER(c.c_int), c.c_char_p, c.c_size_t)
    free = fn("emmpool_torch_free", None, c.c_void_p, c.c_size_t, c.c_int, c.c_void_p)
    record = fn("emmpool_torch_record_stream", c.c_int, c.c_void_p, c.c_int, c.c_void_p,
                c.c_char_p, c.c_size_t)
    stats = fn("emmpool_torch_stats", c.c_int, c.c_int, c.POINTER(c.c_uint64), c.c_int)
    reset_peaks = fn("emmpool_torch_reset_peaks", None, c.c_int)
    trim = fn("emmpool_torch_trim", c.c_size_t, c.c_int)
    largest = fn("emmpool_torch_largest_block", c.c_size_t, c.c_int)
    ipc = fn("emmpool_torch_ipc_handle", c.c_int, c.c_void_p, c.c_int, c.c_char_p,
             c.POINTER(c.c_size_t), c.c_char_p, c.c_size_t)
    set_max = fn("emmpool_torch_set_maximum", c.c_int, c.c_int, c.c_size_t, c.c_char_p, c.c_size_t)
    maximum = fn("emmpool_torch_maximum", c.c_size_t, c.c_int)
    capture = fn("emmpool_torch_capture", c.c_int, c.c_int, c.c_int)
    layout = fn("emmpool_torch_layout", c.c_long, c.c_int, c.POINTER(c.c_uint64), c.c_size_t)
    tag_name = fn("emmpool_torch_tag_name", c.c_char_p, c.c_int)
    outside = fn("emmpool_torch_reserve_outside", c.c_int, c.c_int, c.c_longlong, c.c_char_p,
                 c.c_size_t)
    assert abi() == 3

    def snapshot():
        v = (c.c_uint64 * 16)()
        assert stats(0, v, 16) == 16
        return list(v)

    MiB = 1 << 20
    s = host.create_stream()
    kind, why = c.c_int(-1), c.create_string_buffer(256)
    p = allocate(3 * MiB, 0, s, c.byref(kind), why, 256)
    assert p, why.value
    v = snapshot()
    assert v[0] == 3 * MiB and v[1] == 3 * MiB and v[3] >= 3 * MiB and v[5] == 1, v
    # the cap (512 MiB): refused with the reason, kind 0 = out of memory
    q = allocate(1 << 30, 0, s, c.byref(kind), why, 256)
    assert q is None and kind.value == 0 and b"out of memory" in why.value, (kind, why.value)
    assert v[14] <= largest(0) <= 512 * MiB, largest(0)
    # record_stream: a pool block is accepted, another pointer refused with the reason
    other = host.create_stream()
    assert record(p, 0, other, why, 256) == 0, why.value
    assert record(p + 256, 0, other, why, 256) == -1 and why.value, why.value
    # IPC: the segment's handle and the block's offset
    handle, offset = c.create_string_buffer(64), c.c_size_t(99)
    assert ipc(p, 0, handle, c.byref(offset), why, 256) == 0, why.value
    assert offset.value == 0
    assert ipc(12345, 0, handle, c.byref(offset), why, 256) == -1 and b"not a block" in why.value
    # the layout: every block of every segment; p is torch's, on stream s, in a large segment
    n = layout(0, None, 0)
    rows = (c.c_uint64 * (8 * n))()
    assert layout(0, rows, n) == n >= 1
    blocks = [tuple(rows[8 * i:8 * i + 8]) for i in range(n)]
    mine = [b for b in blocks if b[2] == p]
    assert len(mine) == 1 and mine[0][3] == 3 * MiB and mine[0][4] == s and mine[0][5] == 1, mine
    assert tag_name(mine[0][6]) == b"torch" and tag_name(99) is None
    assert sum(b[3] for b in blocks) == snapshot()[3]  # the blocks tile what is reserved
    # the cap: lowered below what is in use is refused with the reason; else it holds
    assert maximum(0) == 512 * MiB
    assert set_max(0, MiB, why, 256) == -1 and b"in use" in why.value, why.value
    assert set_max(0, 64 * MiB, why, 256) == 0 and maximum(0) == 64 * MiB
    assert allocate(100 * MiB, 0, s, c.byref(kind), why, 256) is None and kind.value == 0
    assert set_max(0, 512 * MiB, why, 256) == 0
    # another allocator's bytes count against the cap: what passes it is refused, counting
    # nothing; the pool cannot grow into what they hold, nor be capped below it
    held = 512 * MiB - snapshot()[3] - 50 * MiB  # leaves the pool 50 MiB to grow into
    assert outside(0, held + 51 * MiB, why, 256) == 1
    assert outside(0, held, why, 256) == 0
    assert allocate(100 * MiB, 0, s, c.byref(kind), why, 256) is None and kind.value == 0
    assert b"reserved by another allocator" in why.value, why.value
    assert set_max(0, held, why, 256) == -1 and b"another allocator" in why.value, why.value
    assert outside(0, -held, why, 256) == 0
    q = allocate(100 * MiB, 0, s, c.byref(kind), why, 256)
    assert q, why.value
    free(q, 0, 0, s)
    # a capture: begin and end pair; an end without a begin is refused
    assert capture(0, 1) == 0 and capture(0, 0) == 0 and capture(0, 0) == -1
    free(p, 0, 0, s)
    v = snapshot()
    assert v[0] == 0 and v[2] >= 3 * MiB, v
    reset_peaks(0)
    assert snapshot()[2] == 0
    host.complete_all_events()
    trim(0)
    print("OK")
    """
)


def test_c_entry_points_over_the_host_driver():
    p = subprocess.run([sys.executable, "-c", C_ENTRIES], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr


def test_choice_is_checked(monkeypatch):
    from emmpool import _torch

    monkeypatch.setenv("EMMPOOL_TORCH_ALLOCATOR", "fast")
    with pytest.raises(ValueError, match="EMMPOOL_TORCH_ALLOCATOR='fast': expected one of"):
        _torch._choice(None)
    assert _torch._choice("Pluggable") == "pluggable"
    monkeypatch.delenv("EMMPOOL_TORCH_ALLOCATOR")
    assert _torch._choice(None) == "auto"


def test_extension_source_is_shipped_with_the_package():
    from emmpool import _torch

    assert _torch.SOURCE.is_file(), _torch.SOURCE
    text = _torch.SOURCE.read_text()
    # every entry point the extension looks up exists in _core
    import ctypes

    from emmpool import _core

    lib = ctypes.CDLL(_core.__file__)
    import re

    for name in set(re.findall(r'"(emmpool_torch_[a-z_]+)"', text)):
        assert hasattr(lib, name), name


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
def test_missing_toolkit_is_said(monkeypatch):
    from torch.utils import cpp_extension

    from emmpool import _torch

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(_torch, "_cuda_home", lambda guess: None)  # none on this machine either
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    with pytest.raises(_torch.TorchExtensionError, match="no CUDA toolkit found"):
        _torch.build_extension()
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(_torch.TorchExtensionError, match="ninja is not installed"):
        _torch.build_extension()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
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


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
def test_extension_builds_against_the_installed_torch(tmp_path):
    # No GPU needed to compile and load it: what a user's `pip install torch` + first
    # use_for_torch() does, with the flags PyTorch itself chooses (its C++ standard moved from
    # 17 to 20 in 2.12, and 2.14's headers need 20: a -std of ours made every build fail).
    import torch

    from emmpool import _torch

    if torch.version.cuda is None:
        pytest.skip(f"torch {torch.__version__} is a CPU build: no CUDA allocator to build")
    problem = _torch._build_problem()
    if problem is not None:
        pytest.skip(f"the extension cannot be built here: {problem}")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]

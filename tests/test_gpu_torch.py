"""PyTorch with emmpool: each feature works, or raises what README's PyTorch section
says. GPU and PyTorch needed (skipped with the reason elsewhere).

Each scenario runs in its own interpreter (tests/torch_scenarios.py) under PyTorch's own
allocator ("native"), emmpool's allocator extension ("extension") or PyTorch's
CUDAPluggableAllocator over emmpool ("pluggable", the fallback where the extension cannot be
built). The first extension scenario compiles the extension (cached by PyTorch afterwards).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs, needs_module, require
from tests.processes import run_python

pytestmark = pytest.mark.torch


def _unavailable() -> str | None:
    """Why these tests cannot run here (they need PyTorch and a GPU, not Numba: not the `gpu`
    marker, whose check asks Numba), or None."""
    if importlib.util.find_spec("torch") is None:
        return needs_module("torch")
    import emmpool

    try:
        if emmpool._core.device_count() == 0:
            return needs("a CUDA GPU", "the CUDA driver reports no device")
    except emmpool.CudaError as e:
        return needs("a CUDA GPU", str(e).split(", so ")[0])
    return None


if _unavailable() is not None:  # the whole file: one line in pytest's summary, not one per test
    pytest.skip(_unavailable(), allow_module_level=True)

SCRIPT = Path(__file__).with_name("torch_scenarios.py")


def scenario(name: str, allocator: str, *extra: str, env: dict | None = None, timeout=300):
    """Run one scenario; return (results: dict merged from RESULT lines, raised: str | None,
    output)."""
    e = dict(os.environ)
    e.pop("EMMPOOL_TORCH_ALLOCATOR", None)
    e.update(env or {})
    p = run_python([str(SCRIPT), name, allocator, *extra], env=e, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "\nOK" in "\n" + p.stdout, out[-4000:]
    results, raised = {}, None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            results.update(json.loads(line[len("RESULT "):]))
        elif line.startswith(("RAISES ", "OOM ")):
            raised = line
    return results, raised, out


@pytest.fixture(scope="module")
def extension_builds():
    """Skip the extension tests, saying why, where emmpool's extension cannot be built."""
    code = ("import emmpool._torch as t; p = t._build_problem(); print('MISSING', p) if p "
            "else (t.build_extension(), print('BUILT'))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if p.stdout.startswith("MISSING "):  # a machine without the tools: emmpool falls back
        pytest.skip(needs("the tools that build emmpool's PyTorch extension",
                          p.stdout[8:].strip()))
    if "BUILT" not in p.stdout:
        msg = (p.stdout + p.stderr).strip().splitlines()
        pytest.fail("emmpool's PyTorch extension does not build: " + "\n".join(msg[-15:]))


def test_cudnn_benchmark_training(extension_builds):
    native, raised, out = scenario("cudnn_benchmark", "native")
    assert raised is None, out
    mine, raised, out = scenario("cudnn_benchmark", "extension")
    assert raised is None, out
    assert mine["losses"] == pytest.approx(native["losses"], rel=1e-3, abs=1e-4), (mine, native)


def test_cudnn_benchmark_pluggable_raises_pytorchs_error():
    _, raised, out = scenario("cudnn_benchmark", "pluggable")
    assert raised is not None and "does not yet support cacheInfo" in raised, out


def test_memory_stats(extension_builds):
    r, raised, out = scenario("memory_stats", "extension")
    assert raised is None, out
    MiB = 1 << 20
    assert r["delta"] == 8 * MiB and r["back"] == 0, r
    assert r["peak"] >= 8 * MiB and r["peak_after_reset"] < 8 * MiB, r
    assert r["peak_reserved"] >= r["reserved"] >= 8 * MiB, r
    assert r["reserved_after_empty"] < r["reserved"], r   # empty_cache trimmed emmpool's pool
    assert "allocated_bytes.all.current" in r["keys"] and r["summary_ok"], r
    assert 0 < r["free"] <= r["total"], r


def test_accumulated_stats_start_again_at_reset(extension_builds):
    r, raised, out = scenario("accumulated_stats", "extension")
    assert raised is None, out
    assert all(v for k, v in r.items() if k != "stats"), r


def test_profiler_reports_a_blocks_size_at_its_allocation_and_free(extension_builds):
    r, raised, out = scenario("profiler_sizes", "extension")
    assert raised is None, out
    assert r["allocation_reported"] and r["free_reported"], r


def test_memory_stats_pluggable_raises_pytorchs_error():
    _, raised, out = scenario("memory_stats", "pluggable")
    assert raised is not None and "does not yet support getDeviceStats" in raised, out


def test_record_stream(extension_builds):
    r, raised, out = scenario("record_stream", "extension")
    assert raised is None, out
    assert r["reused_while_busy"] is False, r


def test_record_stream_pluggable_is_ignored():
    """PyTorch's pluggable allocator drops record_stream (README: use emmpool.record_stream)."""
    r, raised, out = scenario("record_stream", "pluggable")
    assert raised is None, out
    assert r["reused_while_busy"] is True, r


def test_cuda_graph_capture_and_replay(extension_builds):
    r, raised, out = scenario("cuda_graph", "extension")
    assert raised is None, out
    assert r["replay_matches"], r
    assert r["sentinels_intact"], r   # the graph's memory is its own until it is destroyed
    assert r["graph_allocated_is_its_live_blocks"], r


def test_torch_compile(extension_builds):
    r, raised, out = scenario("compiled", "extension", timeout=600)
    assert raised is None, out
    assert r == {"default": True, "max-autotune-no-cudagraphs": True}, r


@pytest.mark.ipc
@pytest.mark.parametrize("segments", ["fixed", "growable"])
@pytest.mark.parametrize("child", ["extension", "native"])
def test_cross_process_tensor_sharing(child, segments, extension_builds):
    """torch.multiprocessing to a child on emmpool or on PyTorch's own allocator: a small tensor
    (a fixed segment's legacy handle) and a 4 MiB one (under growable segments, its pages in
    PyTorch's expandable-segment format, which PyTorch itself opens)."""
    for elements in (1024, 1 << 20):
        env = {"EMMPOOL_SEGMENTS": segments, "EMMCI_TEST_IPC_ELEMENTS": str(elements)}
        r, raised, out = scenario("ipc", "extension", child, env=env)
        assert raised is None, out
        assert r["child_sum"] == r["expected"] and r["child_exit"] == 0, r
        assert r["written_back"], r


@pytest.mark.ipc
def test_a_tensor_from_pytorchs_expandable_segments_opens_on_emmpool(extension_builds):
    """The other way: a process on PyTorch's allocator with expandable segments sends a 4 MiB
    tensor (pages, pidfd_getfd) to a child on emmpool."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           "EMMCI_TEST_IPC_ELEMENTS": str(1 << 20)}
    r, raised, out = scenario("ipc", "native", "extension", env=env)
    assert raised is None, out
    assert r["child_sum"] == r["expected"] and r["child_exit"] == 0, r
    assert r["written_back"], r


@pytest.mark.ipc
def test_tensors_cross_both_ways_where_no_process_may_copy_anothers_descriptors(
        extension_builds):
    """A parent and its child on emmpool's default (growable) segments, neither allowed
    pidfd_getfd (a seccomp filter: what Yama's ptrace_scope=1 or a container would refuse):
    4 MiB tensors each way, their pages handed over by the sender's IPC service."""
    from tests import no_ptrace

    if no_ptrace.supported() is not None:
        pytest.skip(needs(no_ptrace.supported(), "Linux on x86-64 or AArch64"))
    r, raised, out = scenario("ipc_without_ptrace", "extension")
    assert raised is None, out
    assert r["child_refused"] and r["parent_refused"], r
    assert r["child_sum"] == r["expected"] and r["written_back"], r
    assert r["back"] == r["back_expected"] and r["child_exit"] == 0, r


@pytest.mark.ipc
def test_cross_process_pluggable_raises_pytorchs_error():
    _, raised, out = scenario("ipc", "pluggable")
    assert raised is not None and "does not yet support shareipchandle" in raised.lower(), out  # PyTorch spells it shareIPcHandle


def test_memory_fraction_caps_the_pool(extension_builds):
    r, raised, out = scenario("memory_fraction", "extension")
    assert raised is None, out
    assert r["over"] == "OutOfMemoryError", r
    assert "is in use" in r["below"], r
    assert r["raised_again"], r
    if r["fraction"] is not None:
        assert abs(r["fraction"] - 0.25) < 0.01, r


@pytest.mark.parametrize("asserts", ["fast", "slow_path_asserts"])
def test_torch_compile_reduce_overhead_matches_eager(asserts, extension_builds):
    env = {"EMMCI_TEST_SLOW_ASSERTS": "1" if asserts != "fast" else "0"}
    r, raised, out = scenario("reduce_overhead", "extension", env=env, timeout=900)
    assert raised is None, out
    assert r == {k: True for k in ("transformer_inference", "cnn_inference",
                                   "transformer_training", "cnn_training")}, r


def test_graphs_sharing_a_pool_with_a_side_stream(extension_builds):
    r, raised, out = scenario("shared_pool_graphs", "extension")
    assert raised is None, out
    assert r == {"replays_match": True, "given_back": True}, r


def test_mem_pool(extension_builds):
    r, raised, out = scenario("mem_pool", "extension")
    assert raised is None, out
    assert r["inside_in_pool"] and r["outside_not_in_pool"] and r["pool_ids"], r
    assert r["use_count"] >= 1 and r["returned"], r


def test_history_and_snapshot(extension_builds):
    r, raised, out = scenario("history_snapshot", "extension")
    assert raised is None, out
    assert r["tiled"] and r["all_kept_live"] and r["freed_paired"] and r["frames"], r
    assert r["viz"], r
    assert {"alloc", "free_requested", "free_completed", "segment_alloc"} <= set(r["actions"]), r


def test_snapshot_names_every_library(extension_builds):
    require("cupy")
    r, raised, out = scenario("mixed_snapshot", "extension")
    assert raised is None, out
    assert r == {"numba": "numba", "cupy": "cupy", "torch": "torch"}, r


def test_native_allocator_passes_the_same_scenarios():
    """The scenarios' own checks hold under PyTorch's allocator (so that they can fail)."""
    for name in ("cuda_graph", "shared_pool_graphs", "mem_pool", "history_snapshot",
                 "accumulated_stats", "profiler_sizes"):
        r, raised, out = scenario(name, "native")
        assert raised is None, out
        assert all(v for k, v in r.items() if k not in ("actions", "stats", "sizes")), (name, r)


def test_out_of_memory_is_torchs_out_of_memory_error(extension_builds):
    _, raised, out = scenario("out_of_memory", "extension",
                              env={"EMMPOOL_MAXIMUM_POOL_SIZE": "256MiB"})
    assert raised is not None and raised.startswith("OOM emmpool: CUDA out of memory"), out
    # PyTorch's own sentences first, for the tools that read them
    assert "Tried to allocate 1024.00 MiB. GPU 0 has a total capacity of" in raised, out


def test_use_on_oom_pools_serve_before_the_oom_observers_hear(extension_builds):
    r, raised, out = scenario("oom_observers_after_use_on_oom", "extension",
                              env={"EMMPOOL_MAXIMUM_POOL_SIZE": "256MiB"})
    assert raised is None, out
    assert r["filled"] > 0 and r["served_from_pool"] and r["observers_quiet"], r
    assert r["raised"] and r["heard"] == 1, r


def test_graph_capture_beside_threads_that_allocate(extension_builds):
    """A graph captured in each capture mode while CuPy and Numba threads allocate and free from
    the same pool inside each capture: every capture replays right and no thread meets an
    error. (On the libraries' own allocators, Numba's cuMemAlloc inside a "global" capture fails
    with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and breaks the capture.)"""
    require("cupy")
    r, raised, out = scenario("capture_beside_threads", "extension", timeout=600)
    assert raised is None, out
    assert r["threads_done"] and r["thread_errors"] == [], r
    for mode, m in r["modes"].items():
        assert m["correct"] == m["captures"], (mode, r)
    # the threads worked while captures ran (else this proves nothing)
    assert r["overlapped"]["cupy"] > 0 and r["overlapped"]["numba"] > 0, r

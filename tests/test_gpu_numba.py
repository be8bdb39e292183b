"""Numba through the plugin on a real GPU (skipped, with the reason, where there is none).

Each scenario runs in a fresh interpreter with NUMBA_CUDA_MEMORY_MANAGER=emmpool.plugin and
must exit 0, print OK, and write nothing to stderr; here, under each installed package that
provides Numba's CUDA target (numba-cuda, numba-cuda-mlir)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests import gpu_scripts
from tests.processes import run_python

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent


def run(code: str, *args: str, mode: str = "pool", manager: str | None = "emmpool.plugin",
        package=None):
    """Run a scenario (tests/gpu_scripts.py) in a fresh interpreter, Numba's CUDA target taken
    from ``package`` (an emmpool._numba_packages.Package; numba-cuda unless given)."""
    from emmpool import _numba_packages

    package = package or _numba_packages.NUMBA_CUDA
    env = dict(os.environ, EMMPOOL_MODE=mode, EMMCI_TEST_CUDA=package.cuda)
    env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    if manager:
        env["NUMBA_CUDA_MEMORY_MANAGER"] = manager
    # A file, not -c: multiprocessing's spawn re-imports the main module by path.
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "scenario.py"
        script.write_text(code)
        return run_python([str(script), *args], env=env, timeout=300)


def check(p):
    """The scenario exited 0, printed OK last, and wrote nothing to stderr (but Numba's
    performance warnings about small grids). On failure, the tails of both streams in full."""
    stderr = "\n".join(
        line for line in p.stderr.splitlines() if "NumbaPerformanceWarning" not in line
        and "warn(NumbaPerformanceWarning" not in line and "grid size" not in line
    )
    if p.returncode != 0 or not p.stdout.strip().endswith("OK") or stderr.strip():
        pytest.fail(
            f"scenario exited {p.returncode}\n--- stdout (tail) ---\n{p.stdout[-4000:]}"
            f"\n--- stderr (tail) ---\n{p.stderr[-6000:]}",
            pytrace=False,
        )


@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_allocations_of_many_sizes_and_memory_info(mode, numba_package):
    check(run(gpu_scripts.ALLOC_SIZES, mode=mode, package=numba_package))


@pytest.mark.ipc
@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_ipc_of_slices_and_blocks_inside_a_segment(mode, numba_package):
    check(run(gpu_scripts.IPC_PRODUCER, mode=mode, package=numba_package))


@pytest.mark.ipc
@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_ipc_two_arrays_of_one_segment_open_at_once(mode, numba_package):
    check(run(gpu_scripts.IPC_SAME_SEGMENT_OPEN_TOGETHER, mode=mode, package=numba_package))


@pytest.mark.ipc
@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_ipc_of_memory_the_pool_did_not_allocate(mode, numba_package):
    check(run(gpu_scripts.IPC_FOREIGN, mode=mode, package=numba_package))


@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_device_memory_size_is_the_arrays_block(mode, numba_package):
    check(run(gpu_scripts.DEVICE_MEMORY_SIZE, mode=mode, package=numba_package))


@pytest.mark.parametrize("mode", ["pool", "passthrough"])
def test_reset_with_live_arrays_and_exit(mode, numba_package):
    check(run(gpu_scripts.RESET_WITH_LIVE_ARRAYS, mode=mode, package=numba_package))


def test_defer_cleanup_returns_nothing_to_the_driver(numba_package):
    check(run(gpu_scripts.DEFER_CLEANUP, package=numba_package))


def test_out_of_memory_is_numbas_error_and_pool_recovers(numba_package):
    check(run(gpu_scripts.OUT_OF_MEMORY, package=numba_package))


@pytest.mark.passthrough
def test_passthrough_gives_each_allocation_its_segment(numba_package):
    check(run(gpu_scripts.PASSTHROUGH_ONE_SEGMENT_EACH, mode="passthrough", package=numba_package))


def test_freed_block_not_reused_while_another_stream_reads_it(numba_package):
    p = run(gpu_scripts.CROSS_STREAM, package=numba_package)
    check(p)
    assert "fresh-address" in p.stdout


def test_cross_stream_scenario_catches_a_naive_pool(numba_package):
    # The same scenario against a pool that reuses at once must corrupt: this is what makes
    # the test above meaningful.
    p = run(gpu_scripts.CROSS_STREAM, "naive", str(HERE), manager=None, package=numba_package)
    assert p.returncode == 0, p.stderr
    assert "reused-address" in p.stdout and "CORRUPTED" in p.stdout, p.stdout

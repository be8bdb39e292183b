"""The pytest plugin of .ci/torch_suite.py, loaded with -p in every pytest(-xdist) process of both
runs (PYTHONPATH names this folder; no conftest.py is involved).

With EMMCI_TORCH_SUITE=emmpool it calls ``emmpool.use_for_torch()`` at configure time: before
pytest imports test_cuda.py (which asks ``torch.cuda.get_allocator_backend()`` at import) and
before any CUDA allocation. In both runs each process that runs tests writes
``$EMMCI_TORCH_SUITE_OUT/<run>-<phase>-<worker>.json``: the allocator PyTorch reports
(``torch.cuda.memory.get_allocator_backend()``: "native" for PyTorch's own, "emmpool" for
emmpool's extension, "pluggable" for its fallback), how emmpool was installed, and how many
allocations PyTorch made through emmpool. Written at configure time, after every test and at
the end, so that a run cut short by its timeout still has one.
"""

from __future__ import annotations

import json
import os

_state = {"tests": 0, "how": None, "active": False, "filled": []}


def _fill_names_the_test_file_imports():
    """Define, as PyTorch's own test_cuda.py of the installed release does, the module-level
    names that a newer test_cuda.py imports from ``torch.testing._internal.common_utils`` and the
    installed release does not have yet; the same in both runs, recorded in the reports.

    ``TEST_CUDAMALLOCASYNC``: whether the allocator in force is PyTorch's cudaMallocAsync one
    (test_cuda.py defined it itself before it moved to common_utils). Asked after emmpool is
    installed, as the test file's import asks it: an emmpool run is not cudaMallocAsync.
    """
    import torch
    from torch.testing._internal import common_utils

    if not hasattr(common_utils, "TEST_CUDAMALLOCASYNC"):
        common_utils.TEST_CUDAMALLOCASYNC = bool(
            torch.cuda.is_available()
            and torch.cuda.get_allocator_backend() == "cudaMallocAsync")
        _state["filled"].append("TEST_CUDAMALLOCASYNC")


def _run() -> str:
    return os.environ.get("EMMCI_TORCH_SUITE", "")


def pytest_configure(config):
    # The pytest-xdist controller runs no test: it neither installs emmpool nor reports.
    controller = getattr(config.option, "numprocesses", None)
    if os.environ.get("PYTEST_XDIST_WORKER") is None and controller:
        return
    if not _run():
        return
    _state["active"] = True
    if _run() == "emmpool":
        import emmpool

        _state["how"] = emmpool.use_for_torch().how
    _fill_names_the_test_file_imports()
    _report()


def pytest_runtest_logfinish(nodeid, location):
    _state["tests"] += 1
    _report()  # after every test: a run stopped by its timeout never reaches sessionfinish


def pytest_sessionfinish(session, exitstatus):
    _report()


def _report():
    if not _state["active"]:
        return
    import torch

    try:
        backend = torch.cuda.memory.get_allocator_backend()
    except Exception as e:  # noqa: BLE001 - a CPU-only build has no CUDA allocator to name
        backend = f"? ({type(e).__name__}: {e})"
    record = {
        "run": _run(),
        "phase": os.environ.get("EMMCI_TORCH_SUITE_PHASE", "all"),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "tests": _state["tests"],
        "how": _state["how"],
        "backend": backend,
        "torch_allocations": 0,
        "filled": _state["filled"],
    }
    if _state["how"] is not None:
        import emmpool

        record["torch_allocations"] = sum(
            s["by_library"]["torch"]["allocations"] for s in emmpool.stats().values())
    name = f"{record['run']}-{record['phase']}-{record['worker']}.json"
    path = os.path.join(os.environ["EMMCI_TORCH_SUITE_OUT"], name)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)

"""The pytest plugin of .ci/cupy_suite.py, loaded with -p in every pytest(-xdist) process of both
runs (PYTHONPATH names this folder; no conftest.py is involved).

With EMMCI_CUPY_SUITE=emmpool it calls ``emmpool.use_for_cupy()`` at configure time and, now and
then and at the end, writes ``$EMMCI_CUPY_SUITE_OUT/emmpool-worker-<worker>.json``: how many
allocations CuPy made through emmpool in that process (proof that the run used it).

With EMMCI_CUPY_SUITE_PART=K/N, both runs keep the tests of part K of N: those whose test id
hashes (CRC-32) to K-1 modulo N. Every process of both runs keeps the same tests (pytest-xdist
needs its workers to agree), and N runs, one per part, run each test of the selection once.
"""

from __future__ import annotations

import json
import os
import zlib

_done = [0]


def in_part(nodeid: str, part: int, parts: int) -> bool:
    """Whether the test `nodeid` belongs to part `part` (1-based) of `parts`."""
    return zlib.crc32(nodeid.encode()) % parts == part - 1


def pytest_configure(config):
    if os.environ.get("EMMCI_CUPY_SUITE") == "emmpool":
        import emmpool

        emmpool.use_for_cupy()
        _report()


def pytest_collection_modifyitems(config, items):
    text = os.environ.get("EMMCI_CUPY_SUITE_PART")
    if not text:
        return
    part, parts = map(int, text.split("/"))  # K/N, as .ci/cupy_suite.py --part checked it
    kept = [item for item in items if in_part(item.nodeid, part, parts)]
    dropped = [item for item in items if not in_part(item.nodeid, part, parts)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_runtest_logfinish(nodeid, location):
    # Now and then, not only at the end: a run cut short by the timeout never ends.
    _done[0] += 1
    if _done[0] % 50 == 0:
        _report()


def pytest_sessionfinish(session, exitstatus):
    _report()


def _report():
    if os.environ.get("EMMCI_CUPY_SUITE") != "emmpool":
        return
    import cupy
    import emmpool

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    stats = emmpool.stats()
    record = {
        "worker": worker,
        "tests": _done[0],
        "allocator": repr(cupy.cuda.get_allocator()),
        "cupy_allocations": sum(s["by_library"]["cupy"]["allocations"] for s in stats.values()),
        "dormant_fences": sum(s["dormant_fences"] for s in stats.values()),
        "same_stream_reuses": sum(s["same_stream_reuses"] for s in stats.values()),
    }
    path = os.path.join(os.environ["EMMCI_CUPY_SUITE_OUT"], f"emmpool-worker-{worker}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)

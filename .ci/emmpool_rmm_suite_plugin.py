"""The pytest plugin of .ci/rmm_suite.py, loaded with -p in both runs (PYTHONPATH names this
folder; no conftest.py of ours is involved).

With EMMCI_RMM_SUITE=emmpool, before every test, every device's RMM resource becomes emmpool's
(``emmpool.use_for_rmm(replace=True)``): RMM's own conftest.py puts RMM's default back after
each test (``rmm.reinitialize()``), and a test that sets a resource of its own keeps it for its
body, as it would with RMM's default. Both runs write ``$EMMCI_RMM_SUITE_OUT/<run>.json``: the
tests run, how emmpool served RMM (``"native resource"`` or ``"callback resource"``) and how many
allocations RMM made from emmpool's pools (proof that the run used it); after every test, so that
a run cut short by its timeout still has one.
"""

from __future__ import annotations

import json
import os

import pytest

_state = {"tests": 0, "how": None, "tests_on_emmpool": 0}


def _run() -> str:
    return os.environ.get("EMMCI_RMM_SUITE", "")


@pytest.fixture(autouse=True)
def _emmpool_as_rmms_resource():
    if _run() == "emmpool":
        import emmpool

        _state["how"] = emmpool.use_for_rmm(replace=True).how
        _state["tests_on_emmpool"] += 1
    yield


def pytest_runtest_logfinish(nodeid, location):
    _state["tests"] += 1
    _report()


def pytest_sessionfinish(session, exitstatus):
    _report()


def _report():
    record = dict(_state, run=_run(), rmm_allocations=0)
    if _run() == "emmpool":
        import emmpool

        record["rmm_allocations"] = sum(s["by_library"]["rmm"]["allocations"]
                                        for s in emmpool.stats().values())
    path = os.path.join(os.environ["EMMCI_RMM_SUITE_OUT"], f"{_run()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)

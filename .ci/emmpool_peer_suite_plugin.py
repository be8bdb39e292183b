"""The pytest plugin of .ci/peer_suite.py, loaded with -p in both runs of a peer's own tests
(PYTHONPATH names this folder; no conftest.py of ours is involved).

EMMCI_PEER_SUITE names the peer (``rmm``, ``cuda-core``), EMMCI_PEER_RUN the run. In the
``emmpool`` run, before every test, every device's resource of the peer becomes emmpool's
(``emmpool.use_for_rmm(replace=True)``, ``use_for_cuda_core(replace=True)``): the peers' own
fixtures put their defaults back after a test (RMM's ``rmm.reinitialize()``; cuda.core forgets
its per-thread Device objects), and a test that sets a resource of its own keeps it for its body,
as it would with the default. Both runs write ``$EMMCI_PEER_SUITE_OUT/<run>.json``: the tests
run, how emmpool was installed and how many allocations the peer made from emmpool's pools
(proof that the run used it); after every test, so that a run cut short still has one.
"""

from __future__ import annotations

import json
import os

import pytest

# peer -> (the use_for_* that installs emmpool for it, its name in stats()["by_library"])
PEERS = {"rmm": ("use_for_rmm", "rmm"), "cuda-core": ("use_for_cuda_core", "cuda_core")}
_state = {"tests": 0, "how": None, "tests_on_emmpool": 0}


def _peer() -> str:
    return os.environ.get("EMMCI_PEER_SUITE", "")


def _run() -> str:
    return os.environ.get("EMMCI_PEER_RUN", "")


@pytest.fixture(autouse=True)
def _emmpool_as_the_peers_resource():
    if _run() == "emmpool":
        import emmpool

        install = getattr(emmpool, PEERS[_peer()][0])
        _state["how"] = install(replace=True).how
        _state["tests_on_emmpool"] += 1
    yield


def pytest_runtest_logfinish(nodeid, location):
    _state["tests"] += 1
    _report()


def pytest_sessionfinish(session, exitstatus):
    _report()


def _report():
    record = dict(_state, peer=_peer(), run=_run(), allocations=0)
    if _run() == "emmpool":
        import emmpool

        library = PEERS[_peer()][1]
        record["allocations"] = sum(s["by_library"][library]["allocations"]
                                    for s in emmpool.stats().values())
    path = os.path.join(os.environ["EMMCI_PEER_SUITE_OUT"], f"{_run()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)

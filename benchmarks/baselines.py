"""Earlier builds of emmpool timed in the same run as this one ("no slower than before" needs
both in one run: a GPU host's speed drifts between runs more than the changes measured).

    EMMCI_BENCH_BASELINES="before=/tmp/base-before main=/tmp/base-main"

Each NAME=DIR is an emmpool installed with ``pip install --target DIR`` (.ci/gpu.py builds them
from the source trees under .baseline/). A benchmark adds a configuration ``emmpool@NAME`` whose
child process finds DIR first on PYTHONPATH; :func:`check_imported` makes that child fail
rather than time the wrong build.
"""

from __future__ import annotations

import os

VARIABLE = "EMMCI_BENCH_BASELINES"
_EXPECT = "EMMCI_BENCH_EXPECT_DIR"


def baselines() -> list[tuple[str, str]]:
    """(name, directory) for each entry of EMMCI_BENCH_BASELINES, in order."""
    out = []
    for item in os.environ.get(VARIABLE, "").split():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{VARIABLE}: {item!r} is not NAME=DIR")
        if not os.path.isdir(path):
            raise ValueError(f"{VARIABLE}: {path!r} is not a directory")
        out.append((name, os.path.abspath(path)))
    return out


def child_env(path: str) -> dict[str, str]:
    """Environment entries that make a child import the emmpool installed in `path`."""
    rest = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": path + (os.pathsep + rest if rest else ""), _EXPECT: path}


def check_imported() -> None:
    """In a child: raise if the emmpool imported is not the one its configuration names."""
    want = os.environ.get(_EXPECT)
    if not want:
        return
    import emmpool

    got = os.path.realpath(emmpool.__file__)
    if not got.startswith(os.path.realpath(want) + os.sep):
        raise RuntimeError(f"baseline build expected from {want}, imported {got}")

"""emmpool's counters of the work behind a benchmark's operations (``emmpool.stats()`` keys:
events recorded and queried, segments and pages taken from the driver and given back, waits),
read before and after the timed part and reported per operation. A setup other than emmpool's
has none; a build without one of the counters skips it."""

from __future__ import annotations

from typing import Callable


def reader(setup: str, keys: tuple[str, ...], device: int = 0) -> Callable[[], dict] | None:
    """A function returning the pool's counters `keys` of `device` now, for an emmpool setup
    (its name starts with "emmpool"); None for any other, or where emmpool cannot say."""
    if not setup.startswith("emmpool"):
        return None
    try:
        import emmpool

        have = [k for k in keys if k in emmpool.stats(device)]
    except Exception:  # noqa: BLE001 - counters are extra information, never a failure
        return None

    def read() -> dict:
        stats = emmpool.stats(device)
        return {k: stats[k] for k in have}

    return read


def per_op(before: dict, after: dict, ops: int) -> dict:
    """Each counter's growth from `before` to `after`, per operation."""
    return {k: (after[k] - v) / ops for k, v in before.items()}

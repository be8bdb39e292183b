"""The forms every public call shares: integers and device ordinals taken in, byte counts given
back in words.

One home, so that ``device=1.0`` or ``size="4096"`` reads the same from every entry point
(stats, record_stream, the use_for_* family, cuda.core's resource, the Numba plugin, the command
line) and a size reads the same in every report (``python -m emmpool info``, the Dask summary,
the bench table). Checks run before the driver is loaded: its errors would hide a type mistake.
Parsing sizes *from* text (``'4GiB'``, ``'80%'``) belongs to the configuration, ``_config``.
"""

from __future__ import annotations

import operator
import reprlib

from . import _core

__all__ = ["current_device", "device", "devices", "flag", "format_bytes", "integer", "size"]


def integer(value, name: str, what: str) -> int:
    """``value`` as an int (NumPy's integers too, anything with ``__index__``); TypeError for
    anything else, a bool included (``True`` as a device is a slip, not a 1)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an integer ({what}), not {type(value).__name__} "
                    f"{reprlib.repr(value)}")


def flag(value, name: str) -> bool:
    """``True`` or ``False``, nothing else: ``replace="no"`` would be true."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={reprlib.repr(value)}: expected True or False")
    return value


def size(value) -> int:
    """A number of bytes to allocate: an integer, a bool passing as 0 or 1 (negative sizes are
    the caller's to refuse). Numba's C memalloc entry point (cpp/bindings/numba_entry_points.cpp)
    takes what ``operator.index`` takes and says this sentence; the Python paths say the same."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"allocation size must be an integer number of bytes, not "
                        f"{type(value).__name__}") from None


def device(value, name: str = "device") -> int:
    """A CUDA device ordinal: an integer >= 0 (and below 2**31, as CUDA's are ints)."""
    ordinal = integer(value, name, "a CUDA device ordinal, 0 for the first GPU")
    if not 0 <= ordinal < 1 << 31:
        raise ValueError(f"{name} must be a CUDA device ordinal (0 for the first GPU), not "
                         f"{ordinal}")
    return ordinal


def current_device(value=None) -> int:
    """``value`` as a device ordinal; None means the calling thread's current device (0 where
    no CUDA context is current). What ``device=None`` means wherever one device is asked for."""
    if value is not None:
        return device(value)
    return max(_core.current_device(), 0)


def devices(value, name: str = "devices") -> tuple[int, ...] | None:
    """A collection of device ordinals as a tuple, or None (every device: the caller's to
    count). A lone integer or a string is a mistake: ``devices=0`` means ``[0]`` to some readers
    and nothing to others."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of device ordinals (e.g. [0, 1]) or None, "
                        f"not {type(value).__name__}")
    return tuple(device(d) for d in value)


_UNITS = (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10))


def format_bytes(n: int, *, exact: bool = False) -> str:
    """``n`` bytes in binary units, four significant digits: ``"512 B"``, ``"64 KiB"``,
    ``"1.5 GiB"``. ``exact``: the count too where the unit rounds it, ``"1 GiB (1073741824
    bytes)"``."""
    for unit, shift in _UNITS:
        if abs(n) >= 1 << shift:
            text = f"{n / (1 << shift):.4g} {unit}"
            return f"{text} ({n} bytes)" if exact else text
    return f"{n} B"

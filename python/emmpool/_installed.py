"""What the ``use_for_*`` family returns and raises, and what it has installed in this process.

Every ``use_for_*`` returns an :class:`Installed`; each refuses, with an
:class:`AllocatorConflictError`, to take the place of an allocator another library or the
program chose, unless asked with ``replace=True``; each is idempotent (a second call returns an
equal ``Installed`` and changes nothing). The libraries' own modules (``hooks``, ``cuda_core``)
do the installing; this module is what they share, and it calls none of them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["AllocatorConflictError", "Installed", "installed", "lock", "record"]


@dataclass(frozen=True)
class Installed:
    """What a ``use_for_*`` call made a library allocate through.

    ``library``: ``"numba"``, ``"cuda_core"``, ``"cupy"``, ``"torch"`` or ``"rmm"`` (the names of
    ``stats()["by_library"]``). ``how``: the library's own mechanism, ``"memory manager"``
    (Numba's EMM plugin), ``"memory resource"`` (cuda.core), ``"C function allocator"`` (CuPy),
    ``"extension"`` or ``"pluggable"`` (PyTorch: emmpool's allocator extension, or PyTorch's
    ``CUDAPluggableAllocator``), ``"native resource"`` or ``"callback resource"`` (RMM: emmpool's
    own, built against the RMM installed, or RMM's Python-callback one where it cannot be).
    ``allocators``: the objects the library was given, in order: Numba's manager class per
    installed package (numba-cuda, numba-cuda-mlir), cuda.core's and RMM's resource per device,
    CuPy's allocator function, PyTorch's extension module or pluggable allocator. ``devices``:
    the device of each allocator where the library takes one per device (cuda.core, RMM); None
    where one serves every device.
    """

    library: str
    how: str
    allocators: tuple
    devices: tuple[int, ...] | None = None


class AllocatorConflictError(RuntimeError):
    """A ``use_for_*`` call found the library allocating through another allocator, chosen by
    another library or the program, and did not replace it (``replace=True`` does).

    ``library``: the ``use_for_*`` name's library (``"cupy"``, ...); ``situation``: what is
    installed, in a sentence (the message starts with it)."""

    def __init__(self, library: str, situation: str, replacing: str = "replace it"):
        self.library = library
        self.situation = situation
        super().__init__(
            f"{situation}. emmpool does not replace an allocator that another library or the "
            f"program chose: leave {_NAMES.get(library, library)} to it, or call "
            f"emmpool.use_for_{library}(replace=True) to {replacing}")


_NAMES = {"numba": "Numba", "cuda_core": "cuda.core", "cupy": "CuPy", "torch": "PyTorch",
          "rmm": "RMM"}

# One install at a time, the check and the change together: two threads (or two Dask workers
# of one process) must not both find the default allocator and both replace it. Reentrant:
# use_for_rmm makes its resources through rmm_resource, which takes it too.
lock = threading.RLock()
_installed: dict[str, Installed] = {}


def record(result: Installed) -> Installed:
    """Note what was installed (python -m emmpool info lists it); return it."""
    _installed[result.library] = result
    return result


def installed() -> dict[str, Installed]:
    """The latest install of each library in this process."""
    return dict(_installed)

"""Configuration of the process-wide pools: environment variables and :func:`configure`.

One table (``_OPTIONS``) gives each option its variable and its parser, and the environment and
:func:`configure` go through the same parsers: ``'512MiB'`` or ``'80%'`` mean the same in both.
The environment is read and checked when emmpool is installed into a library (``use_for_*``,
``import emmpool.plugin``) and when the first pool is configured; a bad value raises
``ValueError`` naming the variable and the accepted form; an ``EMMPOOL_*`` variable that
emmpool does not know (a misspelling, say) gets an :class:`UnknownVariableWarning` naming the
nearest known one. :func:`config` and :func:`report` say what is in force and where each value
came from.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Callable, NamedTuple

from . import _core
from ._args import format_bytes

__all__ = [
    "TORCH_ALLOCATORS",
    "Config",
    "Setting",
    "UnknownVariableWarning",
    "check_environment",
    "config",
    "configure",
    "diagnose",
    "ensure_configured",
    "parse_fraction",
    "parse_maximum",
    "parse_size",
    "parse_torch_allocator",
    "report",
    "resolve",
    "unknown_variables",
]

log = logging.getLogger("emmpool")
# A library's logger stays silent unless the application (or EMMPOOL_LOG) configures logging:
# without this, Python's last-resort handler would print every warning to stderr.
log.addHandler(logging.NullHandler())


@dataclass(frozen=True)
class Config:
    """Options of the process-wide pools (one per device). ``None`` means "not set": what then
    holds is said in the comment (and by :func:`report`)."""

    mode: str = "pool"  # "pool" or "passthrough"
    initial_pool_size: int = 0  # bytes reserved when a device's pool is created
    # The cap on what the pool reserves: bytes (an int), or a fraction of the device's memory in
    # (0, 1] (a float: maximum_pool_size='80%' gives 0.8); None: no cap but the device's memory.
    maximum_pool_size: int | float | None = None
    trace: str = ""  # CSV path: record every allocation and free, written at exit; "": off
    log: str = ""  # level of the "emmpool" logger; "": left to the application
    pinned: str = "pool"  # Numba's pinned/mapped host memory: "pool" (emmpool's) or "numba"
    pinned_limit: int | None = None  # bytes the pinned cache may hold; None: RAM / 4
    # "growable" (requests above 1 MiB from VMM pages mapped on demand, where the device has
    # virtual memory management) or "fixed" (cuMemAlloc segments: legacy IPC handles for all)
    segments: str = "growable"
    # Bytes of free pages the growable segment keeps mapped for later requests; beyond, free
    # pages move under the requests that lack pages (the core's pool_options says more).
    growable_free_limit: int = _core.DEFAULT_GROWABLE_FREE_LIMIT
    # What one page of the growable segment is (one cuMemCreate + cuMemMap): 0, the driver's
    # granularity (2 MiB); a larger size, rounded up to a multiple of it, makes fewer driver
    # calls and gives pages back more coarsely. Default 20 MiB (the core's pool_options says why).
    growable_page_size: int = _core.DEFAULT_GROWABLE_PAGE_SIZE
    torch_allocator: str = "auto"  # what use_for_torch() installs: one of TORCH_ALLOCATORS

    @property
    def maximum_pool_fraction(self) -> float | None:
        """The cap as a fraction of the device's memory where maximum_pool_size is one; None
        where it is bytes or unset. Read-only: maximum_pool_size sets it."""
        return None if _is_bytes(self.maximum_pool_size) else self.maximum_pool_size


def _is_bytes(maximum) -> bool:
    """Whether a maximum_pool_size is bytes (an int), not a fraction, nor None."""
    return isinstance(maximum, int) and not isinstance(maximum, bool)


# ---- parsers: one per kind of value, shared by the environment and configure() --------------
_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(-?)(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_SIZE_FORM = "bytes, e.g. 1073741824 or '4GiB' (units: B, KiB, MiB, GiB, TiB; K/M/G/T and " \
             "KB/MB/GB/TB mean the same)"
_FRACTION_FORM = "a fraction of the device's memory in (0, 1], e.g. 0.8 or '80%'"


def parse_size(value: int | str, name: str) -> int:
    """Bytes: a non-negative ``int``, or a string ``"1073741824"``, ``"512MiB"``, ``"1.5 GiB"``
    (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(_negative(value, name))
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    unit = m.group(3).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{name}={value!r} is not a size: expected {_SIZE_FORM}")
    if m.group(1):
        raise ValueError(_negative(value, name))
    if _UNITS[unit] == 1 and "." in m.group(2):
        raise ValueError(f"{name}={value!r}: a number of bytes must be whole (or give a unit, "
                         f"e.g. '1.5GiB')")
    return int(float(m.group(2)) * _UNITS[unit])


def _negative(value, name: str) -> str:
    """What every option that takes a size or a fraction says of a negative one."""
    return f"{name}={value!r}: cannot be negative"


def _is_fraction(value: object) -> bool:
    """A float, or a string with a percent sign or a decimal point and no unit: a fraction."""
    if isinstance(value, float):
        return True
    return isinstance(value, str) and re.fullmatch(r"\s*(\d*\.\d*|[^%]*%)\s*", value) is not None


def parse_fraction(value: float | str, name: str) -> float:
    """A fraction in (0, 1]: ``0.8``, ``"0.8"`` or ``"80%"``."""
    try:
        if isinstance(value, str) and value.strip().endswith("%"):
            fraction = float(value.strip()[:-1]) / 100.0
        elif isinstance(value, (float, str)):
            fraction = float(value)
        else:
            fraction = -1.0
    except ValueError:
        fraction = -1.0
    if not 0.0 < fraction <= 1.0:  # also refuses nan
        raise ValueError(f"{name}={value!r}: expected {_FRACTION_FORM}")
    return fraction


def parse_maximum(value: int | float | str | None, name: str) -> tuple[int | None, float | None]:
    """A cap on the pool: a size (bytes, ``"16GiB"``) or a fraction of the device's memory
    (``0.8``, ``"80%"``); ``None`` for no cap. Returns ``(bytes, fraction)``, one of them None."""
    if value is None:
        return None, None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0 or \
            isinstance(value, str) and value.strip().startswith("-"):
        raise ValueError(_negative(value, name))
    if _is_fraction(value):
        return None, parse_fraction(value, name)
    try:
        size = parse_size(value, name)
    except ValueError:
        raise ValueError(f"{name}={value!r} is neither a size nor a fraction: expected "
                         f"{_FRACTION_FORM}, or {_SIZE_FORM}") from None
    if size == 0:
        raise ValueError(f"{name}=0 would leave the pool no memory: leave it unset for no cap")
    return size, None


def _positive_size(value: int | str | None, name: str) -> int | None:
    if value is None:
        return None
    size = parse_size(value, name)
    if size == 0:
        raise ValueError(f"{name}=0 would allow no pinned memory: leave it unset for the "
                         f"default, or set EMMPOOL_PINNED=numba for Numba's own")
    return size


def _page_size(value: int | str, name: str) -> int:
    size = parse_size(value, name)
    if size > _core.MAX_GROWABLE_PAGE_SIZE:
        raise ValueError(f"{name}={value!r}: a growable page may be at most "
                         f"{format_bytes(_core.MAX_GROWABLE_PAGE_SIZE)} (0: the driver's 2 MiB)")
    return size


def _choice(*accepted: str) -> Callable[[str, str], str]:
    def parse(value: str, name: str) -> str:
        text = value.strip().lower() if isinstance(value, str) else None
        if text not in accepted:
            raise ValueError(f"{name}={value!r}: expected "
                             + " or ".join(repr(a) for a in accepted if a))
        return text

    return parse


def _path(value: str, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r}: expected a file path (str), or '' for none")
    path = value.strip()
    if path:
        # Fail now, naming the option, rather than at exit when the trace is written; without
        # creating the file, so that checking the environment leaves nothing behind.
        folder = os.path.dirname(os.path.abspath(path))
        target = path if os.path.exists(path) else folder
        if not os.path.isdir(folder) or not os.access(target, os.W_OK):
            raise ValueError(f"{name}={value!r}: cannot write there")
    return path


_LOG_LEVELS = {"": None, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}


# ---- the options ----------------------------------------------------------------------------
class _Option(NamedTuple):
    variable: str  # the environment variable that sets it
    parse: Callable  # (value, name) -> {Config field: value}


def _one(field: str, parse: Callable) -> Callable:
    return lambda value, name: {field: parse(value, name)}


def _maximum(value, name):
    size, fraction = parse_maximum(value, name)
    return {"maximum_pool_size": size if fraction is None else fraction}


def _fraction_only(value, name):
    return {"maximum_pool_size": None if value is None else parse_fraction(value, name)}


# How use_for_torch() may serve PyTorch (emmpool._torch), in the words report() gives them.
_TORCH_WORDS = {
    "auto": "auto (emmpool's extension, else CUDAPluggableAllocator)",
    "extension": "extension (emmpool's PyTorch extension, or an error)",
    "pluggable": "pluggable (PyTorch's CUDAPluggableAllocator)",
}
TORCH_ALLOCATORS = tuple(_TORCH_WORDS)
parse_torch_allocator = _choice(*TORCH_ALLOCATORS)

# configure()'s keywords: each variable's name in lower case, without EMMPOOL_.
# maximum_pool_size takes a size or a fraction, as its variable does.
_OPTIONS = {
    "mode": _Option("EMMPOOL_MODE", _one("mode", _choice("pool", "passthrough"))),
    "initial_pool_size": _Option("EMMPOOL_INITIAL_POOL_SIZE",
                                 _one("initial_pool_size", parse_size)),
    "maximum_pool_size": _Option("EMMPOOL_MAXIMUM_POOL_SIZE", _maximum),
    # Deprecated: maximum_pool_size given a fraction (configure() warns, and says so).
    "maximum_pool_fraction": _Option("EMMPOOL_MAXIMUM_POOL_SIZE", _fraction_only),
    "trace": _Option("EMMPOOL_TRACE", _one("trace", _path)),
    "log": _Option("EMMPOOL_LOG", _one("log", _choice(*_LOG_LEVELS))),
    "pinned": _Option("EMMPOOL_PINNED", _one("pinned", _choice("pool", "numba"))),
    "pinned_limit": _Option("EMMPOOL_PINNED_LIMIT", _one("pinned_limit", _positive_size)),
    "segments": _Option("EMMPOOL_SEGMENTS", _one("segments", _choice("fixed", "growable"))),
    "growable_free_limit": _Option("EMMPOOL_GROWABLE_FREE_LIMIT",
                                   _one("growable_free_limit", parse_size)),
    "growable_page_size": _Option("EMMPOOL_GROWABLE_PAGE_SIZE",
                                  _one("growable_page_size", _page_size)),
    "torch_allocator": _Option("EMMPOOL_TORCH_ALLOCATOR",
                               _one("torch_allocator", parse_torch_allocator)),
}
_FIELDS = [f.name for f in fields(Config)]
_DEFAULT = "default"
_CONFIGURE = "configure()"

# ---- variables that are not emmpool's options ------------------------------------------------
_PREFIX = "EMMPOOL_"
# Read by emmpool's build (pyproject.toml), not at run time: a shell that keeps it exported
# imports emmpool with it set.
_BUILD_HEADERS = "EMMPOOL_CUDA_HEADERS"
# Where the native RMM resource is built and kept (emmpool._rmm), not a pool option.
_RMM_CACHE = "EMMPOOL_RMM_CACHE"
# Every EMMPOOL_* variable there is: the repository's own tools use EMMCI_* for theirs.
VARIABLES = tuple(sorted({o.variable for o in _OPTIONS.values()} | {_BUILD_HEADERS, _RMM_CACHE}))


class UnknownVariableWarning(UserWarning):
    """An ``EMMPOOL_*`` variable is set that emmpool does not read (a misspelling, say): it has
    no effect."""


def unknown_variables() -> list[str]:
    """For each ``EMMPOOL_*`` variable set (not empty) that emmpool does not read: a sentence
    saying so, naming the nearest variable it does read."""
    messages = []
    for name in sorted(os.environ):
        if not name.startswith(_PREFIX) or name in VARIABLES or not os.environ[name].strip():
            continue
        import difflib  # here: only where a variable is unknown

        # Compared without the prefix they all share, which would make any two look alike;
        # in upper case: EMMPOOL_mode is as likely a slip as EMMPOOL_MDOE.
        close = difflib.get_close_matches(name[len(_PREFIX):].upper(),
                                          [v[len(_PREFIX):] for v in VARIABLES], n=1)
        hint = (f"did you mean {_PREFIX}{close[0]}?" if close
                else f"emmpool reads {', '.join(VARIABLES)}")
        messages.append(f"{name} is not an emmpool variable and has no effect: {hint}")
    return messages


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_unknown_variables() -> None:
    """Warn once per process for each unknown ``EMMPOOL_*`` variable: a misspelt option would
    otherwise be ignored without a word."""
    for message in unknown_variables():
        with _warned_lock:
            if message in _warned:
                continue
            _warned.add(message)  # before warning: where warnings are errors, still only once
        warnings.warn(message, UnknownVariableWarning, stacklevel=caller_outside_emmpool())


def caller_outside_emmpool() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the calling function that names the first
    caller outside emmpool: the line to look at is the program's (or the library's that called
    emmpool), however deep in emmpool the warning is raised."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _checked(cfg: Config) -> Config:
    """What holds across options."""
    if _is_bytes(cfg.maximum_pool_size) and cfg.initial_pool_size > cfg.maximum_pool_size:
        raise ValueError(f"initial_pool_size ({cfg.initial_pool_size}) exceeds "
                         f"maximum_pool_size ({cfg.maximum_pool_size})")
    return cfg


# An option whose variable has a bad value, as _read_environment(problems=...) gives it.
_Problem = tuple[tuple[str, ...], str]  # (the Config fields it leaves unset, the error)


def _read_environment(problems: list[_Problem] | None = None) -> tuple[Config, dict[str, str]]:
    """The options the environment sets, and for each field where its value came from.

    A variable set to an empty string counts as unset. A bad value raises ``ValueError``;
    unless ``problems`` is given: then every bad value is added to it (its fields keep their
    defaults) and the rest is read. Warns of unknown ``EMMPOOL_*`` variables (once)."""
    _warn_unknown_variables()
    values, sources = {}, dict.fromkeys(_FIELDS, _DEFAULT)
    for key, option in _OPTIONS.items():
        text = os.environ.get(option.variable, "")
        if key == "maximum_pool_fraction" or not text.strip():
            continue  # the fraction shares EMMPOOL_MAXIMUM_POOL_SIZE, read once as the maximum
        source = f"{option.variable}={text!r}"
        try:
            parsed = option.parse(text, option.variable)
        except ValueError as e:
            if problems is None:
                raise
            unset = (key,)
            problems.append((unset, str(e)))
            sources.update(dict.fromkeys(unset, source))
            continue
        values.update(parsed)
        sources.update(dict.fromkeys(parsed, source))
    cfg = Config(**values)
    try:
        return _checked(cfg), sources
    except ValueError as e:
        if problems is None:
            raise
        problems.append(((), str(e)))  # the values are good alone: report() still shows them
        return cfg, sources


def check_environment() -> None:
    """Raise ``ValueError`` now, naming the variable, if an ``EMMPOOL_*`` value is bad; warn
    (:class:`UnknownVariableWarning`, once) of an ``EMMPOOL_*`` variable emmpool does not read."""
    _read_environment()


_lock = threading.Lock()
_applied: Config | None = None
_applied_sources: dict[str, str] = {}


def _merged(options: dict, base: Config | None) -> tuple[Config, dict[str, str]]:
    """``base`` (default: the options in force, else the environment's) with ``options`` parsed
    over it, checked; and where each value comes from. Call with _lock held."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        import difflib  # here: only where an option is unknown

        close = difflib.get_close_matches(unknown[0], [k for k in _OPTIONS if k in _FIELDS], n=1)
        hint = f"did you mean {close[0]}?" if close else f"known: {sorted(_FIELDS)}"
        raise TypeError(f"unknown option{'s' * (len(unknown) > 1)} "
                        f"{', '.join(unknown)}: {hint}")
    if "maximum_pool_size" in options and "maximum_pool_fraction" in options:
        raise TypeError("give maximum_pool_size or maximum_pool_fraction, not both")
    if "maximum_pool_fraction" in options:
        warnings.warn(
            f"maximum_pool_fraction is deprecated: maximum_pool_size takes a fraction, as "
            f"EMMPOOL_MAXIMUM_POOL_SIZE does (maximum_pool_size="
            f"{options['maximum_pool_fraction']!r})", DeprecationWarning,
            stacklevel=caller_outside_emmpool())
    if base is not None:
        sources = {}
    elif _applied is not None:
        base, sources = _applied, dict(_applied_sources)
    else:
        base, sources = _read_environment()
    values = asdict(base)
    for key, value in options.items():
        parsed = _OPTIONS[key].parse(value, key)
        values.update(parsed)
        sources.update(dict.fromkeys(parsed, _CONFIGURE))
    return _checked(Config(**values)), sources


def resolve(options: dict, base: Config | None = None) -> Config:
    """The options ``configure(**options)`` would apply, checked; applies nothing.

    Options not given take their value from ``base``: by default the options in force, else the
    environment's (``EMMPOOL_*``), as for :func:`configure`. ``Config()`` checks the given
    options alone, e.g. on a Dask client for workers whose environment it cannot see. Raises
    ``TypeError`` for an unknown option and ``ValueError`` for a bad value.
    """
    with _lock:
        return _merged(options, base)[0]


def configure(**options) -> Config:
    """Set the options of the process-wide pools. Only before the first allocation.

    Keyword arguments are the fields of :class:`Config`, in the forms the environment
    variables take (``initial_pool_size='512MiB'``, ``maximum_pool_size='80%'``) or as numbers
    (bytes; a float for a fraction); those not given keep their value from an earlier call, or
    from the environment (``EMMPOOL_*``), or the default. Raises ``ValueError`` for a bad value
    and ``RuntimeError`` once a pool exists.
    """
    global _applied, _applied_sources
    with _lock:
        cfg, sources = _merged(options, None)
        try:
            _core.configure(
                mode=cfg.mode,
                initial_size=cfg.initial_pool_size,
                # bytes, or a fraction; 0 for either: the core's "no cap"
                maximum_size=cfg.maximum_pool_size if _is_bytes(cfg.maximum_pool_size) else 0,
                maximum_fraction=cfg.maximum_pool_fraction or 0.0,
                pinned_limit=cfg.pinned_limit or 0,  # the core's "a quarter of RAM"
                segments=cfg.segments,
                growable_free_limit=cfg.growable_free_limit,
                growable_page_size=cfg.growable_page_size,
            )
        except RuntimeError as e:  # std::logic_error: a pool exists
            raise RuntimeError(str(e)) from None
        _applied, _applied_sources = cfg, sources
        if cfg.log:
            _log_at(_LOG_LEVELS[cfg.log])
        if cfg.trace:
            _trace_to(cfg.trace)
        log.info("emmpool configured: %s", cfg)
        return cfg


def _log_at(level: int) -> None:
    """Set the emmpool logger's level; print its records to stderr unless the application
    already handles them."""
    log.setLevel(level)
    configured = [h for h in log.handlers if not isinstance(h, logging.NullHandler)]
    if not configured and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("emmpool %(levelname)s: %(message)s"))
        log.addHandler(handler)


_trace_path: str | None = None


def _trace_to(path: str) -> None:
    """Record from now on; write the CSV when the interpreter exits."""
    global _trace_path
    from . import trace

    trace.start()
    if _trace_path is None:
        import atexit

        def write_at_exit():
            rows = trace.write_csv(_trace_path, trace.stop())
            log.info("wrote %d trace records to %s", rows, _trace_path)

        atexit.register(write_at_exit)
    _trace_path = path


def ensure_configured() -> Config:
    """Apply the environment's configuration once, unless configure() already ran."""
    if _applied is not None:
        return _applied
    try:
        return configure()
    except RuntimeError:
        # A pool already exists (e.g. created through the C entry points before any
        # Python-level configuration): it keeps the options it was created with.
        return config()


_BEFORE_CONFIGURATION = "the core's default: a pool was created before configuration"


def _in_force(problems: list[_Problem] | None = None) -> tuple[Config, dict[str, str]]:
    if _applied is not None:
        return _applied, _applied_sources
    cfg, sources = _read_environment(problems)
    if not (_core.pools() or _core.pinned_pools()):
        return cfg, sources  # what the first pool will get
    # Pools made before any configuration keep the core's options; the Python-side options
    # (pinned, log, trace) are still the environment's, as ensure_configured() leaves them.
    o = _core.configured_options()
    core = {
        "mode": o["mode"],
        "initial_pool_size": o["initial_size"],
        "maximum_pool_size": o["maximum_size"] or o["maximum_fraction"] or None,
        "pinned_limit": o["pinned_limit"] or None,
        "segments": o["segments"],
        "growable_free_limit": o["growable_free_limit"],
        "growable_page_size": o["growable_page_size"],
    }
    sources.update(dict.fromkeys(core, _BEFORE_CONFIGURATION))
    return Config(**{**asdict(cfg), **core}), sources


def config() -> Config:
    """The options in force (or that will be, for pools not yet created).

    Raises ``ValueError`` if an ``EMMPOOL_*`` variable that would apply has a bad value."""
    return _in_force()[0]


class Setting(NamedTuple):
    """One line of :func:`report`."""

    option: str  # the Config field
    value: str  # what is in force, in words
    source: str  # "default", "EMMPOOL_MODE='passthrough'", "configure()", ...


def report() -> list[Setting]:
    """Every option: the value in force, in words, and where it came from.

    Raises ``ValueError`` for the first bad ``EMMPOOL_*`` value that would apply
    (:func:`diagnose` reports them all)."""
    settings, errors = diagnose()
    if errors:
        raise ValueError(errors[0])
    return settings


_INVALID = "invalid (see the error)"


# The page granularity of virtual memory management on every NVIDIA GPU emmpool has met; the
# driver says the device's own (python -m emmpool info asks it where there is one).
_GRANULARITY = 2 << 20


def page_size_words(size: int, granularity: int = _GRANULARITY) -> str:
    """The growable page as the pool will use it: ``size`` rounded up to a multiple of the
    driver's granularity (0: the granularity itself; detail/page_policy.hpp)."""
    used = max(granularity, -(-size // granularity) * granularity)
    if size == 0:
        return f"{format_bytes(used)} (the driver's granularity)"
    if used != size:
        pages = format_bytes(granularity)
        return f"{format_bytes(used)} ({format_bytes(size)} rounded to {pages} pages)"
    return format_bytes(size, exact=True)


def diagnose(granularity: int = _GRANULARITY) -> tuple[list[Setting], list[str]]:
    """:func:`report` without raising: every option, and every bad ``EMMPOOL_*`` value that
    would apply, each as the error :func:`check_environment` raises for it (an option with a
    bad value reads ``invalid`` and names its variable as the source). ``granularity``: the
    driver's page granularity, which the growable page is rounded up to."""
    problems: list[_Problem] = []
    cfg, sources = _in_force(problems)
    invalid = {field for unset, _ in problems for field in unset}
    maximum = "no cap but the device's memory"
    if cfg.maximum_pool_fraction is not None:
        maximum = f"{cfg.maximum_pool_fraction * 100:g}% of the device's memory"
    elif cfg.maximum_pool_size is not None:
        maximum = format_bytes(cfg.maximum_pool_size, exact=True)
    words = {
        "mode": cfg.mode,
        "initial_pool_size": format_bytes(cfg.initial_pool_size, exact=True),
        "maximum_pool_size": maximum,
        "trace": cfg.trace or "off",
        "log": cfg.log or "not set (the application's logging configuration)",
        "pinned": {"pool": "pool (emmpool's pinned cache)",
                   "numba": "numba (Numba's own pinned memory)"}[cfg.pinned],
        "pinned_limit": format_bytes(cfg.pinned_limit, exact=True)
        if cfg.pinned_limit is not None
        else f"a quarter of physical memory, {format_bytes(_physical_memory() // 4)} here",
        "segments": {"fixed": "fixed (cuMemAlloc segments)",
                     "growable": "growable (pages on demand above 1 MiB)",
                     }[cfg.segments],
        "growable_free_limit": format_bytes(cfg.growable_free_limit, exact=True),
        "growable_page_size": page_size_words(cfg.growable_page_size, granularity),
        "torch_allocator": _TORCH_WORDS[cfg.torch_allocator],
    }
    # What use_for_torch() installed in this process, if it ran, is what serves PyTorch.
    torch_hook = sys.modules.get("emmpool._torch")
    how = torch_hook.how_installed() if torch_hook is not None else None
    if how is not None:
        words["torch_allocator"] = f"{how} (installed in this process)"
        sources["torch_allocator"] = "use_for_torch()"
        invalid.discard("torch_allocator")
    settings = [Setting(name, _INVALID if name in invalid else text, sources[name])
                for name, text in words.items()]
    return settings, [message for _, message in problems]


def _physical_memory() -> int:
    # The same sysconf query as the pinned cache's default (cpp/src/host_pool.cpp).
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

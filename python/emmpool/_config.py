"""Configuration of the process-wide pools: environment variables and :func:`configure`.

Every variable is validated when the first pool is about to be created (or when
:func:`configure` is called), and a bad value raises ``ValueError`` naming the variable and
the accepted form. See the table in README.md.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import asdict, dataclass

from . import _core

__all__ = ["Config", "configure", "config", "ensure_configured", "parse_size", "resolve"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_MODES = ("pool", "passthrough")
_PINNED = ("pool", "numba")
_LOG_LEVELS = {"": None, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}
log = logging.getLogger("emmpool")
# A library's logger stays silent unless the application (or EMMPOOL_LOG) configures logging:
# without this, Python's last-resort handler would print every warning to stderr.
log.addHandler(logging.NullHandler())
# Options with a fixed set of values: the variable that sets them, and what it accepts.
_CHOICES = {
    "mode": ("EMMPOOL_MODE", _MODES),
    "log": ("EMMPOOL_LOG", tuple(_LOG_LEVELS)),  # "" leaves the logger alone
    "pinned": ("EMMPOOL_PINNED", _PINNED),
}


@dataclass(frozen=True)
class Config:
    """Options of the process-wide pools (one per device)."""

    mode: str = "pool"
    initial_pool_size: int = 0
    maximum_pool_size: int = 0  # bytes; 0 means no cap but the device
    maximum_pool_fraction: float = 0.0  # of the device's memory; 0 means unused
    trace: str = ""  # CSV path: record every allocation and free, written at exit
    log: str = ""  # level of the "emmpool" logger: warning, info or debug; "" leaves it alone
    pinned: str = "pool"  # pinned/mapped host memory for Numba: "pool" (emmpool's) or "numba"
    pinned_limit: int = 0  # bytes of pinned memory the pool may hold; 0: a quarter of RAM


def parse_size(text: str, name: str) -> int:
    """Parse ``"1073741824"``, ``"512MiB"``, ``"2 GB"`` (binary units) into bytes."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is not None and _UNITS.get(unit) == 1 and "." in m.group(1):
        raise ValueError(f"{name}={text!r}: a number of bytes must be whole (or give a unit, "
                         f"e.g. '1.5GiB')")
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{name}={text!r} is not a size: expected bytes as an integer, optionally with a "
            f"unit (B, KiB, MiB, GiB, TiB; K/M/G/T and KB/MB/GB/TB mean the same), e.g. '4GiB'"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def _parse_maximum(text: str, name: str) -> tuple[int, float]:
    """A maximum is a size, or a fraction of the device's memory: '0.8' or '80%'.

    A plain number with a decimal point is a fraction; an integer is bytes."""
    t = text.strip()
    try:
        if t.endswith("%"):
            frac = float(t[:-1]) / 100.0
        elif re.fullmatch(r"\d*\.\d*", t):
            frac = float(t)
        else:
            return parse_size(t, name), 0.0
    except ValueError:
        frac = -1.0
    if not 0.0 < frac <= 1.0:
        raise _bad_fraction(name, text)
    return 0, frac


def _bad_fraction(name: str, value) -> ValueError:
    return ValueError(
        f"{name}={value!r}: a fraction of the device's memory must lie in (0, 1] "
        f"(e.g. '0.8' or '80%'), or give a size such as '16GiB'"
    )


def _as_fields(options: dict) -> dict:
    """configure()'s keywords as Config fields.

    Sizes may come as the variables take them ('4GiB'), and maximum_pool_size also as a
    fraction of the device's memory (0.8, '80%'): then it sets maximum_pool_fraction, as
    EMMPOOL_MAXIMUM_POOL_SIZE does. Other values pass unchanged, for _validated to judge."""
    fields = dict(options)
    for name in ("initial_pool_size", "pinned_limit"):
        if isinstance(fields.get(name), str):
            fields[name] = parse_size(fields[name], name)
    maximum = fields.get("maximum_pool_size")
    if isinstance(maximum, float):
        if not 0.0 < maximum <= 1.0:
            raise _bad_fraction("maximum_pool_size", maximum)
        size, fraction = 0, maximum
    elif isinstance(maximum, str):
        size, fraction = _parse_maximum(maximum, "maximum_pool_size")
    else:
        return fields
    if not fraction:
        fields["maximum_pool_size"] = size
    elif "maximum_pool_fraction" in fields:
        raise ValueError(
            f"maximum_pool_size={maximum!r} is a fraction, and maximum_pool_fraction="
            f"{fields['maximum_pool_fraction']!r} is given too: give the fraction once"
        )
    else:
        del fields["maximum_pool_size"]
        fields["maximum_pool_fraction"] = fraction
    return fields


def _env_choice(env, name: str) -> str:
    """The environment's value of a fixed-choice option (see _CHOICES), or its default."""
    default = getattr(Config, name)
    return env.get(_CHOICES[name][0], default).strip().lower() or default


def _from_environment() -> Config:
    env = os.environ
    mode = _env_choice(env, "mode")
    initial = 0
    if "EMMPOOL_INITIAL_POOL_SIZE" in env:
        initial = parse_size(env["EMMPOOL_INITIAL_POOL_SIZE"], "EMMPOOL_INITIAL_POOL_SIZE")
    maximum, fraction = 0, 0.0
    if "EMMPOOL_MAXIMUM_POOL_SIZE" in env:
        maximum, fraction = _parse_maximum(
            env["EMMPOOL_MAXIMUM_POOL_SIZE"], "EMMPOOL_MAXIMUM_POOL_SIZE"
        )
    trace = env.get("EMMPOOL_TRACE", "").strip()
    level = _env_choice(env, "log")
    pinned = _env_choice(env, "pinned")
    pinned_limit = 0
    if "EMMPOOL_PINNED_LIMIT" in env:
        pinned_limit = parse_size(env["EMMPOOL_PINNED_LIMIT"], "EMMPOOL_PINNED_LIMIT")
    return _validated(
        Config(mode, initial, maximum, fraction, trace, level, pinned, pinned_limit)
    )


def _validated(cfg: Config) -> Config:
    for name, (variable, accepted) in _CHOICES.items():
        value = getattr(cfg, name)
        if value not in accepted:
            expected = " or ".join(repr(a) for a in accepted if a)
            raise ValueError(f"{variable} / {name}={value!r}: expected {expected}")
    for name in ("initial_pool_size", "maximum_pool_size", "pinned_limit"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r}: expected a non-negative number of bytes")
    f = cfg.maximum_pool_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
        raise ValueError(f"maximum_pool_fraction={f!r}: expected a number in [0, 1]")
    if not isinstance(cfg.trace, str):
        raise ValueError(f"trace={cfg.trace!r}: expected a file path (str), or '' for none")
    if cfg.trace:
        try:
            open(cfg.trace, "a").close()  # fail now, naming the variable, not at exit
        except OSError as e:
            raise ValueError(
                f"EMMPOOL_TRACE / trace={cfg.trace!r}: cannot write there ({e.strerror})"
            ) from None
    if cfg.maximum_pool_size and cfg.initial_pool_size > cfg.maximum_pool_size:
        raise ValueError(
            f"initial_pool_size ({cfg.initial_pool_size}) exceeds maximum_pool_size "
            f"({cfg.maximum_pool_size})"
        )
    return cfg


_lock = threading.Lock()
_applied: Config | None = None


def resolve(options: dict, base: Config | None = None) -> Config:
    """The options ``configure(**options)`` would apply, checked; applies nothing.

    Options not given take their value from ``base``: by default the options in force, else
    the environment's (``EMMPOOL_*``), as for :func:`configure`. ``Config()`` checks the given
    options alone, e.g. on a Dask client for workers whose environment it cannot see.
    Raises ``TypeError`` for an unknown option and ``ValueError`` for a bad value.
    """
    unknown = set(options) - set(Config.__dataclass_fields__)
    if unknown:
        raise TypeError(
            f"unknown option(s) {sorted(unknown)}; known: {sorted(Config.__dataclass_fields__)}"
        )
    if base is None:
        base = _applied if _applied is not None else _from_environment()
    fields = asdict(base)
    fields.update(_as_fields(options))
    return _validated(Config(**fields))


def configure(**options) -> Config:
    """Set the options of the process-wide pools. Only before the first allocation.

    Keyword arguments are the fields of :class:`Config`; those not given keep their value from
    the environment (``EMMPOOL_*``), or the default. Sizes may also be strings as the variables
    take them (``'4GiB'``), and ``maximum_pool_size`` a fraction of the device's memory
    (``0.8``, ``'80%'``). Raises ``ValueError`` for a bad value and ``RuntimeError`` once a
    pool exists.
    """
    global _applied
    with _lock:
        cfg = resolve(options)
        try:
            _core.configure(
                mode=cfg.mode,
                initial_size=cfg.initial_pool_size,
                maximum_size=cfg.maximum_pool_size,
                maximum_fraction=float(cfg.maximum_pool_fraction),
                pinned_limit=cfg.pinned_limit,
            )
        except RuntimeError as e:  # std::logic_error: a pool exists
            raise RuntimeError(str(e)) from None
        _applied = cfg
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
        # A pool already exists (e.g. created through the CuPy/PyTorch C hooks before any
        # Python-level configuration): it keeps the options it was created with.
        return config()


def config() -> Config:
    """The options in force (or that will be, for pools not yet created)."""
    if _applied is not None:
        return _applied
    o = _core.configured_options()
    # The pinned choice is Python's alone (the C++ pools never see it): the environment's.
    pinned = _env_choice(os.environ, "pinned")
    if pinned not in _PINNED:
        pinned = Config.pinned
    return Config(o["mode"], o["initial_size"], o["maximum_size"], o["maximum_fraction"],
                  _trace_path or "", logging.getLevelName(log.level).lower() if log.level else "",
                  pinned, o["pinned_limit"])

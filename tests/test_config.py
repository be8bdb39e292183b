"""Configuration: one parser for the environment and configure(), the values in force and
where each came from, and bad values failing where emmpool is installed into a library."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import emmpool
from emmpool import _config, _core

GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture(autouse=True)
def fresh_config(monkeypatch):
    """No EMMPOOL_* from the caller's environment, nothing configured; the core's options are
    put back afterwards (no pool exists in these tests, so configure() may run)."""
    for name in list(os.environ):
        if name.startswith("EMMPOOL_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(_config, "_applied", None)
    monkeypatch.setattr(_config, "_applied_sources", {})
    saved = _core.configured_options()
    yield
    if not (_core.pools() or _core.pinned_pools()):
        _core.configure(mode=saved["mode"], initial_size=saved["initial_size"],
                        maximum_size=saved["maximum_size"],
                        maximum_fraction=saved["maximum_fraction"],
                        pinned_limit=saved["pinned_limit"])


def settings() -> dict[str, _config.Setting]:
    return {s.option: s for s in _config.report()}


# ---- parsers ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, expected",
    [("1024", 1024), ("4KiB", 4096), ("2 MB", 2 * MiB), ("1.5GiB", 3 << 29), ("1t", 1 << 40),
     (512, 512), (0, 0)],
)
def test_parse_size(value, expected):
    assert _config.parse_size(value, "X") == expected


@pytest.mark.parametrize("value", ["", "-1", "12 parsecs", "1e9", "GiB", "0x10", "0.8", -1,
                                   True, 1.5, None])
def test_parse_size_rejects(value):
    with pytest.raises(ValueError, match="X="):
        _config.parse_size(value, "X")


@pytest.mark.parametrize(
    "value, expected",
    [("16GiB", (16 * GiB, None)), (GiB, (GiB, None)), ("80%", (None, 0.8)),
     ("0.5", (None, 0.5)), (0.25, (None, 0.25)), ("100%", (None, 1.0)), (None, (None, None))],
)
def test_parse_maximum(value, expected):
    assert _config.parse_maximum(value, "X") == expected


@pytest.mark.parametrize(
    "value, message",
    [("-5", "neither a size nor a fraction"), ("lots", "neither a size nor a fraction"),
     ("150%", r"fraction of the device's memory in \(0, 1\]"), ("1.5", r"in \(0, 1\]"),
     (0.0, r"in \(0, 1\]"), ("0", "no memory"), (0, "no memory")],
)
def test_parse_maximum_says_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        _config.parse_maximum(value, "X")


# ---- the environment -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env, message",
    [
        ({"EMMPOOL_MODE": "turbo"}, "EMMPOOL_MODE='turbo': expected 'pool' or 'passthrough'"),
        ({"EMMPOOL_INITIAL_POOL_SIZE": "lots"}, "EMMPOOL_INITIAL_POOL_SIZE='lots' is not a size"),
        ({"EMMPOOL_MAXIMUM_POOL_SIZE": "150%"}, "EMMPOOL_MAXIMUM_POOL_SIZE='150%'"),
        ({"EMMPOOL_MAXIMUM_POOL_SIZE": "-5"}, "EMMPOOL_MAXIMUM_POOL_SIZE='-5' is neither a size"),
        ({"EMMPOOL_INITIAL_POOL_SIZE": "2GiB", "EMMPOOL_MAXIMUM_POOL_SIZE": "1GiB"}, "exceeds"),
        ({"EMMPOOL_PINNED": "yes"}, "EMMPOOL_PINNED='yes'"),
        ({"EMMPOOL_PINNED_LIMIT": "half"}, "EMMPOOL_PINNED_LIMIT='half'"),
        ({"EMMPOOL_PINNED_LIMIT": "0"}, "EMMPOOL_PINNED_LIMIT=0"),
        ({"EMMPOOL_LOG": "loud"}, "EMMPOOL_LOG='loud'"),
        ({"EMMPOOL_TRACE": "/nonexistent-dir/trace.csv"}, "EMMPOOL_TRACE"),
    ],
)
def test_bad_environment_is_named(monkeypatch, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for check in (_config.check_environment, emmpool.config, _config.report, emmpool.configure):
        with pytest.raises(ValueError, match=message):
            check()


def test_config_reports_the_environment_in_force(monkeypatch):
    monkeypatch.setenv("EMMPOOL_MODE", "Passthrough")
    monkeypatch.setenv("EMMPOOL_INITIAL_POOL_SIZE", "1GiB")
    monkeypatch.setenv("EMMPOOL_MAXIMUM_POOL_SIZE", "80%")
    monkeypatch.setenv("EMMPOOL_LOG", "")  # empty: as if unset
    assert emmpool.config() == emmpool.Config(mode="passthrough", initial_pool_size=GiB,
                                              maximum_pool_fraction=0.8)
    s = settings()
    assert (s["mode"].value, s["mode"].source) == ("passthrough", "EMMPOOL_MODE='Passthrough'")
    assert s["initial_pool_size"].value == "1 GiB (1073741824 bytes)"
    assert s["initial_pool_size"].source == "EMMPOOL_INITIAL_POOL_SIZE='1GiB'"
    assert s["maximum_pool_size"].value == "80% of the device's memory"
    assert s["pinned"].source == s["log"].source == "default"


def test_defaults_are_said_in_words():
    assert emmpool.config() == emmpool.Config()
    s = settings()
    assert all(setting.source == "default" for setting in s.values())
    assert s["maximum_pool_size"].value == "no cap but the device's memory"
    assert s["pinned_limit"].value.startswith("a quarter of physical memory, ")
    assert s["trace"].value == "off"


def test_pinned_configuration(monkeypatch):
    monkeypatch.setenv("EMMPOOL_PINNED", "Numba")
    monkeypatch.setenv("EMMPOOL_PINNED_LIMIT", "8GiB")
    cfg = emmpool.config()
    assert cfg.pinned == "numba" and cfg.pinned_limit == 8 * GiB
    assert settings()["pinned"].value == "numba (Numba's own pinned memory)"


def test_checking_the_environment_creates_no_trace_file(monkeypatch, tmp_path):
    path = tmp_path / "run.csv"
    monkeypatch.setenv("EMMPOOL_TRACE", str(path))
    _config.check_environment()
    assert settings()["trace"].value == str(path) and not path.exists()


# ---- configure() -----------------------------------------------------------------------------
def test_configure_takes_the_forms_the_variables_take(monkeypatch):
    monkeypatch.setenv("EMMPOOL_MODE", "passthrough")
    cfg = emmpool.configure(initial_pool_size="512MiB", maximum_pool_size="80%")
    assert (cfg.initial_pool_size, cfg.maximum_pool_size, cfg.maximum_pool_fraction) == (
        512 * MiB, None, 0.8)
    assert emmpool.config() == cfg
    s = settings()
    assert s["initial_pool_size"].source == s["maximum_pool_size"].source == "configure()"
    assert s["mode"].source == "EMMPOOL_MODE='passthrough'" and s["mode"].value == "passthrough"
    assert s["pinned"].source == "default"
    # A later call changes only what it names; a size replaces the fraction.
    cfg = emmpool.configure(maximum_pool_size="16GiB", pinned_limit="8GiB")
    assert (cfg.initial_pool_size, cfg.maximum_pool_size, cfg.maximum_pool_fraction) == (
        512 * MiB, 16 * GiB, None)
    assert cfg.pinned_limit == 8 * GiB
    assert settings()["maximum_pool_size"].value == "16 GiB (17179869184 bytes)"
    assert emmpool.configure(maximum_pool_size=0.5).maximum_pool_fraction == 0.5
    assert emmpool.configure(maximum_pool_fraction="25%").maximum_pool_fraction == 0.25
    assert emmpool.configure(maximum_pool_size=None).maximum_pool_fraction is None
    assert emmpool.configure(initial_pool_size=GiB).initial_pool_size == GiB
    assert _core.configured_options()["initial_size"] == GiB  # it reached the core


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"colour": "blue"}, TypeError, "unknown option"),
        ({"mode": "fast"}, ValueError, "mode='fast'"),
        ({"maximum_pool_fraction": 3}, ValueError, "maximum_pool_fraction=3"),
        ({"maximum_pool_size": -5}, ValueError, "maximum_pool_size=-5"),
        ({"maximum_pool_size": "1GiB", "maximum_pool_fraction": 0.5}, TypeError, "not both"),
        ({"initial_pool_size": "2GiB", "maximum_pool_size": "1GiB"}, ValueError, "exceeds"),
        ({"initial_pool_size": 1.5}, ValueError, "initial_pool_size=1.5"),
        ({"pinned_limit": 0}, ValueError, "pinned_limit=0"),
        ({"trace": 42}, ValueError, "trace=42"),
    ],
)
def test_configure_rejects_bad_options(options, error, message):
    with pytest.raises(error, match=message):
        emmpool.configure(**options)
    assert _config._applied is None  # nothing half-applied


def test_log_level_and_configuration_message(monkeypatch, caplog):
    monkeypatch.setenv("EMMPOOL_LOG", "Info")
    assert emmpool.config().log == "info"
    with caplog.at_level("INFO", logger="emmpool"):
        emmpool.configure()
    assert any("emmpool configured" in r.getMessage() for r in caplog.records)


# ---- bad values fail where emmpool is installed, not at the first allocation ----------------
_INSTALLS = {
    "use_for_numba": "import emmpool; emmpool.use_for_numba()",
    "plugin import": "import emmpool.plugin",  # what NUMBA_CUDA_MEMORY_MANAGER does
}


@pytest.mark.parametrize("install", sorted(_INSTALLS))
@pytest.mark.parametrize(
    "variable, value, message",
    [("EMMPOOL_MODE", "bogus", "EMMPOOL_MODE='bogus': expected"),
     ("EMMPOOL_MAXIMUM_POOL_SIZE", "-5", "EMMPOOL_MAXIMUM_POOL_SIZE='-5' is neither"),
     ("EMMPOOL_MODE", "passthrough", None)],  # a good value: installs without complaint
)
def test_bad_environment_fails_where_emmpool_is_installed(install, variable, value, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMMPOOL_")}
    env[variable] = value
    p = subprocess.run([sys.executable, "-c", _INSTALLS[install]], env=env, text=True,
                       capture_output=True, timeout=120)
    if message is None:
        assert p.returncode == 0, p.stderr
    else:
        assert p.returncode == 1 and f"ValueError: {message}" in p.stderr, p.stderr


def test_resolve_checks_options_and_applies_nothing():
    # What the Dask plugin asks on the client: the options checked against the defaults alone
    # (not the client's environment), nothing applied.
    defaults = _config.Config()
    cfg = _config.resolve({"initial_pool_size": "64MiB", "maximum_pool_size": "80%"}, defaults)
    assert cfg == _config.Config(initial_pool_size=64 * MiB, maximum_pool_fraction=0.8)
    assert _config.resolve({"maximum_pool_size": "16GiB"}, defaults).maximum_pool_size == 16 * GiB
    with pytest.raises(ValueError, match="exceeds"):
        _config.resolve({"initial_pool_size": "2GiB", "maximum_pool_size": "1GiB"}, defaults)
    with pytest.raises(TypeError, match="unknown option"):
        _config.resolve({"colour": "blue"}, defaults)
    before = _core.configured_options()
    assert _config.resolve({"initial_pool_size": "3MiB"}).initial_pool_size == 3 * MiB
    assert _core.configured_options() == before

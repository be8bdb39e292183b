"""Configuration: one parser for the environment and configure(), the values in force and
where each came from, and bad values failing where emmpool is installed into a library."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import emmpool
from emmpool import _config, _core
from tests.conftest import needs_repository

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
    monkeypatch.setattr(_config, "_warned", set())  # each test sees its own warnings
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
    [("-5", "X='-5': cannot be negative"), ("lots", "neither a size nor a fraction"),
     ("150%", r"fraction of the device's memory in \(0, 1\]"), ("1.5", r"in \(0, 1\]"),
     (0.0, r"in \(0, 1\]"), ("0", "no memory"), (0, "no memory")],
)
def test_parse_maximum_says_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        _config.parse_maximum(value, "X")


@pytest.mark.parametrize("option, value", [
    *((option, value) for option in ("initial_pool_size", "pinned_limit", "growable_free_limit",
                                     "growable_page_size", "maximum_pool_size")
      for value in (-1, "-1", "-512MiB")),
    ("maximum_pool_size", -0.5), ("maximum_pool_size", "-80%")])
def test_every_option_says_a_negative_value_the_same_way(option, value):
    with pytest.raises(ValueError) as e:
        emmpool.configure(**{option: value})
    assert str(e.value) == f"{option}={value!r}: cannot be negative"


# ---- the environment -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env, message",
    [
        ({"EMMPOOL_MODE": "turbo"}, "EMMPOOL_MODE='turbo': expected 'pool' or 'passthrough'"),
        ({"EMMPOOL_INITIAL_POOL_SIZE": "lots"}, "EMMPOOL_INITIAL_POOL_SIZE='lots' is not a size"),
        ({"EMMPOOL_MAXIMUM_POOL_SIZE": "150%"}, "EMMPOOL_MAXIMUM_POOL_SIZE='150%'"),
        ({"EMMPOOL_MAXIMUM_POOL_SIZE": "-5"}, "EMMPOOL_MAXIMUM_POOL_SIZE='-5': cannot be negative"),
        ({"EMMPOOL_INITIAL_POOL_SIZE": "2GiB", "EMMPOOL_MAXIMUM_POOL_SIZE": "1GiB"}, "exceeds"),
        ({"EMMPOOL_PINNED": "yes"}, "EMMPOOL_PINNED='yes'"),
        ({"EMMPOOL_PINNED_LIMIT": "half"}, "EMMPOOL_PINNED_LIMIT='half'"),
        ({"EMMPOOL_PINNED_LIMIT": "0"}, "EMMPOOL_PINNED_LIMIT=0"),
        ({"EMMPOOL_LOG": "loud"}, "EMMPOOL_LOG='loud'"),
        ({"EMMPOOL_TRACE": "/nonexistent-dir/trace.csv"}, "EMMPOOL_TRACE"),
        ({"EMMPOOL_TORCH_ALLOCATOR": "fast"}, "EMMPOOL_TORCH_ALLOCATOR='fast': expected 'auto'"),
    ],
)
def test_bad_environment_is_named(monkeypatch, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # Every call that depends on the configuration says it, the pools' statistics too: an
    # empty answer would hide the mistake.
    for check in (_config.check_environment, emmpool.config, _config.report, emmpool.configure,
                  emmpool.stats, emmpool.trim, emmpool.reset_peak_stats):
        with pytest.raises(ValueError, match=message):
            check()


def test_report_raises_the_first_bad_value_and_diagnose_says_them_all(monkeypatch):
    monkeypatch.setenv("EMMPOOL_MODE", "turbo")
    monkeypatch.setenv("EMMPOOL_MAXIMUM_POOL_SIZE", "150%")
    monkeypatch.setenv("EMMPOOL_PINNED_LIMIT", "half")
    monkeypatch.setenv("EMMPOOL_TORCH_ALLOCATOR", "fast")
    monkeypatch.setenv("EMMPOOL_INITIAL_POOL_SIZE", "1GiB")  # a good one among them
    with pytest.raises(ValueError, match="EMMPOOL_MODE='turbo'"):
        _config.report()
    settings, errors = _config.diagnose()
    assert [e.split("=")[0] for e in errors] == [
        "EMMPOOL_MODE", "EMMPOOL_MAXIMUM_POOL_SIZE", "EMMPOOL_PINNED_LIMIT",
        "EMMPOOL_TORCH_ALLOCATOR"]
    s = {setting.option: setting for setting in settings}
    for option, variable in [("mode", "EMMPOOL_MODE='turbo'"),
                             ("maximum_pool_size", "EMMPOOL_MAXIMUM_POOL_SIZE='150%'"),
                             ("pinned_limit", "EMMPOOL_PINNED_LIMIT='half'"),
                             ("torch_allocator", "EMMPOOL_TORCH_ALLOCATOR='fast'")]:
        assert s[option].value.startswith("invalid") and s[option].source == variable
    assert s["initial_pool_size"].value == "1 GiB (1073741824 bytes)"
    assert s["segments"].source == "default"


def test_diagnose_says_values_that_conflict_and_shows_both(monkeypatch):
    monkeypatch.setenv("EMMPOOL_INITIAL_POOL_SIZE", "2GiB")
    monkeypatch.setenv("EMMPOOL_MAXIMUM_POOL_SIZE", "1GiB")
    settings, errors = _config.diagnose()
    assert len(errors) == 1 and "exceeds" in errors[0]
    s = {setting.option: setting.value for setting in settings}
    assert s["initial_pool_size"].startswith("2 GiB") and s["maximum_pool_size"].startswith("1 GiB")


@pytest.mark.parametrize(
    "value, words, source",
    [(None, "auto (", "default"),
     ("Pluggable", "pluggable (", "EMMPOOL_TORCH_ALLOCATOR='Pluggable'"),
     ("extension", "extension (", "EMMPOOL_TORCH_ALLOCATOR='extension'")],
)
def test_report_says_how_pytorch_would_be_served(monkeypatch, value, words, source):
    if value is not None:
        monkeypatch.setenv("EMMPOOL_TORCH_ALLOCATOR", value)
    s = settings()["torch_allocator"]
    assert s.value.startswith(words) and s.source == source


def test_torch_allocator_is_configured_as_every_option(monkeypatch):
    # EMMPOOL_TORCH_ALLOCATOR's lower-case twin, as every variable has one; what
    # use_for_torch() then installs.
    from emmpool import _torch

    assert _torch._choice(None) == "auto"
    assert emmpool.configure(torch_allocator="Pluggable").torch_allocator == "pluggable"
    assert _torch._choice(None) == "pluggable"
    assert _torch._choice("extension") == "extension"  # the argument wins
    s = settings()["torch_allocator"]
    assert s.value.startswith("pluggable (") and s.source == "configure()"
    with pytest.raises(ValueError, match="torch_allocator='fast': expected 'auto' or "):
        emmpool.configure(torch_allocator="fast")
    with pytest.raises(ValueError, match="allocator='fast': expected 'auto' or "):
        _torch._choice("fast")


def test_every_variable_has_its_lower_case_twin():
    assert {f"EMMPOOL_{name.upper()}" for name in _config._OPTIONS
            if name != "maximum_pool_fraction"} == set(_config.VARIABLES) - {
        _config._BUILD_HEADERS, _config._RMM_CACHE}
    assert set(_config._OPTIONS) - {"maximum_pool_fraction"} == {
        f.name for f in fields(emmpool.Config)}


def test_maximum_pool_fraction_is_maximum_pool_size_given_a_fraction():
    with pytest.warns(DeprecationWarning, match=r"maximum_pool_size takes a fraction.*"
                                                r"maximum_pool_size='25%'") as record:
        cfg = emmpool.configure(maximum_pool_fraction="25%")
    assert record[0].filename == __file__  # the caller's line
    assert cfg == emmpool.configure(maximum_pool_size="25%")
    # The option's own name says it: the cap is maximum_pool_size, a fraction here.
    assert (cfg.maximum_pool_size, cfg.maximum_pool_fraction) == (0.25, 0.25)
    assert "maximum_pool_size=0.25" in repr(cfg) and "fraction" not in repr(cfg)


def test_config_reports_the_environment_in_force(monkeypatch):
    monkeypatch.setenv("EMMPOOL_MODE", "Passthrough")
    monkeypatch.setenv("EMMPOOL_INITIAL_POOL_SIZE", "1GiB")
    monkeypatch.setenv("EMMPOOL_MAXIMUM_POOL_SIZE", "80%")
    monkeypatch.setenv("EMMPOOL_LOG", "")  # empty: as if unset
    assert emmpool.config() == emmpool.Config(mode="passthrough", initial_pool_size=GiB,
                                              maximum_pool_size=0.8)
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


# ---- EMMPOOL_* variables emmpool does not read -----------------------------------------------
UnknownVariableWarning = _config.UnknownVariableWarning


@pytest.mark.parametrize(
    "variable, nearest",
    [("EMMPOOL_MAXIMUM_POOLSIZE", "did you mean EMMPOOL_MAXIMUM_POOL_SIZE?"),
     ("EMMPOOL_MAX_POOL_SIZE", "did you mean EMMPOOL_MAXIMUM_POOL_SIZE?"),
     ("EMMPOOL_MDOE", "did you mean EMMPOOL_MODE?"),
     ("EMMPOOL_mode", "did you mean EMMPOOL_MODE?"),
     ("EMMPOOL_TORCH_ALLOCATER", "did you mean EMMPOOL_TORCH_ALLOCATOR?"),
     ("EMMPOOL_COLOUR", "emmpool reads EMMPOOL_CUDA_HEADERS, EMMPOOL_GROWABLE_FREE_LIMIT, ")],
)
def test_an_unknown_variable_is_warned_of_once_naming_the_nearest(monkeypatch, variable, nearest):
    monkeypatch.setenv(variable, "1GiB")
    with pytest.warns(UnknownVariableWarning) as record:
        for check in (_config.check_environment, emmpool.config, _config.report,
                      _config.ensure_configured):
            check()
    assert len(record) == 1, [str(w.message) for w in record]
    message = str(record[0].message)
    assert message.startswith(f"{variable} is not an emmpool variable and has no effect: ")
    assert nearest in message, message
    assert record[0].filename == __file__  # the caller's line, not emmpool's
    _config.check_environment()  # once: warnings are errors here, and none comes


def test_every_unknown_variable_is_named(monkeypatch):
    monkeypatch.setenv("EMMPOOL_MAXIMUM_POOLSIZE", "1GiB")
    monkeypatch.setenv("EMMPOOL_PINNED_LIMT", "1GiB")
    with pytest.warns(UnknownVariableWarning) as record:
        emmpool.config()
    assert sorted(str(w.message).split()[0] for w in record) == [
        "EMMPOOL_MAXIMUM_POOLSIZE", "EMMPOOL_PINNED_LIMT"]


def test_an_empty_unknown_variable_counts_as_unset(monkeypatch):
    monkeypatch.setenv("EMMPOOL_MAXIMUM_POOLSIZE", "")
    _config.check_environment()  # warnings are errors here
    assert _config.unknown_variables() == []


@pytest.mark.parametrize("variable", ["EMMPOOL_TORCH_ALLOCATOR", "EMMPOOL_CUDA_HEADERS"])
def test_variables_emmpool_reads_elsewhere_are_not_warned_of(monkeypatch, variable):
    # EMMPOOL_TORCH_ALLOCATOR is read where PyTorch is installed, EMMPOOL_CUDA_HEADERS by the
    # build: a shell that keeps either exported is not misspelling anything.
    monkeypatch.setenv(variable, "auto" if "TORCH" in variable else "pip")
    _config.check_environment()  # warnings are errors here
    assert _config.unknown_variables() == []


@pytest.mark.parametrize("variable", ["EMMPOOL_BENCH_DEADLINE", "EMMPOOL_TEST_CUDA",
                                      "EMMPOOL_GPU_SKIP_TORCH", "EMMPOOL_PYTEST_ARGS"])
def test_every_emmpool_variable_is_one_of_emmpools_own(monkeypatch, variable):
    # The repository's tools name theirs EMMCI_*: an EMMPOOL_* name emmpool does not read is a
    # slip, whatever it looks like.
    monkeypatch.setenv(variable, "1")
    monkeypatch.setenv("EMMCI_" + variable[len("EMMPOOL_"):], "1")
    assert [m.split()[0] for m in _config.unknown_variables()] == [variable]


ROOT = Path(__file__).resolve().parents[1]
# Files that misspell variables on purpose, to test the warning.
_MISSPELLING_ON_PURPOSE = {"tests/test_config.py", "tests/test_cli_input.py"}


def test_no_variable_the_repositorys_tools_use_is_warned_of():
    # The tests, benchmarks and CI scripts run emmpool with their environment: where warnings
    # are errors (pytest here, CuPy's suite), an EMMPOOL_* name emmpool does not read would
    # fail them. Their own knobs are EMMCI_*.
    names = {}
    for top in ("tests", "benchmarks", ".ci", "pyproject.toml"):  # pyproject: the build's
        for path in sorted([ROOT / top, *(ROOT / top).rglob("*")]):
            relative = path.relative_to(ROOT).as_posix()
            if not path.is_file() or relative in _MISSPELLING_ON_PURPOSE:
                continue
            if path.name == "CMakeLists.txt":  # CMake options (-DEMMPOOL_...), not variables
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for name in re.findall(r"\bEMMPOOL_[A-Za-z0-9_]+", text):
                names.setdefault(name, relative)
    if not names:
        pytest.skip(needs_repository("tests/, benchmarks/ and .ci/"))
    unknown = {n: where for n, where in names.items() if n not in _config.VARIABLES}
    assert not unknown, f"variables of the tools that emmpool would warn of: {unknown}"


def test_a_misspelt_variable_is_warned_of_where_emmpool_is_installed():
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMMPOOL_")}
    env["EMMPOOL_MAXIMUM_POOLSIZE"] = "1GiB"
    p = subprocess.run([sys.executable, "-c", _INSTALLS["plugin import"]], env=env, text=True,
                       capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "UnknownVariableWarning: EMMPOOL_MAXIMUM_POOLSIZE is not an emmpool variable" in p.stderr
    assert p.stderr.count("UnknownVariableWarning") == 1, p.stderr


# ---- configure() -----------------------------------------------------------------------------
def test_configure_takes_the_forms_the_variables_take(monkeypatch):
    monkeypatch.setenv("EMMPOOL_MODE", "passthrough")
    cfg = emmpool.configure(initial_pool_size="512MiB", maximum_pool_size="80%")
    assert (cfg.initial_pool_size, cfg.maximum_pool_size, cfg.maximum_pool_fraction) == (
        512 * MiB, 0.8, 0.8)
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
    assert emmpool.configure(maximum_pool_size=None).maximum_pool_fraction is None
    assert emmpool.configure(initial_pool_size=GiB).initial_pool_size == GiB
    assert _core.configured_options()["initial_size"] == GiB  # it reached the core


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"colour": "blue"}, TypeError, "unknown option"),
        ({"mode": "fast"}, ValueError, "mode='fast'"),
        ({"torch_allocator": "fast"}, ValueError, "torch_allocator='fast'"),
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


# ---- bad values fail where emmpool is installed or first asked, not at the first allocation --
_INSTALLS = {
    "use_for_numba": "import emmpool; emmpool.use_for_numba()",
    "plugin import": "import emmpool.plugin",  # what NUMBA_CUDA_MEMORY_MANAGER does
    # import emmpool alone never fails; the first call that depends on the configuration does
    "stats": "import emmpool; emmpool.stats()",
}


@pytest.mark.parametrize("install", sorted(_INSTALLS))
@pytest.mark.parametrize(
    "variable, value, message",
    [("EMMPOOL_MODE", "bogus", "EMMPOOL_MODE='bogus': expected"),
     ("EMMPOOL_MAXIMUM_POOL_SIZE", "-5", "EMMPOOL_MAXIMUM_POOL_SIZE='-5': cannot be negative"),
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
    assert cfg == _config.Config(initial_pool_size=64 * MiB, maximum_pool_size=0.8)
    assert _config.resolve({"maximum_pool_size": "16GiB"}, defaults).maximum_pool_size == 16 * GiB
    with pytest.raises(ValueError, match="exceeds"):
        _config.resolve({"initial_pool_size": "2GiB", "maximum_pool_size": "1GiB"}, defaults)
    with pytest.raises(TypeError, match="unknown option"):
        _config.resolve({"colour": "blue"}, defaults)
    with pytest.raises(TypeError, match="unknown option maximum_pool_sise: did you mean "
                                        "maximum_pool_size?"):
        _config.resolve({"maximum_pool_sise": "1GiB"}, defaults)
    before = _core.configured_options()
    assert _config.resolve({"initial_pool_size": "3MiB"}).initial_pool_size == 3 * MiB
    assert _core.configured_options() == before

"""The command line and bad input: one line on stderr and exit status 2, never a traceback;
``info`` says every bad setting and exits 1, a missing driver in a line (no GPU needed)."""

from __future__ import annotations

import io
import re
import os

import pytest

import emmpool
from emmpool import _config, _info, trace
from tests.test_trace_cli import run_cli

HEADER = ",".join(trace.FIELDS) + "\n"
ONE_ALLOCATION = HEADER + "1,0,alloc,4096,1000,1,numba\n2,0,free,4096,1000,1,numba\n"


def environment(**variables):
    """This process's environment without EMMPOOL_* variables or Numba's manager, plus these."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("EMMPOOL_") and k != "NUMBA_CUDA_MEMORY_MANAGER"}
    return {**env, **variables}


def one_line_error(p, command: str) -> str:
    """The message of a failed command: one line on stderr, exit status 2, no traceback."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    prefix = f"python -m emmpool {command}: error: "
    assert lines[0].startswith(prefix), p.stderr
    return lines[0][len(prefix):]


@pytest.mark.parametrize("option", ["--version", "-V"])
def test_version(option):
    p = run_cli(option)
    assert (p.returncode, p.stdout, p.stderr) == (0, f"emmpool {emmpool.__version__}\n", "")


# ---- replay: input that is not a trace -------------------------------------------------------
@pytest.mark.parametrize(
    "content, message",
    [
        (None, "missing.csv: No such file or directory"),
        ("", "not an emmpool trace (expected header time_ns,device,op,ptr,size,stream,library)"),
        ("a,b\n1,2\n", "not an emmpool trace (expected header"),
        (HEADER + "1,0,alloc,5,10\n", "t.csv:2: bad trace row ['1', '0', 'alloc', '5', '10']: "
                                      "expected 7 fields"),
        (HEADER + "1,0,steal,5,10,1,numba\n", "t.csv:2: bad trace row"),
        (HEADER + "1,0,alloc,5,10,1,fortran\n", "expected op alloc or free with a library of"),
        (HEADER + "1,0,alloc,0x5,10,1,numba\n", "t.csv:2: bad trace row"),
        (HEADER + "1,0,alloc,5,ten,1,numba\n", "size is not an integer"),
        (HEADER + "1,0,alloc,5,-10,1,numba\n", "size is out of range"),
        (HEADER + f"1,0,alloc,5,{1 << 64},1,numba\n", "size is out of range"),
        (HEADER + "1,0,alloc,5,10,-1,numba\n", "stream is out of range"),
        (HEADER + '1,0,"alloc,5,10,1,numba\n', "t.csv:2: bad trace row"),  # an unclosed quote
        # Refused on its line, whether Python's csv module refuses the NUL (3.10) or reads it
        # into a field that is then no op (3.11 on): which sentence says it is CPython's.
        (HEADER + "1,0,al\0loc,5,10,1,numba\n", "t.csv:2: "),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "not an emmpool trace"),
        (HEADER, "nothing to replay on device 0: the trace holds no allocation"),
        (HEADER + "1,0,sync,0,0,0,\n", "the trace holds no allocation"),
    ],
    ids=["missing", "empty", "other-csv", "short-row", "bad-op", "bad-library", "hex", "word",
         "negative", "too-big", "negative-stream", "quote", "nul", "binary", "header-only",
         "no-allocation"],
)
def test_replay_says_what_is_wrong_with_the_file_in_one_line(tmp_path, content, message):
    path = tmp_path / ("missing.csv" if content is None else "t.csv")
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    p = run_cli("replay", str(path), "--backends", "emmpool-host", env=environment())
    assert message in one_line_error(p, "replay")
    assert p.stdout == ""  # nothing half-printed before the error


def test_replay_of_a_folder(tmp_path):
    p = run_cli("replay", str(tmp_path), env=environment())
    assert one_line_error(p, "replay") == f"{tmp_path}: Is a directory"


def test_replay_names_the_devices_a_trace_allocates_on(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(ONE_ALLOCATION)
    p = run_cli("replay", str(path), "--device", "3", env=environment())
    assert one_line_error(p, "replay") == (
        f"{path}: nothing to replay on device 3: the trace allocates on device 0: choose one "
        f"with --device")


def test_replay_with_a_bad_emmpool_value_is_one_line(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(ONE_ALLOCATION)
    p = run_cli("replay", str(path), "--backends", "emmpool-host",
                env=environment(EMMPOOL_SEGMENTS="elastic"))
    assert one_line_error(p, "replay").startswith("EMMPOOL_SEGMENTS='elastic': expected")


def test_a_backend_that_cannot_replay_is_a_row_and_the_others_go_on(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(HEADER + f"1,0,alloc,4096,{1 << 50},1,numba\n")  # past the host driver's 16 TiB
    p = run_cli("replay", str(path), "--backends", "emmpool-host", "emmpool-host-behind",
                env=environment())
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("| emmpool-host")]
    assert len(rows) == 2 and all("| failed: emmpool: out of memory" in r for r in rows), p.stdout


def test_a_warning_is_one_line_and_the_command_goes_on(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(ONE_ALLOCATION)
    p = run_cli("replay", str(path), "--backends", "emmpool-host",
                env=environment(EMMPOOL_MAXIMUM_POOLSIZE="1GiB"))
    assert p.returncode == 0, p.stderr
    assert p.stderr == ("python -m emmpool: warning: EMMPOOL_MAXIMUM_POOLSIZE is not an emmpool "
                        "variable and has no effect: did you mean EMMPOOL_MAXIMUM_POOL_SIZE?\n")
    assert "| emmpool-host |" in p.stdout


@pytest.mark.parametrize(
    "args, message",
    [(["replay", "t.csv", "--device", "-1"], "argument --device: expected a device ordinal"),
     (["replay", "t.csv", "--device", "first"], "argument --device: expected a device ordinal"),
     (["replay", "t.csv", "--backends", "magic"], "argument --backends: invalid choice: 'magic'"),
     (["replay", "--backends", "magic", "t.csv"], "argument --backends: invalid choice: 'magic'"),
     (["replay", "--backends", "emmpool-host"], "the following arguments are required: TRACE"),
     (["replay", "t.csv", "--backends", ","], "argument --backends: expected at least one"),
     (["bench", "--budget", "0"], "argument --budget: expected a number of seconds > 0"),
     (["bench", "--budget", "nan"], "argument --budget: expected a number of seconds > 0"),
     ([], "the following arguments are required: COMMAND")],
)
def test_usage_errors_are_argparses(args, message):
    p = run_cli(*args, env=environment())
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert message in p.stderr.splitlines()[-1], p.stderr


@pytest.mark.parametrize(
    "args",
    [["--backends", "emmpool-host", "TRACE"],  # the trace after the backends: not a backend
     ["--backends", "emmpool-host", "emmpool-host-behind", "TRACE"],
     ["--backends", "emmpool-host,emmpool-host-behind", "TRACE"],
     ["TRACE", "--backends", "emmpool-host", "emmpool-host-behind"],
     ["--device", "0", "TRACE", "--backends", "emmpool-host"]],
)
def test_replay_takes_the_trace_before_or_after_the_backends(tmp_path, args):
    path = tmp_path / "t.csv"
    path.write_text(ONE_ALLOCATION)
    p = run_cli("replay", *[str(path) if a == "TRACE" else a for a in args], env=environment())
    assert p.returncode == 0, p.stderr
    rows = [line.split("|")[1].strip() for line in p.stdout.splitlines()
            if line.startswith("| emmpool-host")]
    asked = [n for a in args[args.index("--backends") + 1:] if a != "TRACE"
             for n in a.split(",")]
    assert rows == asked, p.stdout


# ---- info: every setting, every bad value, exit status 1 -------------------------------------
def test_info_says_every_bad_value_and_exits_1():
    p = run_cli("info", env=environment(EMMPOOL_MODE="bogus", EMMPOOL_PINNED="yes",
                                        EMMPOOL_MAXIMUM_POOL_SIZE="150%",
                                        EMMPOOL_TORCH_ALLOCATOR="fast",
                                        EMMPOOL_MAXIMUM_POOLSIZE="1GiB"))
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr == "", p.stderr  # the report says it all, warnings included
    errors = [line for line in p.stdout.splitlines() if line.startswith("  error: ")]
    assert [e.split("=")[0] for e in errors] == [
        "  error: EMMPOOL_MODE", "  error: EMMPOOL_MAXIMUM_POOL_SIZE", "  error: EMMPOOL_PINNED",
        "  error: EMMPOOL_TORCH_ALLOCATOR"], p.stdout
    assert "  error: EMMPOOL_TORCH_ALLOCATOR='fast': expected 'auto' or 'extension' or 'pluggable'" \
        in errors
    unwrapped = p.stdout.replace("\n    ", " ")  # lines wrapped at 100 columns, joined
    assert ("  warning: EMMPOOL_MAXIMUM_POOLSIZE is not an emmpool variable and has no effect: "
            "did you mean EMMPOOL_MAXIMUM_POOL_SIZE?") in unwrapped.splitlines()
    assert max(len(line) for line in p.stdout.splitlines()) <= 100, p.stdout
    rows = {line.split()[0]: line for line in p.stdout.splitlines() if line.startswith("  ")}
    assert rows["mode"].endswith("from EMMPOOL_MODE='bogus'") and " invalid " in rows["mode"]
    assert rows["torch_allocator"].endswith("from EMMPOOL_TORCH_ALLOCATOR='fast'")
    assert rows["segments"].endswith("from default")  # the good settings are still shown
    assert "driver: " in p.stdout and "numba-cuda" in p.stdout  # and the rest of the report


@pytest.fixture
def fresh_config(monkeypatch):
    for name in list(os.environ):
        if name.startswith("EMMPOOL_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(_config, "_applied", None)
    monkeypatch.setattr(_config, "_warned", set())
    monkeypatch.setattr(_info, "_print_driver", lambda say: True)  # as if a GPU were here


def report() -> tuple[int, str]:
    out = io.StringIO()
    return _info.print_report(out), out.getvalue()


def test_info_exit_status_is_that_of_the_settings(fresh_config, monkeypatch):
    status, out = report()
    assert status == 0 and "error:" not in out
    assert re.search(r"^  torch_allocator +auto \(", out, re.M), out
    assert out.count("from default") == 11, out  # every option (maximum_pool_fraction: none)
    assert re.search(r"^  growable_page_size +20 MiB", out, re.M)
    monkeypatch.setenv("EMMPOOL_TORCH_ALLOCATOR", "Pluggable")
    status, out = report()
    assert status == 0 and "from EMMPOOL_TORCH_ALLOCATOR='Pluggable'" in out
    monkeypatch.setenv("EMMPOOL_MAXIMUM_POOLSIZE", "1GiB")  # misspelt: a warning, not an error
    status, out = report()
    assert status == 0 and "  warning: EMMPOOL_MAXIMUM_POOLSIZE" in out
    monkeypatch.setenv("EMMPOOL_INITIAL_POOL_SIZE", "2GiB")
    monkeypatch.setenv("EMMPOOL_MAXIMUM_POOL_SIZE", "1GiB")
    status, out = report()
    assert status == 1 and "  error: initial_pool_size (2147483648) exceeds" in out


def test_info_says_a_numba_release_out_of_the_tested_range(fresh_config, monkeypatch):
    versions = {"numba-cuda": "0.31.0", "numba-cuda-mlir": "0.5.2"}
    real = _info._version
    monkeypatch.setattr(_info, "_version", lambda dists: versions.get(dists[0]) or real(dists))
    status, out = report()
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert lines["numba-cuda"].endswith("0.31.0  (untested: emmpool is tested with 0.30.x)")
    assert lines["numba-cuda-mlir"].endswith("0.5.2  (too old: emmpool needs 0.6.0 or later)")
    assert status == 0


def test_info_shows_the_page_the_pool_will_use(fresh_config, monkeypatch):
    monkeypatch.setattr(_info, "_granularity", lambda: 2 << 20)  # the driver's pages: 2 MiB
    monkeypatch.setenv("EMMPOOL_GROWABLE_PAGE_SIZE", "3MiB")
    status, out = report()
    assert status == 0
    assert re.search(r"^  growable_page_size +4 MiB \(3 MiB rounded to 2 MiB pages\) +"
                     r"from EMMPOOL_GROWABLE_PAGE_SIZE='3MiB'$", out, re.M), out
    monkeypatch.setenv("EMMPOOL_GROWABLE_PAGE_SIZE", "0")
    assert re.search(r"^  growable_page_size +2 MiB \(the driver's granularity\) ", report()[1],
                     re.M)


def test_replay_says_each_reason_a_backend_was_skipped_once(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(ONE_ALLOCATION)
    p = run_cli("replay", str(path), "--backends", "emmpool", "emmpool-fixed", "emmpool-host",
                env=environment(CUDA_VISIBLE_DEVICES=""))  # no device, driver or not
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("| emmpool")]
    assert rows[0] == rows[1].replace("emmpool-fixed", "emmpool") == "| emmpool | skipped (1) | | | |"
    notes = [line for line in p.stdout.splitlines() if line.startswith("(1) ")]
    assert len(notes) == 1 and "CUDA" in notes[0], p.stdout
    assert p.stdout.count(notes[0][4:]) == 1

"""The commands .ci/gpu.py runs, each in a process group of its own with its output in a log,
stopped at its timeout or with the runner; and what the runner reads back from the logs."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

TAG = "[.ci/gpu]"  # prefixes the runner's lines in suite logs: compare_numba.py reads rc= there

_RUNNING: set = set()  # the Jobs not finished yet


def stop_all(signum=None, frame=None) -> None:
    """Kill every running Job's process group: each runs in a session of its own, which would
    outlive the runner stopped from outside (a time limit, Ctrl-C) and hold the GPU."""
    for job in list(_RUNNING):
        try:
            os.killpg(job.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if signum is not None:
        sys.exit(128 + signum)


class Job:
    """A command in a process group of its own, its output into a log, stopped at its timeout
    (SIGTERM, then SIGKILL after `grace` seconds): exit status 124, or 137 when it had to be
    killed, as timeout(1) says."""

    def __init__(self, argv: list[str], *, log: Path, timeout: float, cwd: Path, env: dict,
                 name: str | None = None, append: bool = False, grace: float = 10):
        self.argv, self.log_path, self.timeout, self.cwd, self.env = argv, log, timeout, cwd, env
        self.name, self.append, self.grace = name, append, grace
        self.rc: int | None = None
        self.timed_out = False

    def start(self) -> "Job":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "ab" if self.append else "wb")
        if self.name:
            self._say(f"{self.name}: {describe_env(self.env)}timeout {int(self.timeout)}s: "
                      f"{shlex.join(self.argv)}")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        _RUNNING.add(self)
        return self

    def _say(self, text: str) -> None:
        self.log.write(f"{TAG} {text}\n".encode())
        self.log.flush()

    def poll(self) -> int | None:
        if self.rc is None:
            rc = self.proc.poll()
            if rc is None and time.monotonic() - self.t0 > self.timeout:
                rc = self._stop()
            if rc is not None:
                self._finish(rc)
        return self.rc

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.2)
        return self.rc

    def _stop(self) -> int:
        self.timed_out = True
        for sig, patience in ((signal.SIGTERM, self.grace), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=patience)
                return 124 if sig == signal.SIGTERM else 137
            except subprocess.TimeoutExpired:
                continue
        return 137

    def _finish(self, rc: int) -> None:
        _RUNNING.discard(self)
        self.rc = rc
        self.seconds = round(time.monotonic() - self.t0)
        if self.name:
            self.log.write(b"\n")  # a test cut off leaves its line open
            self._say(f"{self.name}: rc={rc} after {self.seconds}s"
                      + (" (timeout)" if self.timed_out else ""))
        self.log.close()


def wait_all(jobs: list[Job]) -> None:
    while any(job.poll() is None for job in jobs):
        time.sleep(0.5)


def describe_env(env: dict) -> str:
    shown = [f"{k}={env[k]}" for k in ("NUMBA_CUDA_MEMORY_MANAGER", "EMMPOOL_MODE",
                                       "EMMPOOL_PINNED", "EMMPOOL_SEGMENTS") if env.get(k)]
    return " ".join(shown) + " " if shown else "default manager "


def with_env(env: dict, changes: dict[str, str | None]) -> dict:
    """`env` with `changes` made: a None takes its variable out."""
    return {k: v for k, v in {**env, **changes}.items() if v is not None}


def extract(archive: Path, dest: Path) -> None:
    """Unpack a tarball (any compression tarfile reads) into dest, members kept inside it."""
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "tar_filter"):  # Python >= 3.10.12 / 3.11.4
            tar.extractall(dest, filter="tar")
        else:  # pragma: no cover - older patch releases
            tar.extractall(dest)


def tail(path: Path, n: int, width: int = 240) -> list[str]:
    if not path.is_file():
        return []
    return [line[:width] for line in path.read_text(errors="replace").splitlines()[-n:]]


def first_match(path: Path, pattern: str, last: bool = False) -> str:
    if not path.is_file():
        return ""
    found = [line for line in path.read_text(errors="replace").splitlines()
             if re.search(pattern, line)]
    return (found[-1] if last else found[0]) if found else ""


def pytest_line(log: Path) -> str:
    line = first_match(log, r"^=+ .*(passed|failed|error|skipped|no tests ran).* =+$", last=True)
    return line.strip("= ")


def suite_note(log: Path) -> str:
    """"Ran N tests in S; OK|FAILED (...)" of a numba.runtests log, or how far it got."""
    ran = first_match(log, r"^Ran \d+ tests? in", last=True)
    if not ran:
        text = log.read_text(errors="replace") if log.is_file() else ""
        return f"INCOMPLETE: {len(re.findall(TEST_LINE, text))} test lines"
    return f"{ran}; {first_match(log, FINAL_LINE, last=True)}"


TEST_LINE = r" \.\.\. "  # numba.runtests -v: "test_x (mod.Class.test_x) ... ok"
FINAL_LINE = r"^(OK|FAILED)( \(|$)"

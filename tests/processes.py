"""Fresh interpreters for the scenario tests, which say where one hung.

A scenario that hangs (a deadlock, a wait on the GPU that never ends) would otherwise fail as a
bare TimeoutExpired, or stop the whole run at its outer timeout with no word of where. Here the
child runs with faulthandler on; past the timeout it gets SIGABRT, so it prints every thread's
Python stack before it dies, and that comes back as the result's stderr with returncode
HUNG (the callers' checks of the exit code and output then fail and show it); hung() tells such
a stop from a child's own abort.

EMMCI_TEST_HANG_AFTER=<seconds> caps every such timeout: to find a hang fast on a GPU host
whose time is short.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

HUNG = -signal.SIGABRT  # the returncode of a child stopped by run_python's timeout
_MARK = "[tests.processes] hung: stopped after"


def hung(p: subprocess.CompletedProcess) -> bool:
    """Whether run_python stopped `p` at its timeout (a child that aborted by itself, as
    std::terminate does, has returncode HUNG too)."""
    return p.stderr.rstrip("\n").rsplit("\n", 1)[-1].startswith(_MARK)  # its last line


def run_python(args, *, timeout: float, env=None, cwd=None) -> subprocess.CompletedProcess:
    """subprocess.run([python, *args], capture_output=True, text=True) with faulthandler on,
    whose child, past `timeout` seconds, dumps its threads' stacks and is stopped (returncode
    HUNG, or -SIGKILL if it did not die of that; a line saying so ends its stderr)."""
    timeout = min(timeout, float(os.environ.get("EMMCI_TEST_HANG_AFTER", timeout)))
    argv = [sys.executable, "-X", "faulthandler", *args]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=cwd) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack to stderr
            try:
                out, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # stuck even there (in the kernel, say)
                p.kill()
                out, err = p.communicate()
            err += f"\n{_MARK} {timeout:g} s\n"
        return subprocess.CompletedProcess(argv, p.returncode, out, err)

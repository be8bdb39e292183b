"""What the benchmarks share around their measurements: the deadline a run keeps to, the
versions it reports, child processes and their results, and the files it writes."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT = "RESULT "  # a child's result line: RESULT {json}; anything else it prints is its own


class Deadline:
    """When a run must have written its results: `limit` seconds from `now`, or
    EMMCI_BENCH_DEADLINE (.ci/gpu.py sets it from the step's timeout), whichever comes first;
    `at` is None where neither is set. A run cut off by a timeout keeps nothing; one that starts
    no work past its deadline keeps what it finished."""

    def __init__(self, limit: float | None = None, now: float | None = None):
        now = time.time() if now is None else now
        env = os.environ.get("EMMCI_BENCH_DEADLINE")
        limits = ([now + limit] if limit is not None else []) + ([float(env)] if env else [])
        self.at = min(limits, default=None)

    def allows(self, seconds: float) -> bool:
        """Whether work of about `seconds` would end before the deadline."""
        return self.at is None or time.time() + seconds < self.at


def versions(names) -> dict[str, str]:
    """The installed version of each distribution in `names` that is installed here."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def gib(n: int | None) -> str:
    """Bytes as GiB in a table's cell ("-": not known)."""
    return "-" if n is None else f"{n / (1 << 30):.2f}"


def emit(result: dict) -> None:
    """A child's result, on one line of its stdout."""
    print(RESULT + json.dumps(result, default=str), flush=True)


def result_of(stdout: str) -> dict | None:
    """The last result line of a child's stdout, or None where it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    return json.loads(lines[-1][len(RESULT):]) if lines else None


def run_code(code: str, *args, env: dict | None = None, timeout: float = 600) -> dict:
    """`python -c CODE ARGS...`: the JSON its stdout's last line holds; RuntimeError with the
    end of its stderr where it fails."""
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                       text=True, env=env, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"round failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def write_results(out: Path, stem: str, doc: dict, md: str, indent: int = 1) -> None:
    """OUT/<stem>.json and OUT/<stem>.md, the names .ci/gpu-results keeps them by, and the table
    printed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=indent, default=str) + "\n")
    (out / f"{stem}.md").write_text(md)
    print(md, end="" if md.endswith("\n") else "\n", flush=True)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_script(script, job: dict, timeout: float, log: Path, env: dict | None = None,
               on_start=None) -> tuple[dict | None, int | None]:
    """`python SCRIPT --child JOBFILE`, JOBFILE holding {"job": job, "result": the file the
    child writes its result to}, its output into `log`. It runs in a process group of its own,
    killed with the processes it started `timeout` seconds after it starts, or when this
    process is stopped. Returns (its result, or None where it wrote none; its exit status,
    negative for a signal, None where it was killed at its time limit)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"job": job, "result": str(result)}))
        with open(log, "w") as out:
            child = subprocess.Popen([sys.executable, str(script), "--child", str(spec)],
                                     stdout=out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
            try:
                if on_start is not None:
                    on_start(child.pid)
                code = child.wait(timeout)
            except BaseException as e:
                kill_group(child.pid)
                child.wait()
                if not isinstance(e, subprocess.TimeoutExpired):
                    raise
                code = None
        try:
            return json.loads(result.read_text()), code
        except (OSError, ValueError):
            return None, code

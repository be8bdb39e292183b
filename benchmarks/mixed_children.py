"""How mixed_programs.py starts its children, both sides: each child either a fresh interpreter
(``python mixed_children.py --child JOBFILE``), or forked from a zygote (``python
mixed_children.py --zygote``) that imported the libraries once and never initialized CUDA, so
that every child starts with no CUDA state at all, as a fresh interpreter does, without paying
the imports again. The parent and the zygote speak JSON lines: the zygote says it is ready (or
why forking would be unsafe), then for each job line it forks a child and says its pid and, once
it has exited, its status. Either way the child runs mixed_workloads.run_job and writes its
result to the file the job names.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import harness
import mixed_workloads as work

# ---------------------------------------------------------------------------------------------
# In the parent


class ForkUnsafe(RuntimeError):
    """The zygote found forking unsafe after its imports (CUDA initialized, threads)."""


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def job_error(job: dict, why: str, log: Path | None = None) -> dict:
    """A job's result where the child gave none: why, and its log's last lines."""
    out = {**{k: job[k] for k in ("program", "setup", "kind", "scale")}, "outcome": "error",
           "error": why}
    if log is not None:
        out["log_tail"] = _tail(log)
    return out


def result_or_error(result: dict | None, log: Path, code: int | None, job: dict) -> dict:
    """The child's result; or, where it wrote none, an error saying how it ended (`code`: its
    exit code, negative for a signal, as subprocess reports it; None: killed at its time
    limit)."""
    if result is not None:
        if result.get("outcome") != "ok":
            result["log_tail"] = _tail(log)
        return result
    if code is None:
        why = "killed at its time limit"
    elif code < 0:
        why = f"killed by signal {-code} ({signal.Signals(-code).name})"
    else:
        why = f"exited ({code}) without a result"
    return job_error(job, why, log)


class ExecLauncher:
    """Each child a fresh interpreter: ``python mixed_children.py --child JOBFILE``."""

    mode = "exec"

    def __init__(self, device_uuid: str, workdir: Path):
        self.uuid, self.workdir = device_uuid, workdir
        self.count = 0

    def run(self, job: dict, timeout: float, on_start=None) -> dict:
        self.count += 1
        log = self.workdir / f"exec-{self.uuid[-6:]}-{self.count}.log"
        env = dict(os.environ)
        apply_environment({**work.setup_environment(job["setup"]),
                           **device_environment(self.uuid)}, env)
        result, code = harness.run_script(__file__, job, timeout, log, env=env,
                                          on_start=on_start)
        return result_or_error(result, log, code, job)

    def close(self) -> None:
        pass


class ForkLauncher:
    """Children forked from a zygote (``mixed_children.py --zygote``) that imported the
    libraries once and never initialized CUDA."""

    mode = "fork"

    def __init__(self, device_uuid: str, workdir: Path, ready_timeout: float = 900.0):
        self.uuid, self.workdir = device_uuid, workdir
        self.count = 0
        self.current = None   # the child running now
        log = workdir / f"zygote-{device_uuid[-6:]}.log"
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--zygote"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
            start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        message = self._next(ready_timeout)
        if message is None or "ready" not in message:
            self.close()
            raise ForkUnsafe(f"the zygote did not start: {_tail(log, 5)}")
        self.info = message["ready"]
        if self.info.get("fork_unsafe"):
            self.close()
            raise ForkUnsafe(self.info["fork_unsafe"])

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                continue   # a library's own output
        self.lines.put(None)

    def _next(self, timeout: float):
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return {"timeout": True}

    def run(self, job: dict, timeout: float, on_start=None) -> dict:
        self.count += 1
        base = self.workdir / f"fork-{self.uuid[-6:]}-{self.count}"
        result, log = base.with_suffix(".result.json"), base.with_suffix(".log")
        env = {**work.setup_environment(job["setup"]), **device_environment(self.uuid)}
        self.proc.stdin.write(json.dumps({"job": job, "result": str(result), "log": str(log),
                                          "env": env}) + "\n")
        self.proc.stdin.flush()
        started = self._next(60)
        if not started or "started" not in started:
            return job_error(job, f"the zygote did not fork: {started}")
        pid = self.current = started["started"]
        if on_start:
            on_start(pid)
        exited = self._next(timeout)
        timed_out = bool(exited and exited.get("timeout"))
        if timed_out:
            harness.kill_group(pid)
            exited = self._next(60)
        self.current = None
        if exited is None:
            return job_error(job, "the zygote died", log)
        status = exited.get("status")
        code = os.waitstatus_to_exitcode(status) if status is not None else None
        try:
            written = json.loads(result.read_text())
        except (OSError, ValueError):
            written = None
        return result_or_error(written, log, None if timed_out else code, job)

    def close(self) -> None:
        """End the zygote, and a child still running (the run was stopped)."""
        if self.current is not None:
            harness.kill_group(self.current)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(10)
        self.proc.stdout.close()
        self._log.close()


def device_environment(uuid: str) -> dict:
    """The child sees the GPU it is given as device 0."""
    return {"CUDA_VISIBLE_DEVICES": uuid, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def make_launcher(mode: str, uuid: str, workdir: Path, notes: list):
    if mode == "fork":
        try:
            return ForkLauncher(uuid, workdir)
        except ForkUnsafe as e:
            notes.append(f"children started as fresh interpreters: forking was unsafe ({e})")
    return ExecLauncher(uuid, workdir)


# ---------------------------------------------------------------------------------------------
# In the child


def apply_environment(changes: dict, env=os.environ) -> None:
    """Set each variable of `changes` in `env`; unset those it maps to None."""
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value


def child_main(job_file: str) -> int:
    """``--child JOBFILE``: run the job in this fresh interpreter (its environment is set by
    the parent) and write its result where the job file says."""
    spec = json.loads(open(job_file).read())
    result = work.run_job(spec["job"])
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    return 0


PRELOAD = ("numpy", "cupy", "torch", "torch.utils.cpp_extension", "numba.cuda", "rmm",
           "rmm.mr", "rmm.allocators.cupy", "rmm.allocators.numba", "cuda.bindings.driver",
           "emmpool", "emmpool.plugin", "emmpool.hooks", "emmpool._torch")


def _cuda_initialized() -> bool:
    """Whether CUDA's driver was initialized in this process (a fork would then be unsafe).
    Every driver call before cuInit answers CUDA_ERROR_NOT_INITIALIZED."""
    try:
        from cuda.bindings import driver as cu

        err, _ = cu.cuDeviceGetCount()
    except Exception:  # noqa: BLE001 - no driver here: nothing was initialized
        return False
    return err != cu.CUresult.CUDA_ERROR_NOT_INITIALIZED


def _threads() -> list:
    """The names of this process's threads (Linux), the main one first."""
    try:
        tasks = sorted(os.listdir("/proc/self/task"), key=lambda t: t != str(os.getpid()))
    except OSError:
        return ["main"]
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            names.append("?")
    return names


def preload() -> dict:
    """Import what the children use and say whether forking is safe: no CUDA initialized, one
    thread. emmpool's PyTorch extension is not loaded here: each child loads it (from PyTorch's
    build cache, once a warm-up child built it), as a program does, and a module loaded twice in
    one process image would not be."""
    import importlib

    t0 = time.perf_counter()
    loaded, missing = [], {}
    for name in PRELOAD:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as e:  # noqa: BLE001 - a library missing here: its setups say so
            missing[name] = f"{type(e).__name__}: {e}"[:200]
    info = {"import_s": time.perf_counter() - t0, "loaded": loaded, "missing": missing,
            "threads": _threads(),
            "cuda_initialized": _cuda_initialized()}
    unsafe = []
    if info["cuda_initialized"]:
        unsafe.append("CUDA was initialized by an import")
    if len(info["threads"]) > 1:
        unsafe.append(f"threads besides the main one after the imports: "
                      f"{', '.join(info['threads'][1:])}")
    info["fork_unsafe"] = "; ".join(unsafe) or None
    return info


def zygote_main() -> int:
    """``--zygote``: preload, say so on stdout, then for each job line on stdin fork a child
    (its own process group, its output to the job's log) and report its pid and exit status.

    NumPy's OpenBLAS starts its threads when it loads, and a fork copies none of them: the
    zygote asks it for one (OPENBLAS_NUM_THREADS=1, before NumPy loads), so that it forks with
    no thread but its own. The programs do no BLAS work on the host."""
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    info = preload()
    gc.collect()
    gc.freeze()   # the imports' objects stay out of the children's collections (no copy-on-write)
    print(json.dumps({"ready": info}), flush=True)
    if info["fork_unsafe"]:
        return 0
    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setpgid(0, 0)
                fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                apply_environment(spec["env"])
                result = work.run_job(spec["job"])
                with open(spec["result"], "w") as f:
                    json.dump(result, f)
                code = 0
            except BaseException:  # noqa: BLE001 - the parent reads the log
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"started": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exited": pid, "status": status}), flush=True)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", metavar="JOBFILE", help="run this job here, a fresh interpreter")
    ap.add_argument("--zygote", action="store_true", help="fork a child per job line on stdin")
    args = ap.parse_args()
    if args.child:
        sys.exit(child_main(args.child))
    if args.zygote:
        sys.exit(zygote_main())
    ap.error("--child JOBFILE or --zygote")

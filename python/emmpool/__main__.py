"""python -m emmpool {info, selftest, bench, replay}

  info      what is in force and why: configuration (and where each value came from), the
            driver, devices, library versions, who allocates from emmpool
  selftest  a quick check on the GPU: Numba through the plugin, data round trips, a kernel,
            statistics back to zero, trim
  bench     allocation+free through Numba: emmpool against Numba's default manager, with a
            progress bar; writes a markdown table, JSON and (with matplotlib) a PNG plot
  replay    replay a CSV trace (EMMPOOL_TRACE / emmpool.trace) against emmpool and, where
            present, CuPy's and PyTorch's allocators: time and peak reserved / peak live

A usage error, or input that cannot be used (a trace that is missing or not a trace), is said
in one line on stderr, with exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

from . import __version__, _args, _core, _info, replay, trace
from ._args import format_bytes

MiB = 1 << 20


# ---- info ------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    return _info.print_report()


# ---- selftest --------------------------------------------------------------------------------
_SELFTEST = r"""
import gc, numpy as np
from numba import cuda
import emmpool
checks = 0
def ok(what):
    global checks
    checks += 1
    print(f"  ok  {what}", flush=True)
rng = np.random.default_rng(0)
for n in (1, 1000, 1 << 20, 48 << 20):
    h = rng.integers(0, 255, n, dtype=np.uint8)
    assert (cuda.to_device(h).copy_to_host() == h).all()
ok("round trips of 1 B to 48 MiB")
@cuda.jit
def scale(a, k):
    i = cuda.grid(1)
    if i < a.size:
        a[i] *= k
a = cuda.to_device(np.arange(100_000, dtype=np.float64))
scale[(a.size + 255) // 256, 256](a, 3.0)
assert (a.copy_to_host() == 3.0 * np.arange(100_000)).all()
ok("a kernel on pooled memory")
ctx = cuda.current_context()
assert type(ctx.memory_manager).__name__ == "EmmPoolManager"
ok("Numba uses emmpool's plugin")
del a; gc.collect(); cuda.synchronize()
s = emmpool.stats(0)
assert s["bytes_in_use"] == 0 and s["allocations"] == s["frees"], s
ok(f"statistics back to zero ({s['allocations']} allocations)")
released = emmpool.trim()
# Every byte: a growable segment keeps its address reservation, which holds no memory.
assert emmpool.stats(0)["bytes_reserved"] == 0, emmpool.stats(0)
ok(f"trim returned {released} bytes to the driver")
print(f"PASS ({checks} checks)")
"""


def cmd_selftest(args) -> int:
    try:
        if _core.device_count() < 1:
            print("selftest: FAIL: no CUDA device")
            return 1
    except _core.CudaError as e:
        print(f"selftest: FAIL: {e}")
        return 1
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="emmpool.plugin")
    print("selftest (Numba through emmpool, in a fresh process):", flush=True)
    p = subprocess.run([sys.executable, "-c", _SELFTEST], env=env, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    print(p.stdout, end="")
    if p.returncode != 0:
        print("selftest: FAIL")
        return 1
    return 0


# ---- bench -----------------------------------------------------------------------------------
_SIZES = [256, 4096, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
_MANAGERS = {"numba-default": {}, "emmpool": {"EMMPOOL_MODE": "pool"}}

_BENCH_CHILD = r"""
import json, statistics, sys, time
import numpy as np
from numba import cuda
if sys.argv[1] != "numba-default":
    import emmpool
    emmpool.use_for_numba()
sizes, budget = json.loads(sys.argv[2]), float(sys.argv[3])
out = {}
for i, n in enumerate(sizes):
    for _ in range(20):
        a = cuda.device_array(n, np.uint8); del a
    cuda.synchronize()
    t = time.perf_counter(); k = 0
    while time.perf_counter() - t < budget / 10 or k < 5:
        a = cuda.device_array(n, np.uint8); del a; k += 1
    per_block = max(5, k)
    blocks = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(per_block):
            a = cuda.device_array(n, np.uint8); del a
        cuda.synchronize()
        blocks.append((time.perf_counter() - t) / per_block * 1e6)
    out[str(n)] = statistics.median(blocks)
    print(f"PROGRESS {i + 1}", flush=True)
print("RESULT " + json.dumps(out), flush=True)
"""


def _bar(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / total)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:24s}")
    sys.stderr.flush()


def cmd_bench(args) -> int:
    try:
        if _core.device_count() < 1:
            raise _core.CudaError("no CUDA device")
    except _core.CudaError as e:
        print(f"bench: needs a GPU: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    total, done, results = len(_MANAGERS) * len(_SIZES), 0, {}
    for name, extra in _MANAGERS.items():
        env = dict(os.environ, **extra)
        env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
        proc = subprocess.Popen(
            [sys.executable, "-c", _BENCH_CHILD, name, json.dumps(_SIZES), str(args.budget)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        base = done
        for line in proc.stdout:
            if line.startswith("PROGRESS "):
                done = base + int(line.split()[1])
                _bar(done, total, name)
            elif line.startswith("RESULT "):
                results[name] = json.loads(line[7:])
        proc.wait()
        if name not in results:
            sys.stderr.write(f"\n{name} failed:\n{proc.stderr.read()[-2000:]}\n")
            return 1
    sys.stderr.write("\n")
    gpu = "GPU"
    try:
        from numba import cuda

        d = cuda.list_devices()[0]
        gpu = d.name.decode() if isinstance(d.name, bytes) else d.name
    except Exception:
        pass
    rows = ["| size | Numba default (µs) | emmpool (µs) | speed-up |", "|---:|---:|---:|---:|"]
    for n in _SIZES:
        a, b = results["numba-default"][str(n)], results["emmpool"][str(n)]
        rows.append(f"| {format_bytes(n)} | {a:.1f} | {b:.1f} | {a / b:.1f}× |")
    table = (f"Allocation + free via `cuda.device_array(n, uint8)` + `del` on {gpu}, "
             f"median of 5 timed blocks\n\n" + "\n".join(rows) + "\n")
    (out / "emmpool-bench.md").write_text(table)
    (out / "emmpool-bench.json").write_text(json.dumps(
        {"gpu": gpu, "sizes": _SIZES, "us_per_op": results,
         "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    print(table)
    try:
        _plot(results, gpu, out / "emmpool-bench.png")
        print(f"wrote {out / 'emmpool-bench.png'}")
    except ImportError:
        print("(pip install matplotlib for the plot)")
    return 0


def _plot(results: dict, gpu: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("numba-default", "o-"), ("emmpool", "s-")):
        ax.plot(_SIZES, [results[name][str(n)] for n in _SIZES], style, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(_SIZES, [format_bytes(n) for n in _SIZES], rotation=30)
    ax.set_xlabel("allocation size")
    ax.set_ylabel("µs per allocation + free")
    ax.set_title(f"Numba device_array + del on {gpu}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- replay ----------------------------------------------------------------------------------
def cmd_replay(args) -> int:
    records = trace.read_csv(args.trace)
    ops = replay.from_records(records, device=args.device)
    if not any(op[0] == "alloc" for op in ops):
        devices = sorted({r.device for r in records if r.op == "alloc"})
        where = (f"the trace allocates on device {', '.join(map(str, devices))}: choose one "
                 f"with --device" if devices else "the trace holds no allocation")
        raise ValueError(f"{args.trace}: nothing to replay on device {args.device}: {where}")
    print(f"{args.trace}: {len(records)} records, {len(ops)} operations on device {args.device}")
    print("| backend | peak live (MiB) | peak reserved (MiB) | reserved / live | replay s |")
    print("|---|---:|---:|---:|---:|")
    failed = 0
    reasons: list[str] = []  # why backends were skipped, each said once under the table
    for name in args.backends:
        try:
            r = replay.run(ops, name)
        except replay.Skip as e:
            if str(e) not in reasons:
                reasons.append(str(e))
            print(f"| {name} | skipped ({reasons.index(str(e)) + 1}) | | | |")
            continue
        except (MemoryError, _core.PoolError, _core.CudaError) as e:
            # One backend that cannot replay the trace (out of memory, say) leaves the others.
            print(f"| {name} | failed: {_one_line(e)} | | | |")
            failed += 1
            continue
        print(f"| {name} | {r['peak_live'] / MiB:.1f} | {r['peak_reserved'] / MiB:.1f} | "
              f"{r['ratio']:.3f} | {r['seconds']:.3f} |")
    if reasons:
        print()
    for number, reason in enumerate(reasons, 1):
        print(f"({number}) {reason}")
    return 1 if failed else 0


# ---- the command line ------------------------------------------------------------------------
PROG = "python -m emmpool"


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, not {text!r}")
    return value


def _device_ordinal(text: str) -> int:
    try:
        return _args.device(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a device ordinal (0, 1, ...), not {text!r}") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n", 1)[1],
                                 usage=f"{PROG} [-h] [-V] {{info,selftest,bench,replay}} ...",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-V", "--version", action="version", version=f"emmpool {__version__}")
    # The description lists the commands, each once: argparse's own list of them is left out.
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND",
                            help=argparse.SUPPRESS)
    sub.add_parser("info")
    sub.add_parser("selftest")
    b = sub.add_parser("bench")
    b.add_argument("--out", default=".", help="folder for emmpool-bench.{md,json,png}")
    b.add_argument("--budget", type=_positive_seconds, default=1.0,
                   help="seconds per size and manager")
    r = sub.add_parser("replay",
                       usage=f"{PROG} replay [-h] [--device DEVICE] "
                             f"[--backends BACKEND [BACKEND ...]] TRACE")
    # nargs="?": --backends takes one or more names, and would take the trace's path after
    # them too; _replay_arguments gives it back.
    r.add_argument("trace", nargs="?", metavar="TRACE",
                   help="CSV written by EMMPOOL_TRACE or emmpool.trace.write_csv")
    r.add_argument("--device", type=_device_ordinal, default=0)
    r.add_argument("--backends", nargs="+", metavar="BACKEND",
                   help=f"one or more of {', '.join(sorted(replay.BACKENDS))} (also "
                        f"comma-separated; default: all)")
    r.set_defaults(check=functools.partial(_replay_arguments, usage=r))
    return ap


def _replay_arguments(args, usage: argparse.ArgumentParser) -> None:
    """The trace and the backends of ``replay``, however they were ordered: ``--backends A B
    FILE`` hands FILE to --backends, which is not a backend; usage errors as argparse says
    them."""
    names = [n for value in (args.backends or []) for n in value.split(",") if n]
    if args.trace is None and names and names[-1] not in replay.BACKENDS:
        args.trace = names.pop()
    if args.trace is None:
        usage.error("the following arguments are required: TRACE")
    unknown = [n for n in names if n not in replay.BACKENDS]
    if unknown:
        usage.error(f"argument --backends: invalid choice: {unknown[0]!r} (choose from "
                    f"{', '.join(sorted(replay.BACKENDS))})")
    if args.backends is not None and not names:
        usage.error("argument --backends: expected at least one backend")
    args.backends = names or list(replay.BACKENDS)


def _one_line(e: BaseException) -> str:
    """What went wrong, in one line: a file error as 'path: reason', emmpool's and Python's
    value errors as their message, anything else with its type's name."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    elif isinstance(e, (ValueError, OSError, MemoryError, _core.PoolError, _core.CudaError,
                        Warning)):  # Warning: raised where warnings are errors (-W error)
        text = str(e)
    else:
        text = f"{type(e).__name__}: {e}"
    return " ".join(text.split()) or type(e).__name__


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    # One line, as the errors: the source line Python would add means nothing to a CLI user.
    print(f"{PROG}: warning: {' '.join(str(message).split())}",
          file=sys.stderr if file is None else file)


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)  # a usage error: argparse's message, exit status 2
    if hasattr(args, "check"):
        args.check(args)  # what argparse cannot check alone: also a usage error
    command = {"info": cmd_info, "selftest": cmd_selftest, "bench": cmd_bench,
               "replay": cmd_replay}[args.command]
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return command(args)
        except KeyboardInterrupt:
            print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:
            # The reader went away (| head): nothing to say, and nowhere to say it. Python's
            # flush of stdout at exit would fail again, so stdout goes nowhere from here.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        except Exception as e:
            # Input that cannot be used (a missing or malformed file, a bad EMMPOOL_* value), or
            # any other failure: one line, as argparse says a usage error, not a traceback.
            print(f"{PROG} {args.command}: error: {_one_line(e)}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())

"""What runs in a child of mixed_programs.py: the three programs, the allocator setups, and one
job (a timing run, a capacity probe or a warm-up) in a process of its own.

Importing this module imports no GPU library and touches no GPU (the parent imports it for the
programs' names and each setup's environment); each library is imported where a job needs it.
A job runs in a fresh process (mixed_children.py starts it), in this order: the setup's
environment variables, the CUDA context (the device's primary context, which every library then
shares), the filler allocation of a capacity probe, the setup installed in every library the
program uses, then the program. No library allocates before its setup is in place.
"""

from __future__ import annotations

import os
import time
import traceback

import pool_counters

SEED = 7
# Batch sizes over one cycle of steps, as fractions of the scale's full batch: the sizes shift
# both ways (a smaller batch after the largest, then a larger one again), as variable-size
# batches do, and a caching pool splits and grows its blocks with them.
FACTORS = (0.6, 1.0, 0.35, 0.8)
STEPS_PER_CYCLE = len(FACTORS)

SETUPS = ("separate", "separate-expandable", "rmm-pool", "rmm-async", "torch-under-cupy",
          "emmpool", "emmpool-growable")
BRIDGES = ("rmm-pool", "rmm-async", "torch-under-cupy")
SEPARATE = ("separate", "separate-expandable")


class Program:
    """What the parent needs to know of a program, without running it."""

    def __init__(self, name: str, letter: str, libraries: tuple, title: str, unit: str,
                 timing_scale: int, quick_scale: int, bytes_per_scale: int, factory: str):
        self.name = name
        self.letter = letter
        self.libraries = libraries
        self.title = title          # one line for the table's heading
        self.unit = unit            # what one unit of scale is
        self.timing_scale = timing_scale
        self.quick_scale = quick_scale
        # A rough guess of a separate setup's device bytes per unit of scale: where a capacity
        # search starts when no timing run of the same run says better.
        self.bytes_per_scale = bytes_per_scale
        self.factory = factory      # the class below that runs it


MiB = 1 << 20
PROGRAMS = {
    p.name: p for p in (
        Program("cupy_torch", "a", ("cupy", "torch"),
                "CuPy (batched solve, FFT) then a PyTorch MLP's training step, alternating",
                "1,024 samples of a 64×64 matrix", 16, 1, 210 * MiB, "CupyTorch"),
        Program("numba_cupy_torch", "b", ("numba", "cupy", "torch"),
                "CuPy preprocessing and Numba kernels of variable-size batches feeding a "
                "PyTorch training step",
                "2,048 signals of 1,024 samples", 16, 1, 180 * MiB, "NumbaCupyTorch"),
        Program("rapids", "c", ("rmm", "cupy", "numba"),
                "RAPIDS-style: tables in rmm.DeviceBuffers, a Numba UDF over them, CuPy's "
                "sort, gather and group-by, buffers freed and allocated again",
                "2^20 rows", 16, 1, 190 * MiB, "Rapids"),
    )
}
LETTERS = {p.letter: p.name for p in PROGRAMS.values()}


def program_named(text: str) -> str:
    """A program's name from its name or letter; ValueError naming the choices."""
    name = LETTERS.get(text, text)
    if name not in PROGRAMS:
        choices = ", ".join(f"{p.letter} ({p.name})" for p in PROGRAMS.values())
        raise ValueError(f"unknown program {text!r}: one of {choices}")
    return name


def libraries_of(program: str, setup: str) -> tuple:
    """The libraries a (program, setup) child imports: the program's, and PyTorch for
    torch-under-cupy, whose CuPy allocates through PyTorch's pool."""
    libs = PROGRAMS[program].libraries
    if setup == "torch-under-cupy" and "torch" not in libs:
        libs = (*libs, "torch")
    return libs


IMPORT_NAMES = {"cupy": "cupy", "torch": "torch", "numba": "numba.cuda", "rmm": "rmm",
                "emmpool": "emmpool"}


def not_run_reason(program: str, setup: str, importable) -> str | None:
    """Why a (program, setup) pair is not run, or None. ``importable(module)`` says whether a
    module can be imported here (the parent asks importlib.util.find_spec)."""
    libs = PROGRAMS[program].libraries
    if setup == "separate-expandable" and "torch" not in libs:
        return "the program uses no PyTorch: the same as separate"
    needed = list(libraries_of(program, setup))
    if setup.startswith("rmm"):
        needed.append("rmm")
    if setup.startswith("emmpool"):
        needed.append("emmpool")
    for lib in dict.fromkeys(needed):
        if not importable(IMPORT_NAMES[lib]):
            return f"{IMPORT_NAMES[lib]} is not installed here"
    return None


def setup_environment(setup: str) -> dict:
    """Environment variables a setup sets (None: unset) before any library starts: PyTorch's
    allocator reads PYTORCH_CUDA_ALLOC_CONF when CUDA starts, emmpool its EMMPOOL_* when a hook
    is installed. emmpool's setups name their segments, since the default may change."""
    env: dict = {"PYTORCH_CUDA_ALLOC_CONF": None, "EMMPOOL_SEGMENTS": None}
    if setup == "separate-expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif setup == "emmpool":
        env["EMMPOOL_SEGMENTS"] = "fixed"
    elif setup == "emmpool-growable":
        env["EMMPOOL_SEGMENTS"] = "growable"
    return env


def batch(units: int, step: int) -> int:
    """The batch of a step: the scale's full batch times the step's factor."""
    return max(1, round(units * FACTORS[step % STEPS_PER_CYCLE]))


# ---------------------------------------------------------------------------------------------
# Out-of-memory, as each library says it.

OOM_WORDS = ("out of memory", "out_of_memory", "cuda_error_out_of_memory", "alloc_failed",
             "cudaerrormemoryallocation", "std::bad_alloc")


def classify_failure(exc: BaseException) -> str:
    """'oom' where the exception, or one it came from, is a library's out-of-memory error:
    a MemoryError (CuPy's OutOfMemoryError, RMM's and emmpool's), PyTorch's OutOfMemoryError,
    Numba's or cuda.core's CUDA error with CUDA_ERROR_OUT_OF_MEMORY (code 2), cuBLAS's, cuFFT's
    or cuSOLVER's ALLOC_FAILED, the runtime's cudaErrorMemoryAllocation; else 'error'. An error
    is never taken for a fit, nor for an out-of-memory."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MemoryError):
            return "oom"
        if type(exc).__name__ == "OutOfMemoryError":   # torch.OutOfMemoryError: a RuntimeError
            return "oom"
        code = getattr(exc, "code", None)
        if type(exc).__name__ in ("CudaAPIError", "CUDAError") and _code_is_oom(code):
            return "oom"
        text = str(exc).lower()
        if any(word in text for word in OOM_WORDS):
            return "oom"
        exc = exc.__cause__ or exc.__context__
    return "error"


def _code_is_oom(code) -> bool:
    try:
        return int(code) == 2    # CUDA_ERROR_OUT_OF_MEMORY
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# Where a program runs: the GPU (CuPy, PyTorch on CUDA, Numba, RMM). The tests of the programs'
# own logic give them the same interface over NumPy, PyTorch on the CPU and Numba's simulator.


class GpuEnv:
    def __init__(self, libs: tuple):
        import cupy

        self.xp = cupy
        self.libs = libs
        self.torch = self.cuda = self.rmm = None
        self.device = "cuda"
        if "torch" in libs:
            import torch

            self.torch = torch
        if "numba" in libs:
            from numba import cuda

            self.cuda = cuda
        if "rmm" in libs:
            import rmm

            self.rmm = rmm

    def sync(self) -> None:
        self.xp.cuda.runtime.deviceSynchronize()

    def buffer(self, nbytes: int):
        return self.rmm.DeviceBuffer(size=nbytes)

    def view(self, buf, dtype):
        """CuPy's view of an RMM buffer (its CUDA Array Interface: no copy)."""
        return self.xp.asarray(buf).view(dtype)

    def numba_view(self, buf, dtype):
        return self.cuda.as_cuda_array(buf).view(dtype)

    def from_numba(self, array):
        return self.xp.asarray(array)

    def cupy_pool_bytes(self) -> int:
        """What CuPy's own pool holds (0 where CuPy allocates through another allocator)."""
        return int(self.xp.get_default_memory_pool().total_bytes())

    def torch_max_reserved(self) -> int:
        return int(self.torch.cuda.max_memory_reserved())


def _mlp(torch, inputs: int, hidden: int, outputs: int):
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, outputs))


def _train_step(env, model, opt, features, labels) -> float:
    """One training step of `model` on CuPy (or NumPy) arrays, handed to PyTorch by DLPack."""
    torch = env.torch
    x = torch.from_dlpack(features)
    y = torch.from_dlpack(labels)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach().item()


# ---------------------------------------------------------------------------------------------
# The programs. Each makes its batches from one seeded generator, drawn from in the same order
# in every setup, so that every setup computes the same thing; a step's check value goes into
# the comparison.


class CupyTorch:
    """a. A CuPy phase makes large temporaries of shifting sizes: per sample a 64×64 matrix X,
    A = X Xᵀ/n + I, the batched solve A Y = X[:, :, :8] (cuBLAS's batched LU), the FFT of X
    (cuFFT); features from both (log band powers and the solution) go by DLPack to a PyTorch MLP
    (512 → 4096 → 4096 → 16, GELU) for a forward, backward and AdamW step. CuPy's temporaries
    are dead when PyTorch runs, and PyTorch's activations when CuPy runs."""

    N = 64
    CLASSES = 16

    def __init__(self, env, scale: int, seed: int = SEED):
        torch = env.torch
        self.env, self.seed = env, seed
        self.samples = round(1024 * scale)
        self.rng = env.xp.random.default_rng(seed)
        torch.manual_seed(seed)
        self.model = _mlp(torch, 512, 4096, self.CLASSES).to(env.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, i: int) -> float:
        xp, n = self.env.xp, self.N
        m = batch(self.samples, i)
        rng = self.rng
        x = rng.standard_normal((m, n, n), dtype=xp.float32)
        a = xp.matmul(x, x.transpose(0, 2, 1))
        a *= 1.0 / n
        a += xp.eye(n, dtype=xp.float32)
        y = xp.linalg.solve(a, x[:, :, :8])
        del a
        f = xp.fft.rfft2(x)
        del x
        bands = xp.log1p(xp.abs(f[:, :16, :16]).reshape(m, 256)).astype(xp.float32)
        del f
        features = xp.concatenate([bands, y.reshape(m, 8 * n)[:, :256].astype(xp.float32)],
                                  axis=1)
        labels = xp.argmax(y[:, :self.CLASSES, 0], axis=1).astype(xp.int64)
        del y, bands
        features -= features.mean(axis=0)
        features /= features.std(axis=0) + 1e-6
        return _train_step(self.env, self.model, self.opt, features, labels)


# Numba kernels: plain functions here, compiled at first use (cuda.jit(cache=True): later
# processes load them from Numba's cache), so that importing this module needs no Numba. Their
# global `cuda` is Numba's CUDA module, bound by kernel() before the first compilation.
cuda = None
WINDOW, STRIDE, SIGNAL = 16, 8, 1024
WINDOWS = (SIGNAL - WINDOW) // STRIDE + 1
BINS = 32


def _window_stats(z, out):
    """Per signal and window: mean, minimum and maximum."""
    row, w = cuda.grid(2)
    if row < out.shape[0] and w < out.shape[1]:
        start = w * STRIDE
        total = 0.0
        lo = z[row, start]
        hi = lo
        for k in range(WINDOW):
            v = z[row, start + k]
            total += v
            lo = min(lo, v)
            hi = max(hi, v)
        out[row, w, 0] = total / WINDOW
        out[row, w, 1] = lo
        out[row, w, 2] = hi


def _histogram(z, out):
    """Per signal, a histogram of its values over [-4, 4) (the ends clipped), one thread each:
    integer counts, the same in every run."""
    row = cuda.grid(1)
    if row < out.shape[0]:
        bins = out.shape[1]
        for b in range(bins):
            out[row, b] = 0
        for k in range(z.shape[1]):
            b = int((z[row, k] + 4.0) * (bins / 8.0))
            b = min(max(b, 0), bins - 1)
            out[row, b] += 1


def _udf(keys, v0, v1, parts, out, nparts):
    """A row-wise UDF (as cuDF's apply_rows) and the partition of each row for a shuffle."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = v0[i] * v1[i] if v0[i] > 0 else v1[i] - v0[i]
        parts[i] = (keys[i] * 2654435761) % nparts


_kernels: dict = {}


def kernel(env, function):
    global cuda
    key = (id(env.cuda), function.__name__)
    if key not in _kernels:
        cuda = env.cuda
        simulated = env.device == "cpu"
        _kernels[key] = env.cuda.jit(function) if simulated else env.cuda.jit(cache=True)(function)
    return _kernels[key]


class NumbaCupyTorch:
    """b. Variable-size batches of 1,024-sample signals: CuPy makes and normalizes them and
    takes their band powers (FFT); Numba kernels, launched on the CuPy arrays, write window
    statistics and histograms into arrays Numba allocates (cuda.device_array); the features
    (CuPy views of Numba's arrays, and the band powers) go by DLPack to a PyTorch MLP
    (477 → 2048 → 2048 → 10) for a training step."""

    CLASSES = 10
    BANDS = 64

    def __init__(self, env, scale: int, seed: int = SEED):
        torch = env.torch
        self.env, self.seed = env, seed
        self.samples = round(2048 * scale)
        self.rng = env.xp.random.default_rng(seed)
        torch.manual_seed(seed)
        features = WINDOWS * 3 + BINS + self.BANDS
        self.model = _mlp(torch, features, 2048, self.CLASSES).to(env.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.window_stats = kernel(env, _window_stats)
        self.histogram = kernel(env, _histogram)

    def step(self, i: int) -> float:
        import numpy as np

        env, xp, cuda = self.env, self.env.xp, self.env.cuda
        m = batch(self.samples, i)
        rng = self.rng
        raw = rng.standard_normal((m, SIGNAL), dtype=xp.float32)
        slope = rng.standard_normal((m, 1), dtype=xp.float32)
        raw += slope * xp.linspace(-1, 1, SIGNAL, dtype=xp.float32)
        z = (raw - raw.mean(axis=1, keepdims=True)) / raw.std(axis=1, keepdims=True)
        del raw, slope
        power = xp.abs(xp.fft.rfft(z, axis=1)) ** 2
        bands = power[:, 1:SIGNAL // 2 + 1].reshape(m, self.BANDS, -1).sum(axis=2)
        del power
        windows = cuda.device_array((m, WINDOWS, 3), np.float32)
        self.window_stats[((m + 7) // 8, (WINDOWS + 31) // 32), (8, 32)](z, windows)
        counts = cuda.device_array((m, BINS), np.int32)
        self.histogram[(m + 127) // 128, 128](z, counts)
        del z
        features = xp.concatenate(
            [env.from_numba(windows).reshape(m, WINDOWS * 3),
             env.from_numba(counts).astype(xp.float32) * (1.0 / SIGNAL),
             xp.log1p(bands).astype(xp.float32)], axis=1)
        del windows, counts
        labels = xp.argmax(bands[:, :self.CLASSES], axis=1).astype(xp.int64)
        del bands
        return _train_step(env, self.model, self.opt, features, labels)


class Rapids:
    """c. Tables arrive in rmm.DeviceBuffers (what cuDF's columns and distributed's receive
    buffers are): a key and three value columns, filled through CuPy views. A Numba UDF over the
    buffers writes a derived column into another RMM buffer and each row's partition into an
    array Numba allocates; CuPy sorts the rows by partition (a shuffle: CUB's radix sort, its
    temporaries from CuPy's allocator), gathers every column into new RMM buffers (the
    partitions to send) and sums the derived column by key. A table stays alive until the next
    step's is made (a pipeline), then its buffers are freed; the next is of another size."""

    GROUPS = 4096
    PARTS = 16

    def __init__(self, env, scale: int, seed: int = SEED):
        self.env, self.seed = env, seed
        self.rows = round((1 << 20) * scale)
        self.rng = env.xp.random.default_rng(seed)
        self.udf = kernel(env, _udf)
        self.sent = None   # the last step's partitions, freed after this step's are made

    def step(self, i: int) -> float:
        import numpy as np

        env, xp, cuda = self.env, self.env.xp, self.env.cuda
        n = batch(self.rows, i)
        rng = self.rng
        columns = [env.buffer(8 * n) for _ in range(4)]
        env.view(columns[0], xp.int64)[...] = rng.integers(0, self.GROUPS, n, dtype=xp.int64)
        for c in columns[1:]:
            env.view(c, xp.float64)[...] = rng.standard_normal(n, dtype=xp.float64)
        derived = env.buffer(8 * n)
        parts = cuda.device_array(n, np.int64)
        self.udf[(n + 255) // 256, 256](
            env.numba_view(columns[0], np.int64), env.numba_view(columns[1], np.float64),
            env.numba_view(columns[2], np.float64), parts, env.numba_view(derived, np.float64),
            self.PARTS)
        order = xp.argsort(env.from_numba(parts), kind="stable")
        del parts
        sent = []
        for buf, dtype in zip((*columns, derived), (xp.int64, *(xp.float64,) * 4), strict=True):
            out = env.buffer(8 * n)
            xp.take(env.view(buf, dtype), order, out=env.view(out, dtype))
            sent.append(out)
        del columns, derived, order
        keys, values = env.view(sent[0], xp.int64), env.view(sent[4], xp.float64)
        sums = xp.bincount(keys, weights=values, minlength=self.GROUPS)
        # sums come from float atomics (in any order): the check takes their total to 1e-9,
        # and reductions over the shuffled columns, which are exact and ordered
        check = (float(sums.sum()) + float(values[::97].sum())
                 + float(env.view(sent[1], xp.float64)[::89].sum()))
        self.sent = sent   # the previous step's partitions are freed here
        return check


# ---------------------------------------------------------------------------------------------
# Setups


def _torch_alloc(size: int, device: int) -> int:
    """CuPy's malloc over PyTorch's caching allocator, as pytorch-pfn-extras'
    use_torch_mempool_in_cupy does: on PyTorch's current stream, which must be CuPy's."""
    import cupy
    import torch

    stream = torch.cuda.current_stream().cuda_stream
    if stream != cupy.cuda.get_current_stream().ptr:
        raise RuntimeError("PyTorch's and CuPy's current streams differ")
    return torch.cuda.caching_allocator_alloc(size, device, stream)


def _torch_free(ptr: int, device: int) -> None:
    import torch

    torch.cuda.caching_allocator_delete(ptr)


def install(setup: str, env, rmm_initial_pool: int) -> dict:
    """Put `setup` in place for every library of `env`; return what serves each library, and
    the objects the allocator figures are read from afterwards."""
    libs = env.libs
    serves: dict = {}
    keep: dict = {}
    if setup in SEPARATE:
        serves = {lib: "its own" for lib in libs}
        if "torch" in libs and setup == "separate-expandable":
            serves["torch"] = "its own, expandable segments"
    elif setup in ("rmm-pool", "rmm-async"):
        import rmm.mr

        if setup == "rmm-pool":
            mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(),
                                           initial_pool_size=rmm_initial_pool)
            what = f"RMM PoolMemoryResource (initial {rmm_initial_pool >> 20} MiB, no maximum)"
        else:
            mr = rmm.mr.CudaAsyncMemoryResource()
            what = "RMM CudaAsyncMemoryResource"
        rmm.mr.set_current_device_resource(mr)
        keep["rmm_mr"] = mr
        serves["rmm"] = what
        if "cupy" in libs:
            from rmm.allocators.cupy import rmm_cupy_allocator

            env.xp.cuda.set_allocator(rmm_cupy_allocator)
            serves["cupy"] = "rmm_cupy_allocator"
        if "numba" in libs:
            from rmm.allocators.numba import RMMNumbaManager

            env.cuda.set_memory_manager(RMMNumbaManager)
            serves["numba"] = "RMMNumbaManager"
        if "torch" in libs:
            from rmm.allocators.torch import rmm_torch_allocator

            if rmm_torch_allocator is None:
                raise RuntimeError("rmm.allocators.torch made no allocator (PyTorch without "
                                   "CUDA, or without CUDAPluggableAllocator)")
            env.torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
            serves["torch"] = "rmm_torch_allocator"
    elif setup == "torch-under-cupy":
        cupy = env.xp
        allocator = cupy.cuda.memory.PythonFunctionAllocator(_torch_alloc, _torch_free)
        cupy.cuda.set_allocator(allocator.malloc)
        keep["allocator"] = allocator
        serves = {lib: "its own" for lib in libs}
        serves["cupy"] = "PyTorch's caching allocator (PythonFunctionAllocator)"
    elif setup in ("emmpool", "emmpool-growable"):
        import emmpool

        if "numba" in libs:
            emmpool.use_for_numba()
        if "cupy" in libs:
            emmpool.use_for_cupy()
        if "torch" in libs:
            serves["torch"] = f"emmpool ({emmpool.use_for_torch().how})"
        if "rmm" in libs:
            emmpool.use_for_rmm()
        for lib in libs:
            serves.setdefault(lib, "emmpool")
    else:
        raise ValueError(f"unknown setup {setup!r}")
    return {"serves": serves, "keep": keep}


def allocator_figures(setup: str, env, installed: dict, cupy_peak: int) -> dict:
    """What the allocators say they reserved at their peak, library by library, and what is not
    counted. Pools that never give memory back while the program runs (CuPy's MemoryPool,
    PyTorch's caching allocator, RMM's pool) have their peak at the end; CuPy's has no peak
    counter: its total_bytes() is read after every step (it shrinks only when an allocation
    fails and it frees its cache to retry)."""
    libs = env.libs
    counted: dict = {}
    uncounted: list = []
    if setup in SEPARATE or setup == "torch-under-cupy":
        if "cupy" in libs and setup != "torch-under-cupy":
            counted["cupy"] = cupy_peak
        if "torch" in libs:
            counted["torch"] = env.torch_max_reserved()
            if setup == "torch-under-cupy":
                counted["torch+cupy"] = counted.pop("torch")
        if "numba" in libs:
            uncounted.append("numba (its own manager: cuMemAlloc per array)")
        if "rmm" in libs:
            uncounted.append("rmm (its default resource: cudaMalloc per buffer)")
    elif setup == "rmm-pool":
        counted["rmm pool"] = int(installed["keep"]["rmm_mr"].pool_size())
    elif setup == "rmm-async":
        counted["rmm async"] = _async_reserved_high(env)
    else:
        import emmpool

        counted["emmpool"] = int(emmpool.stats(0)["peak_bytes_reserved"])
    return {"counted": counted, "uncounted": uncounted,
            "total": sum(v for v in counted.values() if v is not None)}


def _async_reserved_high(env) -> int | None:
    """The high-water mark of reserved memory of the CUDA memory pool behind RMM's async
    resource, found through a buffer it allocates (RMM does not expose the pool)."""
    import rmm
    from cuda.bindings import driver as cu

    probe = rmm.DeviceBuffer(size=256)
    err, pool = cu.cuPointerGetAttribute(
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, probe.ptr)
    if err != cu.CUresult.CUDA_SUCCESS:
        return None
    err, value = cu.cuMemPoolGetAttribute(
        cu.CUmemoryPool(int(pool)) if not isinstance(pool, cu.CUmemoryPool) else pool,
        cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
    return int(value) if err == cu.CUresult.CUDA_SUCCESS else None


def expandable_in_force(torch) -> bool | None:
    """Whether PyTorch's segments are expandable (its snapshot says, per segment)."""
    segments = torch.cuda.memory_snapshot()
    flags = [s.get("is_expandable") for s in segments if "is_expandable" in s]
    return any(flags) if flags else None


# ---------------------------------------------------------------------------------------------
# CUDA context and the filler


def _check(result, what: str):
    from cuda.bindings import driver as cu

    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err.name}")
    return result[1:] if isinstance(result, tuple) else None


def open_context() -> dict:
    """Make device 0's primary context current (every library uses it), before any library
    starts: its memory is then out of every figure of free memory that follows."""
    from cuda.bindings import driver as cu

    _check(cu.cuInit(0), "cuInit")
    (device,) = _check(cu.cuDeviceGet(0), "cuDeviceGet")
    (ctx,) = _check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    free, total = _check(cu.cuMemGetInfo(), "cuMemGetInfo")
    return {"free": int(free), "total": int(total)}


def fill_device(budget: int) -> dict:
    """One driver allocation of (free - budget) bytes, so that `budget` bytes are left to the
    program, whatever its setup; made before the setup, never freed."""
    from cuda.bindings import driver as cu

    free, total = _check(cu.cuMemGetInfo(), "cuMemGetInfo")
    free = int(free)
    want = (free - budget) // (2 * MiB) * (2 * MiB)
    filler = 0
    while want > 0:
        err, ptr = cu.cuMemAlloc(want)
        if err == cu.CUresult.CUDA_SUCCESS:
            filler = want
            break
        want -= 64 * MiB
    after = int(_check(cu.cuMemGetInfo(), "cuMemGetInfo")[0])
    return {"free_before": free, "filler": filler, "free_after": after}


# ---------------------------------------------------------------------------------------------
# One job


# emmpool's counters of driver work (and waits), per timed step in the report: what a setup's
# time goes to (page maps and moves of growable segments, segments made and freed, waits).
POOL_WORK = ("page_maps", "page_unmaps", "page_creates", "page_releases", "segment_allocations",
             "segment_releases", "fence_waits", "dormant_fences")


def run_job(job: dict) -> dict:
    """Run one job in this (fresh) process and return its figures. job: program, setup, kind
    ('timing', 'probe' or 'warmup'), scale, warmup_cycles, cycles, budget (bytes left to the
    program, probes only), rmm_initial_pool."""
    program, setup = job["program"], job["setup"]
    out = {"program": program, "setup": setup, "kind": job["kind"], "scale": job["scale"],
           "pid": os.getpid(), "marks": {"start": time.time()}, "outcome": "error"}
    out["environment"] = {k: os.environ.get(k) for k in (
        *setup_environment(setup), "CUDA_VISIBLE_DEVICES")}
    try:
        out["context"] = open_context()
        out["marks"]["context"] = time.time()
        if job.get("budget"):
            out["filler"] = fill_device(job["budget"])
        libs = libraries_of(program, setup)
        env = GpuEnv(libs)
        installed = install(setup, env, job.get("rmm_initial_pool", 0))
        out["serves"] = installed["serves"]
        out["marks"]["installed"] = time.time()
        if env.torch is not None:
            env.torch.set_float32_matmul_precision("high")
        runner = globals()[PROGRAMS[program].factory](env, job["scale"])
        out["marks"]["built"] = time.time()
        tracing = job.get("trace") and setup.startswith("emmpool")
        if tracing:  # the steps' allocations, each step's end marked (its sync)
            from emmpool import trace
            trace.start()
        cupy_peak = 0
        work_before = None
        checks, cycle_s, step_s = [], [], []
        step = 0
        warm = job.get("warmup_cycles", 0)
        for cycle in range(warm + job.get("cycles", 1)):
            if cycle == warm:
                out["marks"]["timed"] = time.time()
                pool_work = pool_counters.reader(setup, POOL_WORK)
                work_before = pool_work() if pool_work is not None else None
            t_cycle = time.perf_counter()
            for _ in range(STEPS_PER_CYCLE):
                t_step = time.perf_counter()
                checks.append(runner.step(step))
                env.sync()
                if tracing:
                    trace.mark_synchronize()
                if cycle >= warm:
                    step_s.append(time.perf_counter() - t_step)
                step += 1
                cupy_peak = max(cupy_peak, env.cupy_pool_bytes())
            if cycle >= warm:
                cycle_s.append(time.perf_counter() - t_cycle)
        out["marks"]["done"] = time.time()
        if tracing:
            out["trace_records"] = trace.write_csv(job["trace"], trace.stop())
        out.update(checks=checks, cycle_s=cycle_s, step_s=step_s, steps=step)
        if work_before is not None and step_s:
            out["pool_work"] = pool_counters.per_op(work_before, pool_work(), len(step_s))
        out["allocator"] = allocator_figures(setup, env, installed, cupy_peak)
        if setup == "separate-expandable":
            out["expandable"] = expandable_in_force(env.torch)
        out["outcome"] = "ok"
    except BaseException as e:  # noqa: BLE001 - every failure is this job's outcome
        out["outcome"] = classify_failure(e)
        out["error"] = f"{type(e).__name__}: {e}"[:600]
        traceback.print_exc()
    out["marks"]["end"] = time.time()
    return out

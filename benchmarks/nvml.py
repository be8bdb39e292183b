"""The GPUs as NVML sees them (never through CUDA: the process that measures makes no CUDA
context), and a thread that samples their used memory while the work it measures runs."""

from __future__ import annotations

import threading
import time

MiB = 1 << 20


class Gpu:
    """One GPU by its NVML index (the PCI bus order: CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA's
    the same)."""

    def __init__(self, index: int):
        try:
            import pynvml
        except ImportError:
            raise SystemExit("GPU memory is measured through NVML: pip install nvidia-ml-py "
                             "(on a host without network, bring its wheel)") from None
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as e:
            raise SystemExit(f"NVML sees no GPU {index} (an NVIDIA GPU and its driver are "
                             f"needed): {e}") from None
        self.index = index
        self.name = _text(pynvml.nvmlDeviceGetName(self.handle))
        self.uuid = _text(pynvml.nvmlDeviceGetUUID(self.handle))
        self.total = int(pynvml.nvmlDeviceGetMemoryInfo(self.handle).total)
        self.driver = _text(pynvml.nvmlSystemGetDriverVersion())

    def used(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def process_used(self, pid: int) -> int | None:
        """NVML's used memory of process `pid` on this GPU; None where NVML does not list it
        (another PID namespace, say) or says nothing."""
        for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if p.pid == pid:
                value = p.usedGpuMemory
                return int(value) if value is not None else None
        return None

    def settle(self, idle: int, timeout: float = 15.0, slack: int = 64 * MiB) -> int:
        """Wait until the used memory is back near `idle` (an exited child's memory goes back
        shortly after it exits); return it."""
        end = time.monotonic() + timeout
        while True:
            used = self.used()
            if used <= idle + slack or time.monotonic() > end:
                return used
            time.sleep(0.05)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpus(devices: list[int] | None) -> list[Gpu]:
    """The GPUs of these NVML indices, or every GPU."""
    if devices is None:
        import pynvml

        pynvml.nvmlInit()
        devices = list(range(pynvml.nvmlDeviceGetCount()))
    return [Gpu(d) for d in devices]


class PeakSampler:
    """The used memory of some GPUs, sampled by a thread every `period` seconds with each
    sample's time: the peak above the first reading, over the whole run or within a part of it."""

    def __init__(self, gpus: list, period: float = 0.005):
        self._gpus, self._period = gpus, period
        self.baseline = [g.used() for g in gpus]
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self.samples.append((time.time(), [g.used() for g in self._gpus]))

    def stop(self) -> list[int]:
        """The peak of the whole run above the baseline, per GPU."""
        self._stop.set()
        self._thread.join()
        peaks = self.peak_within(-float("inf"), float("inf")) or [0] * len(self.baseline)
        return [max(p, 0) for p in peaks]

    def peak_within(self, start: float, end: float) -> list[int] | None:
        """The peak above the baseline of the samples taken from `start` to `end` (time.time())."""
        window = [used for t, used in self.samples if start <= t <= end]
        if not window:
            return None
        return [max(u[i] for u in window) - b for i, b in enumerate(self.baseline)]

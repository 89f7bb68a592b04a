"""Host memory of this process: what `maxsim score --max-host-memory` bounds, and how a run measures it.

A run's host memory is its **growth**: the peak resident set of the process (``VmHWM``: anonymous memory,
pinned buffers and the pages of mapped files alike) minus the resident set when the run started, once
the libraries it uses are loaded. Those libraries (Python, torch, pyarrow, the kernels; on CUDA the
driver's context) are the process's fixed cost, about 0.6-0.7 GB with torch's CUDA build whatever the
corpus, and no budget can shrink them; `HostMeter` loads them before it takes its baseline.

The peak is read from ``/proc/self/status`` after ``/proc/self/clear_refs`` reset it to the resident set
at the start (Linux); elsewhere it is the process's lifetime peak (`resource.getrusage`), which can only
overstate the growth.
"""

from __future__ import annotations

import resource
import sys
import threading

# Host bytes a CPU run uses that no plan sizes, besides its worker threads' (`worker_host_bytes`): what
# the C allocator keeps of the run's freed blocks, library code touched for the first time, the run
# writer's buffers. Measured on the 2-core machine, the 512 MiB fp16 corpus, 1 query / 64 queries / 64 x
# 150 own candidates at --max-host-memory 128MiB: the peak grew 43-62 MiB past the planned batches, of
# which the inputs were 17-24 MiB and the two workers' ~19 MiB
# (benchmarks/results/memory/workers-host-memory-2core.txt).
UNPLANNED_HOST_BYTES = 24 << 20


def worker_host_bytes(workers: int) -> int:
    """Host bytes a CPU run's ``workers`` worker threads hold: each keeps its buffers, at most
    `maxsim_kernels.cpu.worker_keep_bytes` (16 MiB on the 2-core Xeon; each worker grew the run by 9.5-9.6
    MiB there, its buffers, its product library's and what the allocator kept: 16 workers forced on the 2
    cores against 2, benchmarks/results/memory/workers-host-memory-2core.txt)."""
    from maxsim_kernels.cpu import worker_keep_bytes

    return workers * worker_keep_bytes()

_active = 0  # meters running in this process (rank threads of a job): only the first resets the peak
_lock = threading.Lock()


def _status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process in bytes (empty where /proc is not there)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def resident_bytes() -> int:
    """This process's resident set now (its lifetime peak where /proc is not there)."""
    return _status().get("VmRSS") or _lifetime_peak()


def _lifetime_peak() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _reset_peak() -> bool:
    """Reset ``VmHWM`` to the resident set now (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def load_libraries(cuda_device: object | None = None) -> None:
    """Load what a run loads lazily, so that it counts as the process's fixed cost and not as the run's:
    safetensors, and on CUDA the device's context. Not pandas: a scoring run builds its Arrow arrays
    without pyarrow's pandas bridge (`maxsim_cli.arrays`), which would import it (0.35-0.5 s on the
    H200 host, ~45 MB)."""
    import pyarrow  # noqa: F401
    import safetensors  # noqa: F401 - the shard readers' header check

    if cuda_device is not None:
        import torch

        torch.empty(0, device=cuda_device)  # type: ignore[call-overload]


class HostMeter:
    """The growth of this process's resident set from now on (see the module docstring).

    Use as a context manager (or call `close`): meters of rank threads running at once share the peak,
    which only the first resets."""

    def __init__(self, cuda_device: object | None = None) -> None:
        global _active
        load_libraries(cuda_device)
        with _lock:
            first = _active == 0
            _active += 1
            self.exact = _reset_peak() if first else bool(_status())
        self._open = True
        self.base = resident_bytes()

    def used(self) -> int:
        """Bytes the resident set has grown since the start (at least 0)."""
        return max(0, resident_bytes() - self.base)

    def peak_growth(self) -> int:
        """The peak resident set since the start, minus the resident set at the start."""
        peak = _status().get("VmHWM") if self.exact else None
        return max(0, (peak or _lifetime_peak()) - self.base)

    def peak(self) -> int:
        """The peak resident set (bytes) since the start (exact) or of the process's lifetime."""
        return (_status().get("VmHWM") if self.exact else None) or _lifetime_peak()

    def close(self) -> None:
        global _active
        if self._open:
            self._open = False
            with _lock:
                _active -= 1

    def __enter__(self) -> HostMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Launching Triton kernels: fitting the tiles into shared memory, and repeated launches at low host cost.

The tuning tables were measured at dim 128. Wider embeddings (ColBERT variants at 384, ColPali at 128 but
other encoders up to 512+) walk the dim in several K chunks, and the software pipeliner keeps `num_stages`
copies of every chunk's tiles in shared memory: at dim 384 the fp16 "few" configuration asks for ~297 KB
against the H200's 227 KB (measured, triton 3.6). Compilation reports that before anything runs, so the
launch is retried with one pipeline stage less until it fits, and the fitted stage count is remembered per
kernel and compile-time signature (no retry and no recompile on later calls).

Host cost. `kernel[grid](...)` binds and specialises every argument and looks the compiled kernel up in
Triton's cache on every call: 37.5 us of host time a launch against 16.0 us for the compiled kernel's own
launcher. Training steps at ColBERT
sizes make four launches and were bound by host time, so a launch site that repeats with the same shapes
(`KernelLaunch`) calls the compiled launcher directly from its third call on (docs/kernel-notes.md,
"Training: the inverse map, the host and the argmax tile").
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
import triton

try:  # the error class moved between Triton releases
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover
    from triton.runtime.autotuner import OutOfResources  # type: ignore[no-redef]

_FITTED_STAGES: dict[tuple, int] = {}

# Gluon is experimental and its API changes between Triton releases: the Gluon kernels are used with the
# release they were built and measured with (the GPU image's), and the Triton kernels with any other.
GLUON_TRITON = "3.6."


def gluon_module(name: str, device: torch.device) -> ModuleType | None:
    """The Gluon kernel module `maxsim_kernels.<name>` where it can run on `device` (CUDA, with Triton
    GLUON_TRITON*), else None (the caller then keeps its Triton kernel). The module's own `supports`
    decides on the problem."""
    if device.type != "cuda" or not triton.__version__.startswith(GLUON_TRITON):
        return None
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None


@functools.cache
def hopper_device(device: torch.device) -> bool:
    """Whether `device` is an sm_90 GPU, the one the Gluon kernels are built for."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def launch_fitting_shared_memory(kernel: Any, grid: tuple, *args: Any, **meta: Any) -> int:
    """`kernel[grid](*args, **meta)`, with `num_stages` lowered until the tiles fit in shared memory.

    Returns the stage count that was launched."""
    key = (kernel, tuple(sorted((k, v) for k, v in meta.items() if k != "num_stages")),
           tuple(getattr(a, "dtype", None) for a in args))  # fmt: skip
    stages = _FITTED_STAGES.get(key, meta.get("num_stages", 3))
    while True:
        try:
            kernel[grid](*args, **{**meta, "num_stages": stages})
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            continue
        _FITTED_STAGES[key] = stages
        return stages


class KernelLaunch:
    """A launch site that repeats: one kernel, grid and set of compile-time arguments (`meta`, with
    num_warps and num_stages).

    The first call launches through Triton's JIT (`launch_fitting_shared_memory`: it compiles if needed
    and fits num_stages). On CUDA the second call fetches the compiled kernel (`kernel.warmup` with the
    same arguments) and every call from then on goes straight to its launcher. That skips Triton's
    argument specialisation, so the caller must pass arguments that Triton would specialise alike on
    every call: the same dtypes, the same 16-byte alignment of every tensor, and the same int values
    (the plans that own a KernelLaunch key it by shapes, dtypes and alignments). Under the interpreter,
    or where this Triton release lacks the compiled-launcher API, every call goes through the JIT.
    """

    __slots__ = ("kernel", "grid", "meta", "device", "calls", "runner", "tail")

    def __init__(self, kernel: Any, grid: tuple, meta: dict[str, Any], device: torch.device) -> None:
        self.kernel, self.grid, self.meta, self.device = kernel, grid, dict(meta), device
        self.calls = 0
        self.runner: Any = None
        self.tail: tuple = ()

    def __call__(self, *args: Any) -> None:
        if self.runner is not None:
            self.runner(*args, *self.tail, stream=torch._C._cuda_getCurrentRawStream(self.device.index))
            return
        self.calls += 1
        if self.calls == 2 and self.device.type == "cuda":
            self._compile(args)
        self.meta["num_stages"] = launch_fitting_shared_memory(self.kernel, self.grid, *args, **self.meta)

    def _compile(self, args: Sequence[Any]) -> None:
        found = compiled_kernel(self.kernel, self.grid, self.meta, args)
        if found is None:
            return
        try:
            self.runner = found[0][(*self.grid, 1, 1)[:3]]  # the compiled launcher reads all three extents
            self.tail = found[1]
        except (AttributeError, TypeError):  # pragma: no cover - a Triton release without this API
            self.runner = None


def compiled_kernel(
    kernel: Any, grid: tuple, meta: dict[str, Any], args: Sequence[Any]
) -> tuple[Any, tuple] | None:
    """The compiled kernel for these arguments (an API Triton keeps public since 3.0) and the
    compile-time values its launcher takes after them; None where this Triton release lacks the API or a
    runtime argument is missing from ``args`` (keep the JIT path then)."""
    try:
        compiled = kernel.warmup(*args, grid=grid, **meta)
        tail = []
        for param in kernel.params[len(args) :]:
            if param.name in meta:
                tail.append(meta[param.name])
            elif param.is_constexpr and param.has_default:
                tail.append(param.default)
            else:
                return None
        return compiled, tuple(tail)
    except (AttributeError, TypeError):  # pragma: no cover - a Triton release without this API
        return None


def specialisation_key(arg: Any) -> Any:
    """What Triton specialises a runtime argument on: a tensor's dtype and 16-byte alignment; an int's
    equality to 1 (a constant then), divisibility by 16 and width (i32, i64, u64); anything else by value."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int) and not isinstance(arg, bool):
        width = 0 if -(2**31) <= arg < 2**31 else 1 if -(2**63) <= arg < 2**63 else 2
        return arg == 1, arg % 16 == 0, width
    return type(arg), arg


class SpecialisedLaunch:
    """A launch site whose grid and arguments change from call to call (a rerank's candidates), launched
    through the compiled kernel of each specialisation it meets (`specialisation_key` of every argument):
    Triton's JIT for a specialisation's first call, its compiled launcher from the second on (as
    `KernelLaunch` does for one fixed set of arguments). Under the interpreter every call goes through
    the JIT."""

    __slots__ = ("kernel", "meta", "device", "_seen", "_compiled")

    def __init__(self, kernel: Any, meta: dict[str, Any], device: torch.device) -> None:
        self.kernel, self.meta, self.device = kernel, dict(meta), device
        self._seen: set[tuple] = set()
        self._compiled: dict[tuple, tuple[Any, tuple]] = {}

    def __call__(self, grid: tuple, *args: Any) -> None:
        key = tuple(map(specialisation_key, args))
        entry = self._compiled.get(key)
        if entry is not None:
            compiled, tail = entry
            compiled[(*grid, 1, 1)[:3]](
                *args, *tail, stream=torch._C._cuda_getCurrentRawStream(self.device.index)
            )
            return
        self.meta["num_stages"] = launch_fitting_shared_memory(self.kernel, grid, *args, **self.meta)
        if self.device.type != "cuda":
            return
        if key in self._seen:
            found = compiled_kernel(self.kernel, grid, self.meta, args)
            if found is not None:
                self._compiled[key] = found
        self._seen.add(key)

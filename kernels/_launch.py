"""Launching a Triton kernel whose tiles must fit the GPU's shared memory, for any `dim`.

The tuning tables were measured at dim 128. Wider embeddings (ColBERT variants at 384, ColPali at 128 but
other encoders up to 512+) walk the dim in several K chunks, and the software pipeliner keeps `num_stages`
copies of every chunk's tiles in shared memory: at dim 384 the fp16 "few" configuration asks for ~297 KB
against the H200's 227 KB (measured, triton 3.6). Compilation reports that before anything runs, so the
launch is retried with one pipeline stage less until it fits, and the fitted stage count is remembered per
kernel and compile-time signature (no retry and no recompile on later calls).
"""

from __future__ import annotations

from typing import Any

try:  # the error class moved between Triton releases
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover
    from triton.runtime.autotuner import OutOfResources  # type: ignore[no-redef]

_FITTED_STAGES: dict[tuple, int] = {}


def launch_fitting_shared_memory(kernel: Any, grid: tuple, *args: Any, **meta: Any) -> None:
    """`kernel[grid](*args, **meta)`, with `num_stages` lowered until the tiles fit in shared memory."""
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
        return

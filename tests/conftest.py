"""Test-session setup shared by every test module.

Without a CUDA device the Triton kernels run under Triton's interpreter on CPU tensors; the variable
must be set before the kernels are defined, hence here, before any test module imports them.
"""

from __future__ import annotations

import os

import pytest
import torch

# `triton.jit` reads the variable when a kernel is defined, i.e. when maxsim_kernels is first imported,
# which happens after this (torch itself does not import the kernels).
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _small_inverse_map_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter, the backward's inverse map sorts segments of 64 / 32 query tokens instead of
    4096 / 1024: the interpreter runs the in-register sort in Python (4096 keys took ~40 s a test), and
    small segments make the multi-segment paths run in every backward test. GPU runs keep the tuned sizes."""
    if HAS_CUDA:
        return
    from maxsim_kernels import maxsim_backward

    monkeypatch.setattr(maxsim_backward, "_CSR_MAX_SEGMENT", 64)
    monkeypatch.setattr(maxsim_backward, "_CSR_MANY_DOCS_SEGMENT", 32)

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

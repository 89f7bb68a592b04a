"""Test-session setup shared by every test module.

Without a CUDA device the Triton kernels run under Triton's interpreter on CPU tensors; the variable
must be set before the kernels are defined, hence here, before any test module imports them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

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


# Defined for every script `sm90_build` runs: the Hopper target and the kernel's resource usage (registers,
# shared and local memory) from triton's own cuobjdump, "" where that tool is missing.
_SM90_PRELUDE = r"""
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def ptxas_report(compiled):  # ptxas -v on the kernel's PTX: registers, spills, wgmma serialization
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "k.ptx"), "w") as fh:
            fh.write(compiled.asm["ptx"])
        return subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(tmp, "k.ptx"), "-o",
                               os.path.join(tmp, "k.cubin")], capture_output=True, text=True).stderr


def resource_usage(compiled):
    if not os.path.exists(_CUOBJDUMP):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([_CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True,
                              text=True).stdout
"""


@pytest.fixture
def sm90_build() -> Callable[[str], Any]:
    """Runs a script that compiles kernels for Hopper (sm_90) with triton's own ptxas, no GPU needed, and
    returns the JSON it prints last. In a fresh process: triton cannot generate code once imported with
    TRITON_INTERPRET=1. Skips where triton's NVIDIA tools or its ahead-of-time compile API are missing."""

    def run(script: str) -> Any:
        triton = pytest.importorskip("triton")
        tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        if not os.path.exists(os.path.join(tools, "ptxas")):
            pytest.skip("triton's NVIDIA backend tools are not installed")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-c", _SM90_PRELUDE + script]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 and ("ASTSource" in proc.stderr or "GPUTarget" in proc.stderr):
            pytest.skip(f"this triton's ahead-of-time compile API differs: {proc.stderr[-300:]}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture
def device_candidates(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The launchers' path for candidate indices on a GPU, under the interpreter: `values_on_host` says
    the CPU candidates tensor cannot be read without waiting for a device, and every host copy of
    candidates (`host_candidates`, the copy that would wait) is recorded in the returned list."""
    from maxsim_kernels import validation as _validate

    copies: list[torch.Tensor] = []
    host_candidates = _validate.host_candidates

    def recorded(candidate_docs: torch.Tensor, num_docs: int) -> Any:
        copies.append(candidate_docs)
        return host_candidates(candidate_docs, num_docs)

    monkeypatch.setattr(_validate, "values_on_host", lambda x: False)
    monkeypatch.setattr(_validate, "host_candidates", recorded)
    return copies


@pytest.fixture(scope="session")
def tiers(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """sample_data's corpus quantized to 4 and 2 bits (64 centroids), once for every test that reads it:
    {bits: folder}."""
    from tierlib import quantize

    root = tmp_path_factory.mktemp("tiers")
    corpus = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sample_data", "corpus"
    )
    folders = {}
    for bits in (4, 2):
        folders[bits] = str(root / f"bits{bits}")
        quantize(corpus, folders[bits], bits)
    return folders

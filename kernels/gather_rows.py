"""Rows of chosen documents gathered into one packed buffer on a GPU, read by the GPU from where they lie:
its own memory, or host memory mapped into its address space (`map_host`). A rerank on a GPU of a corpus
resident in host memory then moves only its candidates' rows over PCIe, read by the SMs, with no host
thread copying them into a staging buffer first.

    out[offsets[i] + r] = src[starts[i] + r]        0 <= r < offsets[i + 1] - offsets[i],  0 <= i < n

and the same for the rows' scales (int8) when given. A program copies BLOCK_ROWS rows of one document as
32-bit words where a row's bytes allow it (16-byte loads and stores), else as bytes.

Cost, bound: no arithmetic; the rows' bytes read once and written once. From mapped host memory the
reads cross PCIe, whose page-locked host-to-device copy ran at 54.8 GB/s on the H100 machine
(benchmarks/results/codes/two-stage-h100-5668d39.json): one query's 1,000 candidates of an 8 GB fp16
corpus, 70.8 MB of rows, take at least 1.29 ms. At ~2 us of PCIe latency that rate needs ~110 KB of reads
in flight, a few dozen programs' 8 KB tiles: the grid keeps far more than that. Measured (H100, in a
two-stage search, docs/two-stage.md): the exact stage of 70.8 MB of rows took 2.23 ms against 6.26 ms with
the rows gathered by host threads, 32 GB/s end to end with the host's work and the scoring launch.

`map_host` page-locks the host tensors' memory and maps it for every GPU (cudaHostRegister, portable and
mapped), in chunks on a few threads (8.0 GB in 0.33-0.39 s on the H100 machine, where the driver
serialises much of it: docs/kernel-notes.md), and checks that each chunk is mapped at its host address
(unified addressing), so that the whole range is one span of device addresses whose base Triton
resolves. The chunks are registered on pool threads: a refused registration leaves its error in that
thread's CUDA state, not in the caller's, where torch's next launch check would report it. It returns
None where CUDA refuses (the caller then copies through a staging buffer); `HostMapping.release` unlocks
the memory, which must not be freed while it is mapped.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl

from .validation import cdiv

BLOCK_ROWS = 32  # rows a program: 8 KB of an fp16 row of dim 128
NUM_WARPS = 4
# Page-locking: chunks of at least this many bytes, on up to this many threads.
REGISTER_CHUNK_BYTES = 256 << 20
REGISTER_THREADS = 8
_PAGE = 4096
_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3


@triton.jit
def _gather_rows_kernel(
    src, src_scales, out, out_scales, starts, offsets,
    WORDS: tl.constexpr, WORDS_P2: tl.constexpr, BLOCK_ROWS: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    doc = tl.program_id(0)
    first_row = tl.program_id(1) * BLOCK_ROWS
    begin = tl.load(offsets + doc)
    rows = tl.load(offsets + doc + 1) - begin
    if first_row < rows:
        start = tl.load(starts + doc)
        r = first_row + tl.arange(0, BLOCK_ROWS)
        w = tl.arange(0, WORDS_P2)
        row_ok = r < rows
        keep = row_ok[:, None] & (w < WORDS)[None, :]
        src_row = (start + r).to(tl.int64)
        out_row = (begin + r).to(tl.int64)
        values = tl.load(src + src_row[:, None] * WORDS + w[None, :], mask=keep)
        tl.store(out + out_row[:, None] * WORDS + w[None, :], values, mask=keep)
        if SCALED:
            tl.store(out_scales + out_row, tl.load(src_scales + src_row, mask=row_ok), mask=row_ok)


def _words(rows: torch.Tensor) -> torch.Tensor:
    """A [T, width] tensor as [T, words] of its bytes: int32 where a row's bytes are a multiple of 4."""
    nbytes = rows.shape[1] * rows.element_size()
    flat = rows.view(torch.uint8).view(rows.shape[0], nbytes)
    return flat.view(torch.int32) if nbytes % 4 == 0 else flat


def gather_rows(
    src: torch.Tensor,
    starts: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    src_scales: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    *,
    max_rows: int,
) -> None:
    """``out[offsets[i]:offsets[i + 1]] = src[starts[i]:starts[i] + offsets[i + 1] - offsets[i]]`` for each
    document ``i`` (and ``out_scales`` from ``src_scales`` alike), on ``out``'s GPU, on the current stream.

    ``src``: [T, width] contiguous, in that GPU's memory or in host memory mapped by `map_host` (or any CPU
    tensor under TRITON_INTERPRET); ``out``: [R, width] of the same dtype; ``starts`` int64 [n] and
    ``offsets`` int64 [n + 1] (non-decreasing, ``offsets[n] <= R``) on the GPU; ``max_rows`` at least the
    longest document's rows (the grid's second axis). Nothing is checked on the device: the caller's rows
    must lie inside ``src``."""
    if src.dtype != out.dtype or src.shape[1:] != out.shape[1:] or src.dim() != 2:
        shapes = f"src {tuple(src.shape)} {src.dtype}, out {tuple(out.shape)} {out.dtype}"
        raise ValueError(f"gather_rows: src and out must be [rows, width] of one width and dtype: {shapes}")
    if not (src.is_contiguous() and out.is_contiguous()):
        raise ValueError("gather_rows: src and out must be contiguous")
    if (src_scales is None) != (out_scales is None):
        raise ValueError("gather_rows: src_scales and out_scales go together (both, or neither)")
    scaled = src_scales is not None
    n = starts.numel()
    if n == 0 or max_rows <= 0:
        return
    src_words, out_words = _words(src), _words(out)
    words = src_words.shape[1]
    grid = (n, cdiv(max_rows, BLOCK_ROWS))
    _gather_rows_kernel[grid](
        src_words, src_scales if scaled else src_words, out_words, out_scales if scaled else out_words,
        starts, offsets,
        WORDS=words, WORDS_P2=triton.next_power_of_2(words), BLOCK_ROWS=BLOCK_ROWS, SCALED=scaled,
        num_warps=NUM_WARPS,
    )  # fmt: skip


class HostMapping:
    """Host memory page-locked and mapped into every GPU's address space by `map_host`, until `release`."""

    def __init__(self, spans: list[tuple[int, int]], seconds: float = 0.0) -> None:
        self.spans = spans  # (address, bytes) of each registered chunk
        self.nbytes = sum(size for _, size in spans)
        self.seconds = seconds  # what the page-locking took
        self._lock = threading.Lock()

    def release(self) -> None:
        """Unlock the memory (once; later calls do nothing)."""
        with self._lock:
            spans, self.spans = self.spans, []
        cudart = torch.cuda.cudart()
        for address, _size in spans:
            cudart.cudaHostUnregister(address)


def _chunks(address: int, nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """[address, address + nbytes) cut at page boundaries into pieces of about ``chunk`` bytes, so that no
    page belongs to two pieces."""
    cuts = [address]
    at = (address // _PAGE + 1) * _PAGE + chunk // _PAGE * _PAGE
    while at < address + nbytes:
        cuts.append(at)
        at += chunk // _PAGE * _PAGE
    cuts.append(address + nbytes)
    return [(a, b - a) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _mapped_at_host_address(address: int) -> bool:
    """Whether the registered host address is also its device address (unified addressing)."""
    driver = _driver()
    if driver is None:
        return False
    device_pointer = ctypes.c_uint64(0)
    status = driver.cuPointerGetAttribute(
        ctypes.byref(device_pointer), _CU_POINTER_ATTRIBUTE_DEVICE_POINTER, ctypes.c_uint64(address)
    )
    return status == 0 and device_pointer.value == address


def map_host(tensors: Sequence[torch.Tensor], *, threads: int = REGISTER_THREADS) -> HostMapping | None:
    """Page-lock the memory of the contiguous CPU ``tensors`` and map it for every GPU (module docstring),
    so that kernels read them in place; None (nothing left locked) where CUDA refuses or a chunk is not
    mapped at its host address. The tensors must outlive the mapping (`HostMapping.release`)."""
    spans: list[tuple[int, int]] = []
    for tensor in tensors:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("map_host: contiguous CPU tensors only")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            spans.extend(_chunks(tensor.data_ptr(), nbytes, REGISTER_CHUNK_BYTES))
    cudart = torch.cuda.cudart()
    began = time.perf_counter()

    def register(span: tuple[int, int]) -> bool:
        address, size = span
        return int(cudart.cudaHostRegister(address, size, _HOST_REGISTER_PORTABLE_MAPPED)) == 0

    with ThreadPoolExecutor(max(1, min(threads, len(spans)))) as pool:
        done = list(pool.map(register, spans))
    registered = [span for span, ok in zip(spans, done, strict=True) if ok]
    mapping = HostMapping(registered, time.perf_counter() - began)
    if not all(done) or not all(_mapped_at_host_address(address) for address, _ in spans):
        mapping.release()
        return None
    return mapping

"""`maxsim verify`: the fused kernel against an independent reference, with a verdict.

    score(q, d) = sum_i max_j <q_i, d_j>          i over the query's tokens, j over the document's

What is compared
----------------
The scored pairs are every document of the corpus, a seeded sample of them (``sample_docs``, ``seed``),
or each query's candidates from a first-stage run (``candidates``). The fused kernel
(`maxsim_kernels.maxsim_varlen` / `maxsim_candidates` with ``return_argmax=True``) scores them on the
chosen device and backend; the reference scores them again from the *same* inputs (queries rounded to
the corpus dtype first, exactly as `maxsim score` feeds the kernel), so every difference is the kernel's
arithmetic, not input rounding:

- float64: ``S64(q, d)`` with its argmax ``a64(i, d)`` (lowest index on ties) and the gap ``g64(i, d)``
  between the two best similarities of query token i in document d;
- float32 ("plain" precision): the similarity tensor materialised in float32, max, and a float32 sum;
  its own error against float64 is the yardstick a fused kernel should not exceed by more than 2x
  (the FlashAttention rule);
- int8 shards: the float64 evaluation of the same integer math (`maxsim_int8_reference`: exact integer
  dot products, each ``s_d[j] * acc[i, j]`` rounded to fp32 as the kernels round it), so the max and
  argmax must match bit for bit and only the query-scale products and the sum may differ.

One shared pass (float shards)
------------------------------
Documents are sorted by length and cut into padded groups (padding masked with -inf); one float32 GEMM
per group gives ``S32 = D Q^T``, its max, argmax ``a32`` and second max, hence the float32 reference and
the float32 gap ``g32``. The float64 reference is derived from the same pass instead of a second, 4x
slower float64 GEMM: any fp32 summation order satisfies ``|S32 - S| <= E = gamma_K |q_i| max_j |d_j|``
(K = dim, Higham's ``gamma_n = n u / (1 - n u)``), so where ``g32 > 2E + margin`` the float64 argmax is
``a32`` and the pair is not a near-tie, and its float64 max is the float64 dot product of ``q_i`` with
that one token; every other pair (near-ties, exact ties) is recomputed over the whole document in
float64. The result is the float64 materialised reference, at the cost of the float32 one.

Tolerances (defaults; docs/verify.md gives the reasoning)
---------------------------------------------------------
With ``u = 2^-24`` and accumulation taken at ``2u`` (tensor cores do not promise round-to-nearest in
their fp32 accumulators):

- similarity error ``e_sim``: ``gamma_K(2u)`` for fp32, fp16 and bf16 inputs (fp16/bf16 products are
  exact in fp32); ``2^-9 + gamma_K(2u)`` for fp32 inputs with TF32 (inputs cut to 10 mantissa bits);
- per-score bound ``B(q, d) = (e_sim + gamma_Lq(u)) * max_j |d_j| * sum_i |q_i|``: the max adds no error
  of its own, the fp32 sum over the query's Lq tokens adds ``gamma_Lq``; int8:
  ``B = (2u + gamma_Lq(u)) * max_j |d~_j| * sum_i |q~_i|`` (dequantized norms: the shared fp32 product
  rounding cancels, the query-scale product and the sum remain);
- near-tie margin of the argmax: ``2 e_sim |q_i| max_j |d_j|`` (either of two tokens closer than that
  may win); int8: 0, since kernel and reference round the same products and both break ties low.

A score passes when ``|kernel - S64| <= B`` (or ``atol + rtol |S64|`` when either is given); the
kernel's max error must also stay within 2x the float32 reference's (float inputs without TF32, default
tolerances); the argmax must agree on every pair that is not a near-tie; every query's top-k must be a
valid top-k of the reference, treating scores within their tolerance as tied ("tolerance-aware
overlap", at least ``min_overlap``, default 1.0); and non-finite scores must match. With a
``reference_corpus`` (the float shards an int8 corpus came from) the quantization impact is reported
(errors, plain top-k overlap, Kendall tau-b against the exact float scores) and judged only on the mean
top-k overlap (``min_overlap``, default `QUANTIZATION_MIN_OVERLAP`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from maxsim_cli.agreement import (
    ArgmaxStats,
    ErrorStats,
    NonFinite,
    RankingStats,
    ToleranceCheck,
    nonfinite_counts,
    ranking_agreement,
    score_errors,
    tolerance_check,
)
from maxsim_cli.errors import InputError, MaxsimError, UsageError
from maxsim_cli.runs import read_run
from maxsim_cli.score import check_backend_option, resolve_device
from maxsim_cli.shards import Corpus, DocBatch, open_corpus, read_queries

EXIT_FAILED = 3  # exit code of a verdict that fails (0: passes; 1: error; 2: usage)
UNIT_ROUNDOFF = 2.0**-24  # fp32, round to nearest
ACCUMULATION_ROUNDOFF = 2.0**-23  # fp32 accumulators of GEMMs and tensor cores, taken at twice u
TF32_INPUT_ERROR = 2.0**-9  # relative error of a product of two inputs cut to TF32 (10 mantissa bits)
# The kernel's max error may be at most this many times the float32 reference's (FlashAttention's rule),
# with the float32 error floored at YARDSTICK_FLOOR_ULPS * u * max|score| (a reference that happens to be
# exact must not make the rule impossible).
YARDSTICK_FACTOR = 2.0
YARDSTICK_FLOOR_ULPS = 4.0
# Quantization impact: the mean top-k overlap an int8 corpus must keep against its float source.
# Per-token int8 perturbs each similarity by ~|q||d| * 2^-8 / sqrt(dim); on real embeddings (the MiniLM
# sample data) that moves a few near-tied documents across the top-10 boundary, which 0.9 allows while
# a broken quantization (wrong scales, wrong rounding) falls far below it.
QUANTIZATION_MIN_OVERLAP = 0.9
OVERLAP_KS = (10, 100, 1000)
TAU_DEPTH = 1000  # Kendall tau-b over each query's top TAU_DEPTH reference documents
# Gradient check (--grad): relative error bound per input dtype (issue 6's targets; bf16 and TF32 store or
# multiply with 8 or 10 mantissa bits, so their bound is the rounding of the stored gradient, ~2^-8).
GRAD_TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3, "int8": 1e-5, "tf32": 8e-3}
GRAD_QUERIES = 8
GRAD_DOCS = 64
# Every scored pair keeps a few float64 numbers in memory: past this many, ask for a sample.
MAX_SCORES = 50_000_000
# Document tokens per scored batch (the kernel's argmax [Tq, docs] is the largest array per batch).
DEFAULT_BATCH_TOKENS = 1 << 19
# Reference pass sizes. CPU, measured on one core of the 2-core dev machine (dim 128, 3200 query tokens,
# documents of 20-300 tokens): blocks of 4M similarities (1024 query rows x ~4096 padded document tokens,
# 16 MB, the kernel's CPU block too) ran 500 documents in 3.9 s against 3.8-4.9 s for 2M-16M; a max with
# argmax over the last dim (query-major layout) takes 6.7 ms per block against 9.7 ms over the middle
# dim. The fix-up gathers rows for 16 MB worth of documents at a time (4-16 documents: 35 ms per 64
# documents, flat). CUDA: sized to keep temporaries near 1-2 GiB; not tuned (no GPU measurement yet).
_CPU_SIM_ELEMS = 1 << 22
_CUDA_SIM_ELEMS = 1 << 28
_CPU_QUERY_ROWS = 1024
_CUDA_QUERY_ROWS = 1 << 30
_CPU_FIXUP_BYTES = 16 << 20
_CUDA_FIXUP_BYTES = 256 << 20
# Documents up to this many tokens get a plain float64 GEMM: its cost per (query token, document) grows
# with the length, the certified fix-up's (one gathered float64 row) does not; 64 documents of 160
# tokens x 3200 query tokens, dim 128: float64 GEMM 200 ms vs fix-up 29 ms, so the two meet near 24.
_FULL_FLOAT64_WIDTH = 24


def gamma(n: int, unit: float = UNIT_ROUNDOFF) -> float:
    """Higham's gamma_n = n u / (1 - n u): relative error bound of a sum of n terms in any order."""
    nu = n * unit
    if nu >= 1.0:
        return math.inf
    return nu / (1.0 - nu)


def similarity_error(dtype: str, dim: int, allow_tf32: bool) -> float:
    """Bound on the kernel's relative similarity error |s^ - s| / (|q_i| |d_j|) for these inputs."""
    error = gamma(dim, ACCUMULATION_ROUNDOFF)
    if dtype == "float32" and allow_tf32:
        error += TF32_INPUT_ERROR
    return error


# ------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------


@dataclass
class Tolerances:
    """User overrides; None means the documented default."""

    atol: float | None = None
    rtol: float | None = None
    min_overlap: float | None = None
    min_argmax_agreement: float = 1.0


@dataclass(frozen=True)
class Check:
    """One judged criterion of the verdict."""

    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@dataclass
class Quantization:
    """The int8 (or lower precision) scores against exact float64 scores of the float reference corpus."""

    reference_corpus: list[str]
    reference_dtype: str
    errors: ErrorStats
    ranking: RankingStats
    min_overlap: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference_corpus": self.reference_corpus,
            "reference_dtype": self.reference_dtype,
            "errors": self.errors.to_dict(),
            "ranking": self.ranking.to_dict(),
            "min_overlap": self.min_overlap,
        }


@dataclass
class VerifyReport:
    """Everything `maxsim verify` measured, and the verdict."""

    setup: dict[str, Any]
    kernel_errors: ErrorStats
    float32_errors: ErrorStats | None
    tolerance: ToleranceCheck
    tolerance_rule: str
    max_allowed: float
    argmax: ArgmaxStats
    float32_argmax: ArgmaxStats | None
    near_tie_margin: str
    ranking: RankingStats
    nonfinite_kernel: NonFinite
    nonfinite_reference: NonFinite
    worst: dict[str, Any] | None
    first_argmax_mismatch: dict[str, Any] | None
    quantization: Quantization | None
    grad: dict[str, Any] | None
    checks: list[Check]
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the headline numbers at the top level, everything else under `details`."""
        return {
            "passed": self.passed,
            "max_abs_error": self.kernel_errors.max_abs,
            "max_rel_error": self.kernel_errors.max_rel,
            "argmax_agreement": self.argmax.agreement,
            "topk_overlap": {str(k): s.mean for k, s in self.ranking.overlap.items()},
            "kendall_tau": self.ranking.kendall_tau.mean,
            "checks": [c.to_dict() for c in self.checks],
            "details": {
                "setup": self.setup,
                "kernel_errors": self.kernel_errors.to_dict(),
                "float32_reference_errors": None
                if self.float32_errors is None
                else self.float32_errors.to_dict(),
                "tolerance": {
                    **self.tolerance.to_dict(),
                    "rule": self.tolerance_rule,
                    "max_allowed": self.max_allowed,
                },
                "argmax": {**self.argmax.to_dict(), "near_tie_margin": self.near_tie_margin},
                "float32_reference_argmax": None
                if self.float32_argmax is None
                else self.float32_argmax.to_dict(),
                "ranking": self.ranking.to_dict(),
                "nonfinite": {
                    "kernel": self.nonfinite_kernel.to_dict(),
                    "reference": self.nonfinite_reference.to_dict(),
                },
                "worst_score": self.worst,
                "first_argmax_mismatch": self.first_argmax_mismatch,
                "quantization": None if self.quantization is None else self.quantization.to_dict(),
                "grad": self.grad,
                "timings_s": self.timings,
            },
        }


# ------------------------------------------------------------------------------------------------------
# The reference pass (float documents)
# ------------------------------------------------------------------------------------------------------


@dataclass
class FloatReference:
    """Reference results for queries x documents, laid out like `maxsim_varlen`'s outputs."""

    score64: torch.Tensor  # float64 [nq, nd]
    score32: torch.Tensor  # float32 [nq, nd]
    argmax64: torch.Tensor  # int32 [Tq, nd], lowest index on ties, -1 for an empty document
    argmax32: torch.Tensor  # int32 [Tq, nd]
    near_tie: torch.Tensor  # bool [Tq, nd]: the two best float64 similarities within the margin
    recomputed: int  # pairs whose float64 max was recomputed over the whole document
    # float32 sums of maxima of similarities computed by plain torch.mm in `plain_dtype` (the yardstick)
    score_plain: torch.Tensor | None = None


@contextlib.contextmanager
def _ieee_float32_matmul() -> Iterator[None]:
    """float32 GEMMs in full IEEE precision (no TF32 / bf16 shortcuts) inside the block."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def _length_groups(lengths: np.ndarray, rows: int, max_elems: int) -> list[np.ndarray]:
    """Non-empty documents sorted by length, cut into groups with rows * n * longest <= max_elems."""
    order = np.argsort(lengths, kind="stable")
    order = order[lengths[order] > 0]
    sorted_lens = lengths[order]
    per_group = max(1, max_elems // max(rows, 1))  # padded document tokens per group
    groups = []
    start = 0
    while start < order.size:
        limit = min(order.size - start, max(1, per_group // int(sorted_lens[start])))
        k = np.arange(1, limit + 1)
        fits = int(np.count_nonzero(k * sorted_lens[start : start + limit] <= per_group))
        stop = start + max(1, fits)
        groups.append(order[start:stop])
        start = stop
    return groups


def _segment_max(values: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    """Max of `values` over each segment [offsets[k], offsets[k+1]) (0 for an empty segment)."""
    lengths = torch.from_numpy(np.diff(offsets)).to(values.device)
    if values.numel() == 0:
        return torch.zeros(lengths.numel(), dtype=values.dtype, device=values.device)
    return torch.segment_reduce(values, "max", lengths=lengths, unsafe=True).nan_to_num(0.0, 0.0, 0.0)


def _top2(
    sims: torch.Tensor, padding: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Max, first argmax and second max over the last dim of `sims`, leaving out where `padding` is true.

    Overwrites `sims`. The second max is -inf for a one-token document. `padding` None: no padding.
    """
    if padding is not None:
        sims.masked_fill_(padding, -math.inf)
    best, arg = sims.max(dim=-1)  # the first maximal index on ties
    sims.scatter_(-1, arg.unsqueeze(-1), -math.inf)
    return best, arg, sims.amax(dim=-1)


@contextlib.contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """Run a loop of small CPU ops on one thread: a second thread gains little on these memory-bound
    ops and, on a busy machine, makes every op wait for it (measured 30x slower under load)."""
    if device.type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _certified_float64(
    block64: torch.Tensor,
    padding: torch.Tensor | None,
    q64: torch.Tensor,
    best32: torch.Tensor,
    arg32: torch.Tensor,
    second32: torch.Tensor,
    gemm_bound: torch.Tensor,
    margin: torch.Tensor,
    fixup_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Float64 max, argmax and near-tie flag of every (query row, document) from the float32 pass.

    `block64` [n, width, dim] holds the documents in float64, `q64` [rows, dim] the query rows;
    `best32`, `arg32`, `second32` [rows, n] are the float32 results and `gemm_bound` [rows, n] bounds
    |S32 - S|. Where the float32 gap exceeds 2 * gemm_bound + margin the float32 winner is the float64
    one and the pair is no near-tie: one float64 dot product gives its max. The other pairs are
    recomputed over the whole document. Returns (best64, arg64, near_tie, recomputed pairs), [rows, n].
    """
    n, width, dim = block64.shape
    rows = q64.shape[0]
    device = block64.device
    gap32 = best32.double() - second32.double()  # inf for one-token documents
    certain = gap32 > 2.0 * gemm_bound + margin
    # one dot product per pair, a few documents at a time so the gathered rows stay in cache
    best64 = torch.empty(n, rows, dtype=torch.float64, device=device)
    flat = block64.view(n * width, dim)
    winners = (torch.arange(n, device=device)[:, None] * width + arg32.T).reshape(-1)  # [n * rows]
    per_step = max(1, fixup_bytes // max(1, rows * dim * 8))
    # one buffer reused: fresh multi-MB temporaries per document cost more in page faults than the math
    buffer = torch.empty(min(n, per_step) * rows, dim, dtype=torch.float64, device=device)
    with _one_thread(device):
        for j0 in range(0, n, per_step):
            j1 = min(n, j0 + per_step)
            picked = buffer[: (j1 - j0) * rows]
            torch.index_select(flat, 0, winners[j0 * rows : j1 * rows], out=picked)
            picked = picked.view(j1 - j0, rows, dim)
            picked.mul_(q64)
            torch.sum(picked, dim=2, out=best64[j0:j1])
    best64 = best64.T.contiguous()
    arg64 = arg32.clone()
    tie = torch.zeros(rows, n, dtype=torch.bool, device=device)
    unsure = (~certain).nonzero()
    per_pair = max(1, fixup_bytes // max(1, width * dim * 8))
    for p0 in range(0, unsure.shape[0], per_pair):
        rr, jj = unsure[p0 : p0 + per_pair].unbind(1)
        full = torch.bmm(block64[jj], q64[rr].unsqueeze(2)).squeeze(2)  # [pairs, width]
        top, where, second = _top2(full, None if padding is None else padding[jj])
        best64[rr, jj] = top
        arg64[rr, jj] = where
        tie[rr, jj] = (top - second) <= margin[rr, jj]
    return best64, arg64, tie, int(unsure.shape[0])


def float_reference(
    queries: torch.Tensor,
    query_offsets: np.ndarray,
    docs: torch.Tensor,
    doc_offsets: np.ndarray,
    *,
    sim_error: float,
    doc_scales: torch.Tensor | None = None,
    plain_dtype: torch.dtype | None = None,
) -> FloatReference:
    """Float64 and float32 references of all queries x all documents, in one float32 pass.

    `queries` [Tq, dim] and `docs` [Td, dim] are float tensors on one device (the values the kernel
    sees); `doc_scales` (optional, [Td]) multiplies document tokens exactly in float64 (float32 pass:
    in float32). `sim_error` is the kernel's relative similarity error, which sets the near-tie margin
    ``2 * sim_error * |q_i| * max_j |d_j|``. See the module docstring for why the result equals a
    float64 materialised reference. With `plain_dtype`, also the scores of plain PyTorch at that
    precision (similarities by `torch.mm` in `plain_dtype`, their maxima summed in float32): the
    FlashAttention yardstick's baseline.
    """
    device = docs.device
    tq, dim = queries.shape
    nq = len(query_offsets) - 1
    nd = len(doc_offsets) - 1
    lengths = np.diff(doc_offsets)
    q64 = queries.to(torch.float64)
    q32 = queries.to(torch.float32).contiguous()
    d32 = docs.to(torch.float32)
    if doc_scales is not None:
        d32 = d32 * doc_scales.to(torch.float32)[:, None]
    doc_norm = _segment_max(torch.linalg.vector_norm(d32.double(), dim=1), doc_offsets)  # max_j |d_j|
    q_norm = torch.linalg.vector_norm(q64, dim=1)
    gemm_error = gamma(dim, ACCUMULATION_ROUNDOFF)  # bound on |S32 - S| / (|q_i| |d_j|)
    token_query = torch.from_numpy(np.repeat(np.arange(nq), np.diff(query_offsets))).to(device)

    score64 = torch.zeros(nq, nd, dtype=torch.float64, device=device)
    score32 = torch.zeros(nq, nd, dtype=torch.float32, device=device)
    score_plain = None if plain_dtype is None else torch.zeros(nq, nd, dtype=torch.float32, device=device)
    q_plain = None if plain_dtype is None else queries.to(plain_dtype).contiguous()
    argmax64 = torch.full((tq, nd), -1, dtype=torch.int32, device=device)
    argmax32 = torch.full((tq, nd), -1, dtype=torch.int32, device=device)
    near_tie = torch.zeros(tq, nd, dtype=torch.bool, device=device)
    empty = torch.from_numpy(np.flatnonzero(lengths == 0)).to(device)
    score64[:, empty] = -math.inf  # max over no tokens, as the kernels define it
    score32[:, empty] = -math.inf
    if score_plain is not None:
        score_plain[:, empty] = -math.inf
    recomputed = 0
    if tq == 0 or nd == 0:
        return FloatReference(score64, score32, argmax64, argmax32, near_tie, 0, score_plain)

    cuda = device.type == "cuda"
    sim_elems = _CUDA_SIM_ELEMS if cuda else _CPU_SIM_ELEMS
    fixup_bytes = _CUDA_FIXUP_BYTES if cuda else _CPU_FIXUP_BYTES
    row_cap = _CUDA_QUERY_ROWS if cuda else _CPU_QUERY_ROWS
    rows_per_step = max(1, min(tq, row_cap, sim_elems // max(1, int(lengths.max()))))
    starts = doc_offsets[:-1]
    with _ieee_float32_matmul():
        for group in _length_groups(lengths, rows_per_step, sim_elems):
            n = group.size
            g_lens = lengths[group]
            width = int(g_lens.max())
            pos = np.arange(width)[None, :]
            rows = starts[group, None] + np.minimum(pos, g_lens[:, None] - 1)
            rows_t = torch.from_numpy(rows.reshape(-1)).to(device)
            padded = pos >= g_lens[:, None]  # [n, width]
            padding = torch.from_numpy(padded).to(device) if padded.any() else None
            # -inf into the padded columns only (a full masked pass costs 40x more)
            pad_columns = None if padding is None else torch.from_numpy(np.flatnonzero(padded)).to(device)
            block32 = d32.index_select(0, rows_t)  # [n * width, dim]
            block64 = docs.index_select(0, rows_t).to(torch.float64)
            if doc_scales is not None:
                block64 *= doc_scales.index_select(0, rows_t).to(torch.float64)[:, None]
            cols = torch.from_numpy(group).to(device)
            g_norm = doc_norm[cols]
            for r0 in range(0, tq, rows_per_step):
                r1 = min(tq, r0 + rows_per_step)
                q_rows64 = q64[r0:r1]
                sims = torch.mm(q32[r0:r1], block32.T)
                if pad_columns is not None:
                    sims.index_fill_(1, pad_columns, -math.inf)
                best32, arg32, second32 = _top2(sims.view(r1 - r0, n, width), None)
                del sims
                scale = q_norm[r0:r1, None] * g_norm[None, :]  # |q_i| max_j |d_j|, [rows, n]
                margin = 2.0 * sim_error * scale
                if width <= _FULL_FLOAT64_WIDTH:
                    sims64 = torch.mm(q_rows64, block64.T)
                    if pad_columns is not None:
                        sims64.index_fill_(1, pad_columns, -math.inf)
                    best64, arg64, second64 = _top2(sims64.view(r1 - r0, n, width), None)
                    del sims64
                    tie = (best64 - second64) <= margin
                else:
                    best64, arg64, tie, count = _certified_float64(
                        block64.view(n, width, dim),
                        padding,
                        q_rows64,
                        best32,
                        arg32,
                        second32,
                        gemm_error * scale,
                        margin,
                        fixup_bytes,
                    )
                    recomputed += count
                argmax64[r0:r1, cols] = arg64.to(torch.int32)
                argmax32[r0:r1, cols] = arg32.to(torch.int32)
                near_tie[r0:r1, cols] = tie
                tq_rows = token_query[r0:r1]
                score64[:, cols] += torch.zeros(nq, n, dtype=torch.float64, device=device).index_add_(
                    0, tq_rows, best64
                )
                score32[:, cols] += torch.zeros(nq, n, dtype=torch.float32, device=device).index_add_(
                    0, tq_rows, best32
                )
                if score_plain is not None and q_plain is not None:
                    plain = torch.mm(q_plain[r0:r1], docs.index_select(0, rows_t).to(plain_dtype).T)
                    if pad_columns is not None:
                        plain.index_fill_(1, pad_columns, -math.inf)
                    best_plain = plain.view(r1 - r0, n, width).amax(dim=2).to(torch.float32)
                    del plain
                    score_plain[:, cols] += torch.zeros(nq, n, dtype=torch.float32, device=device).index_add_(
                        0, tq_rows, best_plain
                    )
    return FloatReference(score64, score32, argmax64, argmax32, near_tie, recomputed, score_plain)


# ------------------------------------------------------------------------------------------------------
# Inputs: queries, the scored documents, reading by location
# ------------------------------------------------------------------------------------------------------


def _query_values(batch: DocBatch, corpus_dtype: str, path: str) -> torch.Tensor:
    """Query vectors as the kernel gets them: the corpus's float dtype, or float32 for an int8 corpus."""
    emb = batch.embeddings
    if emb.dtype == torch.int8:
        if batch.scales is None:
            raise InputError(
                f"{path}: int8 queries without per-token scales; re-create them with maxsim pack"
            )
        emb = emb.to(torch.float32) * batch.scales.to(torch.float32)[:, None]
    if corpus_dtype == "int8":
        return emb.to(torch.float32).contiguous()
    return emb.to(getattr(torch, corpus_dtype)).contiguous()


def _read_locations(corpus: Corpus, locations: np.ndarray) -> DocBatch:
    """Documents at (shard, index) `locations` [n, 2], in that order, packed into one batch."""
    n = locations.shape[0]
    order = np.lexsort((locations[:, 1], locations[:, 0]))
    parts: list[DocBatch] = []
    for s in np.unique(locations[:, 0]):
        picked = order[locations[order, 0] == s]
        parts.append(corpus.shards[int(s)].read_doc_indices(locations[picked, 1]))
    if not parts:
        return corpus.shards[0].read_docs(0, 0)
    emb = torch.cat([p.embeddings for p in parts]) if len(parts) > 1 else parts[0].embeddings
    scales = None
    if parts[0].scales is not None:
        scales = torch.cat([p.scales for p in parts]) if len(parts) > 1 else parts[0].scales  # type: ignore[misc]
    ids = [i for p in parts for i in p.ids]
    lengths = np.concatenate([p.lengths().numpy() for p in parts])
    sorted_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if np.array_equal(order, np.arange(n)):
        return DocBatch(ids, emb, torch.from_numpy(sorted_offsets), scales)
    # back to the requested order: document order[k] of the request sits at sorted position k
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    out_lengths = lengths[position]
    out_offsets = np.concatenate([[0], np.cumsum(out_lengths)]).astype(np.int64)
    rows = np.repeat(sorted_offsets[position] - out_offsets[:-1], out_lengths) + np.arange(out_offsets[-1])
    rows_t = torch.from_numpy(rows)
    return DocBatch(
        [ids[p] for p in position],
        emb.index_select(0, rows_t),
        torch.from_numpy(out_offsets),
        None if scales is None else scales.index_select(0, rows_t),
    )


def _locations_of(corpus: Corpus, global_docs: np.ndarray) -> np.ndarray:
    """(shard, index in shard) of corpus-wide document numbers."""
    shard = np.searchsorted(corpus.doc_starts, global_docs, side="right") - 1
    return np.stack([shard, global_docs - corpus.doc_starts[shard]], axis=1).astype(np.int64)


def _batches_of(corpus: Corpus, global_docs: np.ndarray, max_tokens: int) -> Iterator[np.ndarray]:
    """Split sorted corpus-wide document numbers into runs of at most `max_tokens` tokens within one
    shard (a longer document alone)."""
    lengths = np.concatenate([np.diff(s.offsets) for s in corpus.shards])[global_docs]
    shard_of = _locations_of(corpus, global_docs)[:, 0]
    cumulative = np.concatenate([[0], np.cumsum(lengths)])
    start = 0
    while start < global_docs.size:
        shard_end = start + int(np.searchsorted(shard_of[start:], shard_of[start], side="right"))
        stop = int(np.searchsorted(cumulative, cumulative[start] + max_tokens, side="right")) - 1
        stop = min(max(stop, start + 1), shard_end)
        yield global_docs[start:stop]
        start = stop


@dataclass
class _Scored:
    """Per query: the documents scored (corpus-wide numbers), and per pair the numbers being compared."""

    docs: list[np.ndarray]
    kernel: list[np.ndarray]
    ref64: list[np.ndarray]
    ref32: list[np.ndarray] | None
    allowed: list[np.ndarray]  # the per-score default bound B
    quant_ref: list[np.ndarray] | None
    ref_plain: list[np.ndarray] | None = None  # plain PyTorch at the input precision (GPU, 16-bit)

    def flat(self, name: str) -> np.ndarray:
        parts = getattr(self, name)
        return np.concatenate(parts) if parts else np.zeros(0)


class _ArgmaxCounter:
    """Sums argmax agreement over batches and remembers the first real mismatch."""

    def __init__(self) -> None:
        self.pairs = self.near_ties = self.compared = self.agreed = 0
        self.first_mismatch: dict[str, Any] | None = None

    def add(
        self,
        argmax: torch.Tensor,
        reference: torch.Tensor,
        near_tie: torch.Tensor | None,
        describe: Any = None,
    ) -> None:
        """`argmax`, `reference`, `near_tie`: [query tokens, documents]; -1 in `reference` is padding."""
        argmax = argmax.to(reference.device)
        valid = reference >= 0
        judged = valid if near_tie is None else valid & ~near_tie
        agree = judged & (argmax == reference)
        self.pairs += int(valid.sum())
        self.compared += int(judged.sum())
        self.agreed += int(agree.sum())
        if near_tie is not None:
            self.near_ties += int((valid & near_tie).sum())
        if self.first_mismatch is None and describe is not None:
            bad = (judged & ~agree).nonzero()
            if bad.shape[0]:
                token, doc = (int(x) for x in bad[0])
                self.first_mismatch = describe(
                    token, doc, int(argmax[token, doc]), int(reference[token, doc])
                )

    def stats(self) -> ArgmaxStats:
        return ArgmaxStats(
            pairs=self.pairs,
            near_ties=self.near_ties,
            compared=self.compared,
            agreed=self.agreed,
            mismatches=self.compared - self.agreed,
            agreement=self.agreed / self.compared if self.compared else 1.0,
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dequantized_norms(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """|x_t| per token in float64 (int8 tokens dequantized with their scales)."""
    norms = torch.linalg.vector_norm(values.to(torch.float64), dim=1)
    return norms if scales is None else norms * scales.to(torch.float64).abs()


# ------------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------------


@dataclass
class _Context:
    """What every batch needs: the queries on the device, the options, the bounds' ingredients."""

    device: torch.device
    backend: str
    allow_tf32: bool
    int8: bool
    sim_error: float
    queries: torch.Tensor  # [Tq, dim] on the device, in the kernel's input dtype
    query_offsets: np.ndarray
    query_ids: list[str]
    query_norm_sum: np.ndarray  # sum_i |q_i| per query (int8: dequantized), float64
    score_factor: np.ndarray  # e_sim + gamma_Lq per query (int8: 2u + gamma_Lq)
    reference_corpus: Corpus | None
    reference_queries: torch.Tensor | None


def _kernel(
    ctx: _Context,
    queries: torch.Tensor,
    query_offsets: np.ndarray,
    batch: DocBatch,
    candidates: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel on the device: scores and argmax, exactly as `maxsim score` calls it."""
    import maxsim_kernels

    dev = ctx.device
    kwargs: dict[str, Any] = dict(
        return_argmax=True,
        allow_tf32=ctx.allow_tf32,
        backend=ctx.backend,
        doc_scales=None if batch.scales is None else batch.scales.to(dev),
    )
    args = (
        queries,
        torch.from_numpy(query_offsets).to(dev),
        batch.embeddings.to(dev),
        batch.offsets.to(dev),
    )
    try:
        if candidates is None:
            scores, argmax = maxsim_kernels.maxsim_varlen(*args, **kwargs)
        else:
            c_off, c_docs = (torch.from_numpy(x).to(dev) for x in candidates)
            scores, argmax = maxsim_kernels.maxsim_candidates(*args, c_off, c_docs, **kwargs)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise MaxsimError(f"the kernel refused the inputs: {exc}") from None
    _sync(dev)
    return scores, argmax


def _plain_dtype(queries: torch.Tensor, device: torch.device) -> torch.dtype | None:
    """The precision of the yardstick's plain PyTorch baseline, where it differs from float32.

    On a GPU, 16-bit inputs go through the tensor cores, whose fp32 accumulation of fp16/bf16 products
    does not round like IEEE float32 sums; the FlashAttention rule therefore measures a fused kernel
    against plain PyTorch at the same low precision. On the CPU both the kernel and the float32
    reference sum in IEEE float32, so the float32 reference is the baseline there.
    """
    if device.type == "cuda" and queries.dtype in (torch.float16, torch.bfloat16):
        return queries.dtype
    return None


def _reference(
    ctx: _Context, queries: torch.Tensor, query_offsets: np.ndarray, batch: DocBatch
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, FloatReference | None]:
    """(float64 scores, float32 scores, argmax, near-tie mask, float pass) of queries x batch."""
    dev = ctx.device
    docs = batch.embeddings.to(dev)
    if ctx.int8:
        from maxsim_kernels.maxsim_int8 import maxsim_int8_reference

        assert batch.scales is not None
        score64, argmax = maxsim_int8_reference(
            queries,
            torch.from_numpy(query_offsets),
            docs,
            batch.offsets.to(dev),
            doc_scales=batch.scales.to(dev),
            return_argmax=True,
        )
        return score64, None, argmax, None, None
    ref = float_reference(
        queries, query_offsets, docs, batch.offsets.numpy(), sim_error=ctx.sim_error,
        plain_dtype=_plain_dtype(queries, dev),
    )  # fmt: skip
    return ref.score64, ref.score32, ref.argmax64, ref.near_tie, ref


def _exact_float_scores(
    ctx: _Context, corpus: Corpus, doc_ids: Sequence[str], query_rows: np.ndarray, query_offsets: np.ndarray
) -> np.ndarray:
    """float64 scores of the reference corpus's documents `doc_ids` (quantization impact)."""
    assert ctx.reference_queries is not None
    index = corpus.candidate_index(doc_ids)
    try:
        locations = np.array([index[i] for i in doc_ids], dtype=np.int64).reshape(-1, 2)
    except KeyError as exc:
        raise InputError(
            f"{corpus.paths[0]}: document {exc.args[0]} is not in the reference corpus; "
            "--reference-corpus must hold every scored document (the shards the int8 ones came from)"
        ) from None
    batch = _read_locations(corpus, locations)
    queries = ctx.reference_queries[torch.from_numpy(query_rows).to(ctx.device)]
    ref = float_reference(
        queries, query_offsets, batch.embeddings.to(ctx.device), batch.offsets.numpy(), sim_error=0.0
    )
    return ref.score64.cpu().numpy()


def _score_factor(query_offsets: np.ndarray, base: float) -> np.ndarray:
    return np.array([base + gamma(int(n)) for n in np.diff(query_offsets)], dtype=np.float64)


def _rows_of(query_offsets: np.ndarray, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token rows of the chosen queries and their packed offsets."""
    lengths = np.diff(query_offsets)[chosen]
    rows = (
        np.concatenate([np.arange(query_offsets[q], query_offsets[q + 1]) for q in chosen])
        if len(chosen)
        else np.zeros(0, dtype=np.int64)
    )
    return rows.astype(np.int64), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _score_all_pairs(
    ctx: _Context, corpus: Corpus, selection: np.ndarray, max_tokens: int, counters: dict[str, Any]
) -> _Scored:
    """Every query against the selected documents (corpus-wide numbers), batch by batch."""
    nq = len(ctx.query_ids)
    n = selection.size
    kernel = np.zeros((nq, n))
    ref64 = np.zeros((nq, n))
    ref32 = None if ctx.int8 else np.zeros((nq, n))
    ref_plain: np.ndarray | None = None
    quant = None if ctx.reference_corpus is None else np.zeros((nq, n))
    allowed = np.zeros((nq, n))
    all_rows = np.arange(ctx.queries.shape[0])
    token_query = np.repeat(np.arange(nq), np.diff(ctx.query_offsets))
    token_local = all_rows - ctx.query_offsets[token_query]
    col = 0
    for docs in _batches_of(corpus, selection, max_tokens):
        batch = _read_locations(corpus, _locations_of(corpus, docs))
        cols = slice(col, col + docs.size)
        t0 = time.perf_counter()
        k_scores, k_arg = _kernel(ctx, ctx.queries, ctx.query_offsets, batch)
        t1 = time.perf_counter()
        score64, score32, r_arg, near_tie, fref = _reference(ctx, ctx.queries, ctx.query_offsets, batch)
        _sync(ctx.device)
        t2 = time.perf_counter()
        counters["kernel_s"] += t1 - t0
        counters["reference_s"] += t2 - t1
        kernel[:, cols] = k_scores.double().cpu().numpy()
        ref64[:, cols] = score64.cpu().numpy()
        if ref32 is not None and score32 is not None:
            ref32[:, cols] = score32.double().cpu().numpy()
        if fref is not None and fref.score_plain is not None:
            if ref_plain is None:
                ref_plain = np.zeros((nq, n))
            ref_plain[:, cols] = fref.score_plain.double().cpu().numpy()
        doc_norm = _segment_max(_dequantized_norms(batch.embeddings, batch.scales), batch.offsets.numpy())
        allowed[:, cols] = (ctx.score_factor * ctx.query_norm_sum)[:, None] * doc_norm.numpy()[None, :]
        ids = batch.ids

        def describe(token: int, doc: int, got: int, want: int, ids: list[str] = ids) -> dict[str, Any]:
            q = int(token_query[token])
            return {
                "qid": ctx.query_ids[q],
                "query_token": int(token_local[token]),
                "docno": ids[doc],
                "kernel_argmax": got,
                "reference_argmax": want,
            }

        counters["argmax"].add(k_arg, r_arg, near_tie, describe)
        if fref is not None:
            counters["float32_argmax"].add(fref.argmax32, fref.argmax64, fref.near_tie)
            counters["recomputed"] += fref.recomputed
        if quant is not None:
            t3 = time.perf_counter()
            quant[:, cols] = _exact_float_scores(
                ctx, ctx.reference_corpus, batch.ids, all_rows, ctx.query_offsets
            )
            counters["quantization_s"] += time.perf_counter() - t3
        col += docs.size
    return _Scored(
        docs=[selection] * nq,
        kernel=list(kernel),
        ref64=list(ref64),
        ref32=None if ref32 is None else list(ref32),
        allowed=list(allowed),
        quant_ref=None if quant is None else list(quant),
        ref_plain=None if ref_plain is None else list(ref_plain),
    )


def _score_candidates(
    ctx: _Context,
    corpus: Corpus,
    per_query: list[np.ndarray],
    max_tokens: int,
    counters: dict[str, Any],
) -> _Scored:
    """Each query against its own candidates (corpus-wide numbers), queries grouped under `max_tokens`."""
    nq = len(ctx.query_ids)
    lengths = np.concatenate([np.diff(s.offsets) for s in corpus.shards])
    out_kernel: list[np.ndarray] = [np.zeros(0)] * nq
    out64: list[np.ndarray] = [np.zeros(0)] * nq
    out32: list[np.ndarray] = [np.zeros(0)] * nq
    out_plain: list[np.ndarray] = [np.zeros(0)] * nq
    has_plain = False
    outq: list[np.ndarray] = [np.zeros(0)] * nq
    allowed: list[np.ndarray] = [np.zeros(0)] * nq
    q = 0
    while q < nq:
        # a group of consecutive queries whose distinct candidates fit the token budget
        group = [q]
        pool = set(per_query[q].tolist())
        q += 1
        while q < nq:
            grown = pool | set(per_query[q].tolist())
            if int(lengths[np.fromiter(grown, np.int64)].sum()) > max_tokens:
                break
            pool = grown
            group.append(q)
            q += 1
        pool_docs = np.array(sorted(pool), dtype=np.int64)
        batch = _read_locations(corpus, _locations_of(corpus, pool_docs))
        chosen = np.array(group)
        rows, g_offsets = _rows_of(ctx.query_offsets, chosen)
        queries = ctx.queries[torch.from_numpy(rows).to(ctx.device)]
        cand = [np.searchsorted(pool_docs, per_query[g]) for g in group]
        c_off = np.concatenate([[0], np.cumsum([c.size for c in cand])]).astype(np.int64)
        c_docs = np.concatenate(cand).astype(np.int64) if cand else np.zeros(0, np.int64)
        t0 = time.perf_counter()
        k_scores, k_arg = _kernel(ctx, queries, g_offsets, batch, (c_off, c_docs))
        counters["kernel_s"] += time.perf_counter() - t0
        k_scores = k_scores.double().cpu().numpy()
        pool_offsets = batch.offsets.numpy()
        doc_norm = _segment_max(_dequantized_norms(batch.embeddings, batch.scales), pool_offsets).numpy()
        for i, g in enumerate(group):
            picked = cand[i]
            if picked.size == 0:
                continue
            sub = _subset(batch, picked)
            q_rows = np.arange(g_offsets[i], g_offsets[i + 1])
            q_off = np.array([0, q_rows.size], dtype=np.int64)
            q_vals = queries[torch.from_numpy(q_rows).to(ctx.device)]
            t1 = time.perf_counter()
            score64, score32, r_arg, near_tie, fref = _reference(ctx, q_vals, q_off, sub)
            _sync(ctx.device)
            counters["reference_s"] += time.perf_counter() - t1
            out_kernel[g] = k_scores[c_off[i] : c_off[i + 1]]
            out64[g] = score64[0].cpu().numpy()
            if score32 is not None:
                out32[g] = score32[0].double().cpu().numpy()
            if fref is not None and fref.score_plain is not None:
                out_plain[g] = fref.score_plain[0].double().cpu().numpy()
                has_plain = True
            allowed[g] = ctx.score_factor[g] * ctx.query_norm_sum[g] * doc_norm[picked]
            kernel_arg = k_arg[c_off[i] : c_off[i + 1], : q_rows.size].T
            ids = sub.ids

            def describe(
                token: int, doc: int, got: int, want: int, ids: list[str] = ids, g: int = g
            ) -> dict[str, Any]:
                return {
                    "qid": ctx.query_ids[g],
                    "query_token": token,
                    "docno": ids[doc],
                    "kernel_argmax": got,
                    "reference_argmax": want,
                }

            counters["argmax"].add(kernel_arg, r_arg, near_tie, describe)
            if fref is not None:
                counters["float32_argmax"].add(fref.argmax32, fref.argmax64, fref.near_tie)
                counters["recomputed"] += fref.recomputed
            if ctx.reference_corpus is not None:
                t3 = time.perf_counter()
                outq[g] = _exact_float_scores(
                    ctx, ctx.reference_corpus, sub.ids, np.arange(*ctx.query_offsets[g : g + 2]), q_off
                )[0]
                counters["quantization_s"] += time.perf_counter() - t3
    return _Scored(
        docs=per_query,
        kernel=out_kernel,
        ref64=out64,
        ref32=None if ctx.int8 else out32,
        allowed=allowed,
        quant_ref=None if ctx.reference_corpus is None else outq,
        ref_plain=out_plain if has_plain else None,
    )


def _subset(batch: DocBatch, picked: np.ndarray) -> DocBatch:
    """Documents `picked` of a batch, packed, in that order."""
    offsets = batch.offsets.numpy()
    lengths = offsets[picked + 1] - offsets[picked]
    out_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = torch.from_numpy(
        np.repeat(offsets[picked] - out_offsets[:-1], lengths) + np.arange(out_offsets[-1])
    )
    return DocBatch(
        [batch.ids[i] for i in picked],
        batch.embeddings.index_select(0, rows),
        torch.from_numpy(out_offsets),
        None if batch.scales is None else batch.scales.index_select(0, rows),
    )


def sample_documents(num_docs: int, count: int, seed: int) -> np.ndarray:
    """`count` distinct corpus-wide document numbers drawn uniformly with `seed`, sorted (all if fewer)."""
    if count >= num_docs:
        return np.arange(num_docs, dtype=np.int64)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(num_docs, size=count, replace=False)).astype(np.int64)


def _select_candidates(
    path: str, corpus: Corpus, query_ids: list[str], queries_path: str
) -> tuple[list[np.ndarray], int, int]:
    """Per query, the corpus-wide numbers of its candidates (in run order); how many queries have none;
    how many candidates are not in the corpus (left out, as `maxsim score` leaves them out)."""
    run = read_run(path)
    position = {qid: q for q, qid in enumerate(query_ids)}
    unknown = next((qid for qid in run if qid not in position), None)
    if unknown is not None:
        raise InputError(
            f"{path}: query {unknown} is not in {queries_path}; the run must use the query file's ids"
        )
    index = corpus.candidate_index(docno for rows in run.values() for docno, _ in rows)
    per_query = [np.zeros(0, dtype=np.int64)] * len(query_ids)
    missing = 0
    for qid, rows in run.items():
        found = [index.get(docno) for docno, _ in rows]
        missing += sum(1 for w in found if w is None)
        numbers = [corpus.doc_starts[w[0]] + w[1] for w in found if w is not None]
        per_query[position[qid]] = np.array(numbers, dtype=np.int64)
    skipped = sum(1 for p in per_query if p.size == 0)
    return per_query, skipped, missing


def _gradient_check(
    ctx: _Context, corpus: Corpus, scored: _Scored, seed: int, dtype_key: str
) -> tuple[dict[str, Any], Check]:
    """`maxsim_kernels.maxsim_backward.gradient_check` on a seeded sample of queries x scored documents."""
    try:
        from maxsim_kernels.maxsim_backward import gradient_check
    except ImportError as exc:
        raise MaxsimError(f"--grad needs maxsim_kernels.maxsim_backward.gradient_check: {exc}") from None
    rng = np.random.default_rng(seed)
    with_docs = [q for q, d in enumerate(scored.docs) if d.size]
    chosen = np.sort(rng.choice(with_docs, size=min(GRAD_QUERIES, len(with_docs)), replace=False))
    pool = np.unique(np.concatenate([scored.docs[q] for q in chosen]))
    docs = np.sort(rng.choice(pool, size=min(GRAD_DOCS, pool.size), replace=False))
    batch = _read_locations(corpus, _locations_of(corpus, docs))
    rows, offsets = _rows_of(ctx.query_offsets, chosen)
    dev = ctx.device
    try:
        result = gradient_check(
            ctx.queries[torch.from_numpy(rows).to(dev)],
            torch.from_numpy(offsets).to(dev),
            batch.embeddings.to(dev),
            batch.offsets.to(dev),
            doc_scales=None if batch.scales is None else batch.scales.to(dev),
            seed=seed,
            allow_tf32=ctx.allow_tf32,
            backend=ctx.backend,
        )
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise MaxsimError(f"the gradient check refused the inputs: {exc}") from None
    bound = GRAD_TOLERANCE[dtype_key]
    errors = [result["dq_rel_error"]]
    if result["dd_rel_error"] is not None:
        errors.append(result["dd_rel_error"])
    repeatable = bool(result["bitwise_repeatable"])
    result = {**result, "queries": int(chosen.size), "docs": int(docs.size), "tolerance": bound}
    dd = "n/a (int8 documents)" if result["dd_rel_error"] is None else f"{result['dd_rel_error']:.2e}"
    detail = (
        f"|dQ - ref|/|ref| = {result['dq_rel_error']:.2e}, |dD - ref|/|ref| = {dd} (bound {bound:.0e}); "
        f"bitwise repeatable: {'yes' if repeatable else 'NO'}; {chosen.size} queries x {docs.size} documents"
    )
    if dtype_key == "int8":
        # The gradient check's float64 reference takes its argmax from the float queries, the kernel from
        # the quantized ones: the errors include quantization, so only repeatability is judged.
        result["errors_judged"] = False
        return result, Check("gradients", repeatable, detail + "; int8: errors reported, not judged")
    result["errors_judged"] = True
    return result, Check("gradients", repeatable and all(e <= bound for e in errors), detail)


def verify(
    queries: str,
    corpus: Sequence[str],
    *,
    sample_docs: int | None = None,
    seed: int = 0,
    candidates: str | None = None,
    device: str = "auto",
    backend: str = "auto",
    allow_tf32: bool = False,
    tolerances: Tolerances | None = None,
    reference_corpus: Sequence[str] | None = None,
    grad: bool = False,
    max_tokens: int = DEFAULT_BATCH_TOKENS,
) -> VerifyReport:
    """Score the queries against (a sample of, or the run candidates of) the corpus with the fused kernel
    and with the independent reference; return the report and its verdict (see the module docstring)."""
    started = time.perf_counter()
    tol = tolerances or Tolerances()
    if sample_docs is not None and candidates is not None:
        raise UsageError("--sample-docs and --candidates exclude each other: verify a sample or a run")
    if queries == "-" and candidates == "-":
        raise UsageError("queries and --candidates both read stdin; give one of them as a file")
    if sample_docs is not None and sample_docs < 1:
        raise UsageError(f"--sample-docs {sample_docs}: give a positive number of documents")
    for name, value in (("--atol", tol.atol), ("--rtol", tol.rtol)):
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise UsageError(f"{name} {value}: give a finite number >= 0")
    for name, value in (
        ("--min-overlap", tol.min_overlap),
        ("--min-argmax-agreement", tol.min_argmax_agreement),
    ):
        if value is not None and not 0.0 <= value <= 1.0:
            raise UsageError(f"{name} {value}: give a fraction between 0 and 1")
    if max_tokens < 1:
        raise UsageError(f"--batch-tokens {max_tokens}: give a positive number of tokens")
    dev = resolve_device(device)
    chosen_backend = check_backend_option(backend, dev)
    if chosen_backend == "auto":  # the report names the backend that actually ran
        chosen_backend = "triton" if dev.type == "cuda" else "torch"

    qbatch = read_queries(queries)
    docs_corpus = open_corpus(list(corpus))
    ref_corpus = open_corpus(list(reference_corpus)) if reference_corpus else None
    try:
        if qbatch.num_docs == 0:
            raise InputError(f"{queries}: no queries")
        if qbatch.embeddings.shape[1] != docs_corpus.dim:
            raise InputError(
                f"{queries}: queries have dim {qbatch.embeddings.shape[1]} but the corpus "
                f"{docs_corpus.paths[0]} has dim {docs_corpus.dim}; use queries from the same encoder"
            )
        if ref_corpus is not None and ref_corpus.dim != docs_corpus.dim:
            raise InputError(
                f"{ref_corpus.paths[0]}: reference corpus has dim {ref_corpus.dim} but the corpus "
                f"{docs_corpus.paths[0]} has dim {docs_corpus.dim}; give the shards it was made from"
            )
        if ref_corpus is not None and ref_corpus.dtype == "int8":
            raise InputError(
                f"{ref_corpus.paths[0]}: the reference corpus is int8; --reference-corpus takes float shards"
            )
        return _verify(
            queries, qbatch, docs_corpus, ref_corpus, sample_docs, seed, candidates, dev, chosen_backend,
            allow_tf32, tol, grad, max_tokens, started,
        )  # fmt: skip
    finally:
        docs_corpus.close()
        if ref_corpus is not None:
            ref_corpus.close()


def _verify(
    queries_path: str,
    qbatch: DocBatch,
    corpus: Corpus,
    ref_corpus: Corpus | None,
    sample_docs: int | None,
    seed: int,
    candidates: str | None,
    dev: torch.device,
    backend: str,
    allow_tf32: bool,
    tol: Tolerances,
    grad: bool,
    max_tokens: int,
    started: float,
) -> VerifyReport:
    int8 = corpus.dtype == "int8"
    dim = corpus.dim
    q_values = _query_values(qbatch, corpus.dtype, queries_path)
    q_offsets = qbatch.offsets.numpy().astype(np.int64)
    nq = qbatch.num_docs
    sim_error = 0.0 if int8 else similarity_error(corpus.dtype, dim, allow_tf32)
    if int8:
        from maxsim_kernels.maxsim_int8 import quantize_per_token

        codes, q_scales = quantize_per_token(q_values, backend="torch")
        q_norms = _dequantized_norms(codes, q_scales)
        base = 2.0 * UNIT_ROUNDOFF
    else:
        q_norms = _dequantized_norms(q_values, None)
        base = sim_error
    norm_sum = np.add.reduceat(q_norms.numpy(), q_offsets[:-1]) if q_norms.numel() else np.zeros(nq)
    ref_queries = None
    if ref_corpus is not None:
        ref_queries = _query_values(qbatch, ref_corpus.dtype, queries_path).to(dev)
    ctx = _Context(
        device=dev,
        backend=backend,
        allow_tf32=allow_tf32,
        int8=int8,
        sim_error=sim_error,
        queries=q_values.to(dev),
        query_offsets=q_offsets,
        query_ids=list(qbatch.ids),
        query_norm_sum=norm_sum,
        score_factor=_score_factor(q_offsets, base),
        reference_corpus=ref_corpus,
        reference_queries=ref_queries,
    )
    counters: dict[str, Any] = {
        "kernel_s": 0.0,
        "reference_s": 0.0,
        "quantization_s": 0.0,
        "recomputed": 0,
        "argmax": _ArgmaxCounter(),
        "float32_argmax": _ArgmaxCounter(),
    }
    skipped = missing = 0
    if candidates is not None:
        mode = "candidates"
        per_query, skipped, missing = _select_candidates(candidates, corpus, ctx.query_ids, queries_path)
        pairs = int(sum(p.size for p in per_query))
        if pairs == 0:
            raise InputError(
                f"{candidates}: no candidate of any query of {queries_path} is in the corpus "
                f"{corpus.paths[0]}; verify the run against the corpus it was made for"
            )
    else:
        if sample_docs is not None and sample_docs < corpus.num_docs:
            mode = "sample"
            selection = sample_documents(corpus.num_docs, sample_docs, seed)
        else:
            mode = "all"
            selection = np.arange(corpus.num_docs, dtype=np.int64)
        pairs = nq * selection.size
    if pairs > MAX_SCORES:
        raise UsageError(
            f"{pairs:,} scores ({nq} queries x documents) is more than verify keeps in memory "
            f"({MAX_SCORES:,}); pass --sample-docs N (a seeded sample) or fewer queries"
        )
    setup_s = time.perf_counter() - started
    if candidates is not None:
        scored = _score_candidates(ctx, corpus, per_query, max_tokens, counters)
    else:
        scored = _score_all_pairs(ctx, corpus, selection, max_tokens, counters)

    # ---- statistics ----
    kernel_flat = scored.flat("kernel")
    ref_flat = scored.flat("ref64")
    allowed_flat = scored.flat("allowed")
    kernel_errors = score_errors(kernel_flat, ref_flat)
    float32_errors = None if scored.ref32 is None else score_errors(scored.flat("ref32"), ref_flat)
    plain_errors = None if scored.ref_plain is None else score_errors(scored.flat("ref_plain"), ref_flat)
    baseline_name = "float32 reference" if plain_errors is None else f"plain {corpus.dtype} PyTorch"
    baseline_errors = float32_errors if plain_errors is None else plain_errors
    user_rule = tol.atol is not None or tol.rtol is not None
    if user_rule:
        atol, rtol = tol.atol or 0.0, tol.rtol or 0.0
        rule = f"|kernel - float64| <= {atol:g} + {rtol:g} |float64|"
        per_query_tol = [atol + rtol * np.abs(r) for r in scored.ref64]
        tolerance = tolerance_check(kernel_flat, ref_flat, atol, rtol)
        max_allowed = float(np.max(atol + rtol * np.abs(ref_flat))) if ref_flat.size else atol
    else:
        factor = "2u + gamma_Lq" if int8 else "e_sim + gamma_Lq"
        rule = f"|kernel - float64| <= B(q, d) = ({factor}) max_j|d_j| sum_i|q_i| (docs/verify.md)"
        per_query_tol = scored.allowed
        tolerance = tolerance_check(kernel_flat, ref_flat, allowed_flat, 0.0)
        max_allowed = float(allowed_flat.max()) if allowed_flat.size else 0.0
    max_items = max((d.size for d in scored.docs), default=0)
    ks = [k for k in OVERLAP_KS if k < max_items] or [OVERLAP_KS[0]]
    judged = [q for q, d in enumerate(scored.docs) if d.size]
    ranking = ranking_agreement(
        [scored.kernel[q] for q in judged],
        [scored.ref64[q] for q in judged],
        ks,
        tolerance=[per_query_tol[q] for q in judged],
        tau_depth=TAU_DEPTH,
    )
    argmax = counters["argmax"].stats()
    float32_argmax = None if int8 else counters["float32_argmax"].stats()
    worst = None
    if tolerance.worst_index >= 0:
        q_of_pair = np.repeat(np.arange(nq), [d.size for d in scored.docs])
        first_pair = np.concatenate([[0], np.cumsum([d.size for d in scored.docs])])
        i = tolerance.worst_index
        q = int(q_of_pair[i])
        doc = int(scored.docs[q][i - first_pair[q]])
        shard, local = _locations_of(corpus, np.array([doc]))[0]
        worst = {
            "qid": ctx.query_ids[q],
            "docno": corpus.shards[int(shard)].ids[int(local)],
            "kernel": float(kernel_flat[i]),
            "reference": float(ref_flat[i]),
            "abs_error": float(abs(kernel_flat[i] - ref_flat[i])),
            "allowed": float(
                per_query_tol[q] if np.ndim(per_query_tol[q]) == 0 else per_query_tol[q][i - first_pair[q]]
            ),
        }

    # ---- verdict ----
    checks: list[Check] = []
    checks.append(
        Check(
            "scores",
            tolerance.violations == 0,
            f"{tolerance.violations:,} of {kernel_flat.size:,} scores outside the tolerance "
            f"(worst at {tolerance.worst:.3g} of its bound)",
        )
    )
    yardstick_applies = float32_errors is not None and not (allow_tf32 and corpus.dtype == "float32")
    if yardstick_applies and not user_rule:
        assert baseline_errors is not None
        floor = (
            YARDSTICK_FLOOR_ULPS
            * UNIT_ROUNDOFF
            * float(np.max(np.abs(ref_flat[np.isfinite(ref_flat)]), initial=0.0))
        )
        limit = YARDSTICK_FACTOR * max(baseline_errors.max_abs, floor)
        checks.append(
            Check(
                "yardstick",
                kernel_errors.max_abs <= limit,
                f"kernel max |error| {kernel_errors.max_abs:.3g} <= {YARDSTICK_FACTOR:g} x {baseline_name} "
                f"{baseline_errors.max_abs:.3g} (floor {floor:.3g})",
            )
        )
    checks.append(
        Check(
            "argmax",
            argmax.agreement >= tol.min_argmax_agreement,
            f"{argmax.agreed:,} of {argmax.compared:,} (query token, document) pairs agree "
            f"({argmax.near_ties:,} near-ties excluded); at least {tol.min_argmax_agreement:g} required",
        )
    )
    min_overlap = 1.0 if tol.min_overlap is None else tol.min_overlap
    assert ranking.overlap_within is not None
    worst_k = min(ranking.overlap_within, key=lambda k: ranking.overlap_within[k].min)  # type: ignore[index]
    checks.append(
        Check(
            "ranking",
            all(s.min >= min_overlap for s in ranking.overlap_within.values()),
            f"each query's top-k is a reference top-k within tolerance: least overlap "
            f"{ranking.overlap_within[worst_k].min:.4f} at k={worst_k} (required {min_overlap:g})",
        )
    )
    k_nonfinite = nonfinite_counts(kernel_flat)
    r_nonfinite = nonfinite_counts(ref_flat)
    checks.append(
        Check(
            "non-finite",
            kernel_errors.nonfinite_mismatches == 0,
            f"kernel NaN {k_nonfinite.nan}, Inf {k_nonfinite.inf}; reference NaN {r_nonfinite.nan}, "
            f"Inf {r_nonfinite.inf}; {kernel_errors.nonfinite_mismatches} unmatched",
        )
    )
    quantization = None
    if scored.quant_ref is not None:
        assert ref_corpus is not None
        q_min = QUANTIZATION_MIN_OVERLAP if tol.min_overlap is None else tol.min_overlap
        q_ranking = ranking_agreement(
            [scored.kernel[q] for q in judged],
            [scored.quant_ref[q] for q in judged],
            ks,
            tau_depth=TAU_DEPTH,
        )
        quantization = Quantization(
            reference_corpus=ref_corpus.paths,
            reference_dtype=ref_corpus.dtype,
            errors=score_errors(kernel_flat, scored.flat("quant_ref")),
            ranking=q_ranking,
            min_overlap=q_min,
        )
        low_k = min(q_ranking.overlap, key=lambda k: q_ranking.overlap[k].mean)
        checks.append(
            Check(
                "quantization",
                all(s.mean >= q_min for s in q_ranking.overlap.values()),
                f"mean top-k overlap with the exact float scores {q_ranking.overlap[low_k].mean:.4f} at "
                f"k={low_k} (required {q_min:g})",
            )
        )
    grad_result = None
    grad_s = 0.0
    if grad:
        t0 = time.perf_counter()
        key = "tf32" if allow_tf32 and corpus.dtype == "float32" else corpus.dtype
        grad_result, grad_check = _gradient_check(ctx, corpus, scored, seed, key)
        checks.append(grad_check)
        grad_s = time.perf_counter() - t0

    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    setup = {
        "queries": queries_path,
        "corpus": corpus.paths,
        "mode": mode,
        "candidates": candidates,
        "sample_docs": sample_docs if mode == "sample" else None,
        "seed": seed,
        "num_queries": len(judged),
        "queries_without_candidates": skipped,
        "candidates_not_in_corpus": missing,
        "num_docs": int(np.unique(np.concatenate(scored.docs)).size) if scored.docs else 0,
        "corpus_docs": corpus.num_docs,
        "pairs": int(kernel_flat.size),
        "dtype": corpus.dtype,
        "dim": dim,
        "device": str(dev),
        "device_name": device_name,
        "backend": backend,
        "allow_tf32": allow_tf32,
        "similarity_error": sim_error,
        "recomputed_pairs": counters["recomputed"],
        "torch": torch.__version__,
    }
    near_tie_margin = (
        "0: int8 kernel and reference round the same fp32 products and break ties to the lowest index"
        if int8
        else f"2 x {sim_error:.3g} x |q_i| max_j |d_j|"
    )
    timings = {
        "setup": setup_s,
        "kernel": counters["kernel_s"],
        "reference": counters["reference_s"],
        "quantization": counters["quantization_s"],
        "grad": grad_s,
        "total": time.perf_counter() - started,
    }
    return VerifyReport(
        setup=setup,
        kernel_errors=kernel_errors,
        float32_errors=float32_errors,
        tolerance=tolerance,
        tolerance_rule=rule,
        max_allowed=max_allowed,
        argmax=argmax,
        float32_argmax=float32_argmax,
        near_tie_margin=near_tie_margin,
        ranking=ranking,
        nonfinite_kernel=k_nonfinite,
        nonfinite_reference=r_nonfinite,
        worst=worst,
        first_argmax_mismatch=counters["argmax"].first_mismatch,
        quantization=quantization,
        grad=grad_result,
        checks=checks,
        timings=timings,
    )

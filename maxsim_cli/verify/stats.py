"""Statistics of `maxsim verify`: the numbers compared per scored pair, accumulators over batches, and the
error and ranking statistics the checks judge. Pure computations over tensors and arrays (no file I/O)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from maxsim_cli.agreement import (
    ArgmaxStats,
    ErrorStats,
    NonFinite,
    RankingStats,
    nonfinite_counts,
    ranking_agreement,
    score_errors,
)

OVERLAP_KS = (10, 100, 1000)
TAU_DEPTH = 1000  # Kendall tau-b over each query's top TAU_DEPTH reference documents


def segment_max(values: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    """Max of `values` over each segment [offsets[k], offsets[k+1]) (0 for an empty segment)."""
    lengths = torch.from_numpy(np.diff(offsets)).to(values.device)
    if values.numel() == 0:
        return torch.zeros(lengths.numel(), dtype=values.dtype, device=values.device)
    return torch.segment_reduce(values, "max", lengths=lengths, unsafe=True).nan_to_num(0.0, 0.0, 0.0)


def dequantized_norms(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """|x_t| per token in float64 (int8 tokens dequantized with their scales)."""
    norms = torch.linalg.vector_norm(values.to(torch.float64), dim=1)
    return norms if scales is None else norms * scales.to(torch.float64).abs()


@dataclass
class Scored:
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


@dataclass
class Counters:
    """What the batches add up: time in the kernel, the reference and the quantization reference; argmax
    agreement of the kernel and of the float32 reference; pairs whose float64 max was recomputed."""

    kernel_s: float = 0.0
    reference_s: float = 0.0
    quantization_s: float = 0.0
    recomputed: int = 0
    argmax: _ArgmaxCounter = field(default_factory=_ArgmaxCounter)
    float32_argmax: _ArgmaxCounter = field(default_factory=_ArgmaxCounter)
    total_pairs: int = 0  # pairs planned
    done_pairs: int = 0  # pairs scored both ways so far
    progress: Callable[[int, int], None] | None = None  # told (done_pairs, total_pairs) after each batch

    def advance(self, pairs: int) -> None:
        """Count ``pairs`` more scored, and tell `progress`."""
        self.done_pairs += pairs
        if self.progress is not None:
            self.progress(self.done_pairs, self.total_pairs)


@dataclass
class ScoreStats:
    """Per-score errors against the float64 reference, over every scored pair (flattened query by query)."""

    kernel: np.ndarray  # kernel scores
    reference: np.ndarray  # float64 reference scores
    kernel_errors: ErrorStats
    float32_errors: ErrorStats | None  # the float32 reference's own error (None for int8)
    # The yardstick's baseline: plain PyTorch at the input precision where the reference computed it
    # (GPU, 16-bit inputs), else the float32 reference.
    baseline_name: str
    baseline_errors: ErrorStats | None
    nonfinite_kernel: NonFinite
    nonfinite_reference: NonFinite


def score_statistics(scored: Scored, dtype: str) -> ScoreStats:
    """Errors of the kernel (and of the float32 and plain references) against float64; NaN/Inf counts."""
    kernel_flat = scored.flat("kernel")
    ref_flat = scored.flat("ref64")
    kernel_errors = score_errors(kernel_flat, ref_flat)
    float32_errors = None if scored.ref32 is None else score_errors(scored.flat("ref32"), ref_flat)
    plain_errors = None if scored.ref_plain is None else score_errors(scored.flat("ref_plain"), ref_flat)
    baseline_name = "float32 reference" if plain_errors is None else f"plain {dtype} PyTorch"
    baseline_errors = float32_errors if plain_errors is None else plain_errors
    return ScoreStats(
        kernel=kernel_flat,
        reference=ref_flat,
        kernel_errors=kernel_errors,
        float32_errors=float32_errors,
        baseline_name=baseline_name,
        baseline_errors=baseline_errors,
        nonfinite_kernel=nonfinite_counts(kernel_flat),
        nonfinite_reference=nonfinite_counts(ref_flat),
    )


def overlap_depths(scored: Scored) -> list[int]:
    """The top-k depths of `OVERLAP_KS` below the most documents any query scored (at least the first)."""
    max_items = max((d.size for d in scored.docs), default=0)
    return [k for k in OVERLAP_KS if k < max_items] or [OVERLAP_KS[0]]


def judged_queries(scored: Scored) -> list[int]:
    """The queries that scored at least one document: only they are ranked."""
    return [q for q, d in enumerate(scored.docs) if d.size]


def kernel_ranking(scored: Scored, tolerance: list[Any], judged: list[int], ks: list[int]) -> RankingStats:
    """Per query, the kernel's ranking against the float64 reference's, scores within `tolerance` tied."""
    return ranking_agreement(
        [scored.kernel[q] for q in judged],
        [scored.ref64[q] for q in judged],
        ks,
        tolerance=[tolerance[q] for q in judged],
        tau_depth=TAU_DEPTH,
    )


def quantization_ranking(scored: Scored, judged: list[int], ks: list[int]) -> RankingStats:
    """Per query, the kernel's ranking against the exact float scores of the reference corpus."""
    assert scored.quant_ref is not None
    return ranking_agreement(
        [scored.kernel[q] for q in judged],
        [scored.quant_ref[q] for q in judged],
        ks,
        tau_depth=TAU_DEPTH,
    )

"""Agreement between two sets of scores: pure functions over numpy arrays (torch tensors accepted).

Used by `maxsim verify` to compare the fused kernel with an independent reference, and by the
quantization report to compare an int8 run with the float run it came from. Every function takes the
values under test first and the reference second.

Definitions (v: values under test, r: reference, both per score):

- absolute error ``|v - r|``; relative error ``|v - r| / |r|`` (``|r|`` floored at the smallest normal
  float32, so an exact zero reference gives a large but finite number instead of a division by zero).
  Pairs equal as floats (including equal infinities) have error 0; a pair where either side is NaN or
  infinite and the two differ is a *non-finite mismatch*, counted apart and left out of the statistics.
- tolerance: a pair passes when ``|v - r| <= atol + rtol * |r|`` (the torch.testing rule; ``atol`` may
  be one bound per score).
- argmax agreement: the share of (query token, document) pairs where both pick the same document token,
  over the pairs that are not near-ties (the reference's best two similarities within a rounding margin;
  there either choice is right) and not padding.
- top-k overlap: ``|top_k(v) ∩ top_k(r)| / min(k, n)``, ties broken by position (the lower index first),
  so equal inputs always overlap fully.
- tolerance-aware top-k overlap: the share of ``top_k(v)`` whose reference score is within the score
  tolerance of the k-th best reference score, i.e. how much of v's top-k is *a* valid top-k of r when
  scores closer than the tolerance count as ties.
- Kendall τ-b: ``(n_c - n_d) / sqrt((n_0 - n_1)(n_0 - n_2))`` with ``n_0 = n(n-1)/2``, ``n_1`` and ``n_2``
  the pairs tied in v and in r; computed by Knight's method (sort, count inversions by merging) in
  O(n log² n) vectorised numpy. NaN when either side is constant or n < 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# Smallest normal float32: the floor of |reference| in relative errors.
REL_FLOOR = float(np.finfo(np.float32).tiny)


def _as_numpy(x: Any, dtype: Any = np.float64) -> np.ndarray:
    """A numpy copy/view of `x` (numpy array, torch tensor on any device, or sequence)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu()
        if dtype is not None and str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        x = x.numpy()
    return np.asarray(x, dtype=dtype) if dtype is not None else np.asarray(x)


@dataclass(frozen=True)
class ErrorStats:
    """Absolute and relative error statistics of `count` compared pairs."""

    count: int
    max_abs: float
    p99_abs: float
    mean_abs: float
    max_rel: float
    p99_rel: float
    mean_rel: float
    nonfinite_mismatches: int  # pairs where a NaN/Inf on either side is not matched by the other

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(frozen=True)
class NonFinite:
    nan: int
    inf: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def nonfinite_counts(values: Any) -> NonFinite:
    """How many entries of `values` are NaN and how many are ±Inf."""
    v = _as_numpy(values)
    return NonFinite(nan=int(np.isnan(v).sum()), inf=int(np.isinf(v).sum()))


def _abs_rel_errors(values: Any, reference: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-pair absolute and relative errors over the comparable pairs, and the non-finite mismatches."""
    v = _as_numpy(values).ravel()
    r = _as_numpy(reference).ravel()
    if v.shape != r.shape:
        raise ValueError(f"shape mismatch: {v.shape} values vs {r.shape} reference")
    equal = v == r  # equal infinities included; NaN never equal
    finite = np.isfinite(v) & np.isfinite(r)
    comparable = finite | equal
    with np.errstate(invalid="ignore", over="ignore"):
        abs_err = np.where(equal, 0.0, np.abs(v - r))[comparable]
        rel_err = abs_err / np.maximum(np.abs(r[comparable]), REL_FLOOR)
    return abs_err, rel_err, int((~comparable).sum())


def score_errors(values: Any, reference: Any) -> ErrorStats:
    """Max, 99th percentile and mean of the absolute and relative errors of `values` against `reference`."""
    abs_err, rel_err, mismatches = _abs_rel_errors(values, reference)
    if abs_err.size == 0:
        return ErrorStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, mismatches)
    return ErrorStats(
        count=int(abs_err.size),
        max_abs=float(abs_err.max()),
        p99_abs=float(np.percentile(abs_err, 99)),
        mean_abs=float(abs_err.mean()),
        max_rel=float(rel_err.max()),
        p99_rel=float(np.percentile(rel_err, 99)),
        mean_rel=float(rel_err.mean()),
        nonfinite_mismatches=mismatches,
    )


@dataclass(frozen=True)
class ToleranceCheck:
    """Pairs outside ``|v - r| <= atol + rtol |r|``.

    `worst` is the largest ratio ``|v - r| / (atol + rtol |r|)``; a ratio above 1 is a violation.
    """

    violations: int
    worst: float
    worst_index: int  # flat index of the worst pair, -1 when there are no pairs

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def tolerance_check(values: Any, reference: Any, atol: Any, rtol: float) -> ToleranceCheck:
    """Count the pairs outside the tolerance; a non-finite mismatch is always a violation.

    `atol` is a scalar or an array broadcastable to the scores (a bound per score).
    """
    v = _as_numpy(values).ravel()
    r = _as_numpy(reference).ravel()
    if v.shape != r.shape:
        raise ValueError(f"shape mismatch: {v.shape} values vs {r.shape} reference")
    if v.size == 0:
        return ToleranceCheck(0, 0.0, -1)
    bound = np.broadcast_to(_as_numpy(atol).ravel() if np.ndim(atol) else float(atol), v.shape)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        equal = v == r
        err = np.where(equal, 0.0, np.abs(v - r))
        allowed = bound + rtol * np.where(np.isfinite(r), np.abs(r), 0.0)
        ratio = np.where(equal, 0.0, err / allowed)
    ratio = np.where(np.isnan(ratio), np.inf, ratio)  # NaN vs anything: a violation
    worst_index = int(np.argmax(ratio))
    return ToleranceCheck(
        violations=int((ratio > 1.0).sum()), worst=float(ratio[worst_index]), worst_index=worst_index
    )


@dataclass(frozen=True)
class ArgmaxStats:
    """Argmax agreement per (query token, document) pair, near-ties excluded."""

    pairs: int  # valid pairs (not padding)
    near_ties: int  # pairs excluded because the reference's best two are within the margin
    compared: int  # pairs - near_ties
    agreed: int
    mismatches: int
    agreement: float  # agreed / compared (1.0 when nothing is compared)

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def argmax_agreement(
    argmax: Any, reference_argmax: Any, near_tie: Any | None = None, valid: Any | None = None
) -> ArgmaxStats:
    """Agreement of two argmax arrays (same shape), leaving out near-ties and invalid (padding) pairs.

    `near_tie` and `valid` are boolean arrays of the same shape; `valid` defaults to
    ``reference_argmax >= 0`` (the kernels write -1 for padding).
    """
    a = _as_numpy(argmax, np.int64)
    b = _as_numpy(reference_argmax, np.int64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {a.shape} argmax vs {b.shape} reference")
    ok = (b >= 0) if valid is None else _as_numpy(valid, bool)
    tie = np.zeros(a.shape, bool) if near_tie is None else _as_numpy(near_tie, bool)
    pairs = int(ok.sum())
    near_ties = int((ok & tie).sum())
    judged = ok & ~tie
    compared = int(judged.sum())
    agreed = int((judged & (a == b)).sum())
    return ArgmaxStats(
        pairs=pairs,
        near_ties=near_ties,
        compared=compared,
        agreed=agreed,
        mismatches=compared - agreed,
        agreement=agreed / compared if compared else 1.0,
    )


def _ranking(scores: np.ndarray) -> np.ndarray:
    """Indices by score descending, ties by index ascending; NaN ranks last."""
    s = np.where(np.isnan(scores), -np.inf, scores)
    return np.lexsort((np.arange(s.size), -s))


def topk_overlap(values: Any, reference: Any, k: int) -> float:
    """``|top_k(values) ∩ top_k(reference)| / min(k, n)`` for two score vectors over the same items.

    1.0 for n == 0. Ties inside a vector are broken by index (lower first), so the same scores always
    give the same top-k.
    """
    v = _as_numpy(values).ravel()
    r = _as_numpy(reference).ravel()
    if v.shape != r.shape:
        raise ValueError(f"shape mismatch: {v.shape} values vs {r.shape} reference")
    depth = min(int(k), v.size)
    if depth <= 0:
        return 1.0
    common = np.intersect1d(_ranking(v)[:depth], _ranking(r)[:depth], assume_unique=True)
    return common.size / depth


def topk_overlap_within(values: Any, reference: Any, k: int, tolerance: Any) -> float:
    """Share of ``top_k(values)`` whose reference score ties or beats the k-th reference score.

    Two scores closer than `tolerance` (a scalar, or one value per item: the allowed error of that
    item's score) count as tied, so a swap that the score errors allow is not a disagreement.
    """
    v = _as_numpy(values).ravel()
    r = _as_numpy(reference).ravel()
    if v.shape != r.shape:
        raise ValueError(f"shape mismatch: {v.shape} values vs {r.shape} reference")
    depth = min(int(k), v.size)
    if depth <= 0:
        return 1.0
    tol = np.broadcast_to(_as_numpy(tolerance), r.shape)
    ref_order = _ranking(r)
    kth = ref_order[depth - 1]
    mine = _ranking(v)[:depth]
    # Item i is a valid member of a top-k when r[i] + tol[i] >= r[kth] - tol[kth].
    ok = r[mine] + tol[mine] >= r[kth] - tol[kth]
    return float(ok.sum()) / depth


def _count_inversions(a: np.ndarray) -> int:
    """Pairs i < j with a[i] > a[j] (strict), by a bottom-up merge sort vectorised over all run pairs."""
    n = a.size
    if n < 2:
        return 0
    a = np.asarray(a, np.int64)
    a = a - a.min()
    span = int(a.max()) + 1  # key offset per block: keeps blocks apart
    positions = np.arange(n, dtype=np.int64)
    total = 0
    width = 1
    while width < n:
        block = positions // (2 * width)
        right = (positions // width) % 2 == 1
        # Offsetting by block makes every block's left run one globally sorted array.
        key = block * span + a
        left_keys = key[~right]
        right_keys = key[right]
        right_block = block[right]
        # For each right element: left elements of its block strictly greater than it.
        left_end = np.searchsorted(left_keys, (right_block + 1) * span, side="left")
        not_greater = np.searchsorted(left_keys, right_keys, side="right")
        total += int((left_end - not_greater).sum())
        a = np.sort(key) - block * span  # merged: each block of 2*width is sorted, blocks keep their place
        width *= 2
    return total


def _tied_pairs(sorted_values: np.ndarray) -> int:
    """Pairs of equal values, for an array sorted so that equal values are adjacent."""
    if sorted_values.size < 2:
        return 0
    boundaries = np.flatnonzero(sorted_values[1:] != sorted_values[:-1]) + 1
    runs = np.diff(np.concatenate(([0], boundaries, [sorted_values.size])))
    return int((runs * (runs - 1) // 2).sum())


def kendall_tau_b(values: Any, reference: Any) -> float:
    """Kendall's τ-b rank correlation of two score vectors over the same items (NaN if undefined).

    τ-b = (n_c - n_d) / sqrt((n_0 - n_1)(n_0 - n_2)) where n_c, n_d are the concordant and discordant
    pairs, n_0 = n(n-1)/2, n_1 the pairs tied in `values`, n_2 the pairs tied in `reference`.
    With n_3 the pairs tied in both, n_c + n_d = n_0 - n_1 - n_2 + n_3.
    """
    x = _as_numpy(values).ravel()
    y = _as_numpy(reference).ravel()
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch: {x.shape} values vs {y.shape} reference")
    n = x.size
    if n < 2 or np.isnan(x).any() or np.isnan(y).any():
        return float("nan")
    # Dense integer ranks keep the arithmetic exact.
    xr = np.unique(x, return_inverse=True)[1].astype(np.int64).ravel()
    yr = np.unique(y, return_inverse=True)[1].astype(np.int64).ravel()
    n0 = n * (n - 1) // 2
    order = np.lexsort((yr, xr))  # by x, then y: pairs tied in x are never counted as inversions
    xs, ys = xr[order], yr[order]
    n1 = _tied_pairs(xs)
    n3 = _tied_pairs(xs * n + ys)  # adjacent in this order exactly when tied in both
    n2 = _tied_pairs(np.sort(yr))
    discordant = _count_inversions(ys)
    denominator = float(n0 - n1) * float(n0 - n2)
    if denominator <= 0.0:
        return float("nan")
    concordant_minus_discordant = n0 - n1 - n2 + n3 - 2 * discordant
    return float(concordant_minus_discordant / np.sqrt(denominator))


@dataclass(frozen=True)
class Summary:
    """Mean and min of a per-query statistic (NaNs left out and counted)."""

    mean: float
    min: float
    queries: int
    undefined: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def summarize(per_query: Sequence[float]) -> Summary:
    """Mean and minimum over queries, leaving out NaN (an undefined statistic) and counting it."""
    x = np.asarray(per_query, np.float64)
    defined = x[~np.isnan(x)]
    if defined.size == 0:
        return Summary(float("nan"), float("nan"), 0, int(x.size))
    return Summary(float(defined.mean()), float(defined.min()), int(defined.size), int(x.size - defined.size))


@dataclass(frozen=True)
class RankingStats:
    """Ranking agreement over queries: plain and tolerance-aware top-k overlap per k, and Kendall τ-b."""

    overlap: dict[int, Summary]
    overlap_within: dict[int, Summary] | None
    kendall_tau: Summary
    tau_depth: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "overlap": {str(k): s.to_dict() for k, s in self.overlap.items()},
            "overlap_within_tolerance": None
            if self.overlap_within is None
            else {str(k): s.to_dict() for k, s in self.overlap_within.items()},
            "kendall_tau": self.kendall_tau.to_dict(),
            "tau_depth": self.tau_depth,
        }


def ranking_agreement(
    values: Sequence[Any],
    reference: Sequence[Any],
    ks: Sequence[int] = (10, 100, 1000),
    *,
    tolerance: Sequence[Any] | None = None,
    tau_depth: int = 1000,
) -> RankingStats:
    """Per-query top-k overlaps and Kendall τ-b, summarised over queries.

    `values[q]` and `reference[q]` are query q's scores over the same items. τ-b is computed over the
    reference's top `tau_depth` items (the part of a ranking anyone reads). With `tolerance[q]` (per
    item or scalar), the tolerance-aware overlap is computed as well.
    """
    if len(values) != len(reference):
        raise ValueError(f"{len(values)} queries of values vs {len(reference)} of reference")
    overlaps: dict[int, list[float]] = {int(k): [] for k in ks}
    within: dict[int, list[float]] = {int(k): [] for k in ks}
    taus: list[float] = []
    for q, (v, r) in enumerate(zip(values, reference, strict=True)):
        v = _as_numpy(v).ravel()
        r = _as_numpy(r).ravel()
        for k in overlaps:
            overlaps[k].append(topk_overlap(v, r, k))
            if tolerance is not None:
                within[k].append(topk_overlap_within(v, r, k, tolerance[q]))
        head = _ranking(r)[: min(tau_depth, r.size)]
        taus.append(kendall_tau_b(v[head], r[head]))
    return RankingStats(
        overlap={k: summarize(x) for k, x in overlaps.items()},
        overlap_within=None if tolerance is None else {k: summarize(x) for k, x in within.items()},
        kendall_tau=summarize(taus),
        tau_depth=tau_depth,
    )

"""Tolerances of `maxsim verify` and the checks that turn its statistics into a verdict.

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

Checks
------
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

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from maxsim_cli.agreement import ArgmaxStats, RankingStats, ToleranceCheck, tolerance_check
from maxsim_cli.verify.stats import Scored, ScoreStats

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
# Gradient check (--grad): relative error bound per input dtype (issue 6's targets; bf16 and TF32 store or
# multiply with 8 or 10 mantissa bits, so their bound is the rounding of the stored gradient, ~2^-8).
GRAD_TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3, "int8": 1e-5, "tf32": 8e-3}


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


def query_score_factors(query_offsets: np.ndarray, base: float) -> np.ndarray:
    """The factor of B per query: ``base + gamma_Lq`` (base: e_sim, or 2u for int8)."""
    return np.array([base + gamma(int(n)) for n in np.diff(query_offsets)], dtype=np.float64)


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
class ScoreTolerance:
    """The tolerance the scores are judged by: the user's atol/rtol, or the derived per-score bound B."""

    user_rule: bool  # --atol or --rtol given
    rule: str  # the rule in words, for the report
    per_query: list[Any]  # per query, the allowed error of each scored document
    check: ToleranceCheck
    max_allowed: float


def score_tolerance(scored: Scored, stats: ScoreStats, tol: Tolerances, int8: bool) -> ScoreTolerance:
    """Judge every score against its tolerance (the user's rule if given, else B per score)."""
    kernel_flat, ref_flat = stats.kernel, stats.reference
    allowed_flat = scored.flat("allowed")
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
    return ScoreTolerance(user_rule, rule, per_query_tol, tolerance, max_allowed)


def score_checks(
    stats: ScoreStats,
    tolerance: ScoreTolerance,
    argmax: ArgmaxStats,
    ranking: RankingStats,
    tol: Tolerances,
    *,
    dtype: str,
    allow_tf32: bool,
) -> list[Check]:
    """The kernel's checks, in report order: scores, yardstick (where it applies), argmax, ranking,
    non-finite."""
    kernel_errors = stats.kernel_errors
    checks: list[Check] = []
    checks.append(
        Check(
            "scores",
            tolerance.check.violations == 0,
            f"{tolerance.check.violations:,} of {stats.kernel.size:,} scores outside the tolerance "
            f"(worst at {tolerance.check.worst:.3g} of its bound)",
        )
    )
    # The FlashAttention rule holds where the float32 reference rounds like the kernel: float inputs
    # without TF32, judged by the derived bounds.
    yardstick_applies = stats.float32_errors is not None and not (allow_tf32 and dtype == "float32")
    if yardstick_applies and not tolerance.user_rule:
        baseline_errors = stats.baseline_errors
        assert baseline_errors is not None
        ref_flat = stats.reference
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
                f"kernel max |error| {kernel_errors.max_abs:.3g} <= {YARDSTICK_FACTOR:g} x "
                f"{stats.baseline_name} {baseline_errors.max_abs:.3g} (floor {floor:.3g})",
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
    k_nonfinite, r_nonfinite = stats.nonfinite_kernel, stats.nonfinite_reference
    checks.append(
        Check(
            "non-finite",
            kernel_errors.nonfinite_mismatches == 0,
            f"kernel NaN {k_nonfinite.nan}, Inf {k_nonfinite.inf}; reference NaN {r_nonfinite.nan}, "
            f"Inf {r_nonfinite.inf}; {kernel_errors.nonfinite_mismatches} unmatched",
        )
    )
    return checks


def quantization_min_overlap(tol: Tolerances) -> float:
    """The mean top-k overlap the quantized corpus must keep: --min-overlap, else the default."""
    return QUANTIZATION_MIN_OVERLAP if tol.min_overlap is None else tol.min_overlap


def quantization_check(q_ranking: RankingStats, q_min: float) -> Check:
    """Judged on the lowest mean top-k overlap with the exact float scores."""
    low_k = min(q_ranking.overlap, key=lambda k: q_ranking.overlap[k].mean)
    return Check(
        "quantization",
        all(s.mean >= q_min for s in q_ranking.overlap.values()),
        f"mean top-k overlap with the exact float scores {q_ranking.overlap[low_k].mean:.4f} at "
        f"k={low_k} (required {q_min:g})",
    )


def gradient_verdict(
    result: dict[str, Any], queries: int, docs: int, dtype_key: str
) -> tuple[dict[str, Any], Check]:
    """The gradient check's result (`gradient_check` on `queries` x `docs`) judged against
    `GRAD_TOLERANCE[dtype_key]`, with the numbers the report shows."""
    bound = GRAD_TOLERANCE[dtype_key]
    errors = [result["dq_rel_error"]]
    if result["dd_rel_error"] is not None:
        errors.append(result["dd_rel_error"])
    repeatable = bool(result["bitwise_repeatable"])
    result = {**result, "queries": queries, "docs": docs, "tolerance": bound}
    dd = "n/a (int8 documents)" if result["dd_rel_error"] is None else f"{result['dd_rel_error']:.2e}"
    detail = (
        f"|dQ - ref|/|ref| = {result['dq_rel_error']:.2e}, |dD - ref|/|ref| = {dd} (bound {bound:.0e}); "
        f"bitwise repeatable: {'yes' if repeatable else 'NO'}; {queries} queries x {docs} documents"
    )
    if dtype_key == "int8":
        # The gradient check's float64 reference takes its argmax from the float queries, the kernel from
        # the quantized ones: the errors include quantization, so only repeatability is judged.
        result["errors_judged"] = False
        return result, Check("gradients", repeatable, detail + "; int8: errors reported, not judged")
    result["errors_judged"] = True
    return result, Check("gradients", repeatable and all(e <= bound for e in errors), detail)

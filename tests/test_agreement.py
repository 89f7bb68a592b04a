"""Unit tests of maxsim_cli.agreement against hand-computed values and brute-force definitions.

All quantities here are exact (integer counts, or ratios of small integers), so comparisons use a
tolerance of 1e-12 only to absorb the final float division.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from maxsim_cli.agreement import (
    _count_inversions,
    argmax_agreement,
    kendall_tau_b,
    nonfinite_counts,
    ranking_agreement,
    score_errors,
    summarize,
    tolerance_check,
    topk_overlap,
    topk_overlap_within,
)


def _tau_b_brute(x: list[float], y: list[float]) -> float:
    """τ-b straight from its definition, over all pairs."""
    concordant = discordant = tied_x = tied_y = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        dx = np.sign(x[i] - x[j])
        dy = np.sign(y[i] - y[j])
        tied_x += dx == 0
        tied_y += dy == 0
        concordant += dx * dy > 0
        discordant += dx * dy < 0
    n0 = len(x) * (len(x) - 1) / 2
    return (concordant - discordant) / math.sqrt((n0 - tied_x) * (n0 - tied_y))


def test_kendall_tau_b_hand_computed_with_ties() -> None:
    # Pairs of x=[1,2,2,3], y=[1,3,2,2]: (0,1) (0,2) (0,3) concordant; (1,3) discordant;
    # (1,2) tied in x; (2,3) tied in y. n0=6, n1=1, n2=1: τ-b = (3-1)/sqrt(5*5) = 0.4.
    assert kendall_tau_b([1, 2, 2, 3], [1, 3, 2, 2]) == pytest.approx(0.4, abs=1e-12)


def test_kendall_tau_b_extremes_and_undefined() -> None:
    x = np.arange(7.0)
    assert kendall_tau_b(x, x) == pytest.approx(1.0, abs=1e-12)
    assert kendall_tau_b(x, -x) == pytest.approx(-1.0, abs=1e-12)
    assert math.isnan(kendall_tau_b([1.0], [2.0]))
    assert math.isnan(kendall_tau_b([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))  # constant: undefined


def test_kendall_tau_b_matches_brute_force_on_random_ties() -> None:
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(2, 30))
        x = rng.integers(0, 4, n).astype(float)
        y = rng.integers(0, 4, n).astype(float)
        if len(set(x)) == 1 or len(set(y)) == 1:
            continue
        assert kendall_tau_b(x, y) == pytest.approx(_tau_b_brute(list(x), list(y)), abs=1e-12)


def test_count_inversions_brute_force() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        a = rng.integers(-3, 8, int(rng.integers(0, 40)))
        expected = sum(1 for i, j in itertools.combinations(range(a.size), 2) if a[i] > a[j])
        assert _count_inversions(a) == expected


def test_topk_overlap() -> None:
    ref = np.array([5.0, 4.0, 3.0, 2.0, 1.0])
    mine = np.array([5.0, 4.0, 1.0, 2.0, 3.0])  # items 2 and 4 swapped
    assert topk_overlap(mine, ref, 2) == 1.0
    assert topk_overlap(mine, ref, 3) == pytest.approx(2 / 3)
    assert topk_overlap(mine, ref, 10) == 1.0  # k > n: all items
    assert topk_overlap(torch.tensor(mine), torch.tensor(ref), 3) == pytest.approx(2 / 3)
    # Ties broken by index: equal inputs always overlap fully.
    tied = np.array([1.0, 1.0, 1.0, 1.0])
    assert topk_overlap(tied, tied, 2) == 1.0
    assert topk_overlap(np.array([]), np.array([]), 10) == 1.0


def test_topk_overlap_within_tolerance_forgives_allowed_swaps() -> None:
    ref = np.array([3.0, 2.0, 2.0 - 1e-7, 1.0])
    mine = np.array([3.0, 2.0 - 1e-7, 2.0, 1.0])  # the near-tied items 1 and 2 swap
    assert topk_overlap(mine, ref, 2) == 0.5
    assert topk_overlap_within(mine, ref, 2, 1e-6) == 1.0
    assert topk_overlap_within(mine, ref, 2, 1e-9) == 0.5
    far = np.array([3.0, 0.0, 0.0, 2.5])  # item 3 enters the top-2 although far below
    assert topk_overlap_within(far, ref, 2, 1e-6) == 0.5


def test_score_errors_and_nonfinite() -> None:
    ref = np.array([1.0, 2.0, -4.0, 0.0, np.inf, np.nan])
    mine = np.array([1.0, 2.5, -4.0, 0.0, np.inf, 1.0])
    stats = score_errors(mine, ref)
    assert stats.count == 5  # the NaN pair is a non-finite mismatch
    assert stats.nonfinite_mismatches == 1
    assert stats.max_abs == 0.5
    assert stats.max_rel == 0.25
    assert stats.mean_abs == pytest.approx(0.1)
    assert nonfinite_counts(ref).to_dict() == {"nan": 1, "inf": 1}


def test_tolerance_check() -> None:
    ref = np.array([1.0, 10.0, 100.0])
    mine = np.array([1.0 + 1e-3, 10.0, 100.0 + 0.05])
    check = tolerance_check(mine, ref, atol=1e-3, rtol=1e-4)
    # allowed: 1.1e-3, 2e-3, 1.1e-2 -> errors 1e-3 (ok), 0, 5e-2 (violation, ratio 50/11)
    assert check.violations == 1
    assert check.worst_index == 2
    assert check.worst == pytest.approx(0.05 / 0.011)
    per_score = tolerance_check(mine, ref, atol=np.array([1e-2, 1e-2, 1e-1]), rtol=0.0)
    assert per_score.violations == 0
    assert tolerance_check([np.nan], [1.0], atol=1.0, rtol=1.0).violations == 1
    assert tolerance_check([np.inf], [np.inf], atol=0.0, rtol=0.0).violations == 0


def test_argmax_agreement_excludes_near_ties_and_padding() -> None:
    ref = np.array([[0, 1, 2], [3, -1, 5]])
    mine = np.array([[0, 2, 2], [4, -1, 5]])
    near_tie = np.array([[False, True, False], [False, False, False]])
    stats = argmax_agreement(mine, ref, near_tie)
    assert (stats.pairs, stats.near_ties, stats.compared, stats.agreed, stats.mismatches) == (5, 1, 4, 3, 1)
    assert stats.agreement == 0.75


def test_summaries_and_ranking_agreement() -> None:
    s = summarize([1.0, 0.5, float("nan")])
    assert (s.mean, s.min, s.queries, s.undefined) == (0.75, 0.5, 2, 1)
    ref = [np.arange(20.0), np.arange(20.0)[::-1].copy()]
    mine = [np.arange(20.0), np.arange(20.0)[::-1].copy()]
    mine[1][0], mine[1][1] = mine[1][1], mine[1][0]  # swap the top two of query 1
    stats = ranking_agreement(mine, ref, ks=(1, 10), tolerance=[0.0, 0.0])
    assert stats.overlap[1].min == 0.0
    assert stats.overlap[10].mean == 1.0
    assert stats.kendall_tau.min == pytest.approx(1 - 2 * 2 / (20 * 19))  # one discordant pair
    assert stats.to_dict()["overlap"]["10"]["mean"] == 1.0

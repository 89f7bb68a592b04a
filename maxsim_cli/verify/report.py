"""The report of `maxsim verify`: everything measured, the checks and the verdict, as JSON-ready data.

`maxsim_cli.commands.verify` renders it as the text table (or prints `VerifyReport.to_dict` as JSON) and
exits with `EXIT_FAILED` when the verdict fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from maxsim_cli.agreement import ArgmaxStats, ErrorStats, NonFinite, RankingStats, ToleranceCheck
from maxsim_cli.verify.checks import Check

EXIT_FAILED = 3  # exit code of a verdict that fails (0: passes; 1: error; 2: usage)


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


def near_tie_margin_text(int8: bool, sim_error: float) -> str:
    """The argmax's near-tie margin in words."""
    return (
        "0: int8 kernel and reference round the same fp32 products and break ties to the lowest index"
        if int8
        else f"2 x {sim_error:.3g} x |q_i| max_j |d_j|"
    )

"""`maxsim verify`: the fused kernel against an independent reference, with a verdict (see `run`)."""

from maxsim_cli.verify.run import (
    _FULL_FLOAT64_WIDTH,
    DEFAULT_BATCH_TOKENS,
    EXIT_FAILED,
    Tolerances,
    VerifyReport,
    float_reference,
    sample_documents,
    similarity_error,
    verify,
)

__all__ = [
    "DEFAULT_BATCH_TOKENS",
    "EXIT_FAILED",
    "Tolerances",
    "VerifyReport",
    "_FULL_FLOAT64_WIDTH",
    "float_reference",
    "sample_documents",
    "similarity_error",
    "verify",
]

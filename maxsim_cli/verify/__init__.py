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

The verdict passes when every score is within its bound, the argmax agrees off near-ties, every query's
top-k is a valid reference top-k, and non-finite scores match (`checks` gives the rules and bounds).

Where each part lives
---------------------
- `stats`: the numbers compared per pair (`Scored`), accumulators over batches (argmax agreement,
  timings), the error, yardstick-baseline and ranking statistics; pure computations.
- `checks`: the rounding-error model (``gamma``), `Tolerances`, the per-score bound and the checks that
  turn statistics into verdicts.
- `reference`: the float64/float32 reference in one shared float32 pass (`float_reference`).
- `report`: `VerifyReport` (JSON-ready via ``to_dict``) and `EXIT_FAILED`; `maxsim_cli.commands.verify`
  renders the text table.
- `inputs`: the queries as the kernel sees them, the document sample, a run's candidates, reading
  documents by location.
- `batches`: scoring the planned pairs batch by batch, with the kernel (as `maxsim score` calls it) and
  the reference, folded into the per-pair numbers and the counters.
- `run`: `verify`, the driver: plan the pairs, score them, measure, judge, report.

Imports run one way: stats <- checks <- reference, report; inputs, reference, stats <- batches; all <- run.
"""

from maxsim_cli.verify.checks import Tolerances, similarity_error
from maxsim_cli.verify.inputs import sample_documents
from maxsim_cli.verify.reference import FULL_FLOAT64_WIDTH, float_reference
from maxsim_cli.verify.report import EXIT_FAILED, VerifyReport
from maxsim_cli.verify.run import DEFAULT_BATCH_TOKENS, verify

__all__ = [
    "DEFAULT_BATCH_TOKENS",
    "EXIT_FAILED",
    "FULL_FLOAT64_WIDTH",
    "Tolerances",
    "VerifyReport",
    "float_reference",
    "sample_documents",
    "similarity_error",
    "verify",
]

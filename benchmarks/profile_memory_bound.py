"""Launch the HBM-bound kernels once each, for Nsight Compute (H200 probe).

The one-query workload of `bench_kernels.py` (1 query x 32 tokens against 100K documents of 20-300
tokens, offsets on the GPU): the int8 Triton kernel (`_launch_varlen`, its default tile), then
`maxsim_varlen` (fp16); with ``--rerank`` also the int8 rerank (64 queries x 1000 shuffled candidates of
180 tokens, `_launch_candidates`). The launches come in that order. Run under ncu, e.g. (run_h200.sh step
ncu-one-query, which also records the stall reasons):

    ncu -k regex:"_maxsim_int8_varlen_kernel|_maxsim_varlen_kernel" --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        --section MemoryWorkloadAnalysis python benchmarks/profile_memory_bound.py
"""

from __future__ import annotations

import argparse

import torch
from common import make_workload
from maxsim_kernels import maxsim_int8 as i8
from maxsim_kernels import maxsim_varlen

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rerank", action="store_true", help="also the int8 rerank launches")
args = parser.parse_args()

w = make_workload("one_query")
q_off, d_off = w["q_off"].cuda(), w["d_off"].cuda()
q8, sq = i8.quantize_per_token(w["queries"])
d8, sd = i8.quantize_per_token(w["docs"])
d16 = w["docs"].half()
i8._launch_varlen(q8, sq, q_off, d8, sd, d_off, False)
maxsim_varlen(w["queries"].half(), q_off, d16, d_off)
if args.rerank:
    r = make_workload("rerank")
    rq8, rsq = i8.quantize_per_token(r["queries"])
    rd8, rsd = i8.quantize_per_token(r["docs"])
    args8 = (rq8, rsq, r["q_off"].cuda(), rd8, rsd, r["d_off"].cuda())
    cands = (r["cand_offsets"].cuda(), r["cand_docs"].cuda())
    i8._launch_candidates(*args8, *cands, False)
torch.cuda.synchronize()
print("done")

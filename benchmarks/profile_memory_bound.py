"""Launch the one-query kernels once each, int8 then fp16, for Nsight Compute (H200 probe).

The one-query workload of `bench_kernels.py` (1 query x 32 tokens against 100K documents of 20-300
tokens, offsets on the GPU): `maxsim_varlen_int8` (the Triton int8 kernel) and `maxsim_varlen` (fp16).
Run under ncu, e.g. (run_h200.sh step ncu-one-query):

    ncu -k regex:"_maxsim_int8_varlen_kernel|_maxsim_varlen_kernel" --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        --section MemoryWorkloadAnalysis python benchmarks/profile_memory_bound.py
"""

from __future__ import annotations

import torch
from common import make_workload
from maxsim_kernels import maxsim_varlen
from maxsim_kernels.maxsim_int8 import maxsim_varlen_int8, quantize_per_token

w = make_workload("one_query")
q_off, d_off = w["q_off"].cuda(), w["d_off"].cuda()
d8, sd = quantize_per_token(w["docs"])
d16 = w["docs"].half()
maxsim_varlen_int8(w["queries"], q_off, d8, d_off, doc_scales=sd)
maxsim_varlen(w["queries"].half(), q_off, d16, d_off)
torch.cuda.synchronize()
print("done")

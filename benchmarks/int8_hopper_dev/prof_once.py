"""Launch the int8 Gluon all-pairs kernel once on the exhaustive workload (for ncu)."""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
import ab_int8_gluon as ab  # noqa: E402
import bench_kernels as bk  # noqa: E402
from maxsim_kernels.maxsim_int8 import quantize_per_token  # noqa: E402

w = bk.make_workload("exhaustive")
q8, sq = quantize_per_token(w["queries"])
d8, sd = quantize_per_token(w["docs"])
if os.environ.get("V2"):
    run = ab.k82.launcher(
        q8, sq, w["q_off"], d8, sd, w["d_off"], stages=int(os.environ.get("ST", 4)), group=8
    )
else:
    run = ab.gluon_launcher(q8, sq, w["q_off"], d8, sd, w["d_off"], stages=5, group=8)
run()
torch.cuda.synchronize()
run()
torch.cuda.synchronize()
print("done")

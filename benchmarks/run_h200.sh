#!/usr/bin/env bash
# One call on the H200 that checks and times everything the docs report: the GPU-marked tests, the forward
# kernels against the peers, training (forward + backward), and the verify reports on sample_data/.
# Usage (device tool, carrying .whl with the peers' wheels):  bash benchmarks/run_h200.sh "$OUT"
# Each step has its own time limit so that one slow step cannot take the others' results with it.
# Kept results go to benchmarks/results/<area>/: benchmarks/README.md lists each step's area.
set -u
out=${1:?usage: run_h200.sh OUTDIR}
logs=$(mktemp -d)
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$logs/install.log" 2>&1 || cat "$logs/install.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$logs/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$logs/gpu.txt"

step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$logs/steps.txt"
  tail -n 25 "$logs/$name.log"
  tar -czf "$out/h200-results.tar.gz" -C "$logs" .  # after every step: a later time-out keeps these
}

# STEPS picks a subset (not in the default set: sweep, the tile sweep of bench_kernels.py; score,
# `maxsim score` end to end on a 10 GB corpus; pinning, bench_pinning.py; first-pass,
# profile_first_pass.py; probe-host, probe_host_overhead.py; probe-batch,
# probe_batch_host.py; argmax-sweep,
# sweep_argmax_forward.py; long-hopper, ab_long_hopper.py); WORKLOADS narrows the kernel benchmark.
# All steps at their default limits take longer than one 10-minute call: run STEPS="gpu-tests verify",
# STEPS="kernels train" and STEPS="int8 ab" as three calls (the full gpu-tests step takes ~140 s).
steps=" ${STEPS:-gpu-tests kernels train verify int8 ab} "
want() { [[ $steps == *" $1 "* ]]; }
# GPU_TESTS narrows the GPU-marked tests to some files or node ids
want gpu-tests && step gpu-tests ${GPU_TESTS_S:-240} python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/}
want sweep && step sweep ${SWEEP_S:-240} python3 benchmarks/bench_kernels.py --sweep \
  --workloads "${SWEEP_WORKLOADS:-exhaustive,colpali,one_query}" --out "$logs/kernels-sweep-h200.json"
want kernels && step kernels ${KERNELS_S:-300} python3 benchmarks/bench_kernels.py --cold --cold-workloads "${COLD_WORKLOADS:-one_query}" \
  --workloads "${WORKLOADS:-exhaustive,one_query,colpali,rerank}" --out "$logs/kernels-h200.json"
want train && step train ${TRAIN_S:-260} python3 benchmarks/bench_train.py --out "$logs/train-h200.json" \
  --methods ours,plain-autograd,lik,lik-lowmem,flash-maxsim --fp32-shapes colbert-128
want verify && step verify ${VERIFY_S:-80} python3 benchmarks/verify_reports.py --device cuda --out "$logs/verify"
want int8 && step int8 ${INT8_S:-200} python3 benchmarks/bench_int8.py gpu --rep-ms 200 ${INT8_ARGS:-} \
  --out "$logs/int8-h200.json" --workdir /tmp
want ab && step ab ${AB_S:-60} python3 benchmarks/ab_specialization.py
# ab-forward: the forward kernel against other versions of its module, AB_VARIANTS="NAME=FILE ..."
want ab-forward && step ab-forward ${AB_FORWARD_S:-240} python3 benchmarks/ab_forward.py \
  $(for v in ${AB_VARIANTS:-}; do echo --variant "$v"; done) --workloads "${AB_WORKLOADS:-exhaustive,colpali,one_query,rerank}" \
  --out "$logs/ab-forward-h200.json"
want pinning && step pinning ${PINNING_S:-90} bash -c "python3 benchmarks/bench_pinning.py > $logs/pin-h200.txt"
# first-pass: fresh processes that differ in what precedes the first run (benchmarks/profile_first_pass.py)
want first-pass && step first-pass ${FIRST_PASS_S:-200} bash -c '
  fp="python3 benchmarks/profile_first_pass.py --workdir /var/tmp/mb --out '"$logs"'/first-pass-h200.txt"
  $fp --label fresh --warm none && $fp --label warm-small --warm small && $fp --label spin --spin 2 \
    && CUDA_MODULE_LOADING=EAGER $fp --label eager && $fp --label fresh-again --warm none'

want probe-host && step probe-host ${PROBE_HOST_S:-120} python3 benchmarks/probe_host_overhead.py \
  --out "$logs/probe-host-h200.json"
want probe-batch && step probe-batch ${PROBE_BATCH_S:-120} python3 benchmarks/probe_batch_host.py \
  --out "$logs/probe-batch-host-h200.txt"
# ncu-one-query: Nsight Compute on the one-query kernels, int8 and fp16 (profile_memory_bound.py)
want ncu-one-query && step ncu-one-query ${NCU_S:-150} bash -c '
  PATH=/usr/local/cuda-13/bin:$PATH ncu -k regex:"_maxsim_int8_varlen_kernel|_maxsim_varlen_kernel|_maxsim_int8_candidates_kernel" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    --metrics regex:"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 benchmarks/profile_memory_bound.py --rerank \
    > '"$logs"'/ncu-one-query-h200.txt 2>&1; rc=$?; grep -E "Duration|Throughput|Occupancy|Registers|Stall|Eligible|Issued" '"$logs"'/ncu-one-query-h200.txt; exit $rc'
# ab-offsets: maxsim score with the offsets copied three ways (and a run-ahead bound), fp16 and int8
# (ab_offsets_copy.py)
want ab-offsets && step ab-offsets ${AB_OFFSETS_S:-300} python3 benchmarks/ab_offsets_copy.py \
  --workdir /var/tmp/mb --out "$logs/ab-offsets-h200.json"
# read-rate: page-cached shard reads by method and thread count (probe_read_rate.py; needs the score corpus)
want read-rate && step read-rate ${READ_RATE_S:-150} python3 benchmarks/probe_read_rate.py /var/tmp/mb/corpus/*.safetensors \
  --out "$logs/read-rate-h200.json"
# timeline: torch.profiler timelines of one fp16 and one int8 `maxsim score` pass, summarised
# (profile_score_timeline.py; builds the score corpus and its int8 quantization like ab-offsets)
want timeline && step timeline ${TIMELINE_S:-240} python3 benchmarks/profile_score_timeline.py --workdir /var/tmp/mb \
  --out "$logs/timeline-h200.json" --traces "$logs"
# pass-breakdown: the scoring thread's cycle per batch, timed part by part, with variants (probe_pass_breakdown.py)
want pass-breakdown && step pass-breakdown ${PASS_BREAKDOWN_S:-240} python3 benchmarks/probe_pass_breakdown.py \
  --workdir /var/tmp/mb ${PASS_BREAKDOWN_ARGS:-} --out "$logs/pass-breakdown-h200.json"
# ab-trees: maxsim score end to end from the checkout and from a baseline tree (AB_BASE, e.g. unpacked by
# `git archive BASE | tar -x -C ab-base` before the call), alternating fresh processes (ab_trees.py)
want ab-trees && step ab-trees ${AB_TREES_S:-300} python3 benchmarks/ab_trees.py --tree base=${AB_BASE:-ab-base} \
  --tree new=. --workdir /var/tmp/mb ${AB_TREES_ARGS:-} --out "$logs/ab-trees-h200.json"
# multigpu: `maxsim score` on 1 and 2 GPUs (needs the two-GPU kind), MGPU_CONFIGS from bench_multigpu.py
want multigpu && step multigpu ${MULTIGPU_S:-420} python3 benchmarks/bench_multigpu.py --workdir /var/tmp/mgpu \
  --size ${MGPU_SIZE:-10GB} --configs ${MGPU_CONFIGS:-1gpu,2gpu} --repeats ${MGPU_REPEATS:-3} \
  --log "$logs/multigpu-log.jsonl" --out "$logs/multigpu-h200x2.json"
# int8-queries: int8 all-pairs kernels and tiles for 1-64 queries against fp16 (sweep_int8_queries.py)
want int8-queries && step int8-queries ${INT8_QUERIES_S:-200} python3 benchmarks/sweep_int8_queries.py \
  ${INT8_QUERIES_ARGS:-} --out "$logs/int8-queries-h200.json"
# host-memory: NUMA nodes, read and copy rates bound to nodes, reads while GPUs copy (probe_host_memory.py)
want host-memory && step host-memory ${HOST_MEMORY_S:-200} python3 benchmarks/probe_host_memory.py \
  --workdir /var/tmp/mgpu --out "$logs/host-memory-h200.json"
# register-pages: page-locking the mapped shard files, and copies from them (probe_register_pages.py)
want register-pages && step register-pages ${REGISTER_PAGES_S:-200} python3 benchmarks/probe_register_pages.py \
  --workdir /var/tmp/mgpu --out "$logs/register-pages-h200.json"
# gpu-side: the pass replayed on GPU-resident batches, adding the merge, copies and reads (probe_gpu_side.py)
# (GPU_SIDE_ARGS: e.g. "--precisions fp16,int8 --steps kernel,+merge,+copies,+reads")
want gpu-side && step gpu-side ${GPU_SIDE_S:-200} python3 benchmarks/probe_gpu_side.py --workdir /var/tmp/mb \
  ${GPU_SIDE_ARGS:-} --out "$logs/gpu-side-h200.json"
want argmax-sweep && step argmax-sweep ${ARGMAX_SWEEP_S:-150} python3 benchmarks/sweep_argmax_forward.py \
  --out "$logs/argmax-sweep-h200.json"
want long-hopper && step long-hopper ${LONG_HOPPER_S:-240} python3 benchmarks/ab_long_hopper.py \
  --out "$logs/long-hopper-h200.json"
# SCORE_ARGS adds options to the score step (e.g. "--int8 --batch-times": fp16 against int8 end to end)
want score && step score ${SCORE_S:-200} python3 benchmarks/bench_score.py gpu --workdir /var/tmp/mb \
  ${SCORE_ARGS:-} --out "$logs/score-h200.json"

cat "$logs/gpu.txt" "$logs/steps.txt"

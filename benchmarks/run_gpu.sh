#!/usr/bin/env bash
# One call on the GPU machine (H100 or H200) that checks and times the docs' headline figures: the GPU-marked tests, the forward
# kernels against the peers, training (forward + backward), int8, and the verify reports on sample_data/.
# Usage, on the GPU machine (the peers' wheels in .whl/):  bash benchmarks/run_gpu.sh OUTDIR
# Each step has its own time limit so that one slow step cannot take the others' results with it.
# Kept results go to benchmarks/results/<area>/: benchmarks/README.md lists each step's area.
set -u
out=${1:?usage: run_gpu.sh OUTDIR}
logs=$(mktemp -d)
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # the peers' wheels, and the serve stack's in .whl/serve/ when present
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .whl/serve/*.whl 2>/dev/null) && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$logs/install.log" 2>&1 || cat "$logs/install.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$logs/gpu.txt"
# the card's name in every result file: h100 or h200
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'H[0-9]{3}' | tr 'A-Z' 'a-z')
card=${card:-gpu}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$logs/gpu.txt"

step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$logs/steps.txt"
  tail -n 25 "$logs/$name.log"
  tar -czf "$out/$card-results.tar.gz" -C "$logs" .  # after every step: a later time-out keeps these
}

# STEPS picks a subset (not in the default set: sweep, the tile sweep of bench_kernels.py; score,
# `maxsim score` end to end on a 10 GB corpus; ab-trees, gpu-side, multigpu: below); WORKLOADS narrows the
# kernel benchmark. The default set takes longer than one 10-minute call: run STEPS="gpu-tests",
# STEPS="kernels verify" and STEPS="train int8" as three calls (the full gpu-tests step takes more than 5
# minutes: on an H100 at df8f26f its first 155 tests took 300 s; its limit is 540 s).
steps=" ${STEPS:-gpu-tests kernels train verify int8} "
want() { [[ $steps == *" $1 "* ]]; }
# GPU_TESTS narrows the GPU-marked tests to some files or node ids
want gpu-tests && step gpu-tests ${GPU_TESTS_S:-540} python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/}
want sweep && step sweep ${SWEEP_S:-240} python3 benchmarks/bench_kernels.py --sweep \
  --workloads "${SWEEP_WORKLOADS:-exhaustive,colpali,one_query}" --out "$logs/kernels-sweep-$card.json"
want kernels && step kernels ${KERNELS_S:-300} python3 benchmarks/bench_kernels.py --cold --cold-workloads "${COLD_WORKLOADS:-one_query}" \
  --workloads "${WORKLOADS:-exhaustive,one_query,colpali,rerank}" --out "$logs/kernels-$card.json"
want train && step train ${TRAIN_S:-260} python3 benchmarks/bench_train.py --out "$logs/train-$card.json" \
  --methods ours,plain-autograd,lik,lik-lowmem,flash-maxsim --fp32-shapes colbert-128
want verify && step verify ${VERIFY_S:-80} python3 benchmarks/verify_reports.py --device cuda --out "$logs/verify"
want int8 && step int8 ${INT8_S:-200} python3 benchmarks/bench_int8.py gpu --rep-ms 200 ${INT8_ARGS:-} \
  --out "$logs/int8-$card.json" --workdir /tmp
# codes: the scan kernels below 8 bits (int4, residual2) beside fp16 and int8 on the same documents
want codes && step codes ${CODES_S:-300} python3 benchmarks/bench_codes.py ${CODES_ARGS:-} --out "$logs/codes-$card.json"
# two-stage: quantize --bits 4/2 of an 8 GB fp16 corpus (built once in TWO_STAGE_WORKDIR, ~11 GB of disk with
# its tiers) and one query's two-stage search against its bound; run it as a call of its own
want two-stage && step two-stage ${TWO_STAGE_S:-540} python3 benchmarks/bench_two_stage.py \
  --workdir ${TWO_STAGE_WORKDIR:-/var/tmp/mb-two-stage} ${TWO_STAGE_ARGS:-} --out "$logs/two-stage-$card.json"
# scale: one query's scan over 1e9 tokens of 2-bit codes resident on the GPU (~37 GB), 4-bit at the largest
# size that fits, a two-stage search composed with an exact tier in host memory; a call of its own
# (SCALE_ARGS: e.g. "--tokens 5e8" where memory is short, "--exact-dtype int8")
want scale && step scale ${SCALE_S:-540} python3 benchmarks/bench_scale.py ${SCALE_ARGS:-} --out "$logs/scale-$card.json"
# api-resident: the Python API's small calls on an 8.2 GB resident corpus beside the kernel alone
want api-resident && step api-resident ${API_RESIDENT_S:-300} python3 benchmarks/bench_api_resident.py \
  --workdir /var/tmp/mb-api --size ${API_RESIDENT_SIZE:-8.2GB} --out "$logs/api-resident-$card.json"
# ab-trees: maxsim score end to end from the checkout and from a baseline tree (AB_BASE, e.g. unpacked by
# `git archive BASE | tar -x -C ab-base` before the call), alternating fresh processes (ab_trees.py)
want ab-trees && step ab-trees ${AB_TREES_S:-300} python3 benchmarks/ab_trees.py --tree base=${AB_BASE:-ab-base} \
  --tree new=. --workdir /var/tmp/mb ${AB_TREES_ARGS:-} --out "$logs/ab-trees-$card.json"
# multigpu: `maxsim score` on 1 and 2 GPUs (needs the two-GPU kind), MGPU_CONFIGS from bench_multigpu.py
want multigpu && step multigpu ${MULTIGPU_S:-420} python3 benchmarks/bench_multigpu.py --workdir /var/tmp/mgpu \
  --size ${MGPU_SIZE:-10GB} --configs ${MGPU_CONFIGS:-1gpu,2gpu} --repeats ${MGPU_REPEATS:-3} \
  --log "$logs/multigpu-log.jsonl" --out "$logs/multigpu-${card}x2.json"
# gpu-side: the pass replayed on GPU-resident batches, adding the merge, copies and reads (probe_gpu_side.py)
# (GPU_SIDE_ARGS: e.g. "--precisions fp16,int8 --steps kernel,+merge,+copies,+reads")
want gpu-side && step gpu-side ${GPU_SIDE_S:-200} python3 benchmarks/probe_gpu_side.py --workdir /var/tmp/mb \
  ${GPU_SIDE_ARGS:-} --out "$logs/gpu-side-$card.json"
# SCORE_ARGS adds options to the score step (e.g. "--int8 --batch-times": fp16 against int8 end to end)
want score && step score ${SCORE_S:-200} python3 benchmarks/bench_score.py gpu --workdir /var/tmp/mb \
  ${SCORE_ARGS:-} --out "$logs/score-$card.json"

cat "$logs/gpu.txt" "$logs/steps.txt"

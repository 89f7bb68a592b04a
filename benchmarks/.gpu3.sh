set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/serve/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_codecs.py tests/test_two_stage.py tests/test_runs.py > $OUT/gpu-tests-codes.log 2>&1; tail -5 $OUT/gpu-tests-codes.log
cd benchmarks
timeout 240 python3 bench_codes.py --out $OUT/codes.json 2>&1 | tail -6
timeout 120 python3 probe_api_calls.py --workdir /var/tmp/mb-api --size 2GB --calls 300 --out $OUT/probe-api.txt > /dev/null 2>&1; grep "==" $OUT/probe-api.txt

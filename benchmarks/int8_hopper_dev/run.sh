# one process per compile-time variant: NAME ENV...
set -u
out=$1; shift
for spec in "$@"; do
  name=${spec%%:*}; envs=${spec#*:}
  echo "== $name ($envs)"
  env $envs timeout ${T:-200} python3 benchmarks/int8_hopper_dev/ab_int8_gluon.py --rounds 2 --out $out/$name.json > $out/$name.log 2>&1
  echo rc=$?; grep -v "^{" $out/$name.log | grep -v "^  \|Traceback" | tail -8
done

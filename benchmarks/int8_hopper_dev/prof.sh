set -u
export PATH=/usr/local/cuda-13/bin:$PATH
timeout 300 ncu --launch-skip 1 --launch-count 1 -k regex:int8_allpairs --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section SpeedOfLight --section SourceCounters --section InstructionStats -o $OUT/prof python3 benchmarks/int8_hopper_dev/prof_once.py > $OUT/ncu.log 2>&1
echo rc=$?; tail -3 $OUT/ncu.log
ncu -i $OUT/prof.ncu-rep --page details > $OUT/details.txt 2>&1
ncu -i $OUT/prof.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > $OUT/source.csv.gz
rm -f $OUT/prof.ncu-rep
grep -i "Duration\|Issue Slots Busy\|Eligible Warps\|Executed Ipc A" $OUT/details.txt

#!/bin/bash
# The third twin call (2026-12-06, benchmarks/data/h100/twin2/README.md): OUT=DIR bash benchmarks/h100_run3.sh
# benchmarks/gpu_h100_twin.py's saved-tensor inventory (fixed walk) and dispatch counts, as h100_run2.sh runs its
# sections: a tiny-shape smoke run first, then each table in its own process under a hard timeout.
set -u
D=$(cd "$(dirname "$0")" && pwd)
W=/tmp/w3; rm -rf $W; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
LOG=$OUT/log3.txt
T0=$(date +%s)
P=${PY:-python3}
sec() {  # name timeout args...
  local name=$1 to=$2; shift 2
  mkdir -p $W/$name
  echo "=== $name start t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
  timeout -k 3 $to $P $D/gpu_h100_twin.py --out $W/$name "$@" >> $LOG 2>&1; echo "=== $name rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
  [ "$name" = smoke ] || cp $W/$name/*.json $OUT/ 2>/dev/null
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv >> $LOG 2>&1
sec smoke 60 --smoke --only saved,dispatch
sec saved 45 --only saved
sec dispatch 150 --only dispatch --budget dispatch=130
echo "=== all done t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
grep -h "^\[" $LOG

#!/bin/bash
# The third H100 call (2026-12-06 23:11 UTC, benchmarks/data/h100/twin2/README.md): OUT=DIR bash benchmarks/h100_run2.sh
# benchmarks/gpu_h100_twin.py's tables, every section a separate process under a hard timeout, its JSON files
# copied into $OUT as soon as it ends; a tiny-shape smoke run first (same code path on the GPU).
# SECTIONS picks the tables (default: the third call's five; `SECTIONS=saved,dispatch` is the follow-up call that
# re-takes the saved-tensor inventory with the fixed graph walk and counts dispatches, not yet run).
set -u
D=$(cd "$(dirname "$0")" && pwd)  # benchmarks/ (on the device the scripts travel as .gpu/gpu3/)
W=/tmp/w2; rm -rf $W; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
LOG=$OUT/log.txt
T0=$(date +%s)
P=${PY:-python3}
sec() {  # name timeout args...
  local name=$1 to=$2; shift 2
  mkdir -p $W/$name
  echo "=== $name start t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
  timeout -k 3 $to $P $D/gpu_h100_twin.py --out $W/$name "$@" >> $LOG 2>&1; echo "=== $name rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
  [ "$name" = smoke ] || cp $W/$name/*.json $OUT/ 2>/dev/null
  grep -h "^\[" $LOG | tail -4
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total,temperature.gpu,power.draw --format=csv;
  $P -c "import torch, triton; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.get_device_name(0), triton.__version__)"; } >> $LOG 2>&1
cat $LOG
SECTIONS=${SECTIONS:-recompute,saved,moe,moe_concat,dense}
declare -A TO=([recompute]=135 [saved]=45 [moe]=120 [moe_concat]=50 [dense]=65 [dispatch]=150)
sec smoke 60 --smoke --only $SECTIONS
for s in ${SECTIONS//,/ }; do
  sec $s ${TO[$s]} --only $s $([ $s = saved ] || echo "--budget $s=$(( ${TO[$s]} - 15 ))")
done
echo "=== all done t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
ls -la $OUT

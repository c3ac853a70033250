#!/bin/bash
# The seventh H100 call (benchmarks/data/h100/rounds): OUT=DIR bash benchmarks/h100_rounds.sh
# The held-out dense rows under the three twin variants in interleaved rounds with the host's eager-op table before
# and after (benchmarks/gpu_dense_rounds.py); the tiny-shape host rows of the twin as it runs today (gpu_reference.py
# --only host_model) and bare views (gpu_moe_launches.py --only ops) on the same host; the held-out MoE rows
# (gpu_h100.py --only steps_moe); Chrome traces of the two host-bound GPT rows (gpu_step_traces.py). Each a
# process under a hard timeout, its JSON copied into $OUT as soon as it ends.
set -u
D=$(cd "$(dirname "$0")" && pwd)
W=/tmp/w7; rm -rf $W; mkdir -p $W/smoke $W/rounds $W/traces $W/moe
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
LOG=$OUT/log.txt
T0=$(date +%s)
P=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total,temperature.gpu,power.draw --format=csv;
  lscpu | grep -E "Model name|^CPU\(s\)|MHz"; uptime;
  $P -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.get_device_name(0))"; } >> $LOG 2>&1
timeout -k 3 40 $P $D/gpu_dense_rounds.py --out $W/smoke --smoke --rounds 1 >> $LOG 2>&1
echo "=== smoke rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
timeout -k 3 ${LIMIT:-300} $P $D/gpu_dense_rounds.py --out $W/rounds --rounds ${ROUNDS:-3} --budget rounds=${BUDGET:-260} >> $LOG 2>&1
echo "=== rounds rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
cp $W/rounds/*.json $OUT/ 2>/dev/null
timeout -k 3 60 $P $D/gpu_reference.py --out $W/host --only host_model --budget host_model=${HM_BUDGET:-35} >> $LOG 2>&1
echo "=== host_model rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
cp $W/host/host_model.json $OUT/ 2>/dev/null
timeout -k 3 60 $P $D/gpu_moe_launches.py --out $W/ops --only ops --budget ops=30 >> $LOG 2>&1
echo "=== ops rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
cp $W/ops/launches.json $OUT/ 2>/dev/null
timeout -k 3 ${MOE_LIMIT:-120} $P $D/gpu_h100.py --out $W/moe --only steps_moe --budget steps_moe=100 >> $LOG 2>&1
echo "=== moe rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
cp $W/moe/*.json $OUT/ 2>/dev/null
timeout -k 3 ${TR_LIMIT:-45} $P $D/gpu_step_traces.py --out $W/traces --rows gpt-2048-mb1,gpt-1024-mb2 >> $LOG 2>&1
echo "=== traces rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
mkdir -p $OUT/traces; cp $W/traces/* $OUT/traces/ 2>/dev/null
tail -45 $LOG

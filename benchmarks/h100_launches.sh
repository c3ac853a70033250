#!/bin/bash
# The fifth H100 call (benchmarks/data/h100/launches): OUT=DIR bash benchmarks/h100_launches.sh
# benchmarks/gpu_moe_launches.py on the lent card: a tiny-shape smoke run first, then the launch counts, the tiny
# host rows and the dropless steps (router as initialised and balanced), then the DeepSeek twin's steps
# (benchmarks/gpu_deepseek_steps.py), each under a hard timeout; JSON copied into $OUT.
set -u
D=$(cd "$(dirname "$0")" && pwd)
W=/tmp/w5; rm -rf $W; mkdir -p $W/smoke $W/launches $W/deepseek
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
LOG=$OUT/log.txt
T0=$(date +%s)
P=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total,temperature.gpu,power.draw --format=csv;
  $P -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.get_device_name(0))"; } >> $LOG 2>&1
timeout -k 3 60 $P $D/gpu_moe_launches.py --out $W/smoke --smoke --only ops,dropless >> $LOG 2>&1
echo "=== smoke rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
timeout -k 3 ${LIMIT:-300} $P $D/gpu_moe_launches.py --out $W/launches --only ${ONLY:-ops,layers,dropless} \
    --budget ${BUDGET:-ops=40,layers=70,dropless=170} >> $LOG 2>&1
echo "=== launches rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
cp $W/launches/*.json $OUT/ 2>/dev/null
timeout -k 3 ${DS_LIMIT:-190} $P $D/gpu_deepseek_steps.py --out $W/deepseek --budget-s 140 >> $LOG 2>&1
echo "=== deepseek rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
cp $W/deepseek/*.json $OUT/ 2>/dev/null
tail -40 $LOG

#!/bin/bash
# The fourth H100 call (2026-12-07 03:55 UTC, benchmarks/data/h100/twin3): OUT=DIR bash benchmarks/h100_recompute.sh
# Only the recompute rows of benchmarks/gpu_h100_twin.py with the twin that keeps Paddle's saved tensors
# (`--saved-variants`): a tiny-shape smoke run first, then the rows under a hard timeout; JSON copied into $OUT.
set -u
D=$(cd "$(dirname "$0")" && pwd)
W=/tmp/w4; rm -rf $W; mkdir -p $W/smoke $W/recompute
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
LOG=$OUT/log.txt
T0=$(date +%s)
P=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total,temperature.gpu,power.draw --format=csv;
  $P -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.get_device_name(0))"; } >> $LOG 2>&1
timeout -k 3 60 $P $D/gpu_h100_twin.py --out $W/smoke --smoke --only recompute --saved-variants >> $LOG 2>&1
echo "=== smoke rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
timeout -k 3 170 $P $D/gpu_h100_twin.py --out $W/recompute --only recompute --saved-variants --budget recompute=150 >> $LOG 2>&1
echo "=== recompute rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
cp $W/recompute/*.json $OUT/ 2>/dev/null
grep "^\[recompute\]" $LOG | tail -40

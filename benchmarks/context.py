"""Context parallelism on CPU: bytes one rank holds for a micro-batch's backward, and step time, vs one process.

    python benchmarks/context.py [--seq 1024,2048] [--steps 3]

For each sequence length: a small Llama (hidden 128, 4 heads, 2 kv heads, 2 layers, math attention, fp32) trains
`--steps` steps of micro-batch 1 x 2 accumulation on one process, then on 2 CPU processes under cp2 with each
exchange (ring, allgather, a2a; a launch each), from a synthetic corpus written here (EOD-terminated documents, the
shipped 16k tokenizer). Read back from each run: memory.json's `activation_bytes` (rank 0; what one micro-batch's
forward leaves allocated for its backward, logits included) and the mean `step_time` of the steps after the first.
Prints a markdown table of both and their ratios to one process. On 2 shared cores the cp2 step times include the
gloo stand-ins' extra traffic (an all-gather per ring step) and two processes sharing the machine: they are not
what a GPU ring costs; the memory ratios are the point (about 1/cp and falling with the length, as the one-process
math core's s x s probabilities dominate).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))
TOKENIZER = os.path.join(REPO, "tokenizers", "pd1998-bpe16k")
COMMS = ("ring", "allgather", "a2a")


def corpus(root: Path) -> str:
    import numpy as np

    from llmtrain.data.indexed import IndexedWriter
    from llmtrain.tokenizer import load_tokenizer

    rng = np.random.default_rng(0)
    lengths = rng.integers(200, 3000, size=400)
    tokens = rng.integers(10, 16000, size=int(lengths.sum())).astype(np.uint16)
    tokens[np.cumsum(lengths) - 1] = load_tokenizer(TOKENIZER).eod_id
    w = IndexedWriter(str(root / "synthetic"), np.uint16)
    w.add_documents(tokens, lengths)
    w.finalize()
    return str(root / "synthetic")


def overrides(prefix: str, run_dir: Path, seq: int, steps: int) -> list[str]:
    return ["model=llama-tiny", "model.hidden_size=128", "model.num_layers=2", "model.num_heads=4",
            "model.num_kv_heads=2", "model.ffn_hidden_size=256", "model.attention=math",
            f"model.max_position_embeddings={seq}", f"data.prefixes=[{prefix}]", f"data.tokenizer={TOKENIZER}",
            f"data.seq_len={seq}", "data.split='100,0,0'", "data.num_workers=0", f"train.max_steps={steps}",
            "train.global_batch_size=2", "train.micro_batch_size=1", "train.progress_bar=false",
            "train.visualdl=false", "train.log_interval=1", "checkpoint.save_final=false", "checkpoint.resume=none",
            "checkpoint.interval=0", f"run.dir={run_dir}"]


def read(run_dir: Path) -> tuple[int, float]:
    memory = json.loads((run_dir / "memory.json").read_text())
    times = [r["step_time"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "step_time" in r][1:]
    return memory["ranks"][0]["activation_bytes"], sum(times) / len(times)


def main(argv=None) -> int:
    from launch import run_many

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", default="1024,2048", help="comma-separated sequence lengths")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prefix = corpus(root)
        for seq in (int(s) for s in a.seq.split(",")):
            out = root / f"s{seq}"
            run_many([overrides(prefix, out / "one", seq, a.steps)], nproc=0, workdir=out / "one_launch")
            for c in COMMS:  # one launch each: a launch has 400 s (tests/launch.py), slow at 4k on shared cores
                run_many([overrides(prefix, out / c, seq, a.steps) + ["+parallel=cp2", f"parallel.cp_comm={c}"]],
                         nproc=2, workdir=out / f"{c}_launch")
            one_bytes, one_time = read(out / "one")
            rows.append((seq, "one process", one_bytes, one_time, 1.0, 1.0))
            for c in COMMS:
                held, t = read(out / c)
                rows.append((seq, f"cp2 {c}", held, t, held / one_bytes, t / one_time))
    print("| seq | layout | held for backward (MB, rank 0) | vs one process | step time (s) | vs one process |")
    print("|---|---|---|---|---|---|")
    for seq, name, held, t, rb, rt in rows:
        print(f"| {seq} | {name} | {held / 1e6:.1f} | {rb:.2f} | {t:.3f} | {rt:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

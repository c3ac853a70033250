"""FP8's loss gap: the same run in fp32, FP8-emulated blockwise and FP8-emulated tensorwise, side by side.

    scripts/prepare_default_corpus.sh                     # the embedded People's Daily corpus
    python benchmarks/fp8.py --steps 300 --models llama-tiny --out benchmarks/data/fp8_llama_tiny.json
    python benchmarks/fp8.py --steps 300 --models moe-tiny --out benchmarks/data/fp8_moe_tiny.json
    python benchmarks/fp8.py --report benchmarks/data/fp8_*.json --plot benchmarks/data/fp8_loss_gap.png

For each model (llama-tiny, moe-tiny) and each `train.fp8` (none, blockwise, tensorwise) one
`python llmtrain/pretrain.py` run on CPU with the same seed, data order and initialisation (only `train.fp8`
differs), reading each step's training loss from its metrics.jsonl. The divergence guard's spike tests are off
(a batch of 4 x 64 tokens is noisy enough to trip them, and a rejected step would end a run without checkpoints);
its non-finite and FP8 checks stay on. Reported per model and recipe: the mean gap
(FP8 loss - fp32 loss) and the mean |gap| over the last `--window` steps, the largest |gap| over the whole run,
and the final losses. The runs go one after the other (never two at once on the shared cores); only losses are
compared, so the machine's speed does not enter the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("llama-tiny", "moe-tiny")
RECIPES = ("none", "blockwise", "tensorwise")


def run_losses(model: str, fp8: str, *, steps: int, seq: int, batch: int, workdir: str) -> list[float]:
    """Training loss of every step of one run (step 1..steps)."""
    run_dir = os.path.join(workdir, f"{model}-{fp8}")
    cmd = [sys.executable, os.path.join(REPO, "llmtrain", "pretrain.py"), f"model={model}", f"train.fp8={fp8}",
           f"train.max_steps={steps}", f"train.global_batch_size={batch}", f"data.seq_len={seq}",
           "train.progress_bar=false", "train.visualdl=false", "checkpoint.save_final=false", f"run.dir={run_dir}",
           "optim.warmup_steps=20", "train.anomaly.grad_norm_spike=0", "train.anomaly.loss_spike=1000"]
    env = dict(os.environ, PYTHONPATH=REPO)
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    losses = {}
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec and "step" in rec and rec.get("event") is None:
                losses[int(rec["step"])] = float(rec["loss"])
    return [losses[s] for s in range(1, steps + 1)]


def gap_rows(curves: dict, window: int) -> list[dict]:
    """One row per (model, FP8 recipe): the gap to the fp32 run of the same model."""
    rows = []
    for model, by_recipe in curves.items():
        base = by_recipe["none"]
        for recipe in RECIPES[1:]:
            gap = [a - b for a, b in zip(by_recipe[recipe], base)]
            tail = gap[-window:]
            rows.append({"model": model, "recipe": recipe, "steps": len(gap),
                         "mean_gap_last": sum(tail) / len(tail), "mean_abs_gap_last": sum(map(abs, tail)) / len(tail),
                         "max_abs_gap": max(map(abs, gap)), "final_fp32": base[-1], "final_fp8": by_recipe[recipe][-1]})
    return rows


def table(rows: list[dict], window: int) -> str:
    lines = [f"| model | recipe | steps | mean gap, last {window} (nats) | mean abs gap, last {window} | max abs gap "
             "| final loss fp32 | final loss FP8 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['recipe']} | {r['steps']} | {r['mean_gap_last']:+.4f} | "
                     f"{r['mean_abs_gap_last']:.4f} | {r['max_abs_gap']:.4f} | {r['final_fp32']:.4f} | "
                     f"{r['final_fp8']:.4f} |")
    return "\n".join(lines)


def plot(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(curves), figsize=(6 * len(curves), 7), sharex=True)
    for col, (model, by_recipe) in enumerate(curves.items()):
        for recipe, losses in by_recipe.items():
            axes[0, col].plot(range(1, len(losses) + 1), losses, label=recipe if recipe != "none" else "fp32",
                              linewidth=0.8)
            if recipe != "none":
                axes[1, col].plot(range(1, len(losses) + 1), [a - b for a, b in zip(losses, by_recipe["none"])],
                                  label=recipe, linewidth=0.8)
        axes[0, col].set_title(f"{model}: training loss")
        axes[1, col].set_title(f"{model}: FP8 loss - fp32 loss (nats)")
        axes[1, col].axhline(0.0, color="black", linewidth=0.5)
        axes[1, col].set_xlabel("step")
        for ax in axes[:, col]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=None, help="write the curves and the table's rows as JSON")
    ap.add_argument("--plot", default=None, help="write the loss and gap curves as PNG")
    ap.add_argument("--report", nargs="+", default=None, help="no runs: the table and plot of earlier --out files")
    args = ap.parse_args()
    curves: dict = {}
    if args.report:
        for path in args.report:
            with open(path, encoding="utf-8") as f:
                curves.update(json.load(f)["curves"])
        print(table(gap_rows(curves, args.window), args.window))
        if args.plot:
            plot(curves, args.plot)
        return
    with tempfile.TemporaryDirectory() as workdir:
        for model in args.models.split(","):
            curves[model] = {}
            for recipe in RECIPES:
                curves[model][recipe] = run_losses(model, recipe, steps=args.steps, seq=args.seq, batch=args.batch,
                                                   workdir=workdir)
                print(f"{model} {recipe}: final loss {curves[model][recipe][-1]:.4f}", flush=True)
    rows = gap_rows(curves, args.window)
    print(table(rows, args.window))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"steps": args.steps, "seq_len": args.seq, "global_batch": args.batch, "window": args.window,
                       "rows": rows, "curves": curves}, f)
    if args.plot:
        plot(curves, args.plot)


if __name__ == "__main__":
    main()

"""Loss curve and throughput from metrics.jsonl, as a PNG.

    python -m llmtrain.train.plot outputs/gpt-tiny-dp2/metrics.jsonl   # writes loss_curve.png beside it
"""
from __future__ import annotations

import os
import sys

from llmtrain.train.metrics import read_metrics


def plot_metrics(metrics_path: str, png_path: str | None = None) -> str:
    """Loss (and eval loss) against step, tokens/s below; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    png_path = png_path or os.path.join(os.path.dirname(metrics_path), "loss_curve.png")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[2, 1])
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax1.set_ylabel("loss")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot([r["step"] for r in train], [r["tokens_per_sec"] for r in train], color="tab:green")
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(metrics_path))))
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


if __name__ == "__main__":
    print(plot_metrics(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))

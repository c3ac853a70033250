"""Loss curve and throughput from metrics.jsonl, as a PNG titled with the run directory's name.

    python -m llmtrain.train.plot outputs/gpt-tiny-dp2/metrics.jsonl   # writes loss_curve.png beside it

matplotlib's default font has no CJK glyphs: a Chinese run name is drawn with an installed font that has them, or,
with none installed, shown with `?` in their place and a line naming the font to install (`drawable_title`).
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
    title, font = drawable_title(os.path.basename(os.path.dirname(os.path.abspath(metrics_path))))
    fig.suptitle(title, fontproperties=font)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def _draws(path: str, text: str) -> bool:
    """Whether the font file at `path` has a glyph for every character of `text`."""
    from matplotlib.ft2font import FT2Font

    try:
        charmap = FT2Font(path).get_charmap()
    except (OSError, RuntimeError):
        return False
    return all(ord(c) in charmap for c in text if not c.isspace())


def drawable_title(name: str):
    """(title, font properties or None) for a run named `name`: the default font when it draws every character,
    else an installed font that does (a CJK one for a Chinese run name), else the name with the characters no
    installed font draws shown as `?` and a line saying which font to install (matplotlib would draw boxes)."""
    from matplotlib import font_manager

    default = font_manager.findfont(font_manager.FontProperties())
    if _draws(default, name):
        return name, None
    for entry in font_manager.fontManager.ttflist:  # matplotlib's LastResort font "has" every glyph, as a box
        if "lastresort" not in entry.name.replace(" ", "").lower() and _draws(entry.fname, name):
            return name, font_manager.FontProperties(fname=entry.fname)
    shown = "".join(c if _draws(default, c) else "?" for c in name)
    from llmtrain.utils.log import log0

    log0(f"loss_curve.png: no installed font draws the run name {name!r}; its title shows {shown!r} (install a CJK "
         "font, e.g. Debian's fonts-noto-cjk, to draw it)")
    return f"{shown}\n(run name in characters no installed font draws: install a CJK font such as fonts-noto-cjk)", None


if __name__ == "__main__":
    print(plot_metrics(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))

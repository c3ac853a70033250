"""ernie-tiny masked-LM pretraining: dp2, tp2 and pp2 equal one process; tokens are the masked positions.

    python -m pytest tests/parallel/test_ernie_parity.py -q

A tiny ERNIE-style encoder (4 post-norm layers, tied MLM head) with whole-word masking on the
gold-segmented tiny corpus, 8 optimizer steps with a global batch of 8 (micro-batch 2), through the
real entry function under `paddle.distributed.launch` on CPU processes. The objective follows the
model family (`model=ernie-tiny` gives MLMData); loss and grad_norm are read from metrics.jsonl. tp2pp2 runs in
the tp2pp2 launch of tests/parallel/test_parity.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from llmtest import compose, tiny_overrides
from launch import metrics, run_many

TOL = 1e-4
STEPS = 8
LAYOUTS = [("dp2", 2), ("tp2", 2), ("pp2", 2)]


def overrides(corpus, run_dir):
    return tiny_overrides(corpus, run_dir, "ernie", steps=STEPS) + ["optim.lr=3e-3"]


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ernie_ref")
    run_many([overrides(tiny_corpus, str(out / "run"))], nproc=0, workdir=out)
    return metrics(out / "run")


@pytest.mark.slow
def test_tokens_are_the_masked_positions(reference, tiny_corpus, tmp_path):
    """Recount every step's loss mask on one process: metrics `tokens` is the number of masked positions."""
    from llmtrain.config import to_config
    from llmtrain.data.mlm import MLMData

    cfg = to_config(compose(overrides(tiny_corpus, str(tmp_path))))
    assert cfg.data.masking.strategy == "whole_word"
    data = MLMData(cfg.data, seed=cfg.seed, global_batch_size=8, micro_batch_size=8)
    total = 0
    for rec in reference:
        (mb,) = data.next_step()
        masked = int(mb["loss_mask"].sum())
        maskable = int(data.masker.maskable(mb["labels"]).sum())
        assert rec["tokens"] == masked and abs(masked / maskable - 0.15) <= 0.01
        assert masked < 0.2 * mb["input_ids"].size  # not samples x seq_len
        total += masked
        assert rec["tokens_total"] == total
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["loss"]) for r in reference)
    assert np.mean([r["loss"] for r in reference[-3:]]) < np.mean([r["loss"] for r in reference[:3]])


@pytest.mark.slow
@pytest.mark.parametrize("layout,nproc", LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_ernie_layout_matches_single_process(layout, nproc, reference, tiny_corpus, tmp_path):
    run_many([overrides(tiny_corpus, str(tmp_path / "run")) + [f"+parallel={layout}"]], nproc=nproc, workdir=tmp_path)
    got = metrics(tmp_path / "run")
    assert [r["step"] for r in got] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    for r, g in zip(reference, got):
        assert abs(g["loss"] - r["loss"]) <= TOL, (layout, r["step"], g["loss"], r["loss"])
        assert abs(g["grad_norm"] - r["grad_norm"]) <= TOL, (layout, r["step"], g["grad_norm"], r["grad_norm"])
        assert g["tokens"] == r["tokens"] and g["tokens_total"] == r["tokens_total"]  # never x tp or x pp

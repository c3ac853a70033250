"""ernie-tiny masked-LM pretraining on one process: `tokens` are the masked positions, and the loss falls.

    python -m pytest tests/train/test_mlm_tokens.py -q

A tiny ERNIE-style encoder (4 post-norm layers, tied MLM head) with whole-word masking on the
gold-segmented tiny corpus, 8 optimizer steps with a global batch of 8 (micro-batch 2), through the
real entry function in this process (as tests/checkpoint/test_integrity.py runs it). The objective follows the
model family (`model=ernie-tiny` gives MLMData). The same run under dp2, tp2, pp2 and tp2pp2 is compared with
one process in those launches of tests/parallel/test_parity.py (run "ernie").
"""
from __future__ import annotations

import numpy as np
import pytest

from llmtest import compose, tiny_overrides
from launch import metrics

STEPS = 8


def overrides(corpus, run_dir):
    return tiny_overrides(corpus, run_dir, "ernie", steps=STEPS) + ["optim.lr=3e-3"]


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory):
    from llmtrain.pretrain import pretrain

    out = tmp_path_factory.mktemp("ernie_ref")
    pretrain(compose(overrides(tiny_corpus, str(out / "run"))))
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

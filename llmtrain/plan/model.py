"""The model the planner plans: the configured preset with its vocabulary filled in.

    python -m llmtrain.plan model=llama-7b plan.devices=8
    model = planned_model(cfg)        # ModelConfig; vocab_size from the tokenizer when the preset leaves it null

The same rule `llmtrain.resolve` applies before training (the tokenizer's padded size
when `model.vocab_size` is null), so a plan and the run it predicts count the same
embedding table.
"""
from __future__ import annotations

import dataclasses

from llmtrain.errors import ConfigError


def planned_model(cfg):
    """`cfg.model`, with `vocab_size` read from `data.tokenizer` when it is null; raises ConfigError if unreadable."""
    model = cfg.model
    if model.vocab_size is not None:
        return model
    from llmtrain.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(cfg.data.tokenizer)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ConfigError([f"data.tokenizer={cfg.data.tokenizer}: {e}",
                           "model.vocab_size is null and the tokenizer could not be read: give model.vocab_size"])
    return dataclasses.replace(model, vocab_size=tok.vocab_size)

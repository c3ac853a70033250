"""Small setup steps of the entry scripts: vocabulary, PaddleNLP import, run directory.

    fit_vocab(cfg.model, tokenizer); state = import_initial_state(cfg); prepare_run_dir(cfg, dcfg, topo)
"""
from __future__ import annotations

import os

from omegaconf import OmegaConf

from llmtrain.parallel.layout import ConfigError
from llmtrain.utils.log import log0


def fit_vocab(model_cfg, tokenizer) -> None:
    """model.vocab_size: the tokenizer's padded size when null; never smaller than the tokenizer's."""
    if model_cfg.vocab_size is None:
        model_cfg.vocab_size = tokenizer.vocab_size
    elif model_cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            [f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})"]
        )


def _read_own_checkpoint(src: str):
    """(ModelConfig, lazy state) of one of our step_<N> checkpoints (model weights only)."""
    import json

    from llmtrain.checkpoint.manager import verify_files
    from llmtrain.checkpoint.shards import ShardIndex
    from llmtrain.models.config import ModelConfig

    problems = verify_files(src)
    if problems:
        raise ConfigError([f"model.init_from={src}: " + p for p in problems])
    with open(os.path.join(src, "manifest.json")) as f:
        manifest = json.load(f)
    return ModelConfig(**manifest["model"]), ShardIndex(src).model_state()


def import_initial_state(cfg):
    """Full canonical tensors of the checkpoint at model.init_from (None if unset).

    A PaddleNLP directory (config.json + weights) or one of our step_<N>
    checkpoints (manifest.json; model weights only: optimizer, schedule and data
    position start fresh, as fine-tuning wants). The checkpoint's architecture
    replaces the configured one (it is the truth for its weights); the attention
    kernel choice is kept."""
    src = cfg.model.init_from
    if not src:
        return None
    if os.path.exists(os.path.join(src, "manifest.json")):
        model_cfg, state = _read_own_checkpoint(src)
    else:
        from llmtrain.interop.paddlenlp_format import read_paddlenlp_checkpoint

        inside_run = os.path.abspath(src).startswith(os.path.abspath(cfg.run.dir) + os.sep)
        model_cfg, state, _ = read_paddlenlp_checkpoint(src, trusted=inside_run, lazy=True)
    vocab = cfg.model.vocab_size
    model_cfg.attention = cfg.model.attention
    model_cfg.init_from = src
    model_cfg.name = cfg.model.name if cfg.model.name else model_cfg.name
    if vocab is not None and model_cfg.vocab_size < vocab:
        raise ConfigError([f"model.init_from={src}: checkpoint vocabulary {model_cfg.vocab_size} < tokenizer's {vocab}"])
    cfg.model = model_cfg
    log0(f"model.init_from={src}: {len(state)} tensors, architecture from its config.json")
    return state


def prepare_run_dir(cfg, dcfg, topo) -> None:
    """Create <run.dir> and, on rank 0, write the resolved config as config.yaml."""
    os.makedirs(cfg.run.dir, exist_ok=True)
    if topo.rank == 0:
        path = os.path.join(cfg.run.dir, "config.yaml")
        with open(path + ".tmp", "w") as f:
            f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        os.replace(path + ".tmp", path)

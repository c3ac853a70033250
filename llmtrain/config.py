"""The root configuration: dataclass schemas for every group, registered with Hydra.

    python llmtrain/pretrain.py --cfg job            # print the composed config
    python llmtrain/pretrain.py model=llama-tiny +parallel=dp2 train.max_steps=50

Groups (`conf/<group>/*.yaml`) fill the typed sections below; `parallel` is not
in the defaults list, so `+parallel=NAME` appends it and its absence means one
device. Each section's schema lives with the package it configures.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from llmtrain.checkpoint.config import CheckpointConfig
from llmtrain.data.config import DataConfig
from llmtrain.models.config import ModelConfig
from llmtrain.parallel.config import ParallelConfig
from llmtrain.train.config import OptimConfig, TrainConfig


@dataclass
class RunConfig:
    name: str = "${model.name}-${oc.select:parallel.name,single}"
    """Run label; the default is the model and layout names."""

    dir: str = "outputs/${run.name}"
    """The run directory (metrics.jsonl, loss curve, checkpoints, VisualDL). Every rank computes the same path:
    it never depends on the clock."""


@dataclass
class Config:
    model: ModelConfig = MISSING
    """Model architecture (`conf/model/`)."""

    data: DataConfig = MISSING
    """Corpus, tokenizer, sequence length, blending (`conf/data/`)."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule (`conf/optim/`)."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch arithmetic, precision, logging (`conf/train/`)."""

    parallel: Optional[ParallelConfig] = None
    """Parallel layout (`+parallel=NAME`, `conf/parallel/`); null means one device."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""

    run: RunConfig = field(default_factory=RunConfig)
    """Where the run writes."""

    seed: int = 1234
    """Seed of parameter initialisation (by parameter name) and data order."""


def register_configs() -> None:
    """Register the root schema (`base_config`) and group schemas (`<group>/base`)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="model", name="base", node=ModelConfig)
    cs.store(group="data", name="base", node=DataConfig)
    cs.store(group="optim", name="base", node=OptimConfig)
    cs.store(group="train", name="base", node=TrainConfig)
    cs.store(group="parallel", name="base", node=ParallelConfig)


def to_config(cfg) -> Config:
    """The composed DictConfig as a typed `Config` object (all interpolations resolved)."""
    return OmegaConf.to_object(cfg)


def compose_config(overrides=(), config_dir: Optional[str] = None):
    """The root config composed exactly as `llmtrain/pretrain.py` would, without running it.

        cfg = compose_config(["model=llama-tiny", "+parallel=tp2", "train.max_steps=5"])
    """
    import os

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    config_dir = config_dir or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=config_dir):
        return compose(config_name="config", overrides=list(overrides))

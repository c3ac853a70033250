"""The root configuration: dataclass schemas for every group, registered with Hydra.

    python llmtrain/pretrain.py --cfg job            # print the composed config
    python llmtrain/pretrain.py model=llama-tiny +parallel=dp2 train.max_steps=50

Groups (`conf/<group>/*.yaml`) fill the typed sections below; `parallel` is not
in the defaults list, so `+parallel=NAME` appends it and its absence means one
device. Each section's schema lives with the package it configures.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from llmtrain.checkpoint.config import CheckpointConfig
from llmtrain.data.config import DataConfig
from llmtrain.data.sft import SFTDataConfig
from llmtrain.errors import ConfigError, FrozenConfigError  # noqa: F401  (raised here; importable from here)
from llmtrain.models.config import ModelConfig
from llmtrain.models.lora import FinetuneOptions
from llmtrain.parallel.config import ParallelConfig
from llmtrain.plan.config import PlanConfig
from llmtrain.train.config import OptimConfig, TrainConfig


@dataclass
class RunConfig:
    name: str = "${model_label:}-${layout_tag:}"
    """Run label; the default is the model name and the layout's real degrees (`gpt-tiny-tp2pp2` for
    `+parallel=tp2 parallel.pp=2`, `gpt-tiny-single` for one device; `llmtrain.parallel.config.layout_tag`); with
    `model.init_from` the checkpoint's name instead of the preset's (`Qwen3-0.6B-tp2`, `gpt-tiny-step200-single`:
    `llmtrain.checkpoint.listing.init_label`)."""

    dir: str = "outputs/${run.name}"
    """The run directory (metrics.jsonl, loss curve, checkpoints, VisualDL); it belongs to one run: a new run in a
    directory holding another run's checkpoints is refused up front (`llmtrain.train.rundir`). Every rank computes
    the same path: it never depends on the clock."""

    overwrite: bool = False
    """Start a new run in `dir` even though it holds another run: that run is moved aside to `<dir>.old-<k>` first
    (never deleted). Without it, a new run (checkpoint.resume=none, or a config that cannot continue the
    checkpoints there) in such a directory is refused."""


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

    plan: PlanConfig = field(default_factory=PlanConfig)
    """Planner settings (`python -m llmtrain.plan`); ignored by training."""

    finetune: FinetuneOptions = field(default_factory=FinetuneOptions)
    """Parameter-efficient fine-tuning (`finetune.lora.*`, `llmtrain/models/lora.py`); off by default."""


@dataclass
class FinetuneConfig(Config):
    data: SFTDataConfig = MISSING
    """Fine-tuning records, tokenizer, sequence length (`conf/data/sft.yaml`)."""


def register_configs() -> None:
    """Register the root schemas (`base_config`, `base_finetune_config`), group schemas (`<group>/base`) and the
    `layout_tag` and `model_label` resolvers of the default run name. Once per process: registered already (the
    store and the resolvers there), it returns at once (each store builds its schema's structured config: ~0.3 s)."""
    from llmtrain.parallel.config import layout_tag

    cs = ConfigStore.instance()
    if all(OmegaConf.has_resolver(r) for r in ("layout_tag", "model_label")) and "base_config.yaml" in cs.repo \
            and "base.yaml" in cs.repo.get("parallel", {}):
        return
    OmegaConf.register_new_resolver("layout_tag", lambda *, _root_: layout_tag(_root_.get("parallel")), replace=True)
    OmegaConf.register_new_resolver("model_label", lambda *, _root_: model_label(_root_.model), replace=True)
    cs.store(name="base_config", node=Config)
    cs.store(name="base_finetune_config", node=FinetuneConfig)
    cs.store(group="data", name="base_sft", node=SFTDataConfig)
    cs.store(group="model", name="base", node=ModelConfig)
    cs.store(group="data", name="base", node=DataConfig)
    cs.store(group="optim", name="base", node=OptimConfig)
    cs.store(group="train", name="base", node=TrainConfig)
    cs.store(group="parallel", name="base", node=ParallelConfig)


def preset_config(group: str, name: str):
    """The typed config of conf/<group>/<name>.yaml (each preset's only default is its group's schema), read from its
    file without a Hydra composition."""
    raw = OmegaConf.load(os.path.join(CONF_DIR, group, f"{name}.yaml"))
    raw.pop("defaults", None)
    schema = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig,
              "parallel": ParallelConfig}[group]
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw))


def default_preset(group: str, config_name: str = "config"):
    """The typed config of the preset the root config's defaults list picks for `group` (`gpt-tiny` for `model` in
    conf/config.yaml)."""
    root = OmegaConf.load(os.path.join(CONF_DIR, f"{config_name}.yaml"))
    entries = [d for d in root.defaults if not isinstance(d, str)]  # `- model: gpt-tiny` entries (not `- base`)
    return preset_config(group, next(d[group] for d in entries if group in d))


def model_label(model) -> str:
    """The model part of the default run name: the preset's `model.name`, or with `model.init_from` the checkpoint's
    (`llmtrain.checkpoint.listing.init_label`: the architecture, and so the run, is the checkpoint's)."""
    from llmtrain.checkpoint.listing import init_label

    return init_label(model.init_from) if model.get("init_from") else model.name


def model_preset_named() -> Optional[bool]:
    """Whether the command line named a model preset (`model=NAME`), read from Hydra's overrides inside an entry
    script; None when Hydra's runtime is not there (the compose API: `llmtrain.resolve` then decides)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return any(o.split("=", 1)[0].lstrip("+~") == "model" for o in HydraConfig.get().overrides.task)


def to_config(cfg) -> Config:
    """The composed DictConfig as a typed `Config` object (all interpolations resolved); a key that a `+key=value`
    added and the schema lacks is a ConfigError (to_object would drop it silently)."""
    from llmtrain.utils.overrides import composed_problems

    schema = OmegaConf.get_type(cfg)  # Config or FinetuneConfig: the root schema the tree was composed on
    command = "python llmtrain/finetune.py" if schema is FinetuneConfig else "python llmtrain/pretrain.py"
    problems = composed_problems(cfg, schema, command) if dataclasses.is_dataclass(schema) else []
    if problems:
        raise ConfigError(problems)
    return OmegaConf.to_object(cfg)


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
ROOTS = {"config": (Config, "python llmtrain/pretrain.py"), "finetune": (FinetuneConfig, "python llmtrain/finetune.py")}
"""Root config name -> (schema, the command that prints it)."""


def presets() -> dict[str, list[str]]:
    """{group: preset names} of `conf/<group>/*.yaml`."""
    out = {}
    for group in sorted(os.listdir(CONF_DIR)):
        if os.path.isdir(os.path.join(CONF_DIR, group)):
            out[group] = sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, group)) if f.endswith(".yaml"))
    return out


def command_line_problems(argv: list[str], config_name: str = "config", command: Optional[str] = None) -> list[str]:
    """Unknown keys and presets among the Hydra overrides of a command line (`llmtrain.utils.overrides`), with and
    without `+`, each with the nearest valid override."""
    from hydra._internal.utils import get_args_parser  # Hydra's own parser of its command line (--cfg, -m, ...)

    args, rest = get_args_parser().parse_known_args(argv)
    from llmtrain.utils.overrides import override_problems

    schema, default_command = ROOTS.get(args.config_name or config_name, ROOTS[config_name])
    overrides = args.overrides + [a for a in rest if not a.startswith("-")]  # overrides after an option too
    return override_problems(overrides, schema, presets(), command or default_command)


def refuse_unknown_keys(config_name: str = "config", argv: Optional[list[str]] = None,
                        command: Optional[str] = None) -> None:
    """Before Hydra runs: exit with status 2 (rank 0 prints the problems) when an override names no config key or
    preset (`train.max_step=10`, `+train.max_step=10`, `model=llama-tinny`)."""
    import sys

    problems = command_line_problems(sys.argv[1:] if argv is None else argv, config_name, command)
    if problems:
        from llmtrain.train.entry import exit_config_error

        exit_config_error(ConfigError(problems))


def compose_config(overrides=(), config_dir: Optional[str] = None, config_name: str = "config"):
    """The root config composed exactly as `llmtrain/pretrain.py` would, without running it.

        cfg = compose_config(["model=llama-tiny", "+parallel=tp2", "train.max_steps=5"])
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    config_dir = config_dir or CONF_DIR
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=config_dir):
        return compose(config_name=config_name, overrides=list(overrides))


_CHOICES = {
    "model.family": ("decoder", "encoder"),
    "model.position": ("learned", "rope"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.activation": ("gelu", "gelu_tanh", "swiglu"),
    "model.norm_position": ("pre", "post"),
    "model.attention": ("auto", "flash", "math"),
    "train.amp": ("none", "bf16", "fp16"),
    "optim.name": ("adamw",),
    "optim.schedule": ("cosine", "linear", "constant", "wsd"),
}


def config_problems(cfg: Config) -> list[str]:
    """Value checks that need no hardware or files: one line per problem, naming the field and its value."""
    problems = []

    def get(path):
        obj = cfg
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    for path, allowed in _CHOICES.items():
        if get(path) not in allowed:
            problems.append(f"{path}={get(path)!r}: expected one of {', '.join(allowed)}")
    positive = ["model.hidden_size", "model.num_layers", "model.num_heads", "model.ffn_hidden_size",
                "model.max_position_embeddings", "train.max_steps", "train.log_interval", "data.seq_len"]
    for path in positive:
        if get(path) <= 0:
            problems.append(f"{path}={get(path)}: must be > 0")
    for path in ("optim.lr", "optim.min_lr", "optim.weight_decay", "optim.clip_grad", "optim.warmup_steps",
                 "train.eval_interval", "checkpoint.interval", "checkpoint.keep_last"):
        if get(path) < 0:
            problems.append(f"{path}={get(path)}: must be >= 0")
    port = cfg.train.metrics_port
    if port is not None and not 1 <= port <= 65535:
        problems.append(f"train.metrics_port={port}: must be a TCP port in 1..65535 (local rank r serves on port + r)")
    if cfg.train.metrics_linger_s < 0:
        problems.append(f"train.metrics_linger_s={cfg.train.metrics_linger_s}: must be >= 0")
    if cfg.optim.min_lr > cfg.optim.lr:
        problems.append(f"optim.min_lr={cfg.optim.min_lr} > optim.lr={cfg.optim.lr}")
    if cfg.data.seq_len > cfg.model.max_position_embeddings:
        problems.append(
            f"data.seq_len={cfg.data.seq_len} > model.max_position_embeddings={cfg.model.max_position_embeddings}"
        )
    if cfg.model.position == "rope" and cfg.model.num_heads > 0 and (
            cfg.model.head_dim is not None or cfg.model.hidden_size % cfg.model.num_heads == 0):
        if cfg.model.attn_head_dim() % 2:
            where = (f"model.head_dim={cfg.model.head_dim}" if cfg.model.head_dim is not None else
                     f"hidden_size/num_heads = {cfg.model.hidden_size}/{cfg.model.num_heads}")
            problems.append(f"model.position=rope needs an even head dim; {where} is odd")
    from llmtrain.models.rope import attention_problems  # head_dim, qk_norm, rope_scaling, sliding windows

    problems += attention_problems(cfg.model)
    if cfg.model.family == "encoder" and cfg.model.position != "learned":
        problems.append("model.family=encoder uses learned positions: set model.position=learned")
    if cfg.model.qkv_bias is not None and cfg.model.family != "decoder" and cfg.model.qkv_bias != cfg.model.bias:
        problems.append(f"model.qkv_bias={cfg.model.qkv_bias} with model.family={cfg.model.family}: q/k/v-only biases "
                        f"are a decoder switch (Qwen); the encoder follows model.bias={cfg.model.bias} "
                        "(set qkv_bias=null)")

    from llmtrain.train.anomaly import config_problems as anomaly_problems  # train.anomaly.* (divergence guard)

    problems += anomaly_problems(cfg.train.anomaly)
    return problems


def check_config(cfg: Config) -> None:
    """`config_problems`, raised as one ConfigError."""
    problems = config_problems(cfg)
    if problems:
        raise ConfigError(problems)


def _frozen_class(cls: type) -> type:
    """A subclass of the dataclass `cls` whose instances refuse attribute assignment once frozen."""
    cls = getattr(cls, "_cfg_unfrozen", cls)  # dataclasses.replace of a frozen object: same frozen class
    frozen = _FROZEN_CLASSES.get(cls)
    if frozen is None:
        def __setattr__(self, name, value):
            if self.__dict__.get("_cfg_frozen"):
                raise FrozenConfigError(
                    f"cannot set {cls.__name__}.{name}={value!r}: the configuration was resolved once and is frozen "
                    "(derive a new value with dataclasses.replace or change the config before resolving)")
            object.__setattr__(self, name, value)

        def __reduce__(self):
            state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            return _rebuild_frozen, (cls, state)

        frozen = type(cls.__name__, (cls,), {"__setattr__": __setattr__, "__delattr__": __setattr__,
                                            "__reduce__": __reduce__, "__module__": cls.__module__,
                                            "__qualname__": cls.__qualname__, "_cfg_unfrozen": cls})
        _FROZEN_CLASSES[cls] = frozen
    return frozen


_FROZEN_CLASSES: dict = {}


def _rebuild_frozen(cls: type, state: dict):
    return freeze(cls(**state))


def freeze(obj):
    """Freeze a config dataclass tree in place (lists become tuples) and return it.

        run_cfg = freeze(dataclasses.replace(cfg, model=resolved_model))
        run_cfg.model.hidden_size = 8     # FrozenConfigError
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if obj.__dict__.get("_cfg_frozen"):
            return obj
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, list):
                value = tuple(freeze(v) for v in value)
            else:
                value = freeze(value)
            object.__setattr__(obj, f.name, value)
        obj.__class__ = _frozen_class(type(obj))
        object.__setattr__(obj, "_cfg_frozen", True)
    return obj

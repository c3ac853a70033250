"""Resolve a composed configuration once: every derived value, every problem in one message, then freeze it.

    run = resolve(to_config(dcfg))     # ResolvedRun: frozen config, layout, tokenizer, imported weights
    python llmtrain/pretrain.py train.global_batch_size=10 train.micro_batch_size=4   # exit 2, problems listed

Every file the run reads is checked here too: the data prefixes and their tokenizer, the
masked-LM side files and lexicon (`llmtrain.data.inputs`), and what `run.dir` holds against
`checkpoint.resume` (`llmtrain.train.rundir`: a directory belongs to one run; a resume this config
cannot continue is refused before any process group starts); so is every file it writes (`run.dir` and
its checkpoints writable, room for one checkpoint: `llmtrain.train.writable`).

Derived here and nowhere else: the model's vocabulary (the tokenizer's padded size
when `model.vocab_size` is null), the architecture of a checkpoint given by
`model.init_from` (it replaces the preset's: it is the truth for its weights), the
batch arithmetic and the parallel layout (with its pipeline split), and the model FLOPs per token. Value
checks, layout rules, tokenizer and checkpoint problems and model-fits-layout
problems are all collected before one `ConfigError` is raised, so a user fixes
everything in one round. Nothing downstream mutates the configuration: the
returned `cfg` refuses assignment (`llmtrain.config.freeze`).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from llmtrain.config import Config, config_problems, freeze
from llmtrain.errors import ConfigError, RunFinished
from llmtrain.models.config import FUSE_SWITCHES, ModelConfig, fusion_problems
from llmtrain.paddle_compat.kernels import on_gpu
from llmtrain.parallel.layout import Layout, layout_problems, model_fit_problems
from llmtrain.utils.log import log0


@dataclass(frozen=True)
class ResolvedRun:
    """Everything a recipe needs to know before it starts any process group or reads any batch."""

    cfg: Config
    """The configuration with its derived values filled in (`model.vocab_size`, an imported architecture); frozen."""

    layout: Layout
    """Degrees and batch sizes (global = micro x accum x dp x sharding), identical on every rank."""

    tokenizer: Any
    """The loaded tokenizer of `data.tokenizer` (the data classes reuse it)."""

    objective: str
    """`decoder` (next-token batches) or `encoder` (masked-LM batches): the family of the model preset."""

    initial_state: Optional[Mapping[str, Any]]
    """{canonical name: full tensor} (lazy) of `model.init_from`, or None for random initialisation."""

    world_size: int
    """Processes in the job."""

    flops_per_token: float
    """Model FLOPs per processed position (6N + 12 L h s; LoRA: 4N + 6 N_lora + 12 L h s), for tflops and MFU."""

    initial_adapters: Optional[Mapping[str, Any]] = None
    """{canonical `...lora_A`/`lora_B`: full tensor} of `finetune.lora.init_from` (PaddleNLP adapters), or None."""

    run_dir: Optional[Any] = None
    """`llmtrain.train.rundir.RunDirReview`: the checkpoint a resume continues, and where run.overwrite=true moves
    an old run (`claim_run_dir`)."""


def _fp8_emulate_problems(cfg: Config, model, layout) -> list[str]:
    """`train.fp8_emulate` (llmtrain/fp8/emulate.py): a CPU run without the layout it emulates, widths divisible."""
    from types import SimpleNamespace

    from llmtrain.fp8.emulate import emulate_problems

    emulate = cfg.train.fp8_emulate
    if (emulate.tp, emulate.cp, emulate.sequence_parallel) == (1, 1, False):
        return []
    problems = emulate_problems(
        emulate, fp8=cfg.train.fp8, tp=layout.tp if layout is not None else 1,
        cp=layout.cp if layout is not None else 1, seq_len=cfg.data.seq_len, has_experts=model.moe_num_experts > 0,
        fused=model.fused("fuse_qkv") or model.fused("fuse_ffn"))
    if on_gpu():
        problems.append("train.fp8_emulate: a CPU emulation (on a GPU each rank quantises its own slice)")
    if emulate.tp > 1:
        widths = model_fit_problems(SimpleNamespace(tp=emulate.tp, pp=1, virtual_pp=1, pp_layers=None), model)
        problems += [f"train.fp8_emulate.tp={emulate.tp}: {p}" for p in widths]
    return problems


def resolve(cfg: Config, world_size: Optional[int] = None, *, model_named: Optional[bool] = None) -> ResolvedRun:
    """Check and complete `cfg` for a job of `world_size` processes (default: the launcher's); raises ConfigError.
    `model_named`: whether the command named a model preset (`llmtrain.config.model_preset_named`; None: inferred),
    which `model.init_from` checks against the checkpoint."""
    from llmtrain.train.schedule import schedule_problems

    if world_size is None:
        world_size = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    problems: list[str] = []
    tokenizer = _load_tokenizer(cfg.data.tokenizer, problems)
    model, initial_state = _resolve_model(cfg, tokenizer, problems, model_named)
    model = _zero3_projections(model, cfg.parallel, problems)
    resolved = dataclasses.replace(cfg, model=model)
    resolved, initial_adapters = _resolve_lora(resolved, problems)
    layout, layout_issues = layout_problems(cfg.parallel, cfg.train, world_size)
    fit = model_fit_problems(cfg.parallel, model)
    from llmtrain.models.recompute import recompute_problems

    recompute_issues = recompute_problems(cfg.train)  # train.recompute / _modules / _layers
    problems = config_problems(resolved) + layout_issues + problems + fit + recompute_issues
    if layout is not None and layout.pp > 1 and not fit and not recompute_issues:
        layout = _pipeline_split(layout, resolved)
    problems += schedule_problems(cfg.optim, cfg.train.max_steps)
    from llmtrain.train.main_grad import main_grad_problems

    problems += main_grad_problems(cfg.train, cfg.parallel, cfg.finetune.lora.rank > 0, model.tie_embeddings)
    problems += fusion_problems(model, on_gpu())
    from llmtrain.fp8.apply import fp8_problems

    problems += fp8_problems(cfg.train.fp8, cfg.train.amp, on_gpu())
    problems += _fp8_emulate_problems(cfg, model, layout)
    if cfg.parallel is not None and cfg.parallel.sequence_parallel:
        from llmtrain.parallel.sequence import sequence_parallel_problems

        problems += sequence_parallel_problems(cfg.parallel, model, cfg.data.seq_len)

    from llmtrain.data.loader import document_problems
    from llmtrain.parallel.context import context_problems

    problems += document_problems(cfg.data, model)

    problems += context_problems(cfg.parallel, model, cfg.data.seq_len, bool(getattr(cfg.data, "document_mask", False)),
                                 on_gpu())
    from llmtrain.data.rampup import rampup_config_problems
    from llmtrain.data.sft import packing_problems
    from llmtrain.parallel.moe_pipeline import pipeline_moe_problems

    problems += rampup_config_problems(cfg.train.batch_rampup, cfg.data, layout)
    problems += pipeline_moe_problems(model, cfg.parallel, cfg.train.amp, cfg.train.batch_rampup)
    problems += packing_problems(cfg.data, cfg.parallel)
    from llmtrain.data.inputs import data_input_problems
    from llmtrain.train.rundir import review_run_dir

    problems += data_input_problems(cfg.data, tokenizer, model.family)  # every file the data section names
    run_dir = review_run_dir(resolved, layout if not problems else None, tokenizer)  # one run per directory
    problems += run_dir.problems
    from llmtrain.train.writable import output_problems

    problems += output_problems(resolved, space=not problems)  # run.dir writable, room for one checkpoint
    if problems:
        raise ConfigError(problems)
    if run_dir.finished:
        raise RunFinished(run_dir.finished)
    for note in run_dir.notes:
        log0(note)
    from llmtrain.interop.formats import describe_formats

    formats = describe_formats(model)  # said before training, not found after it
    log0(f"model {model.name}: " + (f"`python -m llmtrain.export` can write it as {formats}" if formats != "none" else
                                    "no export format holds it (`python -m llmtrain.export --format F` names the "
                                    "fields each format refuses)"))
    resolved = dataclasses.replace(resolved, checkpoint=dataclasses.replace(resolved.checkpoint, resume=run_dir.resume))
    return ResolvedRun(
        cfg=freeze(resolved), layout=layout, tokenizer=tokenizer, objective=resolved.model.family,
        initial_state=initial_state, world_size=world_size,
        flops_per_token=_flops_per_token(resolved), initial_adapters=initial_adapters, run_dir=run_dir,
    )


def _pipeline_split(layout: Layout, cfg: Config) -> Layout:
    """The layout with its blocks per pipeline chunk: `parallel.pp_layers`, or balanced by the planner's cost of each
    piece on this run's device (`llmtrain.plan.stage_cost`)."""
    from llmtrain.models.recompute import recompute_of
    from llmtrain.plan.estimate import moe_plan, recompute_mode
    from llmtrain.plan.stage_cost import split_profile, with_pipeline_split

    dev = split_profile(on_gpu(), cfg.plan.device)
    return with_pipeline_split(layout, cfg.model, dev, seq_len=cfg.data.seq_len,
                               recompute=recompute_mode(recompute_of(cfg.train, cfg.model.num_layers)),
                               moe=moe_plan(layout, dev, cfg.plan.devices_per_node, cfg.plan.moe_imbalance))


def _resolve_lora(cfg: Config, problems: list[str]):
    """`finetune.lora` checked against the model; with `finetune.lora.init_from`, its rank, alpha, dropout and
    targets replaced by the PaddleNLP adapter directory's, whose tensors are returned."""
    from llmtrain.models.lora_targets import lora_problems

    lora, state = cfg.finetune.lora, None
    if lora.init_from and lora.rank > 0 and cfg.model.family == "decoder":
        from llmtrain.interop.keys import CheckpointMismatch, UnsupportedConfig
        from llmtrain.interop.lora_format import read_paddlenlp_lora

        try:
            settings, state = read_paddlenlp_lora(lora.init_from, cfg.model)
        except (OSError, ValueError, UnsupportedConfig, CheckpointMismatch) as e:
            problems.append(f"finetune.lora.init_from={lora.init_from}: {e}")
        else:
            log0(f"finetune.lora.init_from={lora.init_from}: r={settings['rank']}, alpha={settings['alpha']}, "
                 f"{len(settings['target_modules'])} adapted linears (these replace finetune.lora's)")
            lora = dataclasses.replace(lora, **settings)
            cfg = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, lora=lora))
    if cfg.model.vocab_size is not None:
        problems += lora_problems(cfg.model, lora, cfg.parallel.tp if cfg.parallel is not None else 1)
    return cfg, state


def _zero3_projections(model: ModelConfig, parallel, problems: list[str]) -> ModelConfig:
    """ZeRO-3 gathers a sliced weight only around its own layer's forward, and fused projections (one matmul of
    concatenated weights) never call the q/k/v or gate/up linears: under ZeRO-3 `auto` turns them off, `true` is
    refused (measured on Paddle 3.3.1: "Tensor not initialized yet" in the first forward)."""
    if parallel is None or parallel.sharding <= 1 or parallel.sharding_stage != 3:
        return model
    off = {}
    for switch in ("fuse_qkv", "fuse_ffn"):
        value = str(getattr(model, switch)).lower()
        if value == "true":
            problems.append(f"model.{switch}=true with parallel.sharding_stage=3: ZeRO-3 gathers each sliced weight "
                            "only around its own linear's forward, which the one-matmul projection never calls; "
                            f"set model.{switch}=false (or auto) under ZeRO-3")
        elif value == "auto" and model.fused(switch):
            off[switch] = "false"
    if off:
        log0(f"parallel.sharding_stage=3: {', '.join(f'model.{k}' for k in off)} auto -> false (ZeRO-3 gathers "
             "weights per linear)")
    return dataclasses.replace(model, **off) if off else model


def _flops_per_token(cfg: Config) -> float:
    """Model FLOPs per processed position; under LoRA the frozen base gets no weight gradients (`flops_per_token`)."""
    from llmtrain.models.lora_targets import adapter_numel
    from llmtrain.models.size import flops_per_token

    lora = cfg.finetune.lora
    return flops_per_token(cfg.model, cfg.data.seq_len, adapter_numel(cfg.model, lora) if lora.rank > 0 else None)


def _load_tokenizer(path: str, problems: list[str]):
    from llmtrain.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        problems.append(f"data.tokenizer={path}: {e}")
        return None


ARCHITECTURE = ("family", "position", "norm", "activation", "norm_position", "qk_norm")
"""What makes a model preset a kind of model; a preset named beside `model.init_from` must agree on these (the
sizes are the checkpoint's)."""


def _kind(model: ModelConfig) -> dict:
    return {**{k: getattr(model, k) for k in ARCHITECTURE}, "experts": model.moe_num_experts > 0,
            "latent attention": model.is_mla()}


def _preset_named(model: ModelConfig, named: Optional[bool], config_name: str) -> bool:
    """Whether the command named the model preset: `named` when the entry script knows (Hydra's overrides), else
    whether `model` differs from the root config's default preset (one named explicitly with nothing changed is
    then taken as not named)."""
    if named is not None:
        return named
    from llmtrain.config import default_preset

    default = default_preset("model", config_name)
    keep = {"name", "init_from", "attention", "init_std", "vocab_size", "hf_family", *FUSE_SWITCHES}
    return any(getattr(model, f.name) != getattr(default, f.name) for f in dataclasses.fields(model) if f.name not in keep)


def _resolve_model(cfg: Config, tokenizer, problems: list[str],
                   model_named: Optional[bool] = None) -> tuple[ModelConfig, Optional[Mapping]]:
    """The model configuration the run trains, and the imported weights (or None). With `model.init_from` the
    architecture is the checkpoint's: a preset the command named must be of its kind (`ARCHITECTURE`), and the
    checkpoint's vocabulary must hold the tokenizer's ids."""
    model = cfg.model
    have = tokenizer.vocab_size if tokenizer is not None else None
    src = model.init_from
    if not src:
        if model.vocab_size is None:
            model = dataclasses.replace(model, vocab_size=have)
        elif have is not None and model.vocab_size < have:
            problems.append(f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's vocabulary ({have})")
        return model, None
    try:
        imported, state = _read_initial_checkpoint(src, cfg.run.dir)
    except ConfigError as e:
        problems += e.problems
        return model, None
    except (OSError, ValueError, KeyError) as e:
        problems.append(f"model.init_from={src}: {e}")
        return model, None
    from llmtrain.checkpoint.listing import init_label

    switches = {k: getattr(model, k) for k in FUSE_SWITCHES}  # kernel choices are the run's, not the checkpoint's
    imported = dataclasses.replace(imported, attention=model.attention, init_from=src, name=init_label(src),
                                   hf_family=imported.hf_family or model.hf_family, **switches)
    if have is not None and imported.vocab_size < have:
        problems.append(f"model.init_from={src}: the checkpoint's vocabulary has {imported.vocab_size} rows, but "
                        f"data.tokenizer={cfg.data.tokenizer} has {have} ids: use the tokenizer the checkpoint was "
                        "trained with")
    from llmtrain.config import FinetuneConfig

    if _preset_named(model, model_named, "finetune" if isinstance(cfg, FinetuneConfig) else "config"):
        theirs, ours = _kind(imported), _kind(model)
        differ = [f"{k} {ours[k]} vs {theirs[k]}" for k in ours if ours[k] != theirs[k]]
        if differ:
            problems.append(f"model={model.name} is not the kind of model model.init_from={src} holds ("
                            + ", ".join(differ) + "): the architecture is the checkpoint's, so drop model= (or name "
                            "a preset of its kind)")
    log0(f"model.init_from={src}: {len(state)} tensors, architecture from the checkpoint's config (run label "
         f"{imported.name})")
    return imported, state


def _read_initial_checkpoint(src: str, run_dir: str):
    """(ModelConfig, lazy {canonical name: tensor}) of a PaddleNLP directory or one of our step_<N> checkpoints
    (`llmtrain.checkpoint.reader`).

    Ours: model weights only (optimizer, schedule and data position start fresh, as fine-tuning wants)."""
    from llmtrain.checkpoint import reader

    if os.path.exists(os.path.join(src, "manifest.json")):
        from llmtrain.checkpoint.verify import verify_files

        files = verify_files(src)
        if files:
            raise ConfigError([f"model.init_from={src}: " + p for p in files])
        manifest = reader.Manifest.read(src)
        if manifest.lora is not None:
            raise ConfigError([f"model.init_from={src} is a LoRA checkpoint: it stores adapters only (base: "
                               f"{manifest.lora_base}). Resume it with checkpoint.resume=, or start from the "
                               "merged model (python -m llmtrain.export --checkpoint ... --merge-lora)"])
        return manifest.model, reader.model_state(manifest, lazy=True)
    inside_run = os.path.abspath(src).startswith(os.path.abspath(run_dir) + os.sep)
    ckpt = reader.read_paddlenlp(src, trusted=inside_run, lazy=True)
    return ckpt.config, ckpt.state

"""The resume contract: what each configuration change at resume does (honoured, warned, refused).

    python llmtrain/pretrain.py ... train.max_steps=300 checkpoint.resume=auto optim.on_resume=config
    review = review_resume(saved_config, config, saved_tokenizer, tokenizer, step)   # pure, testable
    apply_resume_contract(manifest, run, scheduler)   # the Trainer's hook: ConfigError, warnings, schedule

A checkpoint's manifest carries the resolved config of the run that wrote it. At
resume every field of the two configs is compared and each difference falls
under the rule `RULES` gives that exact field (docs/changing-runs.md's table
is this list). There is no default: a field without a rule is refused at resume, and
tests/train/test_contract.py fails on it, so a new config field comes with its rule:

- honoured: the new value is used (layout degrees, batch sizes, AMP, logging, ...);
- warn: the new value is used and a warning names the field, both values and the
  consequence (data mixture or seq_len: the sample order changes);
- refuse: a `ConfigError` names the field and both values (model shape, seed,
  optimizer kind; a tokenizer whose vocabulary differs);
- schedule: the LR-schedule fields (train.max_steps, optim.lr, min_lr,
  warmup_steps, decay_steps, schedule, decay_fraction, decay_start_step,
  decay_shape). With `optim.on_resume` unset the change is honoured if the LR of
  the first step after the resume moves by at most `LR_RTOL` (relative), else
  refused; `optim.on_resume=config` takes this config's schedule,
  `optim.on_resume=checkpoint` keeps the checkpoint's (its fields and its
  max_steps as the horizon), while train.max_steps still says where the run ends.
  Each schedule is evaluated where its run stands: at the step, or under
  `train.batch_rampup` at consumed samples / train.global_batch_size (the LR follows
  consumed samples there); a change of that position alone (ramp-up switched off
  after a ramp) is checked the same way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from llmtrain.errors import ConfigError
from llmtrain.models.config import RopeScaling
from llmtrain.models.lora import FinetuneOptions
from llmtrain.train.anomaly import AnomalyConfig
from llmtrain.train.config import OptimConfig
from llmtrain.train.schedule import lr_at
from llmtrain.utils.log import log0

LR_RTOL = 1e-3
"""Largest relative move of the resume step's LR that a schedule change may cause without optim.on_resume."""

SCHEDULE_FIELDS = ("train.max_steps", "optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.decay_steps",
                   "optim.schedule", "optim.decay_fraction", "optim.decay_start_step", "optim.decay_shape")


def _each(fields: str, rule: str, why: str) -> list[tuple[str, str, str]]:
    return [(f, rule, why) for f in fields.split()]


_MODEL_SHAPE = """model.family model.vocab_size model.hidden_size model.num_layers model.num_heads model.num_kv_heads
    model.ffn_hidden_size model.max_position_embeddings model.position model.rope_theta model.norm model.norm_eps
    model.norm_position model.activation model.bias model.tie_embeddings model.pad_token_id model.type_vocab_size
    model.task_type_vocab_size model.task_id model.fuse_qkv model.fuse_ffn model.fuse_rms_norm model.fuse_rope
    model.fuse_swiglu model.moe_num_experts model.moe_num_shared_experts model.moe_top_k model.moe_ffn_hidden_size
    model.moe_first_dense_layers model.moe_router model.moe_norm_topk model.moe_routed_scale model.moe_capacity_factor
    model.moe_aux_loss_coef model.moe_aux_loss_scope model.moe_z_loss_coef model.moe_bias_update_rate
    model.moe_layer_interval model.moe_last_layer model.moe_aux_counts"""

# One rule per config field, named exactly (no prefixes, no default): a field without a rule is refused at resume
# and fails tests/train/test_contract.py, so every new field needs a line here. Groups that may be null as a whole
# (`parallel`: one device) have a line of their own.
RULES: list[tuple[str, str, str]] = [
    ("parallel", "honoured", "checkpoints are layout-free: tensors are stored whole and re-cut"),
    *_each("""parallel.name parallel.dp parallel.tp parallel.pp parallel.sharding parallel.sharding_stage
        parallel.zero3_segment_size parallel.zero2_buffer_size parallel.pp_schedule parallel.virtual_pp parallel.pp_layers parallel.ep
        parallel.ep_dispatcher parallel.order parallel.sequence_parallel parallel.mp_async_allreduce parallel.pp_overlap_p2p_comm
        parallel.pp_enable_timer parallel.dp_comm_overlap parallel.pp_sharding_comm_overlap
        parallel.sharding_comm_overlap parallel.sharding_tensor_fusion parallel.sharding_split_param
        parallel.sharding_comm_buffer_mb
        parallel.cp parallel.cp_comm""",
           "honoured", "checkpoints are layout-free: tensors are stored whole and re-cut"),
    *_each("train.global_batch_size train.micro_batch_size train.grad_accum",
           "honoured", "the data continues from consumed_samples"),
    ("train.batch_rampup", "honoured", "each step's batch is read from consumed_samples"),
    ("train.fp8", "warn", "the transformer's GEMMs change precision from this step on; weights, optimizer states and "
                          "the checkpoint are the same with or without FP8"),
    ("train.fp8_weight_cache", "honoured", "the weights' FP8 copies are made once per step instead of once per "
                                           "micro-batch, from the same values: the same numbers; nothing is saved"),
    *_each("train.fp8_emulate.tp train.fp8_emulate.sequence_parallel train.fp8_emulate.cp", "warn",
           "the emulated layout's quantisation boundaries change the FP8 numerics from this step on; nothing of them "
           "is saved"),
    ("train.main_grad", "honoured", "gradients are not saved: fp32 main gradients or not, the state is the same"),
    ("train.amp", "honoured", "weights, moments and master weights are stored in fp32 and cast on load (from an fp32 "
                               "checkpoint the master weights start from the cast weights)"),
    *[(f, "schedule", "the LR schedule: see optim.on_resume") for f in SCHEDULE_FIELDS],
    ("optim.on_resume", "honoured", "how schedule changes are treated"),
    ("optim.name", "refuse", "the optimizer state is AdamW's"),
    *_each("optim.beta1 optim.beta2 optim.eps optim.weight_decay optim.clip_grad",
           "warn", "optimizer hyperparameters change the update from this step on"),
    *_each("""train.log_interval train.eval_interval train.eval_batches train.recompute train.recompute_modules
        train.recompute_layers train.offload_activations train.offload_optimizer train.peak_tflops
        train.hang_timeout_s train.peer_timeout_s train.progress_bar train.visualdl train.loss_curve train.metrics_port train.metrics_job
        train.metrics_linger_s""", "honoured", "logging, evaluation and memory settings do not change the numbers"),
    *_each("""checkpoint.interval checkpoint.keep_last checkpoint.resume checkpoint.save_final checkpoint.async_save
        checkpoint.timeout_minutes""", "honoured", "saving settings"),
    *_each("run.name run.dir run.overwrite", "honoured", "where the run writes"),
    *_each("""plan.devices plan.devices_per_node plan.device plan.top plan.recompute plan.profile plan.format
        plan.moe_imbalance""",
           "honoured", "planner settings (`python -m llmtrain.plan`), ignored by training"),
    *_each(" ".join(f"train.anomaly.{f.name}" for f in dataclasses.fields(AnomalyConfig)), "honoured",
           "divergence guard settings: a healthy step trains the same; the detector's history restarts empty at a "
           "resume (its warm-up applies again)"),
    ("data.tokenizer", "honoured", "the path may change; the vocabulary is compared separately (refused if it differs)"),
    ("data.num_workers", "honoured", "loader threads do not change the samples"),
    ("data.cache_dir", "honoured", "index cache location"),
    *_each("data.document_mask data.reset_position_ids", "warn",
           "the same samples and loss tokens, but attention (and, with reset positions, position ids) stays inside each "
           "document from this step on: the numbers change"),
    *_each("""data.prefixes data.weights data.seq_len data.split data.eod_mask_loss data.masking.strategy
        data.masking.prob data.masking.mask_token_prob data.masking.random_token_prob data.masking.max_ngram
        data.masking.entity_source data.masking.lexicon data.masking.entity_tags data.masking.max_entity_tokens
        data.files data.valid_files data.prompt_key data.response_key data.packing data.strict""",
           "warn", "the data fingerprint changes: the sample order from this step on differs"),
    ("model.name", "honoured", "a label"),
    ("model.attention", "honoured", "kernel choice, same numbers"),
    ("model.init_from", "honoured", "ignored at resume: the checkpoint's weights are loaded"),
    ("model.hf_family", "honoured", "what an export writes, not what the model computes"),
    ("model.init_std", "honoured", "ignored at resume: the checkpoint's weights are loaded"),
    ("model.qkv_bias", "refuse", "the checkpoint's q/k/v projections have (or lack) bias tensors; the architecture "
                                 "changes"),
    *_each("model.head_dim model.qk_norm", "refuse", "the checkpoint's attention tensors have the checkpoint's head "
                                                   "width and QK-norm weights (or none)"),
    *_each("model.mla_q_lora_rank model.mla_kv_lora_rank model.mla_qk_nope_head_dim model.mla_qk_rope_head_dim "
           "model.mla_v_head_dim", "refuse", "the checkpoint's latent-attention tensors have the checkpoint's ranks and "
                                             "head widths"),
    ("model.moe_router_dtype", "warn", "the routing and the combine change precision from this step on (checkpoints "
                                       "hold fp32 weights: they fit either way)"),
    *_each("model.moe_n_group model.moe_topk_group model.moe_group_score", "warn",
           "the experts a token may choose change from this step on (the weights fit either way)"),
    *_each("model.sliding_window model.sliding_window_layers " + " ".join(
        f"model.rope_scaling.{f.name}" for f in dataclasses.fields(RopeScaling)), "warn",
        "the attention over positions changes from this step on (the weights fit either way)"),
    *_each(_MODEL_SHAPE, "refuse", "the checkpoint's tensors have the checkpoint's architecture"),
    ("finetune.lora.dropout", "warn", "the adapters' dropout changes the update from this step on"),
    ("finetune.lora.merge", "honoured", "what an export writes"),
    ("finetune.lora.init_from", "honoured", "ignored at resume: the checkpoint's adapters are loaded"),
    *_each("finetune.lora.rank finetune.lora.alpha finetune.lora.target_modules",
           "refuse", "the checkpoint holds adapters of this rank and these targets (or none)"),
    ("seed", "refuse", "the sample order of every step (and dropout and MLM masks) is a function of the seed: a new "
                       "seed mid-run re-draws the order, repeating samples already trained on and skipping others; "
                       "start a new run (checkpoint.resume=none, or model.init_from=<checkpoint>) for a new seed"),
]
_RULE_OF = {path: (rule, why) for path, rule, why in RULES}
assert len(_RULE_OF) == len(RULES), "a field with two rules in RULES"

TOKENIZER_KEYS = ("sha256", "vocab_size", "sp_vocab_size", "special_ids")


def rule_of(path: str) -> tuple[str, str]:
    """(rule, why) of a dotted config field; a field `RULES` does not name is refused (there is no default rule)."""
    return _RULE_OF.get(path, ("refuse", "a field without a resume rule in llmtrain/train/contract.py RULES "
                                         "(every config field needs one)"))


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted path: leaf value} of a nested dict (lists and None are leaves)."""
    if not isinstance(obj, dict):
        return {prefix: obj}
    out: dict[str, Any] = {}
    for k, v in obj.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


@dataclass
class Review:
    """What a resume does with the differences between the checkpoint's config and this one."""

    refused: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    honoured: list[str] = field(default_factory=list)
    schedule_from: str = "config"
    """`config` or `checkpoint`: whose LR schedule is in force after the resume."""
    lr_checkpoint: Optional[float] = None
    lr_config: Optional[float] = None


def _optim(flat: dict[str, Any]) -> tuple[OptimConfig, int]:
    names = {f.name for f in dataclasses.fields(OptimConfig)}
    cfg = OptimConfig(**{k[len("optim."):]: v for k, v in flat.items()
                         if k.startswith("optim.") and k[len("optim."):] in names})
    return cfg, int(flat["train.max_steps"])


def schedule_position(batch_rampup, step: int, consumed_samples: Optional[int], global_batch: Optional[int]) -> float:
    """Where the LR schedule stands after `step` steps: the step, or under `train.batch_rampup` consumed samples /
    train.global_batch_size (`WarmupDecay.follow_samples`)."""
    return step if batch_rampup is None or consumed_samples is None else consumed_samples / global_batch


def as_override(value) -> str:
    """A value as Hydra override text: null, true/false, [a,b], numbers and strings as they are."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(as_override(v) for v in value) + "]"
    return str(value)


def _with_layout(cfg: dict) -> dict:
    """`cfg` with a one-device run's `parallel: null` spelled out as ParallelConfig's defaults, so a new layout shows
    as the degrees that changed, not as every parallel field."""
    if cfg.get("parallel") is not None:
        return cfg
    from llmtrain.parallel.config import ParallelConfig

    return {**cfg, "parallel": dataclasses.asdict(ParallelConfig(name="single"))}


def review_resume(saved: dict, current: dict, saved_tokenizer: Optional[dict], tokenizer: Optional[dict],
                  step: int, positions: Optional[tuple[float, float]] = None) -> Review:
    """Compare two resolved configs (nested dicts) at checkpoint `step` (steps done); pure.

    `positions`: the schedule position of the next step under the checkpoint's config and under this one
    (`schedule_position`); (step, step) when not given."""
    old, new = flatten(_with_layout(saved)), flatten(_with_layout(current))
    at_old, at_new = positions if positions is not None else (step, step)
    # fields the older code did not have compare as their defaults
    defaults = flatten({"optim": dataclasses.asdict(OptimConfig()), "finetune": dataclasses.asdict(FinetuneOptions()),
                        "train": {"anomaly": dataclasses.asdict(AnomalyConfig())}})
    for k, v in defaults.items():
        old.setdefault(k, v)
    r = Review()
    changed_schedule = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        if a == b:
            continue
        rule, why = rule_of(path)
        if path == "model.init_from" and int(old.get("finetune.lora.rank") or 0) > 0:
            rule, why = "refuse", "the base model of a LoRA checkpoint, which stores only the adapters"
        line = f"{path}={a!r} in the checkpoint, {b!r} now"
        if rule == "schedule":
            changed_schedule.append(line)
        elif rule == "refuse":
            r.refused.append(f"{line}: refused ({why}); to continue this run: {path}={as_override(a)}")
        elif rule == "warn":
            r.warnings.append(f"{line}: {why}")
        else:
            r.honoured.append(f"{line}: honoured ({why})")
    if saved_tokenizer is not None and tokenizer is not None:
        for key in TOKENIZER_KEYS:
            if saved_tokenizer.get(key) != tokenizer.get(key):
                r.refused.append(f"data.tokenizer: vocabulary differs ({key} {saved_tokenizer.get(key)!r} in the "
                                 f"checkpoint, {tokenizer.get(key)!r} now): refused (token ids would change meaning); "
                                 f"to continue this run: data.tokenizer={old.get('data.tokenizer')} (the checkpoint's)")
                break
    on_resume = new.get("optim.on_resume")
    moved_position = abs(at_old - at_new) > 1e-9 * max(1.0, abs(at_old))
    if moved_position:
        changed_schedule.append(f"schedule position (consumed samples / train.global_batch_size under "
                                f"train.batch_rampup, else the step)={at_old:g} in the checkpoint, {at_new:g} now")
    if changed_schedule:
        (o_cfg, o_max), (n_cfg, n_max) = _optim(old), _optim(new)
        r.lr_checkpoint, r.lr_config = lr_at(at_old, o_cfg, o_max), lr_at(at_new, n_cfg, n_max)
        moved = abs(r.lr_config - r.lr_checkpoint) > LR_RTOL * max(abs(r.lr_checkpoint), abs(r.lr_config), 1e-30)
        where = (f"the LR of step {step + 1} (the first after the resume) is {r.lr_checkpoint:.6g} under the "
                 f"checkpoint's schedule and {r.lr_config:.6g} under this config's")
        if on_resume == "checkpoint":
            r.schedule_from = "checkpoint"
            fields = changed_schedule[:-1] if moved_position else changed_schedule
            text = f"optim.on_resume=checkpoint: keeping the checkpoint's LR schedule ({where})"
            if fields:
                text += "; ignored: " + "; ".join(fields)
            if moved_position:  # the fields are the checkpoint's, the position is this run's
                text += (f"; the position follows this config's train.batch_rampup, so the LR of step {step + 1} "
                         f"is {lr_at(at_new, o_cfg, o_max):.6g}")
            r.warnings.append(text)
        elif on_resume == "config" or not moved:
            r.honoured += [f"{c}: honoured ({where})" for c in changed_schedule]
        else:
            r.refused.append(f"{'; '.join(changed_schedule)}: the LR schedule changed and {where} (moves by more "
                             f"than {LR_RTOL:g} relative). Set optim.on_resume=config to use this config's schedule "
                             f"or optim.on_resume=checkpoint to keep the checkpoint's")
    return r


def saved_config(manifest: dict) -> dict:
    """The resolved config a checkpoint was written under (nested dict), with the LR schedule its run actually used
    (`schedule_in_force`: what optim.on_resume=checkpoint kept)."""
    from omegaconf import OmegaConf

    saved = OmegaConf.to_container(OmegaConf.create(manifest["config"]), resolve=True)
    in_force = manifest.get("schedule_in_force")
    if in_force:
        saved["optim"] = {**saved["optim"], **in_force["optim"]}
        saved["train"] = {**saved["train"], "max_steps": in_force["max_steps"]}
    return saved


def review_manifest(manifest: dict, cfg, layout, tokenizer) -> Review:
    """What resuming the checkpoint of `manifest` under the resolved config `cfg` (its `layout`, `tokenizer`) does;
    pure. `llmtrain.resolve` asks it up front (a refusal is a config problem before any work), the Trainer's hook
    again when the checkpoint is loaded."""
    from omegaconf import OmegaConf

    saved = saved_config(manifest)
    current = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    tok = tokenizer.identity() if tokenizer is not None else None
    step, data = int(manifest["step"]), manifest.get("data") or {}
    consumed = data.get("consumed_samples")
    positions = (schedule_position(saved["train"].get("batch_rampup"), step, consumed, data.get("global_batch_size")),
                 schedule_position(cfg.train.batch_rampup, step, consumed,
                                   layout.global_batch if cfg.train.batch_rampup is not None else None))
    return review_resume(saved, current, manifest.get("tokenizer"), tok, step, positions)


def apply_resume_contract(manifest: dict, run, scheduler) -> Review:
    """The Trainer's resume hook (before any tensor is read): refuse, warn, and put the chosen schedule in force."""
    r = review_manifest(manifest, run.cfg, getattr(run, "layout", None), run.tokenizer)
    if r.refused:
        raise ConfigError([f"resume from step {manifest['step']}: {p}" for p in r.refused])
    for w in r.warnings:
        log0(f"warning: resume: {w}")
    for h in r.honoured:
        log0(f"resume: {h}")
    if r.schedule_from == "checkpoint":
        scheduler.cfg, scheduler.max_steps = _optim(flatten(saved_config(manifest)))
    return r

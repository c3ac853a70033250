"""The Trainer: model + parallel plan + optimizer + AMP + checkpoints + the loop, for every recipe.

    run = resolve(to_config(dcfg)); topo = init_distributed(run.layout, run.cfg.seed)
    data = build_data(PretrainData, run, topo)
    last_record = Trainer(run, topo, data).fit()

Construction, in the order Paddle's manual hybrid mode requires: this rank's
model from the plan (tp layers at construction, pipeline cut) -> parameters from
(seed, canonical name) or the imported checkpoint -> AdamW + schedule -> AMP O2
decorate -> fleet / ZeRO wrappers -> the norm-recording clip -> checkpointer.
`fit()`: resume from the newest complete checkpoint, then per step this rank's
micro-batches (timed as data wait) -> `StepRunner` -> `Meter` (metrics.jsonl,
progress bar, VisualDL) -> evaluation and checkpoint when due -> graceful stop on
SIGTERM/SIGINT; at the end the final checkpoint and the loss-curve PNG. A watchdog
thread (`watchdog.py`) ends the rank when no step completes in `train.hang_timeout_s`
or another rank is gone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import paddle
from omegaconf import OmegaConf

from llmtrain.checkpoint.listing import read_manifest
from llmtrain.checkpoint.manager import Checkpointer
from llmtrain.checkpoint.state import training_state
from llmtrain.data.rampup import BatchRampup
from llmtrain.fp8.apply import apply_fp8, fp8_layer_count
from llmtrain.fp8.cache import WeightCache
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import init_parameters, load_full_state
from llmtrain.models.size import parameter_count
from llmtrain.paddle_compat.kernels import on_gpu
from llmtrain.parallel.expert_states import attach_expert_parallel
from llmtrain.parallel.build import build_local_model, parallelize
from llmtrain.parallel.overlap_timeline import timeline_hooks
from llmtrain.parallel.slicing import TensorSlices
from llmtrain.train.amp import AmpPlan
from llmtrain.train.anomaly_guard import AnomalyGuard
from llmtrain.train.anomaly_rewind import SkipWindows
from llmtrain.train.clip import install_recording_clip
from llmtrain.plan.memory import predicted_report
from llmtrain.train.contract import apply_resume_contract
from llmtrain.train.lora import init_adapters, no_adapter_problem, split_adapters
from llmtrain.models.recompute import recompute_of
from llmtrain.train.main_grad import attach_main_grad, main_grad_on
from llmtrain.train.memory import predicted_activation_bytes, write_memory_report
from llmtrain.train.metrics import Meter
from llmtrain.train.optim import build_optimizer
from llmtrain.train.peak import peak_flops, remeasure_cpu_peak
from llmtrain.train.plot import plot_metrics
from llmtrain.train.prometheus import exporter_for_run
from llmtrain.train.step import StepRunner
from llmtrain.train.stop import StopRequest
from llmtrain.train.watchdog import Watchdog
from llmtrain.utils.log import log0


@dataclass
class Built:
    """This rank's model and optimizer as the layout wrapped them."""

    model: Any
    """What the step runner calls: the plain model, or fleet's DataParallel/TensorParallel/PipelineParallel wrapper."""
    core: Any
    """The unwrapped model (or PipelineLayer) whose parameters are ours."""
    loss_fn: Optional[Any]
    """Loss for flat models, (logits, labels) -> (loss_sum, tokens); None under pipeline parallelism (the
    PipelineLayer owns it)."""
    optimizer: Any
    scheduler: Any
    clip: Any
    """The clip whose `last_norm` is the step's global gradient norm before clipping."""
    scaler: Optional[Any]
    named_params: list
    """(canonical name, parameter) of this rank's trained parameters (what checkpoints and the optimizer hold)."""
    pipeline: bool
    frozen_params: list = dataclasses.field(default_factory=list)
    """(canonical name, parameter) of this rank's frozen base parameters under LoRA (empty otherwise)."""
    hooks: list = dataclasses.field(default_factory=list)
    """The model's and the plan's step hooks (`llmtrain.contracts.steps.StepHook`), run by the `StepRunner`."""
    inputs: Any = None
    """This rank's part of a micro-batch (`BuiltModel.inputs`), or None: the whole micro-batch."""
    report: Any = None
    """The plan's per-rank report for memory.json (`BuiltModel.report`), or None."""
    offload: Any = None
    """`llmtrain.paddle_compat.offload.OptimizerOffload` under `train.offload_optimizer`, or None."""

    fp8: Any = None
    """`train.fp8`: the model's `FP8Health` (the divergence guard reads it), or None."""


def build_data(data_cls, run, topo):
    """This data rank's batches of the layout-independent global order (`PretrainData`, `MLMData`, `SFTData`)."""
    data = data_cls(
        run.cfg.data, seed=run.cfg.seed, global_batch_size=run.layout.global_batch,
        micro_batch_size=run.layout.micro_batch, dp_rank=topo.data_rank, dp_world=topo.data_world,
        tokenizer=run.tokenizer,
    )
    if run.cfg.train.batch_rampup is not None:  # pretraining only (resolve refuses it for fine-tuning)
        start, increment, samples = run.cfg.train.batch_rampup
        data.use_rampup(BatchRampup(start, increment, samples, final=run.layout.global_batch))
    return data


def build_model_and_optimizer(run, topo, amp: AmpPlan) -> Built:
    """This rank's model and optimizer under `run.layout` (also used by benchmarks that need no loop)."""
    cfg, layout = run.cfg, run.layout
    lora = cfg.finetune.lora if cfg.finetune.lora.rank > 0 else None
    recompute = recompute_of(cfg.train, cfg.model.num_layers, layout.pp_layers)  # what each block re-runs
    local = build_local_model(cfg.model, layout, topo, recompute, lora=lora,
                              positions=any(getattr(cfg.data, k, False) for k in ("document_mask", "reset_position_ids")))
    core = local.core
    cache = WeightCache() if cfg.train.fp8 != "none" and cfg.train.fp8_weight_cache else None  # once a step
    fp8 = apply_fp8(core, cfg.train.fp8, cfg.train.fp8_emulate, cache)  # FP8Health or None; GEMMs in FP8 (llmtrain/fp8)
    if fp8 is not None:
        local.hooks += [fp8] + ([cache] if cache is not None else [])
        log0(f"train.fp8={cfg.train.fp8}: {fp8_layer_count(core)} layers compute their GEMMs in FP8 "
             f"({'on the GPU FP8 kernels' if on_gpu() else 'emulated on CPU: Paddle casts to FP8, dequantised, fp32 GEMM'})")
    named = canonical_parameters(core)
    if len(named) != len(core.parameters()):
        raise RuntimeError(f"{len(core.parameters()) - len(named)} parameters have no canonical name")
    slices = TensorSlices(topo.tp_rank, layout.tp, topo.ep_rank, layout.ep)  # this rank's part of each full tensor
    named, frozen = split_adapters(named) if lora else (named, [])  # LoRA: train the adapters, freeze the base
    problem = no_adapter_problem(named, topo.pp_rank, layout.pp, lora.target_modules) if lora else None
    if problem is not None:  # this rank's stage alone: a RuntimeError, whose traceback every rank prints (a
        raise RuntimeError(problem)  # ConfigError is printed by rank 0 only)
    base = frozen if lora else named
    if run.initial_state is not None:
        load_full_state(base, run.initial_state, slices, source=cfg.model.init_from)
    else:
        init_parameters(base, cfg.model, cfg.seed, slices)
    if lora:
        init_adapters(named, frozen, run, slices)
    # stage-1 V2 lays every optimizer parameter into its buckets and asserts each is trainable: the frozen ones (the
    # MoE router's expert_bias, moved by its own rule) stay out of its list; elsewhere they get no state either
    opt_named = [(n, p) for n, p in named if not p.stop_gradient] if layout.sharding_split_param else named
    optimizer, scheduler = build_optimizer(opt_named, cfg.optim, cfg.train.max_steps, multi_precision=amp.enabled)
    core, optimizer = amp.decorate(core, optimizer)
    if main_grad_on(cfg.train, layout):  # fp32 gradient buffers: what fleet's fused communication buffers need
        core, optimizer = attach_main_grad(core, optimizer, amp)
    local.core = core
    model, optimizer, scaler = parallelize(local, optimizer, amp.scaler(), layout, topo)  # + a wrapper's step hooks
    clip = install_recording_clip(optimizer)
    if layout.sharding_tensor_fusion and layout.pp > 1:  # a tied table's later copy inside a fused parameter
        from llmtrain.paddle_compat.sharding_fused import secondary_shared_spans

        clip.shared_spans = secondary_shared_spans(optimizer, core.parameters())
    local.hooks.extend(timeline_hooks(model, optimizer, cfg.run.dir, topo.rank))  # fused buckets: overlap/rank_N.jsonl
    local.hooks.extend(attach_expert_parallel(core, optimizer, clip, layout, topo, model))  # ep > 1: experts over edp
    offload = None
    if cfg.train.offload_optimizer:  # the state on the host between steps (paddle_compat/offload.py)
        from llmtrain.paddle_compat.offload import OptimizerOffload

        offload = OptimizerOffload(optimizer)
    return Built(model, core, local.loss_fn, optimizer, scheduler, clip, scaler, named, local.pipeline, frozen,
                 local.hooks, local.inputs, local.report, offload, fp8)


class Trainer:
    """One training run of a resolved configuration on this rank."""

    def __init__(self, run, topo, data):
        self.run, self.cfg, self.layout, self.topo, self.data = run, run.cfg, run.layout, topo, data
        self.amp = AmpPlan.from_config(self.cfg.train.amp)
        paddle.seed(self.cfg.seed)
        _prepare_run_dir(self.cfg, topo)
        self.built = build_model_and_optimizer(run, topo, self.amp)
        b = self.built
        state = training_state(b.named_params, b.model, b.optimizer, b.scheduler, b.scaler, data)  # what a save holds
        self.windows = SkipWindows()  # divergence guard: the data windows skipped after rewinds (in every manifest)
        state.manifest_parts.append(self.windows)
        self.ckpt = Checkpointer(self.cfg, self.layout, topo, state, run.tokenizer,
                                 on_manifest=lambda m: apply_resume_contract(m, run, self.built.scheduler))

    def fit(self) -> dict:
        """Resume, train to `train.max_steps` (or a stop signal), save; returns the last metrics record."""
        cfg, layout, topo, built, data, ckpt = self.cfg, self.layout, self.topo, self.built, self.data, self.ckpt
        state = ckpt.resume()
        for waived in ckpt.recorded("skip_windows_waived"):
            self.windows.waive(waived)
        for windows in ckpt.recorded("skip_windows"):  # any checkpoint of the run directory, newer ones included
            self.windows.merge(windows)
        if state.path is not None:  # a changed learning rate: the windows are trained on, not skipped
            self.windows.waive_after_lr_change(read_manifest(state.path), built.scheduler.in_force()["optim"]["lr"],
                                               data.consumed_samples)
        exporter = exporter_for_run(cfg, layout, topo.rank, state.tokens_total, state.step)  # /metrics when metrics_port
        self.runner = runner = StepRunner(built.model, built.loss_fn, built.optimizer, built.scheduler, built.clip, self.amp,
                            built.pipeline, built.scaler, accumulate_steps=layout.grad_accum,
                            hooks=built.hooks, inputs=built.inputs)
        # divergence guard: gates the clip (a verdict before every update), re-run, policies (anomaly.py)
        self.guard = AnomalyGuard(cfg.train.anomaly, topo, runner, built.clip, built.optimizer, self.windows,
                                 fp8=built.fp8)
        peak, peak_source = peak_flops(cfg.train.peak_tflops)
        log0(
            f"layout {layout.name}: dp={layout.dp} tp={layout.tp} pp={layout.pp} sharding={layout.sharding} "
            f"{f'ep={layout.ep} ' if layout.ep > 1 else ''}"
            f"(stage {layout.sharding_stage}); global batch {layout.global_batch} = micro {layout.micro_batch} x accum "
            f"{layout.grad_accum} x data-parallel {layout.data_parallel}"
            f"{'' if cfg.train.batch_rampup is None else f' (ramped up from {list(cfg.train.batch_rampup)})'}; "
            f"seq {cfg.data.seq_len}; "
            f"{parameter_count(cfg.model) / 1e6:.2f}M parameters; {self.run.flops_per_token / 1e6:.1f} MFLOPs/token; "
            f"peak {'unknown' if peak is None else f'{peak / 1e12:.3f} TFLOP/s'} ({peak_source})"
        )
        max_steps = cfg.train.max_steps
        meter = Meter(
            cfg.run.dir, topo, self.run.flops_per_token, peak, cfg.train.log_interval, max_steps,
            start_step=state.step, tokens_total=state.tokens_total,
            progress_bar=cfg.train.progress_bar, visualdl=cfg.train.visualdl, exporter=exporter,
            remeasure_peak=remeasure_cpu_peak if "matmul peak" in peak_source else None,  # CPU: a measured peak
        )
        stop = StopRequest().install()
        wd = Watchdog(cfg.run.dir, topo, cfg.train.hang_timeout_s, cfg.train.peer_timeout_s).start() \
            if cfg.train.hang_timeout_s > 0 else None
        try:
            last = self._loop(state, runner, meter, stop, wd)
        except BaseException:
            if wd is not None:
                wd.stop("failed")  # peers on every node stop at once instead of waiting for a timeout
            raise
        if wd is not None:
            wd.stop("done")
        return last

    def _loop(self, state, runner, meter, stop, wd) -> dict:
        cfg, layout, topo, built, data, ckpt = self.cfg, self.layout, self.topo, self.built, self.data, self.ckpt
        max_steps = cfg.train.max_steps
        paused = wd.paused if wd is not None else contextlib.nullcontext
        exporter = meter.exporter
        step, stopped = state.step, False
        guard = self.guard
        if state.path is None and cfg.checkpoint.interval > 0 and cfg.train.anomaly.initial_checkpoint:
            with paused():  # divergence guard: a healthy checkpoint from before the first update (anomaly.py)
                self._save(0, meter)
            meter.reset_window()
        while step < max_steps:
            guard.before_next_step(data)  # divergence guard: after a rewind, skip the anomalous data window
            t0 = time.perf_counter()
            consumed_before = data.consumed_samples
            micro_batches = data.next_step()
            data_wait = time.perf_counter() - t0
            if cfg.train.batch_rampup is not None:  # the LR follows consumed samples, as Megatron's does
                built.scheduler.follow_samples(consumed_before, layout.global_batch)
            lr = built.optimizer.get_lr()
            # divergence guard: runner.run under a verdict before the update, re-run once if non-finite
            out = guard.run_step(runner, micro_batches, step + 1, (consumed_before, data.consumed_samples))
            step += 1
            # divergence guard: the policy's action for a rejected step (skip / rewind / stop), counted before the record
            action = guard.policy(out.anomaly, ckpt) if out.anomaly is not None else None
            # step hooks: e.g. MoE routing metrics (read on the host on log steps only), bias update
            record = runner.finish(step, out, meter.reduce_sum, logged=meter.logs(step), reduce_device=meter.reduce_tensor)
            out = dataclasses.replace(out, loss=record.loss)
            extra = {"consumed_samples": data.consumed_samples, **guard.metrics(), **record.metrics}
            meter.update(step, out, lr, data_wait, extra=extra)
            if wd is not None:
                wd.progress(step)
            if exporter is not None:
                exporter.guard_counts(guard.counts, guard.kind_counts)
            if action == "stop":  # divergence guard: end the run (raises Diverged: exit status 5)
                guard.stop(out.anomaly, ckpt, meter)
            if action == "rewind":  # divergence guard: reload the newest healthy checkpoint, skip the data window
                step = guard.rewind(out.anomaly, ckpt, data, meter)
                if exporter is not None:
                    exporter.rewound(meter.tokens_total)  # the model's tokens go back; the counter does not
                continue
            if step == state.step + 1 and not guard.counts["rewinds"]:  # optimizer state exists from the first step on: what each rank holds
                self._record_memory(step, exporter)
                ckpt.prepare()  # async saves: their host buffers, allocated in the background
            if cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
                self._evaluate(runner, meter, step)
            stopped = stop.agreed(topo.world)
            if ckpt.due(step) or stopped:
                with paused():
                    self._save(step, meter)
                meter.reset_window()
            if stopped:
                log0(f"stopped by {stop.signal_name or 'a signal on another rank'} after step {step}")
                break
        with paused():
            if not stopped and cfg.checkpoint.save_final and ckpt.last_saved_step != step:
                self._save(step, meter)
            ckpt.close()  # async_save: the last background write is complete (or its failure raises here)
        meter.close()
        if topo.rank == 0 and os.path.exists(meter.path):
            png = plot_metrics(meter.path) if cfg.train.loss_curve else None
            log0(f"run directory {cfg.run.dir}: metrics.jsonl, {os.path.basename(png) + ', ' if png else ''}checkpoints/")
        if exporter is not None:
            exporter.close(cfg.train.metrics_linger_s)
        return meter.last

    def _record_memory(self, step: int, exporter) -> None:
        """memory.json: what each rank holds (measured) beside the planner's prediction for this layout."""
        cfg, layout, topo = self.cfg, self.layout, self.topo
        on_cpu = paddle.get_device() == "cpu"  # Paddle's AMP is a no-op on CPU: everything stays fp32
        lora = cfg.finetune.lora if cfg.finetune.lora.rank > 0 else None
        predicted = predicted_report(cfg.model, layout, "none" if on_cpu else cfg.train.amp, "cpu" if on_cpu else "gpu",
                                     lora)
        predicted_act = predicted_activation_bytes(cfg, layout, "none" if on_cpu else cfg.train.amp, on_cpu)
        report = write_memory_report(cfg.run.dir, self.built, topo, layout, parameter_count(cfg.model), step, predicted,
                                     activations=(self.runner.activation_bytes, predicted_act))
        if exporter is not None:
            exporter.memory(next(e for e in report["ranks"] if e["rank"] == topo.rank))

    def _save(self, step: int, meter: Meter) -> None:
        """A checkpoint; its duration and completion time go to the Prometheus exporter."""
        t0 = time.perf_counter()
        if self.ckpt.save(step, meter.tokens_total_exact(), health=self.guard.health()) is None:
            return  # refused: the state is not finite (divergence guard)
        if meter.exporter is not None:
            meter.exporter.model_tokens(meter.tokens_total)
            meter.exporter.checkpoint_saved(time.perf_counter() - t0)

    def _evaluate(self, runner: StepRunner, meter: Meter, step: int) -> None:
        """Held-out loss and perplexity: the `train.eval_batches` validation micro-batches (the same under every
        layout) split over the data ranks, token sums and counts summed exactly: a token-weighted mean."""
        topo = self.topo
        mine = self.data.valid_batches(self.cfg.train.eval_batches)[topo.data_rank::topo.data_world]
        loss_sum, tokens = runner.evaluate(mine)
        loss_sum, tokens = meter.reduce_sum([loss_sum, float(tokens)])
        loss = loss_sum / max(tokens, 1.0)
        meter.write_event({"step": step, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)),
                           "eval_tokens": int(tokens)})
        log0(f"step {step}: eval loss {loss:.4f}, perplexity {math.exp(min(loss, 700.0)):.2f} ({int(tokens)} tokens)")
        meter.reset_window()


def _prepare_run_dir(cfg, topo) -> None:
    """Create <run.dir> and, on rank 0, write the resolved config as config.yaml."""
    os.makedirs(cfg.run.dir, exist_ok=True)
    if topo.rank == 0:
        path = os.path.join(cfg.run.dir, "config.yaml")
        with open(path + ".tmp", "w") as f:
            f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        os.replace(path + ".tmp", path)

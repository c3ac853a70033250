"""The training loop shared by pretraining and fine-tuning.

    last_record = train_loop(cfg, layout, topo, built, data, ckpt, amp, state, flops_per_token, peak)

Per step: this rank's micro-batches (timed as data wait) -> `StepRunner` ->
`Meter` (metrics.jsonl, progress bar, VisualDL) -> evaluation and checkpoint
when due -> graceful stop on SIGTERM/SIGINT. At the end: final checkpoint and
the loss-curve PNG.
"""
from __future__ import annotations

import os
import time

from llmtrain.models.size import parameter_count
from llmtrain.train.metrics import Meter
from llmtrain.train.plot import plot_metrics
from llmtrain.train.step import StepRunner
from llmtrain.train.stop import StopRequest
from llmtrain.utils.log import log0


def train_loop(cfg, layout, topo, built, data, ckpt, amp, state, flops_per_token: float, peak) -> dict:
    peak_value, peak_source = peak
    runner = StepRunner(built.model, built.loss_fn, built.optimizer, built.scheduler, built.clip, amp, built.pipeline, built.scaler)
    log0(
        f"layout {layout.name}: dp={layout.dp} tp={layout.tp} pp={layout.pp} sharding={layout.sharding} "
        f"(stage {layout.sharding_stage}); global batch {layout.global_batch} = micro {layout.micro_batch} x accum "
        f"{layout.grad_accum} x data-parallel {layout.data_parallel}; seq {cfg.data.seq_len}; "
        f"{parameter_count(cfg.model) / 1e6:.2f}M parameters; {flops_per_token / 1e6:.1f} MFLOPs/token; "
        f"peak {'unknown' if peak_value is None else f'{peak_value / 1e12:.3f} TFLOP/s'} ({peak_source})"
    )
    max_steps = cfg.train.max_steps
    meter = Meter(
        cfg.run.dir, topo, flops_per_token, peak_value, cfg.train.log_interval, max_steps,
        start_step=state.step, tokens_total=state.tokens_total,
        progress_bar=cfg.train.progress_bar, visualdl=cfg.train.visualdl,
    )
    stop = StopRequest().install()
    step = state.step
    stopped = False
    while step < max_steps:
        t0 = time.perf_counter()
        micro_batches = data.next_step()
        data_wait = time.perf_counter() - t0
        lr = built.optimizer.get_lr()
        out = runner.run(micro_batches)
        step += 1
        meter.update(step, out, lr, data_wait, extra={"consumed_samples": data.consumed_samples})
        if step == state.step + 1:  # optimizer state exists from the first step on: what each rank holds
            from llmtrain.train.memory import write_memory_report

            write_memory_report(cfg.run.dir, built, topo, layout, parameter_count(cfg.model), step)
        if cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
            _evaluate(runner, data, meter, topo, step, cfg.train.eval_batches)
        stopped = stop.agreed(topo.world)
        if ckpt.due(step) or stopped:
            ckpt.save(step, meter.tokens_total_exact())
            meter.reset_window()
        if stopped:
            log0(f"stopped by {stop.signal_name or 'a signal on another rank'} after step {step}")
            break
    if not stopped and cfg.checkpoint.save_final and ckpt.last_saved_step != step:
        ckpt.save(step, meter.tokens_total_exact())
    meter.close()
    if topo.rank == 0 and os.path.exists(meter.path):
        png = plot_metrics(meter.path)
        log0(f"run directory {cfg.run.dir}: metrics.jsonl, {os.path.basename(png)}, checkpoints/")
    return meter.last


def _evaluate(runner, data, meter, topo, step: int, n_batches: int) -> None:
    loss = runner.evaluate(data.valid_batches(n_batches))
    total = meter.reduce_mean(float(loss))
    meter.write_event({"step": step, "eval_loss": total})
    log0(f"step {step}: eval loss {total:.4f}")
    meter.reset_window()

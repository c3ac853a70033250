"""Mixture-of-Experts under pipeline parallelism: every stage's routers get their balancing-loss gradient.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=moe-tiny +parallel=pp2
    python -m pytest tests/parallel/test_parity.py -q -k "pp2"

fleet's `PipelineParallel` computes the loss on the last stage only, from the
logits; the routers of earlier stages record their aux and z losses during
their own forward, where no loss function sees them. So each MoE layer of a
stage feeds its share of the balancing loss, (coef_aux * aux_l + coef_z *
z_l) / (MoE layers of the model), to the backward through its output
(`llmtrain.models.moe.attach_balancing_losses`) with the gradient 1 /
micro-batches, the factor fleet divides each micro-batch's LM loss by
(`accumulate_steps`; `_delay_scale_loss` is off), set before every step by
the step hook (`PipelineMoEStats.before_step`). The gradient of every
parameter is then that of one process's `LM + balancing` loss.

What is logged: `PipelineMoEStats` sums the step's per-layer aux and z losses
and expert loads over the pipeline stages (one slot per MoE layer of the
model) and over the data ranks, so `moe_aux_loss`, `moe_z_loss`,
`moe_load_max_mean` and `moe_dropped_frac` equal one process's; the logged
`loss` is the last stage's LM loss plus the coefficients times the stages'
balancing losses (`step_loss`), as one process logs it. The
auxiliary-loss-free bias of each layer moves on its own stage from the
model-wide counts of that layer.

Under DualPipeV (`parallel.pp_schedule=dualpipev`) the same holds with the V's placement: a stage's MoE layers
are those of its two chunks (down and back up the V), fleet's DualPipeV divides each micro-batch's LM loss by
accumulate_steps as 1F1B does, and computes it on stage 0 (the V's last chunk), whose step loss it broadcasts to
every stage; the first stage, which counts the micro-batches, is stage 0 under both schedules.

Limits (refused up front in `llmtrain.parallel.layout` / `llmtrain.resolve`):
`moe_aux_loss_scope=model` (a pooled loss over all layers is not a sum of
per-stage terms) and `train.amp=fp16` (the attached gradient would miss the
dynamic loss scale).
"""
from __future__ import annotations

import paddle
import paddle.distributed as dist

from llmtrain.models.moe import MoEStats, attach_balancing_losses, moe_layer_count, moe_layers


def pipeline_moe_problems(model, parallel, amp: str, rampup) -> list[str]:
    """Problems of an MoE model under pipeline parallelism with this AMP mode and batch ramp-up (empty: fine)."""
    if model.moe_num_experts <= 0 or parallel is None or parallel.pp <= 1:
        return []
    problems = []
    if amp == "fp16":
        problems.append(f"train.amp=fp16 with model.moe_num_experts={model.moe_num_experts} and parallel.pp="
                        f"{parallel.pp}: the balancing losses enter each stage's backward without fp16's dynamic "
                        "loss scale (absent); use train.amp=bf16")
    if rampup is not None:
        problems.append(f"train.batch_rampup with model.moe_num_experts={model.moe_num_experts} and parallel.pp="
                        f"{parallel.pp}: each stage's attached balancing-loss gradient follows the step's micro-batch "
                        "count, but the combination is not checked against a one-process run (absent)")
    return problems


class PipelineMoEStats(MoEStats):
    """`MoEStats` of one pipeline stage's MoE layers (possibly none), summed over the pipeline group before the
    data ranks; the micro-batches are counted once, by the first stage."""

    def __init__(self, layers, cfg, pp_group, first_stage: bool, micro_batches: int):
        super().__init__(layers, cfg)
        self.pp_group, self.first_stage, self.micro_batches = pp_group, first_stage, micro_batches

    def before_step(self, micro_batches: int) -> None:
        """fleet divides each micro-batch's LM loss by the step's micro-batch count: the attached balancing losses
        get the same factor, and the first stage counts them."""
        self.micro_batches = micro_batches
        attach_balancing_losses(self.layers, 1.0 / micro_batches)

    def _loss_sums(self) -> paddle.Tensor:
        """[3] float64 on the device: this stage's layers' share of the mean aux and z losses over the model's MoE
        layers, summed over the micro-batches, and the micro-batches (counted by the first stage)."""
        n = moe_layer_count(self.cfg)
        sums = paddle.zeros([2], "float64")
        for layer in self.layers:
            if layer.step_sums is not None:
                sums = sums + layer.step_sums[self.cfg.moe_num_experts + 1:]
        counted = paddle.full([1], float(self.micro_batches if self.first_stage else 0), "float64")
        return paddle.concat([sums / n, counted])

    def _stepped(self) -> bool:
        return True  # called after every training step, on every stage (a collective, even with no MoE layer here)

    def _device_sums(self) -> paddle.Tensor:
        """`MoEStats._device_sums` summed over the pipeline stages, still on the device (one read follows)."""
        t = super()._device_sums()
        dist.all_reduce(t, group=self.pp_group)
        return t

    def step_loss(self, loss, metrics: dict):
        """The last stage's LM loss (broadcast to every stage by fleet) + the balancing terms of all stages, on the
        device (also on a step whose metrics are not read: the logging window averages every step's loss)."""
        aux, z, micro_batches = self.step_losses[0], self.step_losses[1], self.step_losses[2]
        terms = (self.cfg.moe_aux_loss_coef * aux + self.cfg.moe_z_loss_coef * z) / micro_batches  # [] float64
        return loss + terms.astype(loss.dtype)


def attach_pipeline_moe(pipe, model_cfg, layout, topo) -> list:
    """Under pp > 1 with an MoE model: this stage's balancing losses enter the backward through the layer outputs
    (gradient 1 / micro-batches) and the returned step hook (`PipelineMoEStats`) sets that scale before each step
    and gathers the routing metrics of all stages after it. No hook for a dense model."""
    if model_cfg.moe_num_experts <= 0:
        return []
    layers = moe_layers(pipe)
    attach_balancing_losses(layers, 1.0 / layout.grad_accum)
    return [PipelineMoEStats(layers, model_cfg, topo.group("pp"), topo.pp_rank == 0,
                             layout.grad_accum)]

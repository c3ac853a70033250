"""Mixture-of-Experts feed-forward: router, routed experts, shared experts, balancing losses. Single-device code.

    python -m pytest tests/models/test_moe.py -q
    python llmtrain/pretrain.py model=moe-tiny

A block whose index is >= `model.moe_first_dense_layers` replaces its dense FFN
with `MoEFeedForward` when `model.moe_num_experts > 0`:

    y = shared(x) + scale * sum_{e in topk(x)} w_e(x) * expert_e(x)

Routing (`route`, `llmtrain.models.router`): logits = x W_r (fp32, no bias); softmax or sigmoid scores; the top-k
experts chosen on scores + `expert_bias`, weighted by the unbiased scores; an optional capacity per expert.

Losses, added to the LM loss by `MoELMLoss` (or, once `attach_balancing_losses` ran, fed to the
backward through each layer's output, for a loss function that sees only the LM loss: a pipeline's
last stage):
- aux (Switch/GShard, Mixtral's convention): E * sum_i f_i P_i, f_i = tokens
  choosing expert i / T (before dropping, so a balanced router gives k), P_i =
  mean over tokens of the router probability of i (sigmoid scores normalised per
  token), times `moe_aux_loss_coef`; per layer and averaged over the MoE layers, or
  with `moe_aux_loss_scope=model` once over all layers' f and P pooled (PaddleNLP's
  Mixtral);
- z-loss (ST-MoE): mean_t logsumexp(logits_t)^2, times `moe_z_loss_coef`, averaged
  over the MoE layers.

Attached losses (`attach_balancing_losses(layers, grad_scale)`): each MoE layer's share of the
balancing loss, (coef_aux * aux_l + coef_z * z_l) / (MoE layers of the model), is tied to its output by
`_BalancingLossGrad`: identity forward; backward passes the output gradient through and gives the share
the gradient `grad_scale` = d(objective) / d(micro-batch loss) (1 / micro-batches, as the LM loss is
scaled). The gradients equal those of `MoELMLoss` (tests/models/test_moe.py); `MoEStats` then adds the
balancing terms to the logged loss itself.

The expert bias is a parameter with `stop_gradient=True` (so checkpoints carry
it under its canonical name, the optimizer never touches it): after each
optimizer step `MoEStats.finish_step` moves it (`update_bias`) from the step's observed
load, summed over the data-parallel ranks.

The routed experts are stacked tensors `experts.w_gate/w_up/w_down`
[E, h, f] / [E, h, f] / [E, f, h] tagged with expert axis 0 (`tags.set_expert_axis`); a plan that
spreads experts over ranks (expert parallelism) builds them through
`Roles.experts` holding a contiguous block of E and passes a dispatcher that
moves the expert-major token buffer [E, C, h] between the ranks (`llmtrain/parallel/experts.py`).
The model never asks which experts are local: it hands all (token, expert,
weight) choices to `llmtrain.models.experts.Experts`, which lays them out, computes the ones it holds and
combines the outputs. No value is read on the host during the forward except, dropless, C (one read per layer,
`llmtrain.models.dispatch`); the routing statistics stay on the device until `MoEStats.finish_step`.
"""
from __future__ import annotations

import contextlib

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from llmtrain.contracts.steps import StepHook
from llmtrain.models.config import ModelConfig
from llmtrain.models.recompute import checkpointed
from llmtrain.models.router import Router, Routing, group_limit, route
from llmtrain.paddle_compat import amp


def aux_loss(r: Routing) -> paddle.Tensor:
    """Switch/GShard load-balancing loss E * sum_i (counts_i / T) * mean_t probs[t, i] (balanced: top_k)."""
    num_tokens, num_experts = r.probs.shape
    counts = r.counts if r.aux_counts is None else r.aux_counts
    return num_experts * (counts / num_tokens * r.probs.mean(0)).sum()


def aux_terms(r: Routing):
    """(f [E] = counts / T, no gradient; P [E] = mean router probability) of one layer's forward."""
    return (r.counts if r.aux_counts is None else r.aux_counts) / r.probs.shape[0], r.probs.mean(0)


def pooled_aux_loss(terms: list) -> paddle.Tensor:
    """E * sum_i mean_l f_l,i * mean_l P_l,i: one aux loss over the layers' pooled choices (Mixtral's form,
    layers with equal token counts)."""
    f = paddle.stack([t[0] for t in terms]).mean(0)
    p = paddle.stack([t[1] for t in terms]).mean(0)
    return f.shape[0] * (f * p).sum()


def z_loss(r: Routing) -> paddle.Tensor:
    """Router z-loss: mean over tokens of logsumexp(logits)^2."""
    return paddle.logsumexp(r.logits, axis=-1).pow(2).mean()


def moe_slot(cfg: ModelConfig, index: int) -> int:
    """Position of block `index` among the model's MoE layers (its slot in the routing statistics)."""
    return sum(cfg.is_moe_layer(j) for j in range(index))


def moe_layer_count(cfg: ModelConfig) -> int:
    """MoE layers of the whole model (the balancing losses are averaged over them)."""
    return moe_slot(cfg, cfg.num_layers)


class _BalancingLossGrad(PyLayer):
    """y [T, h] -> y; backward: dy to y and d(objective)/d(loss) = `scale` to the balancing loss [] (Megatron's
    MoEAuxLossAutoScaler idea: a loss computed inside the model reaches the gradient without reaching the loss)."""

    @staticmethod
    def forward(ctx, y, loss, scale):
        ctx.scale, ctx.dtype = scale, loss.dtype
        return y.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy, paddle.full([], ctx.scale, dtype=ctx.dtype)


class MoEFeedForward(nn.Layer):
    """x [b, s, h] -> [b, s, h]; records its routing statistics and loss terms for `MoELMLoss`/`MoEStats`."""

    def __init__(self, cfg: ModelConfig, roles, index: int = 0):
        super().__init__()
        from llmtrain.models.layers import FeedForward

        self.cfg = cfg
        self.slot = moe_slot(cfg, index)  # which MoE layer of the model (block `index`)
        self.num_moe = moe_layer_count(cfg)
        self.num_experts, self.top_k = cfg.moe_num_experts, cfg.moe_top_k
        self.router = Router(cfg.hidden_size, self.num_experts, cfg.moe_router_dtype)
        self.expert_bias = self.create_parameter([self.num_experts], is_bias=True)
        self.expert_bias.stop_gradient = True  # moved by MoEStats.finish_step, never by the optimizer
        if cfg.moe_router_dtype == "fp32":
            amp.keep_fp32_under_o2(self)  # this layer's own parameter, the expert bias (not its sublayers)
        self.experts = roles.experts(cfg)
        self.shared = None
        if cfg.moe_num_shared_experts > 0:
            self.shared = FeedForward(cfg, roles, ffn_hidden_size=cfg.moe_num_shared_experts * cfg.expert_ffn_size())
        self.loss_terms: list = []  # (aux, z) per forward, consumed by MoELMLoss
        self.step_sums = None
        """[E + 3] float64 on the device, summed over this step's training micro-batches: choices per expert, dropped
        choices, and (attached losses only) the aux and z losses. Read on the host once per step, by `MoEStats`."""
        self.step_choices = 0  # (token, expert) choices this step (a static count: no device read)
        self.grad_scale = None  # attached losses: d(objective)/d(micro-batch loss), see attach_balancing_losses
        self.replaying = False  # set while recompute re-runs the block in the backward (see `replay`)
        self.kept = None  # the routing a recomputed forward keeps from its first run (`keep_routing`, `replay`)
        self.recompute_shared = False  # re-run the shared experts in the backward (recompute module shared_experts)

    @contextlib.contextmanager
    def replay(self, kept: dict | None = None):
        """Recompute's second run of this layer's forward (in the backward): the same ops, nothing recorded, and
        the top-k choice `kept["chosen"]` of the first run (`keep_routing`) taken instead of routing again."""
        self.replaying, self.kept = True, kept
        try:
            yield
        finally:
            self.replaying, self.kept = False, None

    @contextlib.contextmanager
    def keep_routing(self, kept: dict):
        """The first run of a forward that recompute will re-run: its top-k choice goes into `kept["chosen"]`."""
        self.kept = kept
        try:
            yield
        finally:
            self.kept = None

    @property
    def step_counts(self):
        """[E] float64 choices per expert this step (None before the first training forward); on the device."""
        return None if self.step_sums is None else self.step_sums[:self.num_experts]

    @property
    def step_dropped(self):
        """[] dropped choices this step, on the device (0.0 before the first training forward)."""
        return 0.0 if self.step_sums is None else self.step_sums[self.num_experts]

    @property
    def step_aux(self):
        """[] attached aux losses summed this step, on the device."""
        return 0.0 if self.step_sums is None else self.step_sums[self.num_experts + 1]

    @property
    def step_z(self):
        """[] attached z losses summed this step, on the device."""
        return 0.0 if self.step_sums is None else self.step_sums[self.num_experts + 2]

    def _record_step(self, r: Routing, aux=None, z=None) -> None:
        """Add one training forward's statistics to `step_sums`, on the device (no host read)."""
        losses = (paddle.zeros([2], "float64") if aux is None else
                  paddle.stack([aux.detach(), z.detach()]).astype("float64"))
        sums = paddle.concat([r.counts.astype("float64"), r.dropped.astype("float64").reshape([1]), losses])
        self.step_sums = sums if self.step_sums is None else self.step_sums + sums
        self.step_choices += int(r.index.size)

    def routing(self, flat):
        """flat [T, h] -> (Routing, (aux, z) losses or None, attached share or None): the router's GEMM, `route`
        and the balancing terms, in fp32 whatever AMP does (`model.moe_router_dtype=fp32`)."""
        region = amp.fp32_region() if self.cfg.moe_router_dtype == "fp32" else contextlib.nullcontext()
        with region:
            logits = self.router(flat)  # [T, E] fp32
            bias = self.expert_bias  # zero unless moved (moe_bias_update_rate) or read from a checkpoint (DeepSeek-V3)
            chosen = self.kept.get("chosen") if self.replaying and self.kept is not None else None
            r = route(logits, self.top_k, self.cfg.moe_router, self.cfg.moe_norm_topk, bias,
                      self.cfg.moe_capacity_factor, groups=group_limit(self.cfg), chosen=chosen)
            if self.kept is not None and not self.replaying:
                self.kept["chosen"] = r.chosen  # [T, k] int64, held until the recompute has run
            if self.cfg.moe_aux_counts == "unbiased":  # ERNIE 4.5: the aux loss counts the top-k without the bias
                with paddle.no_grad():
                    free = paddle.topk(r.probs, self.top_k, axis=-1)[1]  # [T, k]
                    r.aux_counts = F.one_hot(free, self.num_experts).sum([0, 1]).astype("float32")  # [E]
            if self.grad_scale is None:
                return r, (aux_terms(r), z_loss(r)), None
            if not self.training:
                return r, None, None
            aux, z = aux_loss(r), z_loss(r)  # this layer's share of the balancing loss, fed to the backward through y
            return r, (aux, z), (self.cfg.moe_aux_loss_coef * aux + self.cfg.moe_z_loss_coef * z) / self.num_moe

    def forward(self, x):  # [b, s, h]
        shape = x.shape
        flat = x.reshape([-1, shape[-1]])  # [T, h]
        r, terms, share = self.routing(flat)
        y = self.experts(flat, r.index, r.weight)  # [T, h]
        if self.cfg.moe_routed_scale != 1.0:
            y = y * self.cfg.moe_routed_scale
        if self.shared is not None:
            shared = checkpointed(self.shared) if self.recompute_shared and self.training else self.shared
            y = y + shared(flat)
        record = not self.replaying  # recompute re-runs the same ops in the backward: record them once
        aux = z = None
        if self.grad_scale is None:
            if record:
                self.loss_terms.append(terms)
        elif share is not None:
            aux, z = terms
            y = _BalancingLossGrad.apply(y, share, self.grad_scale)
        if self.training and record:
            self._record_step(r, aux, z)  # stays on the device: read once per step by MoEStats
        return y.reshape(shape)


def moe_layers(model: nn.Layer) -> list[MoEFeedForward]:
    """The MoE feed-forwards of a model (or of a pipeline stage), in model order."""
    return [layer for layer in model.sublayers() if isinstance(layer, MoEFeedForward)]


def attach_balancing_losses(layers: list[MoEFeedForward], grad_scale: float) -> None:
    """Make `layers` feed their balancing losses to the backward through their outputs, each loss with the
    gradient `grad_scale` (1 / micro-batches per step); the loss function then sees the LM loss alone.
    Needs `moe_aux_loss_scope=layer` (a pooled loss is not a sum of per-layer terms)."""
    for layer in layers:
        if layer.cfg.moe_aux_loss_scope != "layer":
            raise ValueError("attached balancing losses need model.moe_aux_loss_scope=layer")
        layer.grad_scale = float(grad_scale)


def moe_loss(layers: list[MoEFeedForward], cfg: ModelConfig):
    """(coef_aux * aux + coef_z * mean z, aux, mean z) over the forwards recorded since the last call; aux is
    the mean of per-layer aux losses (`moe_aux_loss_scope=layer`) or one over the layers pooled (`model`)."""
    terms = [t for layer in layers for t in layer.loss_terms]
    for layer in layers:
        layer.loss_terms = []
    if not terms:
        return None, None, None
    with amp.fp32_region():  # fp32 terms stay fp32 whatever AMP's lists say
        if cfg.moe_aux_loss_scope == "model":
            aux = pooled_aux_loss([a for a, _ in terms])
        else:
            e = cfg.moe_num_experts
            aux = paddle.stack([e * (f * p).sum() for (f, p), _ in terms]).mean()
        z = paddle.stack([b for _, b in terms]).mean()
        return cfg.moe_aux_loss_coef * aux + cfg.moe_z_loss_coef * z, aux, z


class MoEStats(StepHook):
    """Per-step routing statistics and the auxiliary-loss-free bias update: the MoE model's step hook.

    `after_step(record)` (`llmtrain.contracts.steps`) runs `finish_step(record.reduce_sum, record.logged,
    record.reduce_device)`, adds the metrics to the record and sets the logged loss (`step_loss`).

    `finish_step(reduce, read, reduce_device)` after the optimizer step: sums the step's choices per
    expert over the data ranks through `reduce_device(tensor) -> tensor` (or `reduce(list[float]) -> list[float]`),
    moves every layer's expert bias (when enabled) and returns the metrics
    `moe_aux_loss`, `moe_z_loss` (means over the step's micro-batches and data ranks), `moe_load_max_mean`
    (per MoE layer of the model: max / mean choices per expert) and `moe_dropped_frac`. The reduced vector has
    one slot per MoE layer of the model (`MoEFeedForward.slot`), so `layers` may be a part of the model (a
    pipeline stage's, with a `reduce` that also sums over the stages).

    Everything the step recorded stays on the device until `finish_step` reads it in ONE host read
    (`.tolist()`), and only on a logged step (`StepRecord.logged`, `train.log_interval`) when the trainer offers a
    device-side reduction (`StepRecord.reduce_device`): the sums over the data ranks and the bias update stay on the
    device on the other steps. No MoE layer reads a value during the forward."""

    def __init__(self, layers: list[MoEFeedForward], cfg: ModelConfig):
        self.layers, self.cfg = layers, cfg
        self.loss_sums = None  # [2] float64 on the device: the micro-batches' mean aux and z losses, summed
        self.losses = 0
        self.step_losses = None  # [3] float64 on the device after finish_step: aux, z sums and micro-batches

    def record_loss(self, aux, z) -> None:
        """One training micro-batch's mean aux and z loss (before their coefficients), added on the device."""
        sums = paddle.stack([aux.detach(), z.detach()]).astype("float64")
        self.loss_sums = sums if self.loss_sums is None else self.loss_sums + sums
        self.losses += 1

    @property
    def aux_sum(self) -> float:
        """Sum over this step's micro-batches of the mean aux loss over MoE layers (reads the device)."""
        return 0.0 if self.loss_sums is None else float(self.loss_sums[0])

    @property
    def z_sum(self) -> float:
        """The same for the z loss (reads the device)."""
        return 0.0 if self.loss_sums is None else float(self.loss_sums[1])

    def _loss_sums(self) -> paddle.Tensor:
        """[3] float64: [sum over micro-batches of the mean aux loss over MoE layers, the same of z, micro-batches]."""
        sums = paddle.zeros([2], "float64") if self.loss_sums is None else self.loss_sums
        return paddle.concat([sums, paddle.full([1], float(self.losses), "float64")])

    def _stepped(self) -> bool:
        return bool(self.layers) and self.layers[0].step_sums is not None

    def _device_sums(self) -> paddle.Tensor:
        """[3 + slots (E + 2)] float64 on the device: `_loss_sums()`, then per MoE layer of the model its choices
        per expert, dropped choices and choices (zeros for a layer not held here)."""
        e = self.cfg.moe_num_experts
        rows = [paddle.zeros([e + 2], "float64") for _ in range(moe_layer_count(self.cfg))]
        for layer in self.layers:
            if layer.step_sums is not None:
                rows[layer.slot] = paddle.concat([layer.step_sums[:e + 1],
                                                  paddle.full([1], float(layer.step_choices), "float64")])
        return paddle.concat([self._loss_sums(), *rows])

    @paddle.no_grad()
    def finish_step(self, reduce=lambda v: v, read: bool = True, reduce_device=None) -> dict:
        """The step's metrics (empty before the first training step, and when `read` is False), the bias moved.

        `reduce_device` (a device-side sum over the data ranks): the sums stay on the device; the expert bias moves
        there and the host reads them once, only when `read` (a logged step). Without it, `reduce` sums the list of
        floats read from the device (one read every step)."""
        if not self._stepped():
            return {}
        sums = self._device_sums()
        if reduce_device is not None:
            total = reduce_device(sums)  # [3 + slots (E + 2)] float64, summed over the data ranks, on the device
            values = total.tolist() if read else None  # the one host read of the routing statistics
        else:
            values = reduce(sums.tolist())  # the one host read of the routing statistics
            total = paddle.to_tensor(values, dtype="float64")
        self.loss_sums, self.losses = None, 0
        self.step_losses = total[:3]  # [aux, z, micro-batches], on the device (the pipeline's logged loss)
        self._finish_layers(total)
        return {} if values is None else self._metrics(values)

    def _finish_layers(self, total: paddle.Tensor) -> None:
        """Move every layer's expert bias (when enabled) from its model-wide counts in `total`, on the device; clear
        the step's sums."""
        e = self.cfg.moe_num_experts
        for layer in self.layers:
            if self.cfg.moe_bias_update_rate > 0:
                first = 3 + layer.slot * (e + 2)
                update_bias(layer.expert_bias, total[first:first + e].astype("float32"), self.cfg.moe_bias_update_rate)
            layer.step_sums, layer.step_choices = None, 0

    def _metrics(self, values: list) -> dict:
        """`values` (the host copy of `_device_sums()` summed over the data ranks) -> the step's metrics."""
        e, slots = self.cfg.moe_num_experts, moe_layer_count(self.cfg)
        aux, z, losses = values[:3]
        rows = values[3:]
        ratios, dropped, choices = [], 0.0, 0.0
        for i in range(slots):
            row = rows[i * (e + 2):(i + 1) * (e + 2)]
            dropped, choices = dropped + row[e], choices + row[e + 1]
            mean = float(np.asarray(row[:e], np.float32).mean())  # fp32, as the per-expert counts are kept
            ratios.append(max(row[:e]) / mean if mean > 0 else 0.0)
        out = {"moe_load_max_mean": ratios, "moe_dropped_frac": dropped / choices if choices else 0.0}
        if losses:
            out["moe_aux_loss"] = aux / losses
            out["moe_z_loss"] = z / losses
        return out

    def step_loss(self, loss, metrics: dict):
        """The logged step loss from the runner's: unchanged here (`MoELMLoss` already added the balancing terms)."""
        return loss

    def after_step(self, record) -> None:
        metrics = self.finish_step(record.reduce_sum, record.logged, record.reduce_device)
        record.metrics.update(metrics)
        record.loss = self.step_loss(record.loss, metrics)


@paddle.no_grad()
def update_bias(bias: paddle.Tensor, counts: paddle.Tensor, rate: float) -> None:
    """Auxiliary-loss-free balancing: b_i += rate * sign(mean(counts) - counts_i) (DeepSeek-V3)."""
    bias.set_value(bias + rate * paddle.sign(counts.mean() - counts).astype(bias.dtype))


class MoELMLoss(nn.Layer):
    """Training: LM loss + coef_aux * aux + coef_z * z of the forward just run; evaluation (model.eval()): the LM
    loss alone (the balancing terms are dropped).

    logits [b, s, V/tp]; labels = (target ids [b, s], loss_mask [b, s]) -> (loss_sum, tokens), fp32 scalars, as
    `LMLoss` returns them; the balancing terms (per micro-batch, not per token) enter the sum as
    terms * max(tokens, 1), so that the caller's loss_sum / max(tokens, 1) is the LM mean + the terms."""

    def __init__(self, lm_loss: nn.Layer, layers: list[MoEFeedForward], cfg: ModelConfig):
        super().__init__()
        self.lm_loss = lm_loss
        self._layers = layers  # a plain list: not sublayers of the loss
        self.cfg = cfg
        self.stats = MoEStats(layers, cfg)

    def forward(self, logits, labels):
        loss_sum, tokens = self.lm_loss(logits, labels)
        extra, aux, z = moe_loss(self._layers, self.cfg)
        if extra is None or not self._layers[0].training:
            return loss_sum, tokens  # evaluation: the LM loss alone
        self.stats.record_loss(aux, z)
        return loss_sum + extra * paddle.clip(tokens, min=1.0), tokens

"""Gradient accumulation: 4 micro-batches of 2 == 1 micro-batch of 8 (loss and weights, 1e-5)."""
from __future__ import annotations

import numpy as np
import pytest

from llmtrain.models import build_model
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import init_parameters
from llmtrain.train.amp import AmpPlan
from llmtrain.train.config import OptimConfig
from llmtrain.train.optim import build_optimizer
from llmtrain.contracts.steps import StepHook, mean_loss
from llmtrain.train.step import StepRunner


def _batches(steps, global_batch, seq, vocab, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, vocab, size=(steps, global_batch, seq + 1))
    return [
        dict(input_ids=t[:, :-1], labels=t[:, 1:], loss_mask=np.ones((global_batch, seq), np.float32))
        for t in toks
    ]


def _split(batch, micro):
    n = batch["input_ids"].shape[0]
    return [{k: v[i : i + micro] for k, v in batch.items()} for i in range(0, n, micro)]


def _train(cfg, micro, steps=3, amp="none"):
    model = build_model(cfg)
    named = canonical_parameters(model)
    init_parameters(named, cfg, seed=11)
    plan = AmpPlan.from_config(amp)
    opt, sched = build_optimizer(named, OptimConfig(lr=1e-3, warmup_steps=1), max_steps=steps, multi_precision=plan.enabled)
    model, opt = plan.decorate(model, opt)
    runner = StepRunner(model, model.loss_fn, opt, sched, opt._grad_clip, plan, scaler=plan.scaler())
    losses, norms = [], []
    batch = _batches(1, 8, 16, cfg.vocab_size)[0]
    for _ in range(steps):  # the same batch each step, so the loss must fall
        out = runner.run(_split(batch, micro))
        losses.append(float(out.loss))
        norms.append(float(out.grad_norm))
        assert out.tokens == 8 * 16
    return losses, norms, {n: p.numpy() for n, p in canonical_parameters(model)}


@pytest.mark.parametrize("arch", ["tiny_gpt", "tiny_llama"])
def test_accumulation_matches_large_micro_batch(arch, request):
    cfg = request.getfixturevalue(arch)
    l8, n8, w8 = _train(cfg, micro=8)
    l2, n2, w2 = _train(cfg, micro=2)
    np.testing.assert_allclose(l2, l8, atol=1e-5)
    np.testing.assert_allclose(n2, n8, atol=1e-5)
    for name in w8:
        np.testing.assert_allclose(w2[name], w8[name], atol=1e-5, err_msg=name)
    assert l8[-1] < l8[0]


def test_amp_o2_code_path_runs_on_cpu(tiny_llama):
    """On CPU AMP is a no-op: the O2 path (decorate, auto_cast, master weights) must give fp32 results."""
    base, _, _ = _train(tiny_llama, micro=4, steps=2)
    for mode in ("bf16", "fp16"):
        got, _, _ = _train(tiny_llama, micro=4, steps=2, amp=mode)
        np.testing.assert_allclose(got, base, atol=1e-5)


def test_clipping_uses_global_norm(tiny_gpt):
    """With clip_grad tiny, every step's update is scaled by clip / norm (global, not per group)."""
    from llmtrain.train.clip import GlobalNormClip
    import paddle

    model = build_model(tiny_gpt)
    named = canonical_parameters(model)
    init_parameters(named, tiny_gpt, seed=1)
    clip = GlobalNormClip(1e-3)
    batch = _batches(1, 4, 8, tiny_gpt.vocab_size)[0]
    loss = mean_loss(model.loss_fn(model(paddle.to_tensor(batch["input_ids"])), (paddle.to_tensor(batch["labels"]), paddle.to_tensor(batch["loss_mask"]))))
    loss.backward()
    grads = [(p, p.grad) for _, p in named]
    norm = float(np.sqrt(sum(float((g.numpy().astype(np.float64) ** 2).sum()) for _, g in grads)))
    clip._dygraph_clip(grads)
    assert abs(float(clip.last_norm) - norm) < 1e-4 * norm
    after = float(np.sqrt(sum(float((g.numpy().astype(np.float64) ** 2).sum()) for _, g in grads)))
    assert abs(after - 1e-3) < 1e-6


@pytest.mark.parametrize("arch", ["tiny_gpt", "tiny_llama"])
def test_recompute_gives_the_same_losses_and_weights(arch, request):
    """Activation recompute (non-reentrant) changes memory, never the numbers."""
    cfg = request.getfixturevalue(arch)

    def run(recompute):
        model = build_model(cfg, recompute=recompute)
        named = canonical_parameters(model)
        init_parameters(named, cfg, seed=11)
        plan = AmpPlan.from_config("none")
        opt, sched = build_optimizer(named, OptimConfig(lr=1e-3, warmup_steps=1), max_steps=3)
        runner = StepRunner(model, model.loss_fn, opt, sched, opt._grad_clip, plan)
        batch = _batches(1, 8, 16, cfg.vocab_size)[0]
        losses = [float(runner.run(_split(batch, 4)).loss) for _ in range(3)]
        return losses, {n: p.numpy() for n, p in canonical_parameters(model)}

    l0, w0 = run(False)
    l1, w1 = run(True)
    np.testing.assert_allclose(l1, l0, atol=1e-6)
    for name in w0:
        np.testing.assert_allclose(w1[name], w0[name], atol=1e-6, err_msg=name)


class _Recorder(StepHook):
    """Records what the loop shows a hook."""

    def __init__(self):
        self.calls, self.step = [], 0

    def before_step(self, micro_batches):
        self.step += 1
        self.calls.append(("before_step", micro_batches))

    def before_update(self, check):
        self.calls.append(("before_update", check.micro_batches, float(check.loss)))
        return False  # a hook cannot veto an update (a veto on some ranks only would desynchronise them)

    def after_step(self, record):
        self.calls.append(("after_step", record.step, record.tokens, record.grad_norm is None))
        record.metrics["seen"] = record.step
        record.loss = record.loss * 2


def test_step_hooks_see_each_step_and_cannot_veto_the_update(tiny_gpt):
    """The loop's hook protocol (`llmtrain.contracts.steps`): before the step, before the update (with the step's
    loss), after it (metrics, the logged loss); what `before_update` returns is ignored: every step updates."""
    model = build_model(tiny_gpt)
    named = canonical_parameters(model)
    init_parameters(named, tiny_gpt, seed=3)
    plan = AmpPlan.from_config("none")
    opt, sched = build_optimizer(named, OptimConfig(lr=1e-2, warmup_steps=1), max_steps=3)
    hook = _Recorder()
    runner = StepRunner(model, model.loss_fn, opt, sched, opt._grad_clip, plan, hooks=[hook])
    batch = _split(_batches(1, 4, 8, tiny_gpt.vocab_size)[0], 2)
    weights, lrs = [{n: p.numpy().copy() for n, p in named}], []
    for step in (1, 2, 3):
        out = runner.run(batch)
        record = runner.finish(step, out, lambda v: v)
        assert record.metrics == {"seen": step} and out.grad_norm is not None
        assert float(record.loss) == pytest.approx(2 * float(out.loss))
        weights.append({n: p.numpy().copy() for n, p in named})
        lrs.append(opt.get_lr())
    assert lrs[0] != lrs[1] != lrs[2]  # every step advanced the schedule
    assert [c[0] for c in hook.calls] == ["before_step", "before_update", "after_step"] * 3
    assert hook.calls[0] == ("before_step", 2) and hook.calls[1][1] == 2
    assert [c[3] for c in hook.calls if c[0] == "after_step"] == [False, False, False]
    for before, after in zip(weights, weights[1:]):  # every step updated, whatever before_update returned
        assert any(not np.array_equal(before[n], after[n]) for n in before)


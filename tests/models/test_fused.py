"""Fused paths (`model.fuse_*`) equal their unfused references on CPU where Paddle 3.3.1's CPU build has them.

    python -m pytest tests/models/test_fused.py -q

fuse_swiglu (Paddle's swiglu kernel), fuse_qkv and fuse_ffn (one matmul of concatenated
weights, the concatenation not kept for the backward) run here: forward and every gradient are compared with the unfused path on the
same weights, also with LoRA adapters on the fused projections. No weight copy is kept: a moe-tiny
training step with every CPU fusion on holds exactly the concatenated-weight copies fewer bytes than the
formulation whose autograd kept them (the host allocator's "Allocated" counter: on CPU the bytes saved for
backward). fuse_rms_norm and fuse_rope have no working CPU kernel (see llmtrain/paddle_compat/kernels.py) and are refused on CPU; on a GPU (scripts/gpu_acceptance.sh
runs this file there) every switch is compared, in fp32.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import pytest

from llmtrain.config import compose_config, to_config
from llmtrain.models import build_model
from llmtrain.models.config import FUSE_SWITCHES, fusion_problems
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import init_parameters
from llmtrain.models.lora import LoraConfig, attach_lora
from llmtrain.models.roles import Roles
from llmtrain.paddle_compat.kernels import CPU_KERNELS, on_gpu
from llmtrain.contracts.steps import mean_loss

FUSIONS = {k: "true" for k in FUSE_SWITCHES if on_gpu() or CPU_KERNELS[k]}
"""Every switch on GPU (scripts/gpu_acceptance.sh runs this file there); on CPU the three with CPU kernels."""


def _run(cfg, ids, labels, lora=None):
    paddle.seed(0)
    model = build_model(cfg)
    if lora is not None:
        attach_lora(model, lora, Roles())
    init_parameters(canonical_parameters(model), cfg, 11)
    rng = np.random.default_rng(5)
    for name, p in canonical_parameters(model):
        if name.endswith(".lora_B"):  # B starts at zero; give the branch something to add
            p.set_value(paddle.to_tensor((0.2 * rng.standard_normal(p.shape)).astype("float32")))
    logits = model(ids)
    loss = mean_loss(model.loss_fn(logits, (labels, paddle.ones(labels.shape, dtype="float32"))))
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in canonical_parameters(model)}
    return logits.numpy(), grads


@pytest.mark.parametrize("bias", [False, True])
def test_fusions_equal_unfused_forward_and_grads(tiny_llama, bias):
    base = dataclasses.replace(tiny_llama, bias=bias, **{k: "false" for k in FUSE_SWITCHES})
    fused = dataclasses.replace(base, **FUSIONS)
    assert all(fused.fused(k) for k in FUSIONS) and not any(base.fused(k) for k in FUSE_SWITCHES)
    rng = np.random.default_rng(3)
    ids = paddle.to_tensor(rng.integers(0, base.vocab_size, (2, 12)))
    labels = paddle.to_tensor(rng.integers(0, base.vocab_size, (2, 12)))
    ref_logits, ref_grads = _run(base, ids, labels)
    got_logits, got_grads = _run(fused, ids, labels)
    assert sorted(got_grads) == sorted(ref_grads)  # canonical names unchanged: q_proj/k_proj/v_proj, gate/up
    np.testing.assert_allclose(got_logits, ref_logits, rtol=0, atol=1e-5)
    for name in ref_grads:
        np.testing.assert_allclose(got_grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("targets", [None, [r".*\.(q|v|up)_proj"]], ids=["all", "q-v-up"])
def test_lora_on_fused_projections_equals_unfused(tiny_llama, targets):
    """LoRA adapters under fuse_qkv / fuse_ffn (the q/k/v or gate/up adapters as one block of the fused output)
    give the unfused model's logits and every gradient, adapters and base; also when only some of a fused
    group's linears are adapted (PaddleNLP's usual q, v)."""
    base = dataclasses.replace(tiny_llama, **{k: "false" for k in FUSE_SWITCHES})
    fused = dataclasses.replace(base, **FUSIONS)
    lora = LoraConfig(rank=3, alpha=6.0, **({} if targets is None else {"target_modules": targets}))
    rng = np.random.default_rng(4)
    ids = paddle.to_tensor(rng.integers(0, base.vocab_size, (2, 12)))
    labels = paddle.to_tensor(rng.integers(0, base.vocab_size, (2, 12)))
    ref_logits, ref_grads = _run(base, ids, labels, lora)
    got_logits, got_grads = _run(fused, ids, labels, lora)
    plain_logits, _ = _run(fused, ids, labels)
    assert sorted(got_grads) == sorted(ref_grads) and sum(n.endswith(".lora_B") for n in got_grads) == \
        base.num_layers * (7 if targets is None else 3)
    assert np.abs(got_logits - plain_logits).max() > 1e-3  # the adapters changed the fused model's output
    np.testing.assert_allclose(got_logits, ref_logits, rtol=0, atol=1e-5)
    for name in ref_grads:
        np.testing.assert_allclose(got_grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_swiglu_kernel_alone():
    from llmtrain.paddle_compat.kernels import swiglu

    rng = np.random.default_rng(0)
    g = paddle.to_tensor(rng.standard_normal((3, 5, 8)).astype("float32"), stop_gradient=False)
    u = paddle.to_tensor(rng.standard_normal((3, 5, 8)).astype("float32"), stop_gradient=False)
    out = swiglu(g, u)
    (out * out).sum().backward()
    dg, du = g.grad.numpy(), u.grad.numpy()
    g.clear_grad(), u.clear_grad()
    ref = paddle.nn.functional.silu(g) * u
    (ref * ref).sum().backward()
    np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=1e-6)
    np.testing.assert_allclose(dg, g.grad.numpy(), atol=1e-5)
    np.testing.assert_allclose(du, u.grad.numpy(), atol=1e-5)


def test_auto_is_off_on_cpu_and_gpu_only_switches_refused(tiny_llama, tiny_gpt):
    assert all(tiny_llama.fused(k) == on_gpu() for k in FUSE_SWITCHES)  # auto: on for GPU only
    assert fusion_problems(tiny_llama, on_gpu=False) == []
    forced = dataclasses.replace(tiny_llama, fuse_rms_norm="true", fuse_rope="True", fuse_qkv="yes")
    problems = fusion_problems(forced, on_gpu=False)
    assert any("model.fuse_rms_norm=true: GPU-only" in p for p in problems), problems
    assert any("model.fuse_rope=true: GPU-only" in p for p in problems), problems
    assert any("model.fuse_qkv='yes': expected auto, true or false" in p for p in problems), problems
    assert fusion_problems(dataclasses.replace(forced, fuse_qkv="auto"), on_gpu=True) == []
    gpt = dataclasses.replace(tiny_gpt, fuse_rms_norm="true", fuse_swiglu="true")
    problems = fusion_problems(gpt, on_gpu=True)
    assert "model.fuse_rms_norm=true needs model.norm=rmsnorm (this model has norm=layernorm)" in problems
    assert "model.fuse_swiglu=true needs model.activation=swiglu (this model has activation=gelu_tanh)" in problems


def test_hydra_switches_compose():
    cfg = to_config(compose_config(["model=llama-tiny", "model.fuse_qkv=true", "model.fuse_ffn=false"]))
    assert cfg.model.fused("fuse_qkv") and not cfg.model.fused("fuse_ffn") and cfg.model.fused("fuse_rope") == on_gpu()


def test_fused_projections_under_zero3_auto_off_true_refused(tiny_corpus, tmp_path, monkeypatch):
    """ZeRO-3 gathers sliced weights per linear; the one-matmul projections never call the linears (a crash on
    Paddle 3.3.1), so under sharding_stage=3 `auto` (on for GPU, simulated here) resolves to off, `true` is refused."""
    from llmtest import tiny_overrides

    from llmtrain.config import ConfigError
    from llmtrain.paddle_compat import kernels
    from llmtrain.resolve import resolve

    base = tiny_overrides(tiny_corpus, str(tmp_path), "llama") + ["+parallel=zero3"]
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)  # `auto` as on a GPU
    model = resolve(to_config(compose_config(base)), world_size=2).cfg.model
    assert (model.fuse_qkv, model.fuse_ffn) == ("false", "false") and model.fused("fuse_swiglu")
    with pytest.raises(ConfigError, match="model.fuse_ffn=true with parallel.sharding_stage=3"):
        resolve(to_config(compose_config(base + ["model.fuse_ffn=true"])), world_size=2)


def _concatenating(monkeypatch):
    """The formulation before issue 45's fix, installed for one run: dense fused projections and the experts' gate|up
    as one GEMM over weights concatenated at every forward through autograd (which keeps the copy for the
    backward)."""
    import paddle.nn.functional as F

    from llmtrain.models import experts, roles
    from llmtrain.paddle_compat import kernels

    def concat_linear(x, layers):
        weight = paddle.concat([layer.weight for layer in layers], axis=1)  # [in, sum out_i]: the copy
        y = F.linear(x, weight, None if layers[0].bias is None else paddle.concat([la.bias for la in layers]))
        return paddle.split(y, [layer.weight.shape[1] for layer in layers], axis=-1)

    def ffn(self, x):  # [E, N, h]
        gate, up = paddle.bmm(x, paddle.concat([self.w_gate, self.w_up], axis=-1)).chunk(2, axis=-1)  # the copy
        return paddle.bmm(kernels.swiglu(gate, up) if self.fuse_swiglu else F.silu(gate) * up, self.w_down)

    monkeypatch.setattr(roles, "concat_linear", concat_linear)
    monkeypatch.setattr(experts.Experts, "ffn", ffn)


def _moe_step_bytes(cfg, ids):
    """(bytes held after the forward, peak above the start over forward + backward) of one moe-tiny step."""
    from llmtrain.paddle_compat.host_memory import host_allocated_bytes, host_peak_bytes

    paddle.seed(0)
    model = build_model(cfg)
    labels = (ids, paddle.ones(ids.shape, dtype="float32"))
    with host_peak_bytes() as peak:
        start = host_allocated_bytes()
        loss = mean_loss(model.loss_fn(model(ids), labels))
        held = host_allocated_bytes() - start
        loss.backward()
    return held, peak.bytes


def test_fused_projections_copy_no_weights(monkeypatch):
    """moe-tiny cut to two blocks (one dense, one MoE), fuse_qkv + fuse_ffn + fuse_swiglu, one training step of 512
    tokens: the forward holds exactly the bytes of the concatenated weights fewer than the formulation that kept
    them (q|k|v and gate|up of every block and shared expert, [E, h, 2f] of every MoE layer), and the step's
    peak falls by at least that much (by exactly that much here: the peak comes before any block's backward)."""
    cfg = to_config(compose_config(["model=moe-tiny", "model.num_layers=2", "model.vocab_size=512",
                                    "model.fuse_qkv=true", "model.fuse_ffn=true", "model.fuse_swiglu=true"])).model
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 512, (2, 256)), dtype="int64")
    held, peak = _moe_step_bytes(cfg, ids)
    with monkeypatch.context() as m:
        _concatenating(m)
        old_held, old_peak = _moe_step_bytes(cfg, ids)
    h, d = cfg.hidden_size, cfg.attn_head_dim()
    qkv = h * (cfg.num_heads + 2 * cfg.kv_heads()) * d  # [h, q + 2 kv] per block
    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    dense_ffn = sum(not m for m in moe) * h * 2 * cfg.ffn_hidden_size  # [h, 2 f]
    shared = sum(moe) * h * 2 * cfg.moe_num_shared_experts * cfg.expert_ffn_size()  # the shared experts' gate|up
    routed = sum(moe) * cfg.moe_num_experts * h * 2 * cfg.expert_ffn_size()  # [E, h, 2 f] per MoE layer
    copies = 4 * (cfg.num_layers * qkv + dense_ffn + shared + routed)  # fp32 bytes
    assert old_held - held == copies, (old_held, held, copies)
    assert old_peak - peak >= copies, (old_peak, peak, copies)

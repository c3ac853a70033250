"""head_dim != hidden / heads, QK-norm, scaled RoPE and sliding windows against a numpy reference, past the original
maximum position.

    python -m pytest tests/models/test_attention_variants.py -q

The reference is tests/hf_tiny.py's numpy forward of the published Qwen3 architecture with transformers' RoPE
formulas (`rope_inv_freq`, written apart from llmtrain/models/rope.py); the checkpoints are its tiny Hugging Face
Qwen3s (head_dim 16 with hidden 32 and 4 heads, QK-norm), imported through llmtrain.interop. Every case runs 40
positions against an original length of 16 (scaled RoPE) or a window of 6 (sliding windows), and also checks that
the feature moved the logits (a reference without it differs), so a feature silently ignored fails.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import paddle
import pytest
from hf_tiny import make_hf_checkpoint, reference_logits, rope_inv_freq

from llmtrain.interop import read_paddlenlp_checkpoint
from llmtrain.models import build_model
from llmtrain.models.config import RopeScaling
from llmtrain.models.init import load_full_state
from llmtrain.models.layers import Rotary, math_attention
from llmtrain.models.stages import canonical_parameters

TOL = 1e-4
S = 40  # positions per sequence, past every original length below
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},  # with max_position_embeddings 16: NTK at 40 positions (<= 48)
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-deepseek": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16,
                      "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def _model(tmp_path, **kw):
    make_hf_checkpoint(tmp_path, "qwen3", seed=3, shards=1, rope_theta=10000.0, **kw)
    cfg, state, _ = read_paddlenlp_checkpoint(str(tmp_path))
    model = build_model(cfg)
    load_full_state(canonical_parameters(model), state)
    model.eval()
    return cfg, model


def _ids(cfg, seq=S):
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (2, seq))


def _unchanged_reference(tmp_path, change: dict, ids):
    """The reference logits of the same weights without `change` (the feature off)."""
    c = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, **change}))
    return reference_logits(tmp_path, ids)


@pytest.mark.parametrize("kind", list(ROPES))
def test_scaled_rope_matches_the_reference_past_the_original_length(kind, tmp_path):
    extra = dict(max_position_embeddings=16) if kind == "dynamic" else {}
    cfg, model = _model(tmp_path, rope_scaling=ROPES[kind], **extra)
    assert cfg.rope_scaling.type == ROPES[kind]["rope_type"] and cfg.max_position_embeddings >= S
    ids = _ids(cfg)
    with paddle.no_grad():
        ours = model(paddle.to_tensor(ids)).numpy()
    ref = reference_logits(tmp_path, ids)
    assert np.abs(ours - ref).max() <= TOL, (kind, float(np.abs(ours - ref).max()))
    plain = _unchanged_reference(tmp_path, {"rope_scaling": None}, ids)
    assert np.abs(plain - ref)[:, 16:].max() > 100 * TOL, kind  # the scaling matters past the original length


@pytest.mark.parametrize("kind", list(ROPES))
def test_rotary_frequencies_and_factor_equal_transformers_formulas(kind):
    """Our Rotary's inv_freq and YaRN attention factor equal the reference's for the same parameters (d 64, so
    the ramps and blends have interior points), at a dynamic length of 40 past 16."""
    hf = dict(ROPES[kind])
    kind_ = hf.pop("rope_type")
    r = RopeScaling(type=kind_, **{k: float(v) if k != "original_max_position_embeddings" else int(v)
                                   for k, v in hf.items()})
    if kind_ == "dynamic":
        r = dataclasses.replace(r, original_max_position_embeddings=16)
    rot = Rotary(64, 10000.0, max_positions=64, scaling=r)
    c = {"rope_theta": 10000.0, "max_position_embeddings": 16 if kind_ == "dynamic" else 64,
         "rope_scaling": ROPES[kind]}
    want, factor = rope_inv_freq(c, 64, S)
    got = rot.inv_freq(rot._length_key(S)).numpy()
    assert np.allclose(got, want, rtol=1e-6, atol=0), (kind, np.abs(got - want).max())
    assert abs(rot.attention_factor() - factor) < 1e-12 and (factor != 1.0) == kind.startswith("yarn")


def test_dynamic_ntk_uses_the_forward_length_with_packed_positions():
    """Given positions, dynamic NTK scales by the largest position + 1 (transformers' max(position_ids) + 1)."""
    r = RopeScaling(type="dynamic", factor=2.0, original_max_position_embeddings=16)
    rot = Rotary(16, 10000.0, max_positions=64, scaling=r)
    q = paddle.randn([1, 40, 2, 16])
    pos = paddle.to_tensor(np.concatenate([np.arange(30), np.arange(10)])[None])  # two packed examples
    got, _ = rot.apply_qk(q, q, pos)
    c = {"rope_theta": 10000.0, "max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    inv, _ = rope_inv_freq(c, 16, 30)
    ang = np.asarray(pos.numpy()[0], np.float64)[:, None] * inv[None]
    emb = np.concatenate([ang, ang], -1)[None, :, None, :]
    x = q.numpy().astype(np.float64)
    want = x * np.cos(emb) + np.concatenate([-x[..., 8:], x[..., :8]], -1) * np.sin(emb)
    assert np.abs(got.numpy() - want).max() < 1e-5


def test_sliding_window_matches_the_reference_past_the_window(tmp_path):
    """A window of 6 on block 1 only (max_window_layers 1), 40 positions."""
    cfg, model = _model(tmp_path, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert cfg.sliding_window == 6 and cfg.sliding_window_layers == [1]
    assert model.layers[0].attn.window == 0 and model.layers[1].attn.window == 6
    ids = _ids(cfg)
    with paddle.no_grad():
        ours = model(paddle.to_tensor(ids)).numpy()
    ref = reference_logits(tmp_path, ids)
    assert np.abs(ours - ref).max() <= TOL, float(np.abs(ours - ref).max())
    full = _unchanged_reference(tmp_path, {"use_sliding_window": False}, ids)
    assert np.abs(full - ref)[:, :6].max() < TOL < np.abs(full - ref)[:, 6:].max()  # only past the window


def test_windowed_kv_cache_decoding_equals_the_full_forward(tmp_path):
    """Decoding one position at a time past the window (every block windowed) gives the full forward's logits."""
    cfg, model = _model(tmp_path, use_sliding_window=True, sliding_window=5, max_window_layers=0)
    assert cfg.sliding_window_layers is None  # every block
    ids = paddle.to_tensor(_ids(cfg, 14))
    with paddle.no_grad():
        full = model(ids).numpy()
        cache = [{} for _ in model.layers]
        steps = [model(ids[:, :4], paddle.arange(4)[None].expand([2, 4]), None, cache).numpy()]
        for t in range(4, 14):
            pos = paddle.full([2, 1], t, dtype="int64")
            steps.append(model(ids[:, t:t + 1], pos, None, cache).numpy())
    assert np.abs(np.concatenate(steps, 1) - full).max() < 1e-4


def test_window_with_packed_examples_is_each_example_windowed_alone():
    """math_attention(window, segments): each packed example equals its own windowed attention."""
    rng = np.random.default_rng(1)
    q, k, v = (paddle.to_tensor(rng.standard_normal([1, 20, 2, 8]).astype(np.float32)) for _ in range(3))
    seg = paddle.to_tensor(np.array([[0] * 12 + [1] * 8]))
    packed = math_attention(q, k, v, True, None, seg, window=5).numpy()
    for lo, hi in ((0, 12), (12, 20)):
        alone = math_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], True, window=5).numpy()
        assert np.abs(packed[:, lo:hi] - alone).max() < 1e-6


def test_head_dim_independent_of_hidden_matches_the_reference(tmp_path):
    """Heads of 24 with hidden 32 and 4 heads (q/k/v project to 96, o back to 32), QK-norm, 40 positions past a
    max_position_embeddings of 16 in config.json's YaRN original length."""
    cfg, model = _model(tmp_path, head_dim=24, rope_scaling=ROPES["yarn"])
    assert cfg.attn_head_dim() == 24 != cfg.hidden_size // cfg.num_heads and cfg.qk_norm
    assert list(model.layers[0].attn.q_proj.weight.shape) == [32, 96]
    assert list(model.layers[0].attn.o_proj.weight.shape) == [96, 32]
    ids = _ids(cfg)
    with paddle.no_grad():
        ours = model(paddle.to_tensor(ids)).numpy()
    ref = reference_logits(tmp_path, ids)
    assert np.abs(ours - ref).max() <= TOL, float(np.abs(ours - ref).max())


def test_attention_variant_problems_are_named():
    from llmtest import compose
    from llmtrain.config import config_problems, to_config

    cfg = to_config(compose(["model=llama-tiny", "model.head_dim=15", "model.rope_scaling.type=yarn",
                             "model.rope_scaling.factor=0.5", "model.rope_scaling.beta_fast=1",
                             "model.sliding_window=4", "model.sliding_window_layers=[0,9]"]))
    text = "\n".join(config_problems(cfg))
    for want in ("model.head_dim=15 is odd", "model.rope_scaling.factor=0.5", "beta_fast=1.0",
                 "model.sliding_window_layers=[0, 9]: [9]"):
        assert want in text, (want, text)
    bad = to_config(compose(["model=gpt-tiny", "model.rope_scaling.type=ntk"]))
    assert any("model.rope_scaling.type='ntk'" in p for p in config_problems(bad))
    enc = to_config(compose(["model=ernie-tiny", "model.sliding_window=4"]))
    assert any("sliding windows are causal" in p for p in config_problems(enc))
    ok = to_config(compose(["model=llama-tiny", "model.head_dim=48", "model.num_heads=3"]))  # 128 % 3 != 0: fine
    assert not [p for p in config_problems(ok) if "head" in p]

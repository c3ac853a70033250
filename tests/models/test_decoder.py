"""Decoder shapes, causality, parameter counts, init by (seed, name). Slicing for tp: tests/parallel/test_slicing.py."""
from __future__ import annotations

import numpy as np
import paddle
import pytest

from llmtrain.models import build_model
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import init_parameters
from llmtrain.models.size import flops_parameters, flops_per_token, parameter_count


@pytest.fixture(params=["tiny_gpt", "tiny_llama"])
def cfg(request):
    return request.getfixturevalue(request.param)


def _model(cfg, seed=7):
    m = build_model(cfg)
    init_parameters(canonical_parameters(m), cfg, seed)
    m.eval()
    return m


def test_shapes_and_parameter_count(cfg):
    m = _model(cfg)
    ids = paddle.randint(0, cfg.vocab_size, [3, 11])
    assert m(ids).shape == [3, 11, cfg.vocab_size]
    assert sum(int(p.size) for p in m.parameters()) == parameter_count(cfg)


def test_causality(cfg):
    """Changing token t never changes the logits at positions before t."""
    m = _model(cfg)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(2, 16))
    base = m(paddle.to_tensor(ids)).numpy()
    for t in (0, 5, 15):
        changed = ids.copy()
        changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
        out = m(paddle.to_tensor(changed)).numpy()
        np.testing.assert_array_equal(out[:, :t], base[:, :t])
        assert np.abs(out[:, t:] - base[:, t:]).max() > 0


def test_init_depends_only_on_seed_and_name(cfg):
    a, b = _model(cfg, seed=3), _model(cfg, seed=3)
    for (na, pa), (nb, pb) in zip(canonical_parameters(a), canonical_parameters(b)):
        assert na == nb
        np.testing.assert_array_equal(pa.numpy(), pb.numpy())
    c = _model(cfg, seed=4)
    diffs = [np.abs(pa.numpy() - pc.numpy()).max() for (_, pa), (_, pc) in zip(canonical_parameters(a), canonical_parameters(c))]
    assert max(diffs) > 0


def test_residual_projections_are_scaled(tiny_gpt):
    m = _model(tiny_gpt)
    named = dict(canonical_parameters(m))
    q = named["layers.0.attn.q_proj.weight"].numpy().std()
    o = named["layers.0.attn.o_proj.weight"].numpy().std()
    assert abs(q - 0.02) < 0.004
    assert abs(o - 0.02 / np.sqrt(2 * tiny_gpt.num_layers)) < 0.003
    assert np.all(named["layers.0.attn_norm.weight"].numpy() == 1)
    assert np.all(named["layers.0.attn.q_proj.bias"].numpy() == 0)


def test_flops_per_token_counts_output_projection(tiny_gpt, tiny_llama):
    for c in (tiny_gpt, tiny_llama):
        n = flops_parameters(c)
        # tied or not, the V x h output projection is in N; the input tables are not
        table = c.vocab_size * c.hidden_size
        pos = c.max_position_embeddings * c.hidden_size if c.position == "learned" else 0
        expect = parameter_count(c) - pos + (table if c.tie_embeddings else 0) - table
        assert n == expect
        assert flops_per_token(c, 128) == 6 * n + 12 * c.num_layers * c.hidden_size * 128


def test_lora_flops_per_token_frozen_base_without_weight_gradients(tiny_llama):
    """LoRA: 4 N for the frozen base (forward + input gradients) + 6 N_lora + attention; N_lora counted by hand
    from the adapted linears (h=32, q 32 -> 32, k/v 32 -> 16 with 2 of 4 heads, o 32 -> 32)."""
    from llmtrain.models.lora import LoraConfig
    from llmtrain.models.lora_targets import adapter_numel

    lora = LoraConfig(rank=4, target_modules=[r"layers\.\d+\.attn\.(q|k|v|o)_proj"])
    n_lora = adapter_numel(tiny_llama, lora)
    assert n_lora == tiny_llama.num_layers * 4 * ((32 + 32) + 2 * (32 + 16) + (32 + 32))
    attention = 12 * tiny_llama.num_layers * tiny_llama.hidden_size * 128
    n = flops_parameters(tiny_llama)
    assert flops_per_token(tiny_llama, 128, n_lora) == 4 * n + 6 * n_lora + attention
    assert flops_per_token(tiny_llama, 128, n_lora) < flops_per_token(tiny_llama, 128)
    assert adapter_numel(tiny_llama, LoraConfig(rank=0)) == 0

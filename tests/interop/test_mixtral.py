"""PaddleNLP Mixtral: a tiny random `MixtralForCausalLM` (save_pretrained) imports with equal logits, our MoE model
exports to a checkpoint PaddleNLP loads with equal logits, and the export reads back to the same state.

PaddleNLP 2.8.1's Mixtral forward fails on Paddle 3.3.1 as shipped (one-argument `paddle.where` now returns 1-D
indices); `runnable_paddlenlp_mixtral` gives its module the [n, 1] form it was written for (interop_helpers.py).

    python -m pytest tests/interop/test_mixtral.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
from interop_helpers import (assert_close, our_logits, paddlenlp_logits, random_state, randomize_paddlenlp,
                             runnable_paddlenlp_mixtral, token_ids)

from llmtrain.interop import UnsupportedConfig, read_paddlenlp_checkpoint, write_paddlenlp_checkpoint
from llmtrain.models.config import ModelConfig
from llmtrain.contracts.steps import mean_loss

# the real package (dev extra); a missing paddlenlp fails these tests rather than skipping them
from paddlenlp.transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=24, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
            rope_theta=10000.0, router_aux_loss_coef=0.02)


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pdparams"])
def test_import_matches_paddlenlp(safe, tmp_path, monkeypatch):
    runnable_paddlenlp_mixtral(monkeypatch)
    ref = MixtralForCausalLM(MixtralConfig(**TINY))
    randomize_paddlenlp(ref, seed=7)
    ref.save_pretrained(str(tmp_path), safe_serialization=safe)
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path), trusted=True)
    assert meta["family"] == "mixtral"
    assert (cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_aux_loss_coef, cfg.kv_heads()) == (4, 2, 0.02, 2)
    assert state["layers.1.mlp.experts.w_down"].shape == (4, 24, 32)
    np.testing.assert_array_equal(state["layers.1.mlp.experts.w_up"][3],
                                  ref.mixtral.layers[1].block_sparse_moe.experts[3].w3.weight.numpy())
    ids = token_ids(cfg.vocab_size, seq=24)
    assert_close(our_logits(cfg, state, ids), paddlenlp_logits(ref, ids), "mixtral import")


def _ours(**kw) -> ModelConfig:
    base = dict(name="moe", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=24,
                vocab_size=128, max_position_embeddings=64, position="rope", norm="rmsnorm", norm_eps=1e-6,
                activation="swiglu", bias=False, tie_embeddings=False, moe_num_experts=4, moe_top_k=2,
                moe_aux_loss_coef=0.01)
    return ModelConfig(**{**base, **kw})


def test_export_loads_in_paddlenlp_with_our_logits_and_reads_back(tmp_path, monkeypatch):
    runnable_paddlenlp_mixtral(monkeypatch)
    cfg = _ours()
    state = random_state(cfg, seed=3)
    for i in range(cfg.num_layers):
        state[f"layers.{i}.mlp.expert_bias"][:] = 0  # no counterpart in PaddleNLP (imported as zeros)
    out = str(tmp_path / "export")
    info = write_paddlenlp_checkpoint(cfg, state, out)
    assert info["family"] == "mixtral" and info["config"]["num_local_experts"] == 4
    ref = AutoModelForCausalLM.from_pretrained(out)
    assert type(ref).__name__ == "MixtralForCausalLM"
    ids = token_ids(cfg.vocab_size, seed=1, seq=24)
    assert_close(our_logits(cfg, state, ids), paddlenlp_logits(ref, ids), "mixtral export")
    back_cfg, back, _ = read_paddlenlp_checkpoint(out)
    assert set(back) == set(state)
    for k in state:
        np.testing.assert_array_equal(back[k], state[k], err_msg=k)
    assert (back_cfg.moe_num_experts, back_cfg.moe_top_k, back_cfg.moe_aux_loss_coef) == (4, 2, 0.01)


@pytest.mark.parametrize("kw,field", [(dict(moe_num_shared_experts=1), "moe_num_shared_experts"),
                                      (dict(moe_router="sigmoid"), "moe_router"),
                                      (dict(moe_first_dense_layers=1), "moe_first_dense_layers"),
                                      (dict(moe_capacity_factor=1.25), "moe_capacity_factor")])
def test_export_refuses_what_mixtral_cannot_compute(kw, field, tmp_path):
    cfg = _ours(**kw)
    with pytest.raises(UnsupportedConfig, match=field):
        write_paddlenlp_checkpoint(cfg, random_state(cfg, seed=1), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_training_loss_equals_paddlenlp_loss_with_its_aux_term(tmp_path, monkeypatch):
    """A continued-training step's loss (our model + its loss function, as the step runner calls them, on an
    imported Mixtral) equals PaddleNLP's forward loss with labels and `output_router_logits=True`:
    cross entropy + router_aux_loss_coef x its pooled load-balancing loss."""
    import paddle

    from llmtrain.models import build_model
    from llmtrain.models.stages import canonical_parameters
    from llmtrain.models.init import load_full_state

    runnable_paddlenlp_mixtral(monkeypatch)
    ref = MixtralForCausalLM(MixtralConfig(**{**TINY, "router_aux_loss_coef": 0.5}))
    randomize_paddlenlp(ref, seed=9)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, state, _ = read_paddlenlp_checkpoint(str(tmp_path))
    assert (cfg.moe_aux_loss_scope, cfg.moe_aux_loss_coef) == ("model", 0.5)
    ids = token_ids(cfg.vocab_size, seed=2, seq=24)
    labels = token_ids(cfg.vocab_size, seed=3, seq=24)
    ref.eval()
    with paddle.no_grad():
        out = ref(ids, labels=labels, output_router_logits=True, return_dict=True)
    theirs, their_aux = float(out.loss), float(out.aux_loss)
    model = build_model(cfg)
    load_full_state(canonical_parameters(model), state)
    model.train()
    loss = mean_loss(model.loss_fn(model(ids), (labels, paddle.ones(labels.shape, "float32"))))
    lm_only = float(mean_loss(model.loss_fn.lm_loss(model(ids), (labels, paddle.ones(labels.shape, "float32")))))
    assert their_aux > 1.0  # a real aux term (balanced would be top_k = 2)
    assert abs(float(loss) - theirs) <= 1e-5, (float(loss), theirs)
    assert abs(float(loss) - lm_only - 0.5 * their_aux) <= 1e-5

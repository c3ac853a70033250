"""Hugging Face Qwen3 and Qwen3-MoE checkpoints in and out, against tests/hf_tiny.py's numpy forward.

    python -m pytest tests/interop/test_hf_qwen3.py -q

The tiny configs carry the field names of the published config.json files (`PUBLISHED_FIELDS`, from Qwen/Qwen3-0.6B
and Qwen/Qwen3-30B-A3B); every field we write is one of those or a scaled-RoPE / window field transformers reads.
"""
from __future__ import annotations

import json

import numpy as np
import paddle
import pytest
from hf_tiny import hf_config, make_hf_checkpoint, reference_logits
from interop_helpers import TOL, our_logits, random_state

from llmtrain.interop import read_paddlenlp_checkpoint, write_paddlenlp_checkpoint
from llmtrain.interop.hf_format import write_hf_checkpoint
from llmtrain.interop.keys import UnsupportedConfig

QWEN3_FIELDS = {"architectures", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "head_dim",
                "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings",
                "max_window_layers", "model_type", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                "rms_norm_eps", "rope_scaling", "rope_theta", "sliding_window", "tie_word_embeddings", "torch_dtype",
                "transformers_version", "use_cache", "use_sliding_window", "vocab_size"}
PUBLISHED_FIELDS = {
    "qwen3": QWEN3_FIELDS,
    "qwen3_moe": QWEN3_FIELDS | {"decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob",
                                 "num_experts", "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef"},
}
"""config.json keys of the published Qwen/Qwen3-0.6B and Qwen/Qwen3-30B-A3B."""
READ_TOO = {"layer_types"}
"""Fields transformers reads that the published files leave out (we write layer_types for windowed blocks)."""

CASES = {
    "qwen3-tied": ("qwen3", {}),
    "qwen3-yarn-window": ("qwen3", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 16},
                                        use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                        tie_word_embeddings=False)),
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-first-dense-llama3": ("qwen3_moe", dict(mlp_only_layers=[0], rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
}


def close(ours, ref, what):
    assert np.abs(ref).max() > 0.1, what
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOL, f"{what}: max abs logit difference {diff:.3g} > {TOL}"


@pytest.mark.parametrize("family", list(PUBLISHED_FIELDS))
def test_tiny_configs_use_the_published_field_names(family):
    assert set(hf_config(family)) <= PUBLISHED_FIELDS[family], set(hf_config(family)) - PUBLISHED_FIELDS[family]
    assert PUBLISHED_FIELDS[family] - set(hf_config(family)) <= {"transformers_version"}


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_reference_and_export_reads_back(case, tmp_path):
    family, kw = CASES[case]
    make_hf_checkpoint(tmp_path / "src", family, seed=len(case), **kw)
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path / "src"), lazy=True)
    assert meta["family"] == family and cfg.qk_norm and cfg.attn_head_dim() == 16
    assert not isinstance(state["layers.0.attn.q_proj.weight"], np.ndarray)  # lazy: mapped, transposed on read
    if family == "qwen3_moe":
        assert not isinstance(state["layers.1.mlp.experts.w_gate"], np.ndarray)  # stacked lazily
        assert cfg.moe_first_dense_layers == len(kw.get("mlp_only_layers", [])) and cfg.moe_aux_loss_coef == 0
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))
    close(our_logits(cfg, state, paddle.to_tensor(ids)), reference_logits(tmp_path / "src", ids), f"{case} read")

    fresh = random_state(cfg, seed=5)
    biases = [k for k in fresh if k.endswith("mlp.expert_bias")]
    if biases:  # Qwen3-MoE routes without our auxiliary-loss-free bias: a moved one is refused, zeros go out
        moved = dict(fresh, **{biases[-1]: np.full_like(fresh[biases[-1]], 0.01)})
        with pytest.raises(UnsupportedConfig, match="expert_bias is non-zero"):
            write_hf_checkpoint(cfg, moved, str(tmp_path / "refused"))
        assert all(not np.any(fresh[k]) for k in biases)
    info = write_hf_checkpoint(cfg, fresh, str(tmp_path / "out"), max_shard_bytes=40_000)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert set(written) <= PUBLISHED_FIELDS[family] | READ_TOO, set(written) - PUBLISHED_FIELDS[family]
    assert info["shards"] > 1 and written["architectures"] == [hf_config(family)["architectures"][0]]
    ours = our_logits(cfg, fresh, paddle.to_tensor(ids))
    close(ours, reference_logits(tmp_path / "out", ids), f"{case} written")
    cfg2, state2, _ = read_paddlenlp_checkpoint(str(tmp_path / "out"))
    fields = ("rope_scaling", "sliding_window", "sliding_window_layers", "head_dim", "qk_norm", "moe_num_experts",
              "moe_first_dense_layers", "moe_norm_topk", "tie_embeddings", "max_position_embeddings")
    assert all(getattr(cfg2, f) == getattr(cfg, f) for f in fields), [f for f in fields
                                                                        if getattr(cfg2, f) != getattr(cfg, f)]
    close(our_logits(cfg2, state2, paddle.to_tensor(ids)), ours, f"{case} read back")


def test_output_router_logits_imports_the_pooled_aux_loss(tmp_path):
    """With output_router_logits transformers' loss adds router_aux_loss_coef x the aux loss pooled over layers:
    the import sets that coefficient and scope, and our training loss equals hf_tiny's reference loss."""
    from hf_tiny import reference_loss

    from llmtrain.models import build_model
    from llmtrain.models.init import load_full_state
    from llmtrain.models.stages import canonical_parameters

    make_hf_checkpoint(tmp_path, "qwen3_moe", seed=2, output_router_logits=True, router_aux_loss_coef=0.5)
    cfg, state, _ = read_paddlenlp_checkpoint(str(tmp_path))
    assert cfg.moe_aux_loss_coef == 0.5 and cfg.moe_aux_loss_scope == "model"
    model = build_model(cfg)
    load_full_state(canonical_parameters(model), state)
    model.train()
    rng = np.random.default_rng(3)
    ids, labels = rng.integers(0, cfg.vocab_size, (2, 12)), rng.integers(0, cfg.vocab_size, (2, 12))
    mask = np.ones((2, 12), np.float32)
    loss_sum, tokens = model.loss_fn(model(paddle.to_tensor(ids)), (paddle.to_tensor(labels), paddle.to_tensor(mask)))
    ours = float(loss_sum) / float(tokens)
    want = reference_loss(tmp_path, ids, labels, mask)
    assert abs(ours - want) < 1e-4, (ours, want)
    c = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, "output_router_logits": False}))
    assert abs(reference_loss(tmp_path, ids, labels, mask) - want) > 0.1  # the aux term is in it


@pytest.mark.parametrize("change,match", [
    (dict(qk_norm=True), "qk_norm"),
    (dict(head_dim=16), "head_dim=16"),
    (dict(sliding_window=4), "sliding_window=4"),
])
def test_paddlenlp_export_refuses_what_paddlenlp_cannot_compute(change, match, tmp_path):
    import dataclasses

    make_hf_checkpoint(tmp_path / "src", "llama", seed=1)
    cfg, state, _ = read_paddlenlp_checkpoint(str(tmp_path / "src"))
    cfg = dataclasses.replace(cfg, **change)
    with pytest.raises(UnsupportedConfig, match=match):
        write_paddlenlp_checkpoint(cfg, random_state(cfg, 0), str(tmp_path / "out"))

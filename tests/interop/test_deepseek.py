"""Hugging Face DeepSeek-V2 / V3 checkpoints in and out, against a numpy forward of the published architecture.

    python -m pytest tests/interop/test_deepseek.py -q

The checkpoints are built by `tests/hf_deepseek.py` (its own writer: DeepSeek's tensor names, [out, in] weights,
interleaved rotary rows, two shards + index, the published config.json fields); the reference is
`hf_deepseek.deepseek_logits` (float64 numpy), not our model.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from hf_deepseek import PUBLISHED_KEYS, deepseek_config, deepseek_logits, deepseek_shapes, make_deepseek_checkpoint
from interop_helpers import assert_close, our_logits, random_state

from llmtrain.interop import read_paddlenlp_checkpoint
from llmtrain.interop.hf_format import write_hf_checkpoint
from llmtrain.interop.keys import UnsupportedConfig

CASES = {
    "v3": ("deepseek_v3", dict(num_nextn_predict_layers=1)),  # + one MTP module in the files, skipped
    "v3-no-q-rank-tied": ("deepseek_v3", dict(q_lora_rank=None, tie_word_embeddings=True, n_group=1, topk_group=1)),
    "v2-lite": ("deepseek_v2", {}),
    "v2-groups-normed": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=1,
                                             norm_topk_prob=True, routed_scaling_factor=16.0)),
}
ROPE = {}  # the tiny YaRN of hf_deepseek (original 16 positions): the 20-position runs go past it


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_checkpoint_imports_with_reference_logits(case, tmp_path):
    import paddle

    model_type, kw = CASES[case]
    c = make_deepseek_checkpoint(tmp_path, model_type, seed=len(case), **ROPE, **kw)
    assert set(deepseek_config(model_type)) == set(PUBLISHED_KEYS[model_type])  # the published fields, no others
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path), lazy=True)
    assert meta["layout"] == "huggingface" and meta["family"] == model_type and meta["sharded"]
    assert cfg.is_mla() and cfg.mla_q_lora_rank == c["q_lora_rank"] and cfg.moe_num_experts == 8
    assert not isinstance(state["layers.0.attn.kv_a_proj.weight"], np.ndarray)  # lazy: read on use
    if c.get("num_nextn_predict_layers"):
        assert any("multi-token prediction" in n for n in meta["notes"])
        assert all("multi-token prediction" in why for k, why in meta["ignored"].items() if ".layers.3." in k)
        assert "model.layers.3.eh_proj.weight" in meta["ignored"]
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20))
    assert_close(our_logits(cfg, state, paddle.to_tensor(ids)), deepseek_logits(tmp_path, ids), case)


def test_fp8_release_is_read_with_its_block_scales(tmp_path):
    """DeepSeek-V3's FP8 form: float8 e4m3 linears with a weight_scale_inv per block, dequantized lazily."""
    import paddle

    from hf_deepseek import fp8_decode

    from llmtrain.interop.tensor_files import E4M3

    np.testing.assert_array_equal(E4M3[np.isfinite(E4M3)], fp8_decode(np.arange(256, dtype=np.uint8))[np.isfinite(E4M3)])
    make_deepseek_checkpoint(tmp_path, "deepseek_v3", seed=5, fp8_block=(8, 4), **ROPE)
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path), lazy=True)
    assert any("FP8 weights (block (8, 4))" in n for n in meta["notes"])
    kv_b = np.asarray(state["layers.1.attn.kv_b_proj.weight"])
    assert len(np.unique(kv_b)) > 64  # scaled per block, not 256 raw codes
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20))
    assert_close(our_logits(cfg, state, paddle.to_tensor(ids)), deepseek_logits(tmp_path, ids), "fp8")


def test_group_limits_and_the_bias_change_the_choice():
    """The tiny V3's router inputs make group-limited routing and the correction bias matter (else the reference
    comparison would not test them)."""
    from hf_deepseek import route

    logits = np.random.default_rng(0).standard_normal([64, 8])
    bias = 0.3 * np.random.default_rng(1).standard_normal(8)
    c = deepseek_config("deepseek_v3")
    grouped, _ = route(c, logits, bias)
    free, _ = route(dict(c, n_group=1, topk_group=1), logits, bias)
    unbiased, _ = route(c, logits, None)
    assert (np.sort(grouped, -1) != np.sort(free, -1)).any(axis=-1).mean() > 0.2
    assert (np.sort(grouped, -1) != np.sort(unbiased, -1)).any(axis=-1).mean() > 0.2


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_export_gives_reference_logits_and_the_published_layout(model_type, tmp_path):
    import paddle

    make_deepseek_checkpoint(tmp_path / "src", model_type, seed=2, **ROPE)
    cfg, _, _ = read_paddlenlp_checkpoint(str(tmp_path / "src"))
    state = random_state(cfg, seed=4)
    if model_type == "deepseek_v2":  # DeepSeek-V2's gate has no bias
        state = {k: np.zeros_like(v) if k.endswith("expert_bias") else v for k, v in state.items()}
    src = json.loads((tmp_path / "src" / "config.json").read_text())
    special = {k: src[k] for k in ("bos_token_id", "eos_token_id")}  # the ids of the run's tokenizer, as recorded
    info = write_hf_checkpoint(cfg, state, str(tmp_path / "out"), max_shard_bytes=50_000, special_ids=special)
    assert info["family"] == {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}[model_type]
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert set(written) == set(PUBLISHED_KEYS[model_type]) and written["model_type"] == model_type
    assert {k: written[k] for k in special} == special
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(deepseek_shapes(written))  # DeepSeek's tensor names, no MTP
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 20))
    assert_close(our_logits(cfg, state, paddle.to_tensor(ids)), deepseek_logits(tmp_path / "out", ids), model_type)
    back, state2, _ = read_paddlenlp_checkpoint(str(tmp_path / "out"))
    for k in ("mla_q_lora_rank", "moe_router", "moe_n_group", "moe_routed_scale", "moe_norm_topk"):
        assert getattr(back, k) == getattr(cfg, k), k
    for k, v in state.items():
        np.testing.assert_array_equal(state2[k], v, err_msg=k)  # the rotary rows go back where they came from


@pytest.mark.parametrize("field,value,needle", [
    ("quantization_config", {"quant_method": "awq", "bits": 4}, "quant_method fp8, fmt e4m3"),
    ("attention_bias", True, "attention_bias=true"),
    ("moe_layer_freq", 2, "moe_layer_freq=2"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("scoring_func", "softmax", "topk_method='noaux_tc' with scoring_func='softmax'"),
])
def test_unsupported_deepseek_configs_are_refused_naming_the_field(field, value, needle, tmp_path):
    make_deepseek_checkpoint(tmp_path, "deepseek_v3", **ROPE, **{field: value})
    with pytest.raises(UnsupportedConfig, match="config.json") as e:
        read_paddlenlp_checkpoint(str(tmp_path))
    assert needle in str(e.value) and "DeepseekV3ForCausalLM" in str(e.value)


def test_v2_export_refuses_what_deepseek_v2_cannot_compute(tmp_path):
    make_deepseek_checkpoint(tmp_path / "src", "deepseek_v2", seed=1, **ROPE)
    cfg, state, _ = read_paddlenlp_checkpoint(str(tmp_path / "src"))
    state = {k: np.asarray(v) for k, v in state.items()}
    state["layers.1.mlp.expert_bias"] = np.full([8], 0.5, np.float32)
    with pytest.raises(UnsupportedConfig, match="layers.1.mlp.expert_bias is non-zero"):
        write_hf_checkpoint(cfg, state, str(tmp_path / "a"))
    import dataclasses

    normed = dataclasses.replace(cfg, moe_norm_topk=True, moe_routed_scale=2.0)
    with pytest.raises(UnsupportedConfig, match="moe_norm_topk=true with moe_routed_scale=2.0"):
        write_hf_checkpoint(normed, state, str(tmp_path / "b"))

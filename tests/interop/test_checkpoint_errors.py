"""Bad PaddleNLP checkpoints stop with a message that lists every problem (no paddlenlp needed).

    python -m pytest tests/interop/test_checkpoint_errors.py -q
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from interop_helpers import random_state

from llmtrain.interop import (CheckpointFileError, CheckpointMismatch, UnsupportedConfig, read_paddlenlp_checkpoint,
                              write_paddlenlp_checkpoint)
from llmtrain.interop.tensor_files import read_safetensors, write_pdparams, write_safetensors
from llmtrain.models.config import ModelConfig

LLAMA = ModelConfig(name="l", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                    vocab_size=128, max_position_embeddings=64, position="rope", norm="rmsnorm", norm_eps=1e-6,
                    activation="swiglu", bias=False, tie_embeddings=False)
GPT = ModelConfig(name="g", hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, vocab_size=128,
                  max_position_embeddings=64)


def exported(tmp_path, cfg=LLAMA, name="ckpt"):
    """A valid checkpoint directory and its tensors (PaddleNLP names)."""
    out = str(tmp_path / name)
    write_paddlenlp_checkpoint(cfg, random_state(cfg, 0), out)
    return out, read_safetensors(os.path.join(out, "model.safetensors"), bf16_bits=False)


def rewrite(ckpt, tensors):
    write_safetensors(tensors, os.path.join(ckpt, "model.safetensors"))


def edit_config(ckpt, **fields):
    path = os.path.join(ckpt, "config.json")
    c = json.load(open(path))
    c.update(fields)
    json.dump(c, open(path, "w"))


def test_missing_unexpected_and_misshaped_are_listed_together(tmp_path):
    ckpt, t = exported(tmp_path)
    del t["llama.layers.1.mlp.up_proj.weight"], t["llama.norm.weight"]
    t["llama.layers.0.self_attn.k_proj.weight"] = np.zeros([32, 32], np.float32)
    t["llama.layers.0.self_attn.q_norm.weight"] = np.zeros([8], np.float32)
    t["classifier.weight"] = np.zeros([32, 2], np.float32)
    rewrite(ckpt, t)
    with pytest.raises(CheckpointMismatch) as e:
        read_paddlenlp_checkpoint(ckpt)
    msg = str(e.value)
    assert "missing keys (2): llama.layers.1.mlp.up_proj.weight, llama.norm.weight" in msg
    assert "llama.layers.0.self_attn.k_proj.weight" in msg and "has [32, 32], config needs [32, 16]" in msg
    assert "unexpected keys (2)" in msg and "classifier.weight" in msg and "self_attn.q_norm.weight" in msg
    assert "model.safetensors" in msg  # names the file the key came from


def test_mismatch_is_a_state_mismatch(tmp_path):
    """Callers that already catch the loader's StateMismatch catch ours too."""
    from llmtrain.models.init import StateMismatch

    ckpt, t = exported(tmp_path)
    del t["lm_head.weight"]
    rewrite(ckpt, t)
    with pytest.raises(StateMismatch, match="lm_head.weight"):
        read_paddlenlp_checkpoint(ckpt)


def test_vocab_of_config_and_weights_disagree(tmp_path):
    ckpt, _ = exported(tmp_path)
    edit_config(ckpt, vocab_size=256)
    with pytest.raises(CheckpointMismatch, match=r"llama.embed_tokens.weight .*has \[128, 32\], config needs \[256, 32\]"):
        read_paddlenlp_checkpoint(ckpt)


@pytest.mark.parametrize("fields, words", [
    (dict(rope_scaling_type="linear", rope_scaling_factor=2.0), "rope_scaling_type"),
    (dict(alibi=True), "alibi"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3"),
])
def test_llama_configs_we_cannot_compute_are_refused(tmp_path, fields, words):
    ckpt, _ = exported(tmp_path)
    edit_config(ckpt, **fields)
    with pytest.raises(UnsupportedConfig, match=words):
        read_paddlenlp_checkpoint(ckpt)


@pytest.mark.parametrize("fields, words", [
    (dict(hidden_activation="relu"), "hidden_activation"),
    (dict(scale_qk_coeff=2.0), "scale_qk_coeff"),
])
def test_gpt_configs_we_cannot_compute_are_refused(tmp_path, fields, words):
    ckpt, _ = exported(tmp_path, GPT)
    edit_config(ckpt, **fields)
    with pytest.raises(UnsupportedConfig, match=words):
        read_paddlenlp_checkpoint(ckpt)


def test_gpt_layer_norm_eps_follows_paddlenlp_not_config(tmp_path):
    ckpt, _ = exported(tmp_path, GPT)
    edit_config(ckpt, layer_norm_eps=1e-12)
    cfg, _, meta = read_paddlenlp_checkpoint(ckpt)
    assert cfg.norm_eps == 1e-5 and any("layer_norm_eps" in n for n in meta["notes"])


def test_gpt_lm_head_that_is_not_the_word_table_is_refused(tmp_path):
    ckpt, t = exported(tmp_path, GPT)
    t["lm_head.weight"] = t["lm_head.weight"] + 1.0
    rewrite(ckpt, t)
    with pytest.raises(CheckpointMismatch, match="ties them"):
        read_paddlenlp_checkpoint(ckpt)


def test_rotary_buffer_is_checked_not_dropped(tmp_path):
    from llmtrain.interop.llama import rope_inv_freq

    ckpt, t = exported(tmp_path)
    t["llama.layers.0.self_attn.rotary_emb.inv_freq"] = rope_inv_freq(8, 10000.0)
    rewrite(ckpt, t)
    _, _, meta = read_paddlenlp_checkpoint(ckpt)
    assert "llama.layers.0.self_attn.rotary_emb.inv_freq" in meta["ignored"]
    t["llama.layers.0.self_attn.rotary_emb.inv_freq"] = rope_inv_freq(8, 500000.0)
    rewrite(ckpt, t)
    with pytest.raises(CheckpointMismatch, match="rotary frequencies"):
        read_paddlenlp_checkpoint(ckpt)


def test_base_model_state_dict_without_prefix(tmp_path):
    ckpt, t = exported(tmp_path)
    rewrite(ckpt, {k.removeprefix("llama."): v for k, v in t.items()})
    cfg, state, meta = read_paddlenlp_checkpoint(ckpt)
    assert any("base-model" in n for n in meta["notes"]) and "lm_head.proj.weight" in state


def test_pickle_warning_is_printed_unless_turned_off(tmp_path):
    ckpt, t = exported(tmp_path)
    os.remove(os.path.join(ckpt, "model.safetensors"))
    write_pdparams(t, os.path.join(ckpt, "model_state.pdparams"))
    _, _, meta = read_paddlenlp_checkpoint(ckpt)
    assert len(meta["warnings"]) == 1 and "pickle" in meta["warnings"][0] and "arbitrary code" in meta["warnings"][0]
    _, state, meta = read_paddlenlp_checkpoint(ckpt, trusted=True)
    assert meta["warnings"] == [] and meta["format"] == "pdparams"


def test_truncated_safetensors_names_the_file(tmp_path):
    ckpt, _ = exported(tmp_path)
    path = os.path.join(ckpt, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(CheckpointFileError, match="model.safetensors.*truncated"):
        read_paddlenlp_checkpoint(ckpt)


def test_index_naming_an_absent_shard(tmp_path):
    ckpt, _ = exported(tmp_path)
    os.remove(os.path.join(ckpt, "model.safetensors"))
    json.dump({"weight_map": {"llama.norm.weight": "model-00001-of-00002.safetensors"}},
              open(os.path.join(ckpt, "model.safetensors.index.json"), "w"))
    with pytest.raises(CheckpointFileError, match="model-00001-of-00002.safetensors"):
        read_paddlenlp_checkpoint(ckpt)


def test_no_weights_and_tensor_parallel_files(tmp_path):
    ckpt, _ = exported(tmp_path)
    os.rename(os.path.join(ckpt, "model.safetensors"), os.path.join(ckpt, "model_state.tp00.pdparams"))
    with pytest.raises(CheckpointFileError, match="tensor-parallel split files"):
        read_paddlenlp_checkpoint(ckpt)


def test_unknown_model_type(tmp_path):
    ckpt, _ = exported(tmp_path)
    edit_config(ckpt, model_type="chatglm", architectures=["ChatGLMForCausalLM"])
    with pytest.raises(UnsupportedConfig, match="chatglm"):
        read_paddlenlp_checkpoint(ckpt)

"""PaddleNLP Qwen (`QWenForCausalLM`, 2.8.1): import, export and LoRA adapters both ways, logits equal.

    python -m pytest tests/interop/test_qwen.py -q

Tiny Qwens are made by the real package (`save_pretrained`), with every parameter random (biases and norms
included), so a swapped q/k/v third, w1/w2 or a missing bias shows in the logits.
"""
from __future__ import annotations

import json

import numpy as np
import paddle
import pytest
from interop_helpers import (assert_close, our_logits, paddlenlp_logits, random_state, randomize_lora,
                             randomize_paddlenlp, token_ids)

from llmtrain.interop import read_paddlenlp_checkpoint, write_paddlenlp_checkpoint
from llmtrain.interop.keys import UnsupportedConfig
from llmtrain.interop.lora_format import read_paddlenlp_lora, write_paddlenlp_lora
from llmtrain.models import build_model
from llmtrain.models.config import ModelConfig
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import load_full_state
from llmtrain.models.lora import LoraConfig, attach_lora, is_adapter
from llmtrain.models.roles import Roles

from paddlenlp.peft import LoRAConfig, LoRAModel  # noqa: E402  (the real package; missing -> the tests fail)
from paddlenlp.transformers import AutoModelForCausalLM, QWenConfig, QWenForCausalLM  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, kv_channels=8,
            intermediate_size=96, max_position_embeddings=64, seq_length=32, layer_norm_epsilon=1e-5,
            rotary_emb_base=5000)


def qwen(**kw):
    return QWenForCausalLM(QWenConfig(**{**TINY, **kw}))


@pytest.mark.parametrize("kw", [{}, dict(no_bias=False)], ids=["qkv-bias-only", "all-biases"])
def test_import_matches_paddlenlp_qwen(kw, tmp_path):
    ref = qwen(**kw)
    randomize_paddlenlp(ref, seed=4)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path), trusted=True)
    assert meta["family"] == "qwen" and cfg.has_qkv_bias() and cfg.bias == ("no_bias" in kw)
    assert cfg.ffn_hidden_size == 48 and cfg.max_position_embeddings == 32  # seq_length: dynamic NTK / logn
    ids = token_ids(cfg.vocab_size, seq=32)
    assert_close(our_logits(cfg, state, ids), paddlenlp_logits(ref, ids), f"qwen {kw}")


def test_export_loads_in_paddlenlp_and_reimports(tmp_path):
    cfg = ModelConfig(name="q", hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=40, vocab_size=128,
                      max_position_embeddings=64, position="rope", rope_theta=20000.0, norm="rmsnorm", norm_eps=1e-6,
                      activation="swiglu", bias=False, qkv_bias=True, tie_embeddings=True)
    state = random_state(cfg, seed=2)
    info = write_paddlenlp_checkpoint(cfg, state, str(tmp_path / "out"), safetensors=False)
    assert info["family"] == "qwen"
    ids = token_ids(cfg.vocab_size, seed=1, seq=24)
    ours = our_logits(cfg, state, ids)
    assert_close(ours, paddlenlp_logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")), ids),
                 "our Qwen -> PaddleNLP")
    cfg2, state2, _ = read_paddlenlp_checkpoint(str(tmp_path / "out"), trusted=True)
    assert cfg2.tie_embeddings and cfg2.qkv_bias and not cfg2.bias  # the head = embedding^T comes back tied
    assert_close(our_logits(cfg2, state2, ids), ours, "re-imported")
    gqa = ModelConfig(**{**cfg.__dict__, "num_kv_heads": 2})
    with pytest.raises(UnsupportedConfig, match="grouped-query Qwen2 goes out with --format hf"):
        write_paddlenlp_checkpoint(gqa, random_state(gqa, 0), str(tmp_path / "gqa"))


def test_unsupported_qwen_configs_are_named(tmp_path):
    ref = qwen()
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    c = json.loads((tmp_path / "config.json").read_text())
    c.update(rotary_pct=0.5, kv_channels=16)
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(UnsupportedConfig, match=r"kv_channels=16.*rotary_pct=0.5"):
        read_paddlenlp_checkpoint(str(tmp_path))


def _lora_model(cfg, lora, state):
    model = build_model(cfg)
    attach_lora(model, lora, Roles())
    load_full_state(canonical_parameters(model), state, source="test state")
    model.eval()
    return model


def _logits(model, ids):
    with paddle.no_grad():
        return model(ids).numpy()


@pytest.mark.parametrize("targets", [[r".*\.(q|v|o)_proj", r".*\.mlp\..*"], [r".*attn\.(q|k|v)_proj"]],
                         ids=["qv-o-mlp", "qkv"])
def test_our_qwen_adapters_load_in_paddlenlp(targets, tmp_path):
    """Ours (own A per q/k/v) -> one stacked c_attn adapter of rank n r: PaddleNLP's LoRAModel gives our logits,
    and reading the directory back gives the same logits again."""
    ref = qwen()
    randomize_paddlenlp(ref, seed=8)
    ref.save_pretrained(str(tmp_path / "base"), safe_serialization=True)
    cfg, base, _ = read_paddlenlp_checkpoint(str(tmp_path / "base"))
    lora = LoraConfig(rank=2, alpha=6, target_modules=targets)
    model = build_model(cfg)
    attach_lora(model, lora, Roles())
    rng = np.random.default_rng(9)
    adapters = {n: (0.3 * rng.standard_normal(p.shape)).astype(np.float32)
                for n, p in canonical_parameters(model) if is_adapter(n)}
    ids = token_ids(cfg.vocab_size, seed=3, seq=20)
    ours = _logits(_lora_model(cfg, lora, {**base, **adapters}), ids)
    info = write_paddlenlp_lora(cfg, lora, adapters, str(tmp_path / "lora"), base=str(tmp_path / "base"))
    n_qkv = 2 if targets[0].endswith("(q|v|o)_proj") else 3
    assert info["rank"] == n_qkv * 2
    theirs = LoRAModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")),
                                       str(tmp_path / "lora"))
    assert float(np.abs(ours - paddlenlp_logits(ref, ids)).max()) > 1e-2  # the adapters matter
    assert_close(ours, paddlenlp_logits(theirs, ids), "our Qwen adapters -> LoRAModel")
    settings, back = read_paddlenlp_lora(str(tmp_path / "lora"), cfg, trusted=True)
    lora2 = LoraConfig(rank=settings["rank"], alpha=settings["alpha"], target_modules=settings["target_modules"])
    assert_close(_logits(_lora_model(cfg, lora2, {**base, **back}), ids), ours, "written and read back")


def test_paddlenlp_qwen_adapters_load_into_ours(tmp_path):
    ref = qwen(no_bias=False)
    randomize_paddlenlp(ref, seed=10)
    ref.save_pretrained(str(tmp_path / "base"), safe_serialization=True)
    lm = LoRAModel(ref, LoRAConfig(r=4, lora_alpha=8, target_modules=[".*c_attn", ".*mlp.w2", ".*attn.c_proj"]))
    randomize_lora(lm, "lora_", 0.2, seed=11)
    lm.save_pretrained(str(tmp_path / "pnlp_lora"))
    ids = token_ids(96, seed=4, seq=20)
    theirs = paddlenlp_logits(lm, ids)
    cfg, base, _ = read_paddlenlp_checkpoint(str(tmp_path / "base"))
    settings, adapters = read_paddlenlp_lora(str(tmp_path / "pnlp_lora"), cfg, trusted=True)
    assert settings["rank"] == 4 and len(adapters) == 2 * 5 * cfg.num_layers  # q, k, v, o, gate
    lora = LoraConfig(rank=4, alpha=settings["alpha"], target_modules=settings["target_modules"])
    assert_close(_logits(_lora_model(cfg, lora, {**base, **adapters}), ids), theirs, "LoRAModel Qwen -> ours")

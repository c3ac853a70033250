"""LoRA adapters in PaddleNLP's format, both ways, with the real `paddlenlp.peft` (2.8.1): equal logits.

    python -m pytest tests/interop/test_lora_paddlenlp.py -q

- ours -> PaddleNLP: our model + adapters, written as lora_config.json + lora_model_state.pdparams (or
  peft_model.safetensors), loaded with `LoRAModel.from_pretrained` on the PaddleNLP base: same logits;
- PaddleNLP -> ours: a `LoRAModel` made and saved by PaddleNLP, read into our model: same logits;
- merged: W + A B alpha/r written as a plain PaddleNLP model gives the unmerged forward's logits.
Adapters are random with B != 0 (at init B = 0 and every comparison would be trivially the base's).
"""
from __future__ import annotations

import numpy as np
import paddle
import pytest
from interop_helpers import assert_close, paddlenlp_logits, random_state, randomize_lora, token_ids

from llmtrain.interop import write_paddlenlp_checkpoint
from llmtrain.interop.lora_format import merge_adapters, read_paddlenlp_lora, write_paddlenlp_lora
from llmtrain.models import build_model
from llmtrain.models.config import ModelConfig
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import load_full_state
from llmtrain.models.lora import LoraConfig, attach_lora, is_adapter
from llmtrain.models.roles import Roles

from paddlenlp.peft import LoRAConfig, LoRAModel  # noqa: E402  (the real package; missing -> the test fails)
from paddlenlp.transformers import AutoModelForCausalLM  # noqa: E402

CFGS = {
    "llama": ModelConfig(name="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                         vocab_size=128, max_position_embeddings=64, position="rope", norm="rmsnorm", norm_eps=1e-6,
                         activation="swiglu", bias=False, tie_embeddings=False),
    "gpt": ModelConfig(name="gpt", hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, vocab_size=128,
                       max_position_embeddings=64, position="learned", norm="layernorm", activation="gelu_tanh",
                       bias=True, tie_embeddings=True),
}
TARGETS = [r"layers\.\d+\.attn\.(q|v|o)_proj", r"layers\.1\.mlp\.(gate|up|down)_proj"]


def lora_model(cfg, lora, state):
    model = build_model(cfg)
    attach_lora(model, lora, Roles())
    load_full_state(canonical_parameters(model), state, source="test state")
    model.eval()
    return model


def random_adapters(model, seed) -> dict:
    rng = np.random.default_rng(seed)
    return {n: (0.2 * rng.standard_normal(p.shape)).astype(np.float32)
            for n, p in canonical_parameters(model) if is_adapter(n)}


def logits(model, ids):
    with paddle.no_grad():
        return model(ids).numpy()


@pytest.mark.parametrize("safe", [False, True], ids=["pdparams", "safetensors"])
@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_our_adapters_load_in_paddlenlp_lora_model(family, safe, tmp_path):
    cfg = CFGS[family]
    lora = LoraConfig(rank=4, alpha=8, target_modules=TARGETS if family == "llama" else [r".*_proj"])
    base = random_state(cfg, seed=3)
    model = build_model(cfg)
    attach_lora(model, lora, Roles())
    adapters = random_adapters(model, seed=4)
    n_adapted = len(adapters) // 2
    assert n_adapted == (2 * 3 + 3 if family == "llama" else 2 * 6)
    load_full_state(canonical_parameters(model), {**base, **adapters}, source="test state")
    model.eval()
    ids = token_ids(cfg.vocab_size, seed=1)
    ours = logits(model, ids)

    write_paddlenlp_checkpoint(cfg, base, str(tmp_path / "base"))
    info = write_paddlenlp_lora(cfg, lora, adapters, str(tmp_path / "lora"), base=str(tmp_path / "base"),
                                safetensors=safe)
    assert info["modules"] == n_adapted
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    base_logits = paddlenlp_logits(ref, ids)
    lm = LoRAModel.from_pretrained(ref, str(tmp_path / "lora"))
    assert float(np.abs(ours - base_logits).max()) > 1e-2  # the adapters matter
    assert_close(ours, paddlenlp_logits(lm, ids), f"{family} ours -> LoRAModel")


def test_paddlenlp_made_adapters_load_into_ours(tmp_path):
    cfg = CFGS["llama"]
    base = random_state(cfg, seed=5)
    write_paddlenlp_checkpoint(cfg, base, str(tmp_path / "base"))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    lm = LoRAModel(ref, LoRAConfig(r=4, lora_alpha=16, target_modules=[".*q_proj", ".*k_proj", ".*down_proj"]))
    randomize_lora(lm, "lora_", 0.2, seed=6)
    lm.save_pretrained(str(tmp_path / "pnlp_lora"))
    ids = token_ids(cfg.vocab_size, seed=2)
    theirs = paddlenlp_logits(lm, ids)

    settings, adapters = read_paddlenlp_lora(str(tmp_path / "pnlp_lora"), cfg, trusted=True)
    assert settings["rank"] == 4 and settings["alpha"] == 16 and len(adapters) == 2 * 3 * cfg.num_layers
    lora = LoraConfig(rank=settings["rank"], alpha=settings["alpha"], target_modules=settings["target_modules"])
    ours = logits(lora_model(cfg, lora, {**base, **adapters}), ids)
    assert_close(ours, theirs, "LoRAModel -> ours")


def test_merged_export_equals_unmerged_forward(tmp_path):
    cfg = CFGS["llama"]
    lora = LoraConfig(rank=4, alpha=8, target_modules=TARGETS)
    base = random_state(cfg, seed=7)
    model = build_model(cfg)
    attach_lora(model, lora, Roles())
    adapters = random_adapters(model, seed=8)
    ids = token_ids(cfg.vocab_size, seed=3)
    ours = logits(lora_model(cfg, lora, {**base, **adapters}), ids)
    merged = merge_adapters(base, adapters, lora.alpha / lora.rank)
    write_paddlenlp_checkpoint(cfg, merged, str(tmp_path / "merged"))
    assert_close(ours, paddlenlp_logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")), ids),
                 "merged PaddleNLP model vs unmerged forward")

"""DeepSeek-V3 and DeepSeek-V2-Lite in the families' end-to-end checks (tests/e2e/family_checks.py).

    python -m pytest tests/e2e/test_families_e2e.py -q -k deepseek

Sources: tiny Hugging Face-layout checkpoints written by tests/hf_deepseek.py (DeepSeek's tensor names, interleaved
rotary rows and config fields) with a byte-level BPE tokenizer.json; reference: hf_deepseek's numpy forward of the
published architecture. Two blocks (dense, then MoE) of multi-head latent attention (4 heads: q/k 8 + 8 wide, v 6;
kv rank 16; V3 with a q rank of 12) under YaRN (original 16 positions: the 32-40 position runs go past it); V3's
sigmoid router with its correction bias, top-2 within 2 of 4 groups, renormalised x 2.5, one shared expert;
V2-Lite's softmax greedy top-2, not renormalised, 2 shared experts; 8 experts of width 16.
Layouts: both under tp2, pp2 and ep2; V3 also LoRA on every MLA linear (the replicated down-projections too) under
tp2, exported merged. The gradients of an MLA block under tp are checked one by one in
tests/parallel/mla_grads.py (in test_parity.py's tp2 launch).
"""
from __future__ import annotations

import numpy as np
from family_checks import EXAMPLES, Family, register, write_sft
from hf_deepseek import deepseek_logits, make_deepseek_checkpoint
from hf_tiny import make_hf_tokenizer

LORA_TARGETS = r"['layers\.\d+\.attn\.(q_a|q_b|kv_a|kv_b|o)_proj','layers\.\d+\.mlp\.(gate|up|down)_proj']"


def _make(model_type: str, seed: int):
    def make(root, tiny_corpus):
        from llmtrain.tokenizer import load_tokenizer

        vocab = load_tokenizer(tiny_corpus["tokenizer"]).vocab_size  # the pretraining corpus's ids fit the table
        make_deepseek_checkpoint(root, model_type, seed=seed, vocab_size=vocab, num_hidden_layers=2,
                                 max_position_embeddings=128)
        make_hf_tokenizer(root, [p + r for p, r in EXAMPLES] * 10)
        write_sft(root)
        return root
    return make


def reference_loss(src, mb) -> float:
    """The masked mean cross entropy of one micro-batch under the numpy reference."""
    logits = deepseek_logits(src, mb["input_ids"])
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, mb["labels"][..., None].astype(np.int64), -1)[..., 0]
    return float((ce * mb["loss_mask"]).sum() / mb["loss_mask"].sum())


def _held(q_name: str):
    def held(layout, ranks):
        """tp2: heads split (2 of 4 per rank: q 2 x 16 wide, kv_b 2 x (8 + 6), o 2 x 6 rows), the replicated
        kv_a/q_a and the experts whole; pp2: one block per stage; ep2: 4 of the 8 experts per rank, attention
        whole."""
        shape = [{k: v["shape"] for k, v in p.items()} for p in ranks]
        if layout == "tp2":
            for s in shape:
                assert s[f"layers.0.attn.{q_name}.weight"][1] == 32 and s["layers.0.attn.kv_b_proj.weight"] == [16, 28]
                assert s["layers.1.attn.o_proj.weight"] == [12, 32] and s["layers.1.attn.kv_a_proj.weight"] == [32, 24]
                assert s["layers.1.mlp.experts.w_gate"] == [8, 32, 16]
                if "layers.1.attn.kv_a_proj.lora_B" in s:  # LoRA: a replicated linear's adapter whole, a column's B split
                    assert s["layers.1.attn.kv_a_proj.lora_B"] == [2, 24] and s["layers.1.attn.kv_b_proj.lora_B"] == [2, 28]
        elif layout == "pp2":
            assert any(k.startswith("layers.0.") for k in shape[0]) and not any(k.startswith("layers.1.") for k in shape[0])
            assert any(k.startswith("layers.1.") for k in shape[1]) and not any(k.startswith("layers.0.") for k in shape[1])
        else:
            for s in shape:
                assert s["layers.1.mlp.experts.w_down"] == [4, 16, 32] and s["layers.1.attn.kv_b_proj.weight"] == [16, 56]
                assert s["layers.1.mlp.expert_bias"] == [8] and s["layers.1.mlp.router.weight"] == [32, 8]
    return held


register(Family(name="deepseek_v3", make=_make("deepseek_v3", 7), reference_loss=reference_loss,
                reference_logits=deepseek_logits, held=_held("q_b_proj"), layouts=("tp2", "pp2", "ep2"), lora=True,
                lora_targets=LORA_TARGETS))
register(Family(name="deepseek_v2", make=_make("deepseek_v2", 8), reference_loss=reference_loss,
                reference_logits=deepseek_logits, held=_held("q_proj"), layouts=("tp2", "pp2", "ep2")))

"""Qwen3 and Qwen3-MoE in the families' end-to-end checks (tests/e2e/family_checks.py).

    python -m pytest tests/e2e/test_families_e2e.py -q -k qwen3

Sources: tiny Hugging Face-layout checkpoints written by tests/hf_tiny.py (transformers' names and config fields)
with a byte-level BPE tokenizer.json; reference: hf_tiny's numpy forward of the published architectures.
Both use what Qwen3 brings: head_dim 16 with hidden 32 and 4 heads (!= 32 / 4), QK-norm, and scaled RoPE and
sliding windows at sequence lengths past the scaling's original length: Qwen3 YaRN (original 16, runs of 32-40
positions) and a window of 8 on block 1 only (`max_window_layers` 1); Qwen3-MoE dynamic NTK (max_position_embeddings
24, so 32-40 positions are scaled) and a window of 12 on every block, 4 experts top-2 renormalised.
Layouts: Qwen3 tp2 (+ LoRA, exported merged), pp2; Qwen3-MoE tp2, pp2, ep2.
"""
from __future__ import annotations

from family_checks import EXAMPLES, Family, register, write_sft
from hf_tiny import make_hf_checkpoint, make_hf_tokenizer, reference_logits, reference_loss

QWEN3 = dict(intermediate_size=64, max_position_embeddings=64,
             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
             use_sliding_window=True, sliding_window=8, max_window_layers=1)
QWEN3_MOE = dict(max_position_embeddings=24, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                 use_sliding_window=True, sliding_window=12)


def _make(family, kw):
    def make(root, tiny_corpus):
        from llmtrain.tokenizer import load_tokenizer

        vocab = load_tokenizer(tiny_corpus["tokenizer"]).vocab_size  # the pretraining corpus's ids fit the table
        make_hf_checkpoint(root, family, seed=7, vocab_size=vocab, **kw)
        make_hf_tokenizer(root, [p + r for p, r in EXAMPLES] * 10)
        write_sft(root)
        return root
    return make


def _loss(src, mb):
    return reference_loss(src, mb["input_ids"], mb["labels"], mb["loss_mask"])


def held_qwen3(layout, ranks):
    """tp2: q/k/v column halves (4 heads x 16 -> 2 per rank; 2 kv heads -> 1), o row half, QK-norm weights whole on
    both; pp2: one block per stage."""
    if layout == "tp2":
        for p in ranks:
            assert p["layers.0.attn.q_proj.weight"]["shape"] == [32, 32]
            assert p["layers.0.attn.k_proj.weight"]["shape"] == [32, 16]
            assert p["layers.0.attn.o_proj.weight"]["shape"] == [32, 32]
            assert p["layers.1.attn.q_norm.weight"]["shape"] == [16] == p["layers.1.attn.k_norm.weight"]["shape"]
    else:
        _held_stages(ranks)


def held_qwen3_moe(layout, ranks):
    """tp2: attention split as Qwen3's, the 4 experts whole on both ranks; pp2: one block per stage; ep2: experts
    0-1 on rank 0 and 2-3 on rank 1 ([2, h, f] each), attention and router whole."""
    if layout == "tp2":
        for p in ranks:
            assert p["layers.0.attn.q_proj.weight"]["shape"] == [32, 32]
            assert p["layers.0.mlp.experts.w_gate"]["shape"] == [4, 32, 24]
    elif layout == "ep2":
        for p in ranks:
            assert p["layers.0.mlp.experts.w_gate"]["shape"] == [2, 32, 24]
            assert p["layers.1.mlp.experts.w_down"]["shape"] == [2, 24, 32]
            assert p["layers.0.attn.q_proj.weight"]["shape"] == [32, 64]
            assert p["layers.0.mlp.router.weight"]["shape"] == [32, 4]
    else:
        _held_stages(ranks)


def _held_stages(ranks):
    assert "layers.0.attn.q_norm.weight" in ranks[0] and "layers.1.attn.q_norm.weight" not in ranks[0]
    assert "layers.1.attn.q_norm.weight" in ranks[1] and "layers.0.attn.q_norm.weight" not in ranks[1]


register(Family(name="qwen3", make=_make("qwen3", QWEN3), reference_loss=_loss, reference_logits=reference_logits,
                held=held_qwen3, layouts=("tp2", "pp2"), lora=True))
register(Family(name="qwen3_moe", make=_make("qwen3_moe", QWEN3_MOE), reference_loss=_loss,
                reference_logits=reference_logits, held=held_qwen3_moe, layouts=("tp2", "pp2", "ep2")))

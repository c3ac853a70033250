"""ERNIE 4.5 dense and MoE in the families' end-to-end checks (tests/e2e/family_checks.py).

    python -m pytest tests/e2e/test_families_e2e.py -q -k ernie45

Sources: tiny checkpoints made by the real PaddleFormers 1.2.0 (`Ernie4_5ForCausalLM` / `Ernie4_5_MoeForCausalLM`,
fuse_rms_norm=False, `save_pretrained`; tests/paddleformers_ref.py runs it in its own environment), the dense one
with PaddleFormers' `Ernie4_5Tokenizer` made from the tiny corpus's SentencePiece model (tokenizer.json +
tokenizer.model + tokenizer_config.json, as the -PT releases ship). Both: 4 heads of head_dim 16 with hidden 32 (q 64
wide), 2 kv heads, interleaved RoPE with theta 500000. The MoE one: block 0 dense, blocks 1-3 MoE
(moe_layer_start_index 1), 4 experts of width 16 top-2 on softmax + a non-zero e_score_correction_bias, 1 shared
expert, untied head, PaddleFormers' MTP block in the files (skipped on import).
References: the dense one PaddleFormers' own forward; the MoE one tests/ernie45_ref.py's numpy forward (PaddleFormers'
MoE forward needs GPU-only kernels), whose training loss adds PaddleFormers' router losses (aux with the unbiased
choices and z, per block, summed).
Layouts: dense tp2 (+ LoRA, exported merged, and as PaddleFormers adapters read by its LoRAModel), pp2; MoE tp2,
pp2, ep2. Exports go out with --format auto, i.e. in
PaddleFormers' layout, and are read back by the reference.
"""
from __future__ import annotations

import numpy as np
from ernie45_ref import ernie_logits, ernie_loss
from family_checks import Family, register, write_sft
from paddleformers_ref import pf_logits, pf_lora_logits, pf_make

SHAPE = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rope_theta=500000, max_position_embeddings=64, rms_norm_eps=1e-5)
DENSE = dict(SHAPE, num_hidden_layers=2, tie_word_embeddings=True)
MOE = dict(SHAPE, num_hidden_layers=4, tie_word_embeddings=False, moe_num_experts=4, moe_k=2,
           moe_intermediate_size=16, moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_interval=1)


def _make(kind: str, config: dict, seed: int):
    def make(root, tiny_corpus):
        from llmtrain.tokenizer import load_tokenizer

        vocab = load_tokenizer(tiny_corpus["tokenizer"]).vocab_size  # the pretraining corpus's ids fit the table
        pf_make(root, kind, dict(config, vocab_size=vocab), seed=seed,
                tokenizer=f"{tiny_corpus['tokenizer']}/tokenizer.model")
        write_sft(root)
        return root
    return make


def _ce(logits, mb) -> float:
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.asarray(mb["labels"])[..., None].astype(np.int64), -1)[..., 0]
    return float((ce * mb["loss_mask"]).sum() / mb["loss_mask"].sum())


def dense_loss(src, mb) -> float:
    """PaddleFormers' masked mean cross entropy of one micro-batch."""
    return _ce(pf_logits(src, mb["input_ids"]), mb)


def _stages(ranks, first: str, last: str):
    assert any(k.startswith(first) for k in ranks[0]) and not any(k.startswith(last) for k in ranks[0])
    assert any(k.startswith(last) for k in ranks[1]) and not any(k.startswith(first) for k in ranks[1])


def held_dense(layout, ranks):
    """tp2: q 4 heads x 16 -> 2 per rank, k/v 2 kv heads -> 1, o rows halved; pp2: one block per stage."""
    if layout != "tp2":
        return _stages(ranks, "layers.0.", "layers.1.")
    for p in ranks:
        assert p["layers.0.attn.q_proj.weight"]["shape"] == [32, 32]
        assert p["layers.1.attn.k_proj.weight"]["shape"] == [32, 16]
        assert p["layers.1.attn.o_proj.weight"]["shape"] == [32, 32]
        assert p["layers.0.mlp.gate_proj.weight"]["shape"] == [32, 24]


def held_moe(layout, ranks):
    """tp2: attention split, the 4 experts and the correction bias whole on both ranks, the shared expert split;
    pp2: blocks 0-1 on stage 0, 2-3 on stage 1; ep2: 2 of the 4 experts per rank, attention whole."""
    if layout == "pp2":
        return _stages(ranks, "layers.0.", "layers.3.")
    for p in ranks:
        assert "layers.0.mlp.gate_proj.weight" in p and "layers.0.mlp.router.weight" not in p  # block 0 dense
        assert p["layers.1.mlp.expert_bias"]["shape"] == [4] and p["layers.2.mlp.router.weight"]["shape"] == [32, 4]
        if layout == "tp2":
            assert p["layers.1.mlp.experts.w_gate"]["shape"] == [4, 32, 16]
            assert p["layers.1.mlp.shared.gate_proj.weight"]["shape"] == [32, 8]
            assert p["layers.1.attn.q_proj.weight"]["shape"] == [32, 32]
        else:
            assert p["layers.2.mlp.experts.w_down"]["shape"] == [2, 16, 32]
            assert p["layers.1.attn.q_proj.weight"]["shape"] == [32, 64]


def lora_adapters_read_by_paddleformers(layout, run, ours, ids, tmp_path) -> dict:
    """The LoRA run exported as PaddleFormers adapters (--format paddleformers --no-merge-lora): its LoRAModel on the
    source gives our trained logits (1e-4). Other runs: nothing."""
    if not run.lora:
        return {}
    from family_checks import STEPS, TOL

    from llmtrain.export import export_checkpoint

    out = tmp_path / "pf_adapters"
    info = export_checkpoint(str(run.run_dir / "checkpoints" / f"step_{STEPS}"), str(out), fmt="paddleformers",
                             merge_lora=False)
    diff = float(np.abs(pf_lora_logits(run.src, out, ids) - ours).max())
    assert info["family"] == "LoRA adapters" and diff <= TOL, (info, diff)
    return {"adapter_diff": diff, "adapter_rank": info["rank"]}


register(Family(name="ernie45", make=_make("dense", DENSE, 5), reference_loss=dense_loss, reference_logits=pf_logits,
                held=held_dense, layouts=("tp2", "pp2"), lora=True, extra=lora_adapters_read_by_paddleformers))
register(Family(name="ernie45_moe", make=_make("moe", MOE, 6), reference_loss=ernie_loss,
                reference_logits=ernie_logits, held=held_moe, layouts=("tp2", "pp2", "ep2")))

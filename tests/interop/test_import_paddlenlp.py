"""Import: real PaddleNLP GPT/Llama checkpoints (save_pretrained) give the same logits in our decoder.

    python -m pytest tests/interop/test_import_paddlenlp.py -q
"""
from __future__ import annotations

import pytest
from interop_helpers import assert_close, our_logits, paddlenlp_logits, randomize_paddlenlp, token_ids

from llmtrain.interop import read_paddlenlp_checkpoint

# the real package (dev extra); a missing paddlenlp fails these tests rather than skipping them
from paddlenlp.transformers import GPTConfig, GPTForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


def gpt(**kw):
    return GPTForCausalLM(GPTConfig(**{**TINY, "intermediate_size": 64, **kw}))


def llama(**kw):
    return LlamaForCausalLM(LlamaConfig(**{**TINY, "intermediate_size": 48, **kw}))


CASES = {
    "gpt": (gpt, {}),
    "gpt-fused-qkv": (gpt, dict(fuse_attention_qkv=True)),
    "gpt-post-norm": (gpt, dict(normalize_before=False)),
    "llama-mha": (llama, {}),
    "llama-gqa": (llama, dict(num_key_value_heads=2, rope_theta=5000.0, rms_norm_eps=1e-5)),
    "llama-mqa-fused": (llama, dict(num_key_value_heads=1, fuse_attention_qkv=True, fuse_attention_ffn=True)),
    "llama-gqa-fused": (llama, dict(num_key_value_heads=2, fuse_attention_qkv=True, fuse_attention_ffn=True)),
    "llama-tied-flag": (llama, dict(num_key_value_heads=2, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pdparams"])
@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_paddlenlp(case, safe, tmp_path):
    build, kw = CASES[case]
    ref = build(**kw)
    randomize_paddlenlp(ref, seed=len(case))
    ref.save_pretrained(str(tmp_path), safe_serialization=safe)
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path), trusted=True)
    assert meta["format"] == ("safetensors" if safe else "pdparams")
    ids = token_ids(cfg.vocab_size)
    assert_close(our_logits(cfg, state, ids), paddlenlp_logits(ref, ids), case)
    if case.startswith("llama"):
        assert cfg.kv_heads() == kw.get("num_key_value_heads", 4)
        assert not cfg.tie_embeddings  # PaddleNLP's Llama head is its own parameter, even with the tie flag
    if case == "llama-tied-flag":
        assert any("untied" in n for n in meta["notes"])


def test_import_tied_llama_head_equal_to_embedding_is_tied(tmp_path):
    """lm_head.weight == embedding^T (what our export writes for a tied model) imports as tied."""
    import paddle

    ref = llama(num_key_value_heads=2, tie_word_embeddings=True)
    randomize_paddlenlp(ref, seed=3)
    with paddle.no_grad():
        ref.lm_head.weight.set_value(ref.llama.embed_tokens.weight.T)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, state, _ = read_paddlenlp_checkpoint(str(tmp_path))
    assert cfg.tie_embeddings and "lm_head.proj.weight" not in state
    ids = token_ids(cfg.vocab_size)
    assert_close(our_logits(cfg, state, ids), paddlenlp_logits(ref, ids), "tied llama")


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pdparams"])
@pytest.mark.parametrize("build", [gpt, llama], ids=["gpt", "llama"])
def test_sharded_index_loads(build, safe, tmp_path):
    ref = build()
    randomize_paddlenlp(ref, seed=11)
    ref.save_pretrained(str(tmp_path), safe_serialization=safe, max_shard_size="10KB")
    index = "model.safetensors.index.json" if safe else "model_state.pdparams.index.json"
    assert (tmp_path / index).is_file()
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path), trusted=True)
    assert meta["sharded"] and len(meta["files"]) > 1
    ids = token_ids(cfg.vocab_size)
    assert_close(our_logits(cfg, state, ids), paddlenlp_logits(ref, ids), f"sharded {build.__name__}")


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pdparams"])
def test_bf16_checkpoint_reads_as_fp32(safe, tmp_path):
    """PaddleNLP writes bf16 safetensors as U16 bits; both file kinds must come back exactly."""
    import numpy as np

    ref = LlamaForCausalLM.from_config(LlamaConfig(**{**TINY, "intermediate_size": 48}), dtype="bfloat16")
    ref.save_pretrained(str(tmp_path), safe_serialization=safe)
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path), trusted=True)
    assert meta["dtype"] == "bfloat16"
    want = ref.llama.layers[0].self_attn.q_proj.weight.astype("float32").numpy()
    got = state["layers.0.attn.q_proj.weight"]
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_safetensors_preferred_over_pdparams(tmp_path):
    ref = gpt()
    randomize_paddlenlp(ref, seed=5)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    ref.save_pretrained(str(tmp_path), safe_serialization=False)
    assert (tmp_path / "model_state.pdparams").is_file() and (tmp_path / "model.safetensors").is_file()
    _, _, meta = read_paddlenlp_checkpoint(str(tmp_path))
    assert meta["format"] == "safetensors"


def test_lazy_read_gives_the_same_state_and_loads(tmp_path):
    """lazy=True (memory-mapped, converted on use) is what a big model under tp/pp needs; same numbers."""
    import numpy as np

    from llmtrain.models import build_model
    from llmtrain.models.stages import canonical_parameters
    from llmtrain.models.init import load_full_state

    ref = llama(num_key_value_heads=2, fuse_attention_qkv=True)
    randomize_paddlenlp(ref, seed=9)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, eager, _ = read_paddlenlp_checkpoint(str(tmp_path))
    cfg2, lazy, _ = read_paddlenlp_checkpoint(str(tmp_path), lazy=True)
    assert cfg == cfg2 and eager.keys() == lazy.keys()
    assert not isinstance(lazy["layers.0.mlp.up_proj.weight"], np.ndarray)  # really deferred
    for k in eager:
        assert np.array_equal(np.asarray(lazy[k]), eager[k]), k
    model = build_model(cfg2)
    load_full_state(canonical_parameters(model), lazy)
    ids = token_ids(cfg.vocab_size)
    model.eval()
    assert_close(model(ids).numpy(), paddlenlp_logits(ref, ids), "lazy")

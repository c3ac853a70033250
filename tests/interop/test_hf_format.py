"""Hugging Face-layout Llama / Qwen2 checkpoints in and out, against a numpy forward of the published architecture.

    python -m pytest tests/interop/test_hf_format.py -q

The checkpoints are built by `tests/hf_tiny.py` (its own writer: transformers' names, [out, in] weights,
two shards + index); the reference is `hf_tiny.reference_logits` (float64 numpy), not our model.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from hf_tiny import make_hf_checkpoint, reference_logits
from interop_helpers import TOL, our_logits, random_state

from llmtrain.interop import read_paddlenlp_checkpoint
from llmtrain.interop.hf_format import write_hf_checkpoint
from llmtrain.interop.keys import UnsupportedConfig

CASES = {
    "qwen2-gqa-tied": ("qwen2", {}),
    "qwen2-mha-untied": ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=False, rope_theta=10000.0)),
    "llama-gqa": ("llama", {}),
    "llama-mqa-tied-bias": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True,
                                          mlp_bias=True)),
}


def close(ours, ref, what):
    assert np.abs(ref).max() > 0.1, what
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOL, f"{what}: max abs logit difference {diff:.3g} > {TOL}"


@pytest.mark.parametrize("case", list(CASES))
def test_hf_checkpoint_imports_with_reference_logits(case, tmp_path):
    family, kw = CASES[case]
    make_hf_checkpoint(tmp_path, family, seed=len(case), **kw)
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path), lazy=True)
    assert meta["layout"] == "huggingface" and meta["family"] == family and meta["sharded"]
    assert not isinstance(state["layers.0.attn.q_proj.weight"], np.ndarray)  # lazy: mapped, transposed on read
    assert cfg.has_qkv_bias() == (family == "qwen2" or "attention_bias" in kw)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    close(our_logits(cfg, state, __import__("paddle").to_tensor(ids)), reference_logits(tmp_path, ids), case)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_export_to_hf_layout_gives_reference_logits_and_reads_back(family, tmp_path):
    import paddle

    make_hf_checkpoint(tmp_path / "src", family, seed=3)
    cfg, _, _ = read_paddlenlp_checkpoint(str(tmp_path / "src"))
    state = random_state(cfg, seed=4)
    info = write_hf_checkpoint(cfg, state, str(tmp_path / "out"), max_shard_bytes=20_000)
    assert info["shards"] > 1 and "model.safetensors.index.json" in info["files"]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f for f in info["files"] if f.endswith(".safetensors")}
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16))
    ours = our_logits(cfg, state, paddle.to_tensor(ids))
    close(ours, reference_logits(tmp_path / "out", ids), f"{family} written")
    cfg2, state2, _ = read_paddlenlp_checkpoint(str(tmp_path / "out"))
    assert cfg2.qkv_bias == cfg.qkv_bias and cfg2.tie_embeddings == cfg.tie_embeddings
    close(our_logits(cfg2, state2, paddle.to_tensor(ids)), ours, f"{family} read back")


@pytest.mark.parametrize("family,change,match", [
    ("qwen2", dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "longrope"),
    ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "finetuned": True}), "finetuned"),
    ("qwen2", dict(hidden_act="gelu"), "hidden_act"),
    ("qwen2", dict(layer_types=["sliding_attention"]), "layer_types"),
    ("qwen3", dict(attention_bias=True), "attention_bias=true"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), r"mlp_only_layers=\[1\]"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), "max_window_layers=1"),
])
def test_unsupported_hf_configs_are_named(family, change, match, tmp_path):
    """What stays refused is named (scaled-RoPE kinds and fields not implemented, Qwen3's o-only-with-qkv bias, MoE
    placements other than first-k-dense, a Qwen3-MoE window whose blocks transformers versions disagree on)."""
    make_hf_checkpoint(tmp_path, family, shards=1)
    c = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, **change}))
    with pytest.raises(UnsupportedConfig, match=match):
        read_paddlenlp_checkpoint(str(tmp_path))


def test_hf_missing_and_unexpected_tensors_are_listed(tmp_path):
    from safetensors.numpy import load_file, save_file

    from llmtrain.interop import CheckpointMismatch

    make_hf_checkpoint(tmp_path, "qwen2", shards=1)
    t = load_file(str(tmp_path / "model.safetensors"))
    t.pop("model.layers.1.self_attn.k_proj.bias")
    t["model.layers.0.self_attn.extra.weight"] = np.zeros([2, 2], np.float32)
    save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch, match=r"(?s)model.layers.1.self_attn.k_proj.bias.*extra.weight"):
        read_paddlenlp_checkpoint(str(tmp_path))


def test_hf_tokenizer_json_loads_through_data_tokenizer(tmp_path):
    """tokenizer.json (byte-level BPE, made with `tokenizers`) through `load_tokenizer`: the library's own ids,
    exact round trip, Qwen2-style special ids, embedding rows from config.json, documents packed with eos."""
    from hf_tiny import make_hf_tokenizer
    from tokenizers import Tokenizer as RustTokenizer

    from llmtrain.tokenizer import load_tokenizer
    from llmtrain.tokenizer.hf import HFTokenizer

    texts = ["人民日报社位于北京。", "长江是中国最长的河流。", "Qwen2 reads tokenizer.json, 一加一等于二。"] * 20
    make_hf_tokenizer(tmp_path, texts)
    make_hf_checkpoint(tmp_path, "qwen2", shards=1, vocab_size=512)  # rows beyond the ids rounded up to 128 (384)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 512 and tok.sp_vocab_size <= 320
    lib = RustTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    eos = lib.token_to_id("<|endoftext|>")
    assert tok.eos_id == tok.eod_id == tok.pad_id == tok.bos_id == eos and tok.unk_id is None
    for text in texts[:3] + ["没见过的字：龘 and emoji 🙂"]:
        ids = tok.encode(text)
        assert ids == lib.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids + [eos, 511]) == text  # specials and padding rows decode to nothing
        starts = tok.byte_starts(text, ids)
        assert starts[0] == 0 and (np.diff(starts) >= 0).all()
    tokens, lengths = tok.encode_documents(texts[:2])
    assert list(lengths) == [len(tok.encode(t)) + 1 for t in texts[:2]] and tokens[lengths[0] - 1] == eos
    assert tok.identity()["sha256"] == tok.sha256


def test_paddlenlp_export_refuses_a_tokenizer_json_tokenizer(tmp_path):
    from hf_tiny import make_hf_tokenizer

    from llmtrain.interop import write_paddlenlp_checkpoint

    make_hf_tokenizer(tmp_path / "tok", ["人民日报社位于北京。"] * 5)
    make_hf_checkpoint(tmp_path / "src", "llama", shards=1, vocab_size=384)
    cfg, state, _ = read_paddlenlp_checkpoint(str(tmp_path / "src"))
    with pytest.raises(UnsupportedConfig, match="not SentencePiece.*--format hf"):
        write_paddlenlp_checkpoint(cfg, state, str(tmp_path / "out"), tokenizer_dir=str(tmp_path / "tok"))
    assert not (tmp_path / "out").exists()
    info = write_hf_checkpoint(cfg, state, str(tmp_path / "out"), tokenizer_dir=str(tmp_path / "tok"))
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(info["files"])


@pytest.mark.parametrize("source", ["built", "ours"])
def test_hf_llama_matches_paddlenlp_from_pretrained(source, tmp_path):
    """PaddleNLP 2.8.1 reads an HF-layout Llama itself (`convert_from_torch=True`: it transposes the [out, in]
    weights; no PyTorch needed; its conversion path does not take a shard index, so one file): one built here and
    one our exporter wrote give its logits (and so the numpy reference is checked against a peer too)."""
    import paddle
    from interop_helpers import assert_close, paddlenlp_logits
    from paddlenlp.transformers import LlamaForCausalLM

    make_hf_checkpoint(tmp_path / "src", "llama", seed=7, shards=1)
    cfg, state, _ = read_paddlenlp_checkpoint(str(tmp_path / "src"))
    if source == "ours":
        state = random_state(cfg, seed=8)
        write_hf_checkpoint(cfg, state, str(tmp_path / "out"))
    path = tmp_path / ("src" if source == "built" else "out")
    theirs = LlamaForCausalLM.from_pretrained(str(path), convert_from_torch=True)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 16))
    want = paddlenlp_logits(theirs, paddle.to_tensor(ids))
    assert_close(our_logits(cfg, state, paddle.to_tensor(ids)), want, f"HF Llama ({source}) vs PaddleNLP")
    close(reference_logits(path, ids), want, "numpy reference vs PaddleNLP")


def test_hf_bf16_shards_read_exactly_as_fp32(tmp_path):
    """Released Qwen2 / Llama checkpoints are BF16 (`torch_dtype: bfloat16`, safetensors dtype BF16), which
    numpy cannot hold: the file is written here by hand (header + raw bf16 bits) and every tensor must read as
    the exact fp32 value of its bits."""
    import struct

    from safetensors.numpy import load_file

    make_hf_checkpoint(tmp_path / "f32", "qwen2", shards=1)
    t = load_file(str(tmp_path / "f32" / "model.safetensors"))
    bits = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in t.items()}  # bf16 = top half of fp32
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for k, b in bits.items():
        header[k] = {"dtype": "BF16", "shape": list(b.shape), "data_offsets": [offset, offset + b.nbytes]}
        offset += b.nbytes
    raw = json.dumps(header).encode()
    (tmp_path / "bf16").mkdir()
    with open(tmp_path / "bf16" / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(b.tobytes() for b in bits.values()))
    c = json.loads((tmp_path / "f32" / "config.json").read_text())
    (tmp_path / "bf16" / "config.json").write_text(json.dumps({**c, "torch_dtype": "bfloat16"}))
    cfg, state, meta = read_paddlenlp_checkpoint(str(tmp_path / "bf16"))
    assert meta["dtype"] == "bfloat16"
    want = (bits["model.layers.1.self_attn.q_proj.weight"].astype(np.uint32) << 16).view(np.float32)
    got = state["layers.1.attn.q_proj.weight"]
    assert got.dtype == np.float32 and np.array_equal(got, want.T)
    assert np.array_equal(state["layers.0.attn.k_proj.bias"],
                          (bits["model.layers.0.self_attn.k_proj.bias"].astype(np.uint32) << 16).view(np.float32))

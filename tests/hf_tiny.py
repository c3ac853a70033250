"""Tiny Hugging Face-layout Llama / Qwen2 checkpoints built here, and a numpy forward of the published architecture.

    from hf_tiny import make_hf_checkpoint, reference_logits
    make_hf_checkpoint(dir, "qwen2", vocab_size=96, seed=0)     # config.json + 2 shards + index, like transformers
    reference_logits(dir, ids)                                  # float64 logits, [b, s, V]

Written from `transformers`' `modeling_llama.py` / `modeling_qwen2.py` as published, independently of
`llmtrain.interop.hf_format` (its own file writer and names): linear weights [out, in]; Qwen2 has bias on
q, k, v only (Llama: `attention_bias` on q, k, v, o; `mlp_bias` on gate, up, down); RMSNorm x / sqrt(mean(x^2) + eps) * w; RoPE rotate-half with inv_freq = 1 / theta^(2i/d) and
cos/sin of [freqs, freqs]; GQA repeats each kv head for consecutive query heads (`repeat_kv`); SwiGLU
down(silu(gate(x)) * up(x)); tied embeddings: logits through the embedding table.
"""
from __future__ import annotations

import json
import os

import numpy as np


def make_hf_tokenizer(out_dir, texts: list[str], vocab_size: int = 320) -> None:
    """A byte-level BPE `tokenizer.json` (Qwen2's kind) trained here with `tokenizers`, plus tokenizer_config.json
    naming `<|endoftext|>` as eos and pad (as Qwen2's does; no bos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, trainer)
    os.makedirs(out_dir, exist_ok=True)
    tk.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                   "unk_token": None, "model_max_length": 32768}, f)


def hf_config(family: str, **kw) -> dict:
    c = dict(architectures=["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"], model_type=family,
             vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, hidden_act="silu", max_position_embeddings=64, rms_norm_eps=1e-6,
             rope_theta=1000000.0 if family == "qwen2" else 10000.0, tie_word_embeddings=family == "qwen2",
             torch_dtype="float32", initializer_range=0.02)
    if family == "qwen2":
        c.update(use_sliding_window=False, sliding_window=4096, max_window_layers=2)
    else:
        c.update(attention_bias=False, mlp_bias=False)
    c.update(kw)
    return c


def hf_shapes(c: dict) -> dict[str, list[int]]:
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    nh = c["num_attention_heads"]
    nkv, d = c.get("num_key_value_heads") or nh, h // nh
    qkv_bias = c["model_type"] == "qwen2" or c.get("attention_bias", False)
    o_bias, mlp_bias = c.get("attention_bias", False), c.get("mlp_bias", False)  # Llama's switches
    out = {"model.embed_tokens.weight": [v, h]}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = [h]
        out[p + "post_attention_layernorm.weight"] = [h]
        for n, rows in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
            out[f"{p}self_attn.{n}_proj.weight"] = [rows, h]
            if qkv_bias:
                out[f"{p}self_attn.{n}_proj.bias"] = [rows]
        out[p + "self_attn.o_proj.weight"] = [h, nh * d]
        if o_bias:
            out[p + "self_attn.o_proj.bias"] = [h]
        for n, shape in (("gate", [f, h]), ("up", [f, h]), ("down", [h, f])):
            out[f"{p}mlp.{n}_proj.weight"] = shape
            if mlp_bias:
                out[f"{p}mlp.{n}_proj.bias"] = shape[:1]
    out["model.norm.weight"] = [h]
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = [v, h]
    return out


def make_hf_checkpoint(out_dir, family: str, seed: int = 0, shards: int = 2, **kw) -> dict:
    """Write a random tiny HF checkpoint (norms near 1, biases non-zero) as `save_pretrained` lays it out."""
    from safetensors.numpy import save_file

    c = hf_config(family, **kw)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in hf_shapes(c).items():
        if name.endswith("norm.weight"):
            tensors[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = ((0.5 if "embed" in name else 0.1) * rng.standard_normal(shape)).astype(np.float32)
    os.makedirs(out_dir, exist_ok=True)
    names = sorted(tensors)
    parts = np.array_split(np.arange(len(names)), shards)
    weight_map = {}
    for j, idx in enumerate(parts):
        fname = f"model-{j + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        save_file({names[k]: tensors[names[k]] for k in idx}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({names[k]: fname for k in idx})
    if shards > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            total = sum(t.nbytes for t in tensors.values())
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    return c


def load_hf(ckpt_dir) -> tuple[dict, dict]:
    """(config.json dict, {name: float64 array}) of an HF directory, read with `safetensors.numpy` (fp32 files)."""
    from safetensors.numpy import load_file

    with open(os.path.join(ckpt_dir, "config.json")) as f:
        c = json.load(f)
    t = {}
    for fname in sorted(os.listdir(ckpt_dir)):
        if fname.endswith(".safetensors"):
            t.update({k: v.astype(np.float64) for k, v in load_file(os.path.join(ckpt_dir, fname)).items()})
    return c, t


def reference_logits(ckpt_dir, ids: np.ndarray) -> np.ndarray:
    """Logits [b, s, V] (float64) of the HF Llama / Qwen2 in `ckpt_dir` for token ids [b, s]."""
    c, t = load_hf(ckpt_dir)
    h, nh = c["hidden_size"], c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    d, eps = h // nh, c["rms_norm_eps"]
    b, s = ids.shape

    def rms(x, w):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w

    def linear(x, name):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    inv_freq = 1.0 / (c["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d))
    freqs = np.outer(np.arange(s, dtype=np.float64), inv_freq)  # [s, d/2]
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb)[None, :, None, :], np.sin(emb)[None, :, None, :]  # [1, s, 1, d]

    def rope(x):  # [b, s, n, d]
        rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + rotated * sin

    causal = np.triu(np.full((s, s), -np.inf), 1)
    x = t["model.embed_tokens.weight"][ids]  # [b, s, h]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = rms(x, t[p + "input_layernorm.weight"])
        q = rope(linear(y, p + "self_attn.q_proj").reshape(b, s, nh, d))
        k = rope(linear(y, p + "self_attn.k_proj").reshape(b, s, nkv, d))
        v = linear(y, p + "self_attn.v_proj").reshape(b, s, nkv, d)
        k, v = np.repeat(k, nh // nkv, axis=2), np.repeat(v, nh // nkv, axis=2)  # query head j -> kv head j // g
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nh * d)
        x = x + linear(attn, p + "self_attn.o_proj")
        y = rms(x, t[p + "post_attention_layernorm.weight"])
        gate = linear(y, p + "mlp.gate_proj")
        x = x + linear(gate / (1.0 + np.exp(-gate)) * linear(y, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms(x, t["model.norm.weight"])
    head = t["model.embed_tokens.weight"] if c["tie_word_embeddings"] else t["lm_head.weight"]
    return x @ head.T

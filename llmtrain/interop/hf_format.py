"""Hugging Face-layout Llama and Qwen2 checkpoints in and out: config.json + safetensors shards + index.

    from llmtrain.interop.hf_format import read_hf_checkpoint, write_hf_checkpoint
    cfg, state, meta = read_hf_checkpoint("Qwen2-0.5B/")       # canonical name -> fp32 numpy (lazy=True: mapped)
    write_hf_checkpoint(cfg, state, "out/", max_shard_bytes=2**30, tokenizer_dir="Qwen2-0.5B/")
    python llmtrain/finetune.py model.init_from=Qwen2-0.5B/ ...  # read_paddlenlp_checkpoint dispatches here
    python -m llmtrain.export --checkpoint RUN --output out/ --format hf

The layout `transformers` writes with `save_pretrained(safe_serialization=True)`: `config.json`,
`model.safetensors` or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` (its
`weight_map` names every tensor's shard). Tensors are read from the safetensors files with numpy
(memory-mapped; no PyTorch). The `safetensors` package's numpy API cannot hold BF16, the dtype these
models ship in, so the header and data are read by `tensor_files.read_safetensors` (BF16 -> fp32 exactly);
files are written with `safetensors.numpy.save_file` (fp32, metadata `format: pt`, which `transformers`
requires). The result is layout-free like our own checkpoints: every tp/pp layout slices what it needs
from the full (lazy) tensors.

The architectures, as published in `transformers` (`modeling_llama.py`, `modeling_qwen2.py`):
  - pre-norm RMSNorm in fp32 (`rms_norm_eps`); RoPE rotate-half with `rope_theta`; SwiGLU
    (gate, up, down); grouped-query attention (`num_key_value_heads`, each kv head serving consecutive
    query heads); linear weights stored [out, in] (transposed here to our [in, out]);
  - Qwen2: bias on q, k and v only (our bias=false, qkv_bias=true); Llama: `attention_bias` (q, k, v, o)
    and `mlp_bias` — both false (bias=false) or both true (bias=true);
  - `tie_word_embeddings`: logits through the embedding; transformers then omits `lm_head.weight`
    (and ignores one that is present, as we do, with a note);
Rejected with the field named: `rope_scaling` / a non-default `rope_parameters` type (scaled RoPE),
Qwen2 sliding-window attention, a `head_dim` other than hidden_size / num_attention_heads, an
activation other than silu. `pytorch_model.bin` (a pickle of torch tensors) is not read: convert to
safetensors first.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Optional

import numpy as np

from llmtrain.interop.keys import SourceTensors, UnsupportedConfig, check_canonical, model_shapes, switch_mismatches
from llmtrain.interop.tensor_files import (SAFE_INDEX, SAFE_SINGLE, CheckpointFileError, dtype_of_config,
                                           find_weight_files, read_tensors, staged_dir)
from llmtrain.models.config import ModelConfig
from llmtrain.utils.log import log0

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DEFAULTS = {  # transformers' config defaults for the fields we read
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                  initializer_range=0.02, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                  attention_bias=False, mlp_bias=False, tie_word_embeddings=False, head_dim=None),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768,
                  initializer_range=0.02, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                  use_sliding_window=False, tie_word_embeddings=False, head_dim=None),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "generation_config.json")


def hf_family(c: dict, ckpt_dir: str) -> Optional[str]:
    """`llama` or `qwen2` when `ckpt_dir` (config dict `c`) is in the Hugging Face layout, else None.

    model_type qwen2 is always HF (PaddleNLP 2.8.1 has no Qwen2). A Llama is HF when its tensor names start
    with `model.` (PaddleNLP's start with `llama.`): the safetensors headers are read, no tensor data."""
    archs = c.get("architectures") or []
    if c.get("model_type") == "qwen2" or any(a.startswith("Qwen2") for a in archs):
        return "qwen2"
    if c.get("model_type") != "llama" and not any(a.startswith("Llama") for a in archs):
        return None
    try:
        files, kind = find_weight_files(ckpt_dir)
    except CheckpointFileError:
        return None
    if kind != "safetensors":
        return None
    return "llama" if any(n.startswith("model.") for f in files for n in _tensor_names(f)) else None


def _tensor_names(path: str) -> list[str]:
    """Tensor names in a safetensors file's JSON header (nothing else is read)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointFileError(f"{path}: truncated safetensors file")
        try:
            header = json.loads(f.read(struct.unpack("<Q", head)[0]))
        except ValueError as e:
            raise CheckpointFileError(f"{path}: unreadable safetensors header ({e})") from e
    return [k for k in header if k != "__metadata__"]


def config_from_hf(c: dict, family: str, name: str, source: str) -> tuple[ModelConfig, list[str]]:
    """ModelConfig computing what transformers' Llama / Qwen2 computes for config.json `c`, and notes."""
    g = {k: c.get(k, v) for k, v in DEFAULTS[family].items()}
    notes = [f"{k} absent from config.json: transformers' default {v!r} used" for k, v in DEFAULTS[family].items()
             if k not in c and k not in ("num_key_value_heads", "head_dim", "rope_scaling")]
    h, heads = g["hidden_size"], g["num_attention_heads"]
    kv = g["num_key_value_heads"] or heads
    theta = g["rope_theta"]
    bad = []
    rope = c.get("rope_parameters")  # transformers 5 keeps rope_theta here
    if isinstance(rope, dict):
        theta = rope.get("rope_theta", theta)
        if rope.get("rope_type", "default") != "default":
            bad.append(f"rope_parameters.rope_type={rope.get('rope_type')!r} (scaled RoPE is not implemented)")
    if g["rope_scaling"]:
        bad.append(f"rope_scaling={g['rope_scaling']!r} (scaled RoPE is not implemented in our decoder)")
    if g["hidden_act"] != "silu":
        bad.append(f"hidden_act={g['hidden_act']!r} (SwiGLU with silu only)")
    if h % heads or heads % kv:
        bad.append(f"hidden_size={h}, num_attention_heads={heads}, num_key_value_heads={kv}: heads must divide "
                   "hidden_size and kv heads divide heads")
    elif g["head_dim"] not in (None, h // heads):
        bad.append(f"head_dim={g['head_dim']} != hidden_size / num_attention_heads = {h // heads}")
    if family == "qwen2" and (g["use_sliding_window"] or "sliding_attention" in (c.get("layer_types") or [])):
        bad.append("use_sliding_window=true (sliding-window attention is not implemented)")
    bias, qkv_bias = False, True
    if family == "llama":
        if bool(g["attention_bias"]) != bool(g["mlp_bias"]):
            bad.append(f"attention_bias={g['attention_bias']}, mlp_bias={g['mlp_bias']} (our model.bias puts a bias "
                       "on every linear or none)")
        bias, qkv_bias = bool(g["attention_bias"]), None
    if bad:
        raise UnsupportedConfig(f"{source}: Hugging Face {ARCHITECTURES[family]} config not supported: "
                                + "; ".join(bad))
    cfg = ModelConfig(
        name=name, hidden_size=h, num_layers=g["num_hidden_layers"], num_heads=heads,
        num_kv_heads=None if kv == heads else kv, ffn_hidden_size=g["intermediate_size"], vocab_size=g["vocab_size"],
        max_position_embeddings=g["max_position_embeddings"], position="rope", rope_theta=float(theta),
        norm="rmsnorm", norm_eps=float(g["rms_norm_eps"]), activation="swiglu", bias=bias, qkv_bias=qkv_bias,
        tie_embeddings=bool(g["tie_word_embeddings"]), init_std=float(g["initializer_range"]))
    return cfg, notes


def hf_family_for(cfg: ModelConfig) -> str:
    """The HF family our config is written as (`hf_family` tells a directory's): q/k/v-only bias -> Qwen2, otherwise Llama."""
    return "qwen2" if cfg.has_qkv_bias() and not cfg.bias else "llama"


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json fields of the HF Llama / Qwen2 computing what `cfg` computes (raises UnsupportedConfig)."""
    wants = (("position", "rope"), ("norm", "rmsnorm"), ("activation", "swiglu"), ("norm_position", "pre"))
    family = hf_family_for(cfg)
    bad = switch_mismatches(cfg, "decoder", ARCHITECTURES[family], family, wants)
    if cfg.moe_num_experts:
        bad.append(f"model.moe_num_experts={cfg.moe_num_experts} (dense Llama / Qwen2 only)")
    if family == "llama" and cfg.has_qkv_bias() != cfg.bias:
        bad.append(f"model.bias={cfg.bias}, qkv_bias={cfg.qkv_bias} (HF Llama's attention_bias covers q, k, v and o)")
    if bad:
        raise UnsupportedConfig(f"model {cfg.name!r} cannot be written as a Hugging Face {ARCHITECTURES[family]}: "
                                + "; ".join(bad))
    out = dict(architectures=[ARCHITECTURES[family]], model_type=family, vocab_size=cfg.vocab_size,
               hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads(), hidden_act="silu",
               max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.init_std,
               rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, rope_scaling=None,
               tie_word_embeddings=cfg.tie_embeddings, torch_dtype="float32", use_cache=True)
    if family == "llama":
        out.update(attention_bias=cfg.bias, mlp_bias=cfg.bias, head_dim=cfg.attn_head_dim())
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    return out


class _Transposed:
    """A 2-D tensor (numpy or a lazy mapped one) seen transposed; read only on `np.asarray`."""

    def __init__(self, inner):
        self.inner = inner
        self.shape = tuple(reversed(np.shape(inner)))
        self.ndim = 2
        self.dtype = np.dtype(np.float32)

    def __array__(self, dtype=None, copy=None):
        arr = np.ascontiguousarray(np.asarray(self.inner, dtype=np.float32).T)
        return arr if dtype is None else arr.astype(dtype, copy=False)


def _linears(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """(our name inside `layers.i.`, HF name inside `model.layers.i.`, has a bias) of every linear of a block."""
    qkv = cfg.has_qkv_bias()
    return [("attn.q_proj", "self_attn.q_proj", qkv), ("attn.k_proj", "self_attn.k_proj", qkv),
            ("attn.v_proj", "self_attn.v_proj", qkv), ("attn.o_proj", "self_attn.o_proj", cfg.bias),
            ("mlp.gate_proj", "mlp.gate_proj", cfg.bias), ("mlp.up_proj", "mlp.up_proj", cfg.bias),
            ("mlp.down_proj", "mlp.down_proj", cfg.bias)]


def to_canonical(src: SourceTensors, cfg: ModelConfig) -> tuple[dict, list[str]]:
    """Our canonical state (HF [out, in] weights seen as [in, out]) from HF Llama / Qwen2 tensors, and notes."""
    shapes = model_shapes(cfg)
    state, notes = {}, []

    def put(canon, key, transpose=False):
        want = shapes[canon]
        arr = src.take(key, list(reversed(want)) if transpose else want)
        if arr is not None:
            state[canon] = _Transposed(arr) if transpose else arr

    put("embed.word.weight", "model.embed_tokens.weight")
    for i in range(cfg.num_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        put(f"{c}attn_norm.weight", f"{p}input_layernorm.weight")
        put(f"{c}mlp_norm.weight", f"{p}post_attention_layernorm.weight")
        for ours, theirs, bias in _linears(cfg):
            put(f"{c}{ours}.weight", f"{p}{theirs}.weight", transpose=True)
            if bias:
                put(f"{c}{ours}.bias", f"{p}{theirs}.bias")
        if src.has(p + "self_attn.rotary_emb.inv_freq"):
            src.ignore(p + "self_attn.rotary_emb.inv_freq", "rotary inv_freq buffer (recomputed from rope_theta)")
    put("final_norm.norm.weight", "model.norm.weight")
    if cfg.tie_embeddings:
        if src.has("lm_head.weight"):
            src.ignore("lm_head.weight", "tie_word_embeddings=true: transformers computes the logits with the "
                                         "embedding (tie_weights) and ignores this tensor")
            notes.append("tie_word_embeddings=true: lm_head.weight in the file ignored, as transformers does")
    else:
        put("lm_head.proj.weight", "lm_head.weight", transpose=True)
    return state, notes


def from_canonical(state: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF tensors ([out, in] linears) from our canonical state (already checked against `cfg`)."""
    out = {"model.embed_tokens.weight": state["embed.word.weight"]}
    for i in range(cfg.num_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        out[f"{p}input_layernorm.weight"] = state[f"{c}attn_norm.weight"]
        out[f"{p}post_attention_layernorm.weight"] = state[f"{c}mlp_norm.weight"]
        for ours, theirs, bias in _linears(cfg):
            out[f"{p}{theirs}.weight"] = np.ascontiguousarray(state[f"{c}{ours}.weight"].T)
            if bias:
                out[f"{p}{theirs}.bias"] = state[f"{c}{ours}.bias"]
    out["model.norm.weight"] = state["final_norm.norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(state["lm_head.proj.weight"].T)
    return out


def read_hf_checkpoint(ckpt_dir: str, c: dict, family: str, name: Optional[str] = None,
                       lazy: bool = False) -> tuple[ModelConfig, dict, dict]:
    """(ModelConfig, canonical state as fp32 numpy or lazy arrays, meta) of an HF Llama / Qwen2 directory."""
    name = name or f"hf-{os.path.basename(os.path.normpath(ckpt_dir))}"
    cfg, notes = config_from_hf(c, family, name, os.path.join(ckpt_dir, "config.json"))
    files, kind = find_weight_files(ckpt_dir)
    if kind != "safetensors":
        raise CheckpointFileError(f"{ckpt_dir}: Hugging Face {family} weights are read from safetensors only "
                                  f"(found {', '.join(os.path.basename(f) for f in files)})")
    dtype = dtype_of_config(c)
    tensors, origin = read_tensors(files, kind, bf16_bits=dtype == "bfloat16", lazy=True)
    src = SourceTensors(tensors, origin, ckpt_dir)
    state, more = to_canonical(src, cfg)
    src.check()
    if not lazy:
        state = {k: np.asarray(v, dtype=np.float32) for k, v in state.items()}
    check_canonical(state, model_shapes(cfg), f"mapping of {ckpt_dir}")
    for note in notes + more:
        log0(f"{ckpt_dir}: {note}")
    from llmtrain.interop.tokenizer_files import find_tokenizer_model

    meta = dict(family=family, layout="huggingface", architectures=c.get("architectures"), config=c, files=files,
                format=kind, sharded=os.path.basename(files[0]) != SAFE_SINGLE, dtype=dtype or "float32",
                notes=notes + more, ignored=dict(src.ignored), warnings=[],
                tokenizer_model=find_tokenizer_model(ckpt_dir), wordpiece_vocab=None)
    return cfg, state, meta


def write_hf_checkpoint(cfg: ModelConfig, state: dict, out_dir: str, max_shard_bytes: int = 2 * 2**30,
                        tokenizer_dir: Optional[str] = None, overwrite: bool = False) -> dict:
    """Write `state` (canonical name -> full fp32 tensor) as an HF Llama / Qwen2 directory, atomically.

    Shards of at most `max_shard_bytes` (a tensor larger than that gets a shard of its own) with
    `model.safetensors.index.json`, or one `model.safetensors` when everything fits in one.
    tokenizer_dir: a directory whose HF tokenizer files (tokenizer.json, tokenizer_config.json, ...) are copied."""
    from safetensors.numpy import save_file

    out_dir = os.path.normpath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) to replace it")
    config = config_to_hf(cfg)
    state = {k: np.asarray(v, dtype=np.float32) for k, v in state.items()}
    check_canonical(state, model_shapes(cfg), "state to export")
    tensors = from_canonical(state, cfg)
    shards, size = [[]], 0
    for key in tensors:
        nbytes = tensors[key].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    with staged_dir(out_dir) as tmp:
        names = [SAFE_SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                          for i in range(len(shards))]
        for fname, keys in zip(names, shards):
            save_file({k: np.ascontiguousarray(tensors[k]) for k in keys}, os.path.join(tmp, fname),
                      metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
                     "weight_map": {k: fname for fname, keys in zip(names, shards) for k in keys}}
            with open(os.path.join(tmp, SAFE_INDEX), "w") as f:
                json.dump(index, f, indent=2)
        copied = []
        if tokenizer_dir is not None:
            for fname in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(tokenizer_dir, fname)):
                    shutil.copy(os.path.join(tokenizer_dir, fname), os.path.join(tmp, fname))
                    copied.append(fname)
            if not copied:
                raise CheckpointFileError(f"tokenizer {tokenizer_dir}: none of {', '.join(TOKENIZER_FILES)} to copy")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return dict(family=ARCHITECTURES[hf_family_for(cfg)], out_dir=out_dir, files=sorted(os.listdir(out_dir)),
                config=config, notes=[], shards=len(shards))

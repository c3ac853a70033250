"""Hugging Face-layout Llama, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V2/V3 checkpoints in and out: config.json +
safetensors shards.

    from llmtrain.interop.hf_format import read_hf_checkpoint, write_hf_checkpoint
    cfg, state, meta = read_hf_checkpoint("Qwen3-8B/", c, "qwen3")   # canonical name -> fp32 numpy (lazy=True: mapped)
    write_hf_checkpoint(cfg, state, "out/", max_shard_bytes=2**30, tokenizer_dir="Qwen3-8B/")
    python llmtrain/finetune.py model.init_from=Qwen3-8B/ ...  # read_paddlenlp_checkpoint dispatches here
    python -m llmtrain.export --checkpoint RUN --output out/ --format hf

The layout `transformers` writes with `save_pretrained(safe_serialization=True)`: `config.json`,
`model.safetensors` or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` (its
`weight_map` names every tensor's shard). Tensors are read from the safetensors files with numpy
(memory-mapped; no PyTorch). The `safetensors` package's numpy API cannot hold BF16, the dtype these
models ship in, so the header and data are read by `tensor_files.read_safetensors` (BF16 -> fp32 exactly);
files are written with `safetensors.numpy.save_file` (fp32, metadata `format: pt`, which `transformers`
requires). The result is layout-free like our own checkpoints: every tp/pp/ep layout slices what it needs
from the full (lazy) tensors, one tensor at a time.

What each family computes and which config fields are refused: `hf_config.py` (DeepSeek-V2/V3, config and tensors:
`deepseek.py`). Tensor names: linear weights
stored [out, in] (transposed here to our [in, out]); Qwen3's `self_attn.q_norm.weight` / `k_norm.weight` [head_dim]
are our `attn.q_norm` / `attn.k_norm`; Qwen3-MoE's `mlp.gate.weight` [E, h] is our router [h, E] and its
`mlp.experts.{j}.{gate,up,down}_proj.weight` are stacked into `mlp.experts.w_gate/w_up/w_down` [E, ...] (our
expert bias, auxiliary-loss-free balancing, has no HF tensor: zeros on import, refused on export when non-zero).
`tie_word_embeddings`: logits through the embedding; transformers then omits `lm_head.weight` (and ignores one
that is present, as we do, with a note). `pytorch_model.bin` (a pickle of torch tensors) is not read: convert to
safetensors first.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
from typing import Optional

import numpy as np

from llmtrain.interop.hf_config import ARCHITECTURES, config_from_hf, config_to_hf, export_notes, hf_family_for
from llmtrain.interop.keys import EXPERT_LINEARS, SourceTensors, UnsupportedConfig, check_canonical, model_shapes
from llmtrain.interop.tokenizer_files import special_id_problems, special_token_ids, write_special_token_files
from llmtrain.interop.tensor_files import (SAFE_INDEX, SAFE_SINGLE, CheckpointFileError, dtype_of_config,
                                           StackedTransposed, find_weight_files, read_tensors, staged_dir)
from llmtrain.models.config import ModelConfig
from llmtrain.utils.log import log0

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "generation_config.json")


def hf_family(c: dict, ckpt_dir: str) -> Optional[str]:
    """`llama`, `qwen2`, `qwen3` or `qwen3_moe` when `ckpt_dir` (config dict `c`) is in the Hugging Face layout, else
    None.

    model_type qwen2/qwen3/qwen3_moe is always HF (PaddleNLP 2.8.1 has none of them). A Llama is HF when its tensor
    names start with `model.` (PaddleNLP's start with `llama.`): the safetensors headers are read, no tensor data."""
    archs = c.get("architectures") or []
    from llmtrain.interop import deepseek

    from llmtrain.interop import ernie45

    for module in (deepseek, ernie45):  # DeepSeek-V2/V3 and ERNIE 4.5: the HF layout (PaddleFormers writes it too)
        for model_type, arch in module.ARCHITECTURES.items():
            if c.get("model_type") == model_type or arch in archs:
                return model_type
    for family, arch in (("qwen3_moe", "Qwen3Moe"), ("qwen3", "Qwen3"), ("qwen2", "Qwen2")):
        if c.get("model_type") == family or any(a.startswith(arch) for a in archs):
            if family == "qwen2" and any(a.startswith("Qwen2Moe") for a in archs):
                return None  # Qwen1.5/2-MoE: not read here (its shared expert has a sigmoid gate)
            return family
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


def _linears(cfg: ModelConfig, index: int) -> list[tuple[str, str, bool]]:
    """(our name inside `layers.i.`, HF name inside `model.layers.i.`, has a bias) of every linear of block `index`
    (the dense MLP's only where the block has no experts)."""
    qkv = cfg.has_qkv_bias()
    out = [("attn.q_proj", "self_attn.q_proj", qkv), ("attn.k_proj", "self_attn.k_proj", qkv),
           ("attn.v_proj", "self_attn.v_proj", qkv), ("attn.o_proj", "self_attn.o_proj", cfg.bias)]
    if not cfg.is_moe_layer(index):
        out += [("mlp.gate_proj", "mlp.gate_proj", cfg.bias), ("mlp.up_proj", "mlp.up_proj", cfg.bias),
                ("mlp.down_proj", "mlp.down_proj", cfg.bias)]
    return out


def to_canonical(src: SourceTensors, cfg: ModelConfig) -> tuple[dict, list[str]]:
    """Our canonical state (HF [out, in] weights seen as [in, out]) from HF tensors, and notes."""
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
        for ours, theirs, bias in _linears(cfg, i):
            put(f"{c}{ours}.weight", f"{p}{theirs}.weight", transpose=True)
            if bias:
                put(f"{c}{ours}.bias", f"{p}{theirs}.bias")
        if cfg.qk_norm:
            put(f"{c}attn.q_norm.weight", f"{p}self_attn.q_norm.weight")
            put(f"{c}attn.k_norm.weight", f"{p}self_attn.k_norm.weight")
        if cfg.is_moe_layer(i):
            put(f"{c}mlp.router.weight", f"{p}mlp.gate.weight", transpose=True)
            state[f"{c}mlp.expert_bias"] = np.zeros([cfg.moe_num_experts], dtype=np.float32)
            for ours, theirs in EXPERT_LINEARS:
                want = shapes[f"{c}mlp.experts.{ours}"][1:]  # [in, out] of one expert
                parts = [src.take(f"{p}mlp.experts.{j}.{theirs}.weight", list(reversed(want)))
                         for j in range(cfg.moe_num_experts)]
                if all(x is not None for x in parts):
                    state[f"{c}mlp.experts.{ours}"] = StackedTransposed(parts)
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
        for ours, theirs, bias in _linears(cfg, i):
            out[f"{p}{theirs}.weight"] = np.ascontiguousarray(state[f"{c}{ours}.weight"].T)
            if bias:
                out[f"{p}{theirs}.bias"] = state[f"{c}{ours}.bias"]
        if cfg.qk_norm:
            out[f"{p}self_attn.q_norm.weight"] = state[f"{c}attn.q_norm.weight"]
            out[f"{p}self_attn.k_norm.weight"] = state[f"{c}attn.k_norm.weight"]
        if cfg.is_moe_layer(i):
            bias = state[f"{c}mlp.expert_bias"]
            if np.any(bias != 0):  # the router adds any non-zero bias to its selection scores
                raise UnsupportedConfig(f"{c}mlp.expert_bias is non-zero (max |b| {float(np.abs(bias).max()):.3g}): "
                                        "Qwen3-MoE routes without a selection bias, so the export would choose other experts")
            out[f"{p}mlp.gate.weight"] = np.ascontiguousarray(state[f"{c}mlp.router.weight"].T)
            for ours, theirs in EXPERT_LINEARS:
                stacked = state[f"{c}mlp.experts.{ours}"]
                for j in range(cfg.moe_num_experts):
                    out[f"{p}mlp.experts.{j}.{theirs}.weight"] = np.ascontiguousarray(stacked[j].T)
    out["model.norm.weight"] = state["final_norm.norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(state["lm_head.proj.weight"].T)
    return out


def _deepseek(family: str):
    """The module with the config and tensor mapping of `family` when it has its own (`deepseek.py`: DeepSeek-V2/V3,
    `ernie45.py`: ERNIE 4.5), else None (this file's and hf_config.py's)."""
    from llmtrain.interop import deepseek, ernie45

    return next((m for m in (deepseek, ernie45) if family in m.ARCHITECTURES), None)


def read_hf_checkpoint(ckpt_dir: str, c: dict, family: str, name: Optional[str] = None,
                       lazy: bool = False) -> tuple[ModelConfig, dict, dict]:
    """(ModelConfig, canonical state as fp32 numpy or lazy arrays, meta) of an HF directory of `family`."""
    name = name or f"hf-{os.path.basename(os.path.normpath(ckpt_dir))}"
    ds = _deepseek(family)
    cfg, notes = (ds.config_from_hf if ds else config_from_hf)(c, family, name, os.path.join(ckpt_dir, "config.json"))
    cfg = dataclasses.replace(cfg, hf_family=family)  # an export writes the family it came from
    files, kind = find_weight_files(ckpt_dir)
    if kind != "safetensors":
        raise CheckpointFileError(f"{ckpt_dir}: Hugging Face {family} weights are read from safetensors only "
                                  f"(found {', '.join(os.path.basename(f) for f in files)})")
    dtype = dtype_of_config(c)
    tensors, origin = read_tensors(files, kind, bf16_bits=dtype == "bfloat16", lazy=True)
    src = SourceTensors(tensors, origin, ckpt_dir)
    state, more = ds.to_canonical(src, cfg, config=c) if ds else to_canonical(src, cfg)
    src.check()
    if not lazy:
        state = {k: np.asarray(v, dtype=np.float32) for k, v in state.items()}
    check_canonical(state, model_shapes(cfg), f"mapping of {ckpt_dir}")
    for note in notes + more:
        log0(f"{ckpt_dir}: {note}")
    from llmtrain.interop.tokenizer_files import find_tokenizer_model

    layout = ds.layout_of(c) if hasattr(ds, "layout_of") else "huggingface"
    meta = dict(family=family, layout=layout, architectures=c.get("architectures"), config=c, files=files,
                format=kind, sharded=os.path.basename(files[0]) != SAFE_SINGLE, dtype=dtype or "float32",
                notes=notes + more, ignored=dict(src.ignored), warnings=[],
                tokenizer_model=find_tokenizer_model(ckpt_dir), wordpiece_vocab=None)
    return cfg, state, meta


def hf_config(cfg: ModelConfig, family: Optional[str] = None, layout: str = "huggingface") -> tuple[str, dict]:
    """(model type, config.json fields) `cfg` is written as: `family`, else ERNIE 4.5 when `cfg.hf_family` says so
    (dense or MoE as its experts say; its switches are a Llama's or a Qwen3-MoE's), else the one the switches imply
    (`hf_family_for`). Raises UnsupportedConfig naming what that class cannot express (no tensor is needed)."""
    from llmtrain.interop import ernie45

    if family is None and cfg.hf_family in ernie45.ARCHITECTURES:
        family = ernie45.family_of(cfg)
    family = family or hf_family_for(cfg)
    ds = _deepseek(family)
    if layout != "huggingface" and not hasattr(ds, "layout_of"):
        raise UnsupportedConfig(f"layout {layout!r}: only ERNIE 4.5 is written in PaddleFormers' layout here (for "
                                f"{family} PaddleFormers' save_pretrained writes the Hugging Face layout: --format hf)")
    config = ds.config_to_hf(cfg, layout) if hasattr(ds, "layout_of") else (ds.config_to_hf if ds else config_to_hf)(cfg)
    return family, config


def write_hf_checkpoint(cfg: ModelConfig, state: dict, out_dir: str, max_shard_bytes: int = 2 * 2**30,
                        tokenizer_dir: Optional[str] = None, overwrite: bool = False, family: Optional[str] = None,
                        layout: str = "huggingface", special_ids: Optional[dict] = None) -> dict:
    """Write `state` (canonical name -> full fp32 tensor) as an HF directory of `family` (default
    `hf_family_for(cfg)`), atomically.

    Shards of at most `max_shard_bytes` (a tensor larger than that gets a shard of its own) with
    `model.safetensors.index.json`, or one `model.safetensors` when everything fits in one; layout `paddleformers`
    (ERNIE 4.5 only) writes PaddleFormers' config fields and always shards + index, as its save_pretrained does.
    tokenizer_dir: a directory whose HF tokenizer files (tokenizer.json, tokenizer_config.json, ...) are copied; one
    of ours (SentencePiece, no tokenizer_config.json) gets the tokenizer_config.json naming the family's tokenizer
    class. config.json's bos/eos/pad ids are that tokenizer's, else `special_ids` (the ids the checkpoint
    recorded), never a family's defaults, and are checked against the shipped tokenizer files."""
    from safetensors.numpy import save_file

    out_dir = os.path.normpath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) to replace it")
    family, config = hf_config(cfg, family, layout)
    ds = _deepseek(family)
    tok = None
    if tokenizer_dir is not None:
        from llmtrain.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer_dir)
    for key in [k for k in config if k.endswith("_token_id")]:  # a family's defaults are not this tokenizer's
        del config[key]
    config.update(special_token_ids(tok) if tok is not None else (special_ids or {}))
    state = {k: np.asarray(v, dtype=np.float32) for k, v in state.items()}
    check_canonical(state, model_shapes(cfg), "state to export")
    tensors = (ds.from_canonical if ds else from_canonical)(state, cfg)
    shards, size = [[]], 0
    for key in tensors:
        nbytes = tensors[key].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    with staged_dir(out_dir) as tmp:
        names = [SAFE_SINGLE] if len(shards) == 1 and layout == "huggingface" else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                          for i in range(len(shards))]
        for fname, keys in zip(names, shards):
            save_file({k: np.ascontiguousarray(tensors[k]) for k in keys}, os.path.join(tmp, fname),
                      metadata={"format": "pt"})
        if len(names) > 1 or names[0] != SAFE_SINGLE:
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
            if "tokenizer.model" in copied and not {"tokenizer_config.json", "tokenizer.json"} & set(copied):
                copied += write_special_token_files(tmp, tok, getattr(ds, "TOKENIZER_CLASS", "LlamaTokenizer"))
            bad = special_id_problems(tmp, config)
            if bad:
                raise UnsupportedConfig(f"{out_dir}: the special-token ids disagree with the shipped tokenizer "
                                        f"{tokenizer_dir}: " + "; ".join(bad))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return dict(family=(ds.ARCHITECTURES if ds else ARCHITECTURES)[family], out_dir=out_dir,
                files=sorted(os.listdir(out_dir)),
                config=config, notes=export_notes(cfg, family), shards=len(shards))

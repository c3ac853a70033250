"""LoRA adapters of an ERNIE 4.5 run written in PaddleFormers 1.2.0's adapter format.

    python -m llmtrain.export --checkpoint RUN --output adapters/ --format paddleformers --no-merge-lora
    # PaddleFormers: LoRAModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), "adapters/")

PaddleFormers' `LoRAModel.save_pretrained` (its flex-checkpoint default) writes `lora_config.json`,
`peft_model-00001-of-00001.safetensors` with `peft_model.safetensors.index.json`, and the base's config.json. Its
adapters sit on the model's in-memory linears, which for ERNIE 4.5 are FUSED and [in, out]: `self_attn.qkv_proj`
(columns grouped per kv head: that head's g = heads / kv heads query heads, then its key, then its value, each
head_dim wide), `self_attn.o_proj`, `mlp.up_gate_proj` (gate columns, then up) and `mlp.down_proj` (the shared
experts' `mlp.shared_experts.*` alike); `lora_A` [in, r], `lora_B` [r, out], y += x A B lora_alpha / r.
Ours have their own A per projection, so the writer stacks them (as `interop/qwen.py` does for PaddleNLP's fused
`c_attn`): for q, k, v, A = [A_q A_k A_v] and B block-diagonal with each projection's columns put at their fused
places (q/k columns back in ERNIE's interleaved rotary order, `ernie45.rotary_rows`); gate/up likewise. One
`LoRAConfig` has one rank, so every module's adapter is zero-padded to the largest stacked rank R and lora_alpha is
scaled by R / r (alpha / r unchanged): the numbers are exact. Adapters on routed experts are refused (ours are
stacked [E, ...] tensors: none are trained here). Reading PaddleFormers adapters back (`finetune.lora.init_from`)
is not implemented.
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

import numpy as np

from llmtrain.interop.keys import UnsupportedConfig
from llmtrain.models.config import ModelConfig

CONFIG_NAME = "lora_config.json"
SAFE_NAME = "peft_model-00001-of-00001.safetensors"
SAFE_INDEX = "peft_model.safetensors.index.json"


def _fused_columns(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """{q, k, v: the columns of the fused qkv_proj [(heads + 2 kv heads) d] that hold that projection's output
    columns, in PaddleFormers' (interleaved rotary) column order}."""
    d, kv = cfg.attn_head_dim(), cfg.kv_heads()
    g = cfg.num_heads // kv
    group = (g + 2) * d
    q = [np.arange(d) + (j // g) * group + (j % g) * d for j in range(cfg.num_heads)]
    k = [np.arange(d) + h * group + g * d for h in range(kv)]
    v = [np.arange(d) + h * group + (g + 1) * d for h in range(kv)]
    return {"q": np.concatenate(q), "k": np.concatenate(k), "v": np.concatenate(v)}


def _modules(cfg: ModelConfig) -> list[tuple[str, list[tuple[str, str]], int]]:
    """(PaddleFormers module, [(our linear, part)], its output width) of every adaptable linear of `cfg`."""
    out = []
    qkv = (cfg.num_heads + 2 * cfg.kv_heads()) * cfg.attn_head_dim()
    for i in range(cfg.num_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        out.append((p + "self_attn.qkv_proj", [(c + f"attn.{n}_proj", n) for n in "qkv"], qkv))
        out.append((p + "self_attn.o_proj", [(c + "attn.o_proj", "")], cfg.hidden_size))
        ffns = [("mlp", "mlp", cfg.ffn_hidden_size)] if not cfg.is_moe_layer(i) else []
        if cfg.is_moe_layer(i) and cfg.moe_num_shared_experts:
            ffns.append(("mlp.shared", "mlp.shared_experts", cfg.moe_num_shared_experts * cfg.expert_ffn_size()))
        for ours, theirs, f in ffns:
            out.append((f"{p}{theirs}.up_gate_proj", [(f"{c}{ours}.gate_proj", "gate"), (f"{c}{ours}.up_proj", "up")],
                        2 * f))
            out.append((f"{p}{theirs}.down_proj", [(f"{c}{ours}.down_proj", "")], cfg.hidden_size))
    return out


def lora_to_paddleformers(adapters: dict, cfg: ModelConfig) -> tuple[dict[str, np.ndarray], int, list[str]]:
    """(PaddleFormers adapter tensors, their rank R, adapted module names) from ours ({`...lora_A`: [in, r],
    `...lora_B`: [r, out]}); see the module docstring."""
    from llmtrain.interop.ernie45 import rotary_rows

    d = cfg.attn_head_dim()
    back = {"q": np.argsort(rotary_rows(d, cfg.num_heads)), "k": np.argsort(rotary_rows(d, cfg.kv_heads()))}
    fused = _fused_columns(cfg)
    known = {ours for _, parts, _ in _modules(cfg) for ours, _ in parts}
    stray = sorted({k.rsplit(".", 1)[0] for k in adapters} - known)
    if stray:
        raise UnsupportedConfig(f"adapters on {', '.join(stray)}: no PaddleFormers ERNIE 4.5 module for them (routed "
                                "experts and the router are not adapted there); export merged (--merge-lora)")
    stacked = []
    for module, parts, width in _modules(cfg):
        present = [(ours, part) for ours, part in parts if ours + ".lora_A" in adapters]
        if not present:
            continue
        a_parts, b_parts = [], []
        for ours, part in present:
            a = np.asarray(adapters[ours + ".lora_A"], np.float32)
            b = np.asarray(adapters[ours + ".lora_B"], np.float32)
            if part in back:
                b = b[:, back[part]]  # theirs[:, j] = ours[:, back[j]]: interleaved rotary columns again
            if part in fused:  # q, k, v: their places in the grouped qkv_proj
                cols = fused[part]
            else:  # gate: the first half of up_gate_proj, up: the second; o / down: all
                cols = np.arange(b.shape[1]) + (b.shape[1] if part == "up" else 0)
            full = np.zeros([b.shape[0], width], np.float32)
            full[:, cols] = b
            a_parts.append(a)
            b_parts.append(full)
        stacked.append((module, np.concatenate(a_parts, 1), np.concatenate(b_parts, 0)))
    rank = max(a.shape[1] for _, a, _ in stacked)
    tensors = {}
    for module, a, b in stacked:  # one LoRAConfig rank: zero columns of A and rows of B change nothing
        tensors[module + ".lora_A"] = np.pad(a, [(0, 0), (0, rank - a.shape[1])])
        tensors[module + ".lora_B"] = np.pad(b, [(0, rank - b.shape[0]), (0, 0)])
    return tensors, rank, [m for m, _, _ in stacked]


def write_paddleformers_lora(cfg: ModelConfig, lora, adapters: dict, out_dir: str, base: Optional[str] = None,
                             overwrite: bool = False) -> dict:
    """Write `adapters` (canonical `...lora_A`/`lora_B` full arrays) as a PaddleFormers adapter directory;
    `lora`: rank, alpha, dropout (a `LoraConfig`); `base`: the base model's path (`base_model_name_or_path`)."""
    from llmtrain.interop.ernie45 import config_to_hf
    from llmtrain.interop.tensor_files import staged_dir, write_safetensors

    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) to replace it")
    tensors, rank, modules = lora_to_paddleformers(adapters, cfg)
    alpha = lora.alpha * rank / lora.rank
    config = {"r": int(rank), "lora_alpha": int(alpha) if float(alpha).is_integer() else float(alpha),
              "lora_dropout": float(lora.dropout), "target_modules": [re.escape(m) for m in modules],
              "trainable_modules": None, "trainable_bias": None, "enable_lora_list": None, "merge_weights": False,
              "rslora": False, "loraga": False, "lora_plus_scale": 1.0, "do_qat": False, "head_dim": None,
              "tensor_model_parallel_size": 1, "dtype": "float32", "base_model_name_or_path": base}
    with staged_dir(out_dir) as tmp:
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config_to_hf(cfg, "paddleformers"), f, indent=2, sort_keys=True)
        write_safetensors(tensors, os.path.join(tmp, SAFE_NAME))
        with open(os.path.join(tmp, SAFE_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
                       "weight_map": {k: SAFE_NAME for k in sorted(tensors)}}, f, indent=2)
    return dict(out_dir=out_dir, files=sorted(os.listdir(out_dir)), modules=len(modules), rank=rank)

"""LoRA adapters in PaddleNLP's format (`paddlenlp.peft`, 2.8.1) both ways, and merging them into a base.

    python -m llmtrain.export --checkpoint RUN_DIR --output adapters/         # a LoRA run -> PaddleNLP adapters
    python -m llmtrain.export --checkpoint RUN_DIR --output merged/ --merge-lora   # -> a plain PaddleNLP model
    # PaddleNLP: LoRAModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), "adapters/")

A PaddleNLP adapter directory is `lora_config.json` (`LoRAConfig`: r, lora_alpha,
lora_dropout, target_modules as regular expressions over PaddleNLP module names, ...)
plus `lora_model_state.pdparams` (a `paddle.save` dict) or `peft_model.safetensors`
with the trainable tensors under the model's state-dict names:
`llama.layers.0.self_attn.q_proj.lora_A` [in, r] and `...lora_B` [r, out] (read from
`paddlenlp/peft/lora/lora_model.py`, `get_trainable_state_dict`, and `lora_layers.py`,
`LoRALinear`: y = x W + dropout(x) A B * lora_alpha / r). Ours have the same shapes and
scaling under canonical names (`layers.0.attn.q_proj.lora_A`); only module names map.
We write `target_modules` as the exact (escaped) names of the adapted modules.
Qwen adapts its fused `c_attn` (q, k and v in one linear): `llmtrain/interop/qwen.py` says how
its adapters map to ours both ways, exactly.

Read but refused with the field named (their numbers would not be reproduced): rslora,
pissa, DoRA-like variants, quantized / QAT adapters, `trainable_modules` or
`trainable_bias` (other trained tensors), merged-linear `enable_lora_list`,
`lora_plus_scale != 1`, fused qkv / gate-up modules, and tensor-parallel shards
(`lora_model_state.tpXX.pdparams`: merge them with PaddleNLP first).
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

import numpy as np

from llmtrain.interop.keys import CheckpointMismatch, UnsupportedConfig, attention_variant_mismatches
from llmtrain.interop.tensor_files import read_tensors, staged_dir, write_pdparams, write_safetensors
from llmtrain.models.config import ModelConfig

CONFIG_NAME = "lora_config.json"
PDPARAMS_NAME = "lora_model_state.pdparams"
SAFE_NAME = "peft_model.safetensors"

# (our canonical module name, PaddleNLP module name) per family, as regex templates over the layer index
MODULES = {
    "llama": [(r"layers.{i}.attn.{n}_proj", r"llama.layers.{i}.self_attn.{n}_proj", "qkvo"),
              (r"layers.{i}.mlp.{n}_proj", r"llama.layers.{i}.mlp.{n}_proj", ("gate", "up", "down"))],
    "gpt": [(r"layers.{i}.attn.{n}_proj", r"gpt.decoder.layers.{i}.self_attn.{n}_proj", "qkv"),
            (r"layers.{i}.attn.o_proj", r"gpt.decoder.layers.{i}.self_attn.out_proj", ("",)),
            (r"layers.{i}.mlp.up_proj", r"gpt.decoder.layers.{i}.linear1", ("",)),
            (r"layers.{i}.mlp.down_proj", r"gpt.decoder.layers.{i}.linear2", ("",))],
}
REFUSED_FLAGS = {"rslora": False, "pissa": False, "do_qat": False, "use_dora": False, "lora_use_mixer": False,
                 "trainable_modules": None, "trainable_bias": None, "enable_lora_list": None,
                 "lora_plus_scale": 1.0}


def lora_family(cfg: ModelConfig) -> str:
    """The PaddleNLP family whose LoRA module names `cfg`'s adapters take (GPT, Llama or Qwen): the checkpoint's
    family (`llmtrain.interop.paddlenlp_format.paddlenlp_family`) restricted to dense decoders whose biases PaddleNLP
    can express (encoders, MoE and q/k/v-only biases outside Qwen raise UnsupportedConfig)."""
    from llmtrain.interop.paddlenlp_format import paddlenlp_family

    if cfg.is_mla():
        raise UnsupportedConfig("LoRA adapters in PaddleNLP's format: multi-head latent attention (DeepSeek) has no "
                                "PaddleNLP LoRA format; export the merged model with --merge-lora --format hf")
    if cfg.family != "decoder" or cfg.moe_num_experts:
        raise UnsupportedConfig("LoRA adapters in PaddleNLP's format: dense decoder models (GPT, Llama, Qwen) only; "
                                f"model.family={cfg.family!r}, moe_num_experts={cfg.moe_num_experts}")
    family = paddlenlp_family(cfg)
    variant = attention_variant_mismatches(cfg, family)
    if variant:
        raise UnsupportedConfig("LoRA adapters in PaddleNLP's format: " + "; ".join(variant)
                                + " (export merged: --merge-lora --format hf)")
    if family != "qwen" and cfg.has_qkv_bias() != cfg.bias:
        raise UnsupportedConfig(f"LoRA adapters in PaddleNLP's format: model.qkv_bias={cfg.qkv_bias} with "
                                f"bias={cfg.bias} "
                                "and grouped-query attention is no PaddleNLP model (a Qwen2: export with --merge-lora "
                                "--format hf)")
    return family


def module_map(cfg: ModelConfig) -> dict[str, str]:
    """{our canonical linear name: PaddleNLP module name} of every linear LoRA can adapt in `cfg`'s model."""
    out = {}
    for i in range(cfg.num_layers):
        for ours, theirs, names in MODULES[lora_family(cfg)]:
            for n in names:
                out[ours.format(i=i, n=n)] = theirs.format(i=i, n=n)
    return out


def lora_config_json(rank: int, alpha: float, dropout: float, modules: list[str], base: Optional[str]) -> dict:
    """PaddleNLP `LoRAConfig` fields for our adapters (exact module names as target regexes)."""
    return {
        "r": int(rank), "lora_alpha": int(alpha) if float(alpha).is_integer() else float(alpha),
        "lora_dropout": float(dropout), "target_modules": [re.escape(m) for m in modules],
        "trainable_modules": None, "merge_weights": False, "trainable_bias": None, "enable_lora_list": None,
        "tensor_parallel_degree": 1, "dtype": "float32", "head_dim": None, "do_qat": False, "rslora": False,
        "pissa": False, "lora_plus_scale": 1.0, "base_model_name_or_path": base, "use_quick_lora": False,
    }


def write_paddlenlp_lora(model_cfg: ModelConfig, lora, adapters: dict, out_dir: str, base: Optional[str] = None,
                         safetensors: bool = False, overwrite: bool = False) -> dict:
    """Write `adapters` ({canonical `...lora_A`/`lora_B`: full array}) as a PaddleNLP adapter directory.

    `lora`: rank, alpha, dropout (a `LoraConfig`); `base`: the base model's path, recorded as
    `base_model_name_or_path`. safetensors: `peft_model.safetensors` + its index (else pdparams)."""
    rank, alpha = lora.rank, lora.alpha
    if lora_family(model_cfg) == "qwen":  # q/k/v adapters stacked into one c_attn adapter of rank n r
        from llmtrain.interop.qwen import lora_to_paddlenlp

        tensors, file_rank, modules = lora_to_paddlenlp(adapters, model_cfg, rank)
        rank, alpha = file_rank, alpha * file_rank / rank
    else:
        names = module_map(model_cfg)
        tensors, modules = {}, []
        for key, arr in sorted(adapters.items()):
            module, factor = key.rsplit(".", 1)
            if module not in names or factor not in ("lora_A", "lora_B"):
                raise UnsupportedConfig(f"adapter {key}: no PaddleNLP {lora_family(model_cfg)} module for it")
            tensors[f"{names[module]}.{factor}"] = np.asarray(arr, dtype=np.float32)
            if factor == "lora_A":
                modules.append(names[module])
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) to replace it")
    with staged_dir(out_dir) as tmp:
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(lora_config_json(rank, alpha, lora.dropout, modules, base), f, indent=2)
        if safetensors:  # PaddleNLP 2.8.1 finds safetensors adapters only through the index file
            write_safetensors(tensors, os.path.join(tmp, SAFE_NAME))
            index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
                     "weight_map": {k: SAFE_NAME for k in tensors}}
            with open(os.path.join(tmp, SAFE_NAME + ".index.json"), "w") as f:
                json.dump(index, f, indent=2)
        else:
            write_pdparams(tensors, os.path.join(tmp, PDPARAMS_NAME))
    return dict(out_dir=out_dir, files=sorted(os.listdir(out_dir)), modules=len(modules), rank=rank)


def read_paddlenlp_lora(lora_dir: str, model_cfg: ModelConfig, trusted: bool = False) -> tuple[dict, dict]:
    """(settings {rank, alpha, dropout, target_modules (our canonical names, escaped)}, {canonical: array})
    of a PaddleNLP adapter directory for the model `model_cfg`."""
    path = os.path.join(lora_dir, CONFIG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{lora_dir}: no {CONFIG_NAME} (not a PaddleNLP LoRA directory)")
    with open(path) as f:
        c = json.load(f)
    bad = [f"{k}={c[k]!r}" for k, ok in REFUSED_FLAGS.items() if c.get(k) not in (None, ok, [])]
    if bad:
        raise UnsupportedConfig(f"{path}: not supported (the adapters' numbers would differ): {', '.join(bad)}")
    if any(re.search(r"\.tp\d\d\.", n) for n in os.listdir(lora_dir)):
        raise UnsupportedConfig(f"{lora_dir}: tensor-parallel adapter shards (lora_model_state.tpXX): save them with "
                                "PaddleNLP's merge_tensor_parallel=True first")
    if os.path.isfile(os.path.join(lora_dir, PDPARAMS_NAME)):
        files, kind = [os.path.join(lora_dir, PDPARAMS_NAME)], "pdparams"
    elif os.path.isfile(os.path.join(lora_dir, SAFE_NAME)):
        files, kind = [os.path.join(lora_dir, SAFE_NAME)], "safetensors"
    else:
        raise FileNotFoundError(f"{lora_dir}: neither {PDPARAMS_NAME} nor {SAFE_NAME}")
    tensors, origin = read_tensors(files, kind, pickle_warning=not trusted)
    state, unexpected, rank = {}, [], int(c.get("r", 8))
    if lora_family(model_cfg) == "qwen":
        from llmtrain.interop.qwen import lora_from_paddlenlp

        state, odd = lora_from_paddlenlp(tensors, model_cfg)
        unexpected = [f"{key} ({origin[key]})" for key in odd]
    else:
        theirs = {v: k for k, v in module_map(model_cfg).items()}
        for key, arr in tensors.items():
            module, _, factor = key.rpartition(".")
            if module not in theirs or factor not in ("lora_A", "lora_B"):
                unexpected.append(f"{key} ({origin[key]})")
                continue
            state[f"{theirs[module]}.{factor}"] = np.asarray(arr, dtype=np.float32)
    modules = sorted({k.rsplit(".", 1)[0] for k in state})
    problems = [f"unexpected keys (fused or unknown modules) ({len(unexpected)}): {', '.join(unexpected)}"] \
        if unexpected else []
    for m in modules:
        for factor in ("lora_A", "lora_B"):
            if f"{m}.{factor}" not in state:
                problems.append(f"missing {m}.{factor}")
        a, b = state.get(f"{m}.lora_A"), state.get(f"{m}.lora_B")
        if a is not None and b is not None and (a.shape[1] != rank or b.shape[0] != rank):
            problems.append(f"{m}: lora_A {list(a.shape)}, lora_B {list(b.shape)} do not have rank r={rank}")
    if not modules:
        problems.append("no adapter tensors")
    if problems:
        raise CheckpointMismatch(f"PaddleNLP adapters {lora_dir} do not fit the model:\n  " + "\n  ".join(problems))
    settings = dict(rank=rank, alpha=float(c.get("lora_alpha", 8)), dropout=float(c.get("lora_dropout", 0.0)),
                    target_modules=[re.escape(m) for m in modules])
    return settings, state


def merge_adapters(base: dict, adapters: dict, scaling: float) -> dict:
    """{canonical: full array} of the base with W += A B * scaling for every adapted linear (fp32)."""
    merged = dict(base)
    for key in adapters:
        if not key.endswith(".lora_A"):
            continue
        module = key[: -len(".lora_A")]
        a = np.asarray(adapters[key], dtype=np.float32)  # [in, r]
        b = np.asarray(adapters[module + ".lora_B"], dtype=np.float32)  # [r, out]
        w = np.asarray(base[module + ".weight"], dtype=np.float32)  # [in, out]
        merged[module + ".weight"] = w + (a @ b) * np.float32(scaling)
    return merged

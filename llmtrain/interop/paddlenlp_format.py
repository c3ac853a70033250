"""PaddleNLP checkpoint directories in and out: `config.json` + weights (+ tokenizer files).

    from llmtrain.interop import read_paddlenlp_checkpoint, write_paddlenlp_checkpoint
    cfg, state, meta = read_paddlenlp_checkpoint("ckpt/")          # state: canonical name -> fp32 numpy
    load_full_state(canonical_parameters(build_model(cfg)), state)
    write_paddlenlp_checkpoint(cfg, state, "out/", safetensors=True, tokenizer_dir="tokenizers/zh")
    # paddlenlp.transformers.AutoModelForCausalLM.from_pretrained("out/") gives our logits

Families: GPT (`gpt.py`), Llama (`llama.py`), Qwen (`qwen.py`), Mixtral (`mixtral.py`, our MoE decoder)
and ERNIE (`ernie.py`, our encoder family),
detected from `model_type` or `architectures`; each module documents the numerics it
reproduces (ERNIE: `ErnieForMaskedLM.from_pretrained("out/")`). Reading checks that every
tensor of the file is used, every tensor the config needs is present and has its shape,
and raises one `CheckpointMismatch` with the whole list otherwise. Writing is atomic: a
hidden temporary directory beside `out_dir`, fsync, then a rename; a crash leaves either
no `out_dir` or a complete one.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from llmtrain.interop import ernie, gpt, llama, mixtral, qwen
from llmtrain.interop.keys import (SourceTensors, UnsupportedConfig, attention_variant_mismatches, check_canonical,
                                   model_shapes)
from llmtrain.interop.tensor_files import (PICKLE_SINGLE, SAFE_SINGLE, CheckpointFileError, dtype_of_config,
                                           find_weight_files, read_tensors, write_pdparams,
                                           staged_dir, write_safetensors)
from llmtrain.interop.tokenizer_files import find_tokenizer_model, special_id_problems, write_tokenizer_files
from llmtrain.models.config import ModelConfig
from llmtrain.utils.log import log0

FAMILIES = {"gpt": (gpt, "gpt."), "llama": (llama, "llama."), "ernie": (ernie, "ernie."), "mixtral": (mixtral, "mixtral."),
            "qwen": (qwen, "qwen.")}


def detect_family(c: dict, source: str) -> str:
    """`gpt`, `llama` or `ernie` from config.json's `model_type`, else from its `architectures`."""
    model_type = c.get("model_type")
    if model_type in FAMILIES:
        return model_type
    for arch in c.get("architectures") or []:
        for family, prefix in (("gpt", "GPT"), ("llama", "Llama"), ("mixtral", "Mixtral"), ("qwen", "QWen")):
            if arch.startswith(prefix):
                return family
        if arch in ernie.ARCHITECTURES:  # exact: ErnieM, ErnieGram, ErnieCtm... are other models
            return "ernie"
    raise UnsupportedConfig(f"{source}: model_type={model_type!r}, architectures={c.get('architectures')!r}: "
                            "only PaddleNLP GPT, Llama, Qwen, Mixtral and ERNIE checkpoints (and Hugging Face Llama "
                            "and Qwen2) are supported")


def read_config(ckpt_dir: str) -> dict:
    """config.json of a checkpoint directory, as a dict."""
    path = os.path.join(ckpt_dir, "config.json")
    if not os.path.isfile(path):
        legacy = os.path.join(ckpt_dir, "model_config.json")
        hint = (f" ({legacy} exists: the pre-2.5 format; load it with PaddleNLP and save_pretrained again)"
                if os.path.isfile(legacy) else "")
        raise CheckpointFileError(f"{path} not found{hint}")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise CheckpointFileError(f"{path}: not valid JSON ({e})") from e


def _add_base_prefix(tensors: dict, origin: dict, prefix: str) -> bool:
    """A bare base-model state dict (`GPTModel`/`LlamaModel`: no `gpt.`/`llama.`) gets the prefix; True if it did."""
    if any(k.startswith(prefix) for k in tensors):
        return False
    for k in list(tensors):
        if not k.startswith("lm_head."):
            tensors[prefix + k] = tensors.pop(k)
            origin[prefix + k] = origin.pop(k)
    return True


def read_paddlenlp_checkpoint(ckpt_dir: str, trusted: bool = False, name: Optional[str] = None,
                              lazy: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """(ModelConfig, canonical state as fp32 numpy, meta) of a PaddleNLP checkpoint directory, or of a Hugging
    Face-layout Llama / Qwen2 / Qwen3 / Qwen3-MoE one (`llmtrain.interop.hf_format`; meta["layout"] == "huggingface").

    trusted: the directory is inside the run directory (our own files). Otherwise loading a
        pickled `.pdparams` first prints a warning that unpickling can run code.
    name: `ModelConfig.name` of the result (default `paddlenlp-<dir name>`).
    lazy: for safetensors, state values are array-likes over the memory-mapped files
        (`.shape` now, fp32 data on `np.asarray`), so `load_full_state` holds one full
        tensor at a time and a pipeline rank reads only its stages. Fused or tied
        tensors are still materialised while mapping. A pickle is always read whole.
    meta: family, architectures, the config.json dict, files read, format
        (`safetensors`/`pdparams`), sharded, stored dtype, notes on mapping decisions,
        ignored buffers with reasons, warnings printed (the pickle warning), and the
        tokenizer model found beside the weights.
    """
    c = read_config(ckpt_dir)
    from llmtrain.interop.hf_format import hf_family, read_hf_checkpoint

    hf = hf_family(c, ckpt_dir)
    if hf is not None:  # a Hugging Face-layout Llama / Qwen2 / Qwen3 / Qwen3-MoE (`hf_format.py`)
        return read_hf_checkpoint(ckpt_dir, c, hf, name=name, lazy=lazy)
    family = detect_family(c, ckpt_dir)
    module, prefix = FAMILIES[family]
    name = name or f"paddlenlp-{os.path.basename(os.path.normpath(ckpt_dir))}"
    cfg, notes = module.config_from_paddlenlp(c, name, os.path.join(ckpt_dir, "config.json"))

    files, kind = find_weight_files(ckpt_dir)
    dtype = dtype_of_config(c)
    warnings: list[str] = []
    tensors, origin = read_tensors(files, kind, bf16_bits=dtype == "bfloat16", pickle_warning=not trusted,
                                   warnings=warnings, lazy=lazy)
    if _add_base_prefix(tensors, origin, prefix):
        notes.append(f"base-model state dict (no '{prefix}' prefix): read as if prefixed")

    src = SourceTensors(tensors, origin, ckpt_dir)
    extra = {"architectures": c.get("architectures")} if family == "ernie" else {}  # a base ErnieModel has no head
    state, cfg, more_notes = module.to_canonical(src, cfg, **extra)
    src.check()
    check_canonical(state, model_shapes(cfg), f"mapping of {ckpt_dir}")  # our mapping covers the model exactly
    for note in notes + more_notes:
        log0(f"{ckpt_dir}: {note}")
    meta = dict(family=family, architectures=c.get("architectures"), config=c, files=files, format=kind,
                sharded=os.path.basename(files[0]) not in (SAFE_SINGLE, PICKLE_SINGLE),
                dtype=dtype or "float32", notes=notes + more_notes, ignored=dict(src.ignored), warnings=warnings,
                tokenizer_model=find_tokenizer_model(ckpt_dir), wordpiece_vocab=ernie.find_wordpiece_vocab(ckpt_dir))
    return cfg, state, meta


def _as_fp32(value) -> np.ndarray:
    """A numpy array or paddle Tensor (any float dtype, bf16 included) as fp32 numpy."""
    if hasattr(value, "place"):  # paddle.Tensor
        return value.astype("float32").numpy()
    return np.asarray(value, dtype=np.float32)


def paddlenlp_family(cfg: ModelConfig) -> str:
    """The PaddleNLP family our config is written as: encoder -> ERNIE; learned positions -> GPT; RoPE with
    biases (q/k/v only, or everywhere) and no grouped-query attention -> Qwen, otherwise Llama (which refuses
    biases)."""
    if cfg.family == "encoder":
        return "ernie"
    if cfg.moe_num_experts > 0:
        return "mixtral"
    if cfg.position == "learned":
        return "gpt"
    return "qwen" if (cfg.has_qkv_bias() or cfg.bias) and cfg.kv_heads() == cfg.num_heads else "llama"


def paddlenlp_config(model_cfg: ModelConfig) -> tuple[str, dict, list[str]]:
    """(PaddleNLP family, config.json fields, notes) of the directory `model_cfg` is written as; raises
    UnsupportedConfig naming the fields PaddleNLP's class cannot express (no tensor is needed)."""
    family = paddlenlp_family(model_cfg)
    module, _ = FAMILIES[family]
    if family != "qwen" and model_cfg.has_qkv_bias() != model_cfg.bias:
        raise UnsupportedConfig(f"model {model_cfg.name!r}: model.qkv_bias={model_cfg.qkv_bias} with bias="
                                f"{model_cfg.bias} cannot be written as a PaddleNLP {family} (only Qwen has q/k/v-only "
                                "biases; a grouped-query Qwen2 goes out with --format hf)")
    variant = attention_variant_mismatches(model_cfg, family)
    if variant:
        raise UnsupportedConfig(f"model {model_cfg.name!r} cannot be written as a PaddleNLP {family}: "
                                + "; ".join(variant))
    config, notes = module.config_to_paddlenlp(model_cfg)
    return family, config, notes


def write_paddlenlp_checkpoint(model_cfg: ModelConfig, state, out_dir: str, safetensors: bool = True,
                               tokenizer_dir: Optional[str] = None, overwrite: bool = False,
                               special_ids: Optional[dict] = None) -> dict:
    """Write `state` (canonical name -> full tensor) as a PaddleNLP checkpoint directory; returns what was written.

    safetensors: `model.safetensors` (else the pickled `model_state.pdparams`), fp32 either way.
    tokenizer_dir: our SentencePiece tokenizer directory (or `.model` file) to include, loadable
        by both our `load_tokenizer` and PaddleNLP's `AutoTokenizer` (see `tokenizer_files.py`).
    overwrite: replace an existing `out_dir` (the old one is removed only after the new one is in place).
    special_ids: config.json's `<k>_token_id` when no tokenizer is shipped (a decoder's; the checkpoint's recorded
        tokenizer, `tokenizer_files.recorded_token_ids`); a shipped tokenizer's own ids are written otherwise and
        checked against its files.
    """
    out_dir = os.path.normpath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) to replace it")
    family, config, notes = paddlenlp_config(model_cfg)  # raises before any work if not expressible
    module, _ = FAMILIES[family]
    state = {k: _as_fp32(v) for k, v in state.items()}
    check_canonical(state, model_shapes(model_cfg), "state to export")
    tensors = module.from_canonical(state, model_cfg)
    config["dtype"] = "float32"

    with staged_dir(out_dir) as tmp:
        if tokenizer_dir is not None:
            config.update(ernie.write_tokenizer(tokenizer_dir, tmp, model_cfg) if family == "ernie"
                          else write_tokenizer_files(tokenizer_dir, tmp, model_cfg.vocab_size))
        elif family != "ernie":  # ERNIE's pad id is the model's (its zeroed embedding row)
            config.update(special_ids or {})
        bad = special_id_problems(tmp, config) if family != "ernie" else []
        if bad:
            raise UnsupportedConfig(f"{out_dir}: the special-token ids disagree with the shipped tokenizer: "
                                    + "; ".join(bad))
        weights = SAFE_SINGLE if safetensors else PICKLE_SINGLE
        (write_safetensors if safetensors else write_pdparams)(tensors, os.path.join(tmp, weights))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return dict(family=family, out_dir=out_dir, files=sorted(os.listdir(out_dir)), config=config, notes=notes)

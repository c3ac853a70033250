"""Hugging Face-layout DeepSeek-V2 / V3 checkpoints <-> our decoder with multi-head latent attention and MoE.

    python llmtrain/finetune.py model.init_from=DeepSeek-V2-Lite/ ...      # read through hf_format.read_hf_checkpoint
    python -m llmtrain.export --checkpoint RUN --output out/ --format hf   # written back as DeepseekV2/V3ForCausalLM

What DeepSeek's published code computes (`modeling_deepseek.py` beside the DeepSeek-V2-Lite and DeepSeek-V3
weights; `transformers`' `modeling_deepseek_v3.py`), and the ModelConfig that reproduces it:
  - pre-norm RMSNorm blocks, SwiGLU, untied LM head (`tie_word_embeddings`), RoPE with `rope_theta` and YaRN
    `rope_scaling` on the `qk_rope_head_dim` rotary part only -> position=rope, rope_scaling;
  - multi-head latent attention (`llmtrain/models/mla.py`): `q_lora_rank` (null: one q_proj), `kv_lora_rank`,
    `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim` -> model.mla_*; the compressed vectors' RMSNorms use
    eps 1e-6 (DeepSeek's code gives them no eps), as mla.py does; softmax scale with YaRN's mscale_all_dim;
    `num_key_value_heads` is not used by MLA;
  - the rotary rows of q_proj / q_b_proj (per head) and of kv_a_proj_with_mqa are stored for DeepSeek's interleaved
    rotation (pairs 2i, 2i+1); we read them permuted evens-then-odds, the layout our rotate-half rotation needs
    (the attention is the same: q.k is unchanged by a common permutation), and write them back interleaved.
    A config with `rope_interleave: false` (transformers' switch) is read as it is;
  - MoE in blocks >= `first_k_dense_replace` (`moe_layer_freq` 1 only): `n_routed_experts` of width
    `moe_intermediate_size`, `n_shared_experts` shared (one FFN n_shared x wide), top `num_experts_per_tok`;
    V3 (`scoring_func` sigmoid, `topk_method` noaux_tc): choice on scores + `e_score_correction_bias` (our
    expert_bias), group-limited to `topk_group` of `n_group` groups ranked by their two best (moe_group_score
    top2), weights the scores, renormalised when top_k > 1 and `norm_topk_prob`, times `routed_scaling_factor`;
    V2 (softmax; greedy, or group_limited_greedy ranking groups by their best: moe_group_score max): weights
    renormalised when top_k > 1 and norm_topk_prob, otherwise times routed_scaling_factor (V2 applies one or the
    other). Dropless (moe_capacity_factor 0). Experts outside the chosen groups are never chosen (DeepSeek's
    inference code; transformers fills them with 0.0, the same choice unless a bias below -1 makes scores
    negative).
Training balance: DeepSeek's sequence-wise auxiliary loss (`aux_loss_alpha`, `seq_aux`) is not implemented, so the
import sets moe_aux_loss_coef=0 (the logged loss is the LM loss); V3's correction bias keeps choosing experts but
is not moved (moe_bias_update_rate 0: fine-tuning's setting; a LoRA checkpoint stores adapters only, so a moved
bias would be lost); the deepseek-v3 preset trains from scratch with the report's gamma 0.001.
Skipped on import, with a note: multi-token prediction modules (`num_nextn_predict_layers`, V3's
`model.layers.61.*`: llmtrain has no MTP; the main model's logits do not use them) and rotary `inv_freq` buffers.
Refused with the field named: `hidden_act` other than silu, `attention_bias` true (its bias on q_a/kv_a/o only is
not expressible), `moe_layer_freq` other than 1, an unknown `topk_method`/`scoring_func` pair, top_k 1 with
`norm_topk_prob` (DeepSeek's and transformers' code disagree there), a `quantization_config` other than DeepSeek's
FP8 (fp8 e4m3 with block scales), and on export a V2 (softmax) model with a non-zero expert bias or one that both
renormalises and scales.
FP8 (DeepSeek-V3's release: `F8_E4M3` linear weights with an fp32 `weight_scale_inv` per 128 x 128 block): read as
fp32, each block times its scale, lazily like every tensor; the run then trains in its own dtype and an export
writes unquantized weights without quantization_config.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from llmtrain.interop.keys import SourceTensors, UnsupportedConfig, ffn_names, take_norm_and_head
from llmtrain.models.config import ModelConfig

ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
DEFAULTS = {  # the defaults of DeepSeek's configuration_deepseek.py for the fields we read
    "deepseek_v2": dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, moe_intermediate_size=1407,
                        num_hidden_layers=30, num_attention_heads=32, n_shared_experts=None, n_routed_experts=None,
                        routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                        v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy", n_group=None, topk_group=None,
                        num_experts_per_tok=None, moe_layer_freq=1, first_k_dense_replace=0, norm_topk_prob=False,
                        scoring_func="softmax", hidden_act="silu", max_position_embeddings=2048,
                        initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                        rope_scaling=None, attention_bias=False, num_nextn_predict_layers=0),
    "deepseek_v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                        v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
                        num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True,
                        scoring_func="sigmoid", hidden_act="silu", max_position_embeddings=4096,
                        initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                        rope_scaling=None, attention_bias=False, num_nextn_predict_layers=1),
}
def rope_from_deepseek(c: dict, g: dict, bad: list, notes: list):
    """(model.rope_scaling, rope_theta, max_position_embeddings) of DeepSeek's `rope_scaling` (or transformers 5's
    `rope_parameters`), read as `hf_config.rope_from_hf` reads it; YaRN's factor on cos/sin is DeepSeek's
    yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim) (mscale 1, mscale_all_dim 0 when
    absent), set explicitly where transformers' rule would differ (mscale without mscale_all_dim)."""
    from llmtrain.interop.hf_rope import rope_from_hf, rope_params
    from llmtrain.models.mla import yarn_mscale
    from llmtrain.models.rope import yarn_attention_factor

    theta, scaling = rope_params(c, g)
    rope, max_pos = rope_from_hf(scaling, g["max_position_embeddings"], bad, notes)
    if rope.type == "yarn" and rope.attention_factor is None:
        theirs = yarn_mscale(rope.factor, rope.mscale or 1.0) / yarn_mscale(rope.factor, rope.mscale_all_dim)
        if abs(theirs - yarn_attention_factor(rope)) > 1e-12:
            rope = dataclasses.replace(rope, attention_factor=theirs)
    return rope, theta, max_pos


def config_from_hf(c: dict, family: str, name: str, source: str) -> tuple[ModelConfig, list[str]]:
    """ModelConfig computing what DeepSeek's `family` (deepseek_v2 / deepseek_v3) computes for config.json `c`."""
    g = {k: c.get(k, v) for k, v in DEFAULTS[family].items()}
    notes = [f"{k} absent from config.json: DeepSeek's default {v!r} used" for k, v in DEFAULTS[family].items()
             if k not in c and k not in ("rope_scaling", "num_nextn_predict_layers", "attention_bias")]
    bad = []
    if g["hidden_act"] != "silu":
        bad.append(f"hidden_act={g['hidden_act']!r} (SwiGLU with silu only)")
    if g["attention_bias"]:
        bad.append("attention_bias=true (a bias on q_a/kv_a/o alone is not expressible: our model.bias covers every "
                   "linear)")
    quant = c.get("quantization_config")
    if quant and fp8_block(quant) is None:
        bad.append(f"quantization_config={quant!r} (read: quant_method fp8, fmt e4m3 with a 2-D weight_block_size, "
                   "DeepSeek-V3's FP8 release)")
    rope, theta, max_pos = rope_from_deepseek(c, g, bad, notes)
    experts = g["n_routed_experts"] or 0
    k, method, scoring = g["num_experts_per_tok"] or 0, g["topk_method"], g["scoring_func"]
    allowed = {"deepseek_v3": {("noaux_tc", "sigmoid")},
               "deepseek_v2": {("greedy", "softmax"), ("group_limited_greedy", "softmax")}}[family]
    if experts:
        if g["moe_layer_freq"] != 1:
            bad.append(f"moe_layer_freq={g['moe_layer_freq']} (MoE in every block after first_k_dense_replace only)")
        if (method, scoring) not in allowed:
            bad.append(f"topk_method={method!r} with scoring_func={scoring!r} ({family} computes "
                       f"{sorted(allowed)})")
        if k == 1 and g["norm_topk_prob"]:
            bad.append("num_experts_per_tok=1 with norm_topk_prob=true (DeepSeek's code skips the renormalisation "
                       "for one expert, transformers' DeepseekV3 does not)")
    if g["kv_lora_rank"] in (None, 0):
        bad.append(f"kv_lora_rank={g['kv_lora_rank']!r} (multi-head latent attention needs a kv rank)")
    if bad:
        raise UnsupportedConfig(f"{source}: {ARCHITECTURES[family]} config not supported: " + "; ".join(bad))
    heads = g["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads")
    if kv_heads not in (None, heads):
        notes.append(f"num_key_value_heads={kv_heads} is not used by multi-head latent attention (every head has its "
                     "own keys and values), as in DeepSeek's code")
    grouped = experts and method in ("noaux_tc", "group_limited_greedy") and (g["n_group"] or 1) > 1
    normed = bool(g["norm_topk_prob"]) and k > 1
    scale = float(g["routed_scaling_factor"]) if family == "deepseek_v3" or not normed else 1.0
    if family == "deepseek_v2" and normed and g["routed_scaling_factor"] != 1.0:
        notes.append(f"routed_scaling_factor={g['routed_scaling_factor']} is not applied: DeepSeek-V2 renormalises "
                     "the top-k weights instead (norm_topk_prob=true)")
    if quant:
        notes.append(f"FP8 weights (block {fp8_block(quant)}) dequantized with their weight_scale_inv; the run trains "
                     "in its own dtype and an export writes unquantized weights")
    if experts:
        notes.append("DeepSeek's sequence-wise auxiliary loss (aux_loss_alpha, seq_aux) is not implemented: "
                     "moe_aux_loss_coef=0" + (" (the correction bias chooses experts and stays as read: "
                                              "moe_bias_update_rate=0)" if family == "deepseek_v3" else ""))
    cfg = ModelConfig(
        name=name, hidden_size=g["hidden_size"], num_layers=g["num_hidden_layers"], num_heads=heads,
        ffn_hidden_size=g["intermediate_size"], vocab_size=g["vocab_size"],
        max_position_embeddings=max_pos, position="rope", rope_theta=theta, rope_scaling=rope,
        norm="rmsnorm", norm_eps=float(g["rms_norm_eps"]), activation="swiglu", bias=False,
        tie_embeddings=bool(g["tie_word_embeddings"]), init_std=float(g["initializer_range"]),
        mla_kv_lora_rank=int(g["kv_lora_rank"]), mla_q_lora_rank=g["q_lora_rank"] or None,
        mla_qk_nope_head_dim=int(g["qk_nope_head_dim"]), mla_qk_rope_head_dim=int(g["qk_rope_head_dim"]),
        mla_v_head_dim=int(g["v_head_dim"]),
        moe_num_experts=int(experts), moe_top_k=int(k or 2), moe_ffn_hidden_size=g["moe_intermediate_size"],
        moe_num_shared_experts=int(g["n_shared_experts"] or 0), moe_first_dense_layers=int(g["first_k_dense_replace"]),
        moe_router=scoring, moe_norm_topk=normed, moe_routed_scale=scale, moe_aux_loss_coef=0.0,
        moe_z_loss_coef=0.0, moe_bias_update_rate=0.0,
        moe_capacity_factor=0.0, moe_n_group=int(g["n_group"]) if grouped else 1,
        moe_topk_group=int(g["topk_group"]) if grouped else 1,
        moe_group_score="max" if grouped and method == "group_limited_greedy" else "top2")
    return cfg, notes


def hf_family_of(cfg: ModelConfig) -> str:
    """The DeepSeek model type `cfg` is written as: a sigmoid router (V3's gate) -> deepseek_v3, else deepseek_v2."""
    return "deepseek_v3" if cfg.moe_num_experts and cfg.moe_router == "sigmoid" else "deepseek_v2"


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json (the published field names) of the DeepSeek model computing what `cfg` computes."""
    from llmtrain.interop.keys import switch_mismatches

    family = hf_family_of(cfg)
    wants = (("position", "rope"), ("norm", "rmsnorm"), ("activation", "swiglu"), ("norm_position", "pre"),
             ("bias", False), ("moe_capacity_factor", 0.0))
    bad = switch_mismatches(cfg, "decoder", ARCHITECTURES[family], family, wants)
    if not cfg.is_mla():
        bad.append("model.mla_kv_lora_rank=0 (DeepSeek uses multi-head latent attention)")
    e = cfg.moe_num_experts
    v3 = family == "deepseek_v3"
    if e and cfg.moe_n_group > 1 and cfg.moe_group_score != ("top2" if v3 else "max"):
        bad.append(f"model.moe_group_score={cfg.moe_group_score!r} with moe_router={cfg.moe_router} ({family} ranks "
                   f"groups by {'the sum of their two best' if v3 else 'their best'} score)")
    if e and not v3 and cfg.moe_norm_topk and cfg.moe_routed_scale != 1.0:
        bad.append(f"model.moe_norm_topk=true with moe_routed_scale={cfg.moe_routed_scale} (DeepSeek-V2 applies "
                   "routed_scaling_factor only to weights it does not renormalise)")
    if e and cfg.moe_norm_topk and cfg.moe_top_k == 1:
        bad.append("model.moe_norm_topk=true with moe_top_k=1 (DeepSeek's code does not renormalise one expert)")
    if bad:
        raise UnsupportedConfig(f"model {cfg.name!r} cannot be written as a Hugging Face {ARCHITECTURES[family]}: "
                                + "; ".join(bad))
    from llmtrain.interop.hf_rope import rope_to_hf

    scaling, max_pos = rope_to_hf(cfg)
    if scaling is not None:  # DeepSeek's code reads rope_scaling["type"]
        scaling = {"type": scaling.pop("rope_type"), **scaling}
    out = dict(architectures=[ARCHITECTURES[family]], model_type=family, attention_bias=False, attention_dropout=0.0,
               bos_token_id=0 if v3 else 100000, eos_token_id=1 if v3 else 100001, ep_size=1,
               first_k_dense_replace=cfg.moe_first_dense_layers if e else cfg.num_layers, hidden_act="silu",
               hidden_size=cfg.hidden_size, initializer_range=cfg.init_std, intermediate_size=cfg.ffn_hidden_size,
               kv_lora_rank=cfg.mla_kv_lora_rank, max_position_embeddings=max_pos,
               moe_intermediate_size=cfg.expert_ffn_size(), moe_layer_freq=1,
               n_group=cfg.moe_n_group, n_routed_experts=e or None,
               n_shared_experts=cfg.moe_num_shared_experts or None, norm_topk_prob=bool(cfg.moe_norm_topk),
               num_attention_heads=cfg.num_heads, num_experts_per_tok=cfg.moe_top_k if e else None,
               num_hidden_layers=cfg.num_layers, num_key_value_heads=cfg.num_heads,
               q_lora_rank=cfg.mla_q_lora_rank, qk_nope_head_dim=cfg.mla_qk_nope_head_dim,
               qk_rope_head_dim=cfg.mla_qk_rope_head_dim, rms_norm_eps=cfg.norm_eps, rope_scaling=scaling,
               rope_theta=cfg.rope_theta, routed_scaling_factor=cfg.moe_routed_scale,
               scoring_func="sigmoid" if v3 else "softmax", tie_word_embeddings=cfg.tie_embeddings,
               topk_group=cfg.moe_topk_group, torch_dtype="float32", transformers_version="4.46.3", use_cache=True,
               v_head_dim=cfg.mla_v_head_dim, vocab_size=cfg.vocab_size)
    if v3:
        out.update(topk_method="noaux_tc", num_nextn_predict_layers=0)
    else:
        out.update(topk_method="group_limited_greedy" if cfg.moe_n_group > 1 else "greedy", aux_loss_alpha=0.001,
                   seq_aux=True, pretraining_tp=1)
    return out


class _Mapped:
    """A (lazy) HF tensor seen as ours: rows reordered by `rows`, then transposed for an [out, in] linear; read on
    `np.asarray`."""

    def __init__(self, inner, rows=None, transpose: bool = False):
        self.inner, self.rows, self.transpose = inner, rows, transpose
        shape = tuple(np.shape(inner))
        self.shape = tuple(reversed(shape)) if transpose else shape
        self.ndim = len(shape)
        self.dtype = np.dtype(np.float32)

    def __array__(self, dtype=None, copy=None):
        arr = np.asarray(self.inner, dtype=np.float32)
        if self.rows is not None:
            arr = arr[self.rows]
        arr = np.ascontiguousarray(arr.T if self.transpose else arr)
        return arr if dtype is None else arr.astype(dtype, copy=False)


def fp8_block(quant: dict):
    """(rows, columns) of DeepSeek's FP8 block scaling from `quantization_config`, or None if it is another scheme."""
    block = quant.get("weight_block_size")
    if (quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3" or not isinstance(block, list)
            or len(block) != 2):
        return None
    return int(block[0]), int(block[1])


class _Dequantized:
    """An FP8 weight [out, in] (float8 e4m3 values, `tensor_files.E4M3`) times its `weight_scale_inv`
    [ceil(out / rows), ceil(in / cols)], one scale per block; read on `np.asarray`."""

    def __init__(self, weight, scale, block: tuple[int, int]):
        self.weight, self.scale, self.block = weight, scale, block
        self.shape = tuple(np.shape(weight))
        self.ndim = 2
        self.dtype = np.dtype(np.float32)

    def __array__(self, dtype=None, copy=None):
        w = np.asarray(self.weight, dtype=np.float32)
        rows, cols = self.block
        scale = np.repeat(np.repeat(np.asarray(self.scale, dtype=np.float32), rows, 0), cols, 1)
        arr = w * scale[:w.shape[0], :w.shape[1]]
        return arr if dtype is None else arr.astype(dtype, copy=False)


def _dequantized(src: SourceTensors, key: str, arr, block):
    """`arr` (the tensor `key`) with its FP8 block scales applied when the file has `key`_scale_inv."""
    if arr is None or not src.has(key + "_scale_inv"):
        return arr
    rows, cols = block or (128, 128)
    out, inp = np.shape(arr)
    scale = src.take(key + "_scale_inv", [-(-out // rows), -(-inp // cols)])
    return None if scale is None else _Dequantized(arr, scale, (rows, cols))


def rotary_rows(cfg: ModelConfig, per_head: int, first: int, heads: int) -> np.ndarray:
    """Row order reading DeepSeek's interleaved rotary rows evens-then-odds: ours[i] = theirs[rows[i]], for `heads`
    blocks of `per_head` rows whose rotary part starts at row `first` of the block."""
    d = cfg.mla_qk_rope_head_dim
    perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    rows = np.arange(heads * per_head).reshape(heads, per_head)
    rows[:, first:first + d] = rows[:, first:first + d][:, perm]
    return rows.reshape(-1)


def _attention_rows(cfg: ModelConfig, interleaved: bool) -> dict:
    """{HF attention linear: row order} for the linears holding rotary rows (none when not interleaved)."""
    if not interleaved:
        return {}
    qk = cfg.mla_qk_nope_head_dim + cfg.mla_qk_rope_head_dim
    q_rows = rotary_rows(cfg, qk, cfg.mla_qk_nope_head_dim, cfg.num_heads)
    kv_rows = rotary_rows(cfg, cfg.mla_kv_lora_rank + cfg.mla_qk_rope_head_dim, cfg.mla_kv_lora_rank, 1)
    return {"q_proj": q_rows, "q_b_proj": q_rows, "kv_a_proj_with_mqa": kv_rows}


def _layer_names(cfg: ModelConfig, i: int) -> list[tuple[str, str, bool]]:
    """(our name inside `layers.i.`, HF name inside `model.layers.i.`, is a linear [out, in]) of block i."""
    q = ([("attn.q_a_proj.weight", "self_attn.q_a_proj.weight", True),
          ("attn.q_a_norm.weight", "self_attn.q_a_layernorm.weight", False),
          ("attn.q_b_proj.weight", "self_attn.q_b_proj.weight", True)] if cfg.mla_q_lora_rank
         else [("attn.q_proj.weight", "self_attn.q_proj.weight", True)])
    names = [("attn_norm.weight", "input_layernorm.weight", False),
             ("mlp_norm.weight", "post_attention_layernorm.weight", False), *q,
             ("attn.kv_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", True),
             ("attn.kv_a_norm.weight", "self_attn.kv_a_layernorm.weight", False),
             ("attn.kv_b_proj.weight", "self_attn.kv_b_proj.weight", True),
             ("attn.o_proj.weight", "self_attn.o_proj.weight", True)]
    return names + ffn_names(cfg, i)


def to_canonical(src: SourceTensors, cfg: ModelConfig, config: Optional[dict] = None) -> tuple[dict, list[str]]:
    """Our canonical state (lazy) from DeepSeek tensors, and notes; MTP modules and rotary buffers are skipped."""
    from llmtrain.interop.tensor_files import StackedTransposed
    from llmtrain.interop.keys import model_shapes

    shapes, notes, state = model_shapes(cfg), [], {}
    rows = _attention_rows(cfg, bool((config or {}).get("rope_interleave", True)))
    quant = (config or {}).get("quantization_config")
    block = fp8_block(quant) if quant else None

    def put(canon, key, linear, order=None):
        want = shapes[canon]
        arr = _dequantized(src, key, src.take(key, list(reversed(want)) if linear else want), block)
        if arr is not None:
            state[canon] = _Mapped(arr, order, linear) if (linear or order is not None) else arr

    put("embed.word.weight", "model.embed_tokens.weight", False)
    for i in range(cfg.num_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        for ours, theirs, linear in _layer_names(cfg, i):
            put(c + ours, p + theirs, linear, rows.get(theirs.split(".")[1]) if theirs.startswith("self_attn") else None)
        if cfg.is_moe_layer(i):
            e, h, f = cfg.moe_num_experts, cfg.hidden_size, cfg.expert_ffn_size()
            bias_key = p + "mlp.gate.e_score_correction_bias"
            if src.has(bias_key):
                put(c + "mlp.expert_bias", bias_key, False)
            else:
                state[c + "mlp.expert_bias"] = np.zeros([e], np.float32)
            for ours, theirs, shape in (("w_gate", "gate_proj", [f, h]), ("w_up", "up_proj", [f, h]),
                                        ("w_down", "down_proj", [h, f])):
                keys = [f"{p}mlp.experts.{j}.{theirs}.weight" for j in range(e)]
                parts = [_dequantized(src, k, src.take(k, shape), block) for k in keys]
                if all(x is not None for x in parts):
                    state[f"{c}mlp.experts.{ours}"] = StackedTransposed(parts)
    take_norm_and_head(src, cfg, put)
    mtp = sorted({k.split(".")[2] for k in src.tensors if k.startswith("model.layers.")
                  and int(k.split(".")[2]) >= cfg.num_layers})
    for key in src.tensors:
        if key.startswith("model.layers.") and int(key.split(".")[2]) >= cfg.num_layers:
            src.ignore(key, "multi-token prediction module (num_nextn_predict_layers): not implemented, skipped")
        elif key.endswith("rotary_emb.inv_freq"):
            src.ignore(key, "rotary inv_freq buffer (recomputed from rope_theta and rope_scaling)")
    if mtp:
        notes.append(f"multi-token prediction module(s) model.layers.{{{','.join(mtp)}}}.* skipped: llmtrain has no MTP "
                     "(the main model's logits do not use them; an export writes num_nextn_predict_layers=0)")
    return state, notes


def from_canonical(state: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """DeepSeek tensors ([out, in] linears, rotary rows interleaved again) from our canonical state."""
    family = hf_family_of(cfg)
    rows = {k: np.argsort(v) for k, v in _attention_rows(cfg, True).items()}  # theirs = ours[argsort(rows)]
    out = {"model.embed_tokens.weight": state["embed.word.weight"]}
    for i in range(cfg.num_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        for ours, theirs, linear in _layer_names(cfg, i):
            arr = np.asarray(state[c + ours], dtype=np.float32)
            arr = arr.T if linear else arr
            order = rows.get(theirs.split(".")[1]) if theirs.startswith("self_attn") else None
            out[p + theirs] = np.ascontiguousarray(arr if order is None else arr[order])
        if not cfg.is_moe_layer(i):
            continue
        bias = np.asarray(state[c + "mlp.expert_bias"], dtype=np.float32)
        if family == "deepseek_v3":
            out[p + "mlp.gate.e_score_correction_bias"] = bias
        elif np.any(bias != 0):
            raise UnsupportedConfig(f"{c}mlp.expert_bias is non-zero: DeepSeek-V2's softmax gate routes without a "
                                    "bias (a sigmoid router is written as DeepSeek-V3, which has one)")
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            stacked = np.asarray(state[f"{c}mlp.experts.{ours}"], dtype=np.float32)
            for j in range(cfg.moe_num_experts):
                out[f"{p}mlp.experts.{j}.{theirs}.weight"] = np.ascontiguousarray(stacked[j].T)
    out["model.norm.weight"] = state["final_norm.norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(state["lm_head.proj.weight"]).T)
    return out

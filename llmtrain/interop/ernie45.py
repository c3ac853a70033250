"""ERNIE 4.5 (dense `Ernie4_5ForCausalLM`, MoE `Ernie4_5_MoeForCausalLM`) checkpoints <-> our decoder.

    python llmtrain/finetune.py model.init_from=ERNIE-4.5-0.3B/ ...          # read through hf_format.read_hf_checkpoint
    python -m llmtrain.export --checkpoint RUN --output out/ --format paddleformers   # or hf (-PT style), or auto

Two layouts, one set of tensors. PaddleFormers 1.2.0's `save_pretrained` (its default `flex_checkpoint` format)
writes what the Hugging Face `-PT` releases hold: `config.json` + `model-0000i-of-0000n.safetensors` shards +
`model.safetensors.index.json` (even for one shard), tensors named `model.layers.{i}.self_attn.{q,k,v,o}_proj`,
`mlp.{gate,up,down}_proj` stored [out, in] (PaddleFormers' fused `qkv_proj` / `up_gate_proj` [in, out] live in
memory only and are split and transposed on save), and a `saved_signal_0` marker file. Its config.json adds
`paddleformers_version` and `rope_parameters`, which is how a PaddleFormers directory is told from a `-PT` one
(`layout`). `--format auto` writes a run back in the layout it came from; `paddleformers` writes PaddleFormers'
(what its `from_pretrained` reads), `hf` the `-PT` style. PaddleFormers' other save path (`save_to_hf=False`: a
pickled `model_state.pdparams` of the fused [in, out] tensors) is not read: its own `from_pretrained` does not
read it back either.

What the published code computes (PaddleFormers 1.2.0 `transformers/ernie4_5/modeling.py`,
`ernie4_5_moe/modeling.py`, `nn/moe/topk_gate.py`, `nn/moe/moe_allgather_layer.py`) and the ModelConfig reproducing it:
  - pre-norm RMSNorm blocks (`rms_norm_eps`), SwiGLU (`hidden_act` silu; the dense config's default name swiglu is
    the same), grouped-query attention of `head_dim` (None: hidden / heads), no biases (`use_bias` true is refused:
    it also puts a bias on every RMSNorm), tied or untied head (`tie_word_embeddings`; PaddleFormers' default is
    false for the dense class and true for the MoE one);
  - RoPE with `rope_theta` in the interleaved ("GLM") form: pairs (2i, 2i+1) of each q/k head are rotated by
    frequency i. We read each head's q and k rows evens-then-odds (the layout our rotate-half rotation needs; q.k is
    unchanged by a common permutation) and write them back interleaved. Scaled RoPE types are refused (the
    published ERNIE 4.5 configs have none);
  - MoE (`Ernie4_5_MoeForCausalLM`): block i has experts when (i + 1) % `moe_layer_interval` == 0 and
    `moe_layer_start_index` <= i <= `moe_layer_end_index` (-1: the last block) -> moe_layer_interval,
    moe_first_dense_layers, moe_last_layer; the other blocks keep a dense FFN of `intermediate_size`;
    `moe_num_experts` SwiGLU experts of `moe_intermediate_size` and `moe_num_shared_experts` shared ones (one FFN
    n_shared x wide) that every token passes through, added to the routed sum;
  - the router (`TopKGate`): logits = x W (fp32, no bias, `mlp.gate.weight` [E, h]); probs = softmax; the top
    `moe_k` experts are chosen on probs + `e_score_correction_bias` (`mlp.moe_statics`, [1, E]: our expert_bias,
    used when `moe_use_aux_free`), weighted by the unbiased probs renormalised to sum 1 (`moe_norm_gate_logits`;
    PaddleFormers divides by max(sum, 1e-12)) -> moe_router=softmax, moe_norm_topk. Dropless: PaddleFormers'
    training capacity is moe_capacity[0] x T / E tokens per expert, which drops nothing when moe_capacity[0] >= E
    (64 in every published config, E <= 64); a smaller one is noted and read dropless;
  - balancing (`_calc_router_loss`, added to the training loss once per MoE block, summed over blocks): the aux
    loss E * sum_i P_i f_i (P_i mean router probability, f_i = top-k choices of expert i / T, the choices made
    WITHOUT the correction bias when `moe_use_aux_free`) times `router_aux_loss_coef`, and the z-loss
    mean_t logsumexp(logits_t)^2 times `router_z_loss_coef`. Ours averages each over the MoE blocks, so the import
    sets moe_aux_loss_coef / moe_z_loss_coef = coefficient x (MoE blocks) and moe_aux_counts=unbiased (the same
    sum). Its router orthogonal loss (`moe_orthogonal_loss_lambda`, a function of the router weight alone) is not
    implemented: an import trains without it (a note says so; the logits are unaffected). The correction bias is
    read and chooses experts but is not moved (moe_bias_update_rate 0, as DeepSeek-V3 is imported);
  - the multi-token prediction block (`num_nextn_predict_layers`: `model.mtp_block.*`, `mtp_emb_norm`,
    `mtp_hidden_norm`, `mtp_linear_proj`) is skipped with a note (the main model's logits do not use it); an export
    writes num_nextn_predict_layers 0.
Refused with the field named: `use_bias` true, a `hidden_act` other than silu/swiglu, lists for `moe_num_experts` /
`moe_intermediate_size` / the layer indices (ERNIE-4.5-VL's multimodal experts), `moe_group_experts`, a
`scoring_func` other than softmax, scaled `rope_scaling` / `rope_parameters`.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from llmtrain.interop.keys import EXPERT_LINEARS, SourceTensors, UnsupportedConfig, ffn_names, take_norm_and_head
from llmtrain.models.config import ModelConfig

ARCHITECTURES = {"ernie4_5": "Ernie4_5ForCausalLM", "ernie4_5_moe": "Ernie4_5_MoeForCausalLM"}
FORMAT_VERSION = "1.2.0"
TOKENIZER_CLASS = "Ernie4_5Tokenizer"
"""The class an export's tokenizer_config.json names for our SentencePiece tokenizer (PaddleFormers' ERNIE 4.5)."""
"""The PaddleFormers version whose save_pretrained layout `--format paddleformers` writes (config.json's
`paddleformers_version`)."""
_COMMON = dict(hidden_act="silu", initializer_range=0.02, use_bias=False, rope_scaling=None, head_dim=None,
               num_key_value_heads=None)
DEFAULTS = {  # PaddleFormers 1.2.0's configuration defaults for the fields we read
    "ernie4_5": dict(_COMMON, vocab_size=32000, hidden_size=768, intermediate_size=11008, max_position_embeddings=32768,
                     num_hidden_layers=2, num_attention_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                     tie_word_embeddings=False),
    "ernie4_5_moe": dict(_COMMON, vocab_size=103424, hidden_size=2560, intermediate_size=12288,
                         max_position_embeddings=32768, num_hidden_layers=3, num_attention_heads=2, rms_norm_eps=1e-6,
                         rope_theta=10000.0, tie_word_embeddings=True, moe_num_experts=16, moe_capacity=[64, 64, 64],
                         router_aux_loss_coef=1e-2, router_z_loss_coef=1e-4, moe_orthogonal_loss_lambda=1e-2,
                         moe_intermediate_size=0, moe_num_shared_experts=2, moe_layer_start_index=1,
                         moe_layer_end_index=-1, moe_layer_interval=1, scoring_func="softmax",
                         moe_norm_gate_logits=True, moe_k=2, moe_use_aux_free=True, moe_group_experts=False,
                         num_nextn_predict_layers=1),
}
_QUIET = ("rope_scaling", "head_dim", "num_key_value_heads", "initializer_range", "num_nextn_predict_layers",
          "moe_capacity", "moe_orthogonal_loss_lambda", "router_aux_loss_coef", "router_z_loss_coef", "scoring_func",
          "moe_norm_gate_logits", "moe_use_aux_free", "moe_group_experts")


def layout_of(c: dict) -> str:
    """`paddleformers` when config.json was written by PaddleFormers (it has `paddleformers_version`), else
    `huggingface` (a `-PT` release)."""
    return "paddleformers" if "paddleformers_version" in c else "huggingface"


def moe_blocks(layers: int, start: int, end: int, interval: int) -> list[int]:
    """The MoE blocks of ERNIE 4.5's placement (end -1: the last block)."""
    end = layers - 1 if end < 0 else end
    return [i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end]


def _moe_fields(g: dict, layers: int, bad: list, notes: list) -> dict:
    """The model.moe_* fields of an ERNIE 4.5 MoE config (problems appended to `bad`)."""
    listed = [k for k in ("moe_num_experts", "moe_intermediate_size", "moe_layer_start_index", "moe_layer_end_index",
                          "moe_num_shared_experts", "moe_k") if isinstance(g[k], (list, tuple))]
    if listed:
        bad.append(f"{', '.join(listed)} given per modality (lists: ERNIE-4.5-VL's multimodal experts are not read)")
        return {}
    if g["moe_group_experts"]:
        bad.append("moe_group_experts=true (grouped top-1 routing is not implemented)")
    if g["scoring_func"] != "softmax":
        bad.append(f"scoring_func={g['scoring_func']!r} (the softmax router only)")
    e, k, interval = int(g["moe_num_experts"]), int(g["moe_k"]), int(g["moe_layer_interval"])
    if interval < 1 or not 1 <= k <= e:
        bad.append(f"moe_layer_interval={interval}, moe_k={k}, moe_num_experts={e}")
        return {}
    start, end = int(g["moe_layer_start_index"]), int(g["moe_layer_end_index"])
    blocks = moe_blocks(layers, max(start, 0), end, interval)
    if not blocks:
        bad.append(f"moe_layer_start_index={start}, moe_layer_end_index={end}, moe_layer_interval={interval}: no "
                   f"block of {layers} has experts")
        return {}
    cap = g["moe_capacity"] or [0]
    if cap[0] < e:
        notes.append(f"moe_capacity={cap}: PaddleFormers' training capacity ({cap[0]} x T / {e} per expert) can drop "
                     "tokens; read dropless (every choice computed)")
    n = len(blocks)
    aux, z = float(g["router_aux_loss_coef"] or 0.0), float(g["router_z_loss_coef"] or 0.0)
    notes.append(f"balancing: router_aux_loss_coef={aux} and router_z_loss_coef={z} per MoE block, summed over the "
                 f"{n} blocks -> moe_aux_loss_coef={aux * n:g}, moe_z_loss_coef={z * n:g} (ours average over blocks)")
    if g["moe_orthogonal_loss_lambda"]:
        notes.append(f"moe_orthogonal_loss_lambda={g['moe_orthogonal_loss_lambda']}: ERNIE's router orthogonal loss "
                     "is not implemented; training runs without it")
    if g["moe_use_aux_free"]:
        notes.append("moe_use_aux_free: e_score_correction_bias chooses experts as read (moe_bias_update_rate=0)")
    width = int(g["moe_intermediate_size"] or g["intermediate_size"])
    return dict(moe_num_experts=e, moe_top_k=k, moe_ffn_hidden_size=width,
                moe_num_shared_experts=int(g["moe_num_shared_experts"] or 0), moe_first_dense_layers=max(start, 0),
                moe_last_layer=None if end < 0 or end >= layers - 1 else end, moe_layer_interval=interval,
                moe_router="softmax", moe_norm_topk=bool(g["moe_norm_gate_logits"]), moe_routed_scale=1.0,
                moe_aux_loss_coef=aux * n, moe_aux_loss_scope="layer", moe_z_loss_coef=z * n, moe_aux_counts="unbiased",
                moe_bias_update_rate=0.0, moe_capacity_factor=0.0)


def config_from_hf(c: dict, family: str, name: str, source: str) -> tuple[ModelConfig, list[str]]:
    """ModelConfig computing what PaddleFormers' `family` (ernie4_5 / ernie4_5_moe) computes for config.json `c`."""
    from llmtrain.interop.hf_rope import rope_params

    g = {k: c.get(k, v) for k, v in DEFAULTS[family].items()}
    notes = [f"{k} absent from config.json: PaddleFormers' default {v!r} used" for k, v in DEFAULTS[family].items()
             if k not in c and k not in _QUIET]
    bad = []
    if g["hidden_act"] not in ("silu", "swiglu"):
        bad.append(f"hidden_act={g['hidden_act']!r} (SwiGLU with silu only)")
    if g["use_bias"]:
        bad.append("use_bias=true (a bias on every linear and every RMSNorm is not expressible here)")
    theta, scaling = rope_params(c, g)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        bad.append(f"rope scaling {scaling!r} (ERNIE 4.5 is read with plain RoPE only)")
    h, heads = int(g["hidden_size"]), int(g["num_attention_heads"])
    kv = int(g["num_key_value_heads"] or heads)
    if heads % kv:
        bad.append(f"num_attention_heads={heads} not divisible by num_key_value_heads={kv}")
    head_dim = g["head_dim"]
    if head_dim is None and h % heads:
        bad.append(f"hidden_size={h} not divisible by num_attention_heads={heads} (and no head_dim)")
    layers = int(g["num_hidden_layers"])
    moe = _moe_fields(g, layers, bad, notes) if family == "ernie4_5_moe" else {}
    if bad:
        raise UnsupportedConfig(f"{source}: {ARCHITECTURES[family]} config not supported: " + "; ".join(bad))
    if family == "ernie4_5_moe" and g["num_nextn_predict_layers"]:
        notes.append(f"num_nextn_predict_layers={g['num_nextn_predict_layers']}: the multi-token prediction block is "
                     "skipped (llmtrain has no MTP; an export writes 0)")
    cfg = ModelConfig(
        name=name, hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=None if kv == heads else kv,
        head_dim=None if head_dim in (None, h // heads) else int(head_dim), ffn_hidden_size=int(g["intermediate_size"]),
        vocab_size=int(g["vocab_size"]), max_position_embeddings=int(g["max_position_embeddings"]), position="rope",
        rope_theta=theta, norm="rmsnorm", norm_eps=float(g["rms_norm_eps"]), activation="swiglu", bias=False,
        tie_embeddings=bool(g["tie_word_embeddings"]), init_std=float(g["initializer_range"]), **moe)
    return cfg, notes


def family_of(cfg: ModelConfig) -> str:
    """The ERNIE 4.5 model type `cfg` is written as: MoE -> ernie4_5_moe, else ernie4_5."""
    return "ernie4_5_moe" if cfg.moe_num_experts else "ernie4_5"


def _moe_layers(cfg: ModelConfig) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def config_to_hf(cfg: ModelConfig, layout: str = "huggingface") -> dict:
    """config.json (PaddleFormers' / the -PT releases' field names) of the ERNIE 4.5 model computing what `cfg`
    computes; layout `paddleformers` adds `paddleformers_version` and `rope_parameters` as its save_pretrained does."""
    from llmtrain.interop.keys import attention_variant_mismatches, switch_mismatches

    family = family_of(cfg)
    arch = ARCHITECTURES[family]
    e = cfg.moe_num_experts
    wants = (("position", "rope"), ("norm", "rmsnorm"), ("activation", "swiglu"), ("norm_position", "pre"),
             ("bias", False)) + ((("moe_router", "softmax"), ("moe_routed_scale", 1.0), ("moe_capacity_factor", 0.0),
                                  ("moe_n_group", 1), ("moe_aux_loss_scope", "layer")) if e else ())
    bad = switch_mismatches(cfg, "decoder", arch, family, wants)
    if cfg.has_qkv_bias():
        bad.append(f"model.qkv_bias={cfg.qkv_bias} (ERNIE 4.5 has no biases)")
    bad += [b for b in attention_variant_mismatches(cfg, family) if not b.startswith("model.head_dim")]
    if e:
        if cfg.moe_aux_loss_coef and cfg.moe_aux_counts != "unbiased":
            bad.append("model.moe_aux_counts=chosen with a non-zero moe_aux_loss_coef (ERNIE counts the choices made "
                       "without the correction bias: moe_aux_counts=unbiased)")
    if bad:
        raise UnsupportedConfig(f"model {cfg.name!r} cannot be written as {arch}: " + "; ".join(bad))
    out = dict(architectures=[arch], model_type=family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
               intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads(), head_dim=cfg.attn_head_dim(),
               hidden_act="silu", max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
               rope_theta=cfg.rope_theta, use_bias=False, tie_word_embeddings=cfg.tie_embeddings,
               initializer_range=cfg.init_std, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False,
               torch_dtype="float32")
    if e:
        n = _moe_layers(cfg)
        out.update(moe_num_experts=e, moe_k=cfg.moe_top_k, moe_intermediate_size=cfg.expert_ffn_size(),
                   moe_num_shared_experts=cfg.moe_num_shared_experts,
                   moe_layer_start_index=cfg.moe_first_dense_layers,
                   moe_layer_end_index=cfg.num_layers - 1 if cfg.moe_last_layer is None else cfg.moe_last_layer,
                   moe_layer_interval=cfg.moe_layer_interval, moe_capacity=[e, e, e], moe_gate="topk",
                   moe_norm_gate_logits=bool(cfg.moe_norm_topk), moe_use_aux_free=True, scoring_func="softmax",
                   router_aux_loss_coef=cfg.moe_aux_loss_coef / n, router_z_loss_coef=cfg.moe_z_loss_coef / n,
                   moe_orthogonal_loss_lambda=0.0, num_nextn_predict_layers=0)
    if layout == "paddleformers":
        out.update(paddleformers_version=FORMAT_VERSION, fuse_rms_norm=False,
                   rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"})
    return out


def rotary_rows(rows_per_head: int, heads: int) -> np.ndarray:
    """Row order reading each head's interleaved rotary rows evens-then-odds: ours[i] = theirs[order[i]]."""
    perm = np.concatenate([np.arange(0, rows_per_head, 2), np.arange(1, rows_per_head, 2)])
    return (np.arange(heads)[:, None] * rows_per_head + perm[None]).reshape(-1)


def _layer_names(cfg: ModelConfig, i: int) -> list[tuple[str, str, bool]]:
    """(our name inside `layers.i.`, theirs inside `model.layers.i.`, is a linear [out, in]) of block i."""
    names = [("attn_norm.weight", "input_layernorm.weight", False),
             ("mlp_norm.weight", "post_attention_layernorm.weight", False)]
    names += [(f"attn.{n}_proj.weight", f"self_attn.{n}_proj.weight", True) for n in "qkvo"]
    return names + ffn_names(cfg, i)


def _rows(cfg: ModelConfig) -> dict:
    """{ERNIE attention linear: row order} for q_proj and k_proj (interleaved rotary rows per head)."""
    d = cfg.attn_head_dim()
    return {"self_attn.q_proj.weight": rotary_rows(d, cfg.num_heads),
            "self_attn.k_proj.weight": rotary_rows(d, cfg.kv_heads())}


def to_canonical(src: SourceTensors, cfg: ModelConfig, config: Optional[dict] = None) -> tuple[dict, list[str]]:
    """Our canonical state (lazy) from ERNIE 4.5 tensors, and notes; the MTP block is skipped."""
    from llmtrain.interop.deepseek import _Mapped
    from llmtrain.interop.tensor_files import StackedTransposed
    from llmtrain.interop.keys import model_shapes

    shapes, notes, state, rows = model_shapes(cfg), [], {}, _rows(cfg)

    def put(canon, key, linear, order=None):
        want = shapes[canon]
        arr = src.take(key, list(reversed(want)) if linear else want)
        if arr is not None:
            state[canon] = _Mapped(arr, order, linear) if linear else arr

    put("embed.word.weight", "model.embed_tokens.weight", False)
    for i in range(cfg.num_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        for ours, theirs, linear in _layer_names(cfg, i):
            put(c + ours, p + theirs, linear, rows.get(theirs))
        if cfg.is_moe_layer(i):
            e = cfg.moe_num_experts
            bias = src.take(p + "mlp.moe_statics.e_score_correction_bias", [1, e])
            use = (config or {}).get("moe_use_aux_free", True)
            state[c + "mlp.expert_bias"] = (np.asarray(bias, np.float32).reshape(e) if bias is not None and use
                                            else np.zeros([e], np.float32))
            for ours, theirs in EXPERT_LINEARS:
                shape = list(reversed(shapes[f"{c}mlp.experts.{ours}"][1:]))  # one expert's [out, in]
                parts = [src.take(f"{p}mlp.experts.{j}.{theirs}.weight", shape) for j in range(e)]
                if all(x is not None for x in parts):
                    state[f"{c}mlp.experts.{ours}"] = StackedTransposed(parts)
    take_norm_and_head(src, cfg, put)
    mtp = sorted(k for k in src.tensors if k.startswith("model.mtp_"))
    for key in mtp:
        src.ignore(key, "multi-token prediction block (num_nextn_predict_layers): not implemented, skipped")
    if mtp:
        notes.append(f"multi-token prediction tensors model.mtp_* ({len(mtp)}) skipped")
    return state, notes


def from_canonical(state: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """ERNIE 4.5 tensors ([out, in] linears, q/k rotary rows interleaved again) from our canonical state."""

    back = {k: np.argsort(v) for k, v in _rows(cfg).items()}  # theirs = ours[argsort(order)]
    out = {"model.embed_tokens.weight": np.asarray(state["embed.word.weight"], np.float32)}
    for i in range(cfg.num_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        for ours, theirs, linear in _layer_names(cfg, i):
            arr = np.asarray(state[c + ours], dtype=np.float32)
            arr = arr.T if linear else arr
            out[p + theirs] = np.ascontiguousarray(arr[back[theirs]] if theirs in back else arr)
        if not cfg.is_moe_layer(i):
            continue
        out[p + "mlp.moe_statics.e_score_correction_bias"] = np.asarray(
            state[c + "mlp.expert_bias"], np.float32).reshape(1, -1)
        for ours, theirs in EXPERT_LINEARS:
            stacked = np.asarray(state[f"{c}mlp.experts.{ours}"], dtype=np.float32)
            for j in range(cfg.moe_num_experts):
                out[f"{p}mlp.experts.{j}.{theirs}.weight"] = np.ascontiguousarray(stacked[j].T)
    out["model.norm.weight"] = np.asarray(state["final_norm.norm.weight"], np.float32)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(state["lm_head.proj.weight"], np.float32).T)
    return out

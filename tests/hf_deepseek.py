"""Tiny Hugging Face-layout DeepSeek-V2 / V3 checkpoints built here, and a numpy forward of the published architecture.

    from hf_deepseek import make_deepseek_checkpoint, deepseek_logits
    make_deepseek_checkpoint(dir, "deepseek_v3", seed=0, vocab_size=96)   # config.json + 2 shards + index
    deepseek_logits(dir, ids)                                             # float64 logits [b, s, V]

Written from DeepSeek's own published code (the `modeling_deepseek.py` shipped beside the DeepSeek-V2-Lite and
DeepSeek-V3 weights, `inference/model.py` of the DeepSeek-V3 repository) and `transformers`'
`modeling_deepseek_v3.py`, independently of `llmtrain.models.mla` and `llmtrain.interop.deepseek`:
  - linear weights [out, in]; RMSNorm x / sqrt(mean(x^2) + eps) * w (the q_a/kv_a norms: eps 1e-6, the class
    default, as DeepSeek's code passes none);
  - attention (MLA): q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x) when q_lora_rank is null),
    [c_kv, k_rot] = kv_a_proj_with_mqa(x), [k_nope, v] = kv_b_proj(kv_a_layernorm(c_kv)); the rotary parts are
    de-interleaved (view(d/2, 2).transpose) and rotated rotate-half; the key's rotary part is shared by all heads;
    softmax scale (qk_nope + qk_rope)^-0.5 x yarn_get_mscale(factor, mscale_all_dim)^2 under YaRN;
  - YaRN (`rope_scaling.type` yarn): DeepSeek's correction range (floor/ceil of the correction dims of beta_fast
    and beta_slow over original_max_position_embeddings), linear ramp over d/2, inv_freq = inter (1 - mask) +
    extra mask with mask = 1 - ramp, cos/sin x yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor,
    mscale_all_dim);
  - MoE for layers >= first_k_dense_replace: gate [E, h] in fp32; V3 (`noaux_tc`): sigmoid scores, choice on
    scores + e_score_correction_bias, groups ranked by the sum of their two best, experts outside the topk_group
    best groups never chosen (DeepSeek's inference code fills them with -inf), weights the unbiased scores,
    renormalised when top_k > 1 and norm_topk_prob, then x routed_scaling_factor; V2 (`greedy` /
    `group_limited_greedy`): softmax scores, groups ranked by their best score, weights renormalised when
    top_k > 1 and norm_topk_prob, else x routed_scaling_factor; shared experts of width n_shared x
    moe_intermediate_size added; each expert SwiGLU down(silu(gate(x)) * up(x)).
"""
from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

PUBLISHED_KEYS = {
    "deepseek_v3": [  # deepseek-ai/DeepSeek-V3 config.json (quantization_config and auto_map left out here)
        "architectures", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "ep_size",
        "first_k_dense_replace", "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
        "kv_lora_rank", "max_position_embeddings", "model_type", "moe_intermediate_size", "moe_layer_freq",
        "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob", "num_attention_heads",
        "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "num_nextn_predict_layers",
        "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_scaling", "rope_theta",
        "routed_scaling_factor", "scoring_func", "tie_word_embeddings", "topk_group", "topk_method",
        "torch_dtype", "transformers_version", "use_cache", "v_head_dim", "vocab_size"],
    "deepseek_v2": [  # deepseek-ai/DeepSeek-V2-Lite(-Chat) config.json as transformers loads it (auto_map left out)
        "architectures", "attention_bias", "attention_dropout", "aux_loss_alpha", "bos_token_id", "eos_token_id",
        "ep_size", "first_k_dense_replace", "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
        "kv_lora_rank", "max_position_embeddings", "model_type", "moe_intermediate_size", "moe_layer_freq",
        "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob", "num_attention_heads",
        "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "pretraining_tp", "q_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_scaling", "rope_theta",
        "routed_scaling_factor", "scoring_func", "seq_aux", "tie_word_embeddings", "topk_group", "topk_method",
        "torch_dtype", "transformers_version", "use_cache", "v_head_dim", "vocab_size"],
}
"""The fields of the published config.json files, which the tiny configs here carry (and only those)."""

YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 1.0, "mscale_all_dim": 0.5,
        "original_max_position_embeddings": 16, "type": "yarn"}
"""A tiny YaRN: positions past 16 are extrapolated; mscale != mscale_all_dim scales cos/sin as well as the softmax."""


def deepseek_config(model_type: str, **kw) -> dict:
    """A tiny config.json with the published fields: DeepSeek-V3-shaped (q compression, sigmoid router with bias,
    8 experts in 4 groups of which 2 are searched, top-2 renormalised x 2.5, one shared expert, first layer dense)
    or DeepSeek-V2-Lite-shaped (no q compression, softmax top-2 greedy, not renormalised, 2 shared experts)."""
    c = dict(attention_bias=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=1, first_k_dense_replace=1,
             hidden_act="silu", hidden_size=32, initializer_range=0.02, intermediate_size=64, kv_lora_rank=16,
             max_position_embeddings=64, model_type=model_type, moe_intermediate_size=16, moe_layer_freq=1,
             num_attention_heads=4, num_hidden_layers=3, num_key_value_heads=4, qk_nope_head_dim=8,
             qk_rope_head_dim=8, rms_norm_eps=1e-6, rope_scaling=dict(YARN), rope_theta=10000,
             tie_word_embeddings=False, torch_dtype="float32", transformers_version="4.46.3", use_cache=True,
             v_head_dim=6, vocab_size=96, ep_size=1)
    if model_type == "deepseek_v3":
        c.update(architectures=["DeepseekV3ForCausalLM"], n_group=4, n_routed_experts=8,
                 n_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=2, num_nextn_predict_layers=0,
                 q_lora_rank=12, routed_scaling_factor=2.5, scoring_func="sigmoid", topk_group=2,
                 topk_method="noaux_tc")
    else:
        c.update(architectures=["DeepseekV2ForCausalLM"], aux_loss_alpha=0.001, n_group=1, n_routed_experts=8,
                 n_shared_experts=2, norm_topk_prob=False, num_experts_per_tok=2, pretraining_tp=1, q_lora_rank=None,
                 routed_scaling_factor=1.0, scoring_func="softmax", seq_aux=True, topk_group=1, topk_method="greedy")
    c.update(kw)
    return c


def deepseek_shapes(c: dict, mtp: bool = True) -> dict[str, list[int]]:
    """HF tensor name -> shape of a DeepSeek-V2/V3 checkpoint (with `num_nextn_predict_layers` MTP modules)."""
    h, v, nh = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    e, fe = c["n_routed_experts"], c["moe_intermediate_size"]
    out = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    if not c["tie_word_embeddings"]:  # tied: transformers writes no lm_head.weight
        out["lm_head.weight"] = [v, h]

    def layer(i):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = [h]
        out[p + "post_attention_layernorm.weight"] = [h]
        if c["q_lora_rank"]:
            out[p + "self_attn.q_a_proj.weight"] = [c["q_lora_rank"], h]
            out[p + "self_attn.q_a_layernorm.weight"] = [c["q_lora_rank"]]
            out[p + "self_attn.q_b_proj.weight"] = [nh * qk, c["q_lora_rank"]]
        else:
            out[p + "self_attn.q_proj.weight"] = [nh * qk, h]
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = [c["kv_lora_rank"] + c["qk_rope_head_dim"], h]
        out[p + "self_attn.kv_a_layernorm.weight"] = [c["kv_lora_rank"]]
        out[p + "self_attn.kv_b_proj.weight"] = [nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]]
        out[p + "self_attn.o_proj.weight"] = [h, nh * c["v_head_dim"]]
        if c.get("attention_bias"):
            for n, rows in (("q_a_proj" if c["q_lora_rank"] else None, c["q_lora_rank"]),
                            ("kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"]), ("o_proj", h)):
                if n:
                    out[f"{p}self_attn.{n}.bias"] = [rows]
        if i < c["first_k_dense_replace"]:
            f = c["intermediate_size"]
            out.update({p + "mlp.gate_proj.weight": [f, h], p + "mlp.up_proj.weight": [f, h],
                        p + "mlp.down_proj.weight": [h, f]})
            return
        out[p + "mlp.gate.weight"] = [e, h]
        if c["model_type"] == "deepseek_v3":
            out[p + "mlp.gate.e_score_correction_bias"] = [e]
        for j in range(e):
            q = f"{p}mlp.experts.{j}."
            out.update({q + "gate_proj.weight": [fe, h], q + "up_proj.weight": [fe, h], q + "down_proj.weight": [h, fe]})
        fs = fe * c["n_shared_experts"]
        q = p + "mlp.shared_experts."
        out.update({q + "gate_proj.weight": [fs, h], q + "up_proj.weight": [fs, h], q + "down_proj.weight": [h, fs]})

    n = c["num_hidden_layers"]
    for i in range(n):
        layer(i)
    for i in range(n, n + (c.get("num_nextn_predict_layers") or 0) if mtp else n):  # V3's multi-token prediction
        layer(i)
        p = f"model.layers.{i}."
        out.update({p + "enorm.weight": [h], p + "hnorm.weight": [h], p + "eh_proj.weight": [h, 2 * h],
                    p + "shared_head.norm.weight": [h], p + "shared_head.head.weight": [v, h],
                    p + "embed_tokens.weight": [v, h]})
    return out


FP8_MODULES = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
               "up_proj", "down_proj")
"""The linears DeepSeek-V3's FP8 release stores as float8 e4m3 with a weight_scale_inv per block (not the
embedding, the head, the norms or the router)."""


def fp8_decode(bits: np.ndarray) -> np.ndarray:
    """float64 values of float8 e4m3fn bit patterns (uint8): sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    bits = bits.astype(np.int64)
    exp, man = (bits >> 3) & 15, (bits & 7).astype(np.float64)
    mag = np.where(exp == 0, np.ldexp(man, -9), np.ldexp(8.0 + man, exp - 10))  # m/8 2^-6, (1 + m/8) 2^(e-7)
    return np.where(bits & 128, -mag, mag)


def fp8_encode(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 bits [out, in] uint8, weight_scale_inv [ceil(out/r), ceil(in/c)] fp32) with w ~ bits * scale per block:
    each block scaled to the largest finite e4m3 (448), then rounded to the nearest e4m3 value."""
    rows, cols = block
    grid = -(-np.array(w.shape) // np.array(block))
    scale = np.zeros(grid, np.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            scale[i, j] = np.abs(w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]).max() / 448.0
    values = fp8_decode(np.arange(256, dtype=np.uint8))
    finite = np.array([b for b in range(256) if np.isfinite(values[b]) and not (b & 0x7F) == 0x7F])
    order = finite[np.argsort(values[finite])]
    full = np.repeat(np.repeat(scale, rows, 0), cols, 1)[:w.shape[0], :w.shape[1]]
    x = w / full
    pos = np.clip(np.searchsorted(values[order], x), 1, len(order) - 1)
    lo, hi = order[pos - 1], order[pos]
    bits = np.where(np.abs(values[lo] - x) <= np.abs(values[hi] - x), lo, hi).astype(np.uint8)
    return bits, scale


def save_raw(path: str, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file written by hand: {name: (dtype string, array)} (for F8_E4M3, which safetensors.numpy
    cannot write)."""
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def load_deepseek(ckpt_dir) -> tuple[dict, dict]:
    """(config.json dict, {name: float64 array}) of a DeepSeek directory read from the safetensors bytes (F32, or
    F8_E4M3 times its weight_scale_inv blocks); the scales are consumed."""
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        c = json.load(f)
    raw = {}
    for fname in sorted(os.listdir(ckpt_dir)):
        if fname.endswith(".safetensors"):
            with open(os.path.join(ckpt_dir, fname), "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header, data = json.loads(f.read(n)), f.read()
            for name, info in header.items():
                if name != "__metadata__":
                    a, b = info["data_offsets"]
                    kind = {"F32": np.float32, "F8_E4M3": np.uint8}[info["dtype"]]
                    arr = np.frombuffer(data[a:b], dtype=kind).reshape(info["shape"])
                    raw[name] = fp8_decode(arr) if info["dtype"] == "F8_E4M3" else arr.astype(np.float64)
    t = {k: v for k, v in raw.items() if not k.endswith("_scale_inv")}
    block = (c.get("quantization_config") or {}).get("weight_block_size", [128, 128])
    for name in t:
        if name + "_scale_inv" in raw:
            scale = np.repeat(np.repeat(raw[name + "_scale_inv"], block[0], 0), block[1], 1)
            t[name] = t[name] * scale[:t[name].shape[0], :t[name].shape[1]]
    return c, t


def make_deepseek_checkpoint(out_dir, model_type: str, seed: int = 0, shards: int = 2, fp8_block=None, **kw) -> dict:
    """Write a random tiny DeepSeek checkpoint as `save_pretrained` lays it out (norms near 1, a non-zero V3
    correction bias); `fp8_block` (rows, cols): the FP8 form of DeepSeek-V3's release (`FP8_MODULES` as float8 e4m3
    with weight_scale_inv, quantization_config in config.json)."""
    c = deepseek_config(model_type, **kw)
    if fp8_block:
        c["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": list(fp8_block)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in deepseek_shapes(c).items():
        if name.endswith("norm.weight"):
            tensors[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        else:
            scale = 0.5 if "embed" in name else 0.3 if name.endswith("gate.weight") else 0.15
            tensors[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    stored = {}
    for name, arr in tensors.items():
        if fp8_block and name.split(".")[-2] in FP8_MODULES:
            bits, scale = fp8_encode(arr, fp8_block)
            stored[name], stored[name + "_scale_inv"] = ("F8_E4M3", bits), ("F32", scale)
        else:
            stored[name] = ("F32", arr)
    os.makedirs(out_dir, exist_ok=True)
    names = sorted(stored)
    weight_map = {}
    for j, idx in enumerate(np.array_split(np.arange(len(names)), shards)):
        fname = f"model-{j + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        save_raw(os.path.join(out_dir, fname), {names[k]: stored[names[k]] for k in idx})
        weight_map.update({names[k]: fname for k in idx})
    if shards > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(a.nbytes for _, a in stored.values())}, "weight_map": weight_map}, f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    return c


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rotary_tables(c: dict, positions: np.ndarray):
    """cos, sin [s, d] (float64) of DeepSeek's rotary embedding (YaRN when rope_scaling says so)."""
    d, base = c["qk_rope_head_dim"], float(c["rope_theta"])
    extra = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    rs, attention = c.get("rope_scaling"), 1.0
    if rs:
        assert rs.get("type", rs.get("rope_type")) == "yarn", rs
        factor, orig = float(rs["factor"]), rs["original_max_position_embeddings"]

        def corr(rot):
            return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(rs.get("beta_fast", 32))), 0)
        high = min(math.ceil(corr(rs.get("beta_slow", 1))), d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        mask = 1.0 - ramp
        extra = extra / factor * (1 - mask) + extra * mask
        attention = yarn_get_mscale(factor, rs.get("mscale", 1)) / yarn_get_mscale(factor, rs.get("mscale_all_dim", 0))
    freqs = np.outer(positions.astype(np.float64), extra)  # [s, d/2]
    emb = np.concatenate([freqs, freqs], -1)
    return np.cos(emb) * attention, np.sin(emb) * attention


def softmax_scale(c: dict) -> float:
    scale = (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]) ** -0.5
    rs = c.get("rope_scaling")
    if rs and rs.get("mscale_all_dim"):
        m = yarn_get_mscale(float(rs["factor"]), rs["mscale_all_dim"])
        scale *= m * m
    return scale


def route(c: dict, logits: np.ndarray, bias) -> tuple[np.ndarray, np.ndarray]:
    """(index [T, k], weight [T, k]) of DeepSeek's gate for router logits [T, E]."""
    k, e, g = c["num_experts_per_tok"], c["n_routed_experts"], c["n_group"]
    if c["scoring_func"] == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    choose = scores + (bias[None] if bias is not None else 0.0)
    method = c["topk_method"]
    if method in ("noaux_tc", "group_limited_greedy"):
        grouped = choose.reshape(len(choose), g, e // g)
        rank = np.sort(grouped, -1)[..., -2:].sum(-1) if method == "noaux_tc" else grouped.max(-1)  # [T, G]
        best = np.argsort(-rank, -1, kind="stable")[:, :c["topk_group"]]
        keep = np.zeros_like(rank, dtype=bool)
        np.put_along_axis(keep, best, True, -1)
        choose = np.where(np.repeat(keep, e // g, -1), choose, -np.inf)
    index = np.argsort(-choose, -1, kind="stable")[:, :k]
    weight = np.take_along_axis(scores, index, -1)
    normed = k > 1 and c["norm_topk_prob"]
    if normed:
        weight = weight / (weight.sum(-1, keepdims=True) + 1e-20)
    if c["model_type"] == "deepseek_v3" or not normed:
        weight = weight * c["routed_scaling_factor"]
    return index, weight


def _rms(x, w, eps):
    """RMSNorm over the last axis (float64)."""
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w


def _linear(t: dict, x, name: str):
    """x W^T (+ b) of the HF linear `name` in the tensors `t`."""
    out = x @ t[name + ".weight"].T
    return out + t[name + ".bias"] if name + ".bias" in t else out


def _silu(x):
    return x / (1.0 + np.exp(-x))


def deepseek_logits(ckpt_dir, ids: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
    """Logits [b, s, V] (float64) of the DeepSeek-V2/V3 checkpoint in `ckpt_dir` for token ids [b, s] at
    positions 0..s-1 (or `positions` [s])."""
    c, t = load_deepseek(ckpt_dir)
    h, nh, eps = c["hidden_size"], c["num_attention_heads"], c["rms_norm_eps"]
    nope, rope, dv, r = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    b, s = ids.shape

    def rms(x, w, e=eps):
        return _rms(x, w, e)

    def linear(x, name):
        return _linear(t, x, name)

    def swiglu(x, p):
        return linear(_silu(linear(x, p + "gate_proj")) * linear(x, p + "up_proj"), p + "down_proj")

    cos, sin = rotary_tables(c, np.arange(s) if positions is None else positions)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # [1, s, 1, d]

    def rotate(x):  # [b, s, n, d], interleaved pairs -> de-interleaved, then rotate-half
        x = x.reshape(*x.shape[:-1], rope // 2, 2).swapaxes(-1, -2).reshape(x.shape)
        return x * cos + np.concatenate([-x[..., rope // 2:], x[..., :rope // 2]], -1) * sin

    causal = np.triu(np.full((s, s), -np.inf), 1)
    scale = softmax_scale(c)
    x = t["model.embed_tokens.weight"][ids]  # [b, s, h]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = rms(x, t[p + "input_layernorm.weight"])
        a = p + "self_attn."
        if c["q_lora_rank"]:
            q = linear(rms(linear(y, a + "q_a_proj"), t[a + "q_a_layernorm.weight"], 1e-6), a + "q_b_proj")
        else:
            q = linear(y, a + "q_proj")
        q = q.reshape(b, s, nh, nope + rope)
        ckv = linear(y, a + "kv_a_proj_with_mqa")
        kv = linear(rms(ckv[..., :r], t[a + "kv_a_layernorm.weight"], 1e-6), a + "kv_b_proj").reshape(b, s, nh, -1)
        k_rot = rotate(ckv[..., r:].reshape(b, s, 1, rope))
        q = np.concatenate([q[..., :nope], rotate(q[..., nope:])], -1)
        k = np.concatenate([kv[..., :nope], np.broadcast_to(k_rot, (b, s, nh, rope))], -1)
        v = kv[..., nope:]
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + linear(np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nh * dv), a + "o_proj")
        y = rms(x, t[p + "post_attention_layernorm.weight"])
        if i < c["first_k_dense_replace"]:
            x = x + swiglu(y, p + "mlp.")
            continue
        flat = y.reshape(b * s, h)
        index, weight = route(c, flat @ t[p + "mlp.gate.weight"].T, t.get(p + "mlp.gate.e_score_correction_bias"))
        out = np.zeros_like(flat)
        for tok in range(b * s):
            for slot in range(index.shape[1]):
                out[tok] += weight[tok, slot] * swiglu(flat[tok], f"{p}mlp.experts.{index[tok, slot]}.")
        x = x + (out + swiglu(flat, p + "mlp.shared_experts.")).reshape(b, s, h)
    head = t["model.embed_tokens.weight"] if c["tie_word_embeddings"] else t["lm_head.weight"]
    return rms(x, t["model.norm.weight"]) @ head.T

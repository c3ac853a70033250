"""Building blocks of the decoder and encoder: norms, rotary embedding, attention, feed-forward.

    python -m pytest tests/models -q

Single-device code: every linear layer comes from the `Roles` factory
(`llmtrain/models/roles.py`) the plan passes in. A plan may hand out layers
that hold only part of the heads or of the FFN width (comments write such a
width as `nh/tp`, `f/tp`); the code never asks how many parts there are, it
takes the local head count from the tensor (`reshape([0, 0, -1, head_dim])`).

The `model.fuse_*` switches (`ModelConfig.fused`) select Paddle's fused kernels
(`llmtrain/paddle_compat/kernels.py`) or fused projections (`Roles.column_linears`);
each has the unfused path beside it as its reference, and parameters keep the same
canonical names either way.
"""
from __future__ import annotations

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from llmtrain.contracts import tags
from llmtrain.models.config import ModelConfig
from llmtrain.models.recompute import checkpointed
from llmtrain.models.roles import Roles
from llmtrain.paddle_compat import flash_attn, kernels


class RMSNorm(nn.Layer):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32 (Llama)."""

    def __init__(self, hidden_size: int, eps: float, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x):  # x [b, s, h]
        if self.fused:
            return kernels.fused_rms_norm(x, self.weight, self.eps)  # [b, s, h]
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x, weight, eps: float):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, in fp32: x [..., n], weight [n]."""
    x32 = x.astype("float32")
    var = x32.pow(2).mean(-1, keepdim=True)  # [..., 1]
    return (x32 * paddle.rsqrt(var + eps)).astype(weight.dtype) * weight


class HeadNorm(nn.Layer):
    """QK-norm (Qwen3): RMSNorm over each head of x [b, s, heads, d] with one weight [d] shared by the heads.

    Under a plan that splits the heads a rank sees only its heads, so the weight's gradient is a partial sum:
    `roles.head_shared` sums it over the split (a tensor-parallel all-reduce in backward)."""

    def __init__(self, head_dim: int, eps: float, roles: Roles):
        super().__init__()
        self.eps = eps
        self.roles = roles
        self.weight = self.create_parameter([head_dim], default_initializer=nn.initializer.Constant(1.0))
        tags.set_init(self.weight, "ones")

    def forward(self, x):  # x [b, s, heads, d]
        return rms_norm(x, self.roles.head_shared(self.weight), self.eps)


def build_norm(cfg: ModelConfig, hidden_size: int) -> nn.Layer:
    """The configured norm (`layernorm` or `rmsnorm`) over the last axis; its weight starts at 1."""
    if cfg.norm == "layernorm":
        norm = nn.LayerNorm(hidden_size, epsilon=cfg.norm_eps)
    elif cfg.norm == "rmsnorm":
        norm = RMSNorm(hidden_size, cfg.norm_eps, fused=cfg.fused("fuse_rms_norm"))
    else:
        raise ValueError(f"model.norm={cfg.norm!r}: expected 'layernorm' or 'rmsnorm'")
    tags.set_init(norm.weight, "ones")
    return norm


class Rotary:
    """Rotary position embedding, rotate-half form (as PaddleNLP/HF Llama), optionally scaled (`model.rope_scaling`).

    One entry point, `apply_qk(q, k, positions)`: positions None means 0..s-1; otherwise any absolute positions
    [b, s] (packed sequences restarting per example, a context-parallel rank's chunks of a longer sequence,
    decoding past a prefix). The cos/sin table covers `max_positions` (and grows when a position goes past it).
    Scaled RoPE changes the frequencies (`inv_freq`) and, for YaRN, multiplies cos and sin by its attention
    factor; both reach the fused kernel through the same table. Dynamic NTK depends on the forward's length n
    (s, or the largest position + 1: one host read when positions are given)."""

    def __init__(self, head_dim: int, theta: float, fused: bool = False, max_positions: int = 0, scaling=None):
        self.head_dim = head_dim
        self.theta = theta
        self.fused = fused
        self.max_positions = max_positions
        self.scaling = scaling if scaling is not None and scaling.type != "none" else None
        self._cache: dict = {}

    def inv_freq(self, length: int | None = None):
        """[d/2] fp32 inverse frequencies: theta^(-2i/d), or their scaled form (`llmtrain.models.rope`);
        `length`: the forward's length (dynamic NTK only)."""
        if self.scaling is None:
            return 1.0 / (self.theta ** (paddle.arange(0, self.head_dim, 2, dtype="float32") / self.head_dim))
        from llmtrain.models.rope import rope_frequencies

        freq, _ = rope_frequencies(self.head_dim, self.theta, self.scaling, self.max_positions, length)
        return paddle.to_tensor(freq.astype("float32"))

    def attention_factor(self) -> float:
        """The factor on cos and sin (YaRN's; 1 otherwise)."""
        if self.scaling is None or self.scaling.type != "yarn":
            return 1.0
        from llmtrain.models.rope import yarn_attention_factor

        return yarn_attention_factor(self.scaling)

    def _length_key(self, length):
        """The part of the cache key the frequencies depend on: the forward's length under dynamic NTK."""
        if self.scaling is None or self.scaling.type != "dynamic":
            return None
        from llmtrain.models.rope import original_length

        return max(int(length), original_length(self.scaling, self.max_positions))

    def cos_sin(self, seq_len: int, dtype, length: int | None = None):
        """cos, sin [1, seq_len, 1, d] of positions 0..seq_len-1 (`length`: the forward's, for dynamic NTK)."""
        n = self._length_key(length if length is not None else seq_len)
        key = (seq_len, str(dtype), n)
        if key not in self._cache:
            t = paddle.arange(seq_len, dtype="float32")
            freqs = paddle.outer(t, self.inv_freq(n))  # [s, d/2]
            emb = paddle.concat([freqs, freqs], axis=-1)  # [s, d]
            scale = self.attention_factor()
            cos, sin = emb.cos(), emb.sin()
            if scale != 1.0:
                cos, sin = cos * scale, sin * scale
            self._cache[key] = (cos.astype(dtype)[None, :, None, :], sin.astype(dtype)[None, :, None, :])  # [1, s, 1, d]
        return self._cache[key]

    def _forward_length(self, positions, seq_len: int):
        """The forward's length n for dynamic NTK (None for every other kind: no host read)."""
        if self._length_key(0) is None:
            return None
        return seq_len if positions is None else int(positions.max()) + 1

    def _table(self, positions, seq_len: int, dtype):
        """cos, sin [b, s, 1, d] at `positions` [b, s] (or [1, s, 1, d] for 0..s-1 when positions is None)."""
        n = self._forward_length(positions, seq_len)
        if positions is None:
            return self.cos_sin(seq_len, dtype, n)
        size = max(self.max_positions, seq_len, n or 0)
        if size <= 0:
            size = int(positions.max()) + 1  # no known bound: one host read
        cos, sin = self.cos_sin(size, dtype, n)  # [1, P, 1, d]
        cos = paddle.gather(cos[0, :, 0], positions.reshape([-1])).reshape([*positions.shape, 1, -1])  # [b, s, 1, d]
        sin = paddle.gather(sin[0, :, 0], positions.reshape([-1])).reshape([*positions.shape, 1, -1])
        return cos, sin

    @staticmethod
    def rotate(x, cos, sin):  # x [b, s, heads, d]; cos/sin broadcastable [., s, 1, d]
        x1, x2 = x.chunk(2, axis=-1)
        return x * cos + paddle.concat([-x2, x1], axis=-1) * sin

    def apply(self, x, positions=None):  # x [b, s, heads, d]; positions [b, s] int64 or None (0..s-1)
        cos, sin = self._table(positions, x.shape[1], x.dtype)
        return self.rotate(x, cos, sin)

    def apply_qk(self, q, k, positions=None):  # q [b, s, nh, d], k [b, s, nkv, d]; positions [b, s] or None
        if self.fused:  # the same (scaled) table, rows picked by the kernel from position_ids
            n = self._forward_length(positions, q.shape[1])
            if positions is None:
                cos, sin = self.cos_sin(q.shape[1], q.dtype, n)
            else:
                size = max(self.max_positions, q.shape[1], n or 0) or int(positions.max()) + 1
                cos, sin = self.cos_sin(size, q.dtype, n)
            return kernels.fused_rope(q, k, cos, sin, positions)  # GPU-ONLY(fused-rope-scaled)
        cos, sin = self._table(positions, q.shape[1], q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


def math_attention(q, k, v, causal: bool = True, mask=None, segments=None, *, window: int = 0):
    """Softmax attention. q [b, s, nh, d], k/v [b, s, nkv, d] -> [b, s, nh, d].

    causal: position t attends to positions <= t. mask: optional additive [b, 1, 1, s]
    (0 keep, large negative drop), for padding in the bidirectional encoder. segments:
    optional [b, s] example ids of packed sequences (non-decreasing along s): a position
    attends only to positions of its own example (block-diagonal), as an explicit mask.
    window (causal only): query t attends to keys t-window+1..t; 0: no window. Within a packed
    example positions are consecutive, so the index distance is the position distance."""
    nh, nkv = q.shape[2], k.shape[2]
    if nkv != nh:  # grouped-query: each kv head serves nh / nkv query heads
        k = paddle.repeat_interleave(k, nh // nkv, axis=2)
        v = paddle.repeat_interleave(v, nh // nkv, axis=2)
    q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))  # [b, nh, s, d]
    s = q.shape[2]
    scores = paddle.matmul(q, k, transpose_y=True).astype("float32") / math.sqrt(q.shape[-1])  # [b, nh, s, s]
    if causal:
        scores = scores + causal_mask(s, window)
    if mask is not None:
        scores = scores + mask.astype("float32")
    if segments is not None:
        same = segments.unsqueeze(-1) == segments.unsqueeze(-2)  # [b, s, s]: query and key in one example
        scores = scores + paddle.where(same, 0.0, float("-inf")).astype("float32").unsqueeze(1)  # [b, 1, s, s]
    probs = F.softmax(scores, axis=-1).astype(v.dtype)
    return paddle.matmul(probs, v).transpose([0, 2, 1, 3])  # [b, s, nh, d]


def causal_mask(s: int, window: int = 0):
    """[s, s] fp32 additive mask: 0 where key j <= query i (and i - j < window when window > 0), -inf elsewhere."""
    mask = paddle.triu(paddle.full([s, s], float("-inf"), dtype="float32"), diagonal=1)
    if window > 0 and window < s:
        mask = mask + paddle.tril(paddle.full([s, s], float("-inf"), dtype="float32"), diagonal=-window)
    return mask


def document_end_rows(segments):
    """[b, s] non-decreasing example ids -> [b, 1, s, 1] int32: for key j, the first query row
    outside its example (flashmask's causal `startend_row_indices`, PaddleNLP's
    `attn_mask_startend_row_indices`)."""
    ends = paddle.searchsorted(segments, segments, right=True)  # [b, s]: end of each position's example
    return ends.astype("int32").unsqueeze(1).unsqueeze(-1)


def window_end_rows(batch: int, s: int, window: int, segments=None):
    """[b, 1, s, 1] int32: for key j, the first query row that must not see it under a causal window (row j + window)
    and, with packed `segments`, outside its example: min(j + window, end of j's example), clipped to s."""
    rows = paddle.clip(paddle.arange(window, s + window, dtype="int32"), max=s).reshape([1, 1, s, 1])
    if segments is None:
        return rows.expand([batch, 1, s, 1])
    return paddle.minimum(document_end_rows(segments), rows)


def flash_attention_gpu(q, k, v, causal: bool = True, mask=None, segments=None, *, window: int = 0):
    """GPU only: Paddle's flash attention (handles GQA natively); with a padding mask,
    Paddle's scaled_dot_product_attention; with packed examples (`segments`) or a causal sliding `window`,
    Paddle's flashmask attention with the first masked row per key (`document_end_rows`, `window_end_rows`)
    (not run on CPU, where `auto` picks the math path; rehearsed on CPU in tests/gpu_paths/). Shapes as
    math_attention."""
    if window and causal and window < q.shape[1]:
        from paddle.nn.functional.flash_attention import flashmask_attention

        rows = window_end_rows(q.shape[0], q.shape[1], window, segments)  # GPU-ONLY(flashmask-window)
        return flashmask_attention(q, k, v, rows, causal=True)  # GPU-ONLY(flashmask-window)
    if segments is not None:
        from paddle.nn.functional.flash_attention import flashmask_attention

        return flashmask_attention(q, k, v, document_end_rows(segments), causal=causal)  # GPU-ONLY(flashmask)
    if mask is None:
        from paddle.nn.functional.flash_attention import flash_attention

        out, _ = flash_attention(q, k, v, causal=causal)  # GPU-ONLY(flash-attention)
        return out
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.astype(q.dtype), is_causal=causal)  # GPU-ONLY(flash-attention)


def auto_attention(q, k, v, causal: bool = True, mask=None, segments=None, *, window: int = 0):
    """Flash attention for fp16/bf16 inputs on GPU (its kernels take no fp32), the math path otherwise; packed
    examples (`segments`) and sliding windows reach flashmask on the flash side."""
    if q.dtype in (paddle.float16, paddle.bfloat16):
        return flash_attention_gpu(q, k, v, causal, mask, segments, window=window)
    return math_attention(q, k, v, causal, mask, segments, window=window)


def choose_attention(kind: str):
    """The attention core for `model.attention`. Every core has one signature:
    core(q [b, s, nh, d], k [b, s, nkv, d], v [b, s, nkv, dv], causal, mask=None, segments=None, *, window=0)
    -> [b, s, nh, dv] (`window`: a causal sliding window of that many keys; the Attention layer passes it only
    when its block has one). `auto` picks flash attention on GPU for fp16/bf16 activations and the math path
    elsewhere."""
    if kind in ("auto", "flash") and kernels.on_gpu():
        flash_attn.choose_flash_version()  # FlashAttention-3 on Hopper where Paddle has it
    if kind == "auto":
        return auto_attention if kernels.on_gpu() else math_attention
    if kind == "flash":
        return flash_attention_gpu
    if kind == "math":
        return math_attention
    raise ValueError(f"model.attention={kind!r}: expected 'auto', 'flash' or 'math'")


class Attention(nn.Layer):
    """Multi-head / grouped-query self-attention: q, k, v column linears (whole heads), o a row linear; heads of
    `head_dim` (independent of hidden / heads); optional QK-norm (`HeadNorm` on q and k before RoPE) and a
    causal sliding window (`cfg.layer_window(index)` for block `index`)."""

    def __init__(self, cfg: ModelConfig, roles: Roles, index: int = 0):
        super().__init__()
        self.causal = cfg.family == "decoder"
        self.head_dim = cfg.attn_head_dim()
        h, d = cfg.hidden_size, self.head_dim
        qkv_bias = cfg.has_qkv_bias()
        self.q_proj = roles.column_linear(h, cfg.num_heads * d, qkv_bias)
        self.k_proj = roles.column_linear(h, cfg.kv_heads() * d, qkv_bias)
        self.v_proj = roles.column_linear(h, cfg.kv_heads() * d, qkv_bias)
        self.o_proj = roles.row_linear(cfg.num_heads * d, h, cfg.bias)
        tags.mark_residual_out(self.o_proj.weight)
        self.q_norm = HeadNorm(d, cfg.norm_eps, roles) if cfg.qk_norm else None
        self.k_norm = HeadNorm(d, cfg.norm_eps, roles) if cfg.qk_norm else None
        self.rotary = (Rotary(d, cfg.rope_theta, fused=cfg.fused("fuse_rope"), max_positions=cfg.max_position_embeddings,
                              scaling=cfg.rope_scaling) if cfg.position == "rope" else None)
        self.window = cfg.layer_window(index) if self.causal else 0
        self.attend = roles.attention_core(choose_attention(cfg.attention))  # a plan may wrap the core (exchanges)
        self.roles = roles
        self.fuse_qkv = cfg.fused("fuse_qkv")
        self.recompute_core = False  # re-run the core in the backward (`train.recompute=core_attn`, models/recompute.py)

    def forward(self, x, mask=None, positions=None, segments=None, cache=None):
        # x [b, s, h]; mask [b, 1, 1, s] additive or None; positions, segments [b, s] (packed sequences) or None;
        # cache: a dict of this layer's keys/values of earlier positions (generation), filled here
        if self.fuse_qkv:  # one matmul of [h, (nh + 2 nkv)/tp * d]
            q, k, v = self.roles.column_linears(x, [self.q_proj, self.k_proj, self.v_proj])
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape([0, 0, -1, self.head_dim])  # [b, s, nh/tp, d]
        k = k.reshape([0, 0, -1, self.head_dim])  # [b, s, nkv/tp, d]
        v = v.reshape([0, 0, -1, self.head_dim])  # [b, s, nkv/tp, d]
        if self.q_norm is not None:  # per-head RMSNorm (Qwen3), before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:  # positions: packed examples, decoding past a prefix, or None (0..s-1)
            q, k = self.rotary.apply_qk(q, k, positions)
        if cache is not None:
            if "k" in cache:  # one new position after a prefix: it attends to every cached key (in its window)
                if q.shape[1] != 1:
                    raise ValueError(f"KV-cache decoding takes one position per call, got {q.shape[1]}")
                k = paddle.concat([cache["k"], k], axis=1)  # [b, t + 1, nkv, d]
                v = paddle.concat([cache["v"], v], axis=1)
                cache["k"], cache["v"] = k, v
                if self.window:  # the last `window` keys
                    k, v = k[:, -self.window:], v[:, -self.window:]
                    mask = None if mask is None else mask[..., -self.window:]
                return self.o_proj(math_attention(q, k, v, False, mask).reshape([0, 0, -1]))
            cache["k"], cache["v"] = k, v  # the prefix (prefill): causal as usual
        extra = {"window": self.window} if self.window else {}  # only windowed blocks pass the keyword
        attend = checkpointed(self.attend) if self.recompute_core and self.training else self.attend
        out = attend(q, k, v, self.causal, mask, segments, **extra)  # [b, s, nh/tp, d]
        return self.o_proj(out.reshape([0, 0, -1]))  # [b, s, nh/tp * d] -> [b, s, h]


class FeedForward(nn.Layer):
    """GeLU MLP (up, down) or SwiGLU (gate, up, down): up/gate column linears, down a row linear."""

    def __init__(self, cfg: ModelConfig, roles: Roles, ffn_hidden_size: int | None = None):
        super().__init__()
        h, f = cfg.hidden_size, ffn_hidden_size or cfg.ffn_hidden_size
        self.kind = cfg.activation
        if self.kind not in ("gelu", "gelu_tanh", "swiglu"):
            raise ValueError(f"model.activation={self.kind!r}: expected 'gelu', 'gelu_tanh' or 'swiglu'")
        if self.kind == "swiglu":
            self.gate_proj = roles.column_linear(h, f, cfg.bias)
        self.up_proj = roles.column_linear(h, f, cfg.bias)
        self.down_proj = roles.row_linear(f, h, cfg.bias)
        tags.mark_residual_out(self.down_proj.weight)
        self.roles = roles
        self.fuse_ffn = cfg.fused("fuse_ffn")
        self.fuse_swiglu = cfg.fused("fuse_swiglu")

    def forward(self, x):  # x [b, s, h]
        if self.kind == "swiglu":
            if self.fuse_ffn:  # one matmul of [h, 2 f/tp]
                gate, up = self.roles.column_linears(x, [self.gate_proj, self.up_proj])
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)  # [b, s, f/tp] each
            inner = kernels.swiglu(gate, up) if self.fuse_swiglu else F.silu(gate) * up  # [b, s, f/tp]
        else:
            inner = F.gelu(self.up_proj(x), approximate=self.kind == "gelu_tanh")  # [b, s, f/tp]
        return self.down_proj(inner)  # [b, s, h]

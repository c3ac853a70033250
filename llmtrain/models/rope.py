"""Rotary frequencies, plain and scaled (`model.rope_scaling`), and the checks of the attention variants' fields.

    python -m pytest tests/models/test_attention_variants.py -q
    inv_freq, factor = rope_frequencies(128, 1e6, cfg.rope_scaling, seq_len=None)   # [d/2] float64, attention factor

The scaled forms, as Hugging Face publishes them (`modeling_rope_utils.py`), with d the rotated width, theta the
base, s = `factor`, L = `original_max_position_embeddings` and f_i = theta^(-2i/d):
- linear: f_i / s (positions divided by s);
- dynamic (NTK-aware): base theta * (s n / L - (s - 1))^(d / (d - 2)) for a forward of length n > L, plain up to
  L. The length n is the forward's (its largest position + 1): Hugging Face keeps the longest length seen and
  resets below L, which is the same for each forward of a training run;
- yarn: wavelengths of fewer than beta_fast rotations over L keep f_i, those above beta_slow rotations use f_i / s,
  a linear ramp between (the correction range in dimensions, floored/ceiled with `truncate`); cos and sin are
  multiplied by the attention factor (explicit, else m(s, mscale) / m(s, mscale_all_dim) with both set, else
  m(s, 1) = 0.1 ln s + 1);
- llama3: wavelength w_i = 2 pi / f_i; w_i > L / low_freq_factor: f_i / s; w_i < L / high_freq_factor: f_i;
  between: (1 - a) f_i / s + a f_i with a = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor).
Computed in float64 (the unscaled form keeps Paddle's fp32 computation in `Rotary.inv_freq`).
"""
from __future__ import annotations

import math

import numpy as np

from llmtrain.models.config import ROPE_SCALINGS, ModelConfig, RopeScaling


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_attention_factor(r: RopeScaling) -> float:
    """The factor YaRN puts on cos and sin (see the module docstring)."""
    if r.attention_factor is not None:
        return float(r.attention_factor)
    if r.mscale and r.mscale_all_dim:
        return _mscale(r.factor, r.mscale) / _mscale(r.factor, r.mscale_all_dim)
    return _mscale(r.factor)


def original_length(r: RopeScaling, max_positions: int) -> int:
    """L: `original_max_position_embeddings`, or the model's max_position_embeddings when it is 0."""
    return r.original_max_position_embeddings or max_positions


def rope_frequencies(head_dim: int, theta: float, r: RopeScaling, max_positions: int,
                     seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """(inverse frequencies [head_dim / 2] float64, attention factor on cos/sin) of RoPE scaled by `r`; `seq_len`:
    the forward's length (dynamic only)."""
    d = head_dim
    exponent = np.arange(0, d, 2, dtype=np.float64) / d
    plain = 1.0 / theta ** exponent
    s, kind = float(r.factor), r.type
    if kind == "none":
        return plain, 1.0
    if kind == "linear":
        return plain / s, 1.0
    L = original_length(r, max_positions)
    if kind == "dynamic":
        n = max(seq_len or L, L)
        base = theta * ((s * n / L) - (s - 1)) ** (d / (d - 2))
        return 1.0 / base ** exponent, 1.0
    if kind == "yarn":
        def dim_of(rotations):  # the dimension whose wavelength makes `rotations` turns over L
            return d * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(r.beta_fast), dim_of(r.beta_slow)
        if r.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # as published: no zero-width ramp
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        keep = 1.0 - ramp  # 1: extrapolate (f_i), 0: interpolate (f_i / s)
        return plain / s * (1.0 - keep) + plain * keep, yarn_attention_factor(r)
    if kind == "llama3":
        wavelen = 2 * math.pi / plain
        lo_w, hi_w = L / r.low_freq_factor, L / r.high_freq_factor
        scaled = np.where(wavelen > lo_w, plain / s, plain)
        a = (L / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        blend = (1 - a) * scaled / s + a * scaled
        middle = ~(wavelen < hi_w) & ~(wavelen > lo_w)
        return np.where(middle, blend, scaled), 1.0
    raise ValueError(f"model.rope_scaling.type={kind!r}: expected one of {', '.join(ROPE_SCALINGS)}")


def attention_problems(m: ModelConfig) -> list[str]:
    """Value checks of head_dim, qk_norm, rope_scaling and sliding windows, one line per problem."""
    problems = []
    if m.head_dim is not None and m.head_dim <= 0:
        problems.append(f"model.head_dim={m.head_dim}: must be > 0 (or null: hidden_size / num_heads)")
    r = m.rope_scaling
    if r.type not in ROPE_SCALINGS:
        problems.append(f"model.rope_scaling.type={r.type!r}: expected one of {', '.join(ROPE_SCALINGS)}")
    elif r.type != "none":
        if m.position != "rope":
            problems.append(f"model.rope_scaling.type={r.type} needs model.position=rope (this model has "
                            f"{m.position})")
        if not r.factor >= 1.0:
            problems.append(f"model.rope_scaling.factor={r.factor}: must be >= 1 (the context extension factor)")
        if r.original_max_position_embeddings < 0:
            problems.append(f"model.rope_scaling.original_max_position_embeddings="
                            f"{r.original_max_position_embeddings}: must be >= 0 (0: model.max_position_embeddings)")
        if r.type == "yarn" and not r.beta_fast > r.beta_slow > 0:
            problems.append(f"model.rope_scaling.beta_fast={r.beta_fast}, beta_slow={r.beta_slow}: need "
                            "beta_fast > beta_slow > 0")
        if r.type == "llama3" and not r.high_freq_factor > r.low_freq_factor > 0:
            problems.append(f"model.rope_scaling.low_freq_factor={r.low_freq_factor}, high_freq_factor="
                            f"{r.high_freq_factor}: need high_freq_factor > low_freq_factor > 0")
    if m.sliding_window < 0:
        problems.append(f"model.sliding_window={m.sliding_window}: must be >= 0 (0: full attention)")
    elif m.sliding_window > 0:
        if m.family != "decoder":
            problems.append(f"model.sliding_window={m.sliding_window} with model.family={m.family}: sliding windows "
                            "are causal (decoder only)")
        layers = m.sliding_window_layers
        bad = [i for i in (layers or []) if not (isinstance(i, int) and 0 <= i < m.num_layers)]
        if bad:
            problems.append(f"model.sliding_window_layers={list(layers)}: {bad} not block indices 0..{m.num_layers - 1}")
    return problems

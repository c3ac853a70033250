"""Bookkeeping for name mapping: which source tensors were used, missing, mis-shaped or unknown.

    src = SourceTensors(tensors, origin, "ckpt/")
    w = src.take("llama.norm.weight", [h])      # None (and recorded) if absent or mis-shaped
    src.check()                                  # raises CheckpointMismatch listing every problem

A family mapping (`gpt.py`, `llama.py`) takes every tensor it understands; what is
left over is *unexpected* and reported with the file it came from — nothing is
dropped silently. Problems are collected, not raised one at a time, so the user
sees the whole list at once.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from llmtrain.models.init import StateMismatch


class CheckpointMismatch(StateMismatch):
    """A PaddleNLP checkpoint does not fit its config (or our model); the message lists every key."""


class UnsupportedConfig(ValueError):
    """A PaddleNLP config (or one of ours) that the other side cannot compute; the message names the field."""


def switch_mismatches(cfg, family: str, architecture: str, short: str, wants: tuple) -> list[str]:
    """Reasons `cfg` cannot be written as `architecture`: a wrong family, or a switch (field, wanted value)
    that PaddleNLP's `short` model does not have."""
    article = "an" if family == "encoder" else "a"
    bad = [] if cfg.family == family else [f"model.family={cfg.family!r} ({architecture} is {article} {family})"]
    for field, want in wants:
        if getattr(cfg, field) != want:
            bad.append(f"model.{field}={getattr(cfg, field)!r} (PaddleNLP's {short} has {want!r})")
    return bad


def attention_variant_mismatches(cfg, short: str) -> list[str]:
    """Reasons a PaddleNLP model (`short`) cannot compute `cfg`'s attention: PaddleNLP 2.8.1's GPT, Llama, Qwen,
    Mixtral and ERNIE have heads of hidden / heads, no QK-norm, plain RoPE, no sliding window and no latent attention."""
    bad = []
    if cfg.head_dim is not None and cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        bad.append(f"model.head_dim={cfg.head_dim} != hidden_size / num_heads (PaddleNLP's {short} has no head_dim)")
    if cfg.qk_norm:
        bad.append(f"model.qk_norm=true (PaddleNLP's {short} has no QK-norm; a Qwen3 goes out with --format hf)")
    if cfg.rope_scaling.type != "none":
        bad.append(f"model.rope_scaling.type={cfg.rope_scaling.type} (not written for PaddleNLP's {short}; "
                   "--format hf writes rope_scaling)")
    if cfg.sliding_window:
        bad.append(f"model.sliding_window={cfg.sliding_window} (PaddleNLP's {short} attends to every position)")
    if cfg.is_mla():
        bad.append(f"model.mla_kv_lora_rank={cfg.mla_kv_lora_rank} (multi-head latent attention; PaddleNLP's {short} "
                   "has none: a DeepSeek goes out with --format hf)")
    return bad


class SourceTensors:
    """The tensors of one checkpoint, keyed by PaddleNLP name, with use tracking."""

    def __init__(self, tensors: dict[str, np.ndarray], origin: dict[str, str], source: str):
        self.tensors = tensors
        self.origin = origin
        self.source = source
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.misshaped: list[str] = []
        self.ignored: dict[str, str] = {}
        self.problems: list[str] = []

    def has(self, key: str) -> bool:
        return key in self.tensors

    def where(self, key: str) -> str:
        return self.origin.get(key, self.source)

    def take(self, key: str, shape: list[int]) -> Optional[np.ndarray]:
        """The tensor `key` if present with `shape`; otherwise None, and the problem is recorded."""
        if key not in self.tensors:
            self.missing.append(key)
            return None
        self.used.add(key)
        arr = self.tensors[key]
        if list(arr.shape) != list(shape):
            self.misshaped.append(f"{key} ({self.where(key)}): has {list(arr.shape)}, config needs {list(shape)}")
            return None
        return arr

    def take_into(self, state: dict, canon: str, key: str, shape: list[int]) -> None:
        """`state[canon]` = the tensor `key` when `take` finds it with `shape` (else the problem is recorded)."""
        arr = self.take(key, shape)
        if arr is not None:
            state[canon] = arr

    def ignore(self, key: str, reason: str) -> None:
        """Mark `key` as understood but not loaded (e.g. a buffer that we recompute), with the reason."""
        self.used.add(key)
        self.ignored[key] = reason

    def problem(self, message: str) -> None:
        """Record a problem that is not a plain missing/mis-shaped key (e.g. an inconsistent tie)."""
        self.problems.append(message)

    def unexpected(self) -> list[str]:
        return sorted(k for k in self.tensors if k not in self.used)

    def check(self) -> None:
        """Raise `CheckpointMismatch` with every missing, mis-shaped, unexpected key and problem."""
        unexpected = self.unexpected()
        if not (self.missing or self.misshaped or unexpected or self.problems):
            return
        lines = [f"PaddleNLP checkpoint {self.source} does not fit its config.json / our model:"]
        if self.missing:
            lines.append(f"  missing keys ({len(self.missing)}): {', '.join(self.missing)}")
        if self.misshaped:
            lines.append(f"  mis-shaped ({len(self.misshaped)}):\n    " + "\n    ".join(self.misshaped))
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}):\n    "
                         + "\n    ".join(f"{k} ({self.where(k)})" for k in unexpected))
        for p in self.problems:
            lines.append(f"  {p}")
        raise CheckpointMismatch("\n".join(lines))


def take_norm_and_head(src: SourceTensors, cfg, put) -> None:
    """The final norm `model.norm.weight` and the untied head `lm_head.weight` through `put(canonical, key, linear)`
    (the HF layout's names); a tied model's `lm_head.weight`, if the file has one, is ignored with the reason."""
    put("final_norm.norm.weight", "model.norm.weight", False)
    if not cfg.tie_embeddings:
        put("lm_head.proj.weight", "lm_head.weight", True)
    elif src.has("lm_head.weight"):
        src.ignore("lm_head.weight", "tie_word_embeddings=true: the logits use the embedding")


def ffn_names(cfg, i: int) -> list[tuple[str, str, bool]]:
    """(our name inside `layers.i.`, the HF name inside `model.layers.i.`, is a linear) of block i's feed-forward in
    the DeepSeek / ERNIE 4.5 layout: `mlp.{gate,up,down}_proj`, or the router `mlp.gate` and the shared experts'
    `mlp.shared_experts.*` of an MoE block (its routed experts are stacked separately)."""
    ffn = [f"{n}_proj" for n in ("gate", "up", "down")]
    if not cfg.is_moe_layer(i):
        return [(f"mlp.{n}.weight", f"mlp.{n}.weight", True) for n in ffn]
    names = [("mlp.router.weight", "mlp.gate.weight", True)]
    if cfg.moe_num_shared_experts:
        names += [(f"mlp.shared.{n}.weight", f"mlp.shared_experts.{n}.weight", True) for n in ffn]
    return names


def check_canonical(state: dict, shapes: dict[str, list[int]], source: str) -> None:
    """`state` (canonical name -> array) has exactly the names of `shapes`, each with that shape."""
    missing = [n for n in shapes if n not in state]
    unexpected = sorted(n for n in state if n not in shapes)
    shaped = [f"{n}: {source} has {list(np.shape(state[n]))}, model needs {shapes[n]}"
              for n in shapes if n in state and list(np.shape(state[n])) != shapes[n]]
    if missing or unexpected or shaped:
        lines = [f"{source} does not fit the model:"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
        if shaped:
            lines.append(f"  mis-shaped ({len(shaped)}):\n    " + "\n    ".join(shaped))
        raise CheckpointMismatch("\n".join(lines))


def model_shapes(cfg) -> dict[str, list[int]]:
    """Canonical name -> full shape of every parameter of the model `cfg` builds (no memory allocated)."""
    from llmtrain.models import build_model, shape_only
    from llmtrain.models.stages import canonical_parameters

    with shape_only():
        model = build_model(cfg)
    return {name: [int(s) for s in p.shape] for name, p in canonical_parameters(model)}


EXPERT_LINEARS = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
"""(our stacked expert tensor in `layers.i.mlp.experts.`, HF linear in `model.layers.i.mlp.experts.{j}.`)"""

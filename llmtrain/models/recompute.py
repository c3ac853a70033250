"""Activation recompute of a block or of named parts of it: what a `Block` re-runs in its backward.

    python llmtrain/pretrain.py model=llama-tiny train.recompute=core_attn
    python llmtrain/pretrain.py model=moe-tiny train.recompute=selective train.recompute_modules=[moe_act,norm]
    rc = recompute_from(mode="full_attn", modules=[], layers="first:2", blocks=[4, 4])   # -> Recompute

Modes (`train.recompute`, PaddleFormers' `recompute_granularity` names):
- `none`: nothing recomputed;
- `full`: the whole block (its input is kept, everything else re-run);
- `full_attn`: the attention layer (projections, QK-norm, RoPE, the core, the output projection); the norm before it
  is not inside (pre-norm: its output is the part's kept input; `Block._forward`);
- `core_attn`: the attention core only, softmax(q·kᵀ)·v (q, k, v are kept; the probabilities or flash attention's
  log-sum-exp are re-made) — Korthikanti et al. 2022's selective recompute;
- `selective`: only the modules of `train.recompute_modules`.
Modules (`train.recompute_modules`, Megatron-Core's names, added to any mode): `core_attn`, `mlp` (a dense
feed-forward), `moe` (a whole MoE feed-forward, router and dispatch included), `moe_act` (the routed experts'
activation silu(g)·u or gelu(u)), `shared_experts`, `norm` (the block's two norms). `train.recompute=true` is `full`
and `false` is `none`.

Layers (`train.recompute_layers`): `all`, `every:N` (blocks 0, N, 2N, ... of each segment) or `first:K` (the first K
blocks of each segment); a segment is a pipeline chunk (`parallel.pp_layers`), the whole model on one stage.

Every recomputed part runs through Paddle's `fleet.utils.recompute(..., use_reentrant=False)` (a reentrant
recompute whose inputs all have stop_gradient=True gives its parameters no gradient), which keeps the random
state (dropout draws the same mask in the backward). An MoE router in a recomputed part routes exactly as in
the first forward: the first run keeps its top-k choice ([T, k] int64) and the second run takes it
(`MoEFeedForward.keep_routing` / `replay`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

MODES = ("none", "full", "full_attn", "core_attn", "selective")
MODULES = ("core_attn", "mlp", "moe", "moe_act", "shared_experts", "norm")
MODE_PARTS = {"none": (), "full": ("block",), "full_attn": ("attn",), "core_attn": ("core_attn",), "selective": ()}
"""The parts of a block each mode recomputes before `train.recompute_modules` are added."""


@dataclass(frozen=True)
class Recompute:
    """What blocks recompute: `parts` (`block`, `attn` or names of `MODULES`) in the blocks `blocks` (None: all)."""

    parts: frozenset = frozenset()
    """The recomputed parts of a chosen block."""
    blocks: Optional[frozenset] = None
    """Indices of the blocks that recompute; None: every block."""
    offload: bool = False
    """A fully recomputed block's kept input waits in host memory (`llmtrain.paddle_compat.offload`)."""

    def at(self, index: int) -> frozenset:
        """The parts block `index` recomputes (empty: none)."""
        if self.blocks is not None and index not in self.blocks:
            return frozenset()
        return self.parts

    @property
    def on(self) -> bool:
        return bool(self.parts) and (self.blocks is None or bool(self.blocks))


NONE = Recompute()


def parse_mode(value) -> str:
    """`train.recompute` (a mode name, or a boolean: true = full, false = none) -> a mode of `MODES`."""
    if value is True or value is False:
        return "full" if value else "none"
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return "full" if text == "true" else "none"
    if text not in MODES:
        raise ValueError(f"train.recompute={value!r}: expected one of {', '.join(MODES)} (or true = full, "
                         f"false = none); single modules go in train.recompute_modules={list(MODULES)}")
    return text


def choose_blocks(layers: str, segments: Sequence[int]) -> Optional[frozenset]:
    """Block indices picked by `train.recompute_layers` in consecutive segments of `segments[i]` blocks, or None
    for `all`."""
    text = str(layers).strip().lower()
    if text == "all":
        return None
    kind, _, num = text.partition(":")
    if kind not in ("every", "first") or not num.isdigit() or int(num) < (1 if kind == "every" else 0):
        raise ValueError(f"train.recompute_layers={layers!r}: expected 'all', 'every:N' (N >= 1) or 'first:K' (K >= 0)")
    n, chosen, start = int(num), set(), 0
    for size in segments:
        picked = range(0, size, n) if kind == "every" else range(min(n, size))
        chosen.update(start + i for i in picked)
        start += size
    return frozenset(chosen)


def recompute_from(*, mode, modules: Sequence[str] = (), layers: str = "all",
                   blocks: Sequence[int] = (), offload: bool = False) -> Recompute:
    """The `Recompute` of `train.recompute` (`mode`), `train.recompute_modules`, `train.recompute_layers` over a
    model whose blocks come in segments of `blocks` (pipeline chunks; one segment of all blocks on one stage)."""
    name = parse_mode(mode)
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        raise ValueError(f"train.recompute_modules={list(modules)}: unknown {unknown}; expected names of {list(MODULES)}")
    if name == "selective" and not modules:
        raise ValueError("train.recompute=selective needs train.recompute_modules (e.g. [core_attn, mlp])")
    parts = frozenset(MODE_PARTS[name]) | frozenset(modules)
    if "block" in parts:  # the whole block re-runs: its modules are inside it
        parts = frozenset({"block"})
    if "attn" in parts:  # the attention layer re-runs: its core is inside it
        parts -= {"core_attn"}
    if offload and parts != {"block"}:
        raise ValueError(f"train.offload_activations=true offloads the input a fully recomputed block keeps: it needs "
                         f"train.recompute=full (got {name!r} with modules {sorted(modules)})")
    if not parts:
        return NONE
    return Recompute(parts, choose_blocks(layers, blocks), offload)


def as_recompute(value) -> Recompute:
    """A `Recompute` from what a model constructor is given: a `Recompute`, or a bool (true: every whole block)."""
    if isinstance(value, Recompute):
        return value
    return Recompute(frozenset({"block"})) if value else NONE


def checkpointed(fn):
    """`fn` wrapped so that its saved tensors are re-made in the backward (non-reentrant recompute, random state
    kept); called only in training."""

    def run(*args, **kwargs):
        from paddle.distributed.fleet.utils import recompute

        return recompute(fn, *args, use_reentrant=False, **kwargs)

    return run


def recompute_problems(train_cfg) -> list[str]:
    """What is wrong with `train.recompute`, `train.recompute_modules` and `train.recompute_layers` (messages)."""
    try:
        recompute_from(mode=train_cfg.recompute, modules=list(train_cfg.recompute_modules),
                       layers=train_cfg.recompute_layers, blocks=[1], offload=train_cfg.offload_activations)
    except ValueError as e:
        return [str(e)]
    return []


def recompute_of(train_cfg, num_layers: int, chunks: Sequence[int] = ()) -> Recompute:
    """The `Recompute` of a run's `train` section for a model of `num_layers` blocks cut in pipeline `chunks`
    (`parallel.pp_layers`; () for one stage)."""
    return recompute_from(mode=train_cfg.recompute, modules=list(train_cfg.recompute_modules),
                          layers=train_cfg.recompute_layers, blocks=list(chunks) or [num_layers],
                          offload=train_cfg.offload_activations)

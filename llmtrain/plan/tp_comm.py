"""The tensor-parallel collectives one tp rank issues per micro-batch, as llmtrain's tp roles issue them.

    python -m pytest tests/parallel/test_parity.py -k tp_ranks_ops     # a tp2 rank's recorded calls against this list
    calls = tp_collectives(cfg, b=1, s=4096, t=8, e=2, sp=False, gpu=True, replay="full_attn")

One entry per call, `Collective(name, phase, nbytes)`, bytes as nccl-tests counts them (all-reduce: the tensor;
all-gather: the gathered output; reduce-scatter: the input before scattering), for T = b·s tokens:

- every column-parallel linear's input (fleet's c_identity: its gradient all-reduced in the backward; under
  sequence parallelism all-gathered in the forward, its gradient reduce-scattered): q|k|v, gate|up (GeLU: up) as one
  input each when fused (`model.fuse_qkv`, `fuse_ffn`), else one per projection; latent attention (MLA) instead
  q_b's input [T, r_q] (q_proj's [T, h] without a q rank) and kv_b's [T, r_kv], both narrower than h, and the shared
  rotary key [T, d_r] (`roles.head_shared`: its gradient summed over the heads' ranks);
- every row-parallel linear's output (o_proj, down_proj): all-reduced in the forward; under sequence parallelism
  reduce-scattered, its gradient all-gathered in the backward;
- QK-norm's weights [d] for q and k (`roles.head_shared`): their gradients all-reduced;
- an MoE block's shared experts as a dense MLP; its router and routed experts are replicated over tp (no
  collective), so an MoE block without shared experts has none in its feed-forward;
- per micro-batch: the vocabulary-parallel embedding's output all-reduced (first stage; under sequence parallelism
  its gradient all-gathered too, the shard's `ScatterOp`), the head's input gradient all-reduced (last stage; under
  sequence parallelism its input all-gathered first, `GatherOp`) and the parallel cross entropy's max, target logit
  and sum of exponentials [T] fp32, three all-reduces.

`replay` (a `Recompute`): a recomputed piece re-runs its forward in the backward, its forward collectives included
(whole blocks, the attention layer, the MLP, the MoE feed-forward's shared experts; `PART_OF`).
Checked against each tp2 rank's calls (tests/plan/tp_ops.py, inside the tp2 parity launch) and each tp2 x ep2
rank's (the dp2tp2 launch). MLA under sequence parallelism is refused (`field_checks.mla_problems`): its rows here
follow the column/row rule unchecked.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Collective:
    """One collective call on the tp group."""

    name: str
    """all_reduce | all_gather | reduce_scatter."""
    phase: str
    """forward | backward."""
    nbytes: float
    """The buffer's bytes (module docstring)."""


def _column(width: float, sp: bool) -> list:
    """A column-parallel linear's input of `width` bytes: (forward, backward) collectives."""
    if sp:
        return [("all_gather", width)], [("reduce_scatter", width)]
    return [], [("all_reduce", width)]


def _row(width: float, sp: bool) -> list:
    """A row-parallel linear's output of `width` bytes: (forward, backward) collectives."""
    if sp:
        return [("reduce_scatter", width)], [("all_gather", width)]
    return [("all_reduce", width)], []


PART_OF = {"attn": ("block", "attn"), "mlp": ("block", "mlp"), "shared_experts": ("block", "moe", "shared_experts")}
"""The recompute parts (`llmtrain.models.recompute.Recompute.parts`) that re-run a block piece's collectives: the
attention layer's under `block` (full) and `attn` (full_attn), the dense MLP's under `mlp`, the shared experts'
under `moe` and `shared_experts` (the core, the norms and the experts' activation issue none)."""


def block_collectives(cfg, layer: int, T: int, e: int, *, sp: bool, gpu: bool) -> list:
    """[(piece, forward, backward)] of block `layer` for T tokens, piece one of `PART_OF`, forward and backward
    [(name, bytes)] each (module docstring)."""
    fuse_qkv, fuse_ffn = cfg.fused("fuse_qkv", gpu), cfg.fused("fuse_ffn", gpu)
    h = cfg.hidden_size
    attn = []
    if cfg.is_mla():
        q_in = cfg.mla_q_lora_rank or h
        attn += [_column(T * q_in * e, sp), _column(T * cfg.mla_kv_lora_rank * e, sp),
                 ([], [("all_reduce", T * cfg.mla_qk_rope_head_dim * e)])]  # the shared rotary key's gradient
    else:
        attn += [_column(T * h * e, sp)] * (1 if fuse_qkv else 3)
        if cfg.qk_norm:  # the q and k norms' weights [d], their gradients summed over the heads' ranks
            attn += [([], [("all_reduce", cfg.attn_head_dim() * e)])] * 2
    attn.append(_row(T * h * e, sp))
    out = [("attn", *_joined(attn))]
    moe = cfg.is_moe_layer(layer)
    if not moe or cfg.moe_num_shared_experts > 0:  # the dense MLP or the shared experts
        ffn = [_column(T * h * e, sp)] * (1 if fuse_ffn or cfg.activation != "swiglu" else 2) + [_row(T * h * e, sp)]
        out.append(("shared_experts" if moe else "mlp", *_joined(ffn)))
    return out


def _joined(pieces) -> tuple[list, list]:
    return [c for f, _ in pieces for c in f], [c for _, b in pieces for c in b]


def tp_collectives(cfg, b: int, s: int, t: int, e: int, *, sp: bool, gpu: bool, replay=None,
                   layers=None, first: bool = True, last: bool = True) -> list[Collective]:
    """Every tp collective of one micro-batch [b, s] on one rank of a tp group of t (none when t = 1), over the
    blocks `layers` (default: all) and the embedding (`first`) and head (`last`) ends; `replay`: the run's
    `Recompute` (or a mode name), whose recomputed pieces issue their forward collectives again in the backward."""
    from llmtrain.plan.recompute import plan_recompute

    if t <= 1:
        return []
    rc = plan_recompute(replay if replay is not None else "none")
    T, h = b * s, cfg.hidden_size
    sp = sp and t > 1
    fwd, bwd = [], []
    if first:
        fwd.append(("all_reduce", T * h * e))
        if sp:
            bwd.append(("all_gather", T * h * e))
    for i in range(cfg.num_layers) if layers is None else layers:
        again = rc.at(i)
        for piece, f, bk in block_collectives(cfg, i, T, e, sp=sp, gpu=gpu):
            fwd += f
            bwd += (f if again & set(PART_OF[piece]) else []) + bk
    if last:
        if sp:
            fwd.append(("all_gather", T * h * e))
        fwd += [("all_reduce", T * 4)] * 3
        bwd.append(("all_reduce", T * h * e))
    return [Collective(n, "forward", x) for n, x in fwd] + [Collective(n, "backward", x) for n, x in bwd]

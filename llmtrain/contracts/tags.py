"""What models and plans attach to Paddle layers, parameters and optimizers, as typed setters and getters.

    python -m pytest tests/test_package_graph.py -q     # no `llm_` attribute is touched outside this module
    set_split_axis(param, 1); split_axis(param)          # 1: the axis a tensor-parallel plan cut
    set_prefix(layer, "layers.3"); prefix_of(layer)      # the canonical name prefix of a stage layer

A model is written for one device and a parallel plan acts on it from outside, so a
few facts have to travel with the objects themselves: a stage's canonical name, how a
linear may be split, how a parameter is initialised, which axis a plan cut. They are
stored as attributes named `llm_<tag>` on the Paddle object (they follow it through
fleet's wrappers and pipeline chunks) and read and written only here. Every getter
returns the "untagged" value (None or False) for an object that carries no tag.

Tags and who sets / reads them:

| tag | on | set by | read by |
|---|---|---|---|
| prefix | stage layer | model stages, pipeline | canonical names, LoRA |
| tied_table | embedding layer | model stages, pipeline | ZeRO (excluded from slicing) |
| linear | column/row linear | `Roles` | LoRA |
| lora_branch | adapted linear | LoRA | fused projections |
| split_axis | parameter | tp/sp roles, LoRA | slicing, checkpoints, sp |
| expert_axis | parameter | MoE experts | slicing, checkpoints, clip, optimizer |
| init | parameter | norms, LoRA | initialisation |
| residual_out | parameter | attention/MLP out proj | initialisation |
| lora | parameter | LoRA | sp |
| recording_clip | optimizer | ZeRO | the norm-recording clip |
| role | vocab embedding, output linear / bias | `Roles` | the planner's parameter list |
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

InitRule = Union[str, tuple]
"""`"ones"`, `"zeros"`, or `("lora_a", in_features)`; None: the model's normal init."""


class LinearShape(NamedTuple):
    """A linear as the model asked for it: `kind` ("column" / "row" / "replicated") and its full in x out size."""

    kind: str
    in_features: int
    out_features: int


# --- layers ---------------------------------------------------------------------------------------------------------

def set_prefix(layer, prefix: str) -> None:
    """`layer` is a stage whose parameters are named `<prefix>.<name inside the layer>` under every layout."""
    layer.llm_prefix = prefix


def prefix_of(layer) -> Optional[str]:
    """The canonical name prefix of a stage layer, or None for any other layer."""
    return getattr(layer, "llm_prefix", None)


def mark_tied_table(layer, tied: bool = True) -> None:
    """`layer`'s table is also the output projection (read outside the layer's own forward)."""
    layer.llm_tied_table = bool(tied)


def is_tied_table(layer) -> bool:
    return bool(getattr(layer, "llm_tied_table", False))


def set_linear(layer, kind: str, in_features: int, out_features: int) -> None:
    """`layer` is a `kind` ("column" / "row" / "replicated") linear of full size in x out."""
    layer.llm_linear = LinearShape(kind, int(in_features), int(out_features))


def linear_of(layer) -> Optional[LinearShape]:
    """The linear's kind and full size, or None for a layer `Roles` did not hand out as a linear."""
    return getattr(layer, "llm_linear", None)


def set_lora_branch(layer, branch: Callable) -> None:
    """The LoRA adapter branch of an adapted linear (its forward post-hook)."""
    layer.llm_lora_branch = branch


def lora_branch_of(layer) -> Optional[Callable]:
    return getattr(layer, "llm_lora_branch", None)


def set_role(obj, role: str) -> None:
    """What a layer or parameter is for, where its name alone does not say how a plan splits it:
    `"vocab_embedding"`, `"output_linear"` (layers) or `"output_bias"` (a parameter)."""
    obj.llm_role = role


def role_of(obj) -> Optional[str]:
    return getattr(obj, "llm_role", None)


# --- parameters -----------------------------------------------------------------------------------------------------

def set_split_axis(param, axis: Optional[int]) -> None:
    """A tensor-parallel plan cut `param` along `axis` (each tp rank holds one contiguous chunk); None: whole."""
    param.llm_split_axis = axis


def split_axis(param) -> Optional[int]:
    return getattr(param, "llm_split_axis", None)


EXPERT_AXIS_ATTR = "llm_expert_axis"
"""The attribute `set_expert_axis` sets (copied onto a wrapper's stand-in of the parameter, e.g. a V2 slice)."""


def set_expert_axis(param, axis: int) -> None:
    """`param` stacks experts along `axis` (an expert-parallel plan may hold a block of them)."""
    setattr(param, EXPERT_AXIS_ATTR, axis)


def expert_axis(param) -> Optional[int]:
    return getattr(param, EXPERT_AXIS_ATTR, None)


def is_expert(param) -> bool:
    return expert_axis(param) is not None


def set_init(param, rule: InitRule) -> None:
    """How `param` is initialised instead of the model's normal init (`InitRule`)."""
    param.llm_init = rule


def init_rule(param) -> Optional[InitRule]:
    return getattr(param, "llm_init", None)


def mark_residual_out(param) -> None:
    """`param` projects into the residual stream (initialised with std / sqrt(2 L))."""
    param.llm_residual_out = True


def is_residual_out(param) -> bool:
    return bool(getattr(param, "llm_residual_out", False))


def mark_lora(param) -> None:
    """`param` is a LoRA factor (lora_A or lora_B)."""
    param.llm_lora = True


def is_lora(param) -> bool:
    return bool(getattr(param, "llm_lora", False))


# --- optimizers -----------------------------------------------------------------------------------------------------

def set_recording_clip(optimizer, clip: Any) -> None:
    """The norm-recording clip a ZeRO wrapper installed inside `optimizer` (its `last_norm` is the step's norm)."""
    optimizer._llm_recording_clip = clip


def recording_clip(optimizer) -> Any:
    return getattr(optimizer, "_llm_recording_clip", None)

"""Switch a built model's transformer GEMMs to an FP8 recipe (`train.fp8`), leaving everything else as it is.

    python llmtrain/pretrain.py model=llama-tiny train.fp8=blockwise        # CPU: emulated (said in the log)
    health = apply_fp8(model, "blockwise")      # FP8Health, or None for "none"

What runs in FP8 (DeepSeek-V3's split): every linear the model asked `Roles` for as a column, row or replicated
linear (attention projections q/k/v/o, MLA's down- and up-projections, the dense MLP and the shared experts'
gate/up/down) and the routed experts' three batched GEMMs. What stays in the activations' dtype: the embedding,
the LM head (`Roles.output_linear` / tied logits), the router, the norms, attention's softmax GEMMs and the loss.
Parameters, optimizer states and checkpoints are unchanged (FP8 is compute only: a run can switch it at resume).

Works on this rank's layers whatever the layout: fleet's tensor- and sequence-parallel linears and the plain
`Roles` linears all compute through their `linear(x, weight, bias)` attribute, which this replaces with an
`FP8Gemm`; under tp each rank quantises its own slice as a GPU run would (tiles never cross ranks). The fused
projections (`model.fuse_qkv` / `fuse_ffn`) quantise the concatenated weight, one GEMM
(`llmtrain.models.fused_linear.concat_linear` calls the layers' `linear`).
"""
from __future__ import annotations

from typing import Optional

import paddle.nn as nn

from llmtrain.contracts import tags
from llmtrain.fp8.cache import WeightCache
from llmtrain.fp8.emulate import FP8Emulate, token_view, tp_slices
from llmtrain.fp8.health import FP8Health
from llmtrain.fp8.linear import FP8Gemm
from llmtrain.fp8.recipe import RECIPES

CHOICES = ("none", "blockwise", "tensorwise")
"""The values of `train.fp8`."""


def fp8_problems(fp8: str, amp: str, gpu: bool) -> list[str]:
    """What refuses `train.fp8=fp8` with `train.amp=amp` on this device (GPU: Paddle's FP8 kernels must be usable)."""
    if fp8 not in CHOICES:
        return [f"train.fp8={fp8!r}: expected one of {', '.join(CHOICES)}"]
    if fp8 == "none" or not gpu:
        return []
    if fp8 == "tensorwise":
        return ["train.fp8=tensorwise: runs emulated on CPU only; Paddle 3.3.1 has no tensorwise FP8 GEMM with a "
                "backward on GPU (use train.fp8=blockwise there)"]
    problems = [] if amp == "bf16" else [f"train.fp8=blockwise on GPU needs train.amp=bf16 (got {amp!r}): Paddle's "
                                          "FP8 kernels take bf16 activations and weights"]
    from llmtrain.paddle_compat.fp8_kernels import gpu_problems

    return problems + gpu_problems()


def fp8_layers(model: nn.Layer) -> list:
    """[(name, layer, kind)] of the layers an FP8 recipe computes: kind "linear" (a Roles linear) or "experts"."""
    from llmtrain.models.experts import Experts

    out = []
    for name, layer in model.named_sublayers():
        shape = tags.linear_of(layer)
        if shape is not None and hasattr(layer, "linear"):
            out.append((name, layer, "linear"))
        elif isinstance(layer, Experts):
            out.append((name, layer, "experts"))
        elif shape is not None:
            raise TypeError(f"{name}: a {shape.kind} linear of type {type(layer).__name__} has no `linear` GEMM "
                            "attribute to run in FP8")
    return out


def apply_fp8(model: nn.Layer, recipe_name: str, emulate: Optional[FP8Emulate] = None,
              cache: Optional[WeightCache] = None) -> Optional[FP8Health]:
    """Compute `model`'s transformer GEMMs with the FP8 recipe `recipe_name` (in place); returns the FP8Health every
    quantisation of the model records into, or None for `none`. `emulate` (`train.fp8_emulate`): quantise as the
    ranks of that tp / sp / cp layout would (`llmtrain.fp8.emulate`). `cache` (`train.fp8_weight_cache`): every
    layer's FP8 weight made once per optimizer step (`llmtrain.fp8.cache`; the caller runs it as a step hook)."""
    if recipe_name == "none":
        return None
    if recipe_name not in RECIPES:
        raise ValueError(f"train.fp8={recipe_name!r}: expected one of {', '.join(CHOICES)}")
    recipe, health = RECIPES[recipe_name], FP8Health()
    layers = fp8_layers(model)
    if not layers:
        raise ValueError(f"train.fp8={recipe_name}: the model has no linear layer to compute in FP8")
    tp = emulate.tp if emulate is not None else 1
    tokens = token_view(emulate)
    for name, layer, kind in layers:
        if kind == "linear" and (tp > 1 or tokens is not None):
            shape = tags.linear_of(layer)
            view = tokens if tokens is None or shape.kind != "replicated" else token_view(
                FP8Emulate(cp=tokens.cp)) if tokens.cp > 1 else None  # sp orders only the tp linears' tokens
            gemm = FP8Gemm(recipe, health, name, splits=tp_slices(shape.kind, tp), tokens=view,
                           weight_shape=[shape.in_features, shape.out_features], cache=cache)
        elif kind == "experts" and (tp > 1 or tokens is not None):
            raise ValueError(f"{name}: train.fp8_emulate does not model routed experts")
        else:
            gemm = FP8Gemm(recipe, health, name, cache=cache)
        if kind == "linear":
            layer.linear = gemm
        else:
            layer.bmm = gemm.bmm
    return health


def fp8_layer_count(model: nn.Layer) -> int:
    """How many layers of `model` compute in FP8 now (0 when no recipe was applied)."""
    count = 0
    for _, layer in model.named_sublayers():
        gemm = getattr(layer, "linear", None)
        bmm = getattr(layer, "bmm", None)
        if isinstance(gemm, FP8Gemm) or getattr(bmm, "__self__", None).__class__ is FP8Gemm:
            count += 1
    return count

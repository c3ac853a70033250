"""LoRA adapters on the model's linears, attached by canonical name (single-device code).

    python llmtrain/finetune.py finetune.lora.rank=8 finetune.lora.alpha=16 model.init_from=PADDLENLP_DIR ...
    names = attach_lora(model, cfg.finetune.lora, roles)     # after the model (or pipeline stage) is built

A linear `layers.3.attn.q_proj` whose canonical module name matches one of
`finetune.lora.target_modules` (regular expressions, `re.fullmatch`) gets two
parameters, `lora_A` [in, r] and `lora_B` [r, out], and computes
y = x W (+ b) + dropout(x) A B * alpha / r (PaddleNLP's `LoRALinear`, same names,
same scaling). A starts uniform in +-1/sqrt(in) drawn from (seed, canonical name)
like every parameter (PaddleNLP: Kaiming-uniform with a = sqrt(5), the same
bound), B at zero, so training starts from the base model exactly.

The model asks its `Roles` (the same factory that built the linear) for the
adapter's local shapes and for the branch's first half x A (`Roles.lora_down`):
on one device a matmul; under tensor parallelism the plan splits B with a
column-parallel base and A with a row-parallel one (`llmtrain.parallel.tensor`),
under sequence parallelism x A also moves between sequence shards and the whole
sequence as the base's activations do (`llmtrain.parallel.sequence`). The model
never knows. The branch is a forward post-hook of the linear; fused projections
(`model.fuse_qkv` / `fuse_ffn`: one matmul of concatenated weights, which never
calls the linears) add the same adapters as one block (`add_fused_adapters`).

Only column and row linears can carry adapters (the LM head, embeddings and
norms cannot); the base parameters are frozen (`stop_gradient`) by the trainer,
which gives the optimizer the adapters alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional

from typing import TYPE_CHECKING

from llmtrain.contracts import tags

if TYPE_CHECKING:  # paddle is imported where a branch runs: the config dataclasses (llmtrain.config, the planner) stay paddle-free
    import paddle.nn as nn

DEFAULT_TARGETS = [r"layers\.\d+\.attn\.(q|k|v|o)_proj", r"layers\.\d+\.mlp\.(gate|up|down)_proj"]


@dataclass
class LoraConfig:
    rank: int = 0
    """Adapter rank r; 0: no LoRA (full-parameter training)."""

    alpha: float = 16.0
    """Scaling numerator: the branch is multiplied by alpha / rank (PaddleNLP's `lora_alpha`)."""

    dropout: float = 0.0
    """Dropout on the adapter's input (training only). Not with tensor parallelism (resolve refuses it)."""

    target_modules: List[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Regular expressions over canonical linear names (`layers.0.attn.q_proj`, `layers.1.mlp.down_proj`),
    matched with re.fullmatch; every column/row linear that matches gets an adapter."""

    merge: bool = False
    """`python -m llmtrain.export` of this run writes the merged plain model (W + A B alpha/r) by default,
    instead of a PaddleNLP adapter directory (`--merge-lora` / `--no-merge-lora` override)."""

    init_from: Optional[str] = None
    """A PaddleNLP adapter directory (lora_config.json + lora_model_state.pdparams) to continue from;
    rank, alpha and the targets are then taken from its lora_config.json."""


@dataclass
class FinetuneOptions:
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (`finetune.lora.rank > 0` turns them on; pretraining accepts them too)."""


def is_adapter(name: str) -> bool:
    """Is the canonical parameter `name` a LoRA factor?"""
    return name.endswith(".lora_A") or name.endswith(".lora_B")


def linear_modules(model: nn.Layer) -> list[tuple[str, nn.Layer]]:
    """(canonical module name, layer) of every column/row linear of a model or pipeline stage."""
    out, seen = [], set()
    for stage_layer in [model, *model.sublayers()]:
        prefix = tags.prefix_of(stage_layer)
        if prefix is None:
            continue
        for sub, layer in stage_layer.named_sublayers():
            if tags.linear_of(layer) is not None and id(layer) not in seen:
                seen.add(id(layer))
                out.append((f"{prefix}.{sub}", layer))
    return out


def matching(names: list[str], patterns: list[str]) -> list[str]:
    """The names that fully match one of the patterns."""
    compiled = [re.compile(p) for p in patterns]
    return [n for n in names if any(c.fullmatch(n) for c in compiled)]


class _Branch:
    """The forward post-hook adding the adapter branch to a linear's output (also kept as the layer's `tags.lora_branch_of`)."""

    def __init__(self, roles, kind: str, scaling: float, dropout: float):
        self.roles, self.kind, self.scaling, self.dropout = roles, kind, scaling, dropout

    def delta(self, layer, x):
        """dropout(x) A B * alpha / r: x [.., in] (row linear under tp: [.., in/tp]) -> [.., out] (column: out/tp)."""
        import paddle
        import paddle.nn.functional as F

        if self.dropout > 0 and layer.training:
            x = F.dropout(x, self.dropout)
        return paddle.matmul(self.roles.lora_down(self.kind, x, layer.lora_A), layer.lora_B) * self.scaling

    def __call__(self, layer, inputs, output):
        return output + self.delta(layer, inputs[0])


def add_fused_adapters(roles, x, layers: list, outs: list) -> list:
    """`outs` (the fused outputs of column linears fed by one input x: model.fuse_qkv / fuse_ffn) plus the
    adapters of those layers, which their one-matmul path bypasses: x A of every adapted layer in ONE matmul,
    x [.., in] @ [A_1 .. A_n] [in, n r] (under tp or sp one collective for the block, `Roles.lora_down`), then
    each [.., r] block @ its B_i, scaled, onto out_i. The same parameters and numbers as each linear's own
    hook; with dropout in training each adapter draws its own mask, as the hooks do (no shared matmul)."""
    adapted = [i for i, layer in enumerate(layers) if tags.lora_branch_of(layer) is not None]
    if not adapted:
        return outs
    outs = list(outs)
    branches = [tags.lora_branch_of(layers[i]) for i in adapted]
    if layers[0].training and any(b.dropout > 0 for b in branches):
        for i, branch in zip(adapted, branches):
            outs[i] = outs[i] + branch.delta(layers[i], x)
        return outs
    import paddle

    a = paddle.concat([layers[i].lora_A for i in adapted], axis=1)  # [in, n r]
    xa = roles.lora_down("column", x, a)  # [.., n r], whole
    parts = paddle.split(xa, [int(layers[i].lora_A.shape[1]) for i in adapted], axis=-1)  # n x [.., r]
    for i, branch, part in zip(adapted, branches, parts):
        outs[i] = outs[i] + paddle.matmul(part, layers[i].lora_B) * branch.scaling  # [.., out_i(/tp)]
    return outs


def attach_lora(model: nn.Layer, cfg: LoraConfig, roles) -> list[str]:
    """Add lora_A/lora_B to every matching linear of `model`; returns their canonical module names.

    Under pipeline parallelism `model` is this rank's stage(s): only its linears are adapted."""
    if cfg.rank <= 0:
        return []
    attached = []
    wanted = set(matching([n for n, _ in linear_modules(model)], list(cfg.target_modules)))
    for name, layer in linear_modules(model):
        if name not in wanted:
            continue
        kind, in_features, out_features = tags.linear_of(layer)
        (a_shape, a_axis), (b_shape, b_axis) = roles.lora_shapes(kind, in_features, out_features, cfg.rank)
        dtype = layer.weight.dtype
        layer.lora_A = layer.create_parameter(a_shape, dtype=dtype)  # [in(/tp), r]
        layer.lora_B = layer.create_parameter(b_shape, dtype=dtype)  # [r, out(/tp)]
        for p, axis in ((layer.lora_A, a_axis), (layer.lora_B, b_axis)):
            tags.mark_lora(p)
            if axis is not None:
                tags.set_split_axis(p, axis)
                p.is_distributed = True  # fleet: a split tensor (never broadcast over mp, norm counted per rank)
        tags.set_init(layer.lora_A, ("lora_a", in_features))
        tags.set_init(layer.lora_B, "zeros")
        branch = _Branch(roles, kind, cfg.alpha / cfg.rank, cfg.dropout)
        tags.set_lora_branch(layer, branch)
        layer.register_forward_post_hook(branch)
        attached.append(name)
    return attached

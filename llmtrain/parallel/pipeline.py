"""Pipeline plan: cut the model's ordered stage list into fleet `PipelineLayer` stages.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=gpt-tiny +parallel=pp2

    pipe = build_pipeline(cfg.model, layout, roles, topo, recompute)
    model = fleet.distributed_model(pipe)          # -> PipelineParallel
    loss = model.train_batch([input_ids, (labels, loss_mask)], optimizer, lr_scheduler)

The model says what its stages are (`llmtrain.models.stages.Stage`: prefix,
layer class, kwargs, shared key); this module says how fleet runs them. Each
stage becomes a `LayerDesc`; a stage with a shared key (the tied word table)
becomes a `SharedLayerDesc`: its first appearance builds the model's layer (the
embedding), a later appearance (the output projection) builds a `TiedHead`,
which holds only the word table. So the last pipeline stage does not carry a
second copy of the position or token-type tables, and every parameter keeps
one canonical name. The blocks are cut into chunks of `layout.pp_layers` blocks
(`llmtrain.parallel.pp_split`: given or balanced by cost; chunk i on stage i % pp),
the embedding joins the first chunk and the final norm + head the last (under DualPipeV, chunk i on stage i down
the V and 2 pp - 1 - i back up: llmtrain/parallel/dualpipe.py). The
pipeline's micro-batches are the gradient-accumulation micro-batches
(`pipeline_configs.accumulate_steps` = train grad_accum).

How fleet is told the split: its `SegmentLayers` accepts explicit boundaries only
for 1F1B, and for the interleaved schedule only `seg_method="layer:<regex>"`,
which divides the layers whose class name matches the regex equally among the
chunks and cuts right after each chunk's share. So the last block of every chunk
is built from a subclass named `PipelineChunkEnd<Block>` (same attributes, same
canonical names) and the regex matches those alone: one marked layer per chunk,
cut after it, for both schedules.
"""
from __future__ import annotations

import contextlib
from functools import partial

import paddle.nn as nn

from llmtrain.contracts import tags
from llmtrain.contracts.steps import StepHook, mean_loss
from llmtrain.models import model_stages
from llmtrain.models.loss import LMLoss
from llmtrain.models.stages import Stage
from llmtrain.paddle_compat.fleet import mark_secondary_shared_copies
from llmtrain.parallel.layout import Layout
from llmtrain.parallel.moe_pipeline import attach_pipeline_moe
from llmtrain.parallel.pp_split import chunk_starts, describe_split
from llmtrain.utils.log import log0


class TiedHead(nn.Layer):
    """A later pipeline stage's copy of a tied word table, as output projection: [b, s, h] -> logits [b, s, V/tp].

    Built from the kwargs of the layer whose table it shares (`cfg`, `roles`,
    `prefix`; others ignored), with the table under the same attribute (`word`),
    so its parameter has the same canonical name (`embed.word.weight`). fleet
    keeps the copies equal: broadcast from the first stage at start, gradients
    all-reduced between the stages that hold one."""

    def __init__(self, cfg, roles, prefix: str = "embed", **_layer_specific):
        super().__init__()
        tags.set_prefix(self, prefix)
        self.roles = roles
        self.word = roles.vocab_embedding(cfg.vocab_size, cfg.hidden_size)  # [V/tp, h]
        tags.mark_tied_table(self.word)  # read outside its own forward (see llmtrain.parallel.zero)

    @property
    def shared_weight(self):
        return self.word.weight

    def forward(self, hidden):  # [b, s, h]
        return self.roles.tied_logits(hidden, self.shared_weight)  # [b, s, V/tp]


def _tied_logits(roles, layer, hidden):
    """`SharedLayerDesc.forward_func` of the output projection: the shared layer (a `TiedHead`,
    or the model's embedding when both sit on one stage) used through its table."""
    return roles.tied_logits(hidden, layer.shared_weight)  # [b, s, h] -> [b, s, V/tp]


def _carrying(layer_cls):
    """`layer_cls` whose forward takes and returns the stage tuple (hidden, position_ids[, segment_ids]) fleet passes
    between stages, so every block sees the batch's positions and documents (context-parallel chunks, packed
    documents): the embedding takes (input_ids, position_ids[, segment_ids]), the final norm returns the hidden
    states alone. Other stage classes (the LM head) are returned as they are. Same attributes, so the same
    canonical parameter names."""
    from llmtrain.models.decoder import Block, Embedding, FinalNorm

    if layer_cls is Embedding:
        def forward(self, inputs):
            ids, *extra = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
            return (Embedding.forward(self, ids, extra[0] if extra else None), *extra)
    elif layer_cls is Block:
        def forward(self, inputs):
            x, positions, *segments = inputs
            return (Block.forward(self, x, None, positions, segments[0] if segments else None), positions, *segments)
    elif layer_cls is FinalNorm:
        def forward(self, inputs):
            return FinalNorm.forward(self, inputs[0])
    else:
        return layer_cls
    return type(f"Carrying{layer_cls.__name__}", (layer_cls,), {"forward": forward, "__doc__": layer_cls.__doc__})


CHUNK_END = "PipelineChunkEnd"
"""Class-name prefix of the last block of every pipeline chunk; `seg_method` cuts after each (see the module)."""
_CHUNK_END_CLASSES: dict = {}


def _chunk_end(layer_cls):
    """`layer_cls` under the name `PipelineChunkEnd<name>`: the same layer, matched by `seg_method`."""
    if layer_cls not in _CHUNK_END_CLASSES:
        _CHUNK_END_CLASSES[layer_cls] = type(f"{CHUNK_END}{layer_cls.__name__}", (layer_cls,),
                                             {"__doc__": layer_cls.__doc__})
    return _CHUNK_END_CLASSES[layer_cls]


def mark_chunk_ends(stages: list[Stage], pp_layers) -> list[Stage]:
    """`stages` with the last block of every chunk of `pp_layers` blocks built as `_chunk_end` of its class."""
    ends = {f"layers.{start + n - 1}" for start, n in zip(chunk_starts(pp_layers), pp_layers)}
    return [st._replace(layer_cls=_chunk_end(st.layer_cls)) if st.prefix in ends else st for st in stages]


def stage_descs(stages: list[Stage], roles, carry: bool = False, pp_layers=(), local_shared: bool = False) -> list:
    """fleet's `LayerDesc` / `SharedLayerDesc` for the model's ordered stage list (`carry`: stages pass positions and
    document ids along, `_carrying`; `pp_layers`: the last block of each chunk marked, `mark_chunk_ends`;
    `local_shared`: both uses of a tied table sit on one stage (DualPipeV's V), so fleet's `LocalSharedLayerDesc`
    hands the embedding's own table to a `LocalTiedHead`)."""
    from paddle.distributed.fleet.meta_parallel import LayerDesc, SharedLayerDesc

    if local_shared:
        from paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers import LocalSharedLayerDesc

        from llmtrain.parallel.dualpipe import LocalTiedHead

        def shared(key, layer_cls, later: bool, **kwargs):
            return LocalSharedLayerDesc(key, LocalTiedHead if later else layer_cls,
                                        shared_weight_attr="shared_weight", **kwargs)
    else:
        def shared(key, layer_cls, later: bool, **kwargs):
            if not later:
                return SharedLayerDesc(key, layer_cls, shared_weight_attr="shared_weight", **kwargs)
            return SharedLayerDesc(key, TiedHead, forward_func=partial(_tied_logits, roles),
                                   shared_weight_attr="shared_weight", **kwargs)

    if carry:
        stages = [st._replace(layer_cls=_carrying(st.layer_cls)) for st in stages]
    if pp_layers:
        stages = mark_chunk_ends(stages, pp_layers)
    descs, seen = [], set()
    for st in stages:
        if st.shared_key is None:
            descs.append(LayerDesc(st.layer_cls, **st.kwargs))
        else:
            descs.append(shared(st.shared_key, st.layer_cls, st.shared_key in seen, **st.kwargs))
            seen.add(st.shared_key)
    if local_shared:  # DualPipeV hands every chunk but the first its input as a one-tensor list
        descs = [d for desc in descs for d in (_single, desc)]
    return descs


def _single(x):
    """A chunk's input as the tensor the next stage layer takes: DualPipeV passes received activations (and those
    handed from chunk to chunk at the V's turn) as a list of one tensor. A plain function in fleet's layer list: no
    parameters, not counted by `seg_method`."""
    return x[0] if isinstance(x, (list, tuple)) and len(x) == 1 else x


class PipelineLoss(nn.Layer):
    """The loss fleet's schedule calls on the last stage: a scalar, so the mean token loss of the micro-batch
    (`LMLoss`'s sum / count); during evaluation the token sum (`TokenSums`), which makes the caller's
    sum over batches / tokens the exact token-weighted mean."""

    def __init__(self, lm_loss: nn.Layer):
        super().__init__()
        self.lm_loss = lm_loss
        self.sum_tokens = False

    def forward(self, logits, labels):
        if isinstance(logits, (list, tuple)):  # fleet's DualPipeV hands the last chunk's outputs as a list
            (logits,) = logits
        terms = self.lm_loss(logits, labels)  # (loss_sum, tokens)
        return terms[0] if self.sum_tokens else mean_loss(terms)


class TokenSums(StepHook):
    """The pipeline's step hook: its loss returns token sums while an evaluation runs."""

    def __init__(self, loss: PipelineLoss):
        self.loss = loss

    @contextlib.contextmanager
    def evaluation(self):
        self.loss.sum_tokens = True
        try:
            yield
        finally:
            self.loss.sum_tokens = False


def build_pipeline(model_cfg, layout: Layout, roles, topo, recompute=False, wrap_loss=None,
                   carry: bool = False):
    """(pipe, hooks): a `PipelineLayer` holding this rank's stage(s) of the model, and its `StepHook`s. `wrap_loss`:
    the plan's wrapper of the token loss (context parallelism sums it over cp); `carry`: the first stage's input is
    (input_ids, position_ids[, segment_ids]) and every stage passes them on (`_carrying`)."""
    from paddle.distributed.fleet.meta_parallel import PipelineLayer

    if len(layout.pp_layers) != layout.pp * layout.virtual_pp or sum(layout.pp_layers) != model_cfg.num_layers:
        raise ValueError(f"layout.pp_layers={list(layout.pp_layers)} is not a split of model.num_layers="
                         f"{model_cfg.num_layers} blocks into parallel.pp={layout.pp} x parallel.virtual_pp="
                         f"{layout.virtual_pp} chunks (resolve the layout with llmtrain.resolve)")
    schedule = getattr(layout, "pp_schedule", "1f1b")
    v_shape = schedule == "dualpipev"  # DualPipeV's V (llmtrain/parallel/dualpipe.py)
    descs = stage_descs(model_stages(model_cfg, roles, recompute), roles, carry, layout.pp_layers,
                        local_shared=v_shape)
    extra = {}
    if v_shape:  # DualPipeV: 2 x pp chunks cut by the same markers, stage s runs chunks s and 2 pp - 1 - s
        extra["use_dualpipev"] = True
    elif layout.virtual_pp > 1:
        extra["num_virtual_pipeline_stages"] = layout.virtual_pp
    loss = PipelineLoss((wrap_loss or (lambda f: f))(LMLoss(roles)))
    pipe = PipelineLayer(
        layers=descs,
        num_stages=layout.pp,
        topology=topo.hcg.topology(),
        loss_fn=loss,
        seg_method=f"layer:^{CHUNK_END}",
        **extra,
    )
    log0(f"pipeline split {list(layout.pp_layers)} (blocks per chunk, {schedule}): "
         f"{describe_split(layout.pp_layers, layout.pp, v_shape)}")
    mark_secondary_shared_copies(pipe)  # a tied table counted once in the gradient norm
    hooks = [TokenSums(loss)]
    hooks += attach_pipeline_moe(pipe, model_cfg, layout, topo)  # MoE: every stage's balancing losses, statistics
    return pipe, hooks


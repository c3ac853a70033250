"""DualPipeV: fleet's V-shaped pipeline schedule with weight gradients split from input gradients.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=llama-tiny +parallel=pp2 \
        parallel.pp_schedule=dualpipev train.grad_accum=4

DualPipeV (DeepSeek's DualPipe "cut in half", fleet 3.3.1 `meta_parallel/dualpipev.py`, chosen by
`pp_configs.use_dualpipev=True`) cuts the blocks into 2 x pp chunks and lays them out as a V: stage s runs chunk s
on the way down and chunk 2·pp - 1 - s on the way back up, so stage 0 holds the embedding (chunk 0) and the final
norm, head and loss (the last chunk), and the last stage its two middle chunks back to back. Every stage runs
forwards of one direction beside backwards of the other, and the backward of a chunk may leave the weight
gradients of its linears for later ("W" passes that fill what would be bubbles): each linear built here is
fleet's `zero_bubble_utils.SplitBWLinear`, whose backward computes d(input) at once and queues d(weight) in
`WeightGradStore` when the schedule asks for it. The numbers are those of one process (the same sums in another
order).

What this module decides (the schedule itself is fleet's, run on CPU through
`llmtrain.paddle_compat.cpu_backend.dualpipe_p2p`; the wrapper that records the step loss and evaluates is
`llmtrain.paddle_compat.dualpipe.DualPipeV`):
  * `dualpipe_problems` (llmtrain/parallel/dualpipe_checks.py, without paddle, so that the planner's ranking never
    imports it): the layouts it is built for, the others refused with the reason (models and data: any; packed
    documents' position and document ids travel with the hidden states, `paddle_compat.dualpipe.CarriedCommHelper`);
  * `SplitWeightGradRoles`: the layer factory whose plain linears split their weight gradient;
  * `LocalTiedHead`: the output projection of a tied word table. Both ends of the V sit on stage 0, so the head
    uses the embedding's own table through fleet's `LocalSharedLayerDesc` (one tensor, no copy to keep in step;
    fleet's `SharedLayerDesc` is refused by its DualPipeV PipelineLayer).

Beside pp: data-parallel replicas (dp; fleet's HybridParallelOptimizer all-reduces the gradients after the
schedule), stage-1 sharding and expert parallelism inside each stage (ep over the dp x sharding ranks of the stage,
llmtrain/parallel/experts.py) compose with it unchanged, each equal to one process on CPU. Mixture-of-Experts:
the MoE layers of both arms of a stage's V feed their balancing losses to the backward through their outputs
(gradient 1 / micro-batches, as DualPipeV divides each micro-batch's LM loss by accumulate_steps like 1F1B), the
loss is computed and kept on stage 0 and broadcast to the stages, and the routing statistics and the
auxiliary-loss-free bias follow each layer's slot wherever its chunk runs (llmtrain/parallel/moe_pipeline.py).
"""
from __future__ import annotations

import paddle.nn as nn

from llmtrain.contracts import tags
from llmtrain.models.roles import Roles, tag_linear


def _split_linear(in_features: int, out_features: int, bias: bool) -> nn.Layer:
    from paddle.distributed.fleet.meta_parallel.zero_bubble_utils import SplitBWLinear

    return SplitBWLinear(in_features, out_features, bias_attr=None if bias else False)  # weight [in, out]


class SplitWeightGradRoles(Roles):
    """The single-device factory with every plain linear built as fleet's `SplitBWLinear` (same parameters, same
    initialisation: a subclass of `nn.Linear`): its backward returns d(input) and leaves d(weight) = x^T dy to
    `WeightGradStore` when DualPipeV's schedule enables it (run later in a W pass), else computes it at once."""

    def column_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Layer:
        return tag_linear(_split_linear(in_features, out_features, bias), "column", in_features, out_features)

    def row_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Layer:
        return tag_linear(_split_linear(in_features, out_features, bias), "row", in_features, out_features)

    def replicated_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Layer:
        return tag_linear(_split_linear(in_features, out_features, bias), "replicated", in_features, out_features)

    def output_linear(self, hidden_size: int, vocab_size: int) -> nn.Layer:
        layer = _split_linear(hidden_size, vocab_size, False)
        tags.set_role(layer, "output_linear")
        return layer


class LocalTiedHead(nn.Layer):
    """The output projection of a tied word table on the stage that also holds the embedding (DualPipeV's stage 0):
    [b, s, h] -> logits [b, s, V] through the embedding's own table, handed over by fleet's `LocalSharedLayerDesc`
    as `shared_weight`. The table is not registered again (it keeps its one canonical name, `embed.word.weight`)."""

    def __init__(self, cfg, roles, prefix: str = "embed", shared_weight=None, **_layer_specific):
        super().__init__()
        if shared_weight is None:
            raise ValueError("LocalTiedHead is the second use of a tied table: build it through LocalSharedLayerDesc")
        self.roles = roles
        self._table = (shared_weight,)  # a tuple: not a second registration of the parameter

    @property
    def shared_weight(self):
        return self._table[0]  # [V, h]

    def forward(self, hidden):  # [b, s, h]
        return self.roles.tied_logits(hidden, self.shared_weight)  # [b, s, V]

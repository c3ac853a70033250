"""Main-gradient training: an fp32 gradient accumulation buffer (`param.main_grad`) beside each bf16/fp16 parameter.

    python llmtrain/pretrain.py +parallel=sharding2 parallel.sharding_split_param=true train.amp=bf16
    on = main_grad_on(cfg.train, layout)                 # train.main_grad, or what the layout's knobs need
    core, optimizer = attach_main_grad(core, optimizer, amp)   # after AMP's decorate, before fleet wraps them

What PaddleNLP calls `amp_master_grad`, through fleet's public `fleet.utils.mix_precision_utils`:
`MixPrecisionLayer` registers a gradient hook on every parameter that adds the low-precision gradient into an
fp32 `main_grad` (created on first use) and leaves `param.grad` empty; `MixPrecisionOptimizer` steps on the
`main_grad`s and zeroes them in place. fleet's fused communication buffers (`parallel.sharding_split_param`,
`sharding_tensor_fusion`, `sharding_comm_overlap`, `dp_comm_overlap`, `pp_sharding_comm_overlap`) keep the
`main_grad`s as views into one flat fp32 buffer per bucket and refuse to run without them
(`llmtrain.parallel.overlap.FUSED`), so `train.main_grad` defaults on when one of those is switched on.

Numerics against the default path (bf16 `param.grad` accumulated over micro-batches, then the O2 optimizer's
fp32 master weights): the same update, except that the micro-batch gradients are summed in fp32 instead of bf16
(one bf16 rounding per micro-batch instead of one per addition): exact with one micro-batch, closer to the fp32
sum with several. In fp32 (CPU, `train.amp=none`) the two paths give the same numbers to the last bit
(tests/train/test_main_grad.py). Parameters stay in their dtype: MixPrecisionLayer's dtype argument is only
checked, the hooks cast nothing.

Under ep the routed experts' fp32 gradients are reduced over their expert-data-parallel group by
`llmtrain.parallel.expert_states` (V2: their own buckets), and under cp fleet's dp x sep all-reduce sums them
(tests/parallel/test_expert_parity.py and test_context_parity.py: `*_mg` runs).

Under sequence parallelism fleet's hooks (`register_sequence_parallel_allreduce_hooks`, registered before these)
all-reduce each norm weight's gradient over tp after the last micro-batch: they run after the gradient is
accumulated and reduce `param.main_grad` when it exists, before V2's bucket hooks (registered later, by
fleet.distributed_optimizer) reduce-scatter the bucket (tests/parallel/test_parity.py: tp2sharding2v2's llama_v2sp).

Under LoRA only the adapters are in the optimizer (the base is stop_gradient, `llmtrain.train.lora`), so every
fused-buffer knob buckets the adapters alone: V2 and V1 (`_tensor_fusion`) lay out the optimizer's list (fleet's
tensor_fusion_helper.py asserts each parameter trainable, lines 146 and 390), the pipeline's buckets take the
parameters that are not stop_gradient (pipeline_parallel.py, fused_gradient, line 974), and the hooks of a frozen
parameter never fire (tests/parallel/test_parity.py: `llama_lora_tf`, `llama_lora_dpov`, `llama_lora_ppov`). LoRA
with `train.main_grad=true` and no fused-buffer knob runs under sharding stage 1 (V1 reduces the adapters' main
gradients), under tp and under pp, each alone (fleet's hybrid optimizer steps the adapters' main gradients): the
layouts tested (`llama_lora_mg` in sharding2, tp2 and pp2); beside dp, cp, ep or another degree it is not built.

The layer wrapper itself is not kept (PaddleNLP's pipeline recipe does the same): its constructor's hooks are
the whole effect, so the model keeps its class (a pipeline stays a PipelineLayer for fleet).
"""
from __future__ import annotations

MAIN_GRAD_LAYOUTS = ("dp beside tp, pp, cp or sharding (not alone), sharding stage 1 (V1 or V2) and ZeRO-2 (dp > 1 "
                     "included), pp, tp and sequence parallelism, cp and ep, and LoRA under a fused-buffer knob or "
                     "sharding stage 1, tp or pp alone (no ZeRO-3)")


def main_grad_on(train_cfg, layout) -> bool:
    """`train.main_grad` when set; else on exactly when a switched-on knob of the layout needs it."""
    from llmtrain.parallel.overlap import needs_main_grad

    if train_cfg.main_grad is not None:
        return bool(train_cfg.main_grad)
    return layout is not None and needs_main_grad(layout)


def main_grad_problems(train_cfg, parallel, lora: bool, tied: bool = False) -> list[str]:
    """Refusals, with the fields: main_grad switched off under a knob that needs it, or on where it is not built.
    `tied`: the model ties its input and output embeddings (`model.tie_embeddings`)."""
    from llmtrain.parallel.overlap import FUSED

    fused = [k for k in FUSED if parallel is not None and getattr(parallel, k, False)]
    if train_cfg.main_grad is False and fused:
        return [f"train.main_grad=false with parallel.{fused[0]}=true: fleet's fused communication buffers hold "
                "fp32 main gradients (llmtrain.parallel.overlap.FUSED); leave train.main_grad unset or true"]
    if not (train_cfg.main_grad or fused):
        return []
    where = ["train.batch_rampup"] if train_cfg.batch_rampup is not None and fused else []  # buffers fix the count
    if parallel is not None:
        zero = parallel.sharding > 1 and parallel.sharding_stage > 1
        # ZeRO-2: Paddle's GroupShardedStage2 reduces main_grad over sharding, fleet's dp all-reduce after it
        # (tests/parallel/test_expert_parity.py: dp2 x sharding2, dense and experts); ZeRO-3: not built
        where += [f"parallel.sharding_stage={parallel.sharding_stage}"] if zero and parallel.sharding_stage > 2 else []
        if parallel.dp > 1 and parallel.tp == parallel.pp == parallel.sharding == parallel.cp == 1:
            # fleet's pure data-parallel mode: paddle.DataParallel's reducer all-reduces `.grad`, which the main_grad
            # hooks empty, and fleet's optimizer leaves dp to it: the gradients are never summed (measured: Llama
            # under dp2, step 1 grad_norm 0.768 for one process's 0.543)
            where.append(f"parallel.dp={parallel.dp} alone (paddle.DataParallel)")
    one = parallel is not None and parallel.dp == parallel.cp == 1 and parallel.ep == 1 and \
        (parallel.sharding == 1 or parallel.sharding_stage == 1)
    # the layouts tested with LoRA and no fused knob: sharding stage 1, tp or pp, each alone (sharding2, tp2, pp2)
    stage1 = one and sum(d > 1 for d in (parallel.sharding, parallel.tp, parallel.pp)) == 1
    # LoRA: only the adapters train (the base is stop_gradient and outside the optimizer); V2's buckets, V1's fused
    # parameters and buckets and the pipeline's buckets hold the adapters alone; without a fused knob, tested under
    # sharding stage 1, tp and pp alone (tests/parallel/test_parity.py: llama_lora_mg); elsewhere: not built
    where += ["finetune.lora.rank > 0"] if lora and not (stage1 or fused) else []
    if parallel is not None and tied and parallel.pp > 1 and parallel.sharding_split_param and \
            parallel.pp_sharding_comm_overlap:
        # fleet 3.3.1 reduce-scatters the pipeline's buckets (scale_grads) before it sums the tied table's gradient
        # over the stages holding it (allreduce_shared_weight_gradients); the table's V2 slice on stage 0 and on the
        # last stage cover different elements, so that sum adds a sharding-summed part to an unsummed one (measured:
        # a tied GPT under sharding2 x pp2, grad_norm 1.5639 for one process's 1.5647, the loss 1.5e-5 off by step 3)
        return [f"parallel.sharding_split_param=true with parallel.pp_sharding_comm_overlap=true and "
                f"model.tie_embeddings=true under parallel.pp={parallel.pp}: fleet 3.3.1 sums the tied table's gradient "
                "over the pipeline stages after its V2 slices were reduce-scattered, and the stages' slices differ; "
                "untie the embeddings, or drop one of the two options"]
    if where:
        return [f"train.main_grad (on{' for parallel.' + fused[0] if fused else ''}) with {', '.join(where)}: not "
                f"built; main-gradient training runs under {MAIN_GRAD_LAYOUTS}"]
    return []


def attach_main_grad(core, optimizer, amp):
    """fp32 `main_grad` hooks on every parameter of `core` and an optimizer that steps on them; returns
    (core, optimizer). `amp` (an `AmpPlan`) names the dtype fleet's wrapper checks (bf16 when training in fp32)."""
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer, MixPrecisionOptimizer

    MixPrecisionLayer(core, dtype=amp.dtype if amp.enabled else "bfloat16")  # its hooks are the effect
    return core, MixPrecisionOptimizer(optimizer)

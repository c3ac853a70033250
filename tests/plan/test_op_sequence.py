"""The planner's GEMMs are the GEMMs the model executes: `python -m pytest tests/plan/test_op_sequence.py`.

The planner's kernel list (`llmtrain.plan.kernels.micro_batch_kernels`) is written by hand beside the model; this
traces one micro-batch's forward and backward of the real model on CPU with Paddle's profiler (every operator
the dygraph engine runs, C++-launched gradient nodes included) and checks, per family and mode, that

- the forward runs exactly as many GEMMs (matmul, bmm, linear) as the planner lists, of the same shapes
  (m, n, k, batch), recorded at the Python entry points the model calls and required to account for every GEMM
  the profiler saw (so none is hidden from the shape record);
- the backward runs exactly as many: two per GEMM gradient node (dX and dW) plus the GEMMs run as plain ops in
  the backward (a recomputed block's forward, a PyLayer's own backward, as FP8's);
- under recompute (whole blocks, the attention layer, its core, the MLP, the MoE feed-forward, its shared experts,
  in all or some blocks) the GEMMs the recomputed functions run again in the backward are the planner's replayed
  forward kernels (`_Pass.replayed`, whose FLOPs also price partial recompute: `plan.recompute.part_flops_share`).

- the memory-bound and host-side operators of the forward (and of the recomputed forwards) by class: norms, RoPE,
  activations, softmax, embedding, cross entropy, the MoE router's and dispatch's top-k, one_hot, cumsum, logsumexp,
  gathers and scatters, counted per class as the planner lists them (`CLASS_OF` maps the CPU's operator names,
  stand-ins for GPU kernels included, to the planner's classes; `NOT_COMPARED` lists every other operator with why;
  an operator in neither fails);
- the backward's gradient nodes by class (a norm's, RoPE's, an activation's, softmax's, the embedding's, cross
  entropy's, logsumexp's, a row gather's: `BWD_CLASS_OF`) against the planner's `*_bwd` kernels (`PLANNED_BWD_CLASS`);
  every other node listed in `BWD_NOT_COMPARED` with why;
- the optimizer step (global-norm clip, AdamW) by class, over the tensors the planner's `rank_tensors` lists;
- context parallelism (ring, cp2): one rank's GEMMs, the ring's blocks included (a cp group of two threads; the ring
  on flash attention: tests/gpu_paths/test_cp_ring_flash.py);
- expert parallelism (ep2, all-gather dispatcher): one rank's GEMMs, its local experts' included, and its exchanges
  (an ep group of two threads);
- FP8 (blockwise, the GPU path rehearsed): every quantisation call against the planner's FP8 pricing list.

Tensor parallelism (multi-process) is checked per rank in the tp2 parity launch (tests/plan/tp_ops.py). What it does
not hold: elementwise ops by class (see `NOT_COMPARED`, `BWD_NOT_COMPARED`). Dropless MoE's expert GEMM rows depend
on the routing, so its expert bmm are compared by count, batch and width, not rows (capacity MoE: rows too).
"""
from __future__ import annotations

import collections
import math
import os
import sys

import paddle
import paddle.profiler as profiler
import pytest

from llmtrain.config import compose_config, to_config
from llmtrain.contracts.steps import mean_loss
from llmtrain.models import build_model
from llmtrain.models.init import init_parameters
from llmtrain.models.stages import canonical_parameters
from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..", "gpu_paths")]  # gemm_record; cp_threads
from gemm_record import _Record  # noqa: E402

FORWARD_GEMMS = {"matmul", "bmm", "linear"}
GRAD_NODES = {"Global_MatmulGradNode", "Global_BmmGradNode", "Global_LinearGradNode"}
CASES = {
    "gpt": ["model=gpt-tiny"],
    "llama": ["model=llama-tiny"],
    "llama-full-recompute": ["model=llama-tiny", "train.recompute=full"],
    "qwen3-qk-norm": ["model=llama-tiny", "model.qk_norm=true"],
    "llama-fused": ["model=llama-tiny", "model.fuse_qkv=true", "model.fuse_ffn=true"],
    "ernie-encoder": ["model=ernie-tiny"],
    "moe-capacity": ["model=moe-tiny", "model.moe_capacity_factor=1.25"],
    "moe-dropless": ["model=moe-tiny"],
    "moe-full-recompute": ["model=moe-tiny", "model.moe_capacity_factor=1.25", "train.recompute=full"],
    "deepseek-mla": ["model=deepseek-tiny"],
    "llama-fp8": ["model=llama-tiny", "train.fp8=blockwise"],
    "llama-core-attn": ["model=llama-tiny", "train.recompute=core_attn"],
    "qwen3-full-attn": ["model=llama-tiny", "model.qk_norm=true", "train.recompute=full_attn"],
    "llama-mlp-norm-first": ["model=llama-tiny", "train.recompute=selective", "train.recompute_modules=[mlp,norm]",
                             "train.recompute_layers=first:1"],
    "moe-recompute-moe": ["model=moe-tiny", "model.moe_capacity_factor=1.25", "train.recompute=selective",
                          "train.recompute_modules=[moe]"],
    "moe-act-shared": ["model=moe-tiny", "train.recompute=selective", "train.recompute_modules=[moe_act,shared_experts]"],
    "mla-core-attn": ["model=deepseek-tiny", "train.recompute=core_attn"],
    "moe-gelu-experts": ["model=moe-tiny", "model.activation=gelu", "model.moe_capacity_factor=1.25"],
}

# The memory-bound and host-side operators the CPU runs, by the planner class they are compared as. The CPU runs
# stand-ins for GPU kernels: the unfused RMSNorm (one rsqrt per norm; the fused `rms_norm` on a GPU), the unfused
# RoPE (one rotate-half chunk, split_with_num, per rotated tensor; `fused_rotary_position_embedding` on a GPU), the
# unfused SwiGLU (silu; `swiglu` on a GPU), the math attention core's softmax (flash attention's own on a GPU).
CLASS_OF = {
    "matmul": "gemm", "bmm": "gemm", "linear": "gemm",
    "rsqrt": "norm", "rms_norm": "norm", "layer_norm": "norm",
    "split_with_num": "rope", "fused_rotary_position_embedding": "rope",
    "silu": "activation", "gelu": "activation", "swiglu": "activation",
    "softmax": "softmax", "sigmoid": "softmax",  # a sigmoid router's scores: priced as the router softmax's row
    "embedding": "embedding",
    "cross_entropy_with_softmax": "cross_entropy",
    "topk": "topk", "one_hot": "one_hot", "cumsum": "cumsum", "logsumexp": "logsumexp",
    "gather": "gather_rows", "scatter": "scatter", "index_add": "index_add",
    "c_embedding": "embedding",  # the vocabulary-parallel embedding's lookup (tp)
}
PLANNED_CLASS = {"layernorm": "norm", "rmsnorm": "norm", "rope": "rope", "swiglu": "activation", "gelu": "activation",
                 "moe_swiglu_view": "activation", "softmax": "softmax", "moe_softmax": "softmax",
                 "embedding": "embedding", "cross_entropy": "cross_entropy", "moe_one_hot": "one_hot",
                 "moe_cumsum_emajor": "cumsum", "moe_cumsum": "cumsum", "moe_logsumexp": "logsumexp",
                 "moe_gather_rows": "gather_rows", "moe_scatter_i64": "scatter", "moe_index_add_inv": "index_add",
                 "moe_index_add_rows": "index_add"}
"""The planner's kernel classes (`Kernel.op`; `moe_topk*` too) as the classes above; `gemm` by kind."""
NOT_COMPARED = {
    **dict.fromkeys(["add", "multiply", "scale", "divide", "div_scale", "pow", "elementwise_pow", "mean", "sum", "cast",
                     "clip", "not_equal", "greater_equal", "greater_than", "less_equal", "less_than", "bitwise_and",
                     "bitwise_not", "where", "full_like", "concat", "transpose", "repeat_interleave", "triu", "tile",
                     "take_along_axis", "stack"],
                    "elementwise and copies: priced by the planner's add / mul / reduce / cast / copy rows, counted as "
                    "the GPU twin runs them (the CPU decomposes norms, RoPE and the masks into more ops)"),
    **dict.fromkeys(["reshape", "squeeze", "unsqueeze", "expand", "slice", "split"],
                    "views (shape bookkeeping): host time only, `view` kernels"),
    **dict.fromkeys(["cos", "sin", "arange"], "RoPE's cos/sin tables ([s, d/2], made in each layer's forward) and the "
                                              "aranges of positions and masks: not priced (s·d elements)"),
    "full": "fills: the causal mask's and index buffers' initial values (priced inside moe_fill and the mask's row)",
    "max": "reductions: FP8's per-tile amax (priced inside its GEMMs) and dropless MoE's counts.max() for C (the "
           "planner's `sync` host read), not told apart by name",
    **dict.fromkeys(["abs", "isfinite", "minimum", "view_dtype"],
                    "FP8 blockwise quantisation's CPU stand-in (fp8_quant_blockwise on a GPU): priced inside each FP8 "
                    "GEMM (`llmtrain.plan.fp8`: its operands' quantisations)"),
}


BWD_CLASS_OF = {
    "Global_RsqrtGradNode": "norm", "Global_RmsNormGradNode": "norm", "Global_LayerNormGradNode": "norm",
    "Global_SplitWithNumGradNode": "rope", "Global_FusedRotaryPositionEmbeddingGradNode": "rope",
    "Global_SiluGradNode": "activation", "Global_GeluGradNode": "activation", "Global_SwigluGradNode": "activation",
    "Global_SoftmaxGradNode": "softmax", "Global_SigmoidGradNode": "softmax",
    "Global_EmbeddingGradNode": "embedding", "Global_CrossEntropyWithSoftmaxGradNode": "cross_entropy",
    "Global_LogsumexpGradNode": "logsumexp", "Global_GatherGradNode": "gather_rows",
}
"""The backward's gradient nodes (one per forward op that needs a gradient: the CPU runs each as one fused launch)
by the class of the forward op they differentiate; the planner's backward kernels by `PLANNED_BWD_CLASS`."""
PLANNED_BWD_CLASS = {"layernorm_bwd": "norm", "rmsnorm_bwd": "norm", "rmsnorm": "norm", "rope_bwd": "rope",
                     "swiglu_bwd": "activation", "gelu_bwd": "activation", "moe_swiglu_view_bwd": "activation",
                     "softmax_bwd": "softmax", "moe_softmax_bwd": "softmax", "embedding_bwd": "embedding",
                     "cross_entropy_bwd": "cross_entropy", "moe_logsumexp_bwd": "logsumexp",
                     "moe_index_add_inv": "gather_rows", "moe_index_add_rows": "gather_rows"}
"""The planner's backward kernel classes (`Kernel.of` first: the unfused RMSNorm's rsqrt gradient) as the classes
above (a row gather's gradient is its index_add into the source rows)."""
BWD_NOT_COMPARED = {
    **dict.fromkeys(["Global_AddGradNode", "Global_MultiplyGradNode", "Global_ScaleGradNode", "Global_DivScaleGradNode",
                     "Global_DivideGradNode", "Global_PowGradNode", "Global_MeanGradNode", "Global_SumGradNode",
                     "Global_CastGradNode", "Global_ClipGradNode", "Global_WhereGradNode", "Global_ConcatGradNode",
                     "Global_StackGradNode", "Global_TransposeGradNode", "Global_RepeatInterleaveGradNode",
                     "Global_TakeAlongAxisGradNode", "Global_TileGradNode", "Global_MaxGradNode",
                     "Global_GradNodeAccumulation"],
                    "elementwise ops', copies' and reductions' gradients and the parameters' gradient accumulation: "
                    "the planner's add / mul / reduce / copy rows, counted as the GPU twin runs them (the CPU "
                    "decomposes norms, RoPE and the masks into more ops, each with its node)"),
    **dict.fromkeys(["Global_ReshapeGradNode", "Global_SqueezeGradNode", "Global_UnsqueezeGradNode",
                     "Global_ExpandGradNode", "Global_SliceGradNode", "Global_SplitGradNode"],
                    "views' gradients (shape bookkeeping, or a sum over an expanded axis: the planner's reduce rows)"),
    **dict.fromkeys(["Global_MatmulGradNode", "Global_BmmGradNode", "Global_LinearGradNode"],
                    "GEMMs' gradients (compared by count above)"),
    "Global_GradNodePyLayer_*": "a PyLayer's own backward (the fused projections' ConcatLinear, FP8's _EmulatedGemm): "
                                "its ops are traced as plain operators",
}
"""Every other gradient node, with why it is not compared by class (a node in neither table fails)."""


def _classes(ops, not_compared=NOT_COMPARED) -> collections.Counter:
    """Traced operator names -> counts per compared class; an operator neither classed nor listed fails."""
    unknown = sorted({n for n in ops if n not in CLASS_OF and n not in not_compared})
    assert not unknown, f"operators neither classed (CLASS_OF) nor listed as not compared (NOT_COMPARED): {unknown}"
    return collections.Counter(CLASS_OF[n] for n in ops if n in CLASS_OF)


def _planned_classes(kernels) -> collections.Counter:
    """The planner's kernels -> counts per compared class (`Kernel.of` first: the unfused RMSNorm's rsqrt step)."""
    out = collections.Counter()
    for k in kernels:
        if k.kind == "gemm":
            out["gemm"] += 1
        elif k.op.startswith("moe_topk"):
            out["topk"] += 1
        elif (k.of or k.op) in PLANNED_CLASS:
            out[PLANNED_CLASS[k.of or k.op]] += 1
    return out


def _bwd_classes(ops) -> collections.Counter:
    """The backward's gradient nodes -> counts per compared class (plain operators: the recomputed forwards'; an
    engine's `full`); a node in neither table fails."""
    nodes = [n for n in ops if "GradNode" in n]
    unknown = sorted({n for n in nodes if n not in BWD_CLASS_OF and not _is_listed(n)})
    assert not unknown, f"gradient nodes neither classed (BWD_CLASS_OF) nor listed (BWD_NOT_COMPARED): {unknown}"
    return collections.Counter(BWD_CLASS_OF[n] for n in nodes if n in BWD_CLASS_OF)


def _is_listed(node: str) -> bool:
    return node in BWD_NOT_COMPARED or node.startswith("Global_GradNodePyLayer_")


def _planned_bwd_classes(kernels) -> collections.Counter:
    """The planner's backward kernels -> counts per compared class."""
    return collections.Counter(PLANNED_BWD_CLASS[k.of or k.op] for k in kernels if (k.of or k.op) in PLANNED_BWD_CLASS)


def _operators(fn):
    """(fn's result, names of the operators the dygraph engine ran inside it)."""
    prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=lambda _: None)  # no trace file
    prof.start()
    try:
        out = fn()
    finally:
        prof.stop()
    names = []

    def walk(node):  # every operator, at any depth (a recomputed forward runs inside a gradient node)
        if node.type == profiler.TracerEventType.Operator:
            names.append(node.name.replace(" dygraph", ""))
        for child in node.children_node:
            walk(child)

    for root in prof.profiler_result.get_data().values():
        walk(root)
    return out, names


@pytest.mark.parametrize("case", list(CASES))
def test_planned_gemms_are_the_executed_gemms(case, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the profiler writes its trace into the working directory
    cfg = to_config(compose_config(["model.vocab_size=256", "model.num_layers=2", *CASES[case]]))
    record = _Record(monkeypatch)
    paddle.seed(0)
    from llmtrain.models.recompute import recompute_of

    rc = recompute_of(cfg.train, cfg.model.num_layers, [])
    model = build_model(cfg.model, recompute=rc)
    init_parameters(canonical_parameters(model), cfg.model, 7)
    if cfg.train.fp8 != "none":
        from llmtrain.fp8.apply import apply_fp8

        apply_fp8(model, cfg.train.fp8)
    model.train()
    b, s = 2, 16
    ids = paddle.randint(0, cfg.model.vocab_size, [b, s])
    labels = paddle.randint(0, cfg.model.vocab_size, [b, s])
    record.on = True
    loss, fwd_ops = _operators(lambda: mean_loss(model.loss_fn(model(ids), (labels, paddle.ones([b, s], "float32")))))
    executed_fwd = list(record.shapes)
    record.shapes.clear()
    record.again.clear()
    _, bwd_ops = _operators(loss.backward)
    record.on = False
    executed_again = list(record.again)  # the recomputed functions' GEMMs, run again in the backward

    planned = micro_batch_kernels(MicroBatchSpec(cfg.model, b, s, t=1, e=4, gpu=False, flash=False, math_core=False,
                                                 ce_core=False, recompute=rc))
    planned_again = [k.shape for ks, n, *prefix in planned.backward_segments for _ in range(n)
                     for k in ks[:prefix[0] if prefix else 0] if k.kind == "gemm"]
    planned_fwd = [k.shape for k in planned.forward if k.kind == "gemm"]
    planned_bwd = [k for k in planned.backward if k.kind == "gemm"]

    ops = collections.Counter(fwd_ops)
    assert sum(ops[n] for n in FORWARD_GEMMS) == len(executed_fwd), (ops, len(executed_fwd))  # none unrecorded
    if cfg.model.moe_num_experts and cfg.model.moe_capacity_factor <= 0:  # dropless: the expert bmm's rows are the
        # step's busiest expert's load (the planner's an expectation): compare the rest
        strip = lambda shapes: sorted((n, k, bt) if bt > 1 else (m, n, k, bt) for m, n, k, bt in shapes)  # noqa: E731
        assert strip(executed_fwd) == strip(planned_fwd)
        assert strip(executed_again) == strip(planned_again)
    else:
        assert sorted(executed_fwd) == sorted(planned_fwd)
        assert sorted(executed_again) == sorted(planned_again)
    assert bool(executed_again) == rc.on, "a recompute mode that re-runs no GEMM, or GEMMs re-run without one"
    assert _classes(fwd_ops) == _planned_classes(planned.forward)
    if rc.on:  # the plain operators in the backward are the recomputed forwards (and the engine's fills)
        planned_again_k = [k for ks, n, *prefix in planned.backward_segments for _ in range(n)
                           for k in ks[:prefix[0] if prefix else 0]]
        assert _classes([n for n in bwd_ops if "GradNode" not in n]) == _planned_classes(planned_again_k)
    bops = collections.Counter(bwd_ops)
    executed_bwd = 2 * sum(bops[n] for n in GRAD_NODES) + sum(bops[n] for n in FORWARD_GEMMS)
    assert executed_bwd == len(planned_bwd), (bops, len(planned_bwd))
    gradients = [k for ks, n, *prefix in planned.backward_segments for _ in range(n)
                 for k in ks[prefix[0] if prefix else 0:]]  # (a recomputed forward's kernels left out)
    assert _bwd_classes(bwd_ops) == _planned_bwd_classes(gradients), (case, _bwd_classes(bwd_ops))


def test_a_cp_ranks_gemms_are_the_planned_ones(monkeypatch):
    """Context parallelism (ring, cp2) on one rank: the model's cp code path run whole by a cp group of two threads
    (tests/gpu_paths/cp_threads.py; the exchange's collectives through shared memory), the first rank's GEMMs
    recorded: its projections, MLP and head on its s/cp positions and the ring's blocks (forward, and the ring's own
    backward, whose GEMMs are called from Python) are the planner's list for cp=2 (`kernels._ring_math_core`)."""
    import types

    from cp_threads import ThreadGroup

    from llmtrain.models.roles import Roles
    from llmtrain.parallel.context import ContextPlan
    from llmtrain.parallel.context_chunks import ChunkLayout

    cp, b, s = 2, 2, 16
    cfg = to_config(compose_config(["model.vocab_size=256", "model.num_layers=2", "model=llama-tiny"]))
    group = ThreadGroup(cp)
    group.install(monkeypatch)
    record = _Record(monkeypatch, mine=lambda: group.rank == 0)
    traced = {}

    def rank(r):
        paddle.seed(0)
        plan = ContextPlan(types.SimpleNamespace(cp_rank=r, cp_world=cp, cp_group=group), "ring")
        model = build_model(cfg.model, roles=plan.roles(Roles()))
        init_parameters(canonical_parameters(model), cfg.model, 7)
        model.train()
        ids = paddle.randint(0, cfg.model.vocab_size, [b, s // cp])  # this rank's chunks (ids, labels: any)
        positions = paddle.to_tensor(ChunkLayout(s, cp).index(r)).unsqueeze(0).expand([b, s // cp])
        labels = paddle.randint(0, cfg.model.vocab_size, [b, s // cp])
        loss = mean_loss(model.loss_fn(model(ids, positions), (labels, paddle.ones([b, s // cp], "float32"))))
        if r == 0:
            traced["forward"] = list(record.shapes)
            record.shapes.clear()
        group.barrier.wait()
        loss.backward()
        if r == 0:
            traced["backward"] = list(record.shapes)

    record.on = True
    group.run(rank)
    record.on = False
    planned = micro_batch_kernels(MicroBatchSpec(cfg.model, b, s, t=1, e=4, gpu=False, flash=False, math_core=False,
                                                 ce_core=False, cp=cp))
    assert sorted(traced["forward"]) == sorted(k.shape for k in planned.forward if k.kind == "gemm")
    ring_backward = [k.shape for k in planned.backward if k.kind == "gemm" and k.op.startswith("ring.")]
    assert sorted(traced["backward"]) == sorted(ring_backward)  # (the linears' gradients: C++ nodes, not recorded)
    assert len(ring_backward) == cfg.model.num_layers * cp * 5


OPTIMIZER_CLASS = {"squared_l2_norm": "reduce", "add_n": "add", "multiply_": "mul", "adamw_": "adamw"}
"""The optimizer step's operators as the planner's classes (`optimizer_kernels`: a squared norm per tensor, their
sum, a scale per tensor; AdamW, one kernel per tensor, is the profile's fitted `optimizer_seconds`)."""
OPTIMIZER_NOT_COMPARED = {
    **dict.fromkeys(["sqrt", "maximum", "scale", "divide", "full", "reshape"],
                    "the clip's scalar arithmetic (sqrt, max(norm, c) + 1e-6, c / that): the planner's one scalar add"),
    "full_": "the optimizer's state made at its first step (moments, beta powers): once per run, not priced",
}


@pytest.mark.parametrize("model", ["gpt-tiny", "moe-tiny"])
def test_the_optimizer_step_runs_the_planned_kernels(model, monkeypatch, tmp_path):
    """The global-norm clip and AdamW over the model's parameters: one squared norm, one scale and one AdamW kernel
    per tensor the planner's `rank_tensors` lists for one device (the tied table once, each expert stack one tensor),
    one sum of the squares; every other operator of the step listed above with why it is not compared."""
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.plan.estimate import rank_tensors
    from llmtrain.plan.kernels import optimizer_kernels
    from llmtrain.train.optim import build_optimizer

    monkeypatch.chdir(tmp_path)
    c = to_config(compose_config(["model.vocab_size=256", "model.num_layers=2", f"model={model}"]))
    paddle.seed(0)
    net = build_model(c.model)
    init_parameters(canonical_parameters(net), c.model, 7)
    net.train()
    optimizer, _ = build_optimizer(canonical_parameters(net), c.optim, 10)
    ids = paddle.randint(0, c.model.vocab_size, [2, 16])
    mean_loss(net.loss_fn(net(ids), (ids, paddle.ones([2, 16], "float32")))).backward()
    _, ops = _operators(optimizer.step)
    unknown = sorted({n for n in ops if n not in OPTIMIZER_CLASS and n not in OPTIMIZER_NOT_COMPARED})
    assert not unknown, f"optimizer operators neither classed nor listed as not compared: {unknown}"
    traced = collections.Counter(OPTIMIZER_CLASS[n] for n in ops if n in OPTIMIZER_CLASS)
    grads, owned = rank_tensors(c.model, resolve_layout(c.parallel, c.train, 1), "none", 0)
    trained = [int(p.numel()) for p in net.parameters() if not p.stop_gradient]  # (an MoE expert_bias is moved apart)
    assert sorted(n for n, _ in owned) == sorted(trained)  # the same tensors
    planned = collections.Counter(k.op for k in optimizer_kernels(grads, owned, 1))
    planned["add"] -= 1  # the planner's scalar add (sqrt and the scale's arithmetic), not compared
    planned["adamw"] = len(owned)
    assert traced == planned


QUANT_TILE = {("1x128", False): "1x128", ("1x128", True): "1x128T", ("128x128", False): "128x128",
              ("128x128", True): "128x128T"}
"""`fp8_quant_blockwise`'s (quant_method, input_transpose) as the planner's tile variants (`llmtrain.plan.fp8`)."""


def _tiled_fp8_quant_blockwise(x, quant_method, input_transpose, return_transpose_only, output_scale_transpose,
                               using_pow2_scale, **_defaults):
    """`fp8_quant_blockwise`'s contract (Paddle 3.3.1's docstring, as tests/gpu_paths/test_fp8_blockwise.py reads it)
    with the tiles as array axes: e4m3 values of x (xᵀ when transposed) times a per-tile multiplier (448 / amax,
    a power of two below it with `using_pow2_scale`), fp32 decode scales per tile (1x128: [R, C/128], transposed
    [C/128, R]). That test's reference loops over tiles (minutes for a model's calls); this one does the same
    arithmetic at once."""
    import numpy as np

    assert x.ndim == 2 and quant_method in ("1x128", "128x128") and (return_transpose_only or not input_transpose)
    a = x.astype("float32").numpy()
    if input_transpose:
        assert quant_method == "128x128" or a.shape[0] % 128 == 0, f"a transposed 1x128 copy of {a.shape[0]} tokens"
        a = a.T
    rows, cols = a.shape
    tr, tc = (1, 128) if quant_method == "1x128" else (128, 128)
    tr, tc = min(tr, rows), min(tc, cols)
    nr, nc = -(-rows // tr), -(-cols // tc)
    padded = np.zeros([nr * tr, nc * tc], np.float32)
    padded[:rows, :cols] = a
    amax = np.abs(padded.reshape(nr, tr, nc, tc)).max(axis=(1, 3))  # [nr, nc]
    m = np.where(amax > 0, np.float32(448.0) / np.where(amax > 0, amax, 1), 1).astype(np.float32)
    if using_pow2_scale:
        m = np.exp2(np.floor(np.log2(np.minimum(m, np.float32(2.0 ** 127))))).astype(np.float32)
    scaled = (padded.reshape(nr, tr, nc, tc) * m[:, None, :, None]).reshape(nr * tr, nc * tc)[:rows, :cols]
    decode = (np.float32(1.0) / m).astype(np.float32)
    scale = decode.T if output_scale_transpose else decode
    return paddle.to_tensor(scaled).astype("float8_e4m3fn"), paddle.to_tensor(np.ascontiguousarray(scale))


def _tiled_fp8_gemm_blockwise(a, a_decode_scale, b, b_decode_scale, out_dtype, is_a_1d_scaled, is_b_1d_scaled,
                              **_defaults):
    """`fp8_gemm_blockwise`'s contract: a [M, K] @ b [N, K]ᵀ of the dequantised operands (a 1-D scaled, scales
    [K/128, M]; b 1-D [K/128, N] or 2-D [N/128, K/128]), in fp32, returned in out_dtype."""
    import numpy as np

    assert a.dtype == b.dtype == paddle.float8_e4m3fn and is_a_1d_scaled and a.shape[1] == b.shape[1]

    def dequantised(q, scale, one_d):
        rows, k = q.shape
        per = np.repeat(scale.numpy().T, 128, axis=1) if one_d else np.repeat(np.repeat(scale.numpy(), 128, 0), 128, 1)
        return q.astype("float32").numpy() * per[:rows, :k]

    out = dequantised(a, a_decode_scale, True) @ dequantised(b, b_decode_scale, is_b_1d_scaled).T
    return paddle.to_tensor(out.astype(np.float32)).astype(out_dtype)


def test_the_fp8_quantisations_are_the_planned_ones(monkeypatch, tmp_path):
    """`train.fp8=blockwise` on the GPU path (llmtrain/paddle_compat/fp8_kernels.py, its two kernels replaced by
    the rehearsal's checked stand-ins, tests/gpu_paths/test_fp8_blockwise.py): every `fp8_quant_blockwise` call of
    a micro-batch's forward and backward, as (tile, rows, cols) of the tensor quantised, is the planner's FP8 pricing
    list (`FP8Pricing.quantisations` of each FP8 GEMM it lists, the weights' `weight_quantisations`) with the
    weight cache (the first micro-batch of a step: the activations and every weight copy). The MoE model holds every
    kind of FP8 GEMM: attention projections, a dense block's MLP, the shared expert's, the routed experts' bmm (one
    GEMM per expert). (The rest of the model runs its CPU path: only the FP8 GEMMs take the GPU branch.)"""
    import paddle.incubate.nn.functional as IF

    from gpu_rehearsal import checked
    from test_fp8_blockwise import GEMM_ARGS, QUANT_ARGS

    from llmtrain.fp8.apply import apply_fp8
    from llmtrain.fp8.cache import WeightCache
    from llmtrain.fp8.linear import FP8Gemm
    from llmtrain.paddle_compat import kernels as compat_kernels
    from llmtrain.plan.fp8 import FP8Pricing, is_fp8_gemm

    monkeypatch.chdir(tmp_path)
    cfg = to_config(compose_config(["model.vocab_size=256", "model.num_layers=2", "model=moe-tiny", "model.moe_capacity_factor=1.25"]))
    assert cfg.model.moe_first_dense_layers > 0 and cfg.model.moe_num_shared_experts > 0
    quant = checked(IF.fp8_quant_blockwise, _tiled_fp8_quant_blockwise, QUANT_ARGS)
    monkeypatch.setattr(IF, "fp8_quant_blockwise", quant)
    monkeypatch.setattr(IF, "fp8_gemm_blockwise", checked(IF.fp8_gemm_blockwise, _tiled_fp8_gemm_blockwise, GEMM_ARGS))
    gpu = [False]
    monkeypatch.setattr(compat_kernels, "on_gpu", lambda: gpu[0])
    cpu_gemm = FP8Gemm._gemm

    def gpu_gemm(self, x, w):  # only the FP8 GEMM's branch sees a GPU (its backward is the PyLayer's own)
        gpu[0] = True
        try:
            return cpu_gemm(self, x, w)
        finally:
            gpu[0] = False

    monkeypatch.setattr(FP8Gemm, "_gemm", gpu_gemm)
    paddle.seed(0)
    model = build_model(cfg.model)
    init_parameters(canonical_parameters(model), cfg.model, 7)
    cache = WeightCache()
    apply_fp8(model, "blockwise", cache=cache)
    model.train()
    b, s = 2, 16
    ids = paddle.randint(0, cfg.model.vocab_size, [b, s])
    mean_loss(model.loss_fn(model(ids), (ids, paddle.ones([b, s], "float32")))).backward()
    traced = sorted((QUANT_TILE[c["quant_method"], bool(c["input_transpose"])], *c["x"].shape) for c in quant.calls)

    pricing = FP8Pricing("blockwise", model=None, weight_cache=True)
    planned = micro_batch_kernels(MicroBatchSpec(cfg.model, b, s, t=1, e=4, gpu=False, flash=False, math_core=False,
                                                 ce_core=False))
    fp8 = [k for k in planned.forward + planned.backward if k.kind == "gemm" and is_fp8_gemm(k.op)]
    acts = [q for k in fp8 for q in pricing.quantisations(k.op, *k.shape[:3])[0] * k.shape[3]]
    weights = pricing.weight_quantisations(planned.forward, planned.backward)
    assert traced == sorted(acts + weights)


@pytest.mark.parametrize("routing", ["capacity", "dropless"])
def test_an_ep_ranks_gemms_and_exchanges_are_the_planned_ones(routing, monkeypatch):
    """Expert parallelism (ep2, the all-gather dispatcher that CI's gloo runs) on one rank: the model's ep code path
    (`ExpertParallelRoles`, `ExpertParallelDispatch`) run by an ep group of two threads (tests/gpu_paths/cp_threads.py:
    `all_gather` through shared memory, and here `all_reduce`), the first rank's forward GEMMs recorded: its
    attention, dense and shared-expert GEMMs on its own tokens and its E/ep local experts' bmm over the ep C rows
    they receive ([E/ep, ep C, h]) are the planner's list for `MoEPlan(ep=2, dispatcher="allgather")`, and its
    exchanges (forward and backward, to the experts and back) are the planner's `ep_allgather` kernels. Dropless
    (capacity factor 0): C is the group's largest expert load (an all-reduce MAX, then the layer's one host read:
    the planner's `sync` kernel); the experts' rows depend on the routing, so their bmm are compared without them."""
    import types

    import numpy as np
    import paddle.distributed as dist
    from cp_threads import ThreadGroup
    from gpu_rehearsal import checked

    from llmtrain.models.roles import Roles
    from llmtrain.parallel.experts import ExpertParallelRoles
    from llmtrain.plan.moe import MoEPlan

    ep, b, s = 2, 2, 16
    factor = 1.25 if routing == "capacity" else 0.0
    cfg = to_config(compose_config(["model.vocab_size=256", "model.num_layers=2", "model=moe-tiny",
                                    f"model.moe_capacity_factor={factor}"]))
    group = members = ThreadGroup(ep)
    gathers = group.install(monkeypatch)["all_gather"]

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, sync_op=True):  # MAX only: what agree_capacity asks
        assert group is members and op == dist.ReduceOp.MAX, (group, op)
        got = members._exchange(tensor.numpy())
        tensor.copy_(paddle.to_tensor(np.max([got[r] for r in range(ep)], axis=0)), False)

    reduces = checked(dist.all_reduce, all_reduce, ("tensor", "op", "group"))
    monkeypatch.setattr(dist, "all_reduce", reduces)
    record = _Record(monkeypatch, mine=lambda: group.rank == 0)
    traced = {}

    def rank(r):
        paddle.seed(0)
        roles = ExpertParallelRoles(Roles(), types.SimpleNamespace(ep_rank=r, ep_group=group), ep, "allgather")
        model = build_model(cfg.model, roles=roles)
        init_parameters(canonical_parameters(model), cfg.model, 7)
        model.train()
        paddle.seed(1 + r)  # each rank its own tokens
        ids = paddle.randint(0, cfg.model.vocab_size, [b, s])
        loss = mean_loss(model.loss_fn(model(ids), (ids, paddle.ones([b, s], "float32"))))
        if r == 0:
            traced["forward"] = list(record.shapes)
        group.barrier.wait()
        loss.backward()

    record.on = True
    group.run(rank)
    record.on = False
    planned = micro_batch_kernels(MicroBatchSpec(cfg.model, b, s, t=1, e=4, gpu=False, flash=False, math_core=False,
                                                 ce_core=False, moe=MoEPlan(ep=ep, dispatcher="allgather",
                                                                            link=(1e9, 0.0))))
    want = [k.shape for k in planned.forward if k.kind == "gemm"]
    strip = (lambda shapes: sorted((n, k, bt) if bt > 1 else (m, n, k, bt) for m, n, k, bt in shapes)) \
        if routing == "dropless" else sorted  # noqa: E731
    assert strip(traced["forward"]) == strip(want)
    experts = [k.shape for k in planned.forward if k.op.startswith("expert.")]
    assert experts and all(bt == cfg.model.moe_num_experts // ep for *_, bt in experts)  # the local experts only
    exchanges = [k for k in planned.forward + planned.backward if k.op == "ep_allgather"]
    assert exchanges and len(gathers.calls) == ep * len(exchanges)  # (every rank's calls)
    host_reads = sum(k.kind == "sync" for k in planned.forward)
    assert len(reduces.calls) == ep * host_reads and (host_reads > 0) == (routing == "dropless")

"""The PyTorch twin issues the GEMMs llmtrain's model runs: `python -m pytest tests/plan/test_twin_ops.py`.

The twin (benchmarks/gpu_model.py, gpu_moe.py: the instrument the planner's GPU profiles are fitted with) cannot run
here (PyTorch is no dependency), so its GEMMs are recorded once per case by `python benchmarks/twin_ops.py --out
benchmarks/data/twin_ops` (forward and backward under a TorchDispatchMode, fp32 on CPU) and committed with the
SHA-256 of its sources. Per case this test
- fails when the twin's sources no longer have the recorded hashes (re-record with the command in the file);
- requires the recorded architecture to be the Paddle configuration's (the model it is compared with);
- traces the Paddle model's forward GEMMs (with the GPU path's fused q|k|v and gate|up projections, the twin's) and
  requires them to be the twin's forward GEMMs, the math attention core's left out (the twin runs flash attention:
  one call per layer and pass, counted);
- requires the twin's backward GEMMs to be the planner's backward list (checked against the model's in
  tests/plan/test_op_sequence.py) on the GPU path: the input and weight gradients of each, and under recompute the
  blocks' forward again.
- requires the twin's memory-bound and host-side ops by class (`TWIN_CLASS_OF`: norms, activations, the router's
  softmax or sigmoid, top-k, the MoE scans, scatters, row gathers, logsumexp, the dropless host read, the embedding,
  the loss) to be the planner's classes on the GPU path, forward and (under recompute) the forward re-run in the
  backward, and the gradient kernels by class (`TWIN_BWD_CLASS_OF`) to be the planner's `*_bwd` kernels.
The DeepSeek cases run the twin's latent attention and sigmoid router with the group limit
(benchmarks/gpu_deepseek.py) against `model=deepseek-tiny`, its first block dense.
Dropless MoE's expert GEMM rows are the step's busiest expert's load (random routers differ): compared by count,
batch and width. A weight gradient's output may be the transpose of Paddle's (PyTorch's tied head computes
d(tableᵀ) = xᵀ·dY): GEMMs are compared with m and n as a pair in either order (the same work and operands).
The dense cases' forward elementwise ops too: adds, products and reductions as the planner's add / mul / reduce rows,
the pieces of what Paddle fuses (RMSNorm, RoPE, SwiGLU) taken out (`FUSED_PIECES`); copies are not compared (the twin
makes each piece of a fused projection its own tensor, the planner prices Paddle's split as views).
Not covered: MoE's elementwise index arithmetic (the planner prices it as generic adds), FP8 and recompute of parts (the twin has whole-block recompute only); RoPE by class (the twin rotates q
and k in separate unfused kernels where the planner prices Paddle's one fused kernel per layer).
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import sys

import paddle
import pytest

from llmtrain.config import compose_config, to_config
from llmtrain.contracts.steps import mean_loss
from llmtrain.models import build_model
from llmtrain.models.init import init_parameters
from llmtrain.models.recompute import recompute_of
from llmtrain.models.stages import canonical_parameters
from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
from gemm_record import _Record  # noqa: E402
from test_op_sequence import _planned_bwd_classes, _planned_classes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(_HERE))
TWIN_OPS = os.path.join(REPO, "benchmarks", "data", "twin_ops")
CASES = sorted(f[:-5] for f in os.listdir(TWIN_OPS) if f.endswith(".json"))
GPU_PATH = ["model.fuse_qkv=true", "model.fuse_ffn=true"]


def _load(case: str) -> dict:
    with open(os.path.join(TWIN_OPS, f"{case}.json"), encoding="utf-8") as f:
        return json.load(f)


def _pairless(shapes, widths=None) -> list:
    """GEMMs with m and n as an unordered pair (see the module docstring); `widths` (dropless experts): batched
    GEMMs by their dimensions among these widths only (the rows, forward m or weight-gradient k, left out)."""
    out = []
    for m, n, k, b in shapes:
        if b > 1 and widths:
            out.append((tuple(sorted(d for d in (m, n, k) if d in widths)), b))
        else:
            out.append((tuple(sorted((m, n))), k, b))
    return sorted(out, key=repr)


TWIN_CLASS_OF = {
    "rsqrt": "norm", "_fused_rms_norm": "norm", "native_layer_norm": "norm",  # F.rms_norm: one rsqrt per norm on CPU
    "silu": "activation", "gelu": "activation",
    "_softmax": "softmax", "sigmoid": "softmax",  # the router's scores (and the loss's softmax: `_twin_classes`)
    "embedding": "embedding", "log": "cross_entropy",  # SoftmaxCrossEntropy: one log per loss
    "topk": "topk", "cumsum": "cumsum", "logsumexp": "logsumexp", "index_select": "gather_rows",
    "scatter_": "scatter",  # F.one_hot is a scatter_ into zeros in aten: one_hot and scatter are compared together
    "max": "host_read",  # dropless C = int(counts.max()): the full reduction the host reads
}
"""The twin's aten ops (forward, and the forward re-run in the backward) as the planner's kernel classes."""
TWIN_BWD_CLASS_OF = {"_softmax_backward_data": "softmax", "sigmoid_backward": "softmax", "silu_backward": "activation",
                     "gelu_backward": "activation", "embedding_dense_backward": "embedding", "index_add": "gather_rows"}
"""The twin's gradient kernels as the classes of the planner's `*_bwd` kernels (test_op_sequence.PLANNED_BWD_CLASS;
a row gather's gradient is its index_add). Norm gradients are not compared: CPU PyTorch decomposes RMSNorm's."""


def _twin_classes(ops: dict, a: dict) -> collections.Counter:
    """The twin's aten op counts -> counts per class (`TWIN_CLASS_OF`), written as the planner counts them: the
    loss's softmax is inside its cross entropy; GPT's learned positions are a slice of the table added (the planner
    and Paddle: a second embedding lookup, counted here as one)."""
    out = collections.Counter()
    for name, n in ops.items():
        if name in TWIN_CLASS_OF:
            out[TWIN_CLASS_OF[name]] += n
    out["softmax"] -= out["cross_entropy"]
    if a["position"] == "learned" and out["embedding"]:
        out["embedding"] += 1
    return +out


def _planner_classes(kernels) -> collections.Counter:
    """The planner's kernels by the classes of `TWIN_CLASS_OF` (one_hot counted with scatter, `sync` kernels as the
    host read; GEMMs, RoPE and index_add compared elsewhere or not)."""
    out = _planned_classes(kernels)
    out["scatter"] += out.pop("one_hot", 0)
    out["host_read"] += sum(k.kind == "sync" for k in kernels)
    for cls in ("gemm", "rope", "index_add"):
        out.pop(cls, None)
    return +out


ELEMENTWISE_CLASS = {"add": "add", "add_": "add", "clamp": "add", "mul": "mul", "div": "mul", "sum": "reduce",
                     "mean": "reduce"}
"""The twin's elementwise aten ops and reductions as the planner's `add`, `mul` and `reduce` rows (the loss's
max(count, 1) is an add-class kernel, its division a mul)."""
FUSED_PIECES = {"rms_norm": {"pow": 1, "mean": 1, "add_": 1, "mul": 2}, "rope": {"mul": 2, "add": 1},
                "swiglu": {"mul": 1}}
"""Elementwise ops the twin runs inside what the planner prices as one fused kernel, per use: CPU PyTorch's
F.rms_norm decomposed (one per rsqrt: x², its mean, + eps, x·rsqrt, ·w), the twin's unfused rotate-half RoPE per
rotated tensor (x·cos, rot(x)·sin, their sum; the planner: Paddle's fused kernel), SwiGLU's silu(g)·u (per silu)."""


def _twin_elementwise(ops: dict, a: dict) -> collections.Counter:
    """A dense twin's forward elementwise ops as the planner's rows (`ELEMENTWISE_CLASS`), the pieces of the kernels
    Paddle fuses (`FUSED_PIECES`) taken out: RMSNorm per rsqrt, RoPE per rotated q and k, SwiGLU per silu."""
    ops = collections.Counter(ops)
    uses = {"rms_norm": ops["rsqrt"], "rope": 2 * a["layers"] if a["position"] == "rope" else 0,
            "swiglu": ops["silu"] if a["activation"] == "swiglu" else 0}
    for fused, n in uses.items():
        for name, per in FUSED_PIECES[fused].items():
            ops[name] -= per * n
    assert all(v >= 0 for v in ops.values()), ops
    out = collections.Counter()
    for name, n in ops.items():
        if name in ELEMENTWISE_CLASS:
            out[ELEMENTWISE_CLASS[name]] += n
    return +out


def test_the_twin_ops_cover_each_family():
    assert {"llama", "gpt", "moe-capacity", "moe-dropless", "llama-full-recompute", "deepseek-capacity",
            "deepseek-dropless"} <= set(CASES), CASES


@pytest.mark.parametrize("case", CASES)
def test_the_twin_runs_the_models_gemms(case, monkeypatch):
    doc = _load(case)
    for name, sha in doc["sources_sha256"].items():
        with open(os.path.join(REPO, "benchmarks", name), "rb") as f:
            now = hashlib.sha256(f.read()).hexdigest()
        assert now == sha, (f"benchmarks/{name} changed since the twin's GEMMs were recorded: re-record them with "
                            f"`{doc['command']}` (in an environment with PyTorch) and commit benchmarks/data/twin_ops")
    cfg = to_config(compose_config(["model.vocab_size=256", *doc["paddle_overrides"], *GPU_PATH]))
    m, a, moe = cfg.model, doc["arch"], doc["moe"]
    ffn = m.moe_num_shared_experts * m.expert_ffn_size() if moe else m.ffn_hidden_size
    paddle_arch = {"layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads, "kv_heads": m.kv_heads(),
                   "ffn": ffn, "vocab": m.vocab_size, "norm": m.norm, "activation": m.activation,
                   "position": m.position, "bias": m.bias, "tie_embeddings": m.tie_embeddings}
    assert {k: a[k] for k in paddle_arch} == paddle_arch, f"{case}: the recorded twin is not {doc['paddle_overrides']}"
    if moe:
        assert (moe["experts"], moe["top_k"], moe["ffn"], moe["capacity_factor"]) == (
            m.moe_num_experts, m.moe_top_k, m.expert_ffn_size(), max(0.0, m.moe_capacity_factor)), case
    router = doc.get("router")
    if router is None:
        assert m.moe_first_dense_layers == 0 and m.moe_router == "softmax" and not m.is_mla(), \
            "the twin's MoE is in every block, softmax; its attention multi-head"
    else:  # benchmarks/gpu_deepseek.py: latent attention, the sigmoid router, dense blocks first
        mla = doc["mla"]
        assert (mla["q_rank"], mla["kv_rank"], mla["nope"], mla["rope"], mla["v"]) == (
            m.mla_q_lora_rank, m.mla_kv_lora_rank, m.mla_qk_nope_head_dim, m.mla_qk_rope_head_dim, m.mla_v_head_dim)
        assert m.moe_router == "sigmoid" and (router["groups"], router["keep"], router["group_score"],
                                              router["routed_scale"], router["first_dense"], router["dense_ffn"]) == (
            m.moe_n_group, m.moe_topk_group, m.moe_group_score, m.moe_routed_scale, m.moe_first_dense_layers,
            m.ffn_hidden_size), case

    record = _Record(monkeypatch)
    paddle.seed(0)
    rc = recompute_of(cfg.train, m.num_layers, [])
    model = build_model(m, recompute=rc)
    init_parameters(canonical_parameters(model), m, 7)
    model.train()
    b, s = doc["micro_batch"], a["seq"]
    ids = paddle.randint(0, m.vocab_size, [b, s])
    labels = paddle.randint(0, m.vocab_size, [b, s])
    record.on = True
    mean_loss(model.loss_fn(model(ids), (labels, paddle.ones([b, s], "float32"))))
    record.on = False
    paddle_fwd = [shape for shape, core in zip(record.shapes, record.in_core) if not core]
    cores = sum(record.in_core)
    assert cores == 2 * m.num_layers  # q·kᵀ and p·v per layer: what the twin's one attention call replaces
    assert doc["attention"][0] == m.num_layers, doc["attention"]

    widths = {m.hidden_size, m.expert_ffn_size()} if moe and moe["capacity_factor"] <= 0 else None
    assert _pairless(doc["forward"], widths) == _pairless(paddle_fwd, widths)
    planned = micro_batch_kernels(MicroBatchSpec(m, b, s, t=1, e=4, gpu=True, flash=True, recompute=rc))
    planned_bwd = [k.shape for k in planned.backward if k.kind == "gemm"]
    assert _pairless(doc["backward"], widths) == _pairless(planned_bwd, widths)
    # the twin's attention calls in the backward (its gradient, and the forward again under recompute): the planner's
    assert doc["attention"][1] == sum(k.kind in ("attn_fwd", "attn_bwd") for k in planned.backward), doc["attention"]
    # memory-bound and host-side ops by class: the forward, the forward re-run in the backward, the gradients
    fwd_ops, bwd_ops = doc["ops"]
    assert _twin_classes(fwd_ops, a) == _planner_classes(planned.forward), case
    replayed = {n: c for n, c in bwd_ops.items() if n in TWIN_CLASS_OF}
    assert _twin_classes(replayed, a) == _planner_classes(planned.backward), case
    twin_bwd = collections.Counter()
    for name, n in bwd_ops.items():
        if name in TWIN_BWD_CLASS_OF:
            twin_bwd[TWIN_BWD_CLASS_OF[name]] += n
    if a["position"] == "learned":
        twin_bwd["embedding"] += 1  # (the positions' gradient: the table slice's, see `_twin_classes`)
    planned_bwd_classes = _planned_bwd_classes(planned.backward)
    for cls in ("norm", "cross_entropy", "logsumexp", "rope"):  # not compared (TWIN_BWD_CLASS_OF's docstring)
        planned_bwd_classes.pop(cls, None)
    assert twin_bwd == planned_bwd_classes, case
    if not moe:  # the forward's elementwise rows (MoE: the planner's index arithmetic is priced as generic adds)
        planned_rows = collections.Counter(k.op for k in planned.forward if k.kind == "mem" and not k.of
                                           and k.op in ("add", "mul", "reduce"))
        assert _twin_elementwise(fwd_ops, a) == planned_rows, case

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
Dropless MoE's expert GEMM rows are the step's busiest expert's load (random routers differ): compared by count,
batch and width. A weight gradient's output may be the transpose of Paddle's (PyTorch's tied head computes
d(tableᵀ) = xᵀ·dY): GEMMs are compared with m and n as a pair in either order (the same work and operands).
Not covered: MLA (the twin has none: its DeepSeek shape is multi-head attention of the same width), group-limited
and sigmoid routers, FP8 and recompute of parts (the twin has whole-block recompute only).
"""
from __future__ import annotations

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


def test_the_twin_ops_cover_each_family():
    assert {"llama", "gpt", "moe-capacity", "moe-dropless", "llama-full-recompute"} <= set(CASES), CASES


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
        assert m.moe_first_dense_layers == 0 and m.moe_router == "softmax", "the twin's MoE is in every block, softmax"

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

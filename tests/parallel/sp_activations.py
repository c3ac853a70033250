"""Bytes saved for backward by one decoder block under tp and under tp + sequence parallelism (CPU, tp ranks).

Runs inside the tp2 launch of tests/parallel/test_parity.py (an in-process entry of
tests/e2e/multirun_worker.py, after fleet is initialised for tp2); `check` is the assertion.
It also checks, on the same ranks, that a tp block with fused projections (one matmul, one
all-reduce of d(x) per fused projection) equals the unfused one on the same weights: output,
d(input) and every parameter gradient within 1e-5 of each tensor's largest magnitude.

Counted with `llmtrain.plan.activations.saved_bytes` (`paddle.autograd.saved_tensors_hooks`,
distinct storage once, parameters excluded), fp32, math attention, micro-batch 2, seq 64:
  block      one Llama block (RMSNorm, SwiGLU, GQA, RoPE) from its input on this rank
             ([b, s, h] under tp; this rank's [s/tp, b, h] under tp + sp)
  norms      the two RMSNorms alone on the same input (the sequence-parallel region: no dropout here)
for four variants: `tp` (fused q/k/v and gate/up: one c_identity copy per sub-block), `tp_unfused` (one
copy per projection), `tp_sp` (fused: one all-gather per sub-block), `tp_sp_unfused` (one all-gather, and one
kept copy, per projection). The planner's `layer_activation_bytes` must equal each `block` figure.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: llmtest

B, S = 2, 64


def _cfg(fused: bool):
    from llmtrain.models.config import ModelConfig

    on = "true" if fused else "false"
    return ModelConfig(name="sp-act", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                       vocab_size=256, max_position_embeddings=S, position="rope", norm="rmsnorm", activation="swiglu",
                       bias=False, tie_embeddings=False, attention="math", fuse_qkv=on, fuse_ffn=on, fuse_swiglu=on)


def measure(out_dir: str) -> None:
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    from llmtrain.models.decoder import Block
    from llmtrain.parallel.sequence import SequenceParallelRoles
    from llmtrain.parallel.tensor import TensorParallelRoles
    from llmtrain.plan.activations import saved_bytes

    from llmtest import tp_topology

    hcg = fleet.get_hybrid_communicate_group()
    out = {"degree": hcg.get_model_parallel_world_size(), "batch": B, "seq": S}
    for name, roles_cls, fused in (("tp", TensorParallelRoles, True), ("tp_unfused", TensorParallelRoles, False),
                                   ("tp_sp", SequenceParallelRoles, True), ("tp_sp_unfused", SequenceParallelRoles, False)):
        roles = roles_cls(tp_topology())
        paddle.seed(5)
        block = Block(_cfg(fused), roles)
        # [b, s, h], or this rank's [s/tp, b, h]; a fresh tensor, as a block's input is past the first block
        x = roles.sequence_scatter(paddle.randn([B, S, 64])).detach().clone()
        x.stop_gradient = False
        out[name] = {"input_shape": list(x.shape), "block": saved_bytes(block, x),
                     "norms": saved_bytes(block.attn_norm, x) + saved_bytes(block.mlp_norm, x)}
    out["fused_vs_unfused_tp"] = _fused_equals_unfused()
    path = Path(out_dir) / f"rank{dist.get_rank()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


def _fused_equals_unfused() -> float:
    """One tp block with fused q/k/v and gate/up (TensorParallelRoles.column_linears: one all-reduce of d(x))
    against the unfused block on the same weights: largest difference of output, d(input) and every gradient,
    relative to that tensor's largest magnitude."""
    import numpy as np
    import paddle

    from llmtest import tp_topology
    from llmtrain.models.decoder import Block
    from llmtrain.parallel.tensor import TensorParallelRoles

    paddle.seed(7)
    x0 = paddle.randn([B, S, 64])  # the same on every rank
    results = []
    ref = None
    for fused in (False, True):
        block = Block(_cfg(fused), TensorParallelRoles(tp_topology()))
        if ref is None:
            ref = block
        else:
            block.set_state_dict(ref.state_dict())
        x = x0.clone()
        x.stop_gradient = False
        y = block(x)
        (y * y).sum().backward()
        results.append([y.numpy(), x.grad.numpy()] + [p.grad.numpy() for p in block.parameters()])
    return max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(*results))  # relative to each tensor


def check(out_dir) -> dict:
    """The norms' saved bytes shrink to 1/tp and nothing else in the block changes (fused projections); without
    fused projections each projection's gathered copy is kept on top. Returns rank 0's figures."""
    results = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    assert len(results) == 2, results
    for r in results:
        t, tp, sp, unfused = r["degree"], r["tp"], r["tp_sp"], r["tp_sp_unfused"]
        assert t == 2 and tp["input_shape"] == [B, S, 64] and sp["input_shape"] == [S // t, B, 64], r
        assert sp["norms"] * t == tp["norms"] > 0, r  # the sequence-parallel region: 1/tp per rank
        assert tp["block"] - sp["block"] == tp["norms"] - sp["norms"], r  # the rest of the block saves the same
        assert unfused["block"] > sp["block"], r  # q, k, v, gate, up each keep their own gathered [s, b, h]
        assert r["fused_vs_unfused_tp"] <= 1e-5, r
        # the planner's count of each variant, tensor by tensor (fleet's column linears keep a copy of their input)
        from llmtrain.plan.estimate import layer_activation_bytes

        for name, fused, seq in (("tp", True, False), ("tp_unfused", False, False), ("tp_sp", True, True),
                                 ("tp_sp_unfused", False, True)):
            planned = layer_activation_bytes(_cfg(fused), S, B, t, e=4, flash=False, sp=seq)
            assert planned == r[name]["block"], (name, planned, r)
    return results[0]


if __name__ == "__main__":
    measure(sys.argv[1])

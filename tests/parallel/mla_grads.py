"""Every gradient of a multi-head latent attention block under tp equals the one-device block's, on the tp ranks.

Runs inside the tp2 launch of tests/parallel/test_parity.py (an in-process entry of tests/e2e/multirun_worker.py,
after fleet is initialised for tp2); `check` is the assertion. The block (MLA with q compression, a dense SwiGLU)
and LoRA adapters on its replicated down-projections (q_a_proj, kv_a_proj), a column linear (kv_b_proj) and the
row linear (o_proj) are built twice on each rank from the same full weights (`init_parameters` by canonical name;
B non-zero): once with `TensorParallelRoles`, once with plain `Roles`. Output, input gradient and every parameter's
gradient (this rank's slice of the full one) must agree within 1e-5 of each tensor's largest magnitude: the
replicated weights' gradients need the tp sum of the shared rotary key's gradient (`Roles.head_shared`),
which the losses of a few training steps barely show.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: llmtest

B, S, H = 2, 16, 32


def _cfg():
    from llmtrain.models.config import ModelConfig

    return ModelConfig(name="mla-grad", hidden_size=H, num_layers=1, num_heads=4, ffn_hidden_size=64, vocab_size=64,
                       max_position_embeddings=S, position="rope", norm="rmsnorm", activation="swiglu", bias=False,
                       tie_embeddings=False, attention="math", mla_kv_lora_rank=16, mla_q_lora_rank=12,
                       mla_qk_nope_head_dim=8, mla_qk_rope_head_dim=8, mla_v_head_dim=6)


def _block(roles, slices):
    """One MLA block with LoRA r=2 (B drawn like A, so the adapters matter), initialised by canonical name."""
    import dataclasses

    from llmtrain.contracts import tags
    from llmtrain.models.decoder import Block
    from llmtrain.models.init import init_parameters
    from llmtrain.models.lora import LoraConfig, attach_lora
    from llmtrain.models.stages import canonical_parameters

    block = Block(_cfg(), roles)
    attach_lora(block, LoraConfig(rank=2, alpha=4.0, target_modules=[r"layers\.0\.attn\.(q_a|kv_a|kv_b|o)_proj"]),
                roles)
    for p in block.parameters():
        if tags.init_rule(p) == "zeros":  # lora_B: like lora_A's rule (a non-zero draw from its own name)
            tags.set_init(p, ("lora_a", 8))
    named = canonical_parameters(block)
    init_parameters(named, dataclasses.replace(_cfg(), init_std=0.2), seed=3, slices=slices)
    return block, named


def measure(out_dir: str) -> None:
    import numpy as np
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    from llmtrain.models.init import WHOLE
    from llmtrain.models.roles import Roles
    from llmtrain.parallel.slicing import TensorSlices
    from llmtrain.parallel.tensor import TensorParallelRoles

    from llmtest import tp_topology

    hcg = fleet.get_hybrid_communicate_group()
    rank, degree = hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size()
    slices = TensorSlices(rank, degree)
    x0 = paddle.to_tensor(np.random.default_rng(0).standard_normal([B, S, H]).astype("float32"))  # same on all ranks
    results = {}
    for name, roles, cut in (("tp", TensorParallelRoles(tp_topology()), slices), ("one", Roles(), WHOLE)):
        block, named = _block(roles, cut)
        x = x0.clone()
        x.stop_gradient = False
        y = block(x)
        (y * y).sum().backward()
        results[name] = {"y": y.numpy(), "dx": x.grad.numpy(), **{n: p.grad.numpy() for n, p in named}}
        results[name + "_params"] = dict(named)
    worst, names = 0.0, []
    for key, want in results["one"].items():
        got = results["tp"][key]
        if key not in ("y", "dx"):
            want = slices.local(want, results["tp_params"][key])  # this rank's slice of the full gradient
            names.append(key)
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    path = Path(out_dir) / f"rank{dist.get_rank()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"degree": degree, "worst": worst, "names": names}))


def check(out_dir) -> float:
    """Both tp ranks: every gradient within 1e-5 (relative); returns the largest difference seen."""
    results = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    assert len(results) == 2 and all(r["degree"] == 2 for r in results), results
    names = set(results[0]["names"])
    assert {"layers.0.attn.kv_a_proj.weight", "layers.0.attn.q_a_proj.weight", "layers.0.attn.kv_a_proj.lora_A",
            "layers.0.attn.kv_b_proj.lora_B", "layers.0.attn.o_proj.lora_A"} <= names, names
    worst = max(r["worst"] for r in results)
    assert worst <= 1e-5, results
    return worst


if __name__ == "__main__":
    measure(sys.argv[1])

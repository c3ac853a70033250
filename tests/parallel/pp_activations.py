"""Activation bytes the first pipeline stage holds under 1F1B (CPU, 2 pipeline ranks): min(pp, m) micro-batches.

Runs inside the pp2 launch of tests/parallel/test_parity.py (an in-process entry of
tests/e2e/multirun_worker.py, after fleet is initialised for pp2); `check` is the assertion.

A 4-block GPT (LayerNorm, GeLU, math attention, fp32, micro-batch 2, seq 128) cut into 2 stages by
`build_pipeline`, run by fleet's `PipelineParallel.train_batch` (SGD at lr 0: no optimizer state) with
m = 1 and m = 4 micro-batches; on each rank the peak of Paddle's host allocator during the batch
(`core.host_memory_stat_peak_value`, reset before it), after a warm-up batch so gradients exist in both.
1F1B keeps min(pp, m) micro-batches in flight on the first stage and one on the last, so the first
stage's peak at m = 4 exceeds its peak at m = 1 by one micro-batch of its blocks' saved tensors
(the planner's `layer_activation_bytes` x L/pp), the last stage's by nothing of the kind.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

B, S, LAYERS, H = 2, 128, 4, 64


def _cfg():
    from llmtrain.models.config import ModelConfig

    return ModelConfig(name="pp-act", hidden_size=H, num_layers=LAYERS, num_heads=4, ffn_hidden_size=4 * H,
                       vocab_size=256, max_position_embeddings=S, attention="math")


def measure(out_dir: str) -> None:
    import time

    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    from llmtrain.models.roles import Roles
    from llmtrain.paddle_compat.host_memory import host_peak_bytes
    from llmtrain.parallel.pipeline import build_pipeline

    start = time.perf_counter()
    hcg = fleet.get_hybrid_communicate_group()
    paddle.seed(3)
    layout = SimpleNamespace(pp=2, virtual_pp=1, pp_layers=(LAYERS // 2, LAYERS // 2))
    pipe, _ = build_pipeline(_cfg(), layout, Roles(), SimpleNamespace(hcg=hcg))
    model = fleet.distributed_model(pipe)
    opt = fleet.distributed_optimizer(paddle.optimizer.SGD(learning_rate=0.0, parameters=model.parameters()))
    model.micro_batch_size = B
    out = {"stage": hcg.get_stage_id()}
    for m in (4, 1, 4, 1):  # the first of each is a warm-up
        model.accumulate_steps = m
        ids = paddle.randint(0, 256, [m * B, S])
        labels = (paddle.randint(0, 256, [m * B, S]), paddle.ones([m * B, S], dtype="float32"))
        with host_peak_bytes() as peak:
            model.train_batch([ids, labels], opt)
        out[f"m{m}"] = peak.bytes
    out["seconds"] = time.perf_counter() - start
    path = Path(out_dir) / f"rank{dist.get_rank()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


def check(out_dir) -> dict:
    """First stage: peak(m=4) - peak(m=1) is one more micro-batch of its L/pp blocks (within 10%); last stage:
    less than a tenth of that. Returns the figures by stage."""
    from llmtrain.plan.estimate import layer_activation_bytes

    results = {r["stage"]: r for r in (json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json")))}
    assert set(results) == {0, 1}, results
    one = LAYERS // 2 * layer_activation_bytes(_cfg(), S, B, t=1, e=4, flash=False)
    first, last = (results[k]["m4"] - results[k]["m1"] for k in (0, 1))
    assert abs(first / one - 1) < 0.10, (first, one, results)
    assert last < 0.1 * one, (last, one, results)
    return {"planned_one_micro_batch": one, "first_stage_extra": first, "last_stage_extra": last}


if __name__ == "__main__":
    measure(sys.argv[1])

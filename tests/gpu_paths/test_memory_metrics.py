"""GPU-only branch `memory-metrics`: on a GPU every metrics record carries `max_memory_allocated`, the largest
peak allocation of any rank of the job (bytes).

    python -m pytest tests/gpu_paths/test_memory_metrics.py -q

`Meter.update` (llmtrain/train/metrics.py) adds the field when the topology is not on CPU, reading
`paddle.device.cuda.max_memory_allocated()` (which raises in Paddle's CPU build) and taking the maximum over the
job with `dist.all_reduce(op=MAX)`. On CPU both are stand-ins checked against the installed functions'
signatures: the allocator answers a byte count, and the all-reduce of a 2-rank job combines this rank's value with
a peer's the way the collective would. On a GPU the real allocator answers and the job is one process.
"""
from __future__ import annotations

import json

import paddle
import paddle.distributed as dist

from gpu_rehearsal import ON_GPU, checked, reaches
from llmtrain.parallel.strategy import Topology
from llmtrain.train import metrics
from llmtrain.train.step import StepOutput

PEER_BYTES = 7 * 2**30 + 3
"""The other rank's peak in the 2-rank case: larger than this rank's, so the record must show it."""


def _meter(tmp_path, world: int):
    return metrics.Meter(str(tmp_path), Topology(world=world, on_cpu=False), flops_per_token=1e6, peak=1e15,
                         log_interval=2, max_steps=4, progress_bar=False, visualdl=False)


def _step():
    return StepOutput(loss=paddle.to_tensor(2.5), tokens=64, positions=64, grad_norm=paddle.to_tensor([1.0]))


def _peer_all_reduce(tensor, op, group, sync_op):
    """Reference all_reduce of a 2-rank job whose other rank holds PEER_BYTES (MAX) or the same values (SUM)."""
    if op == dist.ReduceOp.MAX:
        tensor.set_value(paddle.maximum(tensor, paddle.full_like(tensor, PEER_BYTES)))
    elif op == dist.ReduceOp.SUM:
        tensor.set_value(tensor * 2)
    else:
        raise AssertionError(f"all_reduce op {op}: the reference models SUM and MAX")


def test_records_carry_the_largest_peak_of_the_job(monkeypatch, tmp_path):
    world = 1 if ON_GPU else 2
    if not ON_GPU:
        own = 5 * 2**30
        allocated = checked(paddle.device.cuda.max_memory_allocated, lambda device: own, ())
        monkeypatch.setattr(paddle.device.cuda, "max_memory_allocated", allocated)
        reduce = checked(dist.all_reduce, _peer_all_reduce, ("tensor", "op"))
        monkeypatch.setattr(metrics.dist, "all_reduce", reduce)
    meter = _meter(tmp_path, world)
    with reaches("memory-metrics"):
        recs = [meter.update(step, _step(), lr=1e-3, data_wait=0.0) for step in (1, 2, 3, 4)]
    assert recs[0] is None and recs[2] is None  # only log steps make a record
    logged = [r for r in recs if r is not None]
    if ON_GPU:
        assert all(0 < r["max_memory_allocated"] == paddle.device.cuda.max_memory_allocated() for r in logged)
    else:
        assert [r["max_memory_allocated"] for r in logged] == [PEER_BYTES, PEER_BYTES]
        assert allocated.calls == [{"device": None}] * 2
        assert [c["op"] for c in reduce.calls] == [dist.ReduceOp.MAX] * 2
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["max_memory_allocated"] for r in written] == [r["max_memory_allocated"] for r in logged]


def test_a_cpu_run_has_no_such_field(tmp_path):
    meter = metrics.Meter(str(tmp_path), Topology(), flops_per_token=1e6, peak=1e15, log_interval=1, max_steps=1,
                          progress_bar=False, visualdl=False)
    assert "max_memory_allocated" not in meter.update(1, _step(), lr=1e-3, data_wait=0.0)

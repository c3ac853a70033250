"""DualPipeV's activations in the planner: the replay of fleet's schedule, and what a stage is priced to hold.

    python -m pytest tests/plan/test_dualpipe_memory.py -q
"""
from __future__ import annotations

import pytest

from llmtrain.plan.dualpipe_memory import v_flights, v_held, v_least_flight


class _Recorder:
    """Stands where fleet's DualPipeVParallel keeps its state, so that fleet's own `forward_backward_pipeline` runs
    its order of passes on one stage and each pass is written down instead of computed."""

    def __init__(self, pp: int, micro_batches: int, stage: int):
        self.group_rank, self.num_ranks, self.accumulate_steps = stage, pp, micro_batches
        self.need_recv_meta, self.pp_group, self.ops = False, None, []
        self._p2p_helper = type("P2P", (), {"recv_meta_from_head": lambda *a: None})()
        self._layers = type("Layers", (), {"allreduce_shared_weight_gradients": lambda *a: None})()

    def _forward_pass(self, phase, *a, **k):
        self.ops.append(f"F{phase}")

    def _backward_pass(self, phase, *a, **k):
        self.ops.append(f"B{phase}")

    def _forward_backward_pass(self, forward_phase, backward_phase, *a, **k):
        self.ops += [f"F{forward_phase}", f"B{backward_phase}"]

    def is_pipeline_last_stage(self):
        return self.group_rank == self.num_ranks - 1

    def _weight_pass(self):
        self.ops.append("W")

    def _reset_states(self): pass
    def _wrap_data(self, data, phase): return data
    def _recv_forward(self, *a): pass
    def _send_forward(self, *a): pass
    def _recv_backward(self, *a): pass
    def _send_backward(self, *a): pass
    def _commit_and_wait_comm(self, *a): pass
    def _broadcast_final_loss(self): return None


def _fleet_states(pp: int, m: int, stage: int) -> set:
    """(down, up) micro-batches held after each forward, counted from the passes fleet's schedule runs."""
    from paddle.distributed.fleet.meta_parallel.dualpipev import DualPipeVParallel

    rec = _Recorder(pp, m, stage)
    DualPipeVParallel.forward_backward_pipeline(rec, None, None)
    held, states = [0, 0], set()
    for op in rec.ops:
        if op != "W":
            held[int(op[1])] += 1 if op[0] == "F" else -1
            assert min(held) >= 0, rec.ops
            if op[0] == "F":
                states.add(tuple(held))
    assert held == [0, 0] and rec.ops.count("F0") == rec.ops.count("F1") == m
    return states


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 7), (3, 6), (4, 8), (4, 13), (8, 32)])
def test_the_replay_is_fleets_schedule_and_peaks_at_2pp_plus_1(pp, m):
    """Every stage: the replay's states are the peaks of the states fleet's own schedule passes through, at
    (2 pp - s, s + 1): 2 pp + 1 chunk-micro-batches, DualPipe's PP + 1, the down chunk's count falling with s."""
    for s in range(pp):
        fleet = _fleet_states(pp, m, s)
        peaks = {a for a in fleet if not any(b != a and b[0] >= a[0] and b[1] >= a[1] for b in fleet)}
        assert set(v_flights(pp, m, s)) == peaks
        assert (2 * pp - s, s + 1) in peaks and max(a + b for a, b in peaks) == 2 * pp + 1
        assert v_least_flight(pp, s) == min(2 * pp - s, s + 1)
    with pytest.raises(ValueError, match="needs >= 8 micro-batches"):
        v_flights(4, 7, 0)


def test_stage_zero_holds_its_down_chunk_2pp_times():
    """Stage 0 holds 2 pp micro-batches of its first chunk and one of its last (the head's), so a heavier first
    chunk costs it more than DualPipe's even count (2 pp + 1) / 2 of the stage's blocks."""
    pp, m = 4, 16
    assert v_held(3.0, 1.0, pp=pp, micro_batches=m, stage=0) == 2 * pp * 3.0 + 1.0
    assert v_held(3.0, 1.0, pp=pp, micro_batches=m, stage=0) > (2 * pp + 1) / 2 * (3.0 + 1.0)
    assert v_held(1.0, 1.0, pp=pp, micro_batches=m, stage=pp - 1) == 2 * pp + 1


def test_memory_estimate_prices_each_chunk_of_the_v():
    """llama-7b, pp4 DualPipeV with an uneven split: every stage's activations are its down chunk's blocks x
    (2 pp - s) + its up chunk's x (s + 1), and the worst stage is what `memory_estimate` reports."""
    from llmtrain.config import to_config
    from llmtrain.parallel.config import ParallelConfig
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.plan.estimate import activation_parts, memory_estimate
    from llmtest import compose

    cfg = to_config(compose(["model=llama-7b", "data.seq_len=4096", "+parallel=custom", "parallel.pp=4",
                             "train.global_batch_size=16", "train.micro_batch_size=1"]))
    split = [6, 4, 4, 3, 3, 4, 4, 4]  # 32 blocks in 8 chunks: stage 0 holds chunks 0 (6 blocks) and 7 (4)
    layout = resolve_layout(ParallelConfig(pp=4, pp_schedule="dualpipev", pp_layers=split), cfg.train, 4)
    got = memory_estimate(cfg.model, layout, 4096, False, "bf16", "gpu", 2, True, 0.0)
    block = activation_parts(cfg.model, layout, 4096, "none", 2, True, "gpu")[0]
    want = [((2 * 4 - s) * split[s] + (s + 1) * split[7 - s]) * block for s in range(4)]
    assert want[0] == max(want)  # the heavy down chunk makes stage 0 the worst
    assert got["activations"] == int(want[0])


def test_a_v_stage_is_priced_with_its_own_blocks():
    """DualPipeV's stage 0 of a 4-block model whose first block is dense holds blocks 0 and 3 (chunks 0 and 3 of
    pp2): one dense and one MoE block, not the consecutive blocks 0-1 (`MicroBatchSpec.block_ids`)."""
    from llmtrain.models.config import ModelConfig
    from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels

    cfg = ModelConfig(name="m", hidden_size=32, num_layers=4, num_heads=4, ffn_hidden_size=64, vocab_size=256,
                      moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, moe_first_dense_layers=2)
    kernels = lambda **k: micro_batch_kernels(MicroBatchSpec(cfg, 2, 32, layers=2, first=True, last=True, **k))  # noqa: E731
    v_stage = kernels(first_layer=0, block_ids=(0, 3)).forward
    consecutive = kernels(first_layer=0).forward  # blocks 0-1: both dense
    moe_stage = kernels(first_layer=2).forward  # blocks 2-3: both MoE
    assert len(consecutive) < len(v_stage) < len(moe_stage)  # an MoE block runs more kernels than a dense one
    assert len(v_stage) - len(consecutive) == len(moe_stage) - len(v_stage)  # one dense block traded for one MoE

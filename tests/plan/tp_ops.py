"""A tp2 rank's executed ops against the planner's per-rank kernel list: runs inside the tp2 launch of
tests/parallel/test_parity.py (an in-process entry of tests/e2e/multirun_worker.py, after fleet is initialised for
tp2); `check` is the assertion.

    {"call": "tests/plan/tp_ops.py:record", "args": [out_dir]}      # in the launch, every rank
    check(out_dir)                                                  # in the test process

Each rank builds two tiny models (`DRAWN`) with the layout's roles (`TensorParallelRoles`, and
`SequenceParallelRoles` under sequence parallelism: fleet's column and row linears, the vocabulary-parallel embedding and loss through
llmtrain's CPU stand-ins), runs one micro-batch [2, 16] forward and backward with the GEMM recorder of
tests/plan/gemm_record.py and Paddle's profiler on, and writes what it ran. `check` requires, per rank and case, what
tests/plan/test_op_sequence.py requires of one device: the forward GEMMs' shapes (column linears out/tp wide, row
linears in/tp deep, the vocabulary-parallel head V/tp, the attention core on nh/tp heads) are the planner's list for
t=2 (`MicroBatchSpec(t=2, sp=...)`), the backward runs as many GEMMs as it lists, the forward's memory-bound
operators by class (`CLASS_OF`) are its classes, and the rank's collectives on the tp group (all-reduce, all-gather,
reduce-scatter as the GPU runs them, forward and backward, each call's bytes: `_Collectives`) are the planner's
`llmtrain.plan.tp_comm.tp_collectives`, what `estimate` prices tp's communication with.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # test_op_sequence, gemm_record; llmtest

B, S = 2, 16
CASES = {
    "llama": (["model=llama-tiny"], False),
    "gpt-sp": (["model=gpt-tiny"], True),
    "llama-sp": (["model=llama-tiny"], True),
    "moe-capacity": (["model=moe-tiny", "model.moe_capacity_factor=1.25"], False),
    "mla": (["model=deepseek-tiny", "model.moe_capacity_factor=1.25"], False),
    "moe-sp": (["model=moe-tiny", "model.moe_capacity_factor=1.25"], True),
    "qwen3-sp": (["model=llama-tiny", "model.qk_norm=true", "model.head_dim=48"], True),
    "llama-sp-full-attn": (["model=llama-tiny", "train.recompute=full_attn"], True),
    "moe-mlp-moe-first2": (["model=moe-tiny", "model.moe_capacity_factor=1.25", "train.recompute=selective",
                            "train.recompute_modules=[mlp,moe]", "train.recompute_layers=first:2"], False),
}
"""case -> (overrides, sequence parallelism)."""
DRAWN = [(case,) for case in CASES]
"""The cases, of which each suite run records two (`llmtest.draw`, k=2; a case costs about 2 s per rank on a loaded
2-core host): plain tp (Llama), sequence parallelism (GPT: LayerNorm, biases, the tied head; Llama: RMSNorm, RoPE;
Qwen3's attention: QK-norm, head_dim != hidden / heads), MoE under tp (router and routed experts replicated, shared
experts split) and under tp + sp (the rank routes its sequence shard alone), MLA under tp; recompute of the attention
layer under tp + sp, of the MLP and the MoE feed-forward in the first two blocks under tp (their forward collectives
again in the backward)."""


TP_NOT_COMPARED = {
    **dict.fromkeys(["exp", "log", "subtract", "equal", "bitwise_or", "all", "assign"],
                    "the CPU stand-ins of fleet's fused tp kernels (llmtrain/paddle_compat/cpu_backend/mp_ops.py): the "
                    "vocabulary-parallel cross entropy op by op (`kernels._vocab_parallel_ce`'s rows; one fused "
                    "c_softmax_with_cross_entropy on a GPU) and the embedding's out-of-range id mask"),
    "empty": "the output buffers of sequence parallelism's all-gather and reduce-scatter stand-ins (communication)",
}
"""Operators a tp rank runs beyond one device's (test_op_sequence.NOT_COMPARED), with why they are not compared."""


class _Collectives:
    """Every collective this rank issues while `phase` is set, in the GPU's terms: (phase, collective, bytes) with
    bytes as nccl-tests counts them (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the
    input before scattering). The CPU stand-ins run gloo's `dist.all_reduce` / `dist.all_gather`; sequence
    parallelism's reduce-scatter stand-in (an all-reduce, then this rank's rows) is recorded as the reduce-scatter
    the GPU runs."""

    def __init__(self, mp):
        import paddle.distributed as dist
        from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

        self.calls, self.phase, self._inside = [], None, False
        self.groups = {}  # id(group) -> a name (`name_group`); calls on other groups are recorded with None
        all_reduce, all_gather, reduce_scatter = dist.all_reduce, dist.all_gather, spu.reduce_scatter

        def nbytes(t):  # (from the shape: Tensor.numel would run an operator inside the profiled pass)
            return math.prod(t.shape) * t.element_size()

        def add(name, size, group):
            if self.groups:
                self.calls.append((self.phase, name, size, self.groups.get(id(group))))
            else:
                self.calls.append((self.phase, name, size))

        def recorded_all_reduce(tensor, *args, **kwargs):
            if self.phase and not self._inside:
                add("all_reduce", nbytes(tensor), kwargs.get("group", args[1] if len(args) > 1 else None))
            return all_reduce(tensor, *args, **kwargs)

        def recorded_all_gather(tensor_list, tensor, *args, **kwargs):
            out = all_gather(tensor_list, tensor, *args, **kwargs)
            if self.phase and not self._inside:
                add("all_gather", nbytes(tensor) * len(tensor_list), kwargs.get("group", args[0] if args else None))
            return out

        def recorded_reduce_scatter(x):
            if self.phase:
                add("reduce_scatter", nbytes(x), None)
            self._inside = True
            try:
                return reduce_scatter(x)
            finally:
                self._inside = False

        mp.setattr(dist, "all_reduce", recorded_all_reduce)
        mp.setattr(dist, "all_gather", recorded_all_gather)
        mp.setattr(spu, "reduce_scatter", recorded_reduce_scatter)

    def name_group(self, group, name: str) -> None:
        """Record calls on `group` as `name` (the recorded tuples then end with the group's name)."""
        self.groups[id(group)] = name


def _config(overrides):
    from llmtrain.config import compose_config, to_config

    return to_config(compose_config(["model.vocab_size=256", *overrides]))


def record(out_dir: str) -> None:
    """Every case on this tp rank: forward GEMM shapes, forward and backward operator names (module docstring)."""
    import paddle
    import paddle.distributed as dist
    import pytest

    from gemm_record import _Record
    from llmtest import tp_topology
    from test_op_sequence import _operators

    from llmtrain.contracts.steps import mean_loss
    from llmtrain.models import build_model
    from llmtrain.models.init import init_parameters
    from llmtrain.models.recompute import recompute_of
    from llmtrain.models.stages import canonical_parameters
    from llmtrain.parallel.sequence import SequenceParallelRoles
    from llmtrain.parallel.slicing import TensorSlices
    from llmtrain.parallel.tensor import TensorParallelRoles

    import time

    start = time.perf_counter()
    from llmtest import draw

    topo = tp_topology()
    slices = TensorSlices(topo.rank, topo.world)
    seed, chosen = draw(DRAWN, k=2)
    out = {"tp": topo.world, "cases": {}, "seed": seed}
    for case, (overrides, sp) in CASES.items():
        if case not in chosen:
            continue
        cfg = _config(overrides)
        with pytest.MonkeyPatch.context() as mp:
            rec = _Record(mp)
            comm = _Collectives(mp)
            paddle.seed(0)
            roles = (SequenceParallelRoles if sp else TensorParallelRoles)(topo)
            model = build_model(cfg.model, roles, recompute_of(cfg.train, cfg.model.num_layers, []))
            init_parameters(canonical_parameters(model), cfg.model, 7, slices=slices)
            model.train()
            ids = paddle.randint(0, cfg.model.vocab_size, [B, S])  # the same on both ranks (one seed)
            rec.on = True
            comm.phase = "forward"
            loss, fwd_ops = _operators(lambda: mean_loss(model.loss_fn(model(ids), (ids, paddle.ones([B, S], "float32")))))
            forward = list(rec.shapes)
            comm.phase = "backward"
            _, bwd_ops = _operators(loss.backward)
            comm.phase = None
            rec.on = False
        out["cases"][case] = {"forward": forward, "fwd_ops": fwd_ops, "bwd_ops": bwd_ops, "collectives": comm.calls}
    out["seconds"] = time.perf_counter() - start
    path = Path(out_dir) / f"rank{dist.get_rank()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))


def check(out_dir) -> dict:
    """Both tp ranks, every case: the planner's per-rank list (module docstring); returns the forward GEMMs compared
    per case and the seconds `record` took on each rank."""
    import collections

    from test_op_sequence import FORWARD_GEMMS, GRAD_NODES, NOT_COMPARED, _classes, _planned_classes

    from llmtrain.models.recompute import recompute_of
    from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels
    from llmtrain.plan.tp_comm import tp_collectives

    ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    assert len(ranks) == 2 and all(r["tp"] == 2 for r in ranks), [r.get("tp") for r in ranks]
    counts = {}
    assert ranks[0]["cases"].keys() == ranks[1]["cases"].keys() and len(ranks[0]["cases"]) >= 2, ranks[0]["cases"].keys()
    for case in ranks[0]["cases"]:
        overrides, sp = CASES[case]
        cfg = _config(overrides)
        rc = recompute_of(cfg.train, cfg.model.num_layers, [])
        planned = micro_batch_kernels(MicroBatchSpec(cfg.model, B, S, t=2, e=4, gpu=False, flash=False,
                                                     math_core=False, ce_core=False, sp=sp, recompute=rc))
        want = sorted(tuple(k.shape) for k in planned.forward if k.kind == "gemm")
        for rank, got in enumerate(r["cases"][case] for r in ranks):
            where = f"{case}, tp rank {rank}"
            forward = sorted(tuple(s) for s in got["forward"])
            ops = collections.Counter(got["fwd_ops"])
            assert sum(ops[n] for n in FORWARD_GEMMS) == len(forward), (where, ops)  # none unrecorded
            assert forward == want, (where, forward, want)
            bops = collections.Counter(got["bwd_ops"])
            executed_bwd = 2 * sum(bops[n] for n in GRAD_NODES) + sum(bops[n] for n in FORWARD_GEMMS)
            assert executed_bwd == sum(k.kind == "gemm" for k in planned.backward), (where, bops)
            assert _classes(got["fwd_ops"], {**NOT_COMPARED, **TP_NOT_COMPARED}) == _planned_classes(planned.forward), where
            calls = sorted((c.phase, c.name, c.nbytes)
                           for c in tp_collectives(cfg.model, B, S, 2, 4, sp=sp, gpu=False, replay=rc))
            assert sorted(tuple(c) for c in got["collectives"]) == calls, (where, got["collectives"], calls)
        counts[case] = len(want)
    return {"forward GEMMs per case": counts, "seconds per rank": [round(r["seconds"], 1) for r in ranks],
            "draw": f"seed {ranks[0]['seed']} (LLMTRAIN_SAMPLE_SEED=<seed> replays it, =all records every case)"}


TP_EP_MODEL = ["model=moe-tiny", "model.moe_capacity_factor=1.25"]
"""The model of the tp x ep record: capacity routing (the experts' rows fixed by the factor), the first block dense,
one shared expert (column and row linears under tp)."""


def record_tp_ep(out_dir: str, run_overrides: list) -> None:
    """In a launch of tp2 x ep2 (dp2 tp2, experts over ep2 of the dp ranks; `run_overrides`: a run of that launch, whose
    layout this reuses): one micro-batch of `TP_EP_MODEL` forward and backward with the layout's roles, recording the
    forward GEMM shapes and every collective by group (tp, ep)."""
    import paddle
    import paddle.distributed as dist
    import pytest

    from gemm_record import _Record

    from llmtrain.config import compose_config, to_config
    from llmtrain.contracts.steps import mean_loss
    from llmtrain.models import build_model
    from llmtrain.models.init import init_parameters
    from llmtrain.models.stages import canonical_parameters
    from llmtrain.parallel.build import make_roles
    from llmtrain.parallel.layout import resolve_layout
    from llmtrain.parallel.slicing import TensorSlices
    from llmtrain.parallel.strategy import init_distributed

    run = to_config(compose_config(run_overrides))
    layout = resolve_layout(run.parallel, run.train, dist.get_world_size())
    assert layout.tp == 2 and layout.ep == 2, (layout.tp, layout.ep)
    topo = init_distributed(layout, run.seed)  # the launch's fleet and groups, reused
    cfg = _config(TP_EP_MODEL)
    with pytest.MonkeyPatch.context() as mp:
        rec, comm = _Record(mp), _Collectives(mp)
        comm.name_group(topo.group("tp"), "tp")
        comm.name_group(topo.group("ep"), "ep")
        paddle.seed(0)
        model = build_model(cfg.model, make_roles(layout, topo))
        tp_rank = topo.group("tp").rank
        init_parameters(canonical_parameters(model), cfg.model, 7, slices=TensorSlices(tp_rank, 2))
        model.train()
        paddle.seed(1 + topo.ep_rank)  # each ep rank its own tokens, the same on the tp ranks of a tp group
        ids = paddle.randint(0, cfg.model.vocab_size, [B, S])
        rec.on = True
        comm.phase = "forward"
        loss = mean_loss(model.loss_fn(model(ids), (ids, paddle.ones([B, S], "float32"))))
        forward = list(rec.shapes)
        comm.phase = "backward"
        loss.backward()
        comm.phase = None
        rec.on = False
    path = Path(out_dir) / f"rank{dist.get_rank()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"forward": forward, "collectives": comm.calls}))


def check_tp_ep(out_dir) -> dict:
    """Every rank of the tp2 x ep2 record: its forward GEMMs are the planner's list for t=2 with
    `MoEPlan(ep=2, dispatcher="allgather")` (the local experts' bmm over [E/ep, ep C, h]), its tp calls are
    `tp_collectives` and its ep calls the planner's `ep_allgather` exchanges (each gathering ep x the [E, C, h]
    buffer); no collective on another group."""
    from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels
    from llmtrain.plan.moe import MoEPlan
    from llmtrain.plan.tp_comm import tp_collectives

    ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    assert len(ranks) == 4, len(ranks)
    cfg = _config(TP_EP_MODEL)
    planned = micro_batch_kernels(MicroBatchSpec(cfg.model, B, S, t=2, e=4, gpu=False, flash=False, math_core=False,
                                                 ce_core=False, moe=MoEPlan(ep=2, dispatcher="allgather",
                                                                            link=(1e9, 0.0))))
    want = sorted(tuple(k.shape) for k in planned.forward if k.kind == "gemm")
    tp = sorted((c.phase, c.name, c.nbytes) for c in tp_collectives(cfg.model, B, S, 2, 4, sp=False, gpu=False))
    ep = sorted((phase, "all_gather", 2 * k.numel) for phase, ks in (("forward", planned.forward),
                                                                      ("backward", planned.backward))
                for k in ks if k.op == "ep_allgather")
    assert ep and tp
    for rank, got in enumerate(ranks):
        assert sorted(tuple(s) for s in got["forward"]) == want, (rank, got["forward"], want)
        calls = [tuple(c) for c in got["collectives"]]
        assert sorted(c[:3] for c in calls if c[3] == "tp") == tp, (rank, calls)
        assert sorted(c[:3] for c in calls if c[3] == "ep") == ep, (rank, calls)
        assert all(c[3] in ("tp", "ep") for c in calls), (rank, calls)
    return {"forward GEMMs": len(want), "tp calls": len(tp), "ep calls": len(ep)}

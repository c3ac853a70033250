"""The ranking's speed-ups keep its results: the pruned balanced split equals the plain programme, and a small
ranking equals the rows committed before the speed-ups.

    python -m pytest tests/plan/test_plan_speed.py -q
    python benchmarks/plan_speed.py --compare DIR      # every row of the frontier rankings against a dump
"""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.parallel.pp_split import REL_TOL, _balanced_split, count_split

REFERENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "plan_rows_qwen3-30b-a3b_8xh800.json.gz"
"""Every row of `python -m llmtrain.plan model=qwen3-30b-a3b plan.devices=8 plan.device=h800
train.global_batch_size=64 data.seq_len=2048 train.amp=bf16`, ranked at 825f9da (main before the speed-ups merged), gzipped;
the DualPipeV rows (81 of 876, 91 more pruned) added when the search began to rank that schedule, every other row
as it was; re-ranked at main ee9af3e, whose later pricing changes had moved the rows' times (same 876 rows, same
pruned count), and again at main 5155c15 (the recompute peak and activation offload rules: 876 rows, 1210 pruned);
re-dumped when every pipeline stage was priced (`estimate.compute_estimate`, not only the two end stages): 52 timed
pipeline rows moved (step 0.9993-1.146x), no pp = 1 row, no memory figure, the same rows and pruned count (1210);
re-dumped when DualPipeV's default split began to balance each stage's pair of chunks (`llmtrain.parallel.v_split`):
18 of the 81 DualPipeV rows moved (pp2 split [12, 13, 13, 10] -> [12, 12, 13, 11] or [13, 12, 13, 10], memory
figures only: none of them fits, so no timed row moved), no other row, the same rows and pruned count.
The speed-ups merged by then were each checked against a dump of their own base with benchmarks/plan_speed.py
--compare."""
OVERRIDES = ["model=qwen3-30b-a3b", "plan.devices=8", "plan.device=h800", "train.global_batch_size=64",
             "data.seq_len=2048", "train.amp=bf16"]


def plain_split(costs: tuple, chunks: int) -> tuple:
    """The balanced split as first written (llmtrain/parallel/pp_split.py before the pruning): every chunk end j of
    every chunk k, every start from the bisected limit, ties within REL_TOL to the earlier start."""
    from bisect import bisect_left

    embed, blocks, head = costs[0], list(costs[1:-1]), costs[-1]
    n = len(blocks)
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def chunk_cost(k, a, j):
        return prefix[j] - prefix[a] + (embed if k == 0 else 0.0) + (head if k == chunks - 1 else 0.0)

    def solve(minimax, limit):
        inf, keep = float("inf"), 1 - REL_TOL
        best = [[(inf, -1)] * (n + 1) for _ in range(chunks)]
        for j in range(1, n - chunks + 2):
            c = chunk_cost(0, 0, j)
            if c <= limit:
                best[0][j] = (c if minimax else c * c, 0)
        for k in range(1, chunks):
            e_k, h_k = 0.0, (head if k == chunks - 1 else 0.0)
            for j in range(k + 1, n - chunks + k + 2):
                top, at, pj = inf, -1, prefix[j]
                lo = max(k, bisect_left(prefix, pj + e_k + h_k - limit) - 1)
                while lo > k and pj - prefix[lo - 1] + e_k + h_k <= limit:
                    lo -= 1
                for a in range(lo, j):
                    prev, c = best[k - 1][a][0], pj - prefix[a] + e_k + h_k
                    if prev == inf or c > limit:
                        continue
                    sc = (prev if prev > c else c) if minimax else prev + c * c
                    if sc < top * keep:
                        top, at = sc, a
                best[k][j] = (top, at)
        return best

    by_count, at = 0.0, 0
    for k, size in enumerate(count_split(n, chunks)):
        by_count, at = max(by_count, chunk_cost(k, at, at + size)), at + size
    worst = solve(True, by_count * (1 + 1e-6))[chunks - 1][n][0]
    best = solve(False, worst * (1 + REL_TOL))
    ends, j = [], n
    for k in range(chunks - 1, -1, -1):
        ends.append(j)
        j = best[k][j][1]
    ends.reverse()
    return tuple(b - a for a, b in zip([0, *ends[:-1]], ends))


def test_pruned_split_equals_the_plain_programme():
    """Seeded costs shaped like the planner's (an embedding, dense then MoE blocks of a few costs, a head), with
    exact and near ties (within REL_TOL) and random ones, every chunk count: the same split."""
    rng = random.Random(41)
    cases = 0
    for _ in range(120):
        n = rng.choice([5, 9, 17, 30, 61])
        dense = rng.randrange(0, 4)
        kind = rng.random()
        if kind < 0.4:  # a dense and an MoE cost: ties everywhere
            d, m = rng.uniform(0.01, 0.1), rng.uniform(0.02, 0.2)
            blocks = [d] * dense + [m] * (n - dense)
        elif kind < 0.7:  # near ties: costs a few REL_TOL apart
            base = rng.uniform(0.01, 0.1)
            blocks = [base * (1 + rng.choice([0, 1, -1, 3]) * REL_TOL / 2) for _ in range(n)]
        else:
            blocks = [rng.uniform(0.0, 1.0) for _ in range(n)]
        costs = (rng.uniform(0, 0.05), *blocks, rng.choice([0.0, rng.uniform(0, 0.5), blocks[-1]]))
        for chunks in sorted({1, 2, rng.randrange(1, n + 1), n, max(1, n // 2), max(1, n // 3)}):
            assert _balanced_split.__wrapped__(costs, chunks) == plain_split(costs, chunks), (costs, chunks)
            cases += 1
    assert cases > 400


def test_small_ranking_equals_the_rows_before_the_speed_ups():
    """qwen3-30b-a3b on 8 x h800 (pipelines with their default splits, ep x edp, ZeRO-1/2/3, every recompute mode,
    offload): every row, field by field, equals the committed reference (floats to 1e-9 relative)."""
    from benchmarks.plan_speed import differences
    from llmtrain.plan.model import planned_model
    from llmtrain.plan.search import rank_layouts

    cfg = to_config(compose(OVERRIDES))
    rows = rank_layouts(cfg, planned_model(cfg))
    want = json.loads(gzip.decompress(REFERENCE.read_bytes()))
    got = {"pruned": rows.pruned, "rows": json.loads(json.dumps(list(rows)))}
    diff = differences(want, got)
    assert not diff, diff[:10]
    assert sum(r["fits"] for r in got["rows"]) > 0 and any(r["pp"] > 1 for r in got["rows"])


def test_parameter_list_on_disk_equals_the_built_one(tmp_path, monkeypatch):
    """The planner's parameter list stored on disk (llmtrain/plan/params.py) reads back equal to the one built from
    the model, and a changed source digest misses (builds again) instead of reading a stale list."""
    from llmtrain.plan import params
    from llmtrain.plan.model import planned_model

    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path))
    model = planned_model(to_config(compose(["model=moe-tiny", "model.vocab_size=1000"])))
    key = (repr(model), repr(None))
    built = params._specs(model, None)
    assert params._from_disk(key) is None
    params._to_disk(key, built)
    assert params._from_disk(key) == built and len(built) > 10
    monkeypatch.setattr(params, "_SOURCE", ["another source"])
    assert params._from_disk(key) is None


def test_the_ranking_command_does_not_import_paddle(tmp_path, monkeypatch):
    """`python -m llmtrain.plan ...` imports no paddle, neither to import the CLI nor to rank, once its parameter
    list is on disk (a first run builds the model lazily, with paddle; here this process stores it first): the
    import costs seconds on a 2-core host."""
    import os
    import subprocess
    import sys

    from llmtrain.plan.model import planned_model
    from llmtrain.plan.params import model_param_specs

    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path))
    args = ["model=moe-tiny", "model.vocab_size=1000", "plan.devices=4", "plan.device=h100", "plan.top=1"]
    model_param_specs(planned_model(to_config(compose(args))))  # what the first run of the command stores
    assert list(tmp_path.glob("param_specs/*.json"))
    root = Path(__file__).resolve().parents[2]
    probe = ("import sys, runpy; import llmtrain.plan.__main__; print('after import', 'paddle' in sys.modules); "
             "sys.argv = ['llmtrain.plan', *sys.argv[1:]]; runpy.run_module('llmtrain.plan', run_name='__main__'); "
             "print('after ranking', 'paddle' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", probe, *args], env={**os.environ, "PYTHONPATH": str(root)}, cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "after import False" in run.stdout, run.stdout[-3000:]
    assert "after ranking False" in run.stdout and " 1 " in run.stdout, run.stdout[-3000:]


def _tiny_moe_layouts(world: int = 8):
    """(model, Layout) for every valid layout of moe-tiny (4 blocks, the first dense, 8 experts) on `world` ranks,
    micro-batch 1 of global batch 64, pipelines split by count."""
    import dataclasses

    from llmtrain.parallel.layout import layout_problems, model_fit_problems
    from llmtrain.parallel.pp_split import count_split
    from llmtrain.plan.model import planned_model
    from llmtrain.plan.search import candidates

    cfg = to_config(compose(["model=moe-tiny", "model.vocab_size=1000", "train.global_batch_size=64"]))
    model = planned_model(cfg)
    train = dataclasses.replace(cfg.train, micro_batch_size=1, grad_accum=None)
    for pc in candidates(world, experts=model.moe_num_experts):
        if model_fit_problems(pc, model):
            continue
        layout, problems = layout_problems(pc, train, world)
        if problems:
            continue
        if layout.pp > 1:
            layout = dataclasses.replace(layout, pp_layers=count_split(model.num_layers, layout.pp * layout.virtual_pp))
        yield model, layout


def test_shortcuts_equal_what_they_stand_for():
    """The ranking's shortcuts against the plain computations, on every valid moe-tiny layout of 8 ranks (ZeRO-1/2/3,
    ep x edp, pipelines): a stage's worst holding found without listing every data index's entry equals the maximum
    of the listed entries; the gradient and optimizer tensor lists shared by stages of the same block kinds equal
    the stage's own; `first_group` is checked in tests/parallel/test_groups.py."""
    from llmtrain.plan import estimate, memory

    sharded_experts = 0
    for model, layout in _tiny_moe_layouts():
        for st in range(layout.pp):
            memory._STAGES.clear()
            memory._WORST_STAGE.clear()
            worst = memory.stage_worst_holding(model, layout, st, "bf16", "gpu")  # without the list
            listed = memory.stage_holdings(model, layout, st, "bf16", "gpu")
            assert worst == max(listed, key=memory.held_bytes), (layout, st)
            sharded_experts += len(listed) > layout.sharding
            assert estimate.rank_tensors(model, layout, "bf16", st) == estimate._rank_tensors(model, layout, "bf16", st)
    assert sharded_experts > 10

"""DualPipeV's default split balances each stage's pair of chunks (llmtrain/parallel/v_split.py), in one process; the
run and the planner take it from the same function.

    python -m pytest tests/parallel/test_v_split.py -q
"""
from __future__ import annotations

import itertools
import random

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.parallel.layout import layout_problems
from llmtrain.parallel.pp_split import balanced_split
from llmtrain.parallel.v_split import chunk_costs, lower_bound, stage_costs, v_balanced_split
from llmtrain.plan.estimate import moe_plan
from llmtrain.plan.stage_cost import layer_costs, split_profile, with_pipeline_split


def test_pair_split_is_the_best_of_every_split():
    """Against every composition of L blocks into 2·pp chunks of at least one (random costs with ties, seeded): no
    split has a cheaper costliest stage (its two chunks summed, the embedding and head on stage 0), among those tied
    on it none a smaller sum of squared chunk costs, then of squared stage costs; none goes under `lower_bound`."""
    rng = random.Random(11)
    cases = 0
    for _ in range(150):
        pp = rng.randint(1, 3)
        n = rng.randint(2 * pp, 10)
        costs = [rng.choice([0.0, 0.3, 1.0, 1.0, 2.5]) for _ in range(n + 2)]
        got = v_balanced_split(costs, pp)
        assert len(got) == 2 * pp and sum(got) == n and min(got) >= 1, (costs, pp, got)
        mine = stage_costs(costs, got, pp)
        score = (max(mine), sum(c * c for c in chunk_costs(costs, got)), sum(c * c for c in mine))
        for cut in itertools.combinations(range(1, n), 2 * pp - 1):
            split = [b - a for a, b in zip((0, *cut), (*cut, n))]
            other = stage_costs(costs, split, pp)
            theirs = (max(other), sum(c * c for c in chunk_costs(costs, split)), sum(c * c for c in other))
            assert theirs[0] >= lower_bound(costs, pp) - 1e-9, (costs, pp, split)
            for x, y in zip(theirs, score):  # lexicographic, ties within 1e-9
                assert x >= y - 1e-9, (costs, pp, got, split)
                if x > y + 1e-9:
                    break
        cases += 1
    assert cases == 150


def test_the_pair_split_evens_what_the_chain_split_leaves_on_the_v():
    """12 equal blocks, the embedding 0.5 and the head 2.0 under pp3: balanced chunk by chunk the stages cost 5.5,
    5.0, 4.0 (stage 0 holds both ends); balanced by pairs 4.5, 5.0, 5.0 (stage 0 gives a block away)."""
    costs = [0.5, *[1.0] * 12, 2.0]
    chain = balanced_split(costs, 6)
    assert chain == (2, 2, 2, 2, 3, 1) and stage_costs(costs, chain, 3) == [5.5, 5.0, 4.0]
    pair = v_balanced_split(costs, 3)
    assert pair == (1, 2, 2, 3, 3, 1) and stage_costs(costs, pair, 3) == [4.5, 5.0, 5.0]


def _deepseek(pp: int):
    cfg = to_config(compose(["model=deepseek-v3", "data.seq_len=4096", "+parallel=custom", f"parallel.pp={pp}",
                             "parallel.pp_schedule=dualpipev", f"plan.devices={pp}", "plan.device=h800",
                             "train.global_batch_size=256", "train.micro_batch_size=1"]))
    layout, problems = layout_problems(cfg.parallel, cfg.train, pp)
    assert problems == [] and layout.v_shape and not layout.pp_layers
    dev = split_profile(True, "h800")
    moe = moe_plan(layout, dev, cfg.plan.devices_per_node, cfg.plan.moe_imbalance)
    return cfg, layout, dev, layer_costs(cfg.model, dev, micro_batch=1, seq_len=4096, moe=moe), moe


def test_deepseek_v3_under_dualpipev_gets_the_pair_split_in_the_run_and_the_plan():
    """DeepSeek-V3 (61 blocks, 3 dense) priced on h800: the default split of a dualpipev layout
    (`with_pipeline_split`, what `llmtrain.resolve` and every planner path call) is the pair split. At pp4 its
    costliest stage is cheaper than the chain split's (716.7 ms vs 735.5 ms on the packaged profile); at pp8 and
    pp16 both reach the bound (a stage holds ceil(58 / pp) MoE blocks) and the pair split has no more stages at it.
    The planner's row for the layout carries the same split."""
    from llmtrain.plan.__main__ import plan

    for pp in (4, 8, 16):
        cfg, layout, dev, costs, moe = _deepseek(pp)
        split = with_pipeline_split(layout, cfg.model, dev, seq_len=4096, moe=moe).pp_layers
        assert split == v_balanced_split(costs, pp)
        pair, chain = stage_costs(costs, split, pp), stage_costs(costs, balanced_split(costs, 2 * pp), pp)
        assert max(pair) <= max(chain) * (1 + 1e-9)
        assert sum(c >= max(pair) * (1 - 1e-9) for c in pair) <= sum(c >= max(chain) * (1 - 1e-9) for c in chain)
        if pp == 4:
            assert max(pair) < 0.99 * max(chain), (pair, chain)
            (row,) = plan(cfg)
            assert tuple(row["pp_layers"]) == split and row["pp_schedule"] == "dualpipev"
        else:
            assert abs(max(pair) - lower_bound(costs, pp)) <= 1e-9 * max(pair)

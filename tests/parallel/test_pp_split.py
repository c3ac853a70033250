"""Uneven pipeline stages, in one process: the split's rules and refusals, the cost-balanced default, and fleet's
segmentation of the marked stage list (the launches are in tests/parallel/test_parity.py and
tests/checkpoint/test_resume.py).

    python -m pytest tests/parallel/test_pp_split.py -q
"""
from __future__ import annotations

import itertools
import random

import pytest

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.models import model_stages
from llmtrain.models.config import ModelConfig
from llmtrain.models.roles import Roles
from llmtrain.parallel.config import ParallelConfig, layout_tag
from llmtrain.parallel.layout import layout_problems, model_fit_problems
from llmtrain.parallel.pipeline import CHUNK_END, stage_descs
from llmtrain.parallel.pp_split import (balanced_split, count_split, describe_split, split_tag, stage_blocks)
from llmtrain.plan.stage_cost import layer_costs, split_profile, with_pipeline_split
from llmtrain.train.config import TrainConfig


def _problems(model_layers: int, **parallel) -> list[str]:
    p = ParallelConfig(**parallel)
    _, problems = layout_problems(p, TrainConfig(global_batch_size=48, micro_batch_size=1), p.world())
    return problems + model_fit_problems(p, ModelConfig(name="m", hidden_size=64, num_layers=model_layers,
                                                        num_heads=4, ffn_hidden_size=128, vocab_size=256))


def _chunk_costs(costs, split):
    at, out = 1, []
    for i, n in enumerate(split):
        out.append(sum(costs[at:at + n]) + (costs[0] if i == 0 else 0) + (costs[-1] if i == len(split) - 1 else 0))
        at += n
    return out


def test_balanced_split_is_the_best_bottleneck_of_every_split():
    """Against every composition of L blocks into k chunks of at least one (random costs, seeded): no split has a
    cheaper costliest chunk, and among the splits that tie on it none has a smaller sum of squared chunk costs."""
    rng = random.Random(7)
    for _ in range(60):
        n, k = rng.randint(1, 9), rng.randint(1, 5)
        if k > n:
            continue
        costs = [rng.choice([0.0, 0.3, 1.0, 2.5]) for _ in range(n + 2)]
        got = balanced_split(costs, k)
        assert len(got) == k and sum(got) == n and min(got) >= 1
        worst, squares = max(_chunk_costs(costs, got)), sum(c * c for c in _chunk_costs(costs, got))
        for cut in itertools.combinations(range(1, n), k - 1):
            split = [b - a for a, b in zip((0, *cut), (*cut, n))]
            other = _chunk_costs(costs, split)
            assert max(other) >= worst - 1e-9, (costs, k, got, split)
            if abs(max(other) - worst) <= 1e-9:
                assert sum(c * c for c in other) >= squares - 1e-9, (costs, k, got, split)


def test_the_head_takes_blocks_off_the_last_stage_and_equal_costs_split_evenly():
    assert balanced_split([0.1, 1, 1, 1, 1, 1, 0.5], 2) == (3, 2)
    assert balanced_split([0.1, *[1] * 8, 0.1], 2) == (4, 4)
    assert balanced_split([0.0, *[1] * 8, 3.0], 2) == (5, 3)
    assert count_split(61, 8) == (8, 8, 8, 8, 8, 7, 7, 7)
    with pytest.raises(ValueError, match="3 blocks cannot fill 4 chunks"):
        balanced_split([0, 1, 1, 1, 0], 4)


def test_a_stage_holds_its_chunks_blocks_interleaved():
    split = (2, 1, 1, 1, 1, 1)  # pp3 x 2 virtual stages: chunk i on stage i % 3
    assert [stage_blocks(split, 3, s) for s in range(3)] == [[0, 1, 4], [2, 5], [3, 6]]
    assert stage_blocks((3, 2), 1, 0) == [0, 1, 2, 3, 4]
    assert describe_split((3, 2), 2) == "stage 0: embedding + blocks 0-2 | stage 1: blocks 3-4 + head"
    assert describe_split(split, 3) == ("stage 0: embedding + blocks 0-1, block 4 | stage 1: block 2, block 5 | "
                                        "stage 2: block 3, block 6 + head")


def test_any_layer_count_under_any_pp_with_a_block_per_chunk():
    """61 blocks (DeepSeek-V3) on pp8, 54 (ERNIE-4.5-300B) on pp4 and pp8 and under 2 virtual stages: no refusal."""
    for layers, degrees in ((61, dict(pp=8)), (54, dict(pp=4)), (54, dict(pp=8)),
                            (54, dict(pp=4, pp_schedule="interleaved", virtual_pp=2)), (5, dict(pp=2))):
        assert _problems(layers, **degrees) == [], (layers, degrees)
    assert _problems(5, pp=2, pp_layers=[3, 2]) == []


def test_refusals_name_the_fields_numbers_and_what_works():
    assert _problems(5, pp=4, pp_schedule="interleaved", virtual_pp=2) == [
        "model.num_layers=5 is fewer than parallel.pp=4 x parallel.virtual_pp=2 = 8 pipeline chunks, and every chunk "
        "needs at least one block: use pp x virtual_pp <= 5"]
    (wrong_sum,) = _problems(6, pp=2, pp_layers=[3, 2])
    assert "parallel.pp_layers=[3, 2] holds 5 blocks, but model.num_layers=6" in wrong_sum
    assert "parallel.pp_layers=[3, 3]" in wrong_sum  # what would work
    (length,) = _problems(5, pp=2, pp_layers=[2, 2, 1])
    assert "has 3 entries, but parallel.pp=2 x parallel.virtual_pp=1 = 2 pipeline chunks" in length
    (empty,) = _problems(5, pp=2, pp_layers=[5, 0])
    assert "parallel.pp_layers=[5, 0]: chunk(s) [1] hold fewer than 1 block" in empty
    (alone,) = _problems(5, pp_layers=[5])
    assert "parallel.pp_layers=[5] with parallel.pp=1" in alone and "set parallel.pp > 1" in alone


def test_an_explicit_split_is_in_the_run_name():
    """Two runs with different splits never share a default run directory; the default split adds nothing."""
    names = {tuple(extra): to_config(compose(["model=llama-tiny", "+parallel=custom", "parallel.pp=2", *extra])).run.name
             for extra in ([], ["parallel.pp_layers=[3,2]"], ["parallel.pp_layers=[2,3]"])}
    assert names == {(): "llama-tiny-pp2", ("parallel.pp_layers=[3,2]",): "llama-tiny-pp2L3-2",
                     ("parallel.pp_layers=[2,3]",): "llama-tiny-pp2L2-3"}
    assert split_tag((9, 8, 8, 8, 7, 7, 7, 7)) == "L9-8x3-7x4"
    assert layout_tag({"pp": 4, "virtual_pp": 2, "pp_layers": [2, 1, 1, 1, 1, 1, 1, 1]}) == "pp4v2L2-1x7"


@pytest.mark.parametrize("split,pp", [((3, 2), 2), ((2, 3), 2), ((1, 2, 2), 3), ((2, 1, 1, 1, 1, 1), 3)])
def test_fleet_cuts_the_marked_stage_list_at_the_chunk_ends(split, pp, tiny_llama):
    """fleet's own segmentation (`seg_method="layer:^PipelineChunkEnd"`, as `build_pipeline` passes it) of the
    marked descs gives chunks of exactly `split` blocks, the embedding first and the head last, for 1F1B and for the
    interleaved schedule (virtual stages)."""
    from paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers import SegmentLayers

    cfg = tiny_llama.__class__(**{**tiny_llama.__dict__, "num_layers": sum(split)})
    roles = Roles()
    descs = stage_descs(model_stages(cfg, roles), roles, carry=True, pp_layers=split)
    vpp = len(split) // pp
    parts = SegmentLayers(descs, num_parts=pp, method=f"layer:^{CHUNK_END}",
                          num_virtual_pipeline_stage=vpp if vpp > 1 else None).do_segment()
    prefixes = [d.kwargs["prefix"] for d in descs]
    chunks = [prefixes[a:b] for a, b in zip(parts, parts[1:])]
    assert [sum(p.startswith("layers.") for p in c) for c in chunks] == list(split)
    assert chunks[0][0] == "embed" and chunks[-1][-1] == "lm_head"


def test_resolve_fills_the_default_split_from_the_planners_costs(tiny_corpus, tmp_path):
    """A pipeline run without parallel.pp_layers gets the split balanced by `layer_costs` on the CPU profile (this
    run's micro-batch and sequence), and a run that gives one keeps it."""
    from llmtrain.resolve import resolve

    base = [f"data.tokenizer={tiny_corpus['tokenizer']}", f"data.prefixes=[{tiny_corpus['prefix']}]",
            "model=llama-tiny", "model.num_layers=5", "+parallel=pp2", "train.global_batch_size=8",
            "train.micro_batch_size=2", "data.seq_len=32"]
    run = resolve(to_config(compose(base + [f"run.dir={tmp_path / 'a'}"])), world_size=2)
    costs = layer_costs(run.cfg.model, split_profile(False, "a100-80g"), micro_batch=2, seq_len=32)
    assert run.layout.pp_layers == balanced_split(costs, 2) and sum(run.layout.pp_layers) == 5
    given = resolve(to_config(compose(base + [f"run.dir={tmp_path / 'b'}", "parallel.pp_layers=[1,4]"])), world_size=2)
    assert given.layout.pp_layers == (1, 4)


def test_the_default_split_weighs_dense_moe_blocks_and_the_head():
    """DeepSeek-V3 (3 dense blocks, then 58 MoE) on 8 stages priced on h800: the first stage takes as many blocks as
    the fullest stage (its dense ones are cheaper, though not enough cheaper to take one more), the last fewer (the
    head is counted), and the split is no worse than one by count alone in its costliest stage or in the spread
    (for these costs the two coincide: three dense blocks save less than one MoE block; that the balanced split is
    the best bottleneck is tested above); the costs are the planner's."""
    cfg = to_config(compose(["model=deepseek-v3", "data.seq_len=4096", "+parallel=custom", "parallel.pp=8",
                             "plan.devices=8", "train.global_batch_size=64", "train.micro_batch_size=1"]))
    dev = split_profile(True, "h800")
    layout, problems = layout_problems(cfg.parallel, cfg.train, 8)
    assert problems == [] and model_fit_problems(cfg.parallel, cfg.model) == []
    costs = layer_costs(cfg.model, dev, micro_batch=1, seq_len=4096)
    assert costs[1] == costs[2] == costs[3] < costs[4] == costs[61] and costs[0] < costs[-1]
    split = with_pipeline_split(layout, cfg.model, dev, seq_len=4096).pp_layers
    assert sum(split) == 61 and len(split) == 8 and min(split) >= 1 and split[0] >= max(split[1:]) > split[-1]
    mine, by_count = _chunk_costs(costs, split), _chunk_costs(costs, count_split(61, 8))
    assert max(mine) <= max(by_count) and sum(c * c for c in mine) <= sum(c * c for c in by_count)
    given = with_pipeline_split(layout.__class__(**{**layout.__dict__, "pp_layers": (9, 8, 8, 8, 7, 7, 7, 7)}),
                                cfg.model, dev, seq_len=4096)
    assert given.pp_layers == (9, 8, 8, 8, 7, 7, 7, 7)  # an explicit split is kept as given

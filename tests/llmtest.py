"""Helpers shared by the tests (a module with a unique name: several conftest.py files exist).

    from llmtest import REPO, compose, tiny_overrides
    seed, chosen = draw([("pp4v2",), ("pp3", "pp3v2")])   # this suite run's sample of launches
"""
from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SAMPLE_SEED = "LLMTRAIN_SAMPLE_SEED"
"""Environment variable of the seed that draws a suite run's sample of compositions (`draw`): an integer replays a
draw, `all` runs every composition."""


FP8_LAYOUTS_DRAWN = [("tp2sp-blockwise",), ("tp2sp-tensorwise",), ("cp2-blockwise",), ("cp2-tensorwise",)]
"""The FP8 parity runs against an emulated one-process reference (`train.fp8_emulate`), one per suite run (`draw`):
tp2 + sp in tests/parallel/test_parity.py, cp2 in tests/parallel/test_context_parity.py, each recipe (a run and
its references cost 30-60 s on 2 cores)."""


def draw(groups: list[tuple], k: int = 1):
    """(seed, the members of the `k` groups drawn): the seed is $LLMTRAIN_SAMPLE_SEED, else today's date as YYYYMMDD
    (UTC; the same on every xdist worker of a run, another draw tomorrow); `all` (seed None) chooses every group."""
    import datetime
    import random

    given = os.environ.get(SAMPLE_SEED, "")
    if given == "all":
        return None, {m for g in groups for m in g}
    seed = int(given) if given else int(datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d"))
    return seed, {m for g in random.Random(seed).sample(list(groups), k) for m in g}


def drawn_or_skip(member: str, groups: list[tuple]) -> None:
    """Skip `member` (of one of `groups`) when this run's `draw` did not choose its group, saying how to replay the draw
    and how to run them all; print the seed when it runs."""
    import pytest

    seed, chosen = draw(groups)
    replay = f"{SAMPLE_SEED}={'all' if seed is None else seed} replays this draw, {SAMPLE_SEED}=all runs every one " \
        f"of {groups}"
    if member not in chosen:
        pytest.skip(f"{member}: not drawn this run (seed {seed}; {replay})")
    print(f"{member}: drawn (seed {seed}; {replay})")


def compose(overrides=()):
    """The root config composed with Hydra's compose API, as llmtrain/pretrain.py would see it."""
    from llmtrain.config import compose_config

    return compose_config(overrides)


def tiny_overrides(corpus: dict, run_dir: str, model: str = "gpt", steps: int = 8) -> list[str]:
    """Hydra overrides for a seconds-long run of a tiny GPT, Llama, ERNIE or MoE (4 experts, top-2) on `corpus`;
    no loss_curve.png (a plot costs more than a tiny run's steps: tests/e2e/test_pretrain.py turns it back on)."""
    arch = {
        "gpt": ["model=gpt-tiny", "model.max_position_embeddings=64"],
        "llama": ["model=llama-tiny", "model.num_kv_heads=2"],
        "ernie": ["model=ernie-tiny", "model.max_position_embeddings=64"],
        "moe": ["model=moe-tiny", "model.num_kv_heads=2", "model.moe_ffn_hidden_size=32", "model.moe_num_experts=4"],
    }[model]
    return arch + [
        "model.hidden_size=32", "model.num_layers=4", "model.num_heads=4", "model.ffn_hidden_size=64",
        f"data.prefixes=[{corpus['prefix']}]", f"data.tokenizer={corpus['tokenizer']}", "data.seq_len=32",
        "data.num_workers=0", f"train.max_steps={steps}", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.progress_bar=false", "train.visualdl=false", "train.loss_curve=false", "checkpoint.save_final=false",
        "checkpoint.resume=none", "optim.lr=1e-3", "optim.warmup_steps=2", f"run.dir={run_dir}",
    ]


def planner_benchmark():
    """benchmarks/planner.py as a module (its H200 rows and published points), loaded once per process."""
    import importlib.util
    import sys

    if "planner_benchmark" not in sys.modules:
        spec = importlib.util.spec_from_file_location("planner_benchmark", os.path.join(REPO, "benchmarks", "planner.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["planner_benchmark"] = module
        spec.loader.exec_module(module)
    return sys.modules["planner_benchmark"]


def tp_topology():
    """The Topology of a launch whose every rank is one tp group (the in-process entries of the tp2 parity launch):
    rank and tp group taken from fleet's initialised HybridCommunicateGroup, what the tp roles take."""
    import paddle.distributed as dist
    from paddle.distributed import fleet

    from llmtrain.parallel.layout import Layout
    from llmtrain.parallel.strategy import Topology

    hcg = fleet.get_hybrid_communicate_group()
    degree = hcg.get_model_parallel_world_size()
    if dist.get_world_size() != degree:
        raise RuntimeError(f"tp_topology needs a launch of tp ranks only: world {dist.get_world_size()}, tp {degree}")
    return Topology(rank=dist.get_rank(), world=degree, layout=Layout(tp=degree),
                    groups={"tp": hcg.get_model_parallel_group()}, hcg=hcg, on_cpu=True)

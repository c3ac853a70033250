"""What the planner's command prints: `--help`, units, the precision it planned, the overrides that launch a row;
and the vocabulary a published preset plans with.

    python -m pytest -q tests/plan/test_plan_cli.py
"""
from __future__ import annotations

import glob
import os
import re

import pytest

from llmtest import REPO, compose
from llmtrain.config import to_config

TINY = {"gpt-tiny", "llama-tiny", "moe-tiny", "deepseek-tiny", "ernie-tiny"}
"""Presets of no published model: their vocabulary is the tokenizer's."""


def test_help_names_calibrate_and_every_plan_field(capsys):
    from llmtrain.plan.__main__ import cli
    from llmtrain.plan.config import PlanConfig

    cli(["--help"])
    text = capsys.readouterr().out
    assert "--calibrate [--out PATH] [--quick]" in text and "usage: python -m llmtrain.plan" in text
    for name in PlanConfig.__dataclass_fields__:
        assert f"  plan.{name}=" in text, name
    assert "Devices of the job" in text  # the field's docstring
    assert "== Config ==" not in text and "Powered by Hydra" not in text  # not Hydra's dump


def test_published_presets_carry_their_vocabulary():
    """`model=llama-7b` plans Llama-2's 32000 tokens, not the tokenizer's 16k; every preset of a published model
    names its vocabulary."""
    from llmtrain.plan.model import planned_model

    import yaml

    for path in glob.glob(os.path.join(REPO, "conf", "model", "*.yaml")):
        name = os.path.basename(path)[:-5]
        with open(path) as f:
            vocab = yaml.safe_load(f).get("vocab_size")
        assert (vocab is None) == (name in TINY), (name, vocab)
    cfg = to_config(compose(["model=llama-7b", "data.tokenizer=/nonexistent"]))  # the tokenizer is not read
    assert planned_model(cfg).vocab_size == 32000
    assert to_config(compose(["model=tinyllama-1.1b"])).model.vocab_size == 32000


TINY_JOB = ["model=llama-tiny", "model.vocab_size=2560", "data.seq_len=128"]


def _cfg(*extra, model=TINY_JOB, devices=4):
    return to_config(compose([*model, "train.global_batch_size=16", f"plan.devices={devices}", *extra]))


@pytest.fixture(scope="module")
def h100_rows():
    """(config, ranked rows) of llama-tiny on 4 x h100 with train.amp=none: shared by the tests below."""
    from llmtrain.plan.search import rank_layouts

    cfg = _cfg("plan.device=h100")
    return cfg, rank_layouts(cfg, cfg.model)


def test_every_ranked_row_launches_with_its_overrides(h100_rows):
    """A row's name (`dp2sharding2s1`) is not a conf/parallel/ file; its overrides compose, pass the layout rules and
    give exactly the row's degrees, micro-batch and recompute, and add train.amp=bf16 where bf16 was planned. One
    composition per kind of row (a preset, and each kind of custom layout) keeps it to seconds."""
    from llmtrain.parallel.layout import layout_problems, model_fit_problems

    base = [*TINY_JOB, "train.global_batch_size=16"]
    _, rows = h100_rows
    custom = [r for r in rows if r["overrides"][0] == "+parallel=custom"]
    picks = [next(r for r in rows if r["overrides"][0] == "+parallel=dp4"),  # a preset of exactly those degrees
             next(r for r in custom if r["pp"] > 1), next(r for r in custom if r["sharding_stage"] == 3),
             next(r for r in custom if r["tp"] > 1 and r["pp"] == 1), next(r for r in rows if r["recompute"])]
    kinds = {id(r): r for r in picks}
    for r in kinds.values():
        run = to_config(compose(base + r["overrides"]))
        layout, problems = layout_problems(run.parallel, run.train, 4)
        assert not problems and not model_fit_problems(run.parallel, run.model), (r["overrides"], problems)
        got = {k: getattr(run.parallel, k) for k in ("dp", "tp", "pp", "sharding", "sharding_stage", "pp_schedule",
                                                     "virtual_pp")}
        assert got == {k: r[k] for k in got}, r["overrides"]
        assert (layout.micro_batch, layout.grad_accum, run.train.recompute) == (r["micro_batch"], r["grad_accum"],
                                                                                r["recompute"])
        assert run.train.amp == "bf16" == r["amp"]  # train.amp=none on a GPU profile: planned (and launched) in bf16


def test_table_and_explanation_say_the_precision_and_print_units(h100_rows):
    from llmtrain.plan.__main__ import plan
    from llmtrain.plan.report import explained, ranked_table

    cfg, rows = h100_rows
    table = "\n".join(ranked_table(rows, cfg, 5))
    assert "bf16 AMP (train.amp=none, but a GPU profile is planned in bf16" in table
    one = _cfg("plan.device=h100", "+parallel=dp2", "parallel.sharding=2", "train.micro_batch_size=2",
               model=["model=llama-7b", "data.seq_len=1024"])
    text = "\n".join(explained(plan(one)[0], one, 80 * 2**30))
    assert "bf16 AMP (train.amp=none" in text
    assert re.search(r"memory on the worst rank: \d+\.\d\d GiB of 80\.00 GiB \((fits|does NOT fit); ", text), text
    assert re.search(r"step time \d+\.\d ms:", text) and "tokens/s per device, MFU " in text
    assert "launch it with: +parallel=custom parallel.dp=2 parallel.sharding=2 train.micro_batch_size=2 " \
           "train.amp=bf16" in text
    for out in (table, text):
        assert not re.search(r"\d\.\d{5,}|\d{7,}", out), out  # no raw floats or byte counts
    bf16 = _cfg("plan.device=h100", "train.amp=bf16", devices=1)
    assert "bf16 AMP:" in "\n".join(ranked_table(plan(bf16), bf16, 1))  # asked for: nothing to explain
    cpu = _cfg("plan.device=cpu-here", "plan.profile=null", devices=1)
    assert ", fp32:" in "\n".join(ranked_table(plan(cpu), cpu, 1))

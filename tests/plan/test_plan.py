"""The planner: its parameter list is the model's, its layouts are the ones training accepts, its JSON has the
issue's fields. (Plan == measured per rank is checked in tests/parallel/test_parity.py on every CI layout.)

    python -m pytest tests/plan -q
"""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from llmtest import compose
from llmtrain.config import to_config
from llmtrain.models.size import parameter_count
from llmtrain.plan.memory import greedy_partition, param_specs, predict_ranks, zero3_padded

PRESETS = ["gpt-tiny", "llama-tiny", "gpt2-small", "tinyllama-1.1b", "llama-7b", "ernie-tiny", "ernie-3.0-base-zh",
           "ernie-3.0-medium-zh"]


@pytest.mark.parametrize("preset", PRESETS)
def test_parameter_list_counts_the_model(preset):
    cfg = to_config(compose([f"model={preset}", "model.vocab_size=2560"]))
    specs = param_specs(cfg.model)
    assert sum(s.numel for s in specs) == parameter_count(cfg.model)
    assert len({s.name for s in specs}) == len(specs)


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny", "ernie-tiny", "moe-tiny", "tinyllama-1.1b"])
def test_parameter_list_is_read_off_the_model(preset):
    """Names, shapes and tp split axes come from the lazily built model and its tags (llmtrain/plan/params.py);
    the split axes agree with the tests' own name-based reference of fleet's layout (memory_checks.SPLIT_AXES),
    LoRA adapters included."""
    import importlib.util
    import re
    from pathlib import Path

    from llmtrain.models.lora import LoraConfig

    path = Path(__file__).resolve().parents[1] / "parallel" / "memory_checks.py"
    spec = importlib.util.spec_from_file_location("memory_checks_reference", path)
    ref = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ref  # dataclasses look their module up
    spec.loader.exec_module(ref)
    SPLIT_AXES = ref.SPLIT_AXES

    cfg = to_config(compose([f"model={preset}", "model.vocab_size=2560"]))
    expert_or_shared = re.compile(r".*\.mlp\.(experts|router)\..*")
    for lora in (None, LoraConfig(rank=4)):
        for s in param_specs(cfg.model, lora):
            if s.name.endswith(("lora_A", "lora_B")):
                base = s.name.rsplit(".", 1)[0]
                row = re.fullmatch(r".*\.(o|down)_proj", base) is not None
                want = (0 if row else None) if s.name.endswith("lora_A") else (None if row else 1)
            elif expert_or_shared.fullmatch(s.name):
                want = None
            else:
                want = next((a for p, a in SPLIT_AXES if re.fullmatch(p, s.name)), None)
            assert s.split_axis == want, (s.name, s.split_axis, want)
            assert s.trainable == (lora is None or s.name.endswith(("lora_A", "lora_B")))


def test_paddle_partition_and_padding_rules():
    # ZeRO-1 sorts largest first; ZeRO-2 keeps the order: [1, 5, 5, 2] -> sizes differ
    assert greedy_partition([1, 5, 5, 2], 2, sort=True) == [[1, 3], [2, 0]]
    assert greedy_partition([1, 5, 5, 2], 2, sort=False) == [[0, 2], [1, 3]]
    assert zero3_padded(1000, 4, 2, "cpu") == 1024  # 4000 bytes -> 4096
    assert zero3_padded(1025, 4, 3, "cpu") == 2049  # 2048 aligned, then a multiple of 3
    assert zero3_padded(100, 2, 2, "gpu") == 128  # 256-byte alignment of bf16


def test_tp_pp_split_the_parameters():
    cfg = to_config(compose(["model=llama-tiny", "model.vocab_size=2560", "model.num_layers=8"]))
    whole = predict_ranks(cfg.model, SimpleNamespace(dp=1, tp=1, pp=1, sharding=1, sharding_stage=1, virtual_pp=1,
                                                     zero3_segment_size=2**20))[0]["param_numel"]
    split = predict_ranks(cfg.model, SimpleNamespace(dp=1, tp=2, pp=2, sharding=1, sharding_stage=1, virtual_pp=1,
                                                     pp_layers=(4, 4), zero3_segment_size=2**20))
    assert sum(r["param_numel"] for r in split if r["tp_rank"] == 0) * 2 < whole * 1.1


@pytest.mark.slow
def test_cli_json_ranks_valid_layouts(tmp_path):
    """Run from an empty directory: it stays empty (no outputs/<name>/), and no Paddle ccache warning is printed."""
    import os

    from launch import path_without_ccache
    from llmtest import REPO

    proc = subprocess.run(
        [sys.executable, "-m", "llmtrain.plan", "model=llama-7b", "model.vocab_size=32000", "data.seq_len=4096",
         "train.global_batch_size=64", "plan.devices=8", "plan.device=a100-80g", "plan.format=json", "plan.top=3",
         "train.amp=bf16"], capture_output=True, text=True, timeout=300, check=True, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=REPO, PATH=path_without_ccache()))
    assert os.listdir(tmp_path) == [] and "ccache" not in proc.stderr, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert len(rows) == 3
    for r in rows:
        assert r["dp"] * r["tp"] * r["pp"] * r["sharding"] == 8 and r["fits"] is True
        m = r["memory_bytes"]
        assert set(m) == {"params", "grads", "optimizer", "activations", "other", "total", "allocated", "recompute_transient"}
        assert m["total"] == sum(m[k] for k in ("params", "grads", "optimizer", "activations", "other"))
        assert m["total"] - m["allocated"] == 2 * 2**30  # the a100-80g margin is outside the allocator's count
        for k in ("virtual_pp", "sharding_stage", "micro_batch", "recompute", "step_time_s",
                  "tokens_per_sec_per_device", "mfu"):
            assert k in r
    assert rows[0]["tokens_per_sec_per_device"] >= rows[1]["tokens_per_sec_per_device"]


def test_auto_resolves_to_the_top_fitting_layout():
    from llmtrain.parallel.layout import layout_problems, model_fit_problems
    from llmtrain.plan.auto import choose_layout

    lines = []
    cfg = to_config(compose(["model=llama-tiny", "model.vocab_size=2560", "+parallel=auto", "train.global_batch_size=8"]))
    chosen = choose_layout(cfg, world_size=4, log=lines.append)
    p = chosen.parallel
    assert p.name != "auto" and p.dp * p.tp * p.pp * p.sharding == 4
    layout, problems = layout_problems(p, chosen.train, 4)
    assert not problems and not model_fit_problems(p, chosen.model)
    assert layout.global_batch == 8 and chosen.train.micro_batch_size == layout.micro_batch
    assert lines[-1].startswith(f"parallel=auto chose {p.name}: ") and len(lines) == 5  # header, top three, why
    assert choose_layout(to_config(compose(["+parallel=dp2"])), world_size=2).parallel.name == "dp2"  # untouched


def test_auto_can_choose_dualpipev():
    """12 blocks on 4 CPU devices (the packaged cpu-here profile, a small vocabulary), a global batch of 16: DualPipeV's
    smaller bubble puts dp2 · pp2 DualPipeV first (0.606 s predicted vs dp4's 0.610 s; every pipeline stage priced,
    llmtrain/plan/estimate.py `compute_estimate`), and +parallel=auto resolves to it: a layout the run accepts, the V
    with 2 x pp chunks and a split of them. (Before the middle stages were priced, pp4 DualPipeV won with 16 blocks
    and a vocabulary of 2560; its cost-balanced split puts 5 blocks on stage 1, which now costs it the lead.)"""
    from llmtrain.parallel.layout import layout_problems, model_fit_problems
    from llmtrain.plan.auto import choose_layout

    lines = []
    cfg = to_config(compose(["model=llama-tiny", "model.vocab_size=256", "model.num_layers=12", "plan.profile=null",
                             "+parallel=auto", "train.global_batch_size=16"]))
    chosen = choose_layout(cfg, world_size=4, log=lines.append)
    p = chosen.parallel
    assert (p.name, p.pp_schedule, p.dp, p.pp, chosen.train.micro_batch_size) == ("dp2pp2dpv", "dualpipev", 2, 2,
                                                                                  1), lines
    layout, problems = layout_problems(p, chosen.train, 4)
    assert not problems and not model_fit_problems(p, chosen.model)
    assert layout.v_shape and len(layout.pp_layers) == 4 and sum(layout.pp_layers) == 12 and layout.grad_accum == 8
    assert "parallel.pp_schedule=dualpipev" in lines[-1], lines[-1]  # the overrides that pin the choice


def test_recompute_modes_are_planned_between_none_and_full():
    from llmtrain.plan.devices import get_device
    from llmtrain.plan.search import evaluate, rank_layouts
    from llmtrain.parallel.layout import layout_problems

    cfg = to_config(compose(["model=llama-tiny", "model.vocab_size=2560", "model.attention=math", "data.seq_len=256",
                             "+parallel=tp2", "train.global_batch_size=8", "train.micro_batch_size=2", "plan.devices=2",
                             "plan.device=a100-80g"]))
    layout, problems = layout_problems(cfg.parallel, cfg.train, 2)
    assert not problems
    modes = ("none", "core_attn", "full_attn", "full")
    rows = {m: evaluate(cfg, cfg.model, layout, m, get_device("a100-80g")) for m in modes}
    act = {m: r["memory_bytes"]["activations"] for m, r in rows.items()}
    comp = {m: r["compute_s"] for m, r in rows.items()}
    assert act["full"] < act["full_attn"] < act["core_attn"] < act["none"]  # core_attn drops the probabilities
    assert comp["none"] < comp["core_attn"] < comp["full_attn"] < comp["full"]
    assert evaluate(cfg, cfg.model, layout, "selective", get_device("a100-80g"))["memory_bytes"] == rows["core_attn"][
        "memory_bytes"]  # the planner's older name
    from llmtrain.plan.estimate import _ring

    dev = get_device("a100-80g")
    block = _ring(2 * 256 * cfg.model.hidden_size * 2, 2, dev.nvlink_bw, dev.nvlink_alpha)  # one [b, s, h] bf16
    again = layout.grad_accum * cfg.model.num_layers * 2 * block  # the two forward all-reduces per block, again
    assert rows["full"]["tp_comm_s"] - rows["none"]["tp_comm_s"] == pytest.approx(again)
    assert all(r["runnable"] for r in rows.values())
    assert [r["recompute"] for r in rows.values()] == list(modes)  # what train.recompute takes
    assert "train.recompute=core_attn" in rows["core_attn"]["overrides"]
    ranked = rank_layouts(cfg, cfg.model)
    assert {r["recompute_granularity"] for r in ranked} == set(modes)


def test_ranking_shows_progress_on_a_terminal_only(monkeypatch):
    """A ranking that takes tens of seconds says how far it is on a terminal (stderr), and writes nothing to a log."""
    import io
    import sys

    from llmtrain.plan.model import planned_model
    from llmtrain.plan.search import rank_layouts

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    cfg = to_config(compose(["model=llama-7b", "plan.device=h100", "plan.devices=8",
                             "train.global_batch_size=16", "data.seq_len=2048", "train.amp=bf16"]))
    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        rank_layouts(cfg, planned_model(cfg), progress=True)
        assert ("ranking llama-7b on 8 x h100" in stream.getvalue()) is shown, stream.getvalue()[-300:]

"""scripts/gpu_acceptance.sh --dry-run: exits 0 on CPU and prints commands that compose and validate.

    python -m pytest tests/scripts/test_gpu_acceptance.py -q

Every printed pretraining launch and planner call is taken apart and its Hydra overrides are
composed with our config tree; the layout must pass every check for the launch's process count
(the planner's: plan.devices) and the model must fit it; pytest commands must name existing files
and their -k expression must select exactly the layouts the GPU count can run. The packed fine-tuning
launch composes with conf/finetune.yaml, and the fp16_overflow step's runs compose and name existing files.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.config import compose_config, to_config
from llmtrain.models.config import fusion_problems
from llmtrain.parallel.layout import layout_problems, model_fit_problems

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "parallel"))
sys.path.insert(0, str(REPO / "scripts"))
import gpu_acceptance  # noqa: E402
from test_parity import LAYOUTS  # noqa: E402


def _commands(gpus: int, out: Path) -> list[tuple[dict, list[str]]]:
    proc = subprocess.run(["bash", "scripts/gpu_acceptance.sh", "--dry-run", "--gpus", str(gpus), "--device", "h100",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cmds = []
    for line in proc.stdout.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        words = shlex.split(line)
        env = {}
        while "=" in words[0] and not words[0].startswith(("/", "-")):
            k, v = words.pop(0).split("=", 1)
            env[k] = v
        if ">" in words:
            words = words[: words.index(">")]
        cmds.append((env, words))
    return cmds


def _selected(expr: str) -> set[str]:
    from _pytest.mark.expression import Expression

    compiled = Expression.compile(expr)
    ids = {name: f"test_layout_matches_single_process[{name}]" for name, _ in LAYOUTS}
    return {name for name, i in ids.items() if compiled.evaluate(lambda word: word.lower() in i.lower())}


def _check_run(overrides: list[str], nproc: int, on_gpu_model: bool = True, config_name: str = "config") -> None:
    cfg = to_config(compose_config(overrides, config_name=config_name))
    assert fusion_problems(cfg.model, on_gpu=on_gpu_model) == []
    if cfg.parallel is None or cfg.parallel.name == "auto":
        return  # the planner ranks/chooses the layout (tests/plan cover the ranking and +parallel=auto)
    layout, problems = layout_problems(cfg.parallel, cfg.train, nproc)
    problems += model_fit_problems(cfg.parallel, cfg.model)
    assert problems == [], (overrides, problems)


@pytest.mark.parametrize("gpus", [8, 2])
def test_dry_run_commands_are_well_formed(gpus, tmp_path):
    cmds = _commands(gpus, tmp_path)
    launches = plans = pytests = finetunes = subcommands = 0
    for env, words in cmds:
        if words[1:3] == ["-m", "paddle.distributed.launch"] and "llmtrain/finetune.py" in words:
            assert int(words[words.index("--nproc_per_node") + 1]) == 2
            overrides = words[words.index("llmtrain/finetune.py") + 1:]
            assert {"data.packing=true", "model.attention=auto", "train.amp=bf16"} <= set(overrides)
            _check_run(overrides, 2, config_name="finetune")
            finetunes += 1
        elif words[1:3] == ["-m", "paddle.distributed.launch"]:
            nproc = int(words[words.index("--nproc_per_node") + 1])
            assert nproc == gpus
            overrides = words[words.index("llmtrain/pretrain.py") + 1:]
            assert any(o.startswith(f"run.dir={tmp_path}") for o in overrides)
            _check_run(overrides, nproc)
            if "parallel.mp_async_allreduce=true" in overrides:
                assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
            launches += 1
        elif words[1:3] == ["-m", "llmtrain.plan"]:
            overrides = words[3:]
            devices = int(next(o for o in overrides if o.startswith("plan.devices=")).split("=")[1])
            assert devices == gpus and "plan.format=json" in overrides
            _check_run(overrides, devices)
            plans += 1
        elif words[1:3] == ["-m", "pytest"]:
            files = [w for w in words[3:] if w.startswith("tests/")]
            assert files and all((REPO / f).exists() for f in files), files
            if "tests/parallel/test_parity.py" in files:
                selected = _selected(words[words.index("-k") + 1])
                expected = {name for name, n in LAYOUTS if n <= gpus}
                assert selected == expected, (selected, expected)
                assert "LLMTRAIN_PARITY_TOL" in env
            pytests += 1
        elif words[1].endswith("scripts/gpu_acceptance.py"):
            assert words[2] in ("env", "fp16-overflow", "ep-alltoall", "cp-exchanges", "fp8-vs-bf16"), words
            if words[2] != "env" and gpus == 2:  # the same 2-GPU runs whatever --gpus: composed once
                runs = {"fp16-overflow": gpu_acceptance.fp16_overflow_runs,
                        "ep-alltoall": gpu_acceptance.ep_alltoall_runs,
                        "cp-exchanges": gpu_acceptance.cp_exchanges_runs,
                        "fp8-vs-bf16": gpu_acceptance.fp8_vs_bf16_runs}[words[2]](Path(words[3]))
                for run in runs:
                    if "call" in run:
                        assert (REPO / run["call"].split(":")[0]).is_file(), run
                    else:
                        _check_run(run["overrides"], 2)
            subcommands += 1
    assert launches == plans == (6 if gpus >= 4 else 4)
    assert pytests == 7 and finetunes == 1 and subcommands == 5


def test_too_few_gpus_refused(tmp_path):
    proc = subprocess.run(["bash", "scripts/gpu_acceptance.sh", "--dry-run", "--gpus", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--gpus 1: the parity suite needs at least 2 GPUs" in proc.stderr


def test_cp_exchanges_check_compares_every_exchange_with_the_fp32_ring(tmp_path):
    def write(name, losses):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i + 1, "loss": x, "grad_norm": 1.0}) + "\n" for i, x in enumerate(losses)))

    write("ring_fp32", [2.0, 1.9])
    for comm in gpu_acceptance.CP_COMMS:
        write(f"{comm}_bf16", [2.01, 1.93] if comm == "a2a" else [2.0, 1.9])
    assert gpu_acceptance.check_cp_exchanges(tmp_path) == []  # bf16 within 5e-2
    (tmp_path / "allgather_bf16" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.001,
                                                                            "grad_norm": 1.0}) + "\n")
    (tmp_path / "ring_bf16" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, "loss": x, "grad_norm": 1.0}) + "\n" for i, x in enumerate([2.0, 2.0])))
    problems = gpu_acceptance.check_cp_exchanges(tmp_path)
    assert len(problems) == 2 and "allgather_bf16: steps [1]" in problems[1] and "step 2 loss" in problems[0], problems

"""Config composition through Hydra and up-front validation."""
from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from llmtest import REPO, compose
from llmtrain.config import check_config, to_config
from llmtrain.parallel.layout import ConfigError, resolve_layout


def test_defaults_have_no_parallel_and_required_overrides_work():
    cfg = compose(["train.max_steps=7", "train.global_batch_size=32", "train.micro_batch_size=4",
                   "train.log_interval=3", "data.seq_len=256", "run.dir=/tmp/x", "seed=9"])
    assert cfg.parallel is None
    c = to_config(cfg)
    assert (c.train.max_steps, c.train.global_batch_size, c.train.micro_batch_size, c.train.log_interval) == (7, 32, 4, 3)
    assert (c.data.seq_len, c.run.dir, c.seed) == (256, "/tmp/x", 9)
    assert c.model.name == "gpt-tiny" and c.run.name == "gpt-tiny-single"


@pytest.mark.parametrize("name", ["dp2", "dp4", "dp8", "tp2", "tp4", "tp8", "pp2", "pp4", "sharding2", "sharding4",
                                  "zero2", "zero3", "dp2tp2", "tp2pp2", "dp2pp2", "tp2sharding2", "dp2tp2pp2", "pp4v2"])
def test_every_parallel_option_composes_and_resolves(name):
    c = to_config(compose([f"+parallel={name}", "train.micro_batch_size=1"]))
    assert c.parallel.name == name
    lay = resolve_layout(c.parallel, c.train, c.parallel.world())
    assert lay.world == c.parallel.world()


def test_parallel_fields_override_after_the_file():
    c = to_config(compose(["+parallel=tp2", "parallel.pp=2"]))
    assert (c.parallel.tp, c.parallel.pp, c.parallel.world()) == (2, 2, 4)
    assert c.run.name == "gpt-tiny-tp2"


def test_model_presets_compose():
    for name in ("gpt-tiny", "llama-tiny", "gpt2-small", "llama-1b", "llama-7b", "ernie-tiny", "ernie-3.0-base-zh",
                 "ernie-3.0-medium-zh"):
        c = to_config(compose([f"model={name}"]))
        assert c.model.name == name


def test_type_errors_name_the_field():
    with pytest.raises(Exception, match="max_steps"):
        to_config(compose(["train.max_steps=abc"]))


def test_bad_values_listed_together():
    c = to_config(compose(["model.position=alibi", "train.amp=fp8", "data.seq_len=4096", "optim.lr=-1"]))
    with pytest.raises(ConfigError) as e:
        check_config(c)
    msg = str(e.value)
    for needle in ("model.position='alibi'", "train.amp='fp8'", "data.seq_len=4096 > model.max_position_embeddings=1024",
                   "optim.lr=-1"):
        assert needle in msg


def test_entry_script_stops_before_any_work_with_the_numbers(tmp_path):
    """Bad batch arithmetic: the run exits non-zero with the fields and numbers, and writes nothing."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "llmtrain/pretrain.py", f"run.dir={run_dir}", "train.global_batch_size=10",
         "train.micro_batch_size=4", "data.tokenizer=/nonexistent"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "train.global_batch_size=10" in out and "not divisible by micro x data-parallel = 4 x 1 = 4" in out
    assert not run_dir.exists() or not any(run_dir.iterdir())  # Hydra may create it; nothing is written

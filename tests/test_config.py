"""Config composition through Hydra and up-front validation."""
from __future__ import annotations

import re
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


BAD = ["train.global_batch_size=10", "train.micro_batch_size=4", "data.tokenizer=/nonexistent"]


def test_entry_script_stops_before_any_work_with_the_numbers(tmp_path):
    """Bad batch arithmetic and a missing tokenizer: exit status 2, both problems with their numbers, no traceback,
    nothing written."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "llmtrain/pretrain.py", f"run.dir={run_dir}", *BAD],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "train.global_batch_size=10" in out and "not divisible by micro x data-parallel = 4 x 1 = 4" in out
    assert "data.tokenizer=/nonexistent" in out
    assert "Traceback" not in out
    assert not run_dir.exists() or not any(run_dir.iterdir())  # Hydra may create it; nothing is written


def test_full_traceback_on_request(tmp_path):
    proc = subprocess.run([sys.executable, "llmtrain/pretrain.py", f"run.dir={tmp_path}", *BAD],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=_env(HYDRA_FULL_ERROR="1"))
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr


@pytest.mark.slow
def test_config_error_under_the_launcher_is_said_once_with_status_2(tmp_path):
    from launch import launch_cmd, logs

    cmd = launch_cmd(["llmtrain/pretrain.py", "+parallel=dp2", f"run.dir={tmp_path / 'run'}", *BAD], 2, tmp_path / "log")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180, env=_env())
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    worker_logs = logs(tmp_path / "log", tail=200)
    assert worker_logs.count("not divisible by micro x data-parallel = 4 x 2 = 8") == 1, worker_logs
    # no Python traceback (a rank the launcher stops first may print Paddle's "C++ Traceback" signal banner)
    assert not re.search(r"^Traceback \(most recent call last\)", worker_logs, re.M), worker_logs


def test_parallel_options_are_degree_only_overrides():
    """conf/parallel/*.yaml state only what differs from the ParallelConfig defaults."""
    import glob
    import os

    import yaml

    from llmtrain.parallel.config import ParallelConfig

    defaults = ParallelConfig()
    for path in glob.glob(os.path.join(REPO, "conf", "parallel", "*.yaml")):
        with open(path) as f:
            d = yaml.safe_load(f)
        restated = [k for k in d if k not in ("defaults", "name") and d[k] == getattr(defaults, k)]
        assert not restated, (path, restated)


def _env(**extra):
    import os

    from launch import env

    e = env()
    e.pop("HYDRA_FULL_ERROR", None)
    e.update(extra)
    return e

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
                                  "zero2", "zero3", "dp2tp2", "tp2pp2", "dp2pp2", "tp2sharding2", "dp2tp2pp2", "pp4v2",
                                  "pp3", "pp3v2", "sharding2v2", "tp2sharding2v2"])
def test_every_parallel_option_composes_and_resolves(name):
    c = to_config(compose([f"+parallel={name}", "train.micro_batch_size=1"]))
    assert c.parallel.name == name
    lay = resolve_layout(c.parallel, c.train, c.parallel.world())
    assert lay.world == c.parallel.world()


def test_parallel_fields_override_after_the_file():
    """The default run name says the real degrees, not the preset's name: a later plain tp2 run must not find this
    tp2 x pp2 run's checkpoints in its directory (issue 38 §1)."""
    c = to_config(compose(["+parallel=tp2", "parallel.pp=2"]))
    assert (c.parallel.tp, c.parallel.pp, c.parallel.world()) == (2, 2, 4)
    assert c.run.name == "gpt-tiny-tp2pp2" and c.run.dir == "outputs/gpt-tiny-tp2pp2"
    assert to_config(compose(["+parallel=tp2"])).run.name == "gpt-tiny-tp2"
    names = {p: to_config(compose([f"+parallel={p}"])).run.name for p in ("zero3", "pp4v2", "tp2sp", "auto")}
    assert names == {"zero3": "gpt-tiny-sharding2s3", "pp4v2": "gpt-tiny-pp4v2", "tp2sp": "gpt-tiny-tp2sp",
                     "auto": "gpt-tiny-auto"}
    assert to_config(compose(["+parallel=dp2", "parallel.sharding=2"])).run.name == "gpt-tiny-dp2sharding2"
    assert to_config(compose(["+parallel=tp2cp2"])).run.name == "gpt-tiny-tp2cp2sp"  # the cp presets: launched in
    assert to_config(compose(["+parallel=dp2", "parallel.cp=2"])).run.name == "gpt-tiny-dp2cp2"  # test_context_parity


def test_unknown_keys_are_refused_with_the_nearest_name():
    """With or without `+`, a key the schema lacks is refused naming the nearest one and the override that works
    (issue 38 §3: `+train.max_step=10` used to run the default 20 steps and drop the key); a preset's typo too."""
    from llmtrain.config import command_line_problems

    for line in ("train.max_step=10", "+train.max_step=10", "++train.max_step=10"):
        (p,) = command_line_problems([line])
        assert p.startswith(f"{line}: train.max_step is not a config key") and "did you mean train.max_steps=10?" in p
    (p,) = command_line_problems(["--cfg", "job", "model=llama-tinny", "max_steps=5"])[:1]
    assert "did you mean model=llama-tiny?" in p
    assert "did you mean train.max_steps=5?" in command_line_problems(["max_steps=5"])[0]
    assert "did you mean train.anomaly.policy=stop?" in command_line_problems(["train.anomaly.polcy=stop"])[0]
    assert "did you mean data.files=[a.jsonl]?" in command_line_problems(["data.file=[a.jsonl]"], "finetune")[0]
    assert command_line_problems(["+parallel=tp2", "parallel.pp=2", "data.prefixes.0=x", "~seed", "hydra.run.dir=x",
                                  "run.overwrite=true", "model=llama-tiny"]) == []
    with pytest.raises(ConfigError, match=r"train.max_step: not a config key .*did you mean train.max_steps\?"):
        to_config(compose(["+train.max_step=10"]))  # the compose API (tests, the docs check, the planner's)


def test_unknown_key_exits_2_from_the_recipe_the_planner_and_the_launcher(tmp_path, capsys):
    """`+train.max_step=10` exits 2 naming train.max_steps before Hydra composes: from the recipe, the planner, and
    the launcher wrapper before any worker starts; export and generate name the nearest option."""
    from llmtrain.export import main as export_main
    from llmtrain.generate import main as generate_main

    for cmd in (["llmtrain/pretrain.py"], ["-m", "llmtrain.plan"],
                ["-m", "llmtrain.launch", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "log"),
                 "llmtrain/pretrain.py", "+parallel=dp2"]):
        proc = subprocess.run([sys.executable, *cmd, "+train.max_step=10"], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env=_env())
        assert proc.returncode == 2, (cmd, proc.stderr[-2000:])
        assert "did you mean train.max_steps=10?" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "log").exists()  # no worker was started
    for main, argv, near in ((export_main, ["--checkpoint", "x", "--ouput", "y"], "--output"),
                             (generate_main, ["--modle", "x"], "--model")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and f"did you mean {near}?" in capsys.readouterr().err


def test_model_presets_compose():
    for name in ("gpt-tiny", "llama-tiny", "gpt2-small", "tinyllama-1.1b", "llama-7b", "ernie-tiny", "ernie-3.0-base-zh",
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
    nothing written: not even an empty run directory (Hydra's run dir is the working directory), and no Paddle
    "No ccache found" warning (PATH holds no ccache, so Paddle would warn: llmtrain/__init__.py filters it)."""
    from launch import path_without_ccache

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "llmtrain/pretrain.py", f"run.dir={run_dir}", *BAD],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=_env(PATH=path_without_ccache()))
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "train.global_batch_size=10" in out and "not divisible by micro x data-parallel = 4 x 1 = 4" in out
    assert "data.tokenizer=/nonexistent" in out
    assert "Traceback" not in out and "ccache" not in out
    assert not run_dir.exists()


def test_full_traceback_on_request(tmp_path):
    proc = subprocess.run([sys.executable, "llmtrain/pretrain.py", f"run.dir={tmp_path}", *BAD],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=_env(HYDRA_FULL_ERROR="1"))
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr


@pytest.mark.slow
def test_config_error_under_the_launcher_is_said_once_with_status_2(tiny_corpus, tmp_path):
    """ONE 2-process launch for the family of up-front errors (issue 38 §4): bad batch arithmetic, a missing
    data.prefixes file, a data.weights count that does not match, data made with another tokenizer, a missing
    lexicon and a missing checkpoint.resume. Status 2, each problem said once (by rank 0), no traceback, and
    before any process group starts: no rank reaches fleet's initialisation, nothing is written in run.dir.
    (Each error alone, and a corrupt or run-directory checkpoint.resume, in process: tests/train/test_resolve.py,
    tests/train/test_rundir.py.)"""
    from launch import launch_cmd, logs

    missing = tmp_path / "nope" / "corpus_text_document"
    bad = [*BAD[:2], "model=ernie-tiny", "model.max_position_embeddings=64", "data.seq_len=32",
           "data.tokenizer=tokenizers/pd1998-bpe16k", f"data.prefixes=[{tiny_corpus['prefix']},{missing}]",
           "data.weights=[1.0]", "data.masking.strategy=entity", "data.masking.entity_source=lexicon",
           f"data.masking.lexicon={tmp_path / 'entities.txt'}", f"checkpoint.resume={tmp_path / 'no-run'}"]
    cmd = launch_cmd(["llmtrain/pretrain.py", "+parallel=dp2", f"run.dir={tmp_path / 'run'}", *bad], 2,
                     tmp_path / "log")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180, env=_env())
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    worker_logs = logs(tmp_path / "log", tail=200)
    for needle in ("not divisible by micro x data-parallel = 4 x 2 = 8", f"{missing}.bin does not exist",
                   "data.weights has 1 entries for 2 data.prefixes", f"{tiny_corpus['prefix']} was preprocessed with "
                   "tokenizer", f"data.masking.lexicon={tmp_path / 'entities.txt'}: ",
                   f"checkpoint.resume={tmp_path / 'no-run'}: no such directory"):
        assert worker_logs.count(needle) == 1, (needle, worker_logs)
    # no Python traceback (a rank the launcher stops first may print Paddle's "C++ Traceback" signal banner)
    assert not re.search(r"^Traceback \(most recent call last\)", worker_logs, re.M), worker_logs
    assert "layout dp2" not in worker_logs and "HybridParallel" not in worker_logs, worker_logs
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


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


def test_chinese_and_spaced_paths_need_hydra_quotes_and_the_refusal_names_them(tmp_path):
    """A Chinese path stopped Hydra with a bare LexerNoViableAltException; the check before Hydra now names the
    quoted form, which composes (spaces inside it too) and which a run can write to."""
    from llmtrain.config import command_line_problems
    from llmtrain.train.writable import output_problems

    run_dir = str(tmp_path / "人民日报 实验")
    (problem,) = command_line_problems([f"run.dir={run_dir}"])
    assert problem == (f"run.dir={run_dir}: Hydra takes a value with non-ASCII characters or commas only in quotes: "
                       f"give \"run.dir='{run_dir}'\" (the double quotes for the shell; spaces inside quotes are fine)")
    cfg = to_config(compose([f"run.dir='{run_dir}'", "run.name='中文运行'"]))
    assert cfg.run.dir == run_dir and cfg.run.name == "中文运行"
    assert output_problems(cfg, space=False) == []

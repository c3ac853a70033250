"""The documentation: the site builds in strict mode, README links resolve, and every command in README.md and
docs/*.md is real (tests/docs_commands.py says what "real" means per kind of command).

    python -m pytest -q tests/test_docs.py
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import docs_run
import pytest

from docs_commands import REPO, Command, all_commands, check, commands_of_text, hydra_session, run_dir_problems
from llmtest import drawn_or_skip

COMMANDS = all_commands()


def test_site_builds_in_strict_mode(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, or a page missing from the nav, fails the build."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                        "-f", os.path.join(REPO, "mkdocs.yml"), "-d", str(tmp_path / "site")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_links_resolve():
    """README.md is outside the site: its relative links (and their anchors in docs/) are checked here."""
    from markdown.extensions.toc import slugify

    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "README.md links nowhere"
    bad = []
    for link in links:
        if re.match(r"^[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        full = os.path.join(REPO, path)
        if not os.path.exists(full):
            bad.append(f"{link}: no {path}")
        elif anchor:
            with open(full, encoding="utf-8") as f:
                heads = [slugify(m, "-") for m in re.findall(r"^#+\s+(.*?)\s*$", f.read(), flags=re.M)]
            if anchor not in heads:
                bad.append(f"{link}: no heading #{anchor} in {path}")
    assert not bad, "README.md links that lead nowhere:\n" + "\n".join(bad)


def test_paths_named_in_the_docs_exist():
    """Every repository path the README and the pages name in code spans (`llmtrain/resolve.py`,
    `tests/x.py::test_y`, `conf/parallel/`) exists, with the named test: a moved or renamed module shows up here."""
    span = re.compile(r"`((?:llmtrain|scripts|conf|tests|deploy|docker|benchmarks|tokenizers)/[^`\s]*)`")
    placeholder = re.compile(r"[<>{}*]|/[A-Z_]+(\.|/|$)")  # step_<N>, {a,b}, conf/data/NAME.yaml
    missing, seen = [], 0
    for path in [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for m in span.finditer(text):
            named, _, test = m.group(1).partition("::")
            named = named.rstrip("/.,;:")
            if placeholder.search(named):
                continue
            seen += 1
            where = f"{os.path.relpath(path, REPO)}:{text[:m.start()].count(chr(10)) + 1}"
            full = os.path.join(REPO, named)
            if not os.path.exists(full):
                missing.append(f"{where}: {named}")
            elif test:  # tests/x.py::test_name or ::test_prefix_*
                with open(full, encoding="utf-8") as f:
                    if not re.search(rf"^def {re.escape(test.rstrip('*'))}{'' if test.endswith('*') else '[(]'}",
                                     f.read(), flags=re.M):
                        missing.append(f"{where}: {named}::{test}")
    assert seen > 50, f"only {seen} repository paths found in the docs: is the pattern still right?"
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_every_model_preset_is_listed():
    """docs/configuration.md's `model/` group list and docs/models.md's preset table name every conf/model/*.yaml,
    and nothing that is not one."""
    presets = {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(REPO, "conf", "model", "*.yaml"))}
    with open(os.path.join(REPO, "docs", "configuration.md"), encoding="utf-8") as f:
        group = re.search(r"groups: `model/` \(`([^`]+)`", f.read())
    assert group, "docs/configuration.md no longer lists the model group as groups: `model/` (`...`)"
    with open(os.path.join(REPO, "docs", "models.md"), encoding="utf-8") as f:
        table = re.search(r"^\| preset \| what it is \|\n\|---\|---\|\n((?:\|.*\n)+)", f.read(), flags=re.M)
    assert table, "docs/models.md has no `| preset | what it is |` table"
    in_table = {name for row in table.group(1).splitlines() for name in re.findall(r"`([^`]+)`", row.split("|")[1])}
    assert set(group.group(1).split()) == presets, ("docs/configuration.md", presets ^ set(group.group(1).split()))
    assert in_table == presets, ("docs/models.md", presets ^ in_table)


def test_no_page_speaks_of_the_issue_tracker():
    """The docs describe the project, not the tracker it was built from ("the issue's run", "issue 38")."""
    found = []
    for path in [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if re.search(r"\bthe issue's\b|\bissue \d+\b|\bthe issue\b", line, flags=re.I):
                    found.append(f"{os.path.relpath(path, REPO)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_readme_opens_with_the_two_commands():
    readme = [c for c in COMMANDS if c.source.endswith("README.md")]
    assert [c.argv for c in readme[:2]] == [["bash", "scripts/quickstart.sh"], ["bash", "scripts/test.sh"]]


@pytest.fixture(scope="module")
def hydra():
    with hydra_session():
        yield


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{os.path.relpath(c.source, REPO)}:{c.line}" for c in COMMANDS])
def test_doc_command_is_real(cmd: Command, hydra):
    check(cmd)


def test_the_pages_training_commands_in_order_keep_to_their_own_run_directories(hydra):
    """Run in order in one fresh directory, no training command of a page lands in a run directory an earlier
    command (of any page) made, unless it reruns that command, starts anew with run.overwrite=true, or continues it
    by the same explicit run.dir on its page (long-context.md's second command used to find "nothing to train")."""
    commands = all_commands()
    for cmd in commands:
        try:
            check(cmd)
        except AssertionError:
            pass  # reported by test_doc_command_is_real
    assert not run_dir_problems(commands), "\n".join(run_dir_problems(commands))


TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.ffn_hidden_size=64",
        "model.max_position_embeddings=64", "data.seq_len=32", "data.num_workers=0", "train.progress_bar=false",
        "train.visualdl=false"]
"""Appended to every command of a page's sequence (the same to each, so the sequence means what it did): a model and
sequence small enough to run a page's commands for real in seconds."""


def test_changing_runs_recipes_do_what_the_page_says(tiny_corpus, tmp_path, monkeypatch, hydra):
    """docs/changing-runs.md's four "Extending a finished run" commands, run for real in order in one fresh
    directory (shrunk: `TINY`, the tiny corpus): the WSD continuation sets the first run's step_20 and its metrics
    aside under work/runs/wsd/superseded/1/, the cosine extension is refused without optim.on_resume=config and runs
    with it, and the first command run again says the run is finished."""
    import json

    from hydra import compose

    from llmtrain.errors import ConfigError, RunFinished
    from llmtrain.pretrain import pretrain

    page = os.path.join(REPO, "docs", "changing-runs.md")
    with open(page, encoding="utf-8") as f:
        recipes = [c for c in commands_of_text(f.read(), page) if c.argv[:2] == ["python", "llmtrain/pretrain.py"]]
    wsd20, wsd40, cos20, cos40 = (c.argv[2:] for c in recipes[:4])
    assert "checkpoint.resume=work/runs/wsd/checkpoints/step_16" in wsd40 and "optim.on_resume=config" in cos40
    data = [f"data.prefixes=[{tiny_corpus['prefix']}]", f"data.tokenizer={tiny_corpus['tokenizer']}"]
    monkeypatch.chdir(tmp_path)

    def run(argv):
        return pretrain(compose(config_name="config", overrides=[*argv, *TINY, *data]))

    run(wsd20)
    with pytest.raises(RunFinished, match=r"nothing to train: run.dir=work/runs/wsd holds step 20 of run .* To train "
                                          r"on, raise train.max_steps .*to start a new run instead: start the new run "
                                          r"in its own directory \(run.dir=work/runs/wsd-2\)"):
        run(wsd20)
    run(wsd40)
    wsd = tmp_path / "work" / "runs" / "wsd"
    aside = wsd / "superseded" / "1"
    assert sorted(os.listdir(wsd / "checkpoints")) == ["step_36", "step_40"]
    assert os.listdir(aside / "checkpoints") == ["step_20"] and (aside / "config.yaml").exists()
    assert [json.loads(x)["step"] for x in open(aside / "metrics.jsonl")] == [17, 18, 19, 20]
    assert [json.loads(x)["step"] for x in open(wsd / "metrics.jsonl")] == list(range(1, 41))
    run(cos20)
    with pytest.raises(ConfigError, match=r"resume from step 20: train.max_steps=20 in the checkpoint, 40 now: the LR "
                                          r"schedule changed and the LR of step 21"):
        run([a for a in cos40 if a != "optim.on_resume=config"])
    assert run(cos40)["step"] == 40
    assert sorted(os.listdir(tmp_path / "work" / "runs" / "cos" / "checkpoints")) == ["step_20", "step_40"]


UNITS = docs_run.units()


@pytest.mark.parametrize("unit", UNITS)
def test_a_pages_commands_do_what_the_page_says(unit):
    """One ```bash block of a page (drawn per suite run: LLMTRAIN_SAMPLE_SEED=all runs every one), its commands run
    for real in order in one fresh directory, shrunk as tests/docs_run.py says: each exits 0 (or is refused where
    the page marks it), makes the files the page says and prints the line the page quotes; a command this machine
    cannot run is classified there with its reason."""
    drawn_or_skip(unit, [(u,) for u in UNITS])
    page, _, line = unit.partition(":")
    results = docs_run.run_page(page, only=int(line))
    for r in results:
        print(f"{r.where}\n   {r.status} ({r.seconds:.1f} s)")
    failed = [f"{r.where}\n   {r.status}\n   " + "\n   ".join(r.output.strip().split("\n")[-20:])
              for r in results if r.status.startswith("FAILED")]
    assert not failed, "\n".join(failed)


def test_every_command_is_run_or_classified():
    """No command of any page is silently left out: each one's program is one tests/docs_run.py runs, or a rule of
    its `not_here` classifies it with a reason; and every page with commands is among the drawn blocks."""
    unknown = [c.where() for c in all_commands() if docs_run.not_here(c, c.argv) is None
               and docs_run.program(c.argv) not in docs_run.RUNNABLE]
    assert not unknown, "neither run nor classified (add a rule with its reason to tests/docs_run.py):\n" + \
        "\n".join(unknown)
    assert {u.partition(":")[0] for u in UNITS} == {os.path.relpath(c.source, REPO) for c in all_commands()}


@pytest.mark.parametrize("line", [
    "python llmtrain/pretrain.py model=llama-tiny train.max_stepz=50",  # no such field
    "python llmtrain/pretrain.py model=llama-tiny +train.max_step=50",  # a `+` key the schema lacks (was dropped)
    "python llmtrain/pretrain.py model=llama-tinyy",  # no such preset
    "python llmtrain/pretrain.py +parallel=dp2",  # 2 ranks' layout on one process
    "python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py +parallel=dp2   # expect: refused",
    "python -m llmtrain.export --checkpoint run --outptu out/",  # the parser's own error
    "python -m llmtrain.plan model=llama-7b plan.device=a100-81g",
    "bash scripts/quickstart.sh train.max_steps=0",  # forwarded to the script's own launch command
    "pyhton llmtrain/pretrain.py",
])
def test_a_wrong_doc_command_fails(line, hydra):
    """The checker is not a rubber stamp: each of these wrong commands must fail it."""
    (cmd,) = commands_of_text(f"```bash\n{line}\n```", os.path.join(REPO, "README.md"))
    with pytest.raises(Exception):
        check(cmd)

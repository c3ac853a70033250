"""Every command of a docs page run for real, in order, in one fresh directory (used by tests/test_docs.py).

    python tests/docs_run.py docs/checkpoints.md      # one page: each command's result, time and checks
    python tests/docs_run.py --all                    # every page, one after the other

The fresh directory holds what the pages' relative paths need: `conf/`, `llmtrain/`, `scripts/`, `docker/`,
`deploy/` linked to this checkout, `tokenizers/` copied (data.md trains a tokenizer into it), and the working
directory and PYTHONPATH set to it, as a user's checkout would be. Each command runs in a subprocess with the
page's own words, shrunk as follows (the same for every command, so that the sequence means what it did):

- `RUN_TINY` is appended to every training recipe (pretrain.py / finetune.py, directly, behind a launcher or
  `scripts/supervise.py`, or through a script that passes "$@" on to one): a short sequence; `SMALL_MODEL` too where
  the preset is not a tiny one. The number of
  processes is kept as written (gloo on CPU). Steps are kept as written: the pages' numbers (20 to 200 steps) run in
  seconds at this size, so no `train.max_steps` is appended, except to the quickstart (`QUICKSTART_STEPS`).
- `.venv/` stands for the installed environment that scripts/env.sh would otherwise create (this interpreter).
- `work/pd1998/` is prepared before the first command as `scripts/prepare_default_corpus.sh` leaves it, from the
  corpus's first 80 articles and a 2500-piece tokenizer (`PD1998_VOCAB=2500`) instead of all 1.9M words and
  16000 pieces; `corpus/` (data.md's "your files") holds the same 80 articles as one jsonl file.
- `ARGUMENTS` replaces a few arguments that would not fit the shrunk corpus (a 32000-piece tokenizer).
- Absolute `/tmp/...` paths move under the fresh directory; a command ending in `&` runs in the background until the
  page ends.
- `PREREQUISITES`: a block that builds on another page's result (work/runs/quickstart) gets it from that command,
  run once per process (shrunk the same way) in a directory of its own whose `work/` is copied in.

One unit is a ```bash block (`units`, `run_page(page, only=LINE)`); `python tests/docs_run.py PAGE` runs all of a
page's blocks in order in one directory. A command this machine cannot run is classified by a rule in `not_here` with its reason (no GPU, no Docker daemon,
placeholders for the user's files, ...); a command that is neither runnable nor classified fails the page.
What the page says each command does is checked in `expectations`: exit status 0, or non-zero with no traceback for
a command marked `# expect: refused`; the files it makes (run directories with checkpoints and metrics, exports,
tokenizers, prefixes); and the first line of an output block the page quotes right after the command.
"""
from __future__ import annotations

import atexit
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from docs_commands import REPO, Command, commands_of_text, doc_files

RUN_TINY = ["data.seq_len=32", "data.num_workers=0", "train.progress_bar=false", "train.visualdl=false"]
"""Appended to every training recipe a page runs (after the command's own words, so data.seq_len=32 holds for a
whole sequence of commands: a resume sees the sequence its checkpoint was trained on)."""

SMALL_MODEL = ["model.hidden_size=64", "model.num_layers=4", "model.num_heads=8", "model.ffn_hidden_size=128",
               "model.vocab_size=null"]
"""Also appended where the preset is not a `*-tiny` one (qwen3-0.6b), each unless the command sets that key: the
size of the tiny presets, whose own sizes are kept (a command's model.num_layers=8 and pp_layers fit them), and the
tokenizer's vocabulary (Qwen3's 151936 rows made its 20 steps take 200 s)."""

LINKED = ["conf", "llmtrain", "scripts", "docker", "deploy", "pyproject.toml", "README.md"]
COPIED = ["tokenizers"]
RECIPE_SCRIPTS = ("llmtrain/pretrain.py", "llmtrain/finetune.py")
FORWARDING_SCRIPTS = ("scripts/quickstart.sh", "scripts/finetune_demo.sh")  # pass "$@" on to a recipe
TIMEOUT = 600

ARGUMENTS = {("docs/data.md", "--vocab-size", "32000"): "2500"}
"""(page, option, value as written) -> the value run here: the stand-in corpus has 80 articles."""

PREREQUISITES = {"work/runs/quickstart": "bash scripts/quickstart.sh",
                 "scripts/finetune_demo.sh": "bash scripts/quickstart.sh"}
"""A path (or script) a block names -> the command that makes what it builds on, run first (shrunk the same way)
unless the block runs that command itself: the quickstart's run (finetune_demo.sh would start an unshrunk one)."""

PROMISES = {
    ("docs/changing-runs.md", "checkpoint.resume=work/runs/wsd/checkpoints/step_16"): [
        "work/runs/wsd/superseded/1/checkpoints/step_20", "work/runs/wsd/superseded/1/metrics.jsonl",
        "work/runs/wsd/checkpoints/step_40"],
    ("docs/checkpoints.md", "run.dir=work/runs/relayout-tp2"): [
        "work/runs/relayout/checkpoints/step_100", "work/runs/relayout-tp2/checkpoints/step_100",
        "work/runs/relayout-tp2/metrics.jsonl"],
    ("docs/checkpoints.md", "model.init_from=work/runs/quickstart/checkpoints/step_200"): [
        "outputs/gpt-tiny-step20-tp2/checkpoints", "says:run directory outputs/gpt-tiny-step20-tp2:"],  # step200
}
"""(page, a word of the command) -> what the page's prose says the command leaves: paths under the fresh directory,
or `says:TEXT` for a line of its output."""

RUNNABLE = {"python", "python3", "bash", "etcd", "cp"}
"""Programs a page's command may run here; any other must be classified by `not_here`."""


def program(argv: list) -> str:
    """The program a command runs (past VAR=value assignments)."""
    words = [a for a in argv if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", a)]
    return words[0] if words else ""


USER_FILES = {"PADDLENLP_DIR", "TOKENIZER_DIR", "RUN", "chat.jsonl", "DeepSeek-V2-Lite/", "ERNIE-4.5-0.3B-PT/"}
"""Placeholders for the user's own files, or weights downloaded from a model hub: none of them exists here."""


QUICKSTART_STEPS = {"train.max_steps=200": "train.max_steps=20", "step_100": "step_10", "step_200": "step_20",
                    "step200": "step20"}
"""The quickstart's 200 steps (checkpoints at 100 and 200) take minutes on 2 loaded cores: it runs 20 steps with
a checkpoint every 10, and a command naming its checkpoints (or continuing it to step 200) is scaled the same."""


def not_here(cmd: Command, argv: list) -> str | None:
    """The reason this machine cannot run the command, or None when it can."""
    prog, args = argv[0], argv[1:]
    words = {w for a in args for w in re.split(r"[=\[\],]", a) if w}
    if prog == "docker":
        return "no Docker daemon here"
    if prog == "kubectl":
        return "no Kubernetes cluster here"
    if prog in ("python", "python3") and (args[:2] == ["-m", "pip"] or args[:1] == ["scripts/install_deps.py"]):
        return "installs packages (paddlepaddle-gpu from Paddle's own index, the project): it would change the " \
               "environment the suite runs in"
    if prog == "bash" and args[:1] == ["scripts/test.sh"]:
        return "the test suite itself (14 minutes; it would run this test again)"
    if prog == "bash" and args[:1] == ["scripts/gpu_acceptance.sh"] and "--dry-run" not in args:
        return "needs GPUs (one node of 8); its --dry-run runs here"
    if prog == "bash" and args[:1] == ["scripts/launch_multinode.sh"]:
        master = args[args.index("--master") + 1] if "--master" in args else ""
        if not master.startswith("127.0.0.1"):
            return f"a node of a multi-node job whose master {master} is another host"
    if words & USER_FILES:
        return f"{sorted(words & USER_FILES)}: placeholders for the user's own files or downloaded weights"
    if args[:3] == ["-m", "llmtrain.plan", "--calibrate"]:
        return "measures this machine's kernels for minutes (8.5 min on 2 cores)"
    world = _world(args)
    if world > 4:
        return f"{world} processes (written for {world} GPUs): more than this 2-core machine runs in a test"
    return None


def _world(args: list) -> int:
    world = 1
    for i, a in enumerate(args):
        for opt in ("--nproc_per_node", "--nnodes"):
            if a == opt and i + 1 < len(args):
                world *= int(args[i + 1].split(":")[0])
            elif a.startswith(opt + "="):
                world *= int(a.split("=", 1)[1].split(":")[0])
    return world


def shrunk(page: str, argv: list, root: str) -> list:
    """The command as run here (module docstring): RUN_TINY appended to training recipes, ARGUMENTS replaced,
    absolute /tmp paths moved into `root`."""
    out = []
    for i, a in enumerate(argv):
        if i and (page, argv[i - 1], a) in ARGUMENTS:
            a = ARGUMENTS[(page, argv[i - 1], a)]
        out.append(re.sub(r"^/tmp/", root + "/tmp/", a))
    if out[:2] == ["bash", "scripts/quickstart.sh"]:
        out += ["train.max_steps=20", "checkpoint.interval=10"]
    elif any("work/runs/quickstart" in a for a in out):
        for big, small in QUICKSTART_STEPS.items():
            out = [a.replace(big, small) for a in out]
    if any(a in RECIPE_SCRIPTS or a in FORWARDING_SCRIPTS for a in out):
        preset = [a.split("=", 1)[1] for a in out if a.startswith("model=")]
        if preset and not preset[-1].endswith("-tiny"):
            given = {a.split("=", 1)[0] for a in out}
            out += [a for a in SMALL_MODEL if a.split("=", 1)[0] not in given]
        # fine-tuning keeps its own sequence (at 32 positions most answers start beyond it) and has no data workers
        finetune = "llmtrain/finetune.py" in out or "scripts/finetune_demo.sh" in out
        out += [a for a in RUN_TINY if not (finetune and a.startswith(("data.num_workers=", "data.seq_len=")))]
    return out


_SEED: list = []


def _seed_dir() -> str:
    """`work/pd1998` (80 articles, 2500 pieces, by scripts/prepare_default_corpus.sh) and `corpus/`, made once."""
    if _SEED:
        return _SEED[0]
    from llmtrain.corpus import peoples_daily as pd

    root = tempfile.mkdtemp(prefix="docs_run_seed_")
    atexit.register(shutil.rmtree, root, True)
    work = os.path.join(root, "work", "pd1998")
    os.makedirs(work)
    os.makedirs(os.path.join(root, "corpus"))
    src = pd.source_path()
    counts = dict(documents=0, paragraphs=0, words=0, characters=0)
    with open(os.path.join(work, "pd1998.jsonl"), "w", encoding="utf-8") as f:
        for r in pd.records(limit=80):
            counts["documents"] += 1
            counts["paragraphs"] += r["words"].count("\n") + 1
            counts["words"] += len(r["words"])
            counts["characters"] += len(r["text"])
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    meta = {"format_version": pd.FORMAT_VERSION, "source": str(src), "source_sha256": pd.sha256_file(src), **counts,
            "output": os.path.join(work, "pd1998.jsonl")}
    with open(os.path.join(work, "pd1998.meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)
    shutil.copy(os.path.join(work, "pd1998.jsonl"), os.path.join(root, "corpus", "pd1998-80.jsonl"))
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "prepare_default_corpus.sh"), work],
                       env=dict(_env(REPO), PD1998_VOCAB="2500"), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"preparing the shrunk work/pd1998 failed:\n{r.stdout}\n{r.stderr}"
    _SEED.append(root)
    return root


_MADE: dict = {}


def _made_by(maker: str) -> str:
    """A fresh directory in which the prerequisite command `maker` ran (shrunk), made once per process."""
    if maker not in _MADE:
        root = fresh_dir()
        (cmd,) = commands_of_text(f"```bash\n{maker}\n```", os.path.join(REPO, "README.md"))
        r = subprocess.run(shrunk("", cmd.argv, root), cwd=root, env=_env(root), capture_output=True, text=True,
                           timeout=TIMEOUT)
        problems = expectations(cmd, shrunk("", cmd.argv, root), root, r.stdout + r.stderr, r.returncode)
        assert not problems, f"the prerequisite {maker}: {problems}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        _MADE[maker] = root
        atexit.register(shutil.rmtree, root, True)
    return _MADE[maker]


def _env(root: str) -> dict:
    env = dict(os.environ, PYTHONPATH=root, PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("LLMTRAIN_SAMPLE_SEED", None)
    return env


def fresh_dir() -> str:
    """A fresh directory laid out as a checkout (module docstring), with the shrunk work/pd1998 and corpus/."""
    root = tempfile.mkdtemp(prefix="docs_run_")
    for name in LINKED:
        os.symlink(os.path.join(REPO, name), os.path.join(root, name))
    for name in COPIED:
        shutil.copytree(os.path.join(REPO, name), os.path.join(root, name))
    shutil.copytree(_seed_dir(), root, dirs_exist_ok=True, symlinks=True)
    venv = os.path.join(root, ".venv")  # what scripts/env.sh finds installed: this interpreter, no new install
    os.makedirs(os.path.join(venv, "bin"))
    os.symlink(sys.executable, os.path.join(venv, "bin", "python"))
    with open(os.path.join(venv, "bin", "activate"), "w") as f:
        f.write(f'export PATH="{os.path.dirname(sys.executable)}:$PATH"\n')
    open(os.path.join(venv, ".llmtrain-installed"), "w").close()
    return root


@dataclasses.dataclass
class Result:
    where: str
    status: str  # "ok", "not here: REASON", "FAILED: WHY"
    seconds: float = 0.0
    output: str = ""


def quoted_outputs(path: str) -> dict:
    """{line of the last command of a ```bash block: first line of the output block the page quotes right after}."""
    lines = open(path, encoding="utf-8").read().split("\n")
    out, fence, bash_end, last_cmd = {}, None, None, None
    for n, raw in enumerate(lines, 1):
        s = raw.strip()
        if not s.startswith("```"):
            if fence == "bash" and s and not s.startswith("#") and not lines[n - 2].rstrip().endswith("\\"):
                last_cmd = n
            continue
        if fence is None:
            fence = s[3:].strip()
            fence = "bash" if fence in ("bash", "sh", "shell") else fence
            if fence not in ("bash",) and bash_end and not any(x.strip() for x in lines[bash_end:n - 1]):
                out[last_cmd] = lines[n].strip()
        else:
            bash_end = n if fence == "bash" else None
            fence = None
    return out


def _start_line(lines: list, end: int) -> int:
    """The first line of the (continued) command that ends on line `end`."""
    while end > 1 and lines[end - 2].rstrip().endswith("\\"):
        end -= 1
    return end


def expectations(cmd: Command, argv: list, root: str, output: str, rc: int) -> list[str]:
    """What the command failed to do of what its page says (empty: it did it all)."""
    if cmd.refused:
        if rc == 0:
            return [f"exit 0, but the page says it is refused"]
        return ["refused with a traceback"] if "Traceback (most recent call last)" in output else []
    if rc != 0:
        return [f"exit {rc}"]
    problems = []

    def need(path, what="it"):
        full = os.path.join(root, path)
        if not os.path.exists(full) or (os.path.isdir(full) and not os.listdir(full)):
            problems.append(f"{path}: absent or empty ({what} should have made it)")

    def opt(name):
        return argv[argv.index(name) + 1] if name in argv else None

    if any(a in RECIPE_SCRIPTS for a in argv):
        made = re.findall(r"run directory (.+?): metrics\.jsonl, (\S+), checkpoints/", output)
        if not made:
            problems.append("no 'run directory DIR: metrics.jsonl, loss_curve.png, checkpoints/' line")
        for run_dir, png in made[-1:]:
            given = [a.split("=", 1)[1].strip("'\"") for a in argv if a.startswith("run.dir=")]
            if given and given[-1] != run_dir:
                problems.append(f"ran in {run_dir}, the page gives run.dir={given[-1]}")
            for f in ("metrics.jsonl", png, "checkpoints", "config.yaml"):
                need(os.path.join(run_dir, f), "the run")
            steps = [int(a.split("=", 1)[1]) for a in argv if a.startswith("train.max_steps=")]
            if steps:
                need(os.path.join(run_dir, "checkpoints", f"step_{steps[-1]}"), f"train.max_steps={steps[-1]}")
    mod = argv[2] if argv[:2] == ["python", "-m"] else None
    if mod == "llmtrain.export":
        need(opt("--output"), "the export")
    elif mod == "llmtrain.tokenizer.train":
        need(os.path.join(opt("--output"), "tokenizer.model"), "the tokenizer")
    elif mod == "llmtrain.data.preprocess":
        for ext in (".bin", ".idx"):
            need(opt("--output-prefix") + ext, "preprocessing")
    elif mod in ("llmtrain.data.lexicon",):
        need(opt("--output"), "the lexicon")
    elif mod == "llmtrain.corpus.qa_pairs":
        for f in ("train.jsonl", "valid.jsonl"):
            need(os.path.join(opt("--output"), f), "qa_pairs")
    elif mod == "llmtrain.generate" and not output.strip():
        problems.append("generated nothing")
    for (where, word), promised in PROMISES.items():
        if cmd.source.endswith(where) and word in cmd.argv:
            for p in promised:
                if p.startswith("says:"):
                    if p[5:] not in output:
                        problems.append(f"the page says the output has {p[5:]!r}")
                else:
                    need(p, "the page says it")
    if argv[:2] == ["bash", "scripts/quickstart.sh"]:
        need("work/runs/quickstart/checkpoints/step_20", "the quickstart (20 steps here: QUICKSTART_STEPS)")
        need("work/runs/quickstart/loss_curve.png", "the quickstart")
    if argv[:2] == ["bash", "scripts/finetune_demo.sh"]:
        for d in ("work/runs/lora-demo/checkpoints", "work/pnlp/lora-demo-adapters", "work/pnlp/lora-demo-merged"):
            need(d, "the fine-tuning demo")
    if argv[:2] == ["bash", "scripts/prepare_default_corpus.sh"]:
        need("work/pd1998/pd1998_text_document.idx", "the corpus preparation")
    return problems


def blocks(page: str) -> list[tuple[int, list[Command]]]:
    """(line of the opening fence, its commands) of each ```bash block of `page` that has a command."""
    path = os.path.join(REPO, page)
    text = open(path, encoding="utf-8").read()
    fences = [n for n, raw in enumerate(text.split("\n"), 1) if raw.strip().startswith("```")]
    out = []
    for start, end in zip(fences[::2], fences[1::2]):
        cmds = [c for c in commands_of_text(text, path) if start < c.line < end]
        if cmds:
            out.append((start, cmds))
    return out


def units() -> list[str]:
    """Every block of every page, as `page:line` (what one suite run draws)."""
    return [f"{page}:{start}" for page in pages() for start, _ in blocks(page)]


def run_page(page: str, log=print, only: int | None = None) -> list[Result]:
    """Run `page`'s commands (a path relative to the repository; `only`: the block opening on that line) in order
    in one fresh directory, after the PREREQUISITES the commands name; one Result per command."""
    path = os.path.join(REPO, page)
    text = open(path, encoding="utf-8").read()
    lines = text.split("\n")
    quoted = {_start_line(lines, end): first for end, first in quoted_outputs(path).items()}
    chosen = [(start, cmds) for start, cmds in blocks(page) if only in (None, start)]
    assert chosen, f"{page} has no block of commands opening on line {only}"
    commands = [c for _, cmds in chosen for c in cmds]
    named = text if only is None else "\n".join(lines[only:only + _block_len(lines, only)])
    makers = {maker for needle, maker in PREREQUISITES.items()
              if needle in named and maker not in {" ".join(c.argv) for c in commands}}
    root = fresh_dir()
    for maker in sorted(makers):
        shutil.copytree(os.path.join(_made_by(maker), "work"), os.path.join(root, "work"), dirs_exist_ok=True,
                        symlinks=True)
        log(f"-- {page}: {maker} (run once, shrunk; its work/ copied in)")
    env = _env(root)
    results, background = [], []
    try:
        for cmd in commands:
            argv = list(cmd.argv)
            where = f"{page}:{cmd.line}: {' '.join(argv)}"[:160]
            reason = not_here(cmd, argv)
            if reason:
                results.append(Result(where, f"not here: {reason}"))
                log(f"-- {where}\n   not here: {reason}")
                continue
            run = shrunk(page, argv, root)
            t0 = time.time()
            if cmd.line and _is_background(text, cmd):
                os.makedirs(os.path.join(root, "tmp"), exist_ok=True)
                background.append(subprocess.Popen(run, cwd=root, env=env, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL, start_new_session=True))
                time.sleep(2)
                problems = [] if background[-1].poll() is None else [f"exited {background[-1].returncode} at once"]
                output = ""
            else:
                try:
                    r = subprocess.run(run, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT)
                    output, rc = r.stdout + r.stderr, r.returncode
                except subprocess.TimeoutExpired as e:
                    output, rc = f"{e.stdout or ''}{e.stderr or ''}", "timeout"
                problems = expectations(cmd, run, root, output, rc) if rc != "timeout" else [f"ran {TIMEOUT} s"]
                first = quoted.get(cmd.line)
                if first and " ".join(first.split()) not in " ".join(output.split()):
                    problems.append(f"the page quotes {first!r}, not in the output")
            seconds = time.time() - t0
            if problems:  # a launcher's own output ends with its log settings: add its rank 0's last words
                logs = sorted(glob.glob(os.path.join(root, "**", "workerlog.0"), recursive=True), key=os.path.getmtime)
                if logs and os.path.getmtime(logs[-1]) >= t0:
                    output += f"\n[{os.path.relpath(logs[-1], root)}]\n" + "\n".join(
                        open(logs[-1], errors="replace").read().strip().split("\n")[-15:])
            status = "ok" if not problems else "FAILED: " + "; ".join(problems)
            results.append(Result(where, status, seconds, output))
            log(f"-- {where}\n   {status} ({seconds:.1f} s)")
            if problems:
                log("   " + "\n   ".join(output.strip().split("\n")[-25:]))
            sys.stdout.flush()
    finally:
        for p in background:
            p.terminate()
            p.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
    return results


def _block_len(lines: list, start: int) -> int:
    """Lines of the ```bash block opening on line `start`, fences excluded."""
    n = start
    while not lines[n].strip().startswith("```"):
        n += 1
    return n - start


def _is_background(text: str, cmd: Command) -> bool:
    """Does the command's line end in `&` (before a comment)?"""
    lines = text.split("\n")
    end = cmd.line
    while lines[end - 1].rstrip().endswith("\\"):
        end += 1
    return bool(re.search(r"[^&]&\s*(#.*)?$", lines[end - 1]))


def pages() -> list[str]:
    """Every page with a command, as a path relative to the repository."""
    out = []
    for path in doc_files():
        with open(path, encoding="utf-8") as f:
            if commands_of_text(f.read(), path):
                out.append(os.path.relpath(path, REPO))
    return out


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    todo = pages() if sys.argv[1:] == ["--all"] else sys.argv[1:]
    failed = 0
    for unit in todo:  # docs/x.md (the whole page) or docs/x.md:LINE (the block opening there)
        page, _, line = unit.partition(":")
        t0 = time.time()
        res = run_page(page, only=int(line) if line else None)
        bad = [r for r in res if r.status.startswith("FAILED")]
        failed += len(bad)
        print(f"== {unit}: {len(res)} commands, {len(bad)} failed, "
              f"{sum(r.status.startswith('not here') for r in res)} not here, {time.time() - t0:.0f} s", flush=True)
    sys.exit(1 if failed else 0)

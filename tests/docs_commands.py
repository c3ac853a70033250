"""Every command in README.md and docs/*.md, checked without training (used by tests/test_docs.py).

    python tests/docs_commands.py            # check them all, print one line per command

A command is a line (with its `\\` continuations) of a ```bash block, split at `&&`, `;`, `|` and `&`. What "real"
means depends on the command:

- `python llmtrain/<recipe>.py OVERRIDES`, also behind `python -m paddle.distributed.launch`, `python -m
  llmtrain.launch`, `bash scripts/launch_multinode.sh` and `python scripts/supervise.py ... --`: Hydra composes the
  recipe's root config with exactly those overrides, and `llmtrain.resolve.resolve` accepts it for the
  launcher's world size (nproc_per_node x nnodes), after `+parallel=auto` is chosen as the recipe chooses it (an
  unknown key or preset is refused first, as the recipe refuses it before Hydra composes). A
  command whose line ends in `# expect: refused` must be refused instead. Paths that exist only after other
  commands ran (a tokenizer under work/, a PaddleNLP directory, placeholders such as TOKENIZER_DIR) are stood in
  for: a missing `data.tokenizer` by the shipped `tokenizers/pd1998-bpe16k`, a missing `model.init_from` or
  `finetune.lora.init_from` by none (the preset's architecture), missing data prefixes, lexicon and fine-tuning
  files by tiny stand-ins; `run.dir` is always a fresh directory and `checkpoint.resume=PATH` none (what this
  checkout's earlier runs left must not decide).
- `python -m llmtrain.plan OVERRIDES`: composed; the device profile's name, and a given layout's degrees against
  `plan.devices`, checked as the planner checks them (the search itself is not run).
- `python -m llmtrain.<module> ARGS` and `python scripts/<x>.py ARGS`: the module or file exists and, when it has an
  argparse command line, its parser accepts ARGS (the parser runs; the command does not).
- `bash scripts/<x>.sh ARGS`: the script exists; when it passes "$@" on to a command above, that command is
  checked with ARGS in place of "$@".
- A few outside programs (docker, kubectl, etcd, pip, mkdocs, cp) are taken as they are; any other program fails.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import importlib
import importlib.util
import inspect
import os
import re
import shlex
import sys
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAND_IN_TOKENIZER = "tokenizers/pd1998-bpe16k"
RECIPES = {"llmtrain/pretrain.py": "config", "llmtrain/finetune.py": "finetune"}
OUTSIDE = {"docker", "kubectl", "etcd", "pip", "mkdocs", "cp"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
REFUSED = "# expect: refused"


@dataclass
class Command:
    """One command of a document: where it is, its words, and whether the document says it is refused."""

    source: str
    line: int
    argv: list
    refused: bool = False
    notes: list = field(default_factory=list)
    recipes: list = field(default_factory=list)
    """(script, overrides, world size, run.dir, run.overwrite) of each recipe the command runs (set by `check`)."""

    def where(self) -> str:
        return f"{os.path.relpath(self.source, REPO)}:{self.line}: {shlex.join(self.argv)}"


def doc_files() -> list[str]:
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def commands_of_text(text: str, source: str) -> list[Command]:
    """The commands of every ```bash (or sh, shell) block of a Markdown text."""
    out, lang, buf, start = [], None, "", 0
    for n, raw in enumerate(text.split("\n"), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            lang = stripped[3:].strip() if lang is None else None
            continue
        if lang not in ("bash", "sh", "shell"):
            continue
        if not buf:
            start = n
        buf += (" " if buf else "") + stripped
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        out += split_commands(buf, source, start)
        buf = ""
    return out


def split_commands(line: str, source: str, lineno: int) -> list[Command]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    words, cmds = list(lex), [[]]
    for w in words:
        if w in SEPARATORS:
            cmds.append([])
        else:
            cmds[-1].append(w)
    refused = line.rstrip().endswith(REFUSED)
    return [Command(source, lineno, c, refused) for c in cmds if c]


def script_commands(path: str) -> list[Command]:
    """The commands of a bash script (its lines read as one ```bash block)."""
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f.read().split("\n") if not ln.lstrip().startswith("#")]
    return commands_of_text("```bash\n" + "\n".join(lines) + "\n```", path)


# ---------------------------------------------------------------------------------------------------------------
def check(cmd: Command) -> None:
    """Raise AssertionError (with the document's file:line) when the command is not real; return when it is."""
    argv = list(cmd.argv)
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):  # VAR=value before the program
        argv.pop(0)
    if argv and argv[0] == "exec":
        argv.pop(0)
    assert argv, f"{cmd.where()}: empty command"
    prog, args = argv[0], argv[1:]
    if prog in ("python", "python3"):
        _check_python(cmd, args)
    elif prog in ("bash", "sh"):
        _check_bash_script(cmd, args)
    elif prog in OUTSIDE:
        cmd.notes.append("outside program")
    else:
        raise AssertionError(f"{cmd.where()}: unknown program {prog!r} (not python, bash or one of {sorted(OUTSIDE)})")


def _check_python(cmd: Command, args: list) -> None:
    if args[:2] == ["-m", "pip"]:
        cmd.notes.append("pip")
        return
    if args[:2] in (["-m", "paddle.distributed.launch"], ["-m", "llmtrain.launch"]):
        return _check_launcher(cmd, args[2:], {"--nproc_per_node": 1, "--nnodes": 1})
    if args[:1] == ["-m"]:
        assert len(args) > 1, f"{cmd.where()}: python -m without a module"
        module = args[1]
        if module == "llmtrain.plan":
            return _check_plan(cmd, args[2:])
        assert module.startswith("llmtrain."), f"{cmd.where()}: python -m {module}: not one of llmtrain's modules"
        assert importlib.util.find_spec(module) is not None, f"{cmd.where()}: no module {module}"
        return _check_argparse(cmd, importlib.import_module(module), args[2:])
    assert args, f"{cmd.where()}: python without a script"
    script = args[0]
    assert os.path.isfile(os.path.join(REPO, script)), f"{cmd.where()}: {script} does not exist"
    if script in RECIPES:
        return _check_recipe(cmd, script, args[1:], world=1)
    if script == "scripts/supervise.py":
        assert "--" in args, f"{cmd.where()}: supervise.py needs `-- COMMAND`"
        cut = args.index("--")
        _check_argparse(cmd, _load_file(script), args[1:cut] + ["--", "true"])
        return check(Command(cmd.source, cmd.line, args[cut + 1:], cmd.refused, cmd.notes))
    return _check_argparse(cmd, _load_file(script), args[1:])


def _check_launcher(cmd: Command, args: list, sizes: dict) -> None:
    """Launcher options up to the recipe, then the recipe with the world size the options give."""
    i = 0
    while i < len(args) and not args[i].endswith(".py"):
        opt = args[i].split("=", 1)[0].replace("-", "_").lstrip("_")
        value = args[i].split("=", 1)[1] if "=" in args[i] else (args[i + 1] if i + 1 < len(args) else "")
        for name in sizes:
            if opt == name.replace("-", "_").lstrip("_"):
                sizes[name] = int(value.split(":")[0])
        i += 1 if "=" in args[i] or not args[i].startswith("-") else 2
    assert i < len(args), f"{cmd.where()}: the launcher is given no script"
    script = args[i]
    assert script in RECIPES, f"{cmd.where()}: {script} is not one of the recipes {sorted(RECIPES)}"
    world = 1
    for v in sizes.values():
        world *= v
    _check_recipe(cmd, script, args[i + 1:], world)


@contextlib.contextmanager
def hydra_session():
    """One Hydra initialisation of `conf/` for many compositions (each `compose_config` would initialise anew)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from llmtrain.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=os.path.join(REPO, "conf")):
        yield
    GlobalHydra.instance().clear()


def _compose(overrides: list, config_name: str):
    """The recipe's root config composed with exactly these overrides, as a typed `Config`."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra

    from llmtrain.config import compose_config, to_config

    if GlobalHydra.instance().is_initialized():
        return to_config(compose(config_name=config_name, overrides=list(overrides)))
    return to_config(compose_config(overrides, config_name=config_name))


_STAND_IN_DIR: list = []


def _stand_in_dir() -> str:
    """A temporary directory of stand-in inputs (made once per process): a tiny MMIDIDX prefix with word
    boundaries and no tokenizer record (`data`), a lexicon (`entities.txt`) and a fine-tuning file (`sft.jsonl`)."""
    if not _STAND_IN_DIR:
        import atexit
        import shutil
        import tempfile

        import numpy as np

        from llmtrain.data.indexed import IndexedWriter

        root = tempfile.mkdtemp(prefix="docs_stand_in_")
        atexit.register(shutil.rmtree, root, True)
        builder = IndexedWriter(os.path.join(root, "data"), np.uint16, side=("wbd",))
        tokens = np.arange(5, 5 + 4096) % 2000 + 5
        builder.add_documents(tokens, np.array([1024] * 4), {"wbd": np.ones(len(tokens), np.uint8)})
        builder.finalize()
        with open(os.path.join(root, "entities.txt"), "w", encoding="utf-8") as f:
            f.write("人民日报\n")
        with open(os.path.join(root, "sft.jsonl"), "w", encoding="utf-8") as f:
            f.write('{"prompt": "你好", "response": "你好"}\n')
        _STAND_IN_DIR.append(root)
    return _STAND_IN_DIR[0]


def _exists(path) -> bool:
    return os.path.exists(path) or os.path.exists(os.path.join(REPO, path)) or os.path.exists(path + ".idx") \
        or os.path.exists(os.path.join(REPO, path) + ".idx")


def _data_stand_ins(cmd: Command, data, tokenizer_stood_in: bool):
    """Data files made by earlier commands (prefixes, a lexicon, fine-tuning records) replaced by stand-ins; a
    stood-in tokenizer takes stand-in prefixes too (the real ones were made with the real tokenizer)."""
    if hasattr(data, "files"):
        for key in ("files", "valid_files"):
            given = list(getattr(data, key) or [])
            if any(not _exists(p) for p in given):
                cmd.notes.append(f"data.{key}={given} absent here: a stand-in record file")
                data = dataclasses.replace(data, **{key: [os.path.join(_stand_in_dir(), "sft.jsonl")] * len(given)})
        return data
    if tokenizer_stood_in or any(not _exists(p) for p in data.prefixes):
        cmd.notes.append(f"data.prefixes={list(data.prefixes)} absent here (or of another tokenizer): stand-ins")
        data = dataclasses.replace(data, prefixes=[os.path.join(_stand_in_dir(), "data")] * len(data.prefixes))
    lexicon = data.masking.lexicon
    if lexicon and not _exists(lexicon):
        cmd.notes.append(f"data.masking.lexicon={lexicon} absent here: a stand-in lexicon")
        data = dataclasses.replace(data, masking=dataclasses.replace(
            data.masking, lexicon=os.path.join(_stand_in_dir(), "entities.txt")))
    return data


def _stand_ins(cmd: Command, cfg):
    """Paths made by earlier commands (or placeholders) replaced so that validation can run here; the run
    directory is always a fresh one and `checkpoint.resume=PATH` is `none` (what this checkout's earlier runs left
    there must not decide whether a document's command is right)."""
    data, model, ft = cfg.data, cfg.model, getattr(cfg, "finetune", None)
    stood_in = not os.path.exists(os.path.join(REPO, data.tokenizer)) and not os.path.exists(data.tokenizer)
    if stood_in:
        cmd.notes.append(f"data.tokenizer={data.tokenizer} absent here: {STAND_IN_TOKENIZER}")
        data = dataclasses.replace(data, tokenizer=os.path.join(REPO, STAND_IN_TOKENIZER))
    data = _data_stand_ins(cmd, data, stood_in)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=os.path.join(_stand_in_dir(), "run")))
    if cfg.checkpoint.resume not in ("auto", "none"):
        cmd.notes.append(f"checkpoint.resume={cfg.checkpoint.resume}: none (the documents' runs are not made here)")
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="none"))
    if model.init_from and not os.path.exists(model.init_from):
        cmd.notes.append(f"model.init_from={model.init_from} absent here: the preset")
        model = dataclasses.replace(model, init_from=None)
    if ft is not None and ft.lora.init_from and not os.path.exists(ft.lora.init_from):
        cmd.notes.append(f"finetune.lora.init_from={ft.lora.init_from} absent here: none")
        ft = dataclasses.replace(ft, lora=dataclasses.replace(ft.lora, init_from=None))
    cfg = dataclasses.replace(cfg, data=data, model=model)
    return dataclasses.replace(cfg, finetune=ft) if ft is not None else cfg


_RESOLVED: dict = {}  # (script, overrides, world) -> (notes, ConfigError or None): a command repeated in two pages


def _check_recipe(cmd: Command, script: str, overrides: list, world: int) -> None:
    key = (script, tuple(overrides), world)
    if key not in _RESOLVED:
        _RESOLVED[key] = _resolve(script, overrides, world)
    notes, error, run_dir, overwrite = _RESOLVED[key]
    cmd.notes += notes
    cmd.recipes.append((script, tuple(overrides), world, run_dir, overwrite))
    if error is not None:
        if cmd.refused:
            cmd.notes.append("refused, as the document says")
            return
        raise AssertionError(f"{cmd.where()}: refused on {world} process(es):\n{error}")
    assert not cmd.refused, f"{cmd.where()}: marked `{REFUSED}` but accepted on {world} process(es)"


def _resolve(script: str, overrides: list, world: int):
    from llmtrain.config import ConfigError, command_line_problems
    from llmtrain.plan.auto import choose_layout
    from llmtrain.resolve import resolve

    probe = Command("", 0, [])
    unknown = command_line_problems(overrides, RECIPES[script])  # what the recipe refuses before Hydra composes
    if unknown:
        return probe.notes, ConfigError(unknown), None, False
    composed = None
    try:
        composed = _compose(overrides, RECIPES[script])  # an unknown `+key` is refused here
        cfg = _stand_ins(probe, composed)
        resolve(choose_layout(cfg, world_size=world, log=lambda _: None), world_size=world)
    except ConfigError as e:
        return probe.notes, e, composed and composed.run.dir, bool(composed and composed.run.overwrite)
    return probe.notes, None, composed.run.dir, composed.run.overwrite


def _check_plan(cmd: Command, args: list) -> None:
    from llmtrain.parallel.layout import layout_problems, model_fit_problems
    from llmtrain.plan.profile import names as profile_names

    if "--calibrate" in args:
        rest = [a for a in args if a != "--calibrate"]
        assert rest == [] or (len(rest) == 2 and rest[0] == "--out"), \
            f"{cmd.where()}: --calibrate takes only --out PATH"
        return
    cfg = _compose(args, "config")
    problems = []
    if cfg.plan.device not in profile_names():
        problems.append(f"plan.device={cfg.plan.device!r}: expected one of {sorted(profile_names())}")
    if cfg.plan.format not in ("table", "json"):
        problems.append(f"plan.format={cfg.plan.format}: expected table or json")
    if cfg.parallel is not None:
        _, issues = layout_problems(cfg.parallel, cfg.train, cfg.plan.devices)
        problems += issues
        if cfg.model.vocab_size is not None:
            problems += model_fit_problems(cfg.parallel, cfg.model)
    assert not problems, f"{cmd.where()}: the planner would refuse it:\n" + "\n".join(problems)


class _Parsed(Exception):
    pass


def _check_argparse(cmd: Command, module, args: list) -> None:
    """The module's own parser on `args`: parsed, then stopped before the command does any work."""
    main = getattr(module, "main", None)
    if main is None or "ArgumentParser(" not in inspect.getsource(module):
        cmd.notes.append("exists (no argparse command line)")
        return
    original = argparse.ArgumentParser.parse_known_args

    def parse_then_stop(self, a=None, namespace=None):
        result = original(self, a, namespace)
        raise _Parsed(result)

    saved_argv = sys.argv
    argparse.ArgumentParser.parse_known_args = parse_then_stop
    sys.argv = [module.__name__] + list(args)
    try:
        if inspect.signature(main).parameters:
            main(list(args))
        else:
            main()
    except _Parsed:
        cmd.notes.append("arguments parsed")
        return
    except SystemExit as e:
        raise AssertionError(f"{cmd.where()}: its argument parser refuses the arguments (exit {e.code})") from None
    finally:
        argparse.ArgumentParser.parse_known_args = original
        sys.argv = saved_argv
    raise AssertionError(f"{cmd.where()}: main() returned without parsing arguments")


def _load_file(path: str):
    name = "docs_cmd_" + re.sub(r"\W", "_", path)
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_bash_script(cmd: Command, args: list) -> None:
    assert args, f"{cmd.where()}: bash without a script"
    script, rest = args[0], args[1:]
    assert script.startswith("scripts/") and os.path.isfile(os.path.join(REPO, script)), \
        f"{cmd.where()}: {script} does not exist"
    if script == "scripts/launch_multinode.sh":
        return _check_launcher(cmd, rest, {"--nproc-per-node": 1, "--nnodes": 1})
    forwarded = [c for c in script_commands(os.path.join(REPO, script)) if "$@" in c.argv]
    if not rest:
        cmd.notes.append("script exists")
        return
    assert forwarded, f"{cmd.where()}: {script} takes no arguments (it passes no \"$@\" on)"
    for inner in forwarded:
        k = inner.argv.index("$@")
        check(Command(cmd.source, cmd.line, inner.argv[:k] + rest + inner.argv[k + 1:], cmd.refused, cmd.notes))


def run_dir_problems(commands: list[Command]) -> list[str]:
    """The pages' training commands run in order in one fresh directory: a command landing in a run directory an
    earlier one made would continue that run (or be refused, or find nothing to train) instead of doing what its
    page says. Allowed: the same recipe and overrides again (a rerun continues its run, as the README says), a
    command with `run.overwrite=true` (it moves the old run aside and starts anew), and a continuation on the same
    page that names the same `run.dir=` explicitly as the command it continues. `check` must have run on each."""
    first: dict = {}  # run.dir -> (command, recipe)
    problems = []
    for cmd in commands:
        if cmd.refused:
            continue  # refused before any work: writes nothing
        for recipe in cmd.recipes:
            script, overrides, world, run_dir, overwrite = recipe
            if run_dir is None:
                continue
            if run_dir not in first:
                first[run_dir] = (cmd, recipe)
                continue
            earlier, their = first[run_dir]
            explicit = any(o.startswith("run.dir=") for o in overrides) and \
                any(o.startswith("run.dir=") for o in their[1])
            if recipe[:3] == their[:3] or overwrite or (explicit and earlier.source == cmd.source):
                continue
            problems.append(f"{cmd.where()}: runs in {run_dir}, the run directory of "
                            f"{os.path.relpath(earlier.source, REPO)}:{earlier.line}: it would continue that run "
                            "(or be refused by it) instead of starting its own; give it its own run.dir=")
    return problems


def all_commands() -> list[Command]:
    out = []
    for path in doc_files():
        with open(path, encoding="utf-8") as f:
            out += commands_of_text(f.read(), path)
    return out


def _report(c: Command) -> bool:
    try:
        check(c)
    except AssertionError as e:
        print(f"FAIL {e}")
        return False
    print(f"ok   {c.where()}  [{'; '.join(c.notes)}]")
    return True


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    failed = 0
    with hydra_session():
        commands = all_commands()
        for c in commands:
            failed += not _report(c)
    for problem in run_dir_problems(commands):
        print(f"FAIL {problem}")
        failed += 1
    sys.exit(1 if failed else 0)

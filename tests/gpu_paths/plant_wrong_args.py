"""Plant a wrong argument in every GPU-only call, one at a time, and require the branch's rehearsal to fail.

    python tests/gpu_paths/plant_wrong_args.py                       # every marked line (minutes: one pytest a plant)
    python tests/gpu_paths/plant_wrong_args.py --only flashmask,fused-rope
    python tests/gpu_paths/plant_wrong_args.py --list                # the plants, nothing run

For every `# GPU-ONLY(<id>)` line under llmtrain/ the statement that holds it is read with `ast`, and for each
call in it (nested ones too) these plants are made:
  `+planted_wrong_arg=1`   an argument the function does not take
  `drop <arg>`             its last argument left out
  `swap <a>, <b>`          its first two positional arguments exchanged
  `<arg> -> None`          each argument replaced by None (one plant each)
  `<arg> -> not <value>`   each True/False constant flipped
A marked statement without a call (an assignment or return of a constant) gets its constant flipped, or `None`
replaced by the value the other side of its `if` assigns. Each plant is written into a scratch copy of the
working tree (tracked and untracked files; the marker comment kept on the statement's first line) and
`python -m pytest tests/gpu_paths/test_<id>.py -x` runs there: exit 1 (a failed test) is "caught", exit 0
"SURVIVED" (or "equivalent" when `EQUIVALENT` says why the planted code computes the same), anything else "broken"
(the plant itself did not import: a bug of this script). Besides the argument
plants: every rehearsal module with all its tests skipped (a rehearsal that skips on CPU rehearses nothing), and
the named regressions of `REGRESSIONS` (packed fine-tuning's `auto` attention as it was before commit 93a94ac).
Each module first runs unplanted and must pass. Exit status 0 when every plant was caught, 1 otherwise.
"""
from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import io
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tokenize
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from gpu_rehearsal import markers, rehearsal_file  # noqa: E402

PLANTED_KEYWORD = "planted_wrong_arg"
MARKER_OF = "# GPU-ONLY({})".format
"""The marker comment of an id."""
SKIP_ALL = '\nimport pytest as _planted_pytest\npytestmark = _planted_pytest.mark.skip(reason="planted: all skipped")\n'


@dataclasses.dataclass
class Plant:
    """One change to one file of the scratch copy, and the rehearsal that must fail on it."""

    branch: str
    """The GPU-ONLY id whose rehearsal module runs."""
    where: str
    """file:line (relative to the repository) of the planted statement or function."""
    what: str
    """What was planted, for the report."""
    path: str
    """The file changed (relative to the repository)."""
    text: str
    """Its whole new text."""


REGRESSIONS = [
    ("flashmask", "llmtrain/models/layers.py", "auto_attention",
     "auto_attention as before commit 93a94ac (no `segments`: packed fine-tuning's TypeError on GPU)",
     '''def auto_attention(q, k, v, causal: bool = True, mask=None, *, window: int = 0):
    if q.dtype in (paddle.float16, paddle.bfloat16):
        return flash_attention_gpu(q, k, v, causal, mask, window=window)
    return math_attention(q, k, v, causal, mask, window=window)
'''),
    ("flashmask", "llmtrain/models/layers.py", "auto_attention",
     "auto_attention takes `segments` but does not hand them to the flash side (plain flash attention)",
     '''def auto_attention(q, k, v, causal: bool = True, mask=None, segments=None, *, window: int = 0):
    if q.dtype in (paddle.float16, paddle.bfloat16):
        return flash_attention_gpu(q, k, v, causal, mask, window=window)
    return math_attention(q, k, v, causal, mask, segments, window=window)
'''),
]
"""(id, file, function, what, the function's planted source): regressions the rehearsal of `id` must catch."""

EQUIVALENT = {
    ("amp-fp16", "loss_scaler: drop decr_every_n_nan_or_inf="):
        "paddle.amp.GradScaler's default decr_every_n_nan_or_inf is 1, the value passed: the same scaler",
    ("alltoall-dispatch", "x.contiguous(..., planted_wrong_arg=1)"):
        "Paddle 3.3.1's Tensor.contiguous is a C builtin that takes no argument and ignores keywords: the same tensor",
    ("cp-nccl-collectives", "p.contiguous(..., planted_wrong_arg=1)"):
        "Paddle 3.3.1's Tensor.contiguous is a C builtin that takes no argument and ignores keywords: the same tensor",
    ("cp-flash", "flashmask_attention: drop causal="):
        "paddle.nn.functional.flashmask_attention's default causal is False, the value passed (the causal part is in "
        "the start/end row indices): the same call",
}
"""(id, plant) -> why the planted code computes exactly what the original does (reported, not counted as survived)."""


def _comments(lines: list[str]) -> list[str]:
    """The comments (with their `#`) of the lines of one statement, in order."""
    source = textwrap.dedent("\n".join(lines)) + "\n"
    return [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]


def _statement(tree: ast.AST, line: int):
    """The innermost simple statement (no body) whose lines hold `line`, or None (a compound statement's header)."""
    node, found = tree, None
    while True:
        inside = [c for c in ast.iter_child_nodes(node)
                  if isinstance(c, (ast.stmt, ast.excepthandler)) and c.lineno <= line <= c.end_lineno]
        if not inside:
            return found
        node = inside[0]
        found = None if hasattr(node, "body") else node


def _calls(stmt) -> list[ast.Call]:
    """Every call of the statement, outermost first."""
    return [n for n in ast.walk(stmt) if isinstance(n, ast.Call)]


def _arg_name(call: ast.Call, i: int) -> str:
    return ast.unparse(call.args[i])


def _call_plants(call: ast.Call):
    """(what, mutate(call)) for one call."""
    name = ast.unparse(call.func)
    positional = [i for i, a in enumerate(call.args) if not isinstance(a, ast.Starred)]
    keywords = [i for i, k in enumerate(call.keywords) if k.arg is not None]

    def add(c):
        c.keywords.append(ast.keyword(arg=PLANTED_KEYWORD, value=ast.Constant(1)))
    yield f"{name}(..., {PLANTED_KEYWORD}=1)", add
    if keywords:
        last = keywords[-1]
        yield f"{name}: drop {call.keywords[last].arg}=", lambda c: c.keywords.pop(last)
    elif positional:
        last = positional[-1]
        yield f"{name}: drop its last argument {_arg_name(call, last)}", lambda c: c.args.pop(last)
    if len(positional) >= 2:
        a, b = positional[:2]
        if ast.unparse(call.args[a]) != ast.unparse(call.args[b]):
            def swap(c, a=a, b=b):
                c.args[a], c.args[b] = c.args[b], c.args[a]
            yield f"{name}: swap {_arg_name(call, a)}, {_arg_name(call, b)}", swap
    for i in positional:
        value = call.args[i]
        if not (isinstance(value, ast.Constant) and value.value is None):
            yield f"{name}: {_arg_name(call, i)} -> None", lambda c, i=i: c.args.__setitem__(i, ast.Constant(None))
        if isinstance(value, ast.Constant) and isinstance(value.value, bool):
            yield (f"{name}: {value.value} -> {not value.value}",
                   lambda c, i=i: c.args.__setitem__(i, ast.Constant(not c.args[i].value)))
    for i in keywords:
        kw = call.keywords[i]
        if not (isinstance(kw.value, ast.Constant) and kw.value.value is None):
            yield f"{name}: {kw.arg}=None", lambda c, i=i: setattr(c.keywords[i], "value", ast.Constant(None))
        if isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, bool):
            yield (f"{name}: {kw.arg}={not kw.value.value}",
                   lambda c, i=i: setattr(c.keywords[i], "value", ast.Constant(not c.keywords[i].value.value)))


def _sibling_value(tree: ast.AST, stmt) -> ast.expr | None:
    """For `x = None` in one side of an `if`: the value the other side assigns to x."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (stmt in node.body or stmt in node.orelse):
            other = node.orelse if stmt in node.body else node.body
            for s in other:
                if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == stmt.targets[0].id:
                    return s.value
    return None


def _value_plants(tree: ast.AST, stmt):
    value = getattr(stmt, "value", None)
    if isinstance(value, ast.Constant) and isinstance(value.value, bool):
        yield f"{value.value} -> {not value.value}", lambda s: setattr(s, "value", ast.Constant(not value.value))
    elif isinstance(value, ast.Constant) and value.value is None:
        other = _sibling_value(tree, stmt)
        if other is not None:
            yield f"None -> {ast.unparse(other)} (the CPU side's value)", lambda s: setattr(s, "value", copy.deepcopy(other))


def _rewrite(text: str, stmt, new_stmt) -> str:
    """`text` with the lines of `stmt` replaced by `new_stmt` on its first line (its comments kept there) and blank
    lines for the rest (every other line keeps its number)."""
    lines = text.split("\n")
    first = lines[stmt.lineno - 1]
    indent = first[: len(first) - len(first.lstrip())]
    kept = "  ".join(_comments(lines[stmt.lineno - 1: stmt.end_lineno]))
    body = indent + ast.unparse(new_stmt) + ("  " + kept if kept else "")
    lines[stmt.lineno - 1: stmt.end_lineno] = [body] + [""] * (stmt.end_lineno - stmt.lineno)
    return "\n".join(lines)


def argument_plants(root: Path = REPO) -> tuple[list[Plant], list[str]]:
    """The plants of every marked statement, and one line per marked line that got none (and why)."""
    plants, unplanted, seen, files = [], [], set(), {}
    for branch, lines in sorted(markers(root / "llmtrain").items()):
        for path, line in lines:
            rel = os.path.relpath(path, root)
            if path not in files:
                text = Path(path).read_text(encoding="utf-8")
                files[path] = text, ast.parse(text)
            text, tree = files[path]
            stmt = _statement(tree, line)
            if stmt is None:
                unplanted.append(f"{rel}:{line} GPU-ONLY({branch}): on a compound statement's header (refused by "
                                 "test_markers.py)")
                continue
            if (rel, stmt.lineno) in seen:
                continue
            seen.add((rel, stmt.lineno))
            index = {id(n): k for k, n in enumerate(ast.walk(stmt))}
            made = 0
            for call in _calls(stmt):
                for what, mutate in _call_plants(call):
                    new = copy.deepcopy(stmt)
                    mutate(list(ast.walk(new))[index[id(call)]])
                    plants.append(Plant(branch, f"{rel}:{stmt.lineno}", what, rel, _rewrite(text, stmt, new)))
                    made += 1
            if not made:
                for what, mutate in _value_plants(tree, stmt):
                    new = copy.deepcopy(stmt)
                    mutate(new)
                    plants.append(Plant(branch, f"{rel}:{stmt.lineno}", what, rel, _rewrite(text, stmt, new)))
                    made += 1
            if not made:
                unplanted.append(f"{rel}:{line} GPU-ONLY({branch}): no call or constant to plant in")
    return plants, unplanted


def regression_plants(root: Path = REPO) -> list[Plant]:
    out = []
    for branch, rel, function, what, source in REGRESSIONS:
        text = (root / rel).read_text(encoding="utf-8")
        node = next((n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == function), None)
        if node is None:
            raise SystemExit(f"REGRESSIONS: {rel} has no function {function} any more: update the plant")
        lines = text.split("\n")
        lines[node.lineno - 1: node.end_lineno] = source.rstrip("\n").split("\n")
        out.append(Plant(branch, f"{rel}:{node.lineno}", what, rel, "\n".join(lines)))
    return out


def skip_plants(branches, root: Path = REPO) -> list[Plant]:
    out = []
    for branch in branches:
        test = rehearsal_file(branch)
        if test.exists():
            rel = os.path.relpath(test, root)
            out.append(Plant(branch, rel, "every test of the rehearsal skipped", rel,
                             test.read_text(encoding="utf-8") + SKIP_ALL))
    return out


def _scratch_copy() -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    scratch = Path(tempfile.mkdtemp(prefix="plant_wrong_args_"))
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, scratch / rel)
    return scratch


def _run(scratch: Path, branch: str, timeout: int) -> tuple[int, str]:
    """Exit status of the branch's rehearsal in the scratch copy, and the first failure line."""
    test = os.path.relpath(rehearsal_file(branch), REPO)
    env = dict(os.environ, PYTHONPATH=str(scratch))
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", test, "-q", "-x", "-p", "no:cacheprovider", "-n", "0"],
                              cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout} s"
    lines = proc.stdout.splitlines()
    reason = next((x for x in lines if x.startswith("E ")), None) or next(
        (x for x in lines if x.startswith(("FAILED", "ERROR"))), lines[-1] if lines else proc.stderr[-300:])
    return proc.returncode, reason.strip()[:300]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tests/gpu_paths/plant_wrong_args.py")
    ap.add_argument("--only", default="", help="comma-separated GPU-ONLY ids (default: every marked one)")
    ap.add_argument("--list", action="store_true", help="print the plants and exit")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per rehearsal run")
    a = ap.parse_args(argv)
    plants, unplanted = argument_plants()
    branches = sorted(markers())
    plants += regression_plants() + skip_plants(branches)
    if a.only:
        keep = set(a.only.split(","))
        plants = [p for p in plants if p.branch in keep]
        unplanted = [u for u in unplanted if any(f"GPU-ONLY({b})" in u for b in keep)]
    for line in unplanted:
        print(f"not planted  {line}")
    if a.list:
        for p in plants:
            print(f"{p.branch:24s} {p.where:45s} {p.what}")
        return 0
    scratch = _scratch_copy()
    bad = 0
    try:
        for branch in sorted({p.branch for p in plants}):
            rc, reason = _run(scratch, branch, a.timeout)
            if rc != 0:
                print(f"baseline FAILED  {branch}: {reason} (fix the rehearsal first)")
                return 1
        for p in plants:
            original = (scratch / p.path).read_text(encoding="utf-8")
            (scratch / p.path).write_text(p.text, encoding="utf-8")
            try:
                rc, reason = _run(scratch, p.branch, a.timeout)
            finally:
                (scratch / p.path).write_text(original, encoding="utf-8")
            verdict = {0: "SURVIVED", 1: "caught"}.get(rc, f"broken (exit {rc})")
            if verdict == "SURVIVED" and (p.branch, p.what) in EQUIVALENT:
                verdict, reason = "equivalent", EQUIVALENT[p.branch, p.what]
            bad += verdict not in ("caught", "equivalent")
            print(f"{verdict:9s} {p.branch:24s} {p.where:40s} {p.what}\n          -> {reason}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{len(plants) - bad} of {len(plants)} plants caught or equivalent; {len(unplanted)} marked lines not planted")
    return 1 if bad or unplanted else 0


if __name__ == "__main__":
    sys.exit(main())

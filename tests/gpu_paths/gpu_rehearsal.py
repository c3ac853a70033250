"""The GPU-only branches of llmtrain (`# GPU-ONLY(<id>)` markers) and the tools their CPU rehearsals share.

    python -m pytest tests/gpu_paths -q

- `markers()`: {id: [(file, line), ...]} of every `# GPU-ONLY(<id>)` comment under llmtrain/ (the marker sits on
  a line that only the GPU path runs);
- `rehearsal_file(id)`: tests/gpu_paths/test_<id with _ for ->.py, where that branch is rehearsed;
- `readme_ids()`: the ids of the README's "GPU-only code paths" list (each item starts with the id in backticks);
  `docs_steps()`: {id: acceptance steps} of docs/gpus.md's list of the same name (each item ends with
  `— steps `<step>`, ...`);
- `header_markers(marks)`: markers that sit on an `if` condition or another compound statement's header (refused);
- `checked(real, reference, implements)`: a stand-in for the GPU-only Paddle function `real` that binds every call
  to `inspect.signature(real)` (a wrong argument list raises TypeError, as the real function would), refuses a
  non-default value for any argument the reference does not implement, and runs `reference(**arguments)`;
- `reaches(id)`: a context manager that traces the marked lines; its block must run at least one line marked with
  `id`, and the rehearsal module as a whole every one of them (tests/gpu_paths/conftest.py checks at the end of
  the module, `module_problems`; on CPU a module whose every test skipped fails there too);
- `LowPrecisionCore(dtype)`: Roles whose attention core is handed q, k, v in fp16/bf16, as under AMP O2 (CPU has
  no low-precision matmul, so the rest of the model stays fp32); `RoundedCore(dtype)`: its CPU reference (the
  same roundings, math in fp32);
- `ON_GPU`: True when the suite runs on a CUDA device (scripts/gpu_acceptance.sh): the rehearsals then call the
  real kernels and compare them with the same CPU references (no stand-in is installed).
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import os
import re
import sys
from pathlib import Path

from llmtrain.models.roles import Roles

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "llmtrain"
MARKER = re.compile(r"#\s*GPU-ONLY\(([^)]*)\)")
ID = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
README_SECTION = "## GPU-only code paths"


def _on_gpu() -> bool:
    from llmtrain.paddle_compat.kernels import on_gpu

    return on_gpu()


ON_GPU = _on_gpu()
HITS: dict[str, set] = {}
"""id -> the marked (file, line) pairs that `reaches` blocks ran in this process."""


def markers(root: Path = PACKAGE) -> dict[str, list[tuple[str, int]]]:
    """{id: [(absolute file, 1-based line), ...]} of every GPU-ONLY marker under `root`; a malformed id raises."""
    out: dict[str, list[tuple[str, int]]] = {}
    for path in sorted(root.rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in MARKER.finditer(line):
                if not ID.fullmatch(m.group(1)):
                    raise ValueError(f"{path}:{n}: GPU-ONLY({m.group(1)}): an id is lower-case words joined by '-'")
                out.setdefault(m.group(1), []).append((str(path), n))
    return out


_HEADERS = {ast.If: "an `if`/`elif` condition", ast.While: "a `while` condition", ast.For: "a `for` header",
            ast.With: "a `with` header", ast.FunctionDef: "a `def` line", ast.Try: "a `try` line"}


def header_markers(marks: dict[str, list[tuple[str, int]]]) -> list[str]:
    """One line per marker that sits on the header of a compound statement (an `if` condition, a `def`, ...): the
    CPU path evaluates that line too, so the tracer would count the branch as rehearsed when only the condition ran."""
    out = []
    trees: dict[str, ast.AST] = {}
    for branch, lines in sorted(marks.items()):
        for path, n in lines:
            tree = trees.setdefault(path, ast.parse(Path(path).read_text(encoding="utf-8")))
            for node in ast.walk(tree):
                kind = next((v for k, v in _HEADERS.items() if isinstance(node, k)), None)
                if kind is not None and node.lineno <= n < node.body[0].lineno:
                    out.append(f"{Path(path).relative_to(REPO) if Path(path).is_relative_to(REPO) else path}:{n}: "
                               f"GPU-ONLY({branch}) sits on {kind}, which the CPU path runs too: put the marker on "
                               "the line(s) inside the branch that only a GPU run executes")
                    break
    return out


def rehearsal_file(branch: str) -> Path:
    return REPO / "tests" / "gpu_paths" / f"test_{branch.replace('-', '_')}.py"


def branch_of(test_file: str) -> str | None:
    """The id a rehearsal file rehearses (test_fused_rope.py -> fused-rope); None for files that are not one."""
    name = Path(test_file).name
    if not name.startswith("test_") or name == "test_markers.py":
        return None
    return name[len("test_"):-len(".py")].replace("_", "-")


def listed_items(path: Path, section: str = README_SECTION) -> list[tuple[str, str]]:
    """(id, item text) of the list items in `section` of the markdown file `path`, in order: items are `- `<id>` ...`
    lines (continuation lines indented); an item without its id in backticks first raises."""
    text = path.read_text(encoding="utf-8")
    if section not in text:
        raise AssertionError(f"{path}: no '{section}' section")
    items: list[list[str]] = []
    for line in text.split(section, 1)[1].split("\n## ", 1)[0].splitlines():
        if line.startswith("- "):
            items.append([line])
        elif items and line.startswith("  ") and line.strip():
            items[-1].append(line.strip())
        elif items and not line.strip():
            items.append([])  # a blank line ends the item
    out = []
    for lines in filter(None, items):
        m = re.match(r"- `([^`]+)`", lines[0])
        if m is None:
            raise AssertionError(f"{path}: GPU-only item without its id in backticks first: {lines[0]!r}")
        out.append((m.group(1), " ".join(lines)))
    return out


def readme_ids(readme: Path = REPO / "README.md") -> list[str]:
    """Ids of the list items in the README's GPU-only section, in order: `- `<id>` ...` lines."""
    return [i for i, _ in listed_items(readme)]


DOCS = REPO / "docs" / "gpus.md"


def docs_steps(docs: Path = DOCS) -> dict[str, list[str]]:
    """{id: acceptance steps} of docs/gpus.md's GPU-only list, in order: each item ends with
    `— steps `a`, `b`` (the scripts/gpu_acceptance.py steps that run it on a GPU); an item without raises."""
    out = {}
    for branch, text in listed_items(docs):
        m = re.search(r"— steps ((?:`[^`]+`(?:, )?)+)[;.]?$", text)
        if m is None:
            raise AssertionError(f"{docs}: the GPU-only item `{branch}` does not end with "
                                 f"'— steps `<step>`, ...' (its GPU_PATHS steps): {text!r}")
        if branch in out:
            raise AssertionError(f"{docs}: the GPU-only item `{branch}` is listed twice")
        out[branch] = re.findall(r"`([^`]+)`", m.group(1))
    return out


def checked(real, reference, implements: tuple[str, ...]):
    """A stand-in for `real` (a Paddle function) that calls `reference` with the arguments bound by name.

    Every argument of `real` that is not in `implements` must keep its default (the reference does not model it);
    `stand_in.calls` keeps the bound arguments of every call."""
    try:
        sig = inspect.signature(real)
    except ValueError as e:  # a C builtin (paddle._C_ops.*) has no Python signature to bind to
        raise AssertionError(f"checked(): inspect.signature cannot read {real!r} ({e}): bind the stand-in to the public "
                             "Python function that wraps it, or check the argument list another way that fails on a "
                             "wrong one (e.g. against the calls Paddle's own Python makes) and say how in the "
                             "rehearsal's docstring") from None
    where = f"{getattr(real, '__module__', '?')}.{getattr(real, '__qualname__', real)}{sig}"
    missing = [p for p in implements if p not in sig.parameters]
    if missing:
        raise AssertionError(f"{where} has no parameter {missing}: the reference models another function")

    def stand_in(*args, **kwargs):
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{where}: {e}") from None
        for name, value in bound.arguments.items():
            default = sig.parameters[name].default
            if name not in implements and not (value is default or _same(value, default)):
                raise AssertionError(f"{where}: {name}={value!r} is not modelled by the CPU reference")
        bound.apply_defaults()
        stand_in.calls.append(dict(bound.arguments))
        return reference(**bound.arguments)

    stand_in.calls = []
    stand_in.__signature__ = sig
    return stand_in


def _same(value, default) -> bool:
    try:
        return bool(value == default) and type(value) is type(default)
    except Exception:  # noqa: BLE001 -- a tensor compared with a default: not the default
        return False


@contextlib.contextmanager
def reaches(branch: str):
    """Trace the lines marked GPU-ONLY(`branch`) while the block runs; at least one must run."""
    want = {(os.path.realpath(f), n) for f, n in markers().get(branch, [])}
    if not want:
        raise AssertionError(f"no line of llmtrain/ is marked GPU-ONLY({branch})")
    files = {f for f, _ in want}
    hit: set = set()
    real_of: dict[str, str] = {}

    def local(frame, event, arg):
        if event == "line":
            key = (real_of[frame.f_code.co_filename], frame.f_lineno)
            if key in want:
                hit.add(key)
        return local

    def calls(frame, event, arg):
        name = frame.f_code.co_filename
        if name not in real_of:
            real_of[name] = os.path.realpath(name)
        return local if real_of[name] in files else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield hit
    finally:
        sys.settrace(previous)
    HITS.setdefault(branch, set()).update(hit)
    assert hit, f"the block ran none of the lines marked GPU-ONLY({branch}): {sorted(want)}"


def module_problems(module: str, branch: str, marked: list[tuple[str, int]], hit: set, ran: int,
                    on_gpu: bool) -> list[str]:
    """What a finished rehearsal module `module` of `branch` lacks: on CPU at least one test must have run (a
    rehearsal whose every test skips on CPU rehearses nothing; only an extra real-GPU check may skip there), and its
    `reaches` blocks together must have run every line in `marked` ((file, line) pairs; `hit`: those that ran). On a
    GPU a module whose tests all skip is accepted (the acceptance steps of GPU_PATHS run the branch there)."""
    if ran == 0:
        if on_gpu:
            return []
        return [f"{module}: every test was skipped on CPU, so GPU-ONLY({branch}) was never rehearsed: a rehearsal "
                "must run on CPU with the GPU kernel replaced by a checked() reference (skip only an extra test that "
                "needs the real GPU; tests/gpu_paths/README.md)"]
    want = {(os.path.realpath(f), n) for f, n in marked}
    missed = sorted(want - hit)
    if not missed:
        return []
    return [f"{module}: no `reaches('{branch}')` block ran these GPU-ONLY({branch}) lines: "
            + ", ".join(f"{os.path.relpath(f, REPO)}:{n}" for f, n in missed)
            + " (run the branch that holds each inside `with reaches(...)`, or move a marker that no GPU run takes)"]


def rounded(t, dtype: str):
    """t rounded to `dtype` and back to fp32 (what a low-precision activation holds)."""
    return t.astype(dtype).astype("float32")


class LowPrecisionCore(Roles):
    """Roles whose attention core gets q, k, v in `dtype` (AMP O2's activations) and returns fp32."""

    def __init__(self, dtype: str):
        self.dtype = dtype

    def attention_core(self, core):
        def attend(q, k, v, *args, **kwargs):  # q [b, s, nh, d], k/v [b, s, nkv, d]
            low = [t.astype(self.dtype) for t in (q, k, v)]
            return core(*low, *args, **kwargs).astype("float32")

        return attend


class RoundedCore(LowPrecisionCore):
    """The CPU reference of LowPrecisionCore: the same roundings of q, k, v and of the output, math in fp32."""

    def attention_core(self, core):
        def attend(q, k, v, *args, **kwargs):
            out = core(*(rounded(t, self.dtype) for t in (q, k, v)), *args, **kwargs)
            return rounded(out, self.dtype)

        return attend

"""llmtrain's import graph against the layer order docs/architecture.md states.

    python -m pytest tests/test_package_graph.py -q
    python tests/test_package_graph.py          # list every violation of today's tree

The graph is built with `ast` from the source (no module is imported), counting every
`import` inside a function or an `if TYPE_CHECKING:` block as well. Checked:
- no import circle between llmtrain's modules;
- no upward import: a module imports from its own unit or from a unit on a lower line
  of the layer block in docs/architecture.md (units on one line are siblings and import
  nothing of each other);
- no `_private` name imported from another package;
- no `llm_` attribute (the tags models and plans attach) read or written outside
  `llmtrain/contracts/tags.py`, whether as `x.llm_name` or `getattr(x, "llm_name")`.
The planted-violation tests run the same checks on a copy of the tree with one bad
import (or attribute) added and expect exactly that violation.
"""
from __future__ import annotations

import ast
import fnmatch
import os
import re
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHITECTURE = os.path.join("docs", "architecture.md")
LAYERS_MARK = "# llmtrain layers"
TAGS_MODULE = "llmtrain.contracts.tags"
SCANNED = ("llmtrain", "tests", "benchmarks", "scripts")
KNOWN_UPWARD: set = set()
"""(importer, imported) pairs allowed to run upward: none (the GPU peaks live in the planner's profiles, which
llmtrain/train/peak.py reads)."""


def read_layers(root: str) -> list[list[str]]:
    """The layer block of docs/architecture.md: a list of lines (top first), each a list of unit patterns."""
    text = open(os.path.join(root, ARCHITECTURE), encoding="utf-8").read()
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        lines = block.splitlines()
        if lines and lines[0].startswith(LAYERS_MARK):
            layers = []
            for line in lines[1:]:
                line = line.split("#", 1)[0].strip()
                if line:
                    name, units = line.split(None, 1) if " " in line else (line, line)
                    layers.append(["llmtrain" if u == "__init__" else "llmtrain." + u.strip("./").replace("/", ".")
                                   for u in units.split()])
            return layers
    raise AssertionError(f"{ARCHITECTURE}: no fenced block starting with {LAYERS_MARK!r}")


def modules(root: str, package: str = "llmtrain") -> dict[str, str]:
    """{dotted module name: file path} of every .py file under `package`."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


_TREES: dict[str, ast.AST] = {}


def parse(path: str) -> ast.AST:
    """The syntax tree of a file (cached by content: the planted-violation copies share every other file)."""
    text = open(path, encoding="utf-8").read()
    if text not in _TREES:
        _TREES[text] = ast.parse(text, path)
    return _TREES[text]


def imports(path: str, name: str, known: dict) -> list[tuple[str, str | None, int]]:
    """(imported llmtrain module, imported name or None, line) of every import in one file."""
    tree = parse(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "llmtrain"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "llmtrain":
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub, None, node.lineno) if sub in known else (mod, a.name, node.lineno))
    return out


def unit_of(module: str, layers: list[list[str]]) -> tuple[int, str]:
    """(line index, unit pattern) of a module: a glob (`llmtrain.*.__main__`) first, then the longest prefix."""
    best = None
    for i, line in enumerate(layers):
        for unit in line:
            if "*" in unit:
                if fnmatch.fnmatchcase(module, unit):
                    return i, unit
            elif module == unit or (unit != "llmtrain" and module.startswith(unit + ".")):
                if best is None or len(unit) > len(best[1]):
                    best = (i, unit)
    if best is None:
        raise AssertionError(f"{module}: in no layer of {ARCHITECTURE}; add its unit to the layer block")
    return best


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def graph_problems(root: str) -> list[str]:
    """Every circle, upward import and cross-package private import in `root`'s llmtrain package."""
    layers = read_layers(root)
    known = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in known}
    problems = []
    for m, path in known.items():
        mi, mu = unit_of(m, layers)
        for target, name, line in imports(path, m, known):
            if target not in known:
                problems.append(f"{path}:{line}: imports {target}, which does not exist")
                continue
            edges[m].add(target)
            ti, tu = unit_of(target, layers)
            where = f"{os.path.relpath(path, root)}:{line}"
            if tu != mu and ti <= mi and (m, target) not in KNOWN_UPWARD:
                kind = "sibling" if ti == mi else "upward"
                problems.append(f"{where}: {kind} import {m} ({mu}) -> {target} ({tu})")
            if name and name.startswith("_") and not name.startswith("__") and package_of(m) != package_of(target):
                problems.append(f"{where}: private name {target}.{name} imported from another package")
    problems += [f"import circle: {' -> '.join(c)}" for c in circles(edges)]
    return list(dict.fromkeys(problems))  # one line per import statement, however many names it imports


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a closed path."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp) + [sorted(comp)[0]])

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def tag_problems(root: str) -> list[str]:
    """`llm_` attributes touched outside the tags module (attribute syntax or a string given to getattr & co.)."""
    problems = []
    for top in SCANNED:
        for m, path in modules(root, top).items():
            if m == TAGS_MODULE:
                continue
            for node in ast.walk(parse(path)):
                hit = None
                if isinstance(node, ast.Attribute) and node.attr.startswith(("llm_", "_llm_")):
                    hit = node.attr
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                      and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
                      and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith(("llm_", "_llm_"))):
                    hit = node.args[1].value
                if hit:
                    problems.append(f"{os.path.relpath(path, root)}:{node.lineno}: attribute {hit} outside "
                                    f"{TAGS_MODULE} (use its typed setters/getters)")
    return problems


def test_layers_cover_the_packages():
    layers = read_layers(REPO)
    for m in modules(REPO):
        unit_of(m, layers)  # raises for a module the architecture page does not place


def test_package_graph_follows_the_layers():
    problems = graph_problems(REPO)
    assert not problems, "\n".join(problems)


def test_llm_attributes_only_through_contracts():
    problems = tag_problems(REPO)
    assert not problems, "\n".join(problems)


def _copy(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(os.path.join(REPO, "llmtrain"), root / "llmtrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(REPO, "docs"), root / "docs")
    for top in SCANNED[1:]:
        (root / top).mkdir()
    return root


def _plant(path, line):
    text = path.read_text()
    path.write_text(text + "\n" + line + "\n")


def test_a_planted_upward_import_fails(tmp_path):
    root = _copy(tmp_path)
    assert graph_problems(str(root)) == []
    _plant(root / "llmtrain" / "models" / "layers.py", "from llmtrain.train.trainer import Trainer  # noqa")
    problems = graph_problems(str(root))
    upward = [p for p in problems if " import " in p and not p.startswith("import circle")]
    assert len(upward) == 1 and "upward import llmtrain.models.layers (llmtrain.models) -> llmtrain.train.trainer" \
        in upward[0], problems  # (the trainer imports the models back: the same line also closes a circle)


def test_a_planted_circle_and_private_import_fail(tmp_path):
    root = _copy(tmp_path)
    _plant(root / "llmtrain" / "errors.py", "def _hidden():\n    from llmtrain.utils import log  # noqa")
    _plant(root / "llmtrain" / "utils" / "log.py", "from llmtrain.errors import ConfigError  # noqa")
    _plant(root / "llmtrain" / "models" / "init.py", "from llmtrain.parallel.layout import _resolve_batch  # noqa")
    problems = graph_problems(str(root))
    assert any(p.startswith("import circle: llmtrain.errors -> llmtrain.utils.log") for p in problems), problems
    assert any("private name llmtrain.parallel.layout._resolve_batch" in p for p in problems), problems


def test_a_planted_llm_attribute_fails(tmp_path):
    root = _copy(tmp_path)
    assert tag_problems(str(root)) == []
    _plant(root / "llmtrain" / "train" / "clip.py", "def _axis(p):\n    return getattr(p, 'llm_split_axis', None)")
    _plant(root / "llmtrain" / "models" / "init.py", "def _mark(p):\n    p.llm_init = 'ones'")
    problems = sorted(tag_problems(str(root)))
    assert len(problems) == 2 and "init.py" in problems[0] and "llm_init" in problems[0] \
        and "clip.py" in problems[1] and "llm_split_axis" in problems[1], problems


if __name__ == "__main__":
    print("\n".join(graph_problems(REPO) + tag_problems(REPO)) or "no violations")

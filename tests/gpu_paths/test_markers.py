"""Every GPU-only branch is marked, rehearsed on CPU, listed in the README and docs/gpus.md and run by the GPU
acceptance script.

    python -m pytest tests/gpu_paths/test_markers.py -q

The branches are read from the code (`# GPU-ONLY(<id>)` comments under llmtrain/), so a branch that lands later
is checked as soon as it is marked. Each id needs tests/gpu_paths/test_<id>.py that enters `reaches("<id>")`
(tests/gpu_paths/conftest.py then checks that the module ran every marked line), an item of the README's
"GPU-only code paths" list, an item of docs/gpus.md's list of that name ending with its acceptance steps, and an
entry of `GPU_PATHS` in scripts/gpu_acceptance.py naming the same steps, steps the script has. A marker on an `if`
condition (or another line the CPU path runs too) is refused. A rehearsal, README or docs item, or acceptance
entry without a marker fails too. Every message says what to add where (tests/gpu_paths/README.md has the recipe).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from gpu_rehearsal import (REPO, branch_of, docs_steps, header_markers, markers, module_problems, readme_ids,
                           rehearsal_file)

sys.path.insert(0, str(REPO / "scripts"))
import gpu_acceptance  # noqa: E402

HOWTO = "tests/gpu_paths/README.md"


@dataclasses.dataclass
class Listing:
    """Where the GPU-only branches are named, as the checker reads them."""

    marks: dict
    """id -> [(file, line)] of its `# GPU-ONLY(<id>)` markers under llmtrain/."""
    readme: list
    """ids of the README's "GPU-only code paths" list, in order."""
    docs: dict
    """id -> acceptance steps of docs/gpus.md's "GPU-only code paths" list."""
    acceptance: dict
    """scripts/gpu_acceptance.py GPU_PATHS: id -> step names."""
    step_names: set
    """Every step scripts/gpu_acceptance.py has (an 8-GPU run's names)."""
    rehearsals: dict
    """id -> text of tests/gpu_paths/test_<id>.py, for every such file."""


def coverage_problems(got: Listing) -> list[str]:
    """One line per gap, each saying what to add where."""
    out = []
    where = {b: ", ".join(f"{_rel(f)}:{n}" for f, n in lines) for b, lines in got.marks.items()}
    for b in sorted(got.marks):
        test = rehearsal_file(b).relative_to(REPO)
        if b not in got.rehearsals:
            out.append(f"GPU-ONLY({b}) at {where[b]}: no rehearsal: write {test} ({HOWTO}, 'Adding a GPU-only "
                       f"branch': the Paddle GPU function replaced by checked(real, reference, implements), the branch "
                       f"run on CPU inside `with reaches(\"{b}\"):`, its result compared with the CPU path)")
        elif f'reaches("{b}")' not in got.rehearsals[b] and f"reaches('{b}')" not in got.rehearsals[b]:
            out.append(f"{test} never enters reaches(\"{b}\"): run the code that reaches {where[b]} inside "
                       f"`with reaches(\"{b}\"):` (gpu_rehearsal.py)")
        if b not in got.readme:
            out.append(f"GPU-ONLY({b}) at {where[b]}: not in README.md's '## GPU-only code paths' list: add the item "
                       f"`- `{b}` — what it runs (`{_rel(got.marks[b][0][0])}`);` in id order")
        steps = got.acceptance.get(b)
        if steps is None:
            out.append(f"GPU-ONLY({b}) at {where[b]}: no GPU_PATHS entry in scripts/gpu_acceptance.py: add "
                       f"`\"{b}\": [\"gpu_paths\", ...]` naming the steps that run it on a GPU (`gpu_paths` runs "
                       f"tests/gpu_paths there; add a step when the branch needs a real run)")
        else:
            unknown = [s for s in steps if s not in got.step_names]
            if not steps or unknown:
                out.append(f"GPU_PATHS[{b!r}] in scripts/gpu_acceptance.py names no step or unknown steps {unknown} "
                           f"(the script's steps: {sorted(got.step_names)})")
        if b not in got.docs:
            out.append(f"GPU-ONLY({b}) at {where[b]}: not in docs/gpus.md's '## GPU-only code paths' list: add the "
                       f"item `- `{b}`: what it runs (`{_rel(got.marks[b][0][0])}`) — steps "
                       + ", ".join(f"`{s}`" for s in steps or ["gpu_paths"]) + ";` in id order")
        elif steps is not None and sorted(got.docs[b]) != sorted(steps):
            out.append(f"docs/gpus.md gives `{b}` the steps {got.docs[b]}, scripts/gpu_acceptance.py GPU_PATHS "
                       f"{steps}: make them the same")
    for b in sorted(set(got.rehearsals) - set(got.marks)):
        out.append(f"{rehearsal_file(b).relative_to(REPO)} rehearses {b!r}, which no line of llmtrain/ is marked "
                   f"with: mark the GPU-only line(s) `# GPU-ONLY({b})`, or rename/remove the rehearsal")
    for name, listed in (("README.md", got.readme), ("docs/gpus.md", list(got.docs)),
                         ("scripts/gpu_acceptance.py GPU_PATHS", list(got.acceptance))):
        for b in sorted(set(listed) - set(got.marks)):
            out.append(f"{name} lists GPU-only path {b!r}, which no line of llmtrain/ is marked with: remove it or "
                       f"mark the code `# GPU-ONLY({b})`")
    for name, listed in (("README.md", got.readme), ("docs/gpus.md", list(got.docs))):
        if len(listed) != len(set(listed)):
            out.append(f"{name} lists a GPU-only path twice: {listed}")
        elif listed != sorted(listed):
            out.append(f"{name}'s GPU-only list is not in id order: {listed} (expected {sorted(listed)})")
    return out


def _rel(path: str) -> str:
    return os.path.relpath(path, REPO)


def _rehearsals() -> dict[str, str]:
    files = sorted((REPO / "tests" / "gpu_paths").glob("test_*.py"))
    return {branch_of(str(f)): f.read_text(encoding="utf-8") for f in files if branch_of(str(f))}


def _step_names() -> set[str]:
    return {s["name"] for s in gpu_acceptance.steps(Path("/nonexistent"), 8, "h100", 30)}


def test_every_gpu_only_branch_is_rehearsed_listed_and_accepted():
    marks = markers()
    assert marks, "no GPU-ONLY markers found under llmtrain/"
    problems = header_markers(marks)
    problems += coverage_problems(Listing(marks, readme_ids(), docs_steps(), gpu_acceptance.GPU_PATHS,
                                          _step_names(), _rehearsals()))
    assert problems == [], "\n".join(problems)


def _listing(**change) -> Listing:
    marks = {b: [(str(REPO / "llmtrain" / "a.py"), n)] for b, n in (("new-kernel", 3), ("old", 9))}
    good = Listing(marks=marks, readme=["new-kernel", "old"], docs={"new-kernel": ["gpu_paths"], "old": ["gpu_paths"]},
                   acceptance={"new-kernel": ["gpu_paths"], "old": ["gpu_paths"]}, step_names={"gpu_paths", "tput"},
                   rehearsals={"new-kernel": 'with reaches("new-kernel"):', "old": 'with reaches("old"):'})
    return dataclasses.replace(good, **change)


def test_the_checker_fails_on_each_kind_of_gap(tmp_path):
    """Planted gaps: a marker without rehearsal, README or docs item or acceptance entry; steps that disagree;
    orphans of each kind; a marker on an `if` condition; a malformed id."""
    pkg = tmp_path / "llmtrain"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\nif gpu:\n    y = kernel(x)  # GPU-ONLY(new-kernel)\n"
                              "if gpu and x:  # GPU-ONLY(on-a-condition)\n    y = 2\n"
                              "while (x <\n       2):  # GPU-ONLY(on-a-condition)\n    x += 1\n")
    marks = markers(pkg)
    assert marks == {"new-kernel": [(str(pkg / "a.py"), 3)],
                     "on-a-condition": [(str(pkg / "a.py"), 4), (str(pkg / "a.py"), 7)]}
    found = header_markers(marks)
    assert len(found) == 2 and "a.py:4: GPU-ONLY(on-a-condition) sits on an `if`/`elif` condition" in found[0], found
    assert "a.py:7" in found[1] and "`while`" in found[1]
    (pkg / "b.py").write_text("z = 2  # GPU-ONLY(Bad_Id)\n")
    try:
        markers(pkg)
    except ValueError as e:
        assert "b.py:1" in str(e)
    else:
        raise AssertionError("a malformed id passed")
    assert coverage_problems(_listing()) == []
    good = _listing()
    gaps = {
        "no rehearsal: write tests/gpu_paths/test_new_kernel.py": dict(rehearsals={"old": good.rehearsals["old"]}),
        'never enters reaches("old")': dict(rehearsals=dict(good.rehearsals, old="def test(): pass")),
        "not in README.md's '## GPU-only code paths' list: add the item `- `new-kernel`": dict(readme=["old"]),
        "not in docs/gpus.md's '## GPU-only code paths' list": dict(docs={"old": ["gpu_paths"]}),
        "docs/gpus.md gives `old` the steps ['tput']": dict(docs=dict(good.docs, old=["tput"])),
        "no GPU_PATHS entry": dict(acceptance={"old": ["gpu_paths"]}),
        "unknown steps ['parity_fp64']": dict(acceptance=dict(good.acceptance, old=["parity_fp64"]),
                                              docs=dict(good.docs, old=["parity_fp64"])),
        "README.md lists GPU-only path 'gone'": dict(readme=["gone", "new-kernel", "old"]),
        "docs/gpus.md lists GPU-only path 'gone'": dict(docs={"gone": ["gpu_paths"], **good.docs}),
        "GPU_PATHS lists GPU-only path 'gone'": dict(acceptance=dict(good.acceptance, gone=["gpu_paths"])),
        "rehearses 'gone'": dict(rehearsals=dict(good.rehearsals, gone="reaches('gone')")),
        "README.md's GPU-only list is not in id order": dict(readme=["old", "new-kernel"]),
        "README.md lists a GPU-only path twice": dict(readme=["new-kernel", "old", "old"]),
        "docs/gpus.md's GPU-only list is not in id order": dict(docs=dict(reversed(good.docs.items()))),
    }
    for what, change in gaps.items():
        found = coverage_problems(_listing(**change))
        assert len(found) == 1 and what in found[0], (what, found)


def test_the_checker_finds_what_the_other_branches_marked(tmp_path):
    """The checker as another engineer meets it: a branch marked in a new file, nothing else yet, gets one line per
    missing piece, each naming the file to write or the line to add."""
    pkg = tmp_path / "llmtrain"
    pkg.mkdir()
    (pkg / "dispatch.py").write_text("def combine(x):\n    return fused(x)  # GPU-ONLY(moe-combine)\n")
    marks = markers(pkg)
    found = coverage_problems(_listing(marks=marks, readme=[], docs={}, acceptance={}, rehearsals={}))
    assert len(found) == 4 and all(p.startswith(f"GPU-ONLY(moe-combine) at {_rel(str(pkg))}/dispatch.py:2: ")
                                   for p in found), found
    assert "write tests/gpu_paths/test_moe_combine.py" in found[0]
    assert "README.md" in found[1] and "- `moe-combine` —" in found[1]
    assert "GPU_PATHS" in found[2] and '"moe-combine": ["gpu_paths", ...]' in found[2]
    assert "docs/gpus.md" in found[3] and "- `moe-combine`:" in found[3] and "— steps `gpu_paths`" in found[3]


def test_readme_parser_reads_ids_and_refuses_an_item_without_one(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## GPU-only code paths\n\nText.\n\n- `b-one` — b;\n- `a-two` — a.\n\n## Next\n- `c` no\n")
    assert readme_ids(readme) == ["b-one", "a-two"]
    readme.write_text("## GPU-only code paths\n\n- flash attention (no id)\n")
    try:
        readme_ids(readme)
    except AssertionError as e:
        assert "without its id" in str(e)
    else:
        raise AssertionError("an item without an id passed")


def test_a_module_that_skips_on_cpu_or_misses_a_marked_line_fails():
    """conftest.py's end-of-module check: a rehearsal whose every test skipped on CPU (a `skipif(not ON_GPU)` on
    each) rehearses nothing; a marked line no `reaches` block ran is named with its file and line."""
    marked = [(str(REPO / "llmtrain" / "a.py"), 3), (str(REPO / "llmtrain" / "a.py"), 7)]
    hit = {(os.path.realpath(f), n) for f, n in marked}
    assert module_problems("test_x.py", "x", marked, hit, ran=2, on_gpu=False) == []
    (skipped,) = module_problems("test_x.py", "x", marked, set(), ran=0, on_gpu=False)
    assert "every test was skipped on CPU" in skipped and "GPU-ONLY(x)" in skipped
    assert module_problems("test_x.py", "x", marked, set(), ran=0, on_gpu=True) == []  # GPU_PATHS' steps run it
    (missed,) = module_problems("test_x.py", "x", marked, set(list(hit)[:1]) | {("other.py", 1)}, ran=1, on_gpu=True)
    assert "no `reaches('x')` block ran" in missed and missed.count("llmtrain/a.py:") == 1


def test_every_marked_line_gets_wrong_argument_plants():
    """plant_wrong_args.py (run by hand: minutes) has plants for every marked line, each a file that still parses
    and keeps its markers: a branch marked later is planted without touching the script."""
    import ast

    from plant_wrong_args import MARKER_OF, argument_plants

    plants, unplanted = argument_plants()
    assert unplanted == []
    assert {p.branch for p in plants} == set(markers())
    first = {p.where: p for p in reversed(plants)}  # one plant per planted statement: parsing is the slow part
    for p in first.values():
        ast.parse(p.text)
    assert all(MARKER_OF(p.branch) in p.text for p in plants)

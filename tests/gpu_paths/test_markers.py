"""Every GPU-only branch is marked, rehearsed on CPU, listed in the README and run by the GPU acceptance script.

    python -m pytest tests/gpu_paths/test_markers.py -q

The branches are read from the code (`# GPU-ONLY(<id>)` comments under llmtrain/), so a branch that lands later
is checked as soon as it is marked. Each id needs tests/gpu_paths/test_<id>.py that enters `reaches("<id>")`
(tests/gpu_paths/conftest.py then checks that the module ran every marked line), an item of the README's
"GPU-only code paths" list, and an entry of `GPU_PATHS` in scripts/gpu_acceptance.py naming steps the script
has. A rehearsal without a marker, a README item without one, or an acceptance entry without one fails too.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from gpu_rehearsal import REPO, branch_of, markers, module_problems, readme_ids, rehearsal_file

sys.path.insert(0, str(REPO / "scripts"))
import gpu_acceptance  # noqa: E402


def coverage_problems(marks: dict, readme: list[str], acceptance: dict, step_names: set,
                      rehearsals: dict[str, str]) -> list[str]:
    """One line per gap. marks: id -> [(file, line)]; readme: the README list's ids; acceptance: id -> step names;
    rehearsals: id -> text of tests/gpu_paths/test_<id>.py for every such file."""
    out = []
    where = {b: ", ".join(f"{Path(f).relative_to(REPO)}:{n}" for f, n in lines) for b, lines in marks.items()}
    for b in sorted(marks):
        if b not in rehearsals:
            out.append(f"GPU-ONLY({b}) at {where[b]}: no rehearsal {rehearsal_file(b).relative_to(REPO)}")
        elif f'reaches("{b}")' not in rehearsals[b] and f"reaches('{b}')" not in rehearsals[b]:
            out.append(f"{rehearsal_file(b).relative_to(REPO)} never enters reaches(\"{b}\")")
        if b not in readme:
            out.append(f"GPU-ONLY({b}) at {where[b]}: not in the README's GPU-only code paths list")
        if b not in acceptance:
            out.append(f"GPU-ONLY({b}) at {where[b]}: no GPU_PATHS entry in scripts/gpu_acceptance.py")
        else:
            unknown = [s for s in acceptance[b] if s not in step_names]
            if not acceptance[b] or unknown:
                out.append(f"GPU_PATHS[{b!r}] names no step or unknown steps {unknown} (steps: {sorted(step_names)})")
    for b in sorted(set(rehearsals) - set(marks)):
        out.append(f"{rehearsal_file(b).relative_to(REPO)} rehearses {b!r}, which no line of llmtrain/ is marked with")
    for b in sorted(set(readme) - set(marks)):
        out.append(f"README lists GPU-only path {b!r}, which no line of llmtrain/ is marked with")
    if len(readme) != len(set(readme)):
        out.append(f"README lists a GPU-only path twice: {readme}")
    for b in sorted(set(acceptance) - set(marks)):
        out.append(f"scripts/gpu_acceptance.py GPU_PATHS has {b!r}, which no line of llmtrain/ is marked with")
    return out


def _rehearsals() -> dict[str, str]:
    files = sorted((REPO / "tests" / "gpu_paths").glob("test_*.py"))
    return {branch_of(str(f)): f.read_text(encoding="utf-8") for f in files if branch_of(str(f))}


def _step_names() -> set[str]:
    return {s["name"] for s in gpu_acceptance.steps(Path("/nonexistent"), 8, "h100", 30)}


def test_every_gpu_only_branch_is_rehearsed_listed_and_accepted():
    marks = markers()
    assert marks, "no GPU-ONLY markers found under llmtrain/"
    problems = coverage_problems(marks, readme_ids(), gpu_acceptance.GPU_PATHS, _step_names(), _rehearsals())
    assert problems == [], "\n".join(problems)
    assert readme_ids() == sorted(readme_ids()), "keep the README's GPU-only list sorted by id"


def test_the_checker_fails_on_each_kind_of_gap(tmp_path):
    """Planted gaps: a marker without rehearsal, README item or acceptance entry; orphans of each kind."""
    pkg = tmp_path / "llmtrain"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\nif gpu:\n    y = kernel(x)  # GPU-ONLY(new-kernel)\n")
    marks = markers(pkg)
    assert marks == {"new-kernel": [(str(pkg / "a.py"), 3)]}
    (pkg / "b.py").write_text("z = 2  # GPU-ONLY(Bad_Id)\n")
    try:
        markers(pkg)
    except ValueError as e:
        assert "b.py:1" in str(e)
    else:
        raise AssertionError("a malformed id passed")
    marks = {b: [(str(REPO / "llmtrain" / "a.py"), n)] for b, n in (("new-kernel", 3), ("old", 9))}
    good = {"new-kernel": 'with reaches("new-kernel"):', "old": 'with reaches("old"):'}
    steps = {"gpu_paths"}
    accepted = {"new-kernel": ["gpu_paths"], "old": ["gpu_paths"]}
    assert coverage_problems(marks, ["new-kernel", "old"], accepted, steps, good) == []
    gaps = {
        "no rehearsal": (["new-kernel", "old"], accepted, {"old": good["old"]}),
        "never enters reaches": (["new-kernel", "old"], accepted, dict(good, old="def test(): pass")),
        "not in the README": (["old"], accepted, good),
        "no GPU_PATHS entry": (["new-kernel", "old"], {"old": ["gpu_paths"]}, good),
        "unknown steps": (["new-kernel", "old"], dict(accepted, old=["parity_fp64"]), good),
        "which no line": (["new-kernel", "old", "gone"], accepted, good),
    }
    for what, (readme, acc, rehearsals) in gaps.items():
        found = coverage_problems(marks, readme, acc, steps, rehearsals)
        assert len(found) == 1 and what in found[0], (what, found)
    orphan = coverage_problems(marks, ["new-kernel", "old"], accepted, steps, dict(good, gone="reaches('gone')"))
    assert len(orphan) == 1 and "rehearses 'gone'" in orphan[0]


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

"""Every registered model family (tests/e2e/family_checks.py) fine-tuned under tp2, continued under pp2 (and ep2 for
MoE families), exported and read back by its reference.

    python -m pytest tests/e2e/test_families_e2e.py -q

No launch of its own: the tp2 runs join the shared tp2 launch of the other end-to-end files, the pp2 runs the shared
pp2 launch (with test_qwen_e2e.py's), the ep2 runs the shared dp2 launch (with test_pretrain.py's and
test_finetune.py's; tests/e2e/shared_launch.py). What each run checks: family_checks.check_run.
"""
from __future__ import annotations

import pytest
from family_checks import LAUNCH, build, check_run, run_name, runs_of

from shared_launch import join, shared

LAYOUTS = ("tp2", "pp2", "ep2")
for _layout in LAYOUTS:
    if runs_of(_layout):
        join(LAUNCH[_layout], "families", build(_layout))

CASES = [(layout, run_name(fam, lora)) for layout in LAYOUTS for fam, lora in runs_of(layout)]


@pytest.mark.slow
@pytest.mark.parametrize("layout,name", CASES, ids=[f"{lay}-{n}" for lay, n in CASES])
def test_family_trains_under_layout_and_exports_back(layout, name, tiny_corpus, tmp_path_factory, tmp_path):
    runs = shared(LAUNCH[layout], "families", tiny_corpus, tmp_path_factory)
    print(layout, name, check_run(layout, name, runs[name], tmp_path))

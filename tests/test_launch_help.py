"""`python -m llmtrain.launch --help` says what llmtrain adds before Paddle's options (the planner's --help:
tests/plan/test_plan_cli.py; no empty run directory and no ccache warning from a refused config or the planner:
tests/test_config.py::test_entry_script_stops_before_any_work_with_the_numbers and
tests/plan/test_plan.py::test_cli_json_ranks_valid_layouts).

    python -m pytest -q tests/test_launch_help.py
"""
from __future__ import annotations

import sys


def test_launch_help_says_what_llmtrain_adds_then_paddles_options(capsys, monkeypatch):
    from llmtrain import launch

    monkeypatch.setattr(sys, "argv", ["llmtrain.launch", "--help"])
    try:
        launch.main()
    except SystemExit as e:  # Paddle's parser ends the help with exit status 0
        assert e.code in (0, None)
    out = capsys.readouterr().out
    ours, paddles = out.index("usage: python -m llmtrain.launch"), out.index("--nproc_per_node NPROC_PER_NODE")
    assert ours < paddles and "checked before any worker starts" in out and "etcd://" in out
    assert not launch._asks_for_help(["--nproc_per_node", "2", "llmtrain/pretrain.py", "--help"])  # the script's

"""The data commands end to end: build indices ahead of a run; the default-corpus script (idempotent)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from llmtrain.data.loader import main as loader_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_loader_cli_builds_indices_ahead(prefix, tokenizer_dir, tmp_path, capsys):
    yaml = tmp_path / "tiny.yaml"
    yaml.write_text(f"prefixes: [{prefix}]\ntokenizer: {tokenizer_dir}\nseq_len: 64\nsplit: '90,10,0'\n"
                    f"cache_dir: {tmp_path / 'cache'}\n")
    assert loader_main(["--data", str(yaml), "--seed", "1234", "--samples", "2000", "seq_len=32"]) == 0
    out = capsys.readouterr().out
    assert "train epoch 0: built" in out and "train epoch 1: built" in out and "valid epoch 0: built" in out
    assert ".train.L32.s1234.e1." in out
    assert loader_main(["--data", str(yaml), "--seed", "1234", "--samples", "2000", "seq_len=32"]) == 0
    out = capsys.readouterr().out
    assert "built" not in out and "train epoch 1: cached" in out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_prepare_default_corpus_script_is_idempotent(tmp_path):
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # the venv python
    work = tmp_path / "pd"
    script = os.path.join(REPO, "scripts", "prepare_default_corpus.sh")
    first = subprocess.run(["bash", script, str(work)], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    made = ["pd1998.jsonl", "tokenizer/tokenizer.model", "pd1998_text_document.bin", "pd1998_text_document.idx",
            "pd1998_text_document.wbd", "pd1998_text_document.meta.json"]
    mtimes = {f: (work / f).stat().st_mtime_ns for f in made}
    assert "3205 documents" in first.stdout + first.stderr
    second = subprocess.run(["bash", script, str(work)], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("up to date") >= 2 and "cached" in second.stdout
    assert {f: (work / f).stat().st_mtime_ns for f in made} == mtimes

"""A checkpoint written by a real tp2 run -> `python -m llmtrain.export` -> PaddleNLP loads it with our logits.

    python -m pytest tests/e2e/test_export_roundtrip.py -q

Both architectures train in one tp2 launch, shared with the other tp2 end-to-end files collected with this one
(tests/e2e/shared_launch.py: test_ernie_paddlenlp.py, test_qwen_e2e.py); each is exported and checked by its own test.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from launch import REPO, env
from llmtest import tiny_overrides
from shared_launch import join, shared


ARCHS = ("llama", "gpt")


def build(root, tiny_corpus):
    """(run_many entries, {arch: run directory}): 3 tp2 steps of each architecture."""
    runs = [tiny_overrides(tiny_corpus, str(root / arch), arch, steps=3) + ["+parallel=tp2", "checkpoint.save_final=true"]
            for arch in ARCHS]
    return [{"overrides": r, "entry": "pretrain"} for r in runs], {arch: root / arch for arch in ARCHS}


join("tp2", "export", build)


@pytest.fixture(scope="module")
def tp2_runs(tiny_corpus, tmp_path_factory):
    return shared("tp2", "export", tiny_corpus, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_checkpoint_exports_to_paddlenlp(arch, tp2_runs, tmp_path):
    import paddle
    from paddlenlp.transformers import AutoModelForCausalLM

    from llmtrain.checkpoint.reader import read_model
    from llmtrain.models import build_model
    from llmtrain.models.stages import canonical_parameters
    from llmtrain.models.init import load_full_state

    run = tp2_runs[arch]
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "llmtrain.export", "--checkpoint", str(run), "--output", str(out),
                           "--safetensors"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    # ours, from the (tp-split, reassembled) checkpoint
    ckpt = read_model(str(run / "checkpoints" / "step_3"))
    cfg, state = ckpt.config, ckpt.state
    ours = build_model(cfg)
    load_full_state(canonical_parameters(ours), state)
    ours.eval()
    theirs = AutoModelForCausalLM.from_pretrained(str(out))
    theirs.eval()
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 24)))
    a = ours(ids).numpy()
    out_t = theirs(ids)
    b = (out_t[0] if isinstance(out_t, (tuple, list)) else out_t).numpy()
    assert np.abs(a - b).max() <= 1e-4

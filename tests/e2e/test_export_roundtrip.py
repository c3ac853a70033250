"""A checkpoint written by a real tp2 run -> `python -m llmtrain.export` -> PaddleNLP loads it with our logits.

    python -m pytest tests/e2e/test_export_roundtrip.py -q
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from launch import REPO, env, run_many
from llmtest import tiny_overrides


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_tp2_checkpoint_exports_to_paddlenlp(arch, tiny_corpus, tmp_path):
    import paddle
    from paddlenlp.transformers import AutoModelForCausalLM

    from llmtrain.checkpoint.reader import read_model
    from llmtrain.models import build_model
    from llmtrain.models.stages import canonical_parameters
    from llmtrain.models.init import load_full_state

    run = tmp_path / "run"
    run_many([tiny_overrides(tiny_corpus, str(run), arch, steps=3) + ["+parallel=tp2", "checkpoint.save_final=true"]],
             nproc=2, workdir=tmp_path / "w")
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

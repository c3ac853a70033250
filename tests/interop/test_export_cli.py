"""`python -m llmtrain.export`: one of our checkpoints -> a PaddleNLP directory with our logits.

    python -m pytest tests/interop/test_export_cli.py -q

The checkpoint is written here in the on-disk format of `llmtrain/checkpoint` (rank
files + manifest with sizes and sha256), as two tensor-parallel ranks would write
it, so the test exercises reassembly without launching a training run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat

import pytest
from interop_helpers import assert_close, our_logits, paddlenlp_logits, random_state, token_ids
from safetensors.numpy import save_file

from llmtrain.checkpoint.listing import FORMAT
from llmtrain.export import main
from llmtrain.models.config import ModelConfig

# the real package (dev extra); a missing paddlenlp fails these tests rather than skipping them
from paddlenlp.transformers import AutoModelForCausalLM  # noqa: E402

CFG = ModelConfig(name="llama-t", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                  vocab_size=128, max_position_embeddings=64, position="rope", norm="rmsnorm", norm_eps=1e-6,
                  activation="swiglu", bias=False, tie_embeddings=False)
SPLIT = {"attn.q_proj.weight": 1, "mlp.down_proj.weight": 0}  # column / row split across the 2 "tp ranks"


def write_our_checkpoint(step_dir, cfg, state, tokenizer_sha=None):
    os.makedirs(step_dir)
    files = {}
    for rank in range(2):
        tensors, meta = {}, {}
        for name, full in state.items():
            axis = next((a for suffix, a in SPLIT.items() if name.endswith(suffix)), None)
            if axis is None and rank == 1:
                continue  # replicated: tp rank 0 writes it
            part = full if axis is None else full.take(range(rank * full.shape[axis] // 2,
                                                             (rank + 1) * full.shape[axis] // 2), axis=axis)
            key = f"model/{name}"
            tensors[key] = part
            meta[key] = {"name": name, "global_shape": list(full.shape), "axis": axis,
                         "offset": 0 if axis is None else rank * part.shape[axis]}
        stem = os.path.join(step_dir, f"rank_{rank:05d}")
        save_file(tensors, stem + ".safetensors")
        json.dump({"rank": rank, "tensors": meta}, open(stem + ".json", "w"))
    for name in sorted(os.listdir(step_dir)):
        data = open(os.path.join(step_dir, name), "rb").read()
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format": FORMAT, "step": 6, "model": dataclasses.asdict(cfg), "files": files,
                "tokenizer": {"sha256": tokenizer_sha} if tokenizer_sha else None}
    json.dump(manifest, open(os.path.join(step_dir, "manifest.json"), "w"))


def test_export_cli_from_run_directory(tmp_path, capsys):
    state = random_state(CFG, seed=4)
    write_our_checkpoint(str(tmp_path / "run" / "checkpoints" / "step_6"), CFG, state)
    os.makedirs(tmp_path / "run" / "checkpoints" / "step_9")  # an unfinished newer save: skipped
    out = str(tmp_path / "exported")
    old_umask = os.umask(0o027)  # the export follows the umask, as open() does (safetensors alone writes 0600)
    try:
        assert main(["--checkpoint", str(tmp_path / "run"), "--output", out, "--safetensors"]) == 0
    finally:
        os.umask(old_umask)
    assert "step_6" in capsys.readouterr().out
    modes = {p: stat.S_IMODE(os.stat(os.path.join(out, p)).st_mode) for p in os.listdir(out)}
    assert modes["model.safetensors"] == 0o640 and set(modes.values()) == {0o640}, modes
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o750
    ref = AutoModelForCausalLM.from_pretrained(out)
    ids = token_ids(CFG.vocab_size, seed=2)
    assert_close(our_logits(CFG, state, ids), paddlenlp_logits(ref, ids), "exported checkpoint")


def test_export_cli_refuses_corrupt_checkpoint_and_wrong_tokenizer(tmp_path, capsys):
    step = str(tmp_path / "step_6")
    write_our_checkpoint(step, CFG, random_state(CFG, seed=4), tokenizer_sha="0" * 64)
    tok = tmp_path / "tok"
    tok.mkdir()
    import sentencepiece as spm

    (tmp_path / "c.txt").write_text("人民日报 社论 今天 北京 天气\n" * 40, encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tok / "tokenizer"),
                                   vocab_size=16, minloglevel=2, byte_fallback=False)
    assert main(["--checkpoint", step, "--output", str(tmp_path / "o"), "--tokenizer", str(tok)]) == 2  # input errors: status 2
    assert "is not the one checkpoint" in capsys.readouterr().err

    with open(os.path.join(step, "rank_00001.safetensors"), "r+b") as f:
        f.truncate(100)
    assert main(["--checkpoint", step, "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "incomplete or corrupt" in err and "rank_00001.safetensors" in err
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("fmt", ["onnx", "gguf"])
def test_export_cli_unknown_format_is_rejected(fmt, tmp_path):
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(tmp_path), "--output", str(tmp_path / "o"), "--format", fmt])


@pytest.mark.parametrize("fmt", ["paddlenlp", "hf", "paddleformers"])
def test_exports_carry_the_special_ids_of_the_tokenizer_used(fmt, tmp_path, capsys):
    """The shipped tokenizer (`<pad>`=0 `<unk>`=1 `<s>`=2 `</s>`=3) gave DeepSeek exports bos 0 / eos 1, ERNIE 4.5
    pad 0 / bos 1 / eos 2 and the Hugging Face Llama exports none: every format now writes the tokenizer's ids,
    names the same pieces in the tokenizer files it ships, and without a tokenizer takes the recorded ids."""
    from llmtrain.interop.tokenizer_files import special_id_problems
    from llmtrain.tokenizer import load_tokenizer

    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "tokenizers", "pd1998-bpe16k")
    tok = load_tokenizer(shipped)
    cfg = dataclasses.replace(CFG, vocab_size=tok.vocab_size)
    step = str(tmp_path / "step_6")
    write_our_checkpoint(step, cfg, random_state(cfg, seed=4), tokenizer_sha=tok.sha256)
    manifest = json.load(open(os.path.join(step, "manifest.json")))
    manifest["tokenizer"] = tok.identity()  # what a training run records
    json.dump(manifest, open(os.path.join(step, "manifest.json"), "w"))
    want = {"bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0}
    for name, extra in (("with", ["--tokenizer", shipped]), ("without", [])):
        out = tmp_path / name
        assert main(["--checkpoint", step, "--output", str(out), "--format", fmt, "--safetensors", *extra]) == 0
        config = json.loads((out / "config.json").read_text())
        assert {k: config.get(k) for k in want} == want, (name, config)
        if name == "with":
            names = json.loads((out / "tokenizer_config.json").read_text())
            assert {k: names[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")} == \
                {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
            assert special_id_problems(str(out), config) == []
            config["eos_token_id"] = 1  # what the DeepSeek export used to write: the check catches it
            assert special_id_problems(str(out), config) == [
                "config.json eos_token_id=1 but the shipped tokenizer's eos id is 3",
                "config.json eos_token_id=1 is '<unk>' in the shipped tokenizer, but its tokenizer files name '</s>' "
                "as eos_token"]
    capsys.readouterr()

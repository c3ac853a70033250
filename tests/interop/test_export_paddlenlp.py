"""Export: our random-init decoder, written as a PaddleNLP checkpoint, loads with
`AutoModelForCausalLM.from_pretrained` and gives our logits; reading it back gives our model.

    python -m pytest tests/interop/test_export_paddlenlp.py -q
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from interop_helpers import assert_close, our_logits, paddlenlp_logits, random_state, token_ids

from llmtrain.interop import UnsupportedConfig, read_paddlenlp_checkpoint, write_paddlenlp_checkpoint
from llmtrain.models.config import ModelConfig

# the real package (dev extra); a missing paddlenlp fails these tests rather than skipping them
from paddlenlp.transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

GPT = dict(hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, vocab_size=128,
           max_position_embeddings=64, position="learned", norm="layernorm", norm_eps=1e-5,
           activation="gelu_tanh", bias=True, tie_embeddings=True)
LLAMA = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48, vocab_size=128,
             max_position_embeddings=64, position="rope", rope_theta=10000.0, norm="rmsnorm", norm_eps=1e-6,
             activation="swiglu", bias=False, tie_embeddings=False)

CASES = {
    "gpt": ModelConfig(name="gpt", **GPT),
    "gpt-no-bias": ModelConfig(name="gpt-no-bias", **{**GPT, "bias": False}),
    "gpt-post-norm": ModelConfig(name="gpt-post-norm", **{**GPT, "norm_position": "post"}),
    "llama-gqa": ModelConfig(name="llama-gqa", **LLAMA),
    "llama-mha-tied": ModelConfig(name="llama-mha-tied", **{**LLAMA, "num_kv_heads": None, "tie_embeddings": True,
                                                          "rope_theta": 500000.0, "norm_eps": 1e-5}),
}


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pdparams"])
@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_paddlenlp_with_our_logits(case, safe, tmp_path):
    cfg = CASES[case]
    state = random_state(cfg, seed=len(case))
    out = str(tmp_path / "export")
    info = write_paddlenlp_checkpoint(cfg, state, out, safetensors=safe)
    assert ("model.safetensors" if safe else "model_state.pdparams") in info["files"]

    ref = AutoModelForCausalLM.from_pretrained(out)
    assert type(ref).__name__ == ("GPTForCausalLM" if case.startswith("gpt") else "LlamaForCausalLM")
    ids = token_ids(cfg.vocab_size, seed=1)
    assert_close(our_logits(cfg, state, ids), paddlenlp_logits(ref, ids), case)

    # and back: the same model comes out (a bias-free GPT comes back with zero biases)
    cfg2, state2, _ = read_paddlenlp_checkpoint(out, trusted=True)
    expect = dataclasses.replace(cfg, name=cfg2.name, bias=True) if case == "gpt-no-bias" else \
        dataclasses.replace(cfg, name=cfg2.name)
    assert cfg2 == expect
    for name, arr in state2.items():
        want = state.get(name, np.zeros_like(arr))  # only the no-bias GPT's biases are absent from `state`
        assert np.array_equal(arr, want), name


def test_export_with_tokenizer_loads_in_paddlenlp(tmp_path):
    """Our SentencePiece tokenizer travels with the model; PaddleNLP's AutoTokenizer encodes as we do."""
    from llmtrain.tokenizer import load_tokenizer
    from llmtrain.tokenizer.train import train

    corpus = tmp_path / "corpus.txt"
    lines = ["人民日报社论：坚持改革开放，发展社会主义市场经济。", "今天北京天气晴，气温 12 度。",
             "Paddle and PaddleNLP 2.8.1 load this model.", "中华人民共和国成立于1949年。"]
    corpus.write_text("\n".join(lines * 50) + "\n", encoding="utf-8")
    tok_dir = str(tmp_path / "tok")
    train([str(corpus)], vocab_size=400, output=tok_dir)
    ours = load_tokenizer(tok_dir)

    cfg = dataclasses.replace(CASES["llama-gqa"], vocab_size=ours.vocab_size)
    out = str(tmp_path / "export")
    write_paddlenlp_checkpoint(cfg, random_state(cfg, 0), out, tokenizer_dir=tok_dir)
    theirs = AutoTokenizer.from_pretrained(out)
    for text in lines + ["没见过的字：龘", "emoji 🙂 and digits 2026"]:
        want = ours.encode(text)
        assert len(want) > 2 and theirs(text)["input_ids"] == want, text
    assert load_tokenizer(out).sha256 == ours.sha256
    model_cfg = AutoModelForCausalLM.from_pretrained(out).config
    assert (model_cfg.eos_token_id, model_cfg.bos_token_id) == (ours.eos_id, ours.bos_id)


def test_write_is_atomic_and_refuses_to_clobber(tmp_path):
    cfg = CASES["gpt"]
    state = random_state(cfg, 0)
    out = tmp_path / "export"
    write_paddlenlp_checkpoint(cfg, state, str(out))
    with pytest.raises(FileExistsError, match="overwrite"):
        write_paddlenlp_checkpoint(cfg, state, str(out))
    state2 = random_state(cfg, 1)
    write_paddlenlp_checkpoint(cfg, state2, str(out), overwrite=True)
    _, back, _ = read_paddlenlp_checkpoint(str(out))
    assert np.array_equal(back["embed.word.weight"], state2["embed.word.weight"])

    # a failure half-way (tokenizer does not exist) leaves neither the output nor a temporary directory
    with pytest.raises(FileNotFoundError):
        write_paddlenlp_checkpoint(cfg, state, str(tmp_path / "failed"), tokenizer_dir=str(tmp_path / "nope"))
    assert sorted(os.listdir(tmp_path)) == ["export"]


@pytest.mark.parametrize("change, field", [
    (dict(tie_embeddings=False), "tie_embeddings"),
    (dict(norm_eps=1e-6), "norm_eps"),
    (dict(activation="gelu"), "activation"),
    (dict(num_kv_heads=2), "num_kv_heads"),
])
def test_gpt_export_refuses_what_paddlenlp_gpt_cannot_compute(change, field, tmp_path):
    cfg = dataclasses.replace(CASES["gpt"], **change)
    with pytest.raises(UnsupportedConfig, match=f"model.{field}"):
        write_paddlenlp_checkpoint(cfg, {}, str(tmp_path / "x"))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("change, field", [
    (dict(bias=True), "bias"),
    (dict(norm_position="post"), "norm_position"),
    (dict(activation="gelu_tanh"), "activation"),
])
def test_llama_export_refuses_what_paddlenlp_llama_cannot_compute(change, field, tmp_path):
    cfg = dataclasses.replace(CASES["llama-gqa"], **change)
    with pytest.raises(UnsupportedConfig, match=f"model.{field}"):
        write_paddlenlp_checkpoint(cfg, {}, str(tmp_path / "x"))
    assert not os.listdir(tmp_path)


def test_state_may_be_paddle_tensors_of_any_float_dtype(tmp_path):
    """A live model's parameters (e.g. bf16 after AMP O2 decoration) export as their exact fp32 values."""
    import paddle

    cfg = CASES["llama-gqa"]
    state = {k: paddle.to_tensor(v).astype("bfloat16") for k, v in random_state(cfg, 0).items()}
    write_paddlenlp_checkpoint(cfg, state, str(tmp_path / "e"))
    _, back, _ = read_paddlenlp_checkpoint(str(tmp_path / "e"))
    for k, t in state.items():
        assert np.array_equal(back[k], t.astype("float32").numpy()), k

"""Export: our encoder, written as a PaddleNLP ERNIE directory, loads with `ErnieForMaskedLM.from_pretrained`
and gives our logits; an imported ERNIE goes back out with its WordPiece tokenizer.

    python -m pytest tests/interop/test_ernie_export.py -q

Also pins what a PaddleNLP ERNIE tokenizer directory holds and that `AutoTokenizer` loads it
from the local directory (the data path tokenizes continued-pretraining text with it).
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import paddle
import pytest
from interop_helpers import assert_close, random_state, randomize_paddlenlp
from test_ernie_import import compare_all, ernie_config, inputs, ours_from, ours_logits, theirs_logits

from llmtrain.interop import UnsupportedConfig, read_paddlenlp_checkpoint, write_paddlenlp_checkpoint
from llmtrain.interop.ernie import paddlenlp_default_mask
from llmtrain.interop.keys import model_shapes
from llmtrain.models.config import ModelConfig

# the real package (dev extra); a missing paddlenlp fails these tests rather than skipping them
from paddlenlp.transformers import AutoTokenizer, ErnieForMaskedLM, ErnieTokenizer  # noqa: E402

ENC = dict(family="encoder", hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, vocab_size=64,
           max_position_embeddings=64, position="learned", norm="layernorm", norm_eps=1e-12, norm_position="post",
           activation="gelu", bias=True, type_vocab_size=4, task_type_vocab_size=0, pad_token_id=0,
           tie_embeddings=True)
CASES = {
    "tiny": ModelConfig(name="tiny", **ENC),
    "task-id-untied": ModelConfig(name="task-id-untied", **{**ENC, "task_type_vocab_size": 3, "task_id": 2,
                                                            "tie_embeddings": False}),
    "no-bias-no-types": ModelConfig(name="no-bias-no-types", **{**ENC, "bias": False, "type_vocab_size": 0}),
}
# special tokens first, as ERNIE vocabularies have them ([PAD]=0); Chinese characters, English word pieces
VOCAB = ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"] \
    + list("人民日报社论坚持改革开放发展经济中华共和国成立年北京天气") \
    + ["的", "，", "。", "paddle", "##nl", "##p", "load", "##s", "this", "model", "1949", "12"]


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pdparams"])
@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_paddlenlp_with_our_logits(case, safe, tmp_path):
    cfg = CASES[case]
    state = random_state(cfg, seed=len(case))
    out = str(tmp_path / "export")
    info = write_paddlenlp_checkpoint(cfg, state, out, safetensors=safe)
    assert info["family"] == "ernie" and any("pooler" in n for n in info["notes"])
    c = json.load(open(os.path.join(out, "config.json")))
    assert c["architectures"] == ["ErnieForMaskedLM"] and c["model_type"] == "ernie"

    ref = ErnieForMaskedLM.from_pretrained(out)
    ids, types, padded = inputs(cfg, seed=1)
    ours = ours_from(cfg, state)
    assert_close(ours_logits(ours, ids, types), theirs_logits(ref, ids, types), f"{case} export")
    mask = paddlenlp_default_mask(padded, cfg.pad_token_id)
    assert_close(ours_logits(ours, padded, types, mask), theirs_logits(ref, padded, types), f"{case} export padded")

    # and back: the same model (a bias-free one comes back with zero linear biases)
    cfg2, state2, _ = read_paddlenlp_checkpoint(out, trusted=True)
    assert cfg2 == dataclasses.replace(cfg, name=cfg2.name, bias=True)
    assert state2.keys() == model_shapes(cfg2).keys()
    for name, arr in state2.items():
        assert np.array_equal(arr, state.get(name, np.zeros_like(arr))), name


def test_paddlenlp_round_trip_with_wordpiece_tokenizer(tmp_path):
    """PaddleNLP ERNIE + its tokenizer -> our encoder -> export -> PaddleNLP: equal logits, same tokens."""
    src = tmp_path / "ernie"
    (tmp_path / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    tok = ErnieTokenizer(vocab_file=str(tmp_path / "vocab.txt"))
    ref = ErnieForMaskedLM(ernie_config(vocab_size=64, use_task_id=True, task_type_vocab_size=3, task_id=1))
    randomize_paddlenlp(ref, seed=21)
    ref.save_pretrained(str(src), safe_serialization=True)
    tok.save_pretrained(str(src))
    # what a PaddleNLP ERNIE directory holds (the data path supports exactly these)
    assert sorted(os.listdir(src)) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                       "tokenizer_config.json", "vocab.txt"]
    assert json.load(open(src / "tokenizer_config.json"))["tokenizer_class"] == "ErnieTokenizer"

    loaded = AutoTokenizer.from_pretrained(str(src))  # local directory, no network
    assert type(loaded).__name__ == "ErnieTokenizer"
    text = "人民日报社论：坚持改革开放，发展经济。Paddle loads this model in 1949"
    enc = loaded(text)
    assert enc["input_ids"] == tok(text)["input_ids"] and enc["input_ids"][0] == VOCAB.index("[CLS]")
    assert VOCAB.index("[UNK]") in enc["input_ids"]  # "：" is not in the tiny vocabulary

    cfg, state, meta = read_paddlenlp_checkpoint(str(src))
    assert meta["wordpiece_vocab"] == str(src / "vocab.txt")
    out = str(tmp_path / "out")
    write_paddlenlp_checkpoint(cfg, state, out, tokenizer_dir=str(src))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                       "tokenizer_config.json", "vocab.txt"]
    assert (tmp_path / "out" / "vocab.txt").read_bytes() == (src / "vocab.txt").read_bytes()
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == enc["input_ids"]

    back = ErnieForMaskedLM.from_pretrained(out)
    ids = paddle.to_tensor([enc["input_ids"]], dtype="int64")
    assert_close(theirs_logits(back, ids), theirs_logits(ref, ids), "PaddleNLP -> ours -> PaddleNLP")
    compare_all(cfg, state, back, "re-exported")


def test_tokenizer_without_class_gets_one_and_mismatches_are_refused(tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")  # a bare vocabulary
    cfg = CASES["tiny"]
    state = random_state(cfg, 0)
    write_paddlenlp_checkpoint(cfg, state, str(tmp_path / "a"), tokenizer_dir=str(tok_dir))
    assert json.load(open(tmp_path / "a" / "tokenizer_config.json"))["tokenizer_class"] == "ErnieTokenizer"
    assert type(AutoTokenizer.from_pretrained(str(tmp_path / "a"))).__name__ == "ErnieTokenizer"

    with pytest.raises(UnsupportedConfig, match=r"padding token '\[PAD\]' has id 0 but model.pad_token_id=3"):
        write_paddlenlp_checkpoint(dataclasses.replace(cfg, pad_token_id=3), state, str(tmp_path / "b"),
                                   tokenizer_dir=str(tok_dir))
    small = dataclasses.replace(cfg, vocab_size=32)
    with pytest.raises(UnsupportedConfig, match=f"{len(VOCAB)} tokens but the model's embedding has only 32"):
        write_paddlenlp_checkpoint(small, random_state(small, 0), str(tmp_path / "c"), tokenizer_dir=str(tok_dir))
    assert sorted(os.listdir(tmp_path)) == ["a", "tok"]  # failures leave nothing behind


@pytest.mark.parametrize("change, field", [
    (dict(norm_position="pre"), "norm_position"),
    (dict(norm_eps=1e-5), "norm_eps"),
    (dict(activation="gelu_tanh"), "activation"),
    (dict(num_kv_heads=2), "num_kv_heads"),
    (dict(norm="rmsnorm"), "norm"),
    (dict(task_type_vocab_size=3, task_id=3), "task_id"),
])
def test_export_refuses_what_paddlenlp_ernie_cannot_compute(change, field, tmp_path):
    cfg = dataclasses.replace(CASES["tiny"], **change)
    with pytest.raises(UnsupportedConfig, match=f"model.{field}=") as e:
        write_paddlenlp_checkpoint(cfg, {}, str(tmp_path / "x"))
    assert "PaddleNLP ERNIE" in str(e.value)
    assert not os.listdir(tmp_path)


def test_export_with_our_sentencepiece_tokenizer(tmp_path):
    """An encoder pretrained with our SentencePiece tokenizer ships it as PaddleNLP's SentencePiece wrapper;
    its padding id must be the model's pad_token_id."""
    from llmtrain.tokenizer import load_tokenizer
    from llmtrain.tokenizer.train import train

    lines = ["人民日报社论：坚持改革开放，发展社会主义市场经济。", "今天北京天气晴，气温 12 度。",
             "中华人民共和国成立于1949年。"]
    (tmp_path / "corpus.txt").write_text("\n".join(lines * 50) + "\n", encoding="utf-8")
    tok_dir = str(tmp_path / "tok")
    train([str(tmp_path / "corpus.txt")], vocab_size=360, output=tok_dir)
    ours = load_tokenizer(tok_dir)
    cfg = dataclasses.replace(CASES["tiny"], vocab_size=ours.vocab_size, pad_token_id=ours.pad_id)
    state = random_state(cfg, 3)
    write_paddlenlp_checkpoint(cfg, state, str(tmp_path / "out"), tokenizer_dir=tok_dir)
    c = json.load(open(tmp_path / "out" / "config.json"))
    assert c["pad_token_id"] == ours.pad_id and c["architectures"] == ["ErnieForMaskedLM"]
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    for text in lines:
        assert theirs(text)["input_ids"] == ours.encode(text), text
    ids, types, _ = inputs(cfg, seed=2)
    assert_close(ours_logits(ours_from(cfg, state), ids, types),
                 theirs_logits(ErnieForMaskedLM.from_pretrained(str(tmp_path / "out")), ids, types), "sp export")

    with pytest.raises(UnsupportedConfig, match=f"padding id {ours.pad_id} but model.pad_token_id=7"):
        write_paddlenlp_checkpoint(dataclasses.replace(cfg, pad_token_id=7), state, str(tmp_path / "bad"),
                                   tokenizer_dir=tok_dir)
    assert not (tmp_path / "bad").exists()

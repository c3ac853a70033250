"""Word-start flags that masking reads: jieba segmentation, and PaddleNLP WordPiece tokenizers.

    python -m pytest tests/data/test_masking_words.py -q

`preprocess --word-boundaries jieba` flags must group tokens into runs of jieba's words; a
PaddleNLP ERNIE tokenizer directory (vocab.txt) must load through `load_tokenizer`, preprocess,
and give flags at its own (character) tokens, with whitespace dropped and case folded.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from llmtrain.corpus.parse import ParseOptions
from llmtrain.data.indexed import IndexedDataset
from llmtrain.data.preprocess import preprocess
from llmtrain.tokenizer import load_tokenizer


def doc_groups(ds, d):
    """Token ids and flag-delimited groups [(a, b)] of document d (EOD excluded)."""
    s, n = int(ds.starts[d]), int(ds.sizes[d])
    ids, flags = np.asarray(ds.tokens[s:s + n]), np.asarray(ds.side("wbd")[s:s + n])
    bounds = list(np.nonzero(flags[:-1])[0]) + [n - 1]
    return ids, list(zip(bounds[:-1], bounds[1:]))


def test_jieba_word_boundaries_group_tokens_into_jieba_words(tiny_corpus, tmp_path):
    import jieba

    from llmtrain.corpus.peoples_daily import records

    recs = list(records(limit=12))
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": r["text"]}, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    prefix = str(tmp_path / "jieba_text_document")
    preprocess([str(src)], tiny_corpus["tokenizer"], prefix, workers=0, word_boundaries="jieba", progress=False)
    ds, tok = IndexedDataset(prefix), load_tokenizer(tiny_corpus["tokenizer"])
    for d, r in enumerate(recs):
        ids, groups = doc_groups(ds, d)
        words = jieba.lcut(r["text"])
        assert len(groups) > 0.5 * len(words)  # most jieba words start at a token start
        for a, b in groups:
            text, got = tok.decode(ids[a:b]), ""
            while len(got) < len(text):
                got += words.pop(0)
            assert got == text, (d, text, got)
        assert not words


VOCAB = ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]", *"人民日报社论迈向新世纪江泽民在北京讲话，。", "abc", "de", "##f", "1998",
         "年"]


@pytest.fixture(scope="module")
def ernie_tokenizer_dir(tmp_path_factory):
    """A real PaddleNLP WordPiece tokenizer directory (save_pretrained of ErnieTokenizer)."""
    from paddlenlp.transformers import ErnieTokenizer

    out = tmp_path_factory.mktemp("ernie_tok")
    (out / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    ErnieTokenizer(vocab_file=str(out / "vocab.txt")).save_pretrained(str(out))
    return out


def test_wordpiece_directory_behind_the_tokenizer_interface(ernie_tokenizer_dir):
    from paddlenlp.transformers import AutoTokenizer

    tok = load_tokenizer(ernie_tokenizer_dir)
    theirs = AutoTokenizer.from_pretrained(str(ernie_tokenizer_dir))
    text = "人民日报社论 ABC deF，江泽民在北京讲话。1998年"
    ids = tok.encode(text)
    assert ids == theirs(text, add_special_tokens=False)["input_ids"]
    assert [tok.id_to_piece(i) for i in ids] == ["人", "民", "日", "报", "社", "论", "abc", "de", "##f", "，", "江",
                                                 "泽", "民", "在", "北", "京", "讲", "话", "。", "1998", "年"]
    assert (tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id, tok.unk_id) == (0, 1, 2, 3, 4)
    assert tok.eod_id == tok.sep_id and tok.bos_id == tok.cls_id and sorted(tok.special_ids) == [0, 1, 2, 3, 4]
    assert tok.sp_vocab_size == len(VOCAB) and tok.vocab_size == 128  # no config.json: padded like ours
    # byte offsets of each token in the text: whitespace dropped, case folded, ## pieces inside words
    starts = tok.byte_starts(text, ids)
    want = [len(text[:text.index(c)].encode()) for c in "人民日报社论"]
    assert list(starts[:6]) == want and starts[6] == len("人民日报社论 ".encode())
    assert starts[8] == len("人民日报社论 ABC de".encode())
    assert tok.decode(tok.encode("江泽民")) == "江 泽 民"  # PaddleNLP's own detokenisation
    assert len(tok.sha256) == 64 and tok.identity()["model_type"] == "wordpiece"


def test_wordpiece_preprocess_with_gold_words_flags_word_starts(ernie_tokenizer_dir, tmp_path):
    words = ["人民日报", "社论", " ", "ABC", " ", "deF", "，", "江泽民", "在", "北京", "讲话", "。", "1998年"]
    src = tmp_path / "gold.jsonl"
    src.write_text(json.dumps({"text": "".join(words), "words": words}, ensure_ascii=False) + "\n", encoding="utf-8")
    prefix = str(tmp_path / "wp_text_document")
    preprocess([str(src)], str(ernie_tokenizer_dir), prefix, workers=0, opt=ParseOptions(words_key="words"),
               word_boundaries="gold", progress=False)
    ds = IndexedDataset(prefix)
    tok = load_tokenizer(ernie_tokenizer_dir)
    assert ds.tokens.dtype == np.uint16 and int(ds.tokens[-1]) == tok.sep_id
    flags = list(np.asarray(ds.side("wbd")))
    # 人 民 日 报 | 社 论 | abc | de ##f | ， | 江 泽 民 | 在 | 北 京 | 讲 话 | 。 | 1998 年 | [SEP]
    assert flags == [1, 0, 0, 0, 1, 0, 1, 1, 0, 1, 1, 0, 0, 1, 1, 0, 1, 0, 1, 1, 0, 1]
    meta = json.load(open(prefix + ".meta.json"))
    assert meta["tokenizer"]["model_type"] == "wordpiece" and meta["tokenizer"]["sha256"] == tok.sha256


def test_wordpiece_vocab_size_follows_a_model_config_beside_it(ernie_tokenizer_dir, tmp_path):
    import shutil

    d = tmp_path / "with_model"
    shutil.copytree(ernie_tokenizer_dir, d)
    (d / "config.json").write_text(json.dumps({"vocab_size": 40}))
    assert load_tokenizer(d).vocab_size == 40
    (d / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ValueError, match=f"vocab_size=10 is smaller than the tokenizer's {len(VOCAB)} ids"):
        load_tokenizer(d)

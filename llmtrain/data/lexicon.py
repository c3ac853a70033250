"""Phrase / entity lexicons for ERNIE-style entity masking, matched on token spans.

    python -m llmtrain.data.lexicon --input work/pd1998/pd1998.jsonl --pos-key pos --output work/pd1998/entities.txt
    python -m llmtrain.data.lexicon --input corpus.jsonl --output entities.txt        # jieba.posseg tags
    python -m llmtrain.data.lexicon --tokenizer work/pd1998/tokenizer --source jieba  # what masking would load

Where entries come from (``data.masking.entity_source``):
- ``jieba``: the words of jieba's dictionary whose tag is one of ``data.masking.entity_tags``
  (nr person, ns place, nt organisation): what ``jieba.posseg`` tags them when it finds them by
  dictionary lookup. Names outside the dictionary, which posseg tags through its HMM, are not in it;
  to have those, build a file from the corpus with this command (it runs ``jieba.posseg``, or reads
  gold tags with ``--pos-key``) and pass it as ``data.masking.lexicon``.
- ``lexicon``: a user file, one entry per line (the first whitespace-separated field, so jieba's
  ``word freq tag`` dictionaries work as they are; a line starting with ``#`` is a comment).

Matching (:meth:`SpanLexicon.match`): every entry is tokenized on its own; a span of a sample
matches when its token ids are those of an entry, it starts at a word start and ends at a word
boundary (so whole-word integrity holds), and it holds no special token. Spans are compared by a
64-bit polynomial hash of their ids (a bitmap of hash prefixes, then ``np.searchsorted`` in a sorted
table per length), so a batch costs a few array operations per entry length. Overlaps keep the
longest span, then the leftmost. An entry whose standalone tokenization differs from its tokenization
in context (BPE merges across its edges) does not match there; with WordPiece (one token per Chinese
character) every occurrence matches. Building the lexicon tokenizes every entry once per process:
about 0.5 s for jieba's 95,000 names with SentencePiece, 3.5 s with PaddleNLP's Python WordPiece.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

_BASE = np.uint64(0x100000001B3)  # odd multiplier of the polynomial hash


def _read_lines(path: str) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(line.split()[0])
    return out


def jieba_entries(tags) -> list[str]:
    """Words of jieba's dictionary whose part-of-speech tag is in ``tags``."""
    import jieba

    want = set(tags)
    out = []
    with jieba.get_dict_file() as f:
        for raw in f:
            parts = raw.decode("utf-8").split()
            if len(parts) >= 3 and parts[2] in want:
                out.append(parts[0])
    return out


def load_entries(source: str, path: str | None, tags) -> list[str]:
    """Entries for ``data.masking.entity_source`` (``jieba``, ``lexicon`` or ``both``), de-duplicated."""
    entries: list[str] = []
    if source in ("jieba", "both"):
        entries += jieba_entries(tags)
    if source in ("lexicon", "both"):
        from llmtrain.utils.paths import resolve_path

        full = resolve_path(path)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"data.masking.lexicon={path}: {full} does not exist; build one with "
                                    "`python -m llmtrain.data.lexicon --input CORPUS --output FILE`")
        entries += _read_lines(full)
        if not entries:
            raise ValueError(f"data.masking.lexicon={path}: no entry in {full}")
    return list(dict.fromkeys(entries))


def _hash_rows(ids: np.ndarray) -> np.ndarray:
    """[k, L] ids -> [k] uint64 polynomial hashes (wrapping); ids shifted by 1 so 0 counts."""
    h = np.zeros(len(ids), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(ids.shape[1]):
            h = h * _BASE + (ids[:, j].astype(np.uint64) + np.uint64(1))
    return h


class SpanLexicon:
    """Token-id sequences of lexicon entries, by length, matched against batches of samples."""

    def __init__(self, entries: list[str], tokenizer, max_tokens: int = 16, source: str = "lexicon"):
        self.source = source
        self.n_entries = len(entries)
        encoded = tokenizer.encode_batch(list(entries)) if entries else []
        by_len: dict[int, list] = {}
        for ids in encoded:
            if 2 <= len(ids) <= max_tokens:  # one token is at most one word: already a unit
                by_len.setdefault(len(ids), []).append(ids)
        self.tables = {n: np.unique(_hash_rows(np.asarray(v, dtype=np.int64))) for n, v in sorted(by_len.items())}
        # per length, a bitmap of ~16 slots per entry indexed by the top hash bits: most windows that are
        # not entries are rejected by one lookup, before the binary search in the sorted table
        self.filters = {}
        for n, table in self.tables.items():
            bits = max(10, int(np.ceil(np.log2(16 * len(table)))))
            seen = np.zeros(1 << bits, dtype=bool)
            seen[(table >> np.uint64(64 - bits)).astype(np.int64)] = True
            self.filters[n] = (np.uint64(64 - bits), seen)
        self.n_spans = sum(len(t) for t in self.tables.values())
        self.sha256 = hashlib.sha256("\n".join(entries).encode("utf-8")).hexdigest()

    def describe(self) -> str:
        lens = ", ".join(f"{n}:{len(t)}" for n, t in self.tables.items())
        return f"{self.source}: {self.n_entries} entries, {self.n_spans} of 2+ tokens (by length {lens})"

    def match(self, tokens: np.ndarray, starts: np.ndarray, maskable: np.ndarray) -> list[tuple[int, int, int]]:
        """Non-overlapping (row, start, length) spans of ``tokens`` [m, S] that are lexicon entries,
        start where ``starts`` [m, S] is True, end before a start or at the end, and are all ``maskable``."""
        m, S = tokens.shape
        if not self.tables:
            return []
        bad = np.zeros((m, S + 1), dtype=np.int64)
        np.cumsum(~maskable, axis=1, out=bad[:, 1:])  # [m, S + 1] unmaskable tokens before each position
        ends = np.concatenate([starts[:, 1:], np.ones((m, 1), dtype=bool)], axis=1)  # [m, S] a unit ends here
        t = tokens.astype(np.uint64) + np.uint64(1)  # [m, S]
        h = np.zeros((m, S), dtype=np.uint64)  # [m, S - n + 1] hash of the n-token window at each start
        found = []
        longest = max(self.tables)
        with np.errstate(over="ignore"):
            for n in range(1, min(longest, S) + 1):
                width = S - n + 1
                h = h[:, :width] * _BASE + t[:, n - 1:]
                table = self.tables.get(n)
                if table is None:
                    continue
                # spans that could be whole units: begin at a word start, end at a boundary, no special
                ok = starts[:, :width] & ends[:, n - 1:] & ((bad[:, n:] - bad[:, :width]) == 0)  # [m, width]
                shift, seen = self.filters[n]
                ok &= seen[(h >> shift).astype(np.int64)]
                r, a = np.nonzero(ok)
                q = h[r, a]  # [candidates] window hashes
                idx = np.minimum(np.searchsorted(table, q), len(table) - 1)
                hit = table[idx] == q
                found += [(int(n), int(i), int(j)) for i, j in zip(r[hit], a[hit])]
        found.sort(key=lambda x: (x[1], -x[0], x[2]))  # per row: longest first, then leftmost
        taken = np.zeros((m, S), dtype=bool)
        out = []
        for n, r, a in found:
            if not taken[r, a:a + n].any():
                taken[r, a:a + n] = True
                out.append((r, a, n))
        return out


def build_lexicon(cfg, tokenizer) -> SpanLexicon:
    """The :class:`SpanLexicon` of a ``data.masking`` section."""
    entries = load_entries(cfg.entity_source, cfg.lexicon, cfg.entity_tags)
    return SpanLexicon(entries, tokenizer, cfg.max_entity_tokens, source=cfg.entity_source)


# ---------------------------------------------------------------- building a lexicon file
def tagged_entities(records, tags, pos_key: str | None, words_key: str, text_key: str) -> dict[str, int]:
    """Counts of the words tagged with one of ``tags``: gold tags (``pos_key``) or ``jieba.posseg``."""
    want = set(tags)
    counts: dict[str, int] = {}
    cut = None
    if pos_key is None:
        import jieba
        import jieba.posseg

        jieba.setLogLevel(60)
        cut = jieba.posseg.cut
    for rec in records:
        if pos_key is not None:
            pairs = zip(rec[words_key], rec[pos_key])
        else:
            pairs = ((p.word, p.flag) for p in cut(rec[text_key]))
        for w, tag in pairs:
            w = w.strip()
            if tag in want and len(w) > 1 and not any(ch.isspace() for ch in w):
                counts[w] = counts.get(w, 0) + 1
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmtrain.data.lexicon", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="*", default=[], help="jsonl files to collect tagged entities from")
    p.add_argument("--output", help="lexicon file to write (entry, count, tag-set; most frequent first)")
    p.add_argument("--tags", nargs="+", default=["nr", "ns", "nt"], help="part-of-speech tags taken as entities")
    p.add_argument("--pos-key", default=None, help="jsonl field with gold tags (with --words-key); else jieba.posseg")
    p.add_argument("--words-key", default="words")
    p.add_argument("--text-key", default="text")
    p.add_argument("--min-count", type=int, default=1)
    p.add_argument("--tokenizer", default=None, help="report how the entries tokenize (with --source)")
    p.add_argument("--source", default="jieba", choices=["jieba", "lexicon", "both"])
    p.add_argument("--lexicon", default=None, help="lexicon file for --source lexicon|both")
    a = p.parse_args(argv)
    if a.input:
        if not a.output:
            p.error("--input needs --output")

        def records():
            for path in a.input:
                with open(path, encoding="utf-8") as f:
                    for line in f:
                        if line.strip():
                            yield json.loads(line)

        counts = tagged_entities(records(), a.tags, a.pos_key, a.words_key, a.text_key)
        kept = sorted(((w, c) for w, c in counts.items() if c >= a.min_count), key=lambda x: (-x[1], x[0]))
        with open(a.output, "w", encoding="utf-8") as f:
            f.write(f"# entities tagged {' '.join(a.tags)} ({'gold ' + a.pos_key if a.pos_key else 'jieba.posseg'})"
                    f" in {' '.join(a.input)}\n")
            for w, c in kept:
                f.write(f"{w}\t{c}\n")
        print(f"{a.output}: {len(kept)} entries", file=sys.stderr)
    if a.tokenizer:
        from llmtrain.tokenizer import load_tokenizer

        tok = load_tokenizer(a.tokenizer)
        lex = SpanLexicon(load_entries(a.source, a.lexicon or a.output, a.tags), tok, source=a.source)
        print(lex.describe())
    if not a.input and not a.tokenizer:
        p.error("give --input (build a file) and/or --tokenizer (report)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

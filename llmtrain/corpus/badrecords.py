"""Bad-record accounting shared by ingestion, tokenizer training and preprocessing.

    python -m llmtrain.corpus.documents PATH [PATH ...]   # prints the report of every bad record

    bad = BadRecords(strict=False)
    bad.add("malformed_json", "data/a.jsonl", 17, "Expecting ',' delimiter")
    print(bad.report())

A bad record never crashes a run and is never dropped silently: it is counted by
kind, the first few locations (``file:line``) of each kind are kept, and the
final report lists them. With ``strict=True`` the first one raises
:class:`BadRecordError` naming its file and line.
"""

from __future__ import annotations

from collections import Counter

KINDS = {
    "invalid_utf8": "bytes that are not valid UTF-8 (or a lone surrogate escape)",
    "malformed_json": "a line that is not valid JSON",
    "not_an_object": "a JSON value that is not an object",
    "missing_field": "the text field is absent (or null)",
    "non_string_field": "the text field is not a string",
    "nul_byte": "the text contains a NUL character",
    "empty": "the document is empty or whitespace only",
    "blank_line": "a blank line in a JSON-lines file",
    "words_mismatch": "the word list does not join to the text (word-boundary mode)",
    "duplicate": "an exact duplicate of an earlier document (only with dedup on)",
}
N_EXAMPLES = 5


class BadRecordError(ValueError):
    """Raised in strict mode at the first bad record."""

    def __init__(self, kind: str, location: str, detail: str = ""):
        self.kind, self.location, self.detail = kind, location, detail
        msg = f"{location}: bad record ({kind}: {KINDS.get(kind, kind)})"
        super().__init__(msg + (f": {detail}" if detail else ""))


class BadRecords:
    """Counts bad records by kind and remembers the first ``N_EXAMPLES`` places of each."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}

    def add(self, kind: str, label: str, line: int, detail: str = "") -> None:
        if kind not in KINDS:
            raise KeyError(f"unknown bad-record kind {kind!r}; known: {sorted(KINDS)}")
        location = f"{label}:{line}"
        if self.strict and kind != "duplicate":
            raise BadRecordError(kind, location, detail)
        self.counts[kind] += 1
        ex = self.examples.setdefault(kind, [])
        if len(ex) < N_EXAMPLES:
            ex.append(location + (f" ({detail})" if detail else ""))

    def update(self, other: "BadRecords") -> None:
        for kind, n in other.counts.items():
            self.counts[kind] += n
            ex = self.examples.setdefault(kind, [])
            ex.extend(other.examples.get(kind, [])[: N_EXAMPLES - len(ex)])

    @property
    def total(self) -> int:
        return sum(n for k, n in self.counts.items() if k != "duplicate")

    def to_dict(self) -> dict:
        return {"total": self.total, "counts": dict(sorted(self.counts.items())),
                "first": {k: v for k, v in sorted(self.examples.items())}}

    def report(self) -> str:
        if not self.counts:
            return "bad records: none"
        lines = [f"bad records: {self.total}" + (f" (+{self.counts['duplicate']} duplicates removed)"
                                                  if self.counts.get("duplicate") else "")]
        for kind, n in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {kind:<17} {n:>10}  {KINDS[kind]}")
            lines.extend(f"      at {loc}" for loc in self.examples.get(kind, []))
        return "\n".join(lines)

"""Optional text normalisation (NFKC, full-width ASCII, control characters) and dedup fingerprints.

    python -m llmtrain.data.preprocess ... --nfkc --fullwidth-ascii --strip-control --dedup

All normalisation is off by default: the tokenizer is trained with the identity
normalisation rule so that ``decode(encode(text)) == text`` holds exactly, and
whatever is normalised must be normalised the same way at preprocessing time.
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass

# U+FF01..U+FF5E (full-width ASCII) -> U+0021..U+007E; U+3000 ideographic space -> " "
_FULLWIDTH = {cp: cp - 0xFEE0 for cp in range(0xFF01, 0xFF5F)}
_FULLWIDTH[0x3000] = 0x20
# C0/C1 control characters except tab and newline; carriage return is dropped too
_CONTROL = {cp: None for cp in list(range(0x00, 0x20)) + [0x7F] + list(range(0x80, 0xA0))
            if cp not in (0x09, 0x0A)}


@dataclass(frozen=True)
class Normalizer:
    """Which normalisations to apply, in this order: NFKC, full-width -> ASCII, control chars."""

    nfkc: bool = False
    """Unicode NFKC (compatibility forms folded; also folds full-width ASCII)."""
    fullwidth_ascii: bool = False
    """Full-width ASCII letters, digits, punctuation and U+3000 become half-width ASCII."""
    strip_control: bool = False
    """Remove C0/C1 control characters other than tab and newline."""

    @property
    def active(self) -> bool:
        return self.nfkc or self.fullwidth_ascii or self.strip_control

    def __call__(self, text: str) -> str:
        if self.nfkc:
            text = unicodedata.normalize("NFKC", text)
        if self.fullwidth_ascii:
            text = text.translate(_FULLWIDTH)
        if self.strip_control:
            text = text.translate(_CONTROL)
        return text


def fingerprint(data: bytes) -> int:
    """64-bit BLAKE2b fingerprint of a document's UTF-8 bytes (exact-duplicate detection)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

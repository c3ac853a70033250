"""Masked-LM corruption (BERT / ERNIE knowledge masking), deterministic per (seed, global sample id).

    python llmtrain/pretrain.py model=ernie-tiny data.masking.strategy=ngram data.masking.max_ngram=4

    masker = Masker(cfg.data.masking, tokenizer, seed=cfg.seed)
    out = masker(tokens, sample_ids, word_starts)   # tokens [m, S] int64, sample_ids [m] int64,
                                                    # word_starts [m, S] (1 where a token starts a word)
    out.input_ids   # [m, S] int64 corrupted input
    out.labels      # [m, S] int64 original tokens
    out.loss_mask   # [m, S] float32, 1 at the selected positions (the only loss-bearing tokens)

How a batch is masked (a few numpy calls over the whole [m, S] array, no loop over tokens):

1. Maskable tokens: all but special tokens (pad, unk, bos/cls, eos/sep, mask, eod and any other
   special id of the tokenizer) and ids beyond the tokenizer's pieces (vocabulary padding rows).
   Unknown tokens are not targets: predicting ``[UNK]`` teaches nothing.
2. Units, the groups masked together: single tokens (``token``); words, a unit starting at each
   token whose word-start flag is 1 (``whole_word``); random segments of 1..max_ngram words,
   P(n) proportional to 1/n (``ngram``); lexicon phrases / entities, matched on token spans that
   begin and end at word boundaries, plus the other words (``entity``,
   :mod:`llmtrain.data.lexicon`). A special token is a unit of its own, so no unit crosses one;
   the first token of a sample always starts a unit (a packed sample may begin inside a word).
3. Budget: ``B = max(1, round(prob x maskable))`` tokens per sample, so every sample bears loss.
4. Selection: the units in a random order; the longest prefix of that order whose lengths add up
   to at most ``B``, then, while tokens are left, the first later unit that fits what is left. A
   unit is taken whole or not at all; the count falls short of ``B`` only when no unit is small
   enough (never for ``token``; rarely, by a token or two, with long units).
5. Corruption per selected token: ``[MASK]`` with ``mask_token_prob``, a random ordinary token
   with ``random_token_prob``, else unchanged (BERT's 80/10/10, per token also in whole-word mode,
   as Google's and PaddleNLP's whole-word masking do).

Randomness is a counter-based hash (splitmix64) of (seed, stream, split, sample id, position):
there is no generator state, so any data-parallel size, micro-batch size, prefetch or resume gives
the same masks for the same global sample. Validation samples use other streams than training
samples with the same id.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STRATEGIES = ("token", "whole_word", "ngram", "entity")
ENTITY_SOURCES = ("jieba", "lexicon", "both")
SPECIAL_ATTRS = ("pad_id", "unk_id", "bos_id", "eos_id", "mask_id", "eod_id", "cls_id", "sep_id")

# hash streams: which random quantity a hash value feeds
_ORDER, _REPLACE, _RANDOM_ID, _NGRAM = 1, 2, 3, 4
_SPLIT_SALT = {"train": 0, "valid": 1 << 8, "test": 2 << 8}

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def position_hash(seed: int, stream: int, sample_ids: np.ndarray, length: int) -> np.ndarray:
    """[m, length] uint64: a hash of (seed, stream, sample id, position) for every position of every sample."""
    with np.errstate(over="ignore"):
        key = _mix(np.array([seed & (2**64 - 1)], dtype=np.uint64) * _GOLDEN + np.uint64(stream))  # [1]
        per_sample = _mix(np.asarray(sample_ids, dtype=np.int64).astype(np.uint64) ^ key)  # [m]
        pos = (np.arange(1, length + 1, dtype=np.uint64) * _GOLDEN)[None, :]  # [1, length]
        return _mix(per_sample[:, None] + pos)  # [m, length]


def uniform(seed: int, stream: int, sample_ids: np.ndarray, length: int) -> np.ndarray:
    """[m, length] float64 in [0, 1) from :func:`position_hash` (53 random bits)."""
    return (position_hash(seed, stream, sample_ids, length) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


@dataclass
class MaskedBatch:
    input_ids: np.ndarray  # [m, S] int64, corrupted
    labels: np.ndarray  # [m, S] int64, the original tokens
    loss_mask: np.ndarray  # [m, S] float32, 1 at selected positions


def check_masking_config(cfg) -> list[str]:
    """Problems of a ``data.masking`` section, each naming the field and its value."""
    bad = []
    if cfg.strategy not in STRATEGIES:
        bad.append(f"data.masking.strategy={cfg.strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if not 0.0 < cfg.prob < 1.0:
        bad.append(f"data.masking.prob={cfg.prob}: must be in (0, 1)")
    for name in ("mask_token_prob", "random_token_prob"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            bad.append(f"data.masking.{name}={getattr(cfg, name)}: must be in [0, 1]")
    if cfg.mask_token_prob + cfg.random_token_prob > 1.0 + 1e-9:
        bad.append(f"data.masking.mask_token_prob + random_token_prob = {cfg.mask_token_prob} + "
                   f"{cfg.random_token_prob} > 1")
    if cfg.max_ngram < 1:
        bad.append(f"data.masking.max_ngram={cfg.max_ngram}: must be >= 1")
    if cfg.max_entity_tokens < 2:
        bad.append(f"data.masking.max_entity_tokens={cfg.max_entity_tokens}: must be >= 2")
    if cfg.entity_source not in ENTITY_SOURCES:
        bad.append(f"data.masking.entity_source={cfg.entity_source!r}: expected one of {', '.join(ENTITY_SOURCES)}")
    elif cfg.strategy == "entity" and cfg.entity_source in ("lexicon", "both") and not cfg.lexicon:
        bad.append(f"data.masking.entity_source={cfg.entity_source} needs data.masking.lexicon=FILE "
                   "(one phrase or entity per line; `python -m llmtrain.data.lexicon` builds one)")
    return bad


def never_masked_ids(tokenizer) -> np.ndarray:
    """Sorted ids that are never selected nor drawn as random replacements (special tokens)."""
    ids = {getattr(tokenizer, a, None) for a in SPECIAL_ATTRS}
    ids |= set(getattr(tokenizer, "special_ids", ()) or ())
    sp = getattr(tokenizer, "sp", None)  # SentencePiece: every control / unknown piece, whatever its name
    if sp is not None:
        ids |= {i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
    return np.array(sorted(i for i in ids if i is not None), dtype=np.int64)


class Masker:
    """Corrupts batches of token ids for masked-LM training (see the module doc)."""

    def __init__(self, cfg, tokenizer, seed: int, lexicon=None):
        bad = check_masking_config(cfg)
        if bad:
            raise ValueError("invalid masking configuration:\n  - " + "\n  - ".join(bad))
        if getattr(tokenizer, "mask_id", None) is None:
            raise ValueError(f"tokenizer {tokenizer.name!r} has no mask token (<mask> / [MASK]); masked-LM "
                             "training needs one")
        self.cfg, self.seed = cfg, int(seed)
        self.strategy = str(cfg.strategy)
        self.prob, self.max_ngram = float(cfg.prob), int(cfg.max_ngram)  # plain values: cfg may be a DictConfig
        self.p_mask, self.p_random = float(cfg.mask_token_prob), float(cfg.random_token_prob)
        self.mask_id = int(tokenizer.mask_id)
        self.n_pieces = int(tokenizer.sp_vocab_size)  # ids >= this are vocabulary padding
        self.special = never_masked_ids(tokenizer)  # [k]
        pool = np.setdiff1d(np.arange(self.n_pieces, dtype=np.int64), self.special)
        self.random_pool = pool  # [n] ordinary ids for the random replacements
        self.lexicon = lexicon
        if self.strategy == "entity" and lexicon is None:
            raise ValueError("data.masking.strategy=entity needs a lexicon (llmtrain.data.lexicon.SpanLexicon)")
        # P(n) proportional to 1/n for n-gram spans of 1..max_ngram words
        w = 1.0 / np.arange(1, self.max_ngram + 1)
        self.ngram_cdf = np.cumsum(w / w.sum())  # [max_ngram]

    @property
    def needs_word_starts(self) -> bool:
        return self.strategy != "token"

    # ------------------------------------------------------------------ units
    def maskable(self, tokens: np.ndarray) -> np.ndarray:
        """[m, S] bool: tokens that may be selected (not special, not vocabulary padding)."""
        return ~np.isin(tokens, self.special) & (tokens >= 0) & (tokens < self.n_pieces)

    def unit_starts(self, tokens, sample_ids, word_starts, maskable, salt: int) -> np.ndarray:
        """[m, S] bool: True where a masking unit starts."""
        m, S = tokens.shape
        if self.strategy == "token":
            starts = np.ones((m, S), dtype=bool)
        else:
            if word_starts is None:
                raise ValueError(f"data.masking.strategy={self.strategy} needs word-start flags (PREFIX.wbd)")
            starts = np.asarray(word_starts).astype(bool)  # copy: [m, S]
        starts[:, 0] = True
        # a special token is a unit of its own: it starts one, and so does the token after it
        starts |= ~maskable
        starts[:, 1:] |= ~maskable[:, :-1]
        if self.strategy == "ngram" and self.max_ngram > 1:
            starts = self._ngram_starts(starts, maskable, sample_ids, salt)
        elif self.strategy == "entity":
            for r, a, n in self.lexicon.match(tokens, starts, maskable):
                starts[r, a + 1:a + n] = False  # the span's words become one unit
        return starts

    def _ngram_starts(self, starts, maskable, sample_ids, salt: int) -> np.ndarray:
        """Word starts -> starts of random segments of 1..max_ngram words (P(n) ~ 1/n)."""
        m, S = starts.shape
        word = np.cumsum(starts, axis=1) - 1  # [m, S] word index of each token
        u = uniform(self.seed, _NGRAM + salt, sample_ids, S)  # [m, S] one draw per segment
        n = np.searchsorted(self.ngram_cdf, u, side="right") + 1  # [m, S] segment lengths in words
        n = np.minimum(n, self.max_ngram)
        first = np.cumsum(n, axis=1) - n  # [m, S] first word of segment k (exclusive cumsum)
        seg_start = np.zeros((m, S + 1), dtype=bool)  # [m, words] word w begins a segment
        rows = np.broadcast_to(np.arange(m)[:, None], first.shape)
        keep = first < S
        seg_start[rows[keep], first[keep]] = True
        out = starts & np.take_along_axis(seg_start, word, axis=1)
        out[:, 0] = True
        out |= ~maskable
        out[:, 1:] |= ~maskable[:, :-1]
        return out

    # ------------------------------------------------------------------ selection
    def select(self, starts, maskable, sample_ids, salt: int) -> np.ndarray:
        """[m, S] bool: the selected tokens, whole units adding up to each sample's budget."""
        m, S = starts.shape
        uid = np.cumsum(starts, axis=1) - 1  # [m, S] unit index of each token
        flat = uid + (np.arange(m, dtype=np.int64) * S)[:, None]
        length = np.bincount(flat.ravel(), minlength=m * S).reshape(m, S)  # [m, units] tokens per unit
        r, c = np.nonzero(starts)
        unit_ok = np.zeros((m, S), dtype=bool)  # [m, units]
        unit_ok[r, uid[r, c]] = maskable[r, c]
        key = np.full((m, S), 2.0)  # [m, units]; unmaskable / absent units sort last
        key[r, uid[r, c]] = uniform(self.seed, _ORDER + salt, sample_ids, S)[r, c]
        key[~unit_ok] = 2.0
        order = np.argsort(key, axis=1, kind="stable")  # [m, units] random order
        size = np.take_along_axis(np.where(unit_ok, length, 0), order, axis=1)  # [m, units] in that order
        n_ok = maskable.sum(axis=1)  # [m]
        budget = np.where(n_ok > 0, np.maximum(1, np.floor(self.prob * n_ok + 0.5)), 0).astype(np.int64)
        take = (np.cumsum(size, axis=1) <= budget[:, None]) & (size > 0)  # [m, units] the prefix that fits
        left = budget - np.where(take, size, 0).sum(axis=1)  # [m]
        while True:  # at most max unit length rounds; each takes one unit per row that still has room
            fits = ~take & (size > 0) & (size <= left[:, None])
            rows = np.nonzero(fits.any(axis=1))[0]
            if not len(rows):
                break
            j = fits[rows].argmax(axis=1)  # first unit in the random order that fits
            take[rows, j] = True
            left[rows] -= size[rows, j]
        chosen = np.zeros((m, S), dtype=bool)  # [m, units]
        np.put_along_axis(chosen, order, take, axis=1)
        return np.take_along_axis(chosen, uid, axis=1) & maskable  # [m, S]

    # ------------------------------------------------------------------ the call
    def __call__(self, tokens: np.ndarray, sample_ids: np.ndarray, word_starts: np.ndarray | None = None,
                 split: str = "train") -> MaskedBatch:
        tokens = np.asarray(tokens, dtype=np.int64)  # [m, S]
        sample_ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)  # [m]
        if tokens.ndim != 2 or len(sample_ids) != tokens.shape[0]:
            raise ValueError(f"masking: tokens {tokens.shape} and sample_ids {sample_ids.shape} do not match")
        salt = _SPLIT_SALT[split]
        m, S = tokens.shape
        maskable = self.maskable(tokens)  # [m, S]
        starts = self.unit_starts(tokens, sample_ids, word_starts, maskable, salt)
        selected = self.select(starts, maskable, sample_ids, salt)  # [m, S]
        u = uniform(self.seed, _REPLACE + salt, sample_ids, S)  # [m, S]
        p_mask, p_rand = self.p_mask, self.p_random
        to_mask = selected & (u < p_mask)
        to_rand = selected & (u >= p_mask) & (u < p_mask + p_rand)
        rand_ids = self.random_pool[(position_hash(self.seed, _RANDOM_ID + salt, sample_ids, S)
                                     % np.uint64(len(self.random_pool))).astype(np.int64)]  # [m, S]
        inputs = np.where(to_mask, self.mask_id, tokens)
        inputs = np.where(to_rand, rand_ids, inputs)
        return MaskedBatch(inputs, tokens.copy(), selected.astype(np.float32))

    def describe(self) -> str:
        c = self.cfg
        what = {"token": "single tokens", "whole_word": "whole words",
                "ngram": f"n-grams of 1..{c.max_ngram} words (P(n) ~ 1/n)",
                "entity": f"lexicon phrases/entities ({self.lexicon.describe() if self.lexicon else '-'}) and words"}
        keep = 1.0 - c.mask_token_prob - c.random_token_prob
        return (f"masking: {what[self.strategy]}, {c.prob:.0%} of maskable tokens per sample, "
                f"{c.mask_token_prob:.0%} mask / {c.random_token_prob:.0%} random / {keep:.0%} unchanged; "
                f"{len(self.special)} special ids never masked")

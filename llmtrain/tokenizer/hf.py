"""Hugging Face `tokenizer.json` tokenizers (Qwen2's byte-level BPE, Llama 3's, ...) behind llmtrain's interface.

    from llmtrain.tokenizer import load_tokenizer
    tok = load_tokenizer("Qwen2-0.5B/")      # a directory with tokenizer.json (+ tokenizer_config.json, config.json)
    python llmtrain/finetune.py model.init_from=Qwen2-0.5B/ data.tokenizer=Qwen2-0.5B/ ...

Loaded with the `tokenizers` library (Rust; no `transformers`, no PyTorch), so ids are exactly the
model's. A directory with a SentencePiece `tokenizer.model` loads as SentencePiece instead (our
`Tokenizer`). What the rest of llmtrain needs is mapped onto it:

- ``encode`` gives ids without special tokens added (documents are packed; ``preprocess`` appends
  ``eod_id`` after each document).
- special ids from `tokenizer_config.json` / `special_tokens_map.json` (a string or ``{"content": ...}``):
  ``eos_id`` = ``eod_id`` = ``eos_token`` (Qwen2: ``<|endoftext|>``); ``pad_id`` = ``pad_token``, else
  eos; ``bos_id`` = ``bos_token``, else eos (Qwen2 has no bos: fine-tuning examples then start with the
  document separator, as packed pretraining data does); ``unk_id`` and ``mask_id`` when present.
- ``sp_vocab_size``: ids the tokenizer can produce (added tokens included); ``vocab_size`` (embedding
  rows): `config.json`'s ``vocab_size`` in the same directory when there is one (Qwen2 pads its table
  beyond the tokenizer), else ``sp_vocab_size`` rounded up to a multiple of 128.
- ``byte_starts(text, ids)``: UTF-8 byte offset of each token, from the tokenizer's offsets.
- ``sha256`` / ``model_file``: of ``tokenizer.json``. ``decode`` skips special and padding ids.
Not provided: ``token_nbytes`` for byte-level BPE (a token may be part of a character), so
``preprocess --word-boundaries`` (ERNIE-style whole-word masking) refuses such a tokenizer.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from llmtrain.tokenizer.base import TokenFileInfo

TOKENIZER_JSON = "tokenizer.json"
PAD_MULTIPLE = 128


def is_hf_tokenizer_dir(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / TOKENIZER_JSON).is_file()


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTokenizer(TokenFileInfo):
    """A `tokenizers.Tokenizer` from `tokenizer.json`, with the attributes llmtrain's data path uses."""

    def __init__(self, directory: str | os.PathLike):
        from tokenizers import Tokenizer as RustTokenizer

        self.directory = Path(directory)
        self.model_file = self.directory / TOKENIZER_JSON
        try:
            self.tk = RustTokenizer.from_file(str(self.model_file))
        except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception on a bad file
            raise ValueError(f"{self.model_file}: not a readable tokenizers file ({e})") from e
        self.meta = {"model_type": "hf-tokenizers"}
        self.sp_vocab_size = self.tk.get_vocab_size(with_added_tokens=True)
        self.pad_multiple = PAD_MULTIPLE
        rows = self._json("config.json").get("vocab_size")
        if rows is not None and int(rows) < self.sp_vocab_size:
            raise ValueError(f"{self.directory}/config.json: vocab_size={rows} is smaller than the tokenizer's "
                             f"{self.sp_vocab_size} ids ({TOKENIZER_JSON})")
        self.vocab_size = int(rows) if rows is not None else -(-self.sp_vocab_size // PAD_MULTIPLE) * PAD_MULTIPLE
        self.name = self.directory.name
        named = {**self._json("special_tokens_map.json"), **self._json("tokenizer_config.json")}
        ids = {k: self._id(named.get(f"{k}_token")) for k in ("bos", "eos", "pad", "unk", "mask")}
        if ids["eos"] is None:
            raise ValueError(f"{self.directory}: no eos_token in tokenizer_config.json / special_tokens_map.json "
                             "(needed to separate documents)")
        self.eos_id = self.eod_id = ids["eos"]
        self.pad_id = ids["pad"] if ids["pad"] is not None else self.eos_id
        self.bos_id = ids["bos"] if ids["bos"] is not None else self.eos_id
        self.unk_id, self.mask_id = ids["unk"], ids["mask"]
        added = self.tk.get_added_tokens_decoder()  # {id: AddedToken}
        self.special_ids = sorted({i for i, t in added.items() if t.special} | {self.eos_id, self.pad_id})

    def _json(self, name: str) -> dict:
        path = self.directory / name
        if not path.is_file():
            return {}
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def _id(self, token) -> int | None:
        text = _token_text(token)
        return None if text is None else self.tk.token_to_id(text)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return [e.ids for e in self.tk.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        """Text of ``ids``; special tokens and vocabulary padding ids decode to nothing."""
        return self.tk.decode([int(i) for i in ids if 0 <= int(i) < self.sp_vocab_size], skip_special_tokens=True)

    def id_to_piece(self, i: int) -> str:
        return self.tk.id_to_token(int(i)) or ""

    def byte_starts(self, text: str, ids: list[int]) -> np.ndarray:
        """[len(ids)] int64: UTF-8 byte offset in ``text`` where each token of ``encode(text)`` starts."""
        spans = self.tk.encode(text, add_special_tokens=False).offsets
        if len(spans) != len(ids):
            raise ValueError(f"{self.model_file}: offsets have {len(spans)} tokens for {len(ids)} ids")
        byte_of_char = np.zeros(len(text) + 1, dtype=np.int64)
        np.cumsum([len(ch.encode("utf-8")) for ch in text], out=byte_of_char[1:])
        return byte_of_char[np.array([s for s, _ in spans], dtype=np.int64)]

    @property
    def token_nbytes(self):
        raise ValueError(f"tokenizer {self.directory}: byte-level BPE tokens need not be whole characters, so word "
                         "boundaries (preprocess --word-boundaries) are not supported with it")

    # ------------------------------------------------------------------ metadata
    def identity(self) -> dict:
        """What a checkpoint stores to refuse a mismatched tokenizer later."""
        return {"name": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "sp_vocab_size": self.sp_vocab_size, "pad_multiple": self.pad_multiple, "model_type": "hf-tokenizers",
                "special_ids": {"pad": self.pad_id, "unk": self.unk_id, "bos": self.bos_id, "eos": self.eos_id,
                                "mask": self.mask_id, "eod": self.eod_id}}

    def __repr__(self) -> str:
        return (f"HFTokenizer({str(self.directory)!r}, ids={self.sp_vocab_size}, vocab_size={self.vocab_size}, "
                f"eod={self.eod_id})")

"""What every tokenizer kind shares: the token-file dtype, the identity hash, documents to one token array.

    class MyTokenizer(TokenFileInfo): ...   # needs .vocab_size, .model_file, .eod_id and .encode_batch
"""
from __future__ import annotations

import itertools
from functools import cached_property

import numpy as np

from llmtrain.utils.files import sha256_file


class TokenFileInfo:
    """Mixin: `dtype` of token files, `sha256` of the file that fixes the ids, `encode_documents`."""

    @property
    def dtype(self):
        """numpy dtype of token files: uint16 when every id fits (vocab <= 65536), else int32."""
        return np.uint16 if self.vocab_size <= 65536 else np.int32

    @cached_property
    def sha256(self) -> str:
        return sha256_file(self.model_file)

    def encode_documents(self, texts: list[str], num_threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Documents back to back, each followed by ``eod_id``: (tokens [n_tokens] ``dtype``,
        lengths [n_docs] int32 with the EOD counted). Generic: from ``encode_batch``'s lists."""
        ids = self.encode_batch(texts, num_threads=num_threads)
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int32, count=len(ids))  # [n_docs]
        eod = [self.eod_id]
        tokens = np.fromiter(itertools.chain.from_iterable(x + eod for x in ids), dtype=self.dtype,
                             count=int(lengths.sum(dtype=np.int64)))  # [n_tokens]
        return tokens, lengths

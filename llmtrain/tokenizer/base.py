"""What every tokenizer kind shares: the token-file dtype and the identity hash.

    class MyTokenizer(TokenFileInfo): ...   # needs .vocab_size and .model_file
"""
from __future__ import annotations

from functools import cached_property

import numpy as np

from llmtrain.utils.files import sha256_file


class TokenFileInfo:
    """Mixin: `dtype` of token files and `sha256` of the file that fixes the ids."""

    @property
    def dtype(self):
        """numpy dtype of token files: uint16 when every id fits (vocab <= 65536), else int32."""
        return np.uint16 if self.vocab_size <= 65536 else np.int32

    @cached_property
    def sha256(self) -> str:
        return sha256_file(self.model_file)

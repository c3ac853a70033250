"""The checkpoint reader reassembles stage-1 V2 state saved under tp: flat slices of each tp piece.

    python -m pytest -q tests/checkpoint/test_flat_pieces.py

Two tp ranks x two sharding ranks each write their V2 slice of their tp piece of a [4, 6] tensor split along axis 1
(each piece [4, 3], flattened and padded to 16 elements, halves of 8); the reader must place every piece in its
columns. The same pieces written without `flat.piece` (the format before tp was supported) leave the tp pieces
unplaced and the reader refuses them (elements covered twice) rather than returning a mix of pieces as the whole.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from llmtrain.checkpoint.shards import ShardIndex

FULL = np.arange(24, dtype=np.float32).reshape(4, 6)
KEY = "optim/layers.0.attn.q_proj.weight/moment1"


def _write(tmp_path, with_piece: bool):
    rank = 0
    for tp in range(2):
        piece = np.pad(FULL[:, 3 * tp: 3 * tp + 3].ravel(), (0, 4))  # [16]: 12 elements + 4 padding
        for sh in range(2):
            meta = {"name": "layers.0.attn.q_proj.weight", "global_shape": [4, 3], "axis": 0, "offset": 8 * sh,
                    "flat": {"numel": 12, "padded": 16}}
            if with_piece:
                meta["global_shape"] = [4, 6]
                meta["flat"]["piece"] = {"shape": [4, 3], "axis": 1, "offset": 3 * tp}
            stem = tmp_path / f"rank_{rank:05d}"
            save_file({KEY: piece[8 * sh: 8 * sh + 8].copy()}, str(stem) + ".safetensors")
            (tmp_path / f"rank_{rank:05d}.json").write_text(json.dumps({"tensors": {KEY: meta}}))
            rank += 1


def test_v2_slices_of_tp_pieces_reassemble_the_full_tensor(tmp_path):
    _write(tmp_path, with_piece=True)
    np.testing.assert_array_equal(ShardIndex(str(tmp_path)).full(KEY), FULL)


def test_tp_pieces_written_without_their_place_are_not_taken_for_the_whole(tmp_path):
    _write(tmp_path, with_piece=False)
    with pytest.raises(ValueError, match="cover"):
        ShardIndex(str(tmp_path)).full(KEY)

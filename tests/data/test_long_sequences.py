"""Long sequences (up to 128k) from the same .bin/.idx: packing, sampling and the layout-free order do not change
with the length; the context-parallel cut and per-document ids work at that length.

    python -m pytest tests/data/test_long_sequences.py -q

A synthetic MMIDIDX prefix of 300 documents (~600k tokens, EOD-terminated, lengths 200..4000, uint16) and the
shipped tokenizer: samples of 131072 + 1 tokens, a global batch of 4 split over 1 or 2 data ranks (the same
samples either way), blended with a second prefix, each rank's chunks under cp = 8 (16384 positions each,
their global positions), and document ids and per-document positions at that length.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from llmtrain.data.config import load_data_config
from llmtrain.data.indexed import IndexedWriter
from llmtrain.data.loader import PretrainData
from llmtrain.parallel.context_chunks import ChunkLayout
from llmtrain.tokenizer import load_tokenizer

SEQ = 131072
TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "tokenizers", "pd1998-bpe16k")


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    eod = load_tokenizer(TOKENIZER).eod_id
    prefixes = []
    for name, seed in (("a", 0), ("b", 1)):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(200, 4000, size=300)
        tokens = rng.integers(10, 16000, size=int(lengths.sum())).astype(np.uint16)
        tokens[np.cumsum(lengths) - 1] = eod  # every document ends with EOD
        w = IndexedWriter(str(root / name), np.uint16)
        w.add_documents(tokens, lengths)
        w.finalize()
        prefixes.append(str(root / name))
    return prefixes


def _data(prefixes, world=1, rank=0, extra=()):
    cfg = load_data_config(None, [f"prefixes=[{','.join(prefixes)}]", f"tokenizer={TOKENIZER}", f"seq_len={SEQ}",
                                  "num_workers=0", "split=100,0,0", *extra])
    return PretrainData(cfg, seed=7, global_batch_size=4, micro_batch_size=2 // world,
                        dp_rank=rank, dp_world=world)


def test_128k_samples_are_layout_free_and_cut_for_context_parallelism(long_corpus):
    one = _data(long_corpus[:1])
    steps = [one.next_step() for _ in range(2)]
    assert all(mb["input_ids"].shape == (2, SEQ) for s in steps for mb in s)
    halves = [_data(long_corpus[:1], world=2, rank=r).step_batches(4) for r in range(2)]  # step 2 on 2 data ranks
    ids = np.concatenate([mb["sample_ids"] for h in halves for mb in h])
    assert ids.tolist() == np.concatenate([mb["sample_ids"] for mb in steps[1]]).tolist()
    tokens = np.concatenate([mb["input_ids"] for h in halves for mb in h])
    assert (tokens == np.concatenate([mb["input_ids"] for mb in steps[1]])).all()
    blended = _data(long_corpus).step_batches(0)
    assert blended[0]["input_ids"].shape == (2, SEQ)
    layout = ChunkLayout(SEQ, 8)
    parts = [layout.localize(steps[0][0], r) for r in range(8)]
    assert all(p["input_ids"].shape == (2, SEQ // 8) for p in parts)
    seen = np.sort(np.concatenate([p["position_ids"][0] for p in parts]))
    assert (seen == np.arange(SEQ)).all()  # every position once, global
    assert sum(p["loss_mask"].sum() for p in parts) == steps[0][0]["loss_mask"].sum()


def test_128k_rows_carry_their_documents(long_corpus):
    mb = _data(long_corpus[:1], extra=["document_mask=true", "reset_position_ids=true"]).step_batches(0)[0]
    eod = load_tokenizer(TOKENIZER).eod_id
    row, seg, pos = mb["input_ids"][0], mb["segment_ids"][0], mb["position_ids"][0]
    ends = np.flatnonzero(row[:-1] == eod)
    assert seg[-1] == len(ends) > 30  # dozens of documents in one 128k row
    assert (pos[ends + 1] == 0).all() and pos.max() < 4000
    local = ChunkLayout(SEQ, 4).localize(mb, 1)
    assert (local["segment_ids"][0] == seg[ChunkLayout(SEQ, 4).index(1)]).all()

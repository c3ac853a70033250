"""Layout-independent order: the multiset of sample ids per step is the same under dp1/dp2/dp4 and
across a stop-and-resume with another dp size; batches, validation, blending, errors."""
from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from llmtrain.data.config import DataConfig
from llmtrain.data.loader import PretrainData

G, STEPS, SEED = 16, 6, 1234


@pytest.fixture
def cfg(prefix, tokenizer_dir, tmp_path):
    return OmegaConf.structured(DataConfig(prefixes=[prefix], tokenizer=str(tokenizer_dir), seq_len=32,
                                           split="90,10,0", cache_dir=str(tmp_path / "cache"), num_workers=1))


def run(cfg, world, micro, steps, consumed=0, state=None):
    """{step: {sample_id: input_ids}} over all data ranks of a layout, plus the ranks' final states."""
    ranks = [PretrainData(cfg, SEED, G, micro, r, world, consumed_samples=consumed) for r in range(world)]
    if state is not None:
        for d in ranks:
            d.load_state_dict(state)
    first = ranks[0].consumed_samples // G
    out = {}
    for s in range(first, first + steps):
        per_step = {}
        for d in ranks:
            mbs = d.next_step()
            assert len(mbs) == G // (micro * world)
            for mb in mbs:
                assert mb["input_ids"].shape == (micro, cfg.seq_len) and mb["input_ids"].dtype == np.int64
                for i, sid in enumerate(mb["sample_ids"]):
                    assert int(sid) not in per_step
                    per_step[int(sid)] = mb["input_ids"][i]
        out[s] = per_step
    states = [d.state_dict() for d in ranks]
    for d in ranks:
        d.close()
    return out, states


def test_same_samples_per_step_under_dp1_dp2_dp4(cfg):
    ref, _ = run(cfg, 1, 4, STEPS)
    for world, micro in [(2, 4), (2, 8), (4, 2), (4, 4), (4, 1)]:
        got, _ = run(cfg, world, micro, STEPS)
        for s in range(STEPS):
            assert sorted(got[s]) == sorted(ref[s]) == list(range(s * G, (s + 1) * G))
            for sid, ids in ref[s].items():
                assert (got[s][sid] == ids).all()


def test_stop_and_resume_with_another_dp_size(cfg):
    ref, _ = run(cfg, 1, 4, STEPS)
    _, states = run(cfg, 2, 4, 3)  # stop after 3 steps under dp2
    assert all(st["consumed_samples"] == 3 * G for st in states)
    for world, micro in [(4, 2), (1, 8), (2, 2)]:
        resumed, _ = run(cfg, world, micro, STEPS - 3, state=states[0])
        assert sorted(resumed) == list(range(3, STEPS))
        for s in range(3, STEPS):
            assert sorted(resumed[s]) == sorted(ref[s])
            assert all((resumed[s][sid] == ref[s][sid]).all() for sid in ref[s])
    via_ctor, _ = run(cfg, 4, 4, STEPS - 3, consumed=3 * G)
    assert {s: sorted(v) for s, v in via_ctor.items()} == {s: sorted(ref[s]) for s in range(3, STEPS)}


def test_rank_share_is_contiguous_and_prefetch_changes_nothing(cfg):
    d = PretrainData(cfg, SEED, G, 2, 1, 2)
    mbs = d.next_step()
    assert np.concatenate([mb["sample_ids"] for mb in mbs]).tolist() == list(range(8, 16))
    sync_cfg = OmegaConf.merge(cfg, {"num_workers": 0})
    a = PretrainData(sync_cfg, SEED, G, 4, 0, 1)
    b = PretrainData(OmegaConf.merge(cfg, {"num_workers": 3}), SEED, G, 4, 0, 1)
    for _ in range(4):
        for x, y in zip(a.next_step(), b.next_step()):
            assert all((x[k] == y[k]).all() for k in x)
        assert a.data_wait_time >= 0 and b.data_wait_time >= 0
    d.close(), b.close()


def test_batches_are_shifted_and_cross_epochs(cfg, tokenizer):
    d = PretrainData(cfg, SEED, G, 8, 0, 1)
    per_epoch = d.train.parts[0].samples_per_epoch
    d.load_state_dict({"consumed_samples": per_epoch - 8})  # this step straddles epochs 0 and 1
    seen = []
    for _ in range(3):
        for mb in d.next_step():
            tokens = d.train.get_many(mb["sample_ids"])
            assert (mb["input_ids"] == tokens[:, :-1]).all() and (mb["labels"] == tokens[:, 1:]).all()
            assert mb["loss_mask"].dtype == np.float32 and mb["loss_mask"].sum() == mb["labels"].size
            seen += mb["sample_ids"].tolist()
    assert seen == list(range(per_epoch - 8, per_epoch - 8 + 3 * G))
    masked = PretrainData(OmegaConf.merge(cfg, {"eod_mask_loss": True}), SEED, G, 8, 0, 1)
    mbs = [mb for _ in range(6) for mb in masked.next_step()]
    eod = np.concatenate([mb["input_ids"] == tokenizer.eod_id for mb in mbs])
    mask = np.concatenate([mb["loss_mask"] for mb in mbs])
    assert eod.any() and (mask[eod] == 0).all() and (mask[~eod] == 1).all()
    d.close(), masked.close()


def test_validation_batches_are_the_same_everywhere(cfg, prefix):
    a = PretrainData(cfg, SEED, G, 4, 0, 1).valid_batches(3)
    b = PretrainData(cfg, SEED, G, 4, 3, 4).valid_batches(3)
    assert len(a) == 3 and all((x["input_ids"] == y["input_ids"]).all() for x, y in zip(a, b))
    from llmtrain.data.packing import parse_split

    d = PretrainData(cfg, SEED, G, 4, 0, 1)
    ds = d.datasets[0]
    doc_lo, doc_hi = parse_split(cfg.split, ds.n_docs)["valid"]
    assert (doc_lo, doc_hi) == (54, 60)
    valid_tokens = set(np.concatenate([ds[i] for i in range(doc_lo, doc_hi)]).tolist())
    for mb in a:  # every validation token comes from the validation documents
        assert set(mb["input_ids"].ravel().tolist()) <= valid_tokens


def test_blending_two_prefixes_by_weight(cfg, prefix, corpus_file, tokenizer_dir, tmp_path):
    from llmtrain.data.preprocess import preprocess

    other = str(tmp_path / "other")
    lines = open(corpus_file, encoding="utf-8").read().splitlines(keepends=True)
    (tmp_path / "other.jsonl").write_text("".join(lines[::-1]), encoding="utf-8")
    preprocess([str(tmp_path / "other.jsonl")], str(tokenizer_dir), other, workers=0, progress=False)
    bcfg = OmegaConf.merge(cfg, {"prefixes": [prefix, other], "weights": [0.75, 0.25]})
    d = PretrainData(bcfg, SEED, G, 4, 0, 1)
    ids = np.arange(4000)
    which, local = d.train.blend.locate(ids)
    assert abs((which == 0).mean() - 0.75) < 1e-3
    for j in (0, 1):
        assert (np.sort(local[which == j]) == np.arange((which == j).sum())).all()
    tokens = d.train.get_many(ids[:64])
    for i in range(64):
        assert (tokens[i] == d.train.parts[which[i]].get(local[i])).all()
    with pytest.raises(ValueError, match="data.weights has 1 entries for 2 data.prefixes"):
        PretrainData(OmegaConf.merge(bcfg, {"weights": [1.0]}), SEED, G, 4, 0, 1)
    natural = PretrainData(OmegaConf.merge(bcfg, {"weights": None}), SEED, G, 4, 0, 1)
    sizes = np.array([p.samples_per_epoch for p in natural.train.parts], dtype=float)
    assert np.allclose(natural.train.blend.weights, sizes / sizes.sum())
    d.close(), natural.close()


def test_clear_errors(cfg, tmp_path):
    missing = OmegaConf.merge(cfg, {"prefixes": [str(tmp_path / "nope" / "corpus_text_document")]})
    with pytest.raises(FileNotFoundError) as e:
        PretrainData(missing, SEED, G, 4, 0, 1)
    msg = str(e.value)
    assert str(tmp_path / "nope" / "corpus_text_document.bin") in msg
    assert "python -m llmtrain.data.preprocess" in msg and "scripts/prepare_default_corpus.sh" in msg
    with pytest.raises(ValueError, match="global_batch_size=10 is not a multiple of micro_batch_size=4 x "
                                         "data-parallel world=2 = 8"):
        PretrainData(cfg, SEED, 10, 4, 0, 2)
    shipped = OmegaConf.merge(cfg, {"tokenizer": "tokenizers/pd1998-bpe16k"})  # relative to the repo root
    with pytest.raises(ValueError, match="was preprocessed with tokenizer 'tiny-bpe'"):
        PretrainData(shipped, SEED, G, 4, 0, 1)
    with pytest.raises(FileNotFoundError, match="llmtrain.tokenizer.train"):
        PretrainData(OmegaConf.merge(cfg, {"tokenizer": str(tmp_path / "no-tok")}), SEED, G, 4, 0, 1)

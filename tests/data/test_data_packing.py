"""Packing: samples are seq_len+1 consecutive tokens of the shuffled document stream; indices are cached."""
from __future__ import annotations

import numpy as np
import pytest

from llmtrain.data.blend import Blend, apportion
from llmtrain.data.indexed import IndexedDataset, IndexedWriter
from llmtrain.data.packing import PackedSplit, build_epoch, main, parse_split


def synthetic(tmp_path, n_docs=50, seed=0, name="syn"):
    """Documents whose tokens are their global positions in the file (int32), so content is checkable."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 40, size=n_docs)
    w = IndexedWriter(str(tmp_path / name), np.int32)
    w.add_documents(np.arange(sizes.sum(), dtype=np.int32), sizes)
    w.finalize()
    return IndexedDataset(str(tmp_path / name))


def test_samples_are_consecutive_tokens_of_the_shuffled_stream(tmp_path):
    ds = synthetic(tmp_path)
    L = 16
    doc_idx, sample_idx, shuffle_idx = build_epoch(ds.sizes, (5, 45), L, seed=3, epoch=0)
    assert sorted(doc_idx) == list(range(5, 45))
    stream = np.concatenate([ds[int(d)] for d in doc_idx])  # the epoch's token stream
    S = (len(stream) - 1) // L
    assert sample_idx.shape == (S + 1, 2) and sorted(shuffle_idx) == list(range(S))
    ps = PackedSplit(ds, "train", (5, 45), L, seed=3, cache_dir=str(tmp_path / "c"))
    assert ps.samples_per_epoch == S
    for k in range(S):
        i = int(shuffle_idx[k])
        assert (ps.get(k) == stream[i * L: i * L + L + 1]).all()
    # the next epoch is the same documents reshuffled
    d1, _, _ = ps.epoch_index(1)
    assert sorted(d1) == sorted(doc_idx) and list(d1) != list(doc_idx)
    assert len(ps.get(S)) == L + 1  # first sample of epoch 1


def test_build_is_deterministic_and_seeded(tmp_path):
    ds = synthetic(tmp_path)
    a = build_epoch(ds.sizes, (0, 50), 8, 1, 0)
    b = build_epoch(ds.sizes, (0, 50), 8, 1, 0)
    c = build_epoch(ds.sizes, (0, 50), 8, 2, 0)
    assert all((x == y).all() for x, y in zip(a, b))
    assert not (a[0] == c[0]).all()


def test_split_ranges():
    assert parse_split("98,2,0", 100) == {"train": (0, 98), "valid": (98, 100), "test": (100, 100)}
    assert parse_split("1", 7) == {"train": (0, 7), "valid": (7, 7), "test": (7, 7)}
    assert parse_split("8,1,1", 10) == {"train": (0, 8), "valid": (8, 9), "test": (9, 10)}
    with pytest.raises(ValueError, match="data.split='a,b'"):
        parse_split("a,b", 10)


def test_cache_names_follow_content_and_parameters(tmp_path):
    ds = synthetic(tmp_path)
    ps = PackedSplit(ds, "train", (0, 45), 16, seed=7, cache_dir=str(tmp_path / "cache"))
    name = ps.cache_name(0)
    assert name.startswith("syn.train.L16.s7.e0.") and len(name.split(".")[-1]) == 16
    files, built = ps.build(0)
    assert built and all(f.is_file() and f.parent == tmp_path / "cache" for f in files.values())
    assert ps.build(0) == (files, False)  # cached: reused, not rebuilt
    assert PackedSplit(ds, "train", (0, 45), 32, 7, str(tmp_path / "cache")).cache_name(0) != name
    assert PackedSplit(ds, "train", (0, 44), 16, 7, str(tmp_path / "cache")).cache_name(0) != name
    assert PackedSplit(ds, "train", (0, 45), 16, 8, str(tmp_path / "cache")).cache_name(0) != name
    assert ps.cache_name(1) != name
    other = synthetic(tmp_path / ".." / tmp_path.name, seed=1)  # same path, new content
    assert PackedSplit(other, "train", (0, 45), 16, 7, str(tmp_path / "cache")).cache_name(0) != name
    default = PackedSplit(ds, "train", (0, 45), 16, 7)
    assert default.cache_dir == tmp_path / "index-cache"


def test_too_few_tokens_is_a_clear_error(tmp_path):
    ds = synthetic(tmp_path)
    ps = PackedSplit(ds, "valid", (49, 50), 1000, 0, str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"fewer than seq_len \+ 1 = 1001"):
        ps.get(0)


def test_packing_cli_builds_ahead(tmp_path, capsys):
    ds = synthetic(tmp_path)
    assert main([ds.prefix, "--seq-len", "8", "--seed", "1", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("built") == 2 and "syn.train.L8.s1.e1." in out
    assert main([ds.prefix, "--seq-len", "8", "--seed", "1"]) == 0
    assert "cached" in capsys.readouterr().out


def test_blend_ratios_and_no_sample_skipped():
    b = Blend([0.7, 0.2, 0.1])
    assert b.quota.sum() == b.period and list(apportion([1, 1, 1], 10)) == [4, 3, 3]
    d, k = b.locate(np.arange(3 * b.period + 1234))
    counts = np.bincount(d, minlength=3)
    assert np.abs(counts / len(d) - [0.7, 0.2, 0.1]).max() < 1e-4
    for j in range(3):  # each dataset's samples are taken in order 0, 1, 2, ... with none skipped
        assert (np.sort(k[d == j]) == np.arange(counts[j])).all()
    for n in range(1, 2000):  # every prefix of the stream already follows the weights
        c = np.bincount(d[:n], minlength=3)
        assert np.abs(c - n * b.weights).max() <= 1.0
    d, _ = Blend([1, 0, 1]).locate(np.arange(100))
    assert set(d) == {0, 2}
    with pytest.raises(ValueError, match="blend weights"):
        Blend([0, 0])


def test_side_file_values_follow_the_sample(prefix):
    ds = IndexedDataset(prefix)
    ps = PackedSplit(ds, "train", (0, ds.n_docs), 64, 5)
    wbd = ds.side("wbd")
    for k in range(0, ps.samples_per_epoch, 7):
        tokens, flags = ps.get(k, side="wbd")
        assert (tokens == ps.get(k)).all() and flags.dtype == np.uint8 and len(flags) == 65
        segs = ps.segments(k)
        assert (flags == np.concatenate([wbd[a: a + n] for a, n in segs])).all()
        assert (tokens == np.concatenate([ds.tokens[a: a + n] for a, n in segs])).all()

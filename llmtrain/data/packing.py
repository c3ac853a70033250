"""GPT packing: documents -> samples of ``seq_len + 1`` tokens, with cached numpy indices.

    python -m llmtrain.data.packing PREFIX --seq-len 128 --seed 1234 [--split 98,2,0] [--epochs 1]

(builds and caches the indices of epoch 0.. of the train split and prints their
files; ``python -m llmtrain.data.loader`` builds everything a training run needs.)

Documents are the items of an MMIDIDX file (one per document in our files, EOD
included). A split is a contiguous range of documents (Megatron's ``98,2,0``
convention). Each epoch of a split is packed independently, as in Megatron:

    doc_idx     [n_docs]        int32  documents of the split in shuffled order
    sample_idx  [S + 1, 2]      int32/int64  (position in doc_idx, token offset) where
                                       sample i starts; sample i spans up to and
                                       including the start of sample i + 1
    shuffle_idx [S]             uint32/int64  permutation of the samples

with ``S = (T - 1) // seq_len`` for ``T`` tokens in the split, so consecutive
samples share one token (input/label shift) and every token but the last
``< seq_len`` of an epoch is used. Built with ``cumsum`` + ``searchsorted``: a
billion tokens take seconds (see ``benchmarks/preprocess.py``).

The indices are cached beside the data (``<prefix dir>/index-cache/`` unless a
cache dir is given) under ``<name>.<split>.L<seq_len>.s<seed>.e<epoch>.<hash>.*.npy``
where ``hash`` covers the ``.idx`` content, the ``.bin`` size, the split's document
range and the parameters. Builders take a file lock, write under temporary names
and rename, so concurrent ranks never see half-written files; prebuilt files are
memory-mapped.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

from llmtrain.data.indexed import IndexedDataset

INDEX_VERSION = 1
SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str, n_docs: int) -> dict[str, tuple[int, int]]:
    """``"98,2,0"`` -> contiguous document ranges {"train": (0, a), "valid": (a, b), "test": (b, n)}."""
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"data.split={split!r}: expected comma-separated numbers such as '98,2,0'") from None
    parts += [0.0] * (3 - len(parts))
    if len(parts) != 3 or min(parts) < 0 or sum(parts) <= 0:
        raise ValueError(f"data.split={split!r}: expected up to 3 non-negative numbers with a positive sum")
    frac = np.asarray(parts) / sum(parts)
    bounds = np.concatenate([[0], np.round(np.cumsum(frac) * n_docs)]).astype(np.int64)
    bounds[-1] = n_docs
    return {name: (int(bounds[i]), int(bounds[i + 1])) for i, name in enumerate(SPLIT_NAMES)}


def build_epoch(sizes: np.ndarray, doc_range: tuple[int, int], seq_len: int, seed: int, epoch: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx [n_docs], sample_idx [S+1, 2], shuffle_idx [S]) of one epoch; pure numpy."""
    d0, d1 = doc_range
    rng = np.random.default_rng([seed, epoch, d0, d1, INDEX_VERSION])
    doc_dtype = np.int32 if d1 < 2**31 else np.int64
    doc_idx = (rng.permutation(d1 - d0) + d0).astype(doc_dtype)  # [n_docs]
    cum = np.cumsum(sizes[doc_idx], dtype=np.int64)  # [n_docs] tokens up to and including each doc
    total = int(cum[-1]) if len(cum) else 0
    n_samples = (total - 1) // seq_len if total > 0 else 0
    starts = np.arange(n_samples + 1, dtype=np.int64) * seq_len  # [S+1] first token of each sample
    pos = np.searchsorted(cum, starts, side="right")  # [S+1] doc containing that token
    before = np.where(pos > 0, cum[np.maximum(pos - 1, 0)], 0)  # tokens in earlier docs
    pos_dtype = np.int32 if max(len(doc_idx), int(sizes.max(initial=0))) < 2**31 else np.int64
    sample_idx = np.stack([pos, starts - before], axis=1).astype(pos_dtype)  # [S+1, 2]
    shuffle_dtype = np.uint32 if n_samples < 2**32 else np.int64
    shuffle_idx = rng.permutation(n_samples).astype(shuffle_dtype)  # [S]
    return doc_idx, sample_idx, shuffle_idx


class PackedSplit:
    """The infinite sample stream of one split of one prefix: epoch after epoch, each reshuffled.

    ``get(k)`` returns sample ``k`` of the stream (epoch ``k // samples_per_epoch``),
    ``seq_len + 1`` tokens as int64.
    """

    def __init__(self, ds: IndexedDataset, split: str, doc_range: tuple[int, int], seq_len: int, seed: int,
                 cache_dir: str | None = None, fingerprint: str | None = None):
        self.ds, self.split, self.doc_range = ds, split, doc_range
        self.seq_len, self.seed = int(seq_len), int(seed)
        d0, d1 = doc_range
        self.n_docs = d1 - d0
        self.n_tokens = int(ds.sizes[d0:d1].sum(dtype=np.int64))
        self.samples_per_epoch = (self.n_tokens - 1) // self.seq_len if self.n_tokens else 0
        self.cache_dir = Path(cache_dir) if cache_dir else Path(ds.prefix).parent / "index-cache"
        self._fingerprint = fingerprint
        self._epochs: OrderedDict[int, tuple] = OrderedDict()

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = self.ds.fingerprint()
        return self._fingerprint

    def cache_name(self, epoch: int) -> str:
        params = {"v": INDEX_VERSION, "data": self.fingerprint, "split": self.split, "range": self.doc_range,
                  "seq_len": self.seq_len, "seed": self.seed, "epoch": epoch}
        h = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
        return f"{Path(self.ds.prefix).name}.{self.split}.L{self.seq_len}.s{self.seed}.e{epoch}.{h}"

    def index_files(self, epoch: int) -> dict[str, Path]:
        base = self.cache_dir / self.cache_name(epoch)
        return {k: Path(f"{base}.{k}.npy") for k in ("doc", "sample", "shuffle")}

    def build(self, epoch: int) -> tuple[dict[str, Path], bool]:
        """Make sure the cache files of ``epoch`` exist; return (files, built_now)."""
        files = self.index_files(epoch)
        if all(f.is_file() for f in files.values()):
            return files, False
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        lock = self.cache_dir / (self.cache_name(epoch) + ".lock")
        with open(lock, "w") as lf:
            fcntl.flock(lf, fcntl.LOCK_EX)  # another rank may be building the same files
            try:
                if all(f.is_file() for f in files.values()):
                    return files, False
                arrays = build_epoch(self.ds.sizes, self.doc_range, self.seq_len, self.seed, epoch)
                for (key, path), arr in zip(files.items(), arrays):
                    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
                    with open(tmp, "wb") as f:
                        np.save(f, arr)
                    os.replace(tmp, path)
                return files, True
            finally:
                fcntl.flock(lf, fcntl.LOCK_UN)

    def epoch_index(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Memory-mapped (doc_idx, sample_idx, shuffle_idx) of ``epoch``, built if needed."""
        if epoch not in self._epochs:
            self._check_nonempty()
            files, _ = self.build(epoch)
            self._epochs[epoch] = tuple(np.load(files[k], mmap_mode="r") for k in ("doc", "sample", "shuffle"))
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        self._epochs.move_to_end(epoch)
        return self._epochs[epoch]

    def _check_nonempty(self) -> None:
        if self.samples_per_epoch <= 0:
            raise ValueError(f"{self.ds.prefix} ({self.split} split, documents {self.doc_range}): "
                             f"{self.n_tokens} tokens, fewer than seq_len + 1 = {self.seq_len + 1}; "
                             f"change data.split or data.seq_len")

    def segments(self, k: int) -> list[tuple[int, int]]:
        """(first element in ``PREFIX.bin``, length) of the pieces of stream sample ``k``."""
        self._check_nonempty()
        epoch, i = divmod(int(k), self.samples_per_epoch)
        doc_idx, sample_idx, shuffle_idx = self.epoch_index(epoch)
        s = int(shuffle_idx[i])
        (p0, o0), (p1, o1) = sample_idx[s], sample_idx[s + 1]
        p0, o0, p1, o1 = int(p0), int(o0), int(p1), int(o1)
        starts, sizes = self.ds.starts, self.ds.sizes
        if p0 == p1:
            return [(int(starts[doc_idx[p0]]) + o0, o1 - o0 + 1)]
        segs = [(int(starts[doc_idx[p0]]) + o0, int(sizes[doc_idx[p0]]) - o0)]
        segs += [(int(starts[doc_idx[p]]), int(sizes[doc_idx[p]])) for p in range(p0 + 1, p1)]
        segs.append((int(starts[doc_idx[p1]]), o1 + 1))
        return segs

    def get(self, k: int, side: str | None = None):
        """[seq_len + 1] int64 tokens of stream sample ``k``; with ``side="wbd"`` also the
        [seq_len + 1] values of that side file at the same positions."""
        segs = self.segments(k)
        out = np.concatenate([self.ds.tokens[a: a + n] for a, n in segs]).astype(np.int64)
        if len(out) != self.seq_len + 1:  # an index that does not match the data
            raise RuntimeError(f"{self.ds.prefix}: sample {k} has {len(out)} tokens, expected {self.seq_len + 1}; "
                               f"delete {self.cache_dir} and rebuild")
        if side is None:
            return out
        values = self.ds.side(side)
        return out, np.concatenate([values[a: a + n] for a, n in segs])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Build and cache the packing indices of one MMIDIDX prefix.")
    p.add_argument("prefix")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--split", default="98,2,0")
    p.add_argument("--which", default="train", choices=SPLIT_NAMES)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--cache-dir", default=None)
    a = p.parse_args(argv)
    ds = IndexedDataset(a.prefix)
    rng = parse_split(a.split, len(ds))[a.which]
    ps = PackedSplit(ds, a.which, rng, a.seq_len, a.seed, a.cache_dir)
    for e in range(a.epochs):
        files, built = ps.build(e)
        print(f"epoch {e}: {ps.samples_per_epoch} samples of {a.seq_len + 1} tokens from {ps.n_docs} documents "
              f"({ps.n_tokens} tokens); {'built' if built else 'cached'} {files['sample'].parent}/"
              f"{ps.cache_name(e)}.*.npy")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training batches: config -> tokenizer, blended packed samples -> this data rank's micro-batches.

    python -m llmtrain.data.loader --data conf/data/pd1998.yaml --seed 1234 --samples 64000 [seq_len=256 ...]

(the command builds every packing index a run of that many samples needs, ahead
of time, and prints what the data holds; the trainer uses :class:`PretrainData`.)

    data = PretrainData(cfg.data, seed=cfg.seed, global_batch_size=G, micro_batch_size=m,
                        dp_rank=r, dp_world=W, consumed_samples=0)
    mbs = data.next_step()   # G // (m*W) micro-batches for this data rank, each a dict of numpy arrays:
                             #   input_ids int64 [m, seq_len], labels int64 [m, seq_len],
                             #   loss_mask float32 [m, seq_len], sample_ids int64 [m]

Order (see :mod:`llmtrain.data.sampler`): step ``s`` holds global samples
``[consumed, consumed + G)`` of the blended stream, a function of (seed, data,
G) only; data rank ``r`` takes the contiguous share ``[r*G/W, (r+1)*G/W)``.
``consumed_samples`` is all a checkpoint needs; ``load_state_dict`` accepts one
written under any data-parallel size. Tokens for the loss (`tokens` in the metrics) are
``loss_mask.sum()``; samples are fully packed, so that is ``m * seq_len`` unless
``eod_mask_loss`` is on. With ``document_mask`` a micro-batch also carries ``segment_ids`` and ``position_ids``
[m, seq_len] int64 (`document_ids`: documents split at EOD; positions restarting per document with
``reset_position_ids``, 0..seq_len-1 otherwise); the loss mask and tokens are the same as without.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from llmtrain.data.blend import Blend
from llmtrain.data.indexed import IndexedDataset
from llmtrain.data.inputs import check_made_with, open_prefix, weights_problem
from llmtrain.data.packing import PackedSplit, parse_split
from llmtrain.utils.paths import resolve_path
from llmtrain.data.sampler import StepSampler
from llmtrain.tokenizer import load_tokenizer


def document_ids(input_ids: np.ndarray, eod_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents of packed samples: input_ids [m, s] -> (segment_ids, position_ids) [m, s] int64.

    A document ends with its EOD token, so position t starts a new document when t - 1 holds an EOD: segment_ids
    counts the EODs before each position (0 for the row's first, possibly truncated, document), position_ids counts
    from each document's first position (0, 1, ...)."""
    eod = input_ids == eod_id  # [m, s]
    starts = np.zeros_like(eod)
    starts[:, 1:] = eod[:, :-1]  # a document starts after each EOD
    segments = np.cumsum(starts, axis=1).astype(np.int64)
    index = np.broadcast_to(np.arange(input_ids.shape[1], dtype=np.int64), input_ids.shape)
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)  # [m, s]: where each position's document began
    return segments, index - first


def document_problems(data_cfg, model) -> list[str]:
    """`data.document_mask` / `data.reset_position_ids` are for decoder pretraining batches."""
    on = [k for k in ("document_mask", "reset_position_ids") if getattr(data_cfg, k, False)]
    if on and model.family != "decoder":
        return [f"data.{on[0]}=true with model.family={model.family}: per-document attention and positions are built "
                "for decoder pretraining (masked-LM batches ignore them)"]
    return []


class SampleStream:
    """One split (train/valid/test) of several prefixes, blended: global id -> tokens."""

    def __init__(self, datasets: list[IndexedDataset], split: str, split_spec: str, seq_len: int, seed: int,
                 weights, cache_dir: str | None, fingerprints: list[str]):
        self.seq_len = seq_len
        self.parts = [PackedSplit(ds, split, parse_split(split_spec, len(ds))[split], seq_len, seed,
                                  resolve_path(cache_dir) if cache_dir else None, fp)
                      for ds, fp in zip(datasets, fingerprints)]
        sizes = np.array([p.samples_per_epoch for p in self.parts], dtype=np.float64)
        w = np.asarray(weights if weights is not None else sizes, dtype=np.float64)
        w = np.where(sizes > 0, w, 0.0)  # a prefix with no sample in this split cannot be drawn
        if w.sum() <= 0:
            raise ValueError(f"no {split} samples: with data.split={split_spec!r} and data.seq_len={seq_len} "
                             + ", ".join(f"{p.ds.prefix} has {p.n_tokens} {split} tokens" for p in self.parts))
        self.blend = Blend(w)
        self._lock = threading.Lock()

    def get_many(self, ids: np.ndarray, side: str | None = None):
        """[n, seq_len + 1] int64 tokens of global sample ids [n]; with ``side="wbd"`` also the
        [n, seq_len + 1] side-file values (word-start flags) at the same positions."""
        d, k = self.blend.locate(ids.ravel())
        out = np.empty((len(d), self.seq_len + 1), dtype=np.int64)
        extra = np.empty((len(d), self.seq_len + 1), dtype=np.uint8) if side else None
        with self._lock:
            for i in range(len(d)):
                if side:
                    out[i], extra[i] = self.parts[d[i]].get(k[i], side)
                else:
                    out[i] = self.parts[d[i]].get(k[i])
        return out if side is None else (out, extra)

    def epochs_needed(self, n_samples: int) -> list[int]:
        """Epochs of each prefix that the first ``n_samples`` global samples touch."""
        P = self.blend.period
        full, rest = divmod(int(n_samples), P)
        counts = full * self.blend.quota + np.bincount(self.blend.pattern[:rest], minlength=len(self.parts))
        return [int(-(-c // p.samples_per_epoch)) if c else 0 for c, p in zip(counts, self.parts)]


class PretrainData:
    """Tokenizer plus the layout-independent stream of training micro-batches (see module doc)."""

    def __init__(self, cfg, seed: int, global_batch_size: int, micro_batch_size: int, dp_rank: int = 0,
                 dp_world: int = 1, consumed_samples: int = 0, tokenizer=None):
        """`tokenizer`: the already-loaded `cfg.tokenizer` (the entry script has it), else loaded here."""
        self.cfg, self.seed = cfg, int(seed)
        self.seq_len = int(cfg.seq_len)
        if self.seq_len <= 0:
            raise ValueError(f"data.seq_len={self.seq_len}: must be positive")
        self.sampler = StepSampler(global_batch_size, micro_batch_size, dp_rank, dp_world)
        self.global_batch_size, self.micro_batch_size = int(global_batch_size), int(micro_batch_size)
        self.tokenizer = tokenizer or load_tokenizer(resolve_path(cfg.tokenizer))
        prefixes = list(cfg.prefixes)
        if not prefixes:
            raise ValueError("data.prefixes is empty: give at least one MMIDIDX prefix")
        weights = None if cfg.weights is None else [float(w) for w in cfg.weights]
        if weights_problem(prefixes, weights):
            raise ValueError(weights_problem(prefixes, weights))
        self.datasets = []
        for p in prefixes:  # the checks llmtrain.resolve ran up front (llmtrain.data.inputs), raised here
            self.datasets.append(open_prefix(p))
            check_made_with(self.datasets[-1].prefix, self.tokenizer, self.cfg.tokenizer)
        fps = [ds.fingerprint() for ds in self.datasets]
        self.fingerprint = hashlib.sha256(json.dumps(
            [fps, weights, self.seq_len, str(cfg.split), self.seed]).encode()).hexdigest()[:16]
        args = (str(cfg.split), self.seq_len, self.seed, weights, cfg.cache_dir, fps)
        self.train = SampleStream(self.datasets, "train", *args)
        self._valid_args = args
        self._valid = None
        self._valid_cache: dict = {}
        self.eod_mask_loss = bool(getattr(cfg, "eod_mask_loss", False))
        self.document_mask = bool(getattr(cfg, "document_mask", False))
        self.reset_position_ids = bool(getattr(cfg, "reset_position_ids", False))
        self.consumed_samples = int(consumed_samples)
        self.data_wait_time = 0.0
        self.prefetch = max(0, int(getattr(cfg, "num_workers", 1)))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="data-prefetch") if self.prefetch else None
        self._pending: collections.deque = collections.deque()  # (consumed_samples, future)

    # ------------------------------------------------------------------ batches
    @property
    def accumulation_steps(self) -> int:
        return self.sampler.accumulation

    def _batch(self, tokens: np.ndarray, ids: np.ndarray) -> dict:
        """tokens [m, seq_len + 1] -> the micro-batch dict."""
        input_ids = np.ascontiguousarray(tokens[:, :-1])  # [m, seq_len]
        labels = np.ascontiguousarray(tokens[:, 1:])  # [m, seq_len]
        loss_mask = np.ones(input_ids.shape, dtype=np.float32)  # [m, seq_len]
        if self.eod_mask_loss:
            loss_mask[input_ids == self.tokenizer.eod_id] = 0.0
        out = {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask,
               "sample_ids": np.asarray(ids, dtype=np.int64)}
        if self.document_mask or self.reset_position_ids:
            segments, positions = document_ids(input_ids, self.tokenizer.eod_id)
            out["position_ids"] = positions if self.reset_position_ids else \
                np.broadcast_to(np.arange(input_ids.shape[1], dtype=np.int64), input_ids.shape).copy()
            if self.document_mask:
                out["segment_ids"] = segments
        return out

    def _micro_batches(self, stream: "SampleStream", ids: np.ndarray, split: str) -> list[dict]:
        """ids [k, m] global sample ids of `stream` -> k micro-batches (subclasses change the objective here)."""
        tokens = stream.get_many(ids.ravel())  # [k * m, seq_len + 1]
        m = ids.shape[1]
        return [self._batch(tokens[a * m:(a + 1) * m], ids[a]) for a in range(len(ids))]

    def step_batches(self, consumed_samples: int) -> list[dict]:
        """This rank's micro-batches of the step that starts after ``consumed_samples`` (no state change)."""
        return self._micro_batches(self.train, self.sampler.rank_ids(consumed_samples), "train")

    def next_step(self) -> list[dict]:
        """Micro-batches of the next step for this data rank; advances ``consumed_samples`` by G."""
        t0 = time.perf_counter()
        c = self.consumed_samples
        if self._pending and self._pending[0][0] == c:
            mbs = self._pending.popleft()[1].result()
        else:
            self._pending.clear()
            mbs = self.step_batches(c)
        self.consumed_samples = c + self.sampler.batch_at(c)
        if self._pool is not None:
            last = self._pending[-1][0] if self._pending else None
            nxt = last + self.sampler.batch_at(last) if last is not None else self.consumed_samples
            while len(self._pending) < self.prefetch:
                self._pending.append((nxt, self._pool.submit(self.step_batches, nxt)))
                nxt += self.sampler.batch_at(nxt)
        self.data_wait_time = time.perf_counter() - t0
        return mbs

    def use_rampup(self, rampup) -> None:
        """Grow the global batch with consumed samples (`llmtrain.data.rampup.BatchRampup`); before the first step."""
        self.sampler.rampup = rampup
        self._pending.clear()

    def valid_batches(self, n_batches: int, micro_batch_size: int | None = None) -> list[dict]:
        """The first ``n_batches`` micro-batches of the validation stream: identical on every rank and layout."""
        m = int(micro_batch_size or self.micro_batch_size)
        key = (int(n_batches), m)
        if key not in self._valid_cache:
            if self._valid is None:
                self._valid = SampleStream(self.datasets, "valid", *self._valid_args)
            ids = np.arange(n_batches * m, dtype=np.int64).reshape(n_batches, m)
            self._valid_cache = {key: self._micro_batches(self._valid, ids, "valid")}
        return self._valid_cache[key]

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "global_batch_size": self.global_batch_size,
                "seed": self.seed, "seq_len": self.seq_len, "data_fingerprint": self.fingerprint,
                "tokenizer": self.tokenizer.identity()["sha256"]}

    def load_state_dict(self, state: dict) -> None:
        """Continue after ``state["consumed_samples"]`` (any dp size, any micro-batch size)."""
        if state.get("data_fingerprint") not in (None, self.fingerprint):
            warnings.warn(f"resuming on different data, weights, seq_len, split or seed (fingerprint "
                          f"{state['data_fingerprint']} -> {self.fingerprint}): the sample order changes")
        self._pending.clear()
        self.consumed_samples = int(state["consumed_samples"])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def summary(self) -> str:
        lines = [f"tokenizer {self.tokenizer.name}: vocab_size {self.tokenizer.vocab_size} "
                 f"({self.tokenizer.sp_vocab_size} pieces), eod {self.tokenizer.eod_id}"]
        for part, w in zip(self.train.parts, self.train.blend.weights):
            lines.append(f"{part.ds.prefix}: weight {w:.3f}, {part.ds.n_docs} documents, "
                         f"train {part.n_docs} docs / {part.n_tokens} tokens / {part.samples_per_epoch} "
                         f"samples per epoch of {self.seq_len + 1} tokens")
        return "\n".join(lines)


def main(argv=None) -> int:
    from llmtrain.data.config import load_data_config

    p = argparse.ArgumentParser(description="Build the packing indices of a data config ahead of a run.")
    p.add_argument("--data", required=True, help="a conf/data/*.yaml file")
    p.add_argument("--seed", type=int, required=True, help="the run's seed (root config `seed`)")
    p.add_argument("--samples", type=int, default=0,
                   help="training samples the run will consume (train.max_steps x global batch size)")
    p.add_argument("overrides", nargs="*", help="data config overrides, e.g. seq_len=256")
    a = p.parse_args(argv)
    cfg = load_data_config(a.data, a.overrides)
    t0 = time.time()
    data = PretrainData(cfg, a.seed, 1, 1)
    print(data.summary())
    epochs = data.train.epochs_needed(max(a.samples, 1))
    for part, n in zip(data.train.parts, epochs):
        for e in range(max(n, 1)):
            files, built = part.build(e)
            print(f"  train epoch {e}: {'built' if built else 'cached'} {files['sample'].parent}/"
                  f"{part.cache_name(e)}.*.npy")
    valid = SampleStream(data.datasets, "valid", *data._valid_args)
    for part in valid.parts:
        if part.samples_per_epoch:
            files, built = part.build(0)
            print(f"  valid epoch 0: {'built' if built else 'cached'} {part.cache_name(0)}")
    first = data.step_batches(0)[0]["input_ids"][0]
    print(f"done in {time.time() - t0:.1f} s; first sample starts: {data.tokenizer.decode(first[:40])!r}")
    data.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

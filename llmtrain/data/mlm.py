"""Masked-LM batches for encoder (ERNIE/BERT) pretraining: the packed stream of PretrainData, masked.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=ernie-tiny +parallel=tp2
    python -m llmtrain.data.mlm --data conf/data/pd1998.yaml --seed 1234 [masking.strategy=entity ...]

    data = MLMData(cfg.data, seed=cfg.seed, global_batch_size=G, micro_batch_size=m, dp_rank=r, dp_world=W)
    mbs = data.next_step()   # G // (m*W) micro-batches for this data rank, each a dict of numpy arrays:
                             #   input_ids int64 [m, seq_len]   tokens with masked positions corrupted
                             #   labels    int64 [m, seq_len]   the original tokens
                             #   loss_mask float32 [m, seq_len] 1 at the masked positions only
                             #   sample_ids int64 [m]

`llmtrain/pretrain.py` uses this class when ``model.family=encoder`` (the objective follows the
model family). Samples, order, prefetching and checkpoint state are PretrainData's
(:mod:`llmtrain.data.loader`): an MLM sample is the first ``seq_len`` tokens of the packed
``seq_len + 1`` sample with the same global id (no shift), with the word-start flags of the
``PREFIX.wbd`` side file at the same positions when the strategy needs words. Masking
(:mod:`llmtrain.data.masking`) is a function of (seed, global sample id) and the sample itself,
so every layout, micro-batch size and resume sees the same masks. Tokens for the loss
(the `tokens` of the metrics, :mod:`llmtrain.train.metrics`) are ``loss_mask.sum()``: the masked positions.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, is_dataclass

import numpy as np
from omegaconf import OmegaConf

from llmtrain.data.inputs import missing_word_boundaries
from llmtrain.data.loader import PretrainData, SampleStream
from llmtrain.data.masking import Masker, check_masking_config
from llmtrain.utils.log import log0


def _masking_dict(cfg) -> dict:
    m = cfg.masking
    if is_dataclass(m):
        return asdict(m)
    return OmegaConf.to_container(m, resolve=True) if OmegaConf.is_config(m) else dict(m)


class MLMData(PretrainData):
    """PretrainData whose micro-batches are masked for the MLM objective (see the module doc)."""

    def __init__(self, cfg, seed: int, global_batch_size: int, micro_batch_size: int, dp_rank: int = 0,
                 dp_world: int = 1, consumed_samples: int = 0, tokenizer=None):
        bad = check_masking_config(cfg.masking)
        if bad:
            raise ValueError("invalid data.masking:\n  - " + "\n  - ".join(bad))
        super().__init__(cfg, seed, global_batch_size, micro_batch_size, dp_rank, dp_world, consumed_samples, tokenizer)
        lexicon = None
        if cfg.masking.strategy == "entity":
            from llmtrain.data.lexicon import build_lexicon

            lexicon = build_lexicon(cfg.masking, self.tokenizer)
        self.masker = Masker(cfg.masking, self.tokenizer, self.seed, lexicon)
        self.side = "wbd" if self.masker.needs_word_starts else None
        if self.side:
            missing = missing_word_boundaries(cfg.masking.strategy, [ds.prefix for ds in self.datasets])
            if missing:
                raise FileNotFoundError(missing)
        masking = _masking_dict(cfg)
        if lexicon is not None:
            masking["lexicon_sha256"] = lexicon.sha256
        self.fingerprint = hashlib.sha256(json.dumps([self.fingerprint, masking], sort_keys=True)
                                          .encode()).hexdigest()[:16]
        self.mask_time = 0.0  # seconds spent masking in the last step_batches call
        log0(self.masker.describe())
        if self.seq_len < 50:
            log0(f"data.seq_len={self.seq_len}: with under 50 maskable tokens per sample the masked fraction of a "
                 f"batch may differ from data.masking.prob by up to {50 / self.seq_len:.1f} points (each sample gets "
                 "a whole number of masked tokens)")

    # ------------------------------------------------------------------ batches
    def _micro_batches(self, stream: SampleStream, ids: np.ndarray, split: str) -> list[dict]:
        """ids [k, m] global sample ids -> k masked micro-batches."""
        flat = ids.ravel()
        got = stream.get_many(flat, side=self.side)
        tokens, flags = got if self.side else (got, None)
        S = self.seq_len
        tokens = tokens[:, :S]  # [k*m, S]: the first seq_len tokens of each packed sample, no shift
        flags = flags[:, :S] if flags is not None else None
        t0 = time.perf_counter()
        m = ids.shape[1]
        out = []
        for a in range(ids.shape[0]):
            rows = slice(a * m, (a + 1) * m)
            mb = self.masker(tokens[rows], ids[a], None if flags is None else flags[rows], split=split)
            out.append({"input_ids": mb.input_ids, "labels": mb.labels, "loss_mask": mb.loss_mask,
                        "sample_ids": np.asarray(ids[a], dtype=np.int64)})
        self.mask_time = time.perf_counter() - t0
        return out

    def summary(self) -> str:
        return super().summary() + "\n" + self.masker.describe()


def main(argv=None) -> int:
    from llmtrain.data.config import load_data_config

    p = argparse.ArgumentParser(description="Show the masked-LM batches of a data config.")
    p.add_argument("--data", required=True, help="a conf/data/*.yaml file")
    p.add_argument("--seed", type=int, required=True, help="the run's seed (root config `seed`)")
    p.add_argument("--batch", type=int, default=8, help="samples to mask")
    p.add_argument("overrides", nargs="*", help="data config overrides, e.g. masking.strategy=ngram")
    a = p.parse_args(argv)
    data = MLMData(load_data_config(a.data, a.overrides), a.seed, a.batch, a.batch)
    print(data.summary())
    (mb,) = data.next_step()
    tok, sel = data.tokenizer, mb["loss_mask"].astype(bool)
    maskable = data.masker.maskable(mb["labels"])
    print(f"masked {int(sel.sum())} of {int(maskable.sum())} maskable tokens "
          f"({sel.sum() / max(maskable.sum(), 1):.2%}); {data.mask_time * 1e3:.2f} ms to mask")
    row = mb["labels"][0]
    shown = "".join(f"[{tok.id_to_piece(t)}]" if s else tok.id_to_piece(t) for t, s in zip(row[:80], sel[0][:80]))
    print(f"sample {int(mb['sample_ids'][0])}, masked tokens in brackets:\n{shown}")
    data.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Supervised fine-tuning data: prompt/response or chat records -> fixed-length samples whose
loss falls on response tokens only, in a layout-independent order.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/finetune.py +parallel=dp2 \
        data.files=[chat.jsonl] data.tokenizer=DIR model.init_from=PADDLENLP_DIR

Records (jsonl, one object per line):
    {"prompt": "...", "response": "..."}
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
Rendering: <bos>, then per turn a role header "<|user|>\\n" (text, tokenized as such)
and the content; every assistant turn ends with <eos>. The loss mask is 1 on the
assistant contents and their <eos> (the targets the model should learn to
produce), 0 on the bos, headers, system and user text, and padding; the token
accounting counts exactly these positions.

One example per sample, padded to seq_len + 1 with <pad> (padding sits after the
example, so causal attention never lets a real token see it); or, with
`data.packing=true`, several examples per sample (PaddleNLP's zero-padding /
`intokens`): each example contributes its len - 1 (input, target) pairs, the
examples are placed best-fit-decreasing into rows of seq_len positions, and each
sample carries `position_ids` (restarting at 0 in every example) and `segment_ids`
(the example's index in the row, non-decreasing; padding one more segment), so the
model's attention stays inside each example (block-diagonal causal: an explicit mask
on CPU, flashmask's per-example end rows on GPU). The packing efficiency (real
positions / all positions) is logged beside the one-example-per-row figure. A
"sample" of the global batch is then a packed row. Not with pipeline parallelism
(resolve refuses it: the stage boundary carries the hidden states only). An example longer than
seq_len + 1 is truncated and counted; one whose response is cut away entirely,
malformed JSON, a missing or non-string field, an unknown role or an empty
response are bad records: counted by kind with file:line, never silent
(`data.strict=true` stops at the first).

Order: global sample g is example perm_e[g mod N] of epoch e = g div N, perm_e a
permutation seeded by (seed, e); steps and data ranks cut the stream exactly as
pretraining does (`sampler.StepSampler`).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import List

import numpy as np
from omegaconf import MISSING

from llmtrain.corpus.badrecords import KINDS, BadRecords
from llmtrain.data.sampler import StepSampler
from llmtrain.tokenizer import load_tokenizer
from llmtrain.utils.log import log0

KINDS.update({
    "bad_message": "a chat message that is not {role, content} with a known role",
    "no_response": "no assistant/response text to learn from (empty, or cut away by seq_len)",
})
ROLES = ("system", "user", "assistant")


@dataclass
class SFTDataConfig:
    files: List[str] = MISSING
    """jsonl files of {"prompt", "response"} or {"messages": [...]} records."""

    tokenizer: str = MISSING
    """Tokenizer directory (ours, `python -m llmtrain.tokenizer.train`); its padded vocab_size sizes the model."""

    seq_len: int = 256
    """Tokens per sample fed to the model (examples are padded or truncated to seq_len + 1)."""

    valid_files: List[str] = field(default_factory=list)
    """Held-out records for evaluation; empty: evaluation reads the first training examples in file order."""

    prompt_key: str = "prompt"
    """Field of the prompt in prompt/response records."""

    response_key: str = "response"
    """Field of the response in prompt/response records."""

    strict: bool = False
    """Stop at the first bad record (with its file and line) instead of counting it."""

    packing: bool = False
    """Pack several examples into each sequence, attention cut between them (see the module docstring)."""


def packing_problems(data_cfg, parallel) -> list[str]:
    """Problems of `data.packing` under this layout (empty: fine)."""
    if getattr(data_cfg, "packing", False) and parallel is not None and parallel.pp > 1:
        return [f"data.packing=true with parallel.pp={parallel.pp}: packed sequences need per-example "
                "positions and attention boundaries inside every stage; not implemented under pipeline "
                "parallelism (use dp/tp/sharding, or data.packing=false)"]
    return []


def render(turns: list[tuple[str, str]], tok) -> tuple[list[int], list[int]]:
    """(ids, mask) of one conversation; mask[i] = 1 where ids[i] is a target to learn."""
    ids, mask = [tok.bos_id], [0]
    for role, content in turns:
        header = tok.encode(f"<|{role}|>\n")
        body = tok.encode(content)
        ids += header + body
        learn = 1 if role == "assistant" else 0
        mask += [0] * len(header) + [learn] * len(body)
        if role == "assistant":
            ids.append(tok.eos_id)
            mask.append(1)
    return ids, mask


def parse_record(obj, cfg: SFTDataConfig):
    """[(role, content), ...] or (bad kind, detail)."""
    if not isinstance(obj, dict):
        return "not_an_object", type(obj).__name__
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            return "bad_message", "messages is not a non-empty list"
        turns = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                return "bad_message", f"message {i}: {str(m)[:60]}"
            turns.append((m["role"], m["content"]))
        if not any(r == "assistant" and c.strip() for r, c in turns):
            return "no_response", "no assistant message with text"
        return turns
    for key in (cfg.prompt_key, cfg.response_key):
        if obj.get(key) is None:
            return "missing_field", key
        if not isinstance(obj[key], str):
            return "non_string_field", f"{key} is {type(obj[key]).__name__}"
    if not obj[cfg.response_key].strip():
        return "no_response", f"empty {cfg.response_key}"
    return [("user", obj[cfg.prompt_key]), ("assistant", obj[cfg.response_key])]


def load_examples(files, tok, cfg: SFTDataConfig, bad: BadRecords):
    """tokens [N, seq_len + 1] (padded with pad_id) and loss mask [N, seq_len + 1], plus the truncation count."""
    examples, truncated = load_records(files, tok, cfg, bad)
    return (*pad_examples(examples, cfg.seq_len + 1, tok.pad_id), truncated)


def pad_examples(examples, width: int, pad_id: int):
    """tokens [N, width] (padded with pad_id after each example) and loss mask [N, width]."""
    rows = np.full((len(examples), width), pad_id, dtype=np.int64)
    masks = np.zeros((len(examples), width), dtype=np.float32)
    for i, (ids, mask) in enumerate(examples):
        rows[i, : len(ids)] = ids
        masks[i, : len(mask)] = mask
    return rows, masks


def pack_examples(examples, seq_len: int, pad_id: int) -> dict:
    """Best-fit-decreasing packing of (ids, mask) examples into rows of seq_len positions.

    Returns arrays [M, seq_len]: input_ids, labels, loss_mask (of the targets), position_ids
    (0.. within each example), segment_ids (example index within the row; padding gets one
    more), and `examples_per_row` [M]. An example of n tokens takes n - 1 positions."""
    import bisect

    order = sorted(range(len(examples)), key=lambda i: (-(len(examples[i][0]) - 1), i))
    free: list = []  # sorted (remaining positions, row index)
    rows: list = []
    for i in order:
        need = len(examples[i][0]) - 1
        at = bisect.bisect_left(free, (need, -1))
        if at == len(free):
            rows.append([])
            r, left = len(rows) - 1, seq_len
        else:
            left, r = free.pop(at)
        rows[r].append(i)
        if left - need > 0:
            bisect.insort(free, (left - need, r))
    m = len(rows)
    out = {"input_ids": np.full((m, seq_len), pad_id, np.int64), "labels": np.full((m, seq_len), pad_id, np.int64),
           "loss_mask": np.zeros((m, seq_len), np.float32), "position_ids": np.zeros((m, seq_len), np.int64),
           "segment_ids": np.zeros((m, seq_len), np.int64), "examples_per_row": np.zeros(m, np.int64)}
    for r, members in enumerate(rows):
        at = 0
        for seg, i in enumerate(sorted(members)):
            ids, mask = examples[i]
            n = len(ids) - 1
            out["input_ids"][r, at: at + n] = ids[:-1]
            out["labels"][r, at: at + n] = ids[1:]
            out["loss_mask"][r, at: at + n] = mask[1:]
            out["position_ids"][r, at: at + n] = np.arange(n)
            out["segment_ids"][r, at: at + n] = seg
            at += n
        out["segment_ids"][r, at:] = len(members)  # padding: a segment of its own after the examples
        out["examples_per_row"][r] = len(members)
    return out


def load_records(files, tok, cfg: SFTDataConfig, bad: BadRecords):
    """[(ids int64 [n], mask float32 [n]), ...] with n <= seq_len + 1, plus the truncation count."""
    truncated = [0]
    examples = list(iter_records(files, tok, cfg, bad, truncated))
    if not examples:
        raise ValueError(f"data.files {list(files)}: no usable example ({bad.report()})")
    return examples, truncated[0]


def first_usable_problem(key: str, files, tok, cfg: SFTDataConfig):
    """The problem of record files (`data.<key>`) without one usable example (None: the first one was found), for
    `llmtrain.data.inputs` before any work; the files are read up to their first usable record."""
    bad = BadRecords(strict=cfg.strict)
    try:
        if next(iter_records(files, tok, cfg, bad, [0]), None) is not None:
            return None
    except ValueError as e:  # --strict: the first bad record, with its file:line
        return f"data.{key}: {e}"
    return (f"data.{key}={list(files)}: no usable example (a prompt and a response within data.seq_len="
            f"{cfg.seq_len}): " + (bad.report() if bad.counts else "the files hold no record"))


def iter_records(files, tok, cfg: SFTDataConfig, bad: BadRecords, truncated: list):
    """Yield (ids int64 [n], mask float32 [n]) of each usable record, n <= seq_len + 1; bad records are counted in
    `bad`, truncated ones in `truncated[0]`."""
    width = cfg.seq_len + 1
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data.files: {path} does not exist")
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    bad.add("invalid_utf8", path, line_no, str(e)[:80])
                    continue
                if not text.strip():
                    bad.add("blank_line", path, line_no)
                    continue
                try:
                    parsed = parse_record(json.loads(text), cfg)
                except json.JSONDecodeError as e:
                    bad.add("malformed_json", path, line_no, str(e)[:80])
                    continue
                if isinstance(parsed, tuple):
                    bad.add(parsed[0], path, line_no, parsed[1])
                    continue
                ids, mask = render(parsed, tok)
                if len(ids) > width:
                    truncated[0] += 1
                    ids, mask = ids[:width], mask[:width]
                if sum(mask[1:]) == 0:
                    bad.add("no_response", path, line_no, f"response starts beyond seq_len={cfg.seq_len}")
                    continue
                yield np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.float32)


class SFTData:
    """Same interface as `PretrainData`: next_step(), valid_batches(), consumed_samples, state_dict()."""

    def __init__(self, cfg: SFTDataConfig, seed: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_world: int = 1, consumed_samples: int = 0, tokenizer=None):
        self.cfg, self.seed = cfg, int(seed)
        self.seq_len = int(cfg.seq_len)
        self.tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
        self.bad = BadRecords(strict=cfg.strict)
        pad, width = self.tokenizer.pad_id, self.seq_len + 1
        examples, truncated = load_records(list(cfg.files), self.tokenizer, cfg, self.bad)
        self.tokens, self.mask = pad_examples(examples, width, pad)
        self.valid_tokens = self.valid_mask = valid = None
        if cfg.valid_files:
            valid, _ = load_records(list(cfg.valid_files), self.tokenizer, cfg, self.bad)
            self.valid_tokens, self.valid_mask = pad_examples(valid, width, pad)
        self.packed = self.valid_packed = None
        if cfg.packing:
            self.packed = pack_examples(examples, self.seq_len, pad)
            if valid is not None:
                self.valid_packed = pack_examples(valid, self.seq_len, pad)
            real = int((self.packed["segment_ids"] < self.packed["examples_per_row"][:, None]).sum())
            self.packing_efficiency = real / self.packed["input_ids"].size
            log0(f"sft packing: {len(self.tokens)} examples in {len(self.packed['input_ids'])} rows of {self.seq_len} "
                 f"positions; packing efficiency (real positions / positions) {self.packing_efficiency:.3f}, "
                 f"one example per row {real / (len(self.tokens) * self.seq_len):.3f}")
        self.sampler = StepSampler(global_batch_size, micro_batch_size, dp_rank, dp_world)
        self.micro_batch_size = int(micro_batch_size)
        self.consumed_samples = int(consumed_samples)
        self.data_wait_time = 0.0
        self._perms: dict = {}
        log0(f"sft data: {len(self.tokens)} examples from {len(cfg.files)} file(s), {int(self.mask[:, 1:].sum())} "
             f"response tokens, {truncated} truncated to seq_len+1={self.seq_len + 1}; {self.bad.report()}")

    @property
    def n_samples(self) -> int:
        """Samples of one epoch: examples, or packed rows."""
        return len(self.packed["input_ids"]) if self.packed is not None else len(self.tokens)

    def _example(self, g: np.ndarray) -> np.ndarray:
        n = self.n_samples
        out = np.empty_like(g)
        for e in np.unique(g // n):
            if e not in self._perms:
                self._perms[e] = np.random.default_rng([self.seed, int(e)]).permutation(n)
            sel = g // n == e
            out[sel] = self._perms[e][g[sel] % n]
        return out

    @staticmethod
    def _batch(tokens, mask, ids) -> dict:
        return {
            "input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask[:, 1:],
            "sample_ids": ids,
        }

    @staticmethod
    def _packed_batch(packed: dict, rows, ids) -> dict:
        out = {k: packed[k][rows] for k in ("input_ids", "labels", "loss_mask", "position_ids", "segment_ids")}
        return dict(out, sample_ids=ids)

    def _rows(self, ex, row_ids, valid: bool = False) -> dict:
        if self.packed is not None:
            return self._packed_batch(self.valid_packed if valid and self.valid_packed is not None else self.packed,
                                      ex, row_ids)
        tokens, mask = (self.valid_tokens, self.valid_mask) if valid and self.valid_tokens is not None \
            else (self.tokens, self.mask)
        return self._batch(tokens[ex], mask[ex], row_ids)

    def next_step(self) -> list[dict]:
        t0 = time.perf_counter()
        ids = self.sampler.rank_ids(self.consumed_samples)  # [accum, micro]
        out = []
        for row in ids:
            out.append(self._rows(self._example(row), row))
        self.consumed_samples += self.sampler.global_batch_size
        self.data_wait_time = time.perf_counter() - t0
        return out

    def valid_batches(self, n_batches: int) -> list[dict]:
        if self.packed is not None:
            n = len((self.valid_packed or self.packed)["input_ids"])
        else:
            n = len(self.valid_tokens if self.valid_tokens is not None else self.tokens)
        m = self.micro_batch_size
        return [self._rows(np.arange(b * m, (b + 1) * m) % n, np.arange(b * m, (b + 1) * m) % n, valid=True)
                for b in range(n_batches)]

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "examples": int(self.n_samples),
                "global_batch_size": self.sampler.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("examples", self.n_samples) != self.n_samples:
            log0(f"warning: the checkpoint saw {state['examples']} samples, the data now has {self.n_samples}")
        self.consumed_samples = int(state["consumed_samples"])

"""Packed SFT: several examples per row, attention cut between them, positions restarting per example.

    python -m pytest tests/data/test_sft_packing.py -q

A packed row must give every example the loss and the gradients it gets alone (1e-5), for a GPT-style
(learned positions) and a Llama-style (RoPE, GQA) decoder on CPU's explicit block-diagonal mask; the
packer must place every example exactly once, in rows of seq_len positions, with its targets and mask.
"""
from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from llmtrain.data.sft import pack_examples
from llmtrain.models import build_model
from llmtrain.models.config import ModelConfig
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import init_parameters

CFGS = {
    "gpt": ModelConfig(name="gpt", hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, vocab_size=97,
                       max_position_embeddings=64, position="learned", attention="math"),
    "llama": ModelConfig(name="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                         vocab_size=97, max_position_embeddings=64, position="rope", norm="rmsnorm",
                         activation="swiglu", bias=False, tie_embeddings=False, attention="math"),
}
PAD = 0


def make_examples(rng, lengths):
    out = []
    for n in lengths:
        ids = rng.integers(1, 97, n).astype(np.int64)
        mask = np.zeros(n, np.float32)
        mask[rng.integers(1, n - 1):] = 1  # a prompt, then the response to learn
        out.append((ids, mask))
    return out


def test_packer_places_every_example_once_with_its_targets():
    rng = np.random.default_rng(0)
    lengths = list(rng.integers(3, 30, 40))
    examples = make_examples(rng, lengths)
    seq = 32
    p = pack_examples(examples, seq, PAD)
    rows = len(p["input_ids"])
    assert rows < len(examples) and rows >= int(np.ceil(sum(n - 1 for n in lengths) / seq))
    found = []
    for r in range(rows):
        seg, pos = p["segment_ids"][r], p["position_ids"][r]
        assert (np.diff(seg) >= 0).all()
        for s in range(p["examples_per_row"][r]):
            at = np.flatnonzero(seg == s)
            assert (pos[at] == np.arange(len(at))).all()  # positions restart per example
            found.append((tuple(p["input_ids"][r, at]) + (int(p["labels"][r, at[-1]]),),
                          tuple(p["loss_mask"][r, at])))
        pad = seg == p["examples_per_row"][r]
        assert (p["loss_mask"][r, pad] == 0).all() and (p["input_ids"][r, pad] == PAD).all()
    want = sorted((tuple(ids), tuple(m[1:])) for ids, m in examples)
    assert sorted(found) == want  # every example exactly once, inputs + final target, mask of its targets
    assert p["loss_mask"].sum() == sum(m[1:].sum() for _, m in examples)  # loss-bearing tokens exact
    real = sum(n - 1 for n in lengths)
    assert real / p["input_ids"].size > real / (len(examples) * seq)  # better than one example per row


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_packed_row_gives_each_example_its_unpacked_loss_and_gradients(family):
    cfg = CFGS[family]
    paddle.seed(0)
    model = build_model(cfg)
    params = canonical_parameters(model)
    init_parameters(params, cfg, seed=3)
    rng = np.random.default_rng(1)
    examples = make_examples(rng, [9, 14, 5, 6])
    p = pack_examples(examples, 40, PAD)
    assert len(p["input_ids"]) == 1 and p["examples_per_row"][0] == 4  # one row, with padding at its end

    def ce(ids, labels, **kw):  # [1, s] -> per-token cross entropy [s]
        logits = model(paddle.to_tensor(ids[None]), **{k: paddle.to_tensor(v[None]) for k, v in kw.items()})
        return F.cross_entropy(logits.astype("float32"), paddle.to_tensor(labels[None]).unsqueeze(-1),
                               reduction="none").reshape([-1])

    def grads():
        out = {n: q.grad.numpy().copy() for n, q in params if q.grad is not None}
        model.clear_gradients()
        return out

    # packed: per-example token-mean losses from one forward
    row_ce = ce(p["input_ids"][0], p["labels"][0], position_ids=p["position_ids"][0], segment_ids=p["segment_ids"][0])
    mask, seg = paddle.to_tensor(p["loss_mask"][0]), p["segment_ids"][0]
    packed_losses = []
    for s in range(4):
        sel = paddle.to_tensor((seg == s).astype(np.float32)) * mask
        packed_losses.append((row_ce * sel).sum() / sel.sum())
    paddle.add_n(packed_losses).backward()
    g_packed = grads()
    # unpacked: each example alone, in the row's order
    order = [int(np.flatnonzero([(tuple(e[0][:-1]) == tuple(p["input_ids"][0][seg == s])) for e in examples])[0])
             for s in range(4)]
    alone = []
    for i in order:
        ids, m = examples[i]
        c = ce(ids[:-1], ids[1:])
        mm = paddle.to_tensor(m[1:])
        alone.append((c * mm).sum() / mm.sum())
    paddle.add_n(alone).backward()
    g_alone = grads()
    for a, b in zip(packed_losses, alone):
        assert abs(float(a) - float(b)) <= 1e-5, (float(a), float(b))
    assert set(g_packed) == set(g_alone)
    worst = max(float(np.abs(g_packed[n] - g_alone[n]).max()) for n in g_packed)
    assert worst <= 1e-5, worst
    # the control: without the segment ids (one causal sequence) the later examples' losses change
    leaky = ce(p["input_ids"][0], p["labels"][0], position_ids=p["position_ids"][0])
    sel = paddle.to_tensor((seg == 1).astype(np.float32)) * mask
    assert abs(float((leaky * sel).sum() / sel.sum()) - float(packed_losses[1])) > 1e-3

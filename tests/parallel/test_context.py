"""Context parallelism and per-document attention, in one process: chunking, the block math, the balance of work.

    python -m pytest tests/parallel/test_context.py -q

The exchanges themselves run on cp ranks in tests/parallel/test_context_parity.py; everything that needs no second
process is checked here: the zigzag chunks and what `localize` hands a rank, the log-sum-exp merge and the block
backward against the plain math attention (grouped-query heads, documents, a block a query sees nothing of), the
attention work the ring schedule gives each rank (balanced within 5%; the contiguous cut is not), the up-front
problems, the pretraining loader's document ids, every document of a packed row getting its own loss and gradients,
and the per-rank check failing a layout that fell back to whole-sequence attention.
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import paddle
import pytest

from context_checks import BALANCE, check_context, documents_alone, expected_pairs
from llmtrain.models.config import ModelConfig
from llmtrain.models.layers import math_attention
from llmtrain.parallel.config import ParallelConfig
from llmtrain.parallel.context import context_problems
from llmtrain.parallel.context_chunks import ChunkLayout
from llmtrain.parallel.context_attention import block_backward, block_forward, keep_mask, merge
from llmtrain.parallel.context_exchange import ring_block


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_chunks_cover_the_sequence_once(cp):
    layout = ChunkLayout(seq_len=8 * 2 * cp, cp=cp)
    c = layout.chunk
    assert c == 8 and sorted(layout.order().tolist()) == list(range(layout.seq_len))
    for r in range(cp):
        assert layout.chunks(r) == (r, 2 * cp - 1 - r)
        assert layout.index(r).tolist() == list(range(r * c, (r + 1) * c)) + \
            list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))


def test_localize_cuts_every_sequence_array_and_adds_global_positions():
    layout = ChunkLayout(16, 2)
    ids = np.arange(32).reshape(2, 16)
    mb = {"input_ids": ids, "labels": ids + 1, "loss_mask": np.ones((2, 16), np.float32), "sample_ids": np.array([5, 6])}
    parts = [layout.localize(mb, r) for r in range(2)]
    assert parts[0]["input_ids"][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert parts[1]["position_ids"][1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # global positions
    assert all((p["labels"] == p["input_ids"] + 1).all() for p in parts)  # a label stays with its position
    assert sum(p["loss_mask"].sum() for p in parts) == mb["loss_mask"].sum()  # no token lost or doubled
    assert parts[0]["sample_ids"].tolist() == [5, 6]
    reset = dict(mb, position_ids=np.tile(np.r_[0:6, 0:10], (2, 1)), segment_ids=np.tile(np.r_[[0] * 6, [1] * 10], (2, 1)))
    got = layout.localize(reset, 1)
    assert got["position_ids"][0].tolist() == [4, 5, 0, 1, 2, 3, 4, 5] and got["segment_ids"][0].tolist() == [0, 0] + [1] * 6
    with pytest.raises(ValueError, match="planned for sequences of 16, got 8"):
        ChunkLayout(16, 2).localize({"input_ids": ids[:, :8]}, 0)


def _qkv(b=2, s=16, nh=4, nkv=2, d=8, seed=0):
    paddle.seed(seed)
    q, k, v = paddle.randn([b, s, nh, d]), paddle.randn([b, s, nkv, d]), paddle.randn([b, s, nkv, d])
    for t in (q, k, v):
        t.stop_gradient = False
    return q, k, v


def test_blocks_merged_by_log_sum_exp_equal_whole_attention_and_gradients():
    """Keys in three blocks (the first sees nothing of the third document's queries: -inf rows), GQA, documents:
    output within 1e-6 and every gradient from the per-block backward with the merged out/lse within 1e-5."""
    q, k, v = _qkv()
    seg = paddle.to_tensor(np.repeat([[0] * 5 + [1] * 7 + [2] * 4], 2, 0))
    ref = math_attention(q, k, v, True, None, seg)
    dout = paddle.randn(ref.shape)
    grads = paddle.grad(ref, [q, k, v], dout)
    idx = paddle.arange(16)
    out = lse = None
    blocks = [(0, 6), (6, 11), (11, 16)]
    for a, e in blocks:
        o, l_ = block_forward(q, k[:, a:e], v[:, a:e], keep_mask(idx, idx[a:e], True, seg, seg[:, a:e]))
        out, lse = merge(out, lse, o, l_)
    assert float((out - ref).abs().max()) < 1e-6
    dq, dks, dvs = paddle.zeros_like(q), [], []
    for a, e in blocks:
        g = block_backward(q, k[:, a:e], v[:, a:e], out.detach(), lse.detach(), dout,
                           keep_mask(idx, idx[a:e], True, seg, seg[:, a:e]))
        dq, _ = dq + g[0], dks.append(g[1]) or dvs.append(g[2])
    for got, want in ((dq, grads[0]), (paddle.concat(dks, 1), grads[1]), (paddle.concat(dvs, 1), grads[2])):
        assert float((got - want).abs().max()) < 1e-5


def _needed(layout, rank: int) -> set:
    """(query chunk, key chunk) pairs a rank's causal attention needs: key chunk index <= query chunk index."""
    return {(qi, kj) for qi in layout.chunks(rank) for src in range(layout.cp) for kj in layout.chunks(src) if kj <= qi}


def _ring(layout, rank: int) -> list:
    """(query chunk, key chunk) pairs the ring computes on `rank`, over its steps (`ring_block`)."""
    pairs = []
    for t in range(layout.cp):
        src = (rank - t) % layout.cp
        qs, ks, _ = ring_block(layout, rank, src)
        pairs += [(layout.chunks(rank)[i], layout.chunks(src)[j]) for i in qs for j in ks]
    return pairs


class _Contiguous(ChunkLayout):
    """The cut without load balancing: rank r holds chunks 2r and 2r + 1 (what zigzag avoids)."""

    def chunks(self, rank):
        return 2 * rank, 2 * rank + 1


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_causal_attention_work_is_balanced_and_the_contiguous_cut_is_not(cp):
    """Zigzag: every rank needs 2·cp+1 chunk pairs of the causal triangle (what allgather computes) and the ring
    computes those plus one masked pair (its square step-0 block), on every rank alike; together the ranks cover
    the triangle once. The contiguous cut needs 4r+3 pairs on rank r: imbalanced far beyond 5%."""
    layout = ChunkLayout(2 * cp * 4, cp)
    needed = [_needed(layout, r) for r in range(cp)]
    assert [len(n) for n in needed] == [2 * cp + 1] * cp
    assert sum(len(n) for n in needed) == 2 * cp * (2 * cp + 1) // 2  # the triangle's pairs, each once
    for r in range(cp):
        ring = _ring(layout, r)
        assert len(ring) == len(set(ring)) == 2 * cp + 2 and set(ring) >= needed[r]
        extra = set(ring) - needed[r]
        assert extra == {(r, 2 * cp - 1 - r)}  # the early query chunk's masked pair with its own late keys
    for comm in ("ring", "allgather"):
        work = [expected_pairs(comm, layout.seq_len, cp, heads=1, rows=1) for _ in range(cp)]
        assert work[0] == layout.chunk ** 2 * (2 * cp + (2 if comm == "ring" else 1))
    contiguous = [len(_needed(_Contiguous(layout.seq_len, cp), r)) for r in range(cp)]
    assert max(contiguous) > (1 + BALANCE) * min(contiguous), contiguous


def test_context_problems_name_the_numbers():
    llama = ModelConfig(name="l", hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2, ffn_hidden_size=64,
                        vocab_size=256)
    assert context_problems(ParallelConfig(cp=2), llama, 32) == []
    msgs = " | ".join(context_problems(ParallelConfig(cp=4, cp_comm="a2a"), llama, 36))
    assert "data.seq_len=36 is not divisible by 2 x parallel.cp = 8" in msgs
    assert "model.num_heads=6 / parallel.tp=1 = 6 heads per tp rank is not divisible by parallel.cp=4" in msgs
    assert "model.num_kv_heads=2" in msgs
    sp = ParallelConfig(cp=2, tp=4, sequence_parallel=True)
    assert "a rank's 10 positions (data.seq_len=20 / cp) are not divisible by parallel.tp=4" in \
        context_problems(sp, llama, 20)[0]
    assert "model.family=encoder" in context_problems(ParallelConfig(cp=2), ModelConfig(
        name="e", family="encoder", hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, vocab_size=256), 32)[0]
    assert "use cp_comm=allgather or a2a" in context_problems(ParallelConfig(cp=2), llama, 32, True, on_gpu=True)[0]
    windowed = dataclasses.replace(llama, sliding_window=8)
    assert "model.sliding_window=8 with parallel.cp_comm=ring" in context_problems(ParallelConfig(cp=2), windowed, 32)[0]
    assert context_problems(ParallelConfig(cp=2, cp_comm="a2a"), windowed, 32) == []
    moe = dataclasses.replace(llama, moe_num_experts=4)
    (msg,) = context_problems(ParallelConfig(cp=2), moe, 32)
    assert "Mixture-of-Experts under context parallelism is not implemented: each cp rank would route only its 16 " \
           "of the 32 positions" in msg and "over 1/2 of each micro-batch's tokens" in msg
    mla = dataclasses.replace(llama, num_kv_heads=None, mla_kv_lora_rank=16, mla_qk_nope_head_dim=8,
                              mla_qk_rope_head_dim=8, mla_v_head_dim=4)
    assert all(context_problems(ParallelConfig(cp=2, cp_comm=c), mla, 32) == [] for c in ("ring", "allgather", "a2a"))


def test_resolve_refuses_context_parallel_problems_up_front(tiny_corpus, tmp_path):
    from llmtest import compose, tiny_overrides
    from llmtrain.config import to_config
    from llmtrain.errors import ConfigError
    from llmtrain.resolve import resolve

    cfg = to_config(compose(tiny_overrides(tiny_corpus, str(tmp_path), "llama") + ["+parallel=cp2", "data.seq_len=30",
                                                                         "parallel.cp_comm=a2a", "model.num_kv_heads=1"]))
    with pytest.raises(ConfigError) as e:
        resolve(cfg, world_size=2)
    msg = str(e.value)
    assert "data.seq_len=30 is not divisible by 2 x parallel.cp = 4" in msg and "model.num_kv_heads=1" in msg


def test_pretraining_batches_carry_document_ids_and_keep_their_tokens(tiny_corpus):
    from llmtrain.data.config import load_data_config
    from llmtrain.data.loader import PretrainData

    kw = [f"prefixes=[{tiny_corpus['prefix']}]", f"tokenizer={tiny_corpus['tokenizer']}", "seq_len=64", "num_workers=0"]
    plain = PretrainData(load_data_config(None, kw), 1, 64, 64).step_batches(0)[0]
    docs = PretrainData(load_data_config(None, kw + ["document_mask=true", "reset_position_ids=true"]), 1, 64, 64)
    mb = docs.step_batches(0)[0]  # 64 rows of 64 tokens
    eod = docs.tokenizer.eod_id
    assert (mb["input_ids"] == plain["input_ids"]).all() and (mb["loss_mask"] == plain["loss_mask"]).all()
    for row, seg, pos in zip(mb["input_ids"], mb["segment_ids"], mb["position_ids"]):
        starts = np.r_[0, np.flatnonzero(row[:-1] == eod) + 1]  # a document starts after each EOD
        assert (np.diff(seg) >= 0).all() and seg[-1] == len(starts) - 1
        assert (pos[starts] == 0).all() and (np.diff(pos)[~np.isin(np.arange(1, 64), starts)] == 1).all()
    assert mb["segment_ids"].max() > 0  # some rows hold the end of one document and the start of the next


COMMON = dict(hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, vocab_size=256, max_position_embeddings=64,
              attention="math")
GPT = ModelConfig(name="gpt", position="learned", norm="layernorm", activation="gelu_tanh", bias=True,
                  tie_embeddings=True, **COMMON)
LLAMA = ModelConfig(name="llama", num_kv_heads=2, position="rope", norm="rmsnorm", activation="swiglu",
                    tie_embeddings=False, **COMMON)


def test_every_document_of_a_packed_row_gets_its_own_loss_and_gradients():
    """GPT with positions reset per document and Llama (RoPE: relative, so without reset) within 1e-5; the packed
    row without document ids (tokens attending across documents) and GPT without reset are not."""
    assert documents_alone(GPT, reset=True) <= 1e-5
    assert documents_alone(LLAMA, reset=False) <= 1e-5
    for cfg, reset, documents in ((GPT, False, True), (LLAMA, False, False)):
        with pytest.raises(AssertionError):
            documents_alone(cfg, reset, documents=documents)


def _report(cp=2, seq=32, comm="ring", heads=4, calls=8):
    c = seq // (2 * cp)
    ranks = []
    for r in range(cp):
        chunks = [r, 2 * cp - 1 - r]
        rng = [[i * c, i * c + c - 1] for i in chunks]
        ranks.append({"rank": r, "cp_rank": r, "pp_rank": 0, "blocks": [0], "context": {
            "cp_rank": r, "chunks": chunks, "index_ranges": rng, "positions": rng, "local_positions": 2 * c,
            "score_pairs": expected_pairs(comm, seq, cp, heads, calls), "exchange_bytes": 1}})
    return {"ranks": ranks}


def test_a_layout_that_fell_back_to_whole_sequence_attention_fails_the_context_check():
    good = _report()
    check_context(good, 2, 32, "ring", heads=4, calls=8)
    whole = copy.deepcopy(good)  # every rank attends over the whole sequence (and holds every position)
    for e in whole["ranks"]:
        e["context"].update(score_pairs=4 * 32 * 32 * 8, local_positions=32)
    no_plan = copy.deepcopy(good)
    for e in no_plan["ranks"]:
        del e["context"]
    unbalanced = copy.deepcopy(good)
    unbalanced["ranks"][1]["context"]["score_pairs"] = int(good["ranks"][1]["context"]["score_pairs"] * 1.3)
    contiguous = copy.deepcopy(good)
    contiguous["ranks"][0]["context"]["chunks"] = [0, 1]
    for bad in (whole, no_plan, unbalanced, contiguous):
        with pytest.raises(AssertionError):
            check_context(bad, 2, 32, "ring", heads=4, calls=8)

"""Checks of context parallelism shared by tests/parallel/test_context.py (one process) and the launched processes
of tests/parallel/test_context_parity.py.

    check_context(memory_json, "cp2", seq_len=32, comm="ring")   # what every rank's attention held and did
    documents_alone(model_cfg, plan=None)                         # per-document loss and gradients: packed vs alone
    documents_alone_under_cp(out_dir)                             # the same on cp ranks, every exchange (a `call` entry)

`check_context` reads the "context" entry each rank writes into memory.json (`llmtrain.parallel.context.ContextStats`):
rank r of a cp group must hold chunks r and 2·cp-1-r (index ranges c·i .. c·i + c - 1), their positions (global,
or the documents' own with `data.reset_position_ids`), 2·c positions per row, and have computed as many score
elements as its exchange's schedule says, within 5% of every other rank's: a layout that fell back to
full-sequence attention on every rank (each rank computing the whole causal square, or holding every position)
fails here even where its losses are right.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

BALANCE = 0.05
"""Largest relative difference of attention work between two cp ranks."""


def expected_pairs(comm: str, seq_len: int, cp: int, heads: int, rows: int) -> int:
    """Score elements one rank computes per layer call of `rows` sequences, in c x c chunk pairs per head: ring
    2·cp+2 (its own two chunks as one square causal block at step 0, then two pairs a step: `ring_block`),
    all-gather 2·cp+1 (query chunk i against keys 0 .. (i+1)c: the causal triangle's pairs exactly); a2a the whole
    s x s square for heads / cp heads (the model's math core computes all of it)."""
    c = seq_len // (2 * cp)
    if comm == "a2a":
        return rows * heads // cp * seq_len * seq_len
    return rows * heads * (2 * cp + (2 if comm == "ring" else 1)) * c * c


def check_context(report: dict, cp: int, seq_len: int, comm: str, heads: int, calls: int,
                  reset_positions: bool = False) -> list[int]:
    """Every rank's "context" entry against the layout (see the module docstring); `heads` the query heads on a tp
    rank, `calls` the attention calls x rows of one block in the first step (micro-batches x micro-batch size), times
    the blocks the rank holds (its pipeline stage's, memory.json "blocks"). Returns the score elements of each rank."""
    c = seq_len // (2 * cp)
    work, stages = [], {}
    for e in report["ranks"]:
        ctx = e.get("context")
        assert ctx is not None, f"rank {e['rank']}: no context-parallel entry (the plan was not applied)"
        r = e["cp_rank"]
        assert ctx["cp_rank"] == r and ctx["chunks"] == [r, 2 * cp - 1 - r], (e["rank"], ctx)
        assert ctx["index_ranges"] == [[i * c, i * c + c - 1] for i in ctx["chunks"]], (e["rank"], ctx)
        assert ctx["local_positions"] == 2 * c == seq_len // cp, (e["rank"], ctx["local_positions"], seq_len, cp)
        if not reset_positions:
            assert ctx["positions"] == ctx["index_ranges"], (e["rank"], ctx)
        else:  # positions restart per document: never beyond the sequence index, and not all global
            assert all(0 <= p[0] <= q[0] and p[1] <= q[1] for p, q in zip(ctx["positions"], ctx["index_ranges"]))
        rank_calls = calls * len(e["blocks"])
        want = expected_pairs(comm, seq_len, cp, heads, rank_calls)
        assert ctx["score_pairs"] == want, (e["rank"], comm, ctx["score_pairs"], want)
        assert ctx["exchange_bytes"] > 0, (e["rank"], ctx)
        work.append(ctx["score_pairs"])
        stages.setdefault(e["pp_rank"], []).append(ctx["score_pairs"])
        full = heads * seq_len * seq_len * rank_calls  # one rank attending over the whole sequence (math core: s x s)
        assert ctx["score_pairs"] <= (1 + BALANCE) * full / cp, f"rank {e['rank']}: {ctx['score_pairs']} vs whole {full}"
    for stage, per_rank in stages.items():  # the cp ranks of one pipeline stage
        assert max(per_rank) <= (1 + BALANCE) * min(per_rank), f"stage {stage}: attention work per rank {per_rank}: " \
            "not balanced within 5%"
    return work


# ---- documents of a packed row: each must get what it gets alone
DOCS = (7, 13)
"""Lengths of the first documents of the test row (EOD last); the rest of the row is a third, truncated one."""
SEQ = 32
EOD = 3


def packed_row(vocab: int, seed: int = 0):
    """(input_ids [1, SEQ + 1] numpy, [(start, end) of each document in input positions])."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, vocab, size=SEQ + 1)
    spans, start = [], 0
    for n in DOCS:
        tokens[start + n - 1] = EOD
        spans.append((start, start + n))
        start += n
    spans.append((start, SEQ))
    return tokens[None], spans


def _batch(tokens, spans, doc: int, whole: bool, reset: bool, documents: bool = True) -> dict:
    """The micro-batch that scores document `doc` alone (whole=False: its tokens only) or inside the packed row:
    loss on the document's positions whose label is in the document too."""
    from llmtrain.data.loader import document_ids

    a, e = spans[doc]
    if not whole:
        tokens = tokens[:, a:e + 1]
        a, e = 0, e - a
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    mask = np.zeros(ids.shape, np.float32)
    mask[:, a:e - 1] = 1.0  # the document's last position predicts the next document's first token: not its own
    mb = {"input_ids": ids, "labels": labels, "loss_mask": mask}
    if whole:
        segments, positions = document_ids(ids, EOD)
        if documents:
            mb["segment_ids"] = segments
        if reset:
            mb["position_ids"] = positions
    return mb


def _build(model_cfg, roles=None):
    from llmtrain.models import build_model
    from llmtrain.models.init import init_parameters
    from llmtrain.models.stages import canonical_parameters

    model = build_model(model_cfg, roles)
    init_parameters(canonical_parameters(model), model_cfg, 1234)  # same draw by canonical name on every rank
    return model


def _loss_and_grads(model, loss_fn, mb, inputs=lambda mb: mb, reduce=lambda g: g):
    from llmtrain.models.stages import canonical_parameters
    from llmtrain.train.step import packing_inputs, to_tensors

    mb = inputs(mb)
    ids, labels = to_tensors(mb)
    loss_sum, tokens = loss_fn(model(ids, **packing_inputs(mb)), labels)
    model.clear_gradients()
    loss_sum.backward()
    grads = {n: reduce(p.grad.clone()).numpy() for n, p in canonical_parameters(model) if p.grad is not None}
    return float(loss_sum), float(tokens), grads


def documents_alone(model_cfg, reset: bool, plan=None, documents: bool = True) -> float:
    """Largest difference, over the documents of `packed_row` and every parameter gradient, between a document
    scored alone (a plain one-process model) and inside the packed row with document masks (`data.document_mask`;
    `reset`: positions restart per document) — on this process, or through the cp `plan` (a `ContextPlan`:
    this rank's chunks, losses summed over cp, gradients all-reduced over cp). Raises above 1e-5 (relative to the
    largest gradient element). `documents=False`: the packed row without document ids (the negative control)."""
    import paddle.distributed as dist

    from llmtrain.models.roles import Roles

    tokens, spans = packed_row(model_cfg.vocab_size)
    plain = _build(model_cfg)
    packed = plain if plan is None else _build(model_cfg, plan.roles(Roles()))
    loss_fn = packed.loss_fn if plan is None else plan.loss(packed.loss_fn)
    inputs = (lambda mb: mb) if plan is None else plan.localize

    def over_cp(g):
        if plan is not None:
            dist.all_reduce(g, group=plan.group)
        return g

    worst = 0.0
    for d in range(len(spans)):
        alone = _loss_and_grads(plain, plain.loss_fn, _batch(tokens, spans, d, False, reset))
        inside = _loss_and_grads(packed, loss_fn, _batch(tokens, spans, d, True, reset, documents), inputs,
                                 over_cp)
        assert inside[1] == alone[1], ("tokens", d, inside[1], alone[1])
        assert abs(inside[0] - alone[0]) <= 1e-5 * max(1.0, abs(alone[0])), ("loss", d, inside[0], alone[0])
        assert alone[2].keys() == inside[2].keys()
        scale = max(float(np.abs(g).max()) for g in alone[2].values())
        for name, g in alone[2].items():
            diff = float(np.abs(inside[2][name] - g).max()) / scale
            worst = max(worst, diff)
            assert diff <= 1e-5, ("gradient", d, name, diff)
    return worst


def documents_alone_under_cp(out_dir: str) -> None:
    """In a cp2 launch (after fleet is initialised): `documents_alone` through every exchange, GPT (learned
    positions, reset per document) and Llama (RoPE, GQA; positions not reset: RoPE sees relative positions);
    rank 0 writes the worst differences to out_dir/documents.json."""
    import paddle.distributed as dist

    from llmtrain.models.config import ModelConfig
    from types import SimpleNamespace

    from paddle.distributed import fleet

    from llmtrain.parallel.context import ContextPlan

    hcg = fleet.get_hybrid_communicate_group()
    topo = SimpleNamespace(cp_rank=hcg.get_sep_parallel_rank(), cp_world=hcg.get_sep_parallel_world_size(),
                           cp_group=hcg.get_sep_parallel_group())
    common = dict(hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, vocab_size=256,
                  max_position_embeddings=64, attention="math")
    models = {"gpt": (ModelConfig(name="gpt", position="learned", norm="layernorm", activation="gelu_tanh", bias=True,
                                  tie_embeddings=True, **common), True),
              "llama": (ModelConfig(name="llama", num_kv_heads=2, position="rope", norm="rmsnorm", activation="swiglu",
                                    tie_embeddings=False, **common), False)}
    out = {}
    for comm in ("ring", "allgather", "a2a"):
        for name, (cfg, reset) in models.items():
            out[f"{name}_{comm}"] = documents_alone(cfg, reset, ContextPlan(topo, comm))
    if dist.get_rank() == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "documents.json").write_text(json.dumps(out))

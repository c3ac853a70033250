"""The context-parallel attention exchanges (`parallel.cp_comm`): ring, all-gather and all-to-all around the core.

    python -m pytest tests/parallel/test_context.py -q
    attend = ContextAttention(core, comm, topo.cp_group, stats)     # what ContextParallelRoles.attention_core returns
    out = attend(q, k, v, causal, mask=None, segments=None)          # this rank's 2 chunks in, their outputs out

Every rank holds chunks r and 2·cp-1-r (llmtrain/parallel/context.py): q, k, v [b, 2c, heads, d], the early
chunk first; `segments` [b, 2c] are the same positions' document ids (`data.document_mask`) or None. What a
query may see is decided by sequence index (causal: key index <= query index) and document id; a (query chunk,
key chunk) pair whose keys all come later is skipped (but one, below), so the work per rank is the same on every
rank.

- `ring`: the key/value chunks of rank r - t arrive at step t (t = 0 .. cp-1; the next transfer is started
  before the current block is computed, so on GPU it overlaps); `ring_block` says which query and key chunks
  meet (at step 0 all four pairs as one square causal block, the early-query/late-key one masked: what flash
  kernels take without an offset), each block's output merges with the others by its log-sum-exp; `_Ring.backward` runs the same ring again, recomputing each block's probabilities from the merged
  log-sum-exp, and sends each block's key/value gradient on with the keys, so it arrives home after cp steps.
  Saved for backward: q, k, v, the output and the log-sum-exp — the local chunks only. On CPU the blocks are the
  math kernels of `context_attention.py`, on GPU flash attention's (`paddle_compat/flash_blocks.py`).
- `allgather`: keys and values of the whole sequence are all-gathered once per call (the backward reduce-scatters
  their gradients); each local query chunk attends to the keys up to its own end. Simple, and with few kv heads
  the gathered bytes are small; it holds the whole sequence's k/v for the backward.
- `a2a` (Ulysses): an all-to-all turns [b, 2c, heads, d] into [b, s, heads/cp, d] (the whole sequence, 1/cp of the
  heads), the sequence is put back in order, the model's own attention core runs (flash / flashmask on GPU, math on
  CPU, documents as `segments`), and the inverse all-to-all returns this rank's positions with all heads. Needs
  heads and kv heads divisible by cp.
"""
from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

from llmtrain.paddle_compat import collectives, kernels
from llmtrain.parallel.context_chunks import ChunkLayout
from llmtrain.parallel.context_attention import block_backward, block_forward, keep_mask, merge


def _seq_first(x):  # [b, s, ...] <-> [s, b, ...]
    return x.transpose([1, 0, *range(2, x.ndim)])


def gather_sequence(x, group):
    """[b, 2c, ...] of every rank -> [b, s, ...] concatenated in rank order (no gradient)."""
    parts: list = []
    dist.all_gather(parts, x.contiguous(), group=group)
    return paddle.concat(parts, axis=1)


class _AllGatherSeq(PyLayer):
    """[b, 2c, n, d] on each cp rank -> [b, s, n, d] in rank order; backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_sequence(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _seq_first(collectives.reduce_scatter(_seq_first(dy).contiguous(), ctx.group))


class _AllToAll(PyLayer):
    """Sequence-split to head-split: [b, 2c, n, d] -> [b, s, n/cp, d] (positions in rank order); backward inverse."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return _a2a(x, group, to_heads)

    @staticmethod
    def backward(ctx, dy):
        return _a2a(dy, ctx.group, not ctx.to_heads)


def _a2a(x, group, to_heads: bool):
    n = group.nranks
    if to_heads:  # [b, 2c, h, d]: head group j to rank j; receive every rank's positions of my head group
        got = collectives.all_to_all(list(paddle.split(x, n, axis=2)), group)
        return paddle.concat(got, axis=1)  # [b, s, h/cp, d]
    got = collectives.all_to_all(list(paddle.split(x, n, axis=1)), group)  # [b, 2c, h/cp, d] from each rank
    return paddle.concat(got, axis=2)  # [b, 2c, h, d]


def ring_block(layout: ChunkLayout, rank: int, src: int, causal: bool = True) -> tuple[list, list, bool]:
    """(local query chunk slots, `src`'s key chunk slots, causal) of the one block `rank` computes when `src`'s
    keys are in hand; slots are 0 (early chunk) and 1 (late chunk). Under a causal mask: its own keys, both query
    chunks over both key chunks, causal in local order (the early query chunk sees its own keys only, the late one
    the early chunk whole and itself causally: exactly the sequence order, as both lie in order); an earlier rank's
    keys (src < rank): both query chunks over its early chunk, whole; a later rank's: the late query chunk over both
    its chunks, whole. Every other pair lies above the diagonal. So every rank computes 4 + 2 (cp - 1) chunk pairs,
    and flash kernels see only square causal blocks or unmasked ones."""
    if not causal:
        return [0, 1], [0, 1], False
    if src == rank:
        return [0, 1], [0, 1], True
    return ([0, 1], [0], False) if src < rank else ([1], [0, 1], False)


def _slots(x, slots, c, axis: int = 1):
    """The chunks `slots` (0 early, 1 late) of a tensor whose `axis` holds this rank's 2c positions ([b, 2c, ...],
    or an lse [b, nh, 2c] with axis 2), concatenated."""
    parts = [x[:, :, j * c:(j + 1) * c] if axis == 2 else x[:, j * c:(j + 1) * c] for j in slots]
    return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=axis)


def _on_flash(q) -> bool:
    return kernels.on_gpu() and q.dtype in (paddle.float16, paddle.bfloat16)


class _Ring(PyLayer):
    """The ring exchange (see the module docstring); `plan` is the call's `_Call` (group, layout, documents)."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        c, n = plan.layout.chunk, plan.layout.cp
        outs, lses = [None, None], [None, None]  # per local query chunk: merged output [b, c, nh, dv], lse [b, nh, c]
        kv = [k, v]
        for t in range(n):
            src = (plan.rank - t) % n
            shift = collectives.ring_shift(kv, plan.group) if t < n - 1 else None  # overlaps the block below
            plan.stats_sent(kv, t < n - 1)
            qs, ks, causal = ring_block(plan.layout, plan.rank, src, plan.causal)
            o, lse = plan.block(_slots(q, qs, c), _slots(kv[0], ks, c), _slots(kv[1], ks, c), qs, src, ks, causal)
            for i, slot in enumerate(qs):
                outs[slot], lses[slot] = merge(outs[slot], lses[slot], o[:, i * c:(i + 1) * c],
                                               lse[:, :, i * c:(i + 1) * c])
            if shift is not None:
                kv = shift.wait()
        out, lse = paddle.concat(outs, axis=1), paddle.concat(lses, axis=2)  # [b, 2c, nh, dv], [b, nh, 2c]
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensor()
        plan = ctx.plan
        c, n = plan.layout.chunk, plan.layout.cp
        dq = paddle.zeros(q.shape, "float32")
        kv, dkv = [k, v], [paddle.zeros(k.shape, "float32"), paddle.zeros(v.shape, "float32")]
        for t in range(n):
            src = (plan.rank - t) % n
            shift = collectives.ring_shift(kv, plan.group) if t < n - 1 else None
            qs, ks, causal = ring_block(plan.layout, plan.rank, src, plan.causal)
            g = plan.block_grad(_slots(q, qs, c), _slots(kv[0], ks, c), _slots(kv[1], ks, c), _slots(out, qs, c),
                                _slots(lse, qs, c, axis=2), _slots(dout, qs, c), qs, src, ks, causal)
            for i, j in enumerate(qs):
                dq[:, j * c:(j + 1) * c] += g[0][:, i * c:(i + 1) * c].astype("float32")
            for i, j in enumerate(ks):
                dkv[0][:, j * c:(j + 1) * c] += g[1][:, i * c:(i + 1) * c].astype("float32")
                dkv[1][:, j * c:(j + 1) * c] += g[2][:, i * c:(i + 1) * c].astype("float32")
            plan.stats_sent(dkv, True)
            dkv = collectives.ring_shift(dkv, plan.group).wait()  # the gradients travel on with their keys
            if shift is not None:
                kv = shift.wait()
        return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


class _Call:
    """One call of the exchange: the layout, document ids and mask kind it was made with (a pipeline runs several
    micro-batches' forwards before their backwards, so the ring's backward reads its own call's, not the latest)."""

    def __init__(self, owner: "ContextAttention", layout: ChunkLayout, causal: bool, segments):
        self.owner, self.layout, self.causal = owner, layout, causal
        self.group, self.rank = owner.group, owner.rank
        self.segments = segments
        """[b, s] document ids of every rank's positions in rank order, or None."""

    def _index(self, rank: int, slots) -> paddle.Tensor:
        c = self.layout.chunk
        return paddle.to_tensor(np.concatenate([self.layout.index(rank)[j * c:(j + 1) * c] for j in slots]))

    def _keep(self, qs, src: int, ks):
        """The CPU kernels' mask of query slots `qs` over `src`'s key slots `ks`: causal by sequence index, and
        documents."""
        q_seg = k_seg = None
        if self.segments is not None:
            c = self.layout.chunk
            mine = self.segments[:, self.rank * 2 * c:(self.rank + 1) * 2 * c]
            theirs = self.segments[:, src * 2 * c:(src + 1) * 2 * c]
            q_seg, k_seg = _slots(mine, qs, c), _slots(theirs, ks, c)
        return keep_mask(self._index(self.rank, qs), self._index(src, ks), self.causal, q_seg, k_seg)

    def block(self, q_i, k_j, v_j, qs, src, ks, causal: bool):
        self.owner.count(q_i.shape[0] * q_i.shape[2] * q_i.shape[1] * k_j.shape[1])
        if _on_flash(q_i):
            from llmtrain.paddle_compat.flash_blocks import flash_block

            return flash_block(q_i, k_j, v_j, causal)  # GPU-ONLY(cp-ring-flash)
        return block_forward(q_i, k_j, v_j, self._keep(qs, src, ks))

    def block_grad(self, q_i, k_j, v_j, out, lse, dout, qs, src, ks, causal: bool):
        if _on_flash(q_i):
            from llmtrain.paddle_compat.flash_blocks import flash_block_grad

            return flash_block_grad(q_i, k_j, v_j, out, lse, dout, causal)  # GPU-ONLY(cp-ring-flash)
        return block_backward(q_i, k_j, v_j, out, lse, dout, self._keep(qs, src, ks))

    def stats_sent(self, tensors, sent: bool) -> None:
        if sent:
            self.owner.sent(tensors)


class ContextAttention:
    """An attention core with this rank's cp exchange around it (same signature as the model's cores)."""

    def __init__(self, core, comm: str, group, stats):
        self.core, self.comm, self.group, self.stats = core, comm, group, stats
        self.rank, self.cp = group.rank, group.nranks
        self.recording = True
        """Count score elements and exchanged bytes into `stats` (the plan turns it off after the first step)."""

    def __call__(self, q, k, v, causal: bool = True, mask=None, segments=None, **options):
        if mask is not None:
            raise ValueError("context parallelism takes no additive padding mask (decoders have none)")
        if self.comm != "a2a" and any(options.values()):  # refused up front (`context_problems`)
            raise NotImplementedError(f"attention options {sorted(options)} under cp_comm={self.comm}")
        seg = None if segments is None else gather_sequence(segments, self.group)  # [b, s] rank order
        call = _Call(self, ChunkLayout(q.shape[1] * self.cp, self.cp), causal, seg)
        if self.comm == "a2a":
            return self._a2a(call, q, k, v, options)
        if self.comm == "allgather":
            return self._allgather(call, q, k, v)
        return _Ring.apply(q, k, v, call)

    def count(self, pairs: int) -> None:
        if self.recording:
            self.stats.score_pairs += int(pairs)

    def sent(self, tensors) -> None:
        if self.recording:
            self.stats.exchange_bytes += sum(int(t.numel()) * t.element_size() for t in tensors)

    def _allgather(self, call: _Call, q, k, v):
        layout = call.layout
        c, s = layout.chunk, layout.seq_len
        perm = paddle.to_tensor(np.argsort(layout.order()))  # rank order -> sequence order
        k_all = paddle.gather(_AllGatherSeq.apply(k, self.group), perm, axis=1)  # [b, s, nkv, d], in order
        v_all = paddle.gather(_AllGatherSeq.apply(v, self.group), perm, axis=1)
        seg = None if call.segments is None else paddle.gather(call.segments, perm, axis=1)
        self.sent([k, v])
        outs = []
        for qs, qi in enumerate(layout.chunks(self.rank)):
            end = (qi + 1) * c if call.causal else s  # keys up to the end of this query chunk
            q_i = q[:, qs * c:(qs + 1) * c]
            self.count(q.shape[0] * q.shape[2] * c * end)
            if _on_flash(q_i):
                outs.append(_flash_prefix(q_i, k_all[:, :end], v_all[:, :end], call.causal, seg, qi * c))
                continue
            q_idx = paddle.arange(qi * c, (qi + 1) * c, dtype="int64")
            keep = keep_mask(q_idx, paddle.arange(end, dtype="int64"), call.causal,
                             None if seg is None else seg[:, qi * c:(qi + 1) * c], None if seg is None else seg[:, :end])
            outs.append(block_forward(q_i, k_all[:, :end], v_all[:, :end], keep)[0])
        return paddle.concat(outs, axis=1)  # [b, 2c, nh, dv]

    def _a2a(self, call: _Call, q, k, v, options):
        order = paddle.to_tensor(call.layout.order())
        perm = paddle.to_tensor(np.argsort(call.layout.order()))
        q_h, k_h, v_h = (paddle.gather(_AllToAll.apply(x, self.group, True), perm, axis=1) for x in (q, k, v))
        self.sent([q, k, v])
        s = call.layout.seq_len
        self.count(q.shape[0] * q_h.shape[2] * s * s)  # the core's scores over the whole sequence, heads/cp
        seg = None if call.segments is None else paddle.gather(call.segments, perm, axis=1)
        out = self.core(q_h, k_h, v_h, call.causal, None, seg, **options)  # [b, s, nh/cp, dv] in sequence order
        out = paddle.gather(out, order, axis=1)  # back to rank order
        self.sent([out])
        return _AllToAll.apply(out, self.group, False)  # [b, 2c, nh, dv]


def _flash_prefix(q_i, keys, values, causal: bool, seg, q_start: int):
    """GPU: one query chunk (sequence indices q_start ..) over the keys up to its end, as flashmask's column-wise
    bidirectional mask [b, 1, sk, 2] = (first masked row from below, first unmasked row from above) per key: key j
    is seen by the chunk's rows [j - q_start, end of j's document - q_start), clipped to the chunk — causal and
    documents in one, with no assumption on how a kernel aligns a causal mask when there are more keys than
    queries."""
    from paddle.nn.functional.flash_attention import flashmask_attention

    from llmtrain.paddle_compat.flash_blocks import widened

    c, sk = q_i.shape[1], keys.shape[1]
    j = paddle.arange(sk, dtype="int32")
    below = paddle.clip(j - q_start, 0, c) if causal else paddle.zeros([sk], "int32")  # rows above are masked
    if seg is None:
        until = paddle.full([q_i.shape[0], sk], c, "int32")
    else:
        from llmtrain.models.layers import document_end_rows

        until = paddle.clip(document_end_rows(seg[:, :sk]).reshape([q_i.shape[0], sk]) - q_start, 0, c)
    rows = paddle.stack([until, below.unsqueeze(0).expand([q_i.shape[0], sk])], axis=-1)  # [b, sk, 2]
    dv = values.shape[-1]  # MLA's values are narrower than q/k: the kernel takes one width (zero columns, cut after)
    values = widened(values, q_i.shape[-1])
    return flashmask_attention(q_i, keys, values, rows.unsqueeze(1).astype("int32"), causal=False)[..., :dv]  # GPU-ONLY(cp-flash)

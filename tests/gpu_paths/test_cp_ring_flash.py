"""CPU rehearsal of GPU-ONLY(cp-ring-flash): the context-parallel ring's flash-attention blocks.

    python -m pytest tests/gpu_paths/test_cp_ring_flash.py -q

On GPU the ring (llmtrain/parallel/context_exchange.py) computes each block with `paddle._C_ops.flash_attn` and
back-propagates it with `flash_attn_grad` given the merged output and log-sum-exp
(llmtrain/paddle_compat/flash_blocks.py). Here the two kernels are replaced by math references with the kernels'
positional arguments and outputs (their argument count checked against the calls Paddle 3.3.1's own Python makes:
`flash_attention` and `auto_parallel.ring_attention`), the branch is forced on, and for every (rank, source) step
of a cp2 and a cp3 ring the flash branch must give what the CPU kernels give: output, log-sum-exp and gradients
within 1e-5 — which checks the causal flag `ring_block` hands the kernel and the slicing around it.
"""
from __future__ import annotations

import ast
import inspect

import paddle
import pytest

from llmtrain.parallel import context_exchange
from llmtrain.parallel.context_chunks import ChunkLayout
from llmtrain.parallel.context_attention import block_backward, block_forward, keep_mask
from llmtrain.parallel.context_exchange import _Call, ring_block


def _paddle_call_arity(module, name: str) -> set:
    """Positional argument counts of every `_C_ops.<name>(...)` call in a Paddle module's source."""
    tree = ast.parse(inspect.getsource(module))
    return {len(n.args) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == name and getattr(n.func.value, "id", None) == "_C_ops"}


def _our_call_arity(name: str) -> set:
    from llmtrain.paddle_compat import flash_blocks

    tree = ast.parse(inspect.getsource(flash_blocks))
    return {len(n.args) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == name}


def _bottom_right(sq: int, sk: int, causal: bool):
    if not causal:
        return None
    return keep_mask(paddle.arange(sk - sq, sk), paddle.arange(sk), True)


def ref_flash_attn(q, k, v, fixed_seed_offset, attn_mask, dropout, causal, return_softmax, is_test, rng_name):
    """`_C_ops.flash_attn`'s outputs (out, softmax, lse [b, nh, sq], seed_offset), causal aligned bottom-right."""
    assert fixed_seed_offset is None and attn_mask is None and dropout == 0.0 and not return_softmax
    out, lse = block_forward(q, k, v, _bottom_right(q.shape[1], k.shape[1], causal))
    return out, None, lse, None


def ref_flash_attn_grad(q, k, v, out, lse, seed_offset, attn_mask, dout, dropout, causal):
    assert attn_mask is None and dropout == 0.0 and list(seed_offset.shape) == [2]
    return block_backward(q, k, v, out, lse, dout, _bottom_right(q.shape[1], k.shape[1], causal))


def test_our_kernel_calls_take_the_arguments_paddle_passes():
    from paddle.distributed.auto_parallel import ring_attention
    from paddle.nn.functional import flash_attention

    assert _our_call_arity("flash_attn") <= _paddle_call_arity(flash_attention, "flash_attn") == {10}
    assert _our_call_arity("flash_attn_grad") <= _paddle_call_arity(ring_attention, "flash_attn_grad") == {10}
    for f in (ref_flash_attn, ref_flash_attn_grad):
        assert len(inspect.signature(f).parameters) == 10


class _Owner:
    def __init__(self, rank: int, cp: int):
        self.group = type("G", (), {"rank": rank, "nranks": cp})()
        self.rank = rank

    def count(self, pairs):
        pass


@pytest.mark.parametrize("cp", [2, 3])
def test_flash_branch_equals_the_cpu_blocks_on_every_ring_step(cp, monkeypatch):
    layout = ChunkLayout(seq_len=2 * cp * 4, cp=cp)
    c = layout.chunk
    paddle.seed(1)
    for rank in range(cp):
        call = _Call(_Owner(rank, cp), layout, True, None)
        for src in range(cp):
            qs, ks, causal = ring_block(layout, rank, src)
            q = paddle.randn([2, len(qs) * c, 4, 8])
            k, v = paddle.randn([2, len(ks) * c, 2, 8]), paddle.randn([2, len(ks) * c, 2, 8])
            dout = paddle.randn(q.shape)
            monkeypatch.setattr(context_exchange, "_on_flash", lambda x: False)
            out, lse = call.block(q, k, v, qs, src, ks, causal)
            grads = call.block_grad(q, k, v, out, lse, dout, qs, src, ks, causal)
            monkeypatch.setattr(context_exchange, "_on_flash", lambda x: True)
            monkeypatch.setattr(paddle._C_ops, "flash_attn", ref_flash_attn, raising=False)
            monkeypatch.setattr(paddle._C_ops, "flash_attn_grad", ref_flash_attn_grad, raising=False)
            f_out, f_lse = call.block(q, k, v, qs, src, ks, causal)
            f_grads = call.block_grad(q, k, v, out, lse, dout, qs, src, ks, causal)
            monkeypatch.undo()
            pairs = [(out, f_out), (lse, f_lse), *zip(grads, f_grads)]
            for want, got in pairs:
                finite = paddle.isfinite(want)
                assert bool((finite == paddle.isfinite(got)).all()), (rank, src)
                diff = paddle.where(finite, (want - got).abs(), paddle.zeros_like(want))
                assert float(diff.max()) <= 1e-5, (rank, src, qs, ks, causal)
            assert not (causal and len(qs) != len(ks)), "a causal flash block must be square"

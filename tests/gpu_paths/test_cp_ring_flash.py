"""GPU-only branch `cp-ring-flash`: the context-parallel ring's blocks through flash attention's kernels.

    python -m pytest tests/gpu_paths/test_cp_ring_flash.py -q

On a GPU with fp16/bf16 activations the ring (llmtrain/parallel/context_exchange.py) computes each block with
`paddle._C_ops.flash_attn` and back-propagates it with `flash_attn_grad` given the ring's merged output and
log-sum-exp (llmtrain/paddle_compat/flash_blocks.py). Here llmtrain is told it runs on a GPU (`kernels.on_gpu`)
and both kernels are CPU references behind `checked`: `flash_attn`'s signature is the installed Paddle's own
(its typing stub, `paddle/_typing/libs/libpaddle/pir/ops.pyi`, since the C++ function has none), `flash_attn_grad`'s
stub takes `*args`, so its parameter list is written from the op's definition and held to the argument count of
the calls Paddle's own `auto_parallel/ring_attention.py` makes. The references repeat the kernels' input checks
(fp16/bf16, one head width for q, k, v) and return what the kernels return: out, lse [b, nh, sq rounded up to
128] (the padding rows NaN here, so a caller that read them would fail), the seed offset.

The whole ring then runs, forward and backward, on a cp group played by threads (tests/gpu_paths/cp_threads.py;
its ring shift through the checked `batch_isend_irecv`), cp2 and cp3, GQA, and multi-head latent attention's
narrower values (d_v < d: zero-padded for the kernels). Every rank's output and q/k/v gradients must equal one
device's attention over the whole sequence (`gpu_references.dense_attention` in fp32 on the same fp16 values):
`CPU_TOL` is a few fp16 roundings of the merged output (the ring rounds each block's output to fp16 before the
log-sum-exp merge, and the gradients to fp16 once). Each kernel call must have been a square causal block or an
unmasked one (flash kernels align a causal mask bottom-right; the ring never needs that alignment). On a real GPU
the kernels are not replaced (bounds `GPU_TOL`, not yet measured on a GPU).
"""
from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path

import numpy as np
import paddle
import pytest

from cp_threads import ThreadGroup, random_tensors, run_exchange, whole_sequence, worst_error
from gpu_rehearsal import ON_GPU, checked, reaches
from gpu_references import _low_precision, _one_head_width
from llmtrain.paddle_compat import kernels

STUB = Path(paddle.__file__).parent / "_typing" / "libs" / "libpaddle" / "pir" / "ops.pyi"
FP16 = 2.0**-11
CPU_TOL = 8 * FP16
"""Per entry (values O(1), gradients up to ~4): the block outputs' fp16 rounding carried through cp merges, and
the gradients' one fp16 rounding each (measured <= 2.4e-3 = 4.8 units); a wrong causal flag or a misplaced block
moves entries by O(0.1)."""
GPU_TOL = 3e-2
"""With the real kernels (fp16 accumulation orders of the GPU): not yet measured on a GPU."""


def _stub_signature(name: str):
    """A function with the signature the installed Paddle's typing stub gives `_C_ops.<name>`."""
    for line in STUB.read_text(encoding="utf-8").splitlines():
        if line.startswith(f"def {name}("):
            space: dict = {"paddle": paddle}
            exec(line.rstrip() + " ...", space)  # noqa: S102 -- Paddle's own stub line, a def with `...` body
            return space[name]
    raise AssertionError(f"{STUB}: no stub for {name}")


def flash_attn_grad_spec(q, k, v, out, softmax_lse, seed_offset, attn_mask, out_grad, dropout, causal):
    """`_C_ops.flash_attn_grad`'s parameters (the op's backward definition; its stub says only *args)."""


def every_argument(stand_in, name: str):
    """`stand_in` refusing a call that leaves any parameter to its default: a `_C_ops` function reads its arguments
    by position and has no defaults (the stub's are the Python API's; Paddle's own calls pass every one)."""
    n = len(inspect.signature(_stub_signature(name) if name == "flash_attn" else flash_attn_grad_spec).parameters)

    def call(*args, **kwargs):
        assert len(args) + len(kwargs) == n, f"_C_ops.{name} takes all {n} arguments, given {len(args) + len(kwargs)}"
        return stand_in(*args, **kwargs)

    call.calls = stand_in.calls
    return call


def _paddle_call_arity(module, name: str) -> set:
    """Positional argument counts of every `_C_ops.<name>(...)` call in a Paddle module's source."""
    tree = ast.parse(inspect.getsource(module))
    return {len(n.args) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == name and getattr(n.func.value, "id", None) == "_C_ops"}


def _dense(q, k, v, causal: bool):
    """(scores' probabilities [b, nh, sq, sk], lse [b, nh, sq]) in float64, causal aligned bottom-right (query t
    of the block sees keys up to sk - sq + t), kv heads repeated for grouped-query attention."""
    b, sq, nh, d = q.shape
    sk, nkv = k.shape[1], k.shape[2]
    kk = np.repeat(k, nh // nkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(d)
    if causal:
        allowed = np.arange(sk)[None, :] <= (sk - sq + np.arange(sq))[:, None]
        s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lse = (m + np.log(p.sum(-1, keepdims=True)))[..., 0]
    return np.exp(s - lse[..., None]), lse


def _f64(t):
    return t.astype("float32").numpy().astype(np.float64)


def ref_flash_attn(q, k, v, fixed_seed_offset, attn_mask, dropout, causal, return_softmax, is_test, rng_name):
    """`_C_ops.flash_attn` -> (out [b, sq, nh, d] in q's dtype, softmax None, lse [b, nh, ceil128(sq)] fp32,
    seed_offset [2] int64)."""
    _low_precision("flash_attn", query=q, key=k, value=v)
    _one_head_width("flash_attn", q, k, v)
    assert fixed_seed_offset is None and attn_mask is None and dropout == 0.0
    p, lse = _dense(_f64(q), _f64(k), _f64(v), causal)
    nh = q.shape[2]
    out = np.einsum("bhqk,bkhd->bqhd", p, np.repeat(_f64(v), nh // v.shape[2], axis=2))
    rounded = -(-q.shape[1] // 128) * 128
    lse_pad = np.full([*lse.shape[:2], rounded], np.nan, np.float32)
    lse_pad[:, :, : q.shape[1]] = lse
    return (paddle.to_tensor(out.astype(np.float32)).astype(q.dtype), None, paddle.to_tensor(lse_pad),
            paddle.to_tensor([0, 0], dtype="int64"))


def ref_flash_attn_grad(q, k, v, out, softmax_lse, seed_offset, attn_mask, out_grad, dropout, causal):
    """`_C_ops.flash_attn_grad` -> (dq, dk, dv) in q's dtype: the block's share of the gradient given the row's
    (merged) out and lse [b, nh, >= sq]."""
    _low_precision("flash_attn_grad", query=q, key=k, value=v)
    _one_head_width("flash_attn_grad", q, k, v)
    assert attn_mask is None and dropout == 0.0
    # the forward's seed and offset ([2] int64, as flash_attn returned them), which the kernel reads
    assert isinstance(seed_offset, paddle.Tensor) and list(seed_offset.shape) == [2] and seed_offset.dtype == paddle.int64
    assert list(out.shape) == list(q.shape) and list(out_grad.shape) == list(q.shape)
    b, sq, nh, d = q.shape
    nkv = k.shape[2]
    lse = softmax_lse.numpy().astype(np.float64)[:, :, :sq]
    qn, kn, vn = _f64(q), np.repeat(_f64(k), nh // nkv, axis=2), np.repeat(_f64(v), nh // nkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", qn, kn) / math.sqrt(d)
    if causal:
        sk = k.shape[1]
        s = np.where(np.arange(sk)[None, :] <= (sk - sq + np.arange(sq))[:, None], s, -np.inf)
    p = np.exp(s - lse[..., None])  # the row's global probabilities of this block's keys
    do = _f64(out_grad)
    dv = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vn)
    ds = p * (dp - (do * _f64(out)).sum(-1).transpose(0, 2, 1)[..., None]) / math.sqrt(d)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kn)
    dk = np.einsum("bhqk,bqhd->bkhd", ds, qn)
    group = lambda g: g.reshape(b, g.shape[1], nkv, nh // nkv, d).sum(3)  # noqa: E731 -- kv heads' query groups
    return tuple(paddle.to_tensor(x.astype(np.float32)).astype(q.dtype) for x in (dq, group(dk), group(dv)))


def test_the_kernel_specs_match_paddles_calls():
    from paddle.distributed.auto_parallel import ring_attention
    from paddle.nn.functional import flash_attention

    fwd = inspect.signature(_stub_signature("flash_attn"))
    assert list(fwd.parameters) == list(inspect.signature(ref_flash_attn).parameters)
    assert _paddle_call_arity(flash_attention, "flash_attn") == {len(fwd.parameters)}
    grad = inspect.signature(flash_attn_grad_spec)
    assert _paddle_call_arity(ring_attention, "flash_attn_grad") == {len(grad.parameters)}
    assert list(grad.parameters) == list(inspect.signature(ref_flash_attn_grad).parameters)


@pytest.fixture
def flash(monkeypatch):
    """On CPU: llmtrain sees a GPU and the two kernels are checked references ({} on a real GPU)."""
    if ON_GPU:
        return {}
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    stand_ins = {
        "flash_attn": checked(_stub_signature("flash_attn"), ref_flash_attn,
                              ("q", "k", "v", "fixed_seed_offset", "attn_mask", "causal")),
        "flash_attn_grad": checked(flash_attn_grad_spec, ref_flash_attn_grad,
                                   tuple(inspect.signature(flash_attn_grad_spec).parameters)),
    }
    for name, f in stand_ins.items():
        monkeypatch.setattr(paddle._C_ops, name, every_argument(f, name), raising=False)
    return stand_ins


@pytest.mark.parametrize("cp, heads, widths", [(2, (4, 2), (8, 8)), (3, (4, 4), (8, 8)), (2, (4, 4), (16, 8))],
                         ids=["cp2-gqa", "cp3", "cp2-mla-values"])
def test_ring_through_flash_kernels_equals_one_device(cp, heads, widths, flash, monkeypatch):
    rng = np.random.default_rng(cp + widths[0])
    tensors = random_tensors(rng, b=2, s=4 * cp, nh=heads[0], nkv=heads[1], d=widths[0], dv=widths[1],
                             dtype="float16")
    group = ThreadGroup(cp, list(range(10, 10 + cp)))
    group.install(monkeypatch)
    with reaches("cp-ring-flash"):
        got = run_exchange(group, "ring", tensors, dtype="float16")
    err = worst_error(got, whole_sequence(tensors), cp)
    assert max(err.values()) <= (GPU_TOL if ON_GPU else CPU_TOL), err
    if flash:
        blocks = flash["flash_attn"].calls + flash["flash_attn_grad"].calls
        assert len(flash["flash_attn"].calls) == len(flash["flash_attn_grad"].calls) == cp * cp
        for call in blocks:  # flash aligns a causal mask bottom-right: the ring only ever hands it square ones
            assert not call["causal"] or call["q"].shape[1] == call["k"].shape[1], call["q"].shape
        assert sum(c["causal"] for c in flash["flash_attn"].calls) == cp  # one own-chunk block per rank


def test_a_ring_ranks_flash_calls_are_the_planned_ones(flash, monkeypatch):
    """The planner's kernel list for a cp2 rank on flash attention (`llmtrain.plan.kernels._ring_flash_core`) is what
    the ring calls: per ring step one `flash_attn` and one `flash_attn_grad` on that step's block, as
    (batch·heads, keys, head dim, causal, kv heads, query rows); rank 0 exactly as listed, rank 1 (which holds an
    earlier rank's keys: 2c x c blocks where rank 0 has c x 2c) the same work per call."""
    if not flash:
        pytest.skip("on a GPU the kernels are not replaced: the calls are counted on CPU")
    from llmtrain.models.config import ModelConfig
    from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels

    cp, b = 2, 2
    cfg = ModelConfig(name="ring", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                      vocab_size=64, max_position_embeddings=16, position="rope", norm="rmsnorm", activation="swiglu",
                      bias=False, tie_embeddings=False)
    nh, nkv, d = cfg.num_heads, cfg.kv_heads(), cfg.attn_head_dim()
    group = ThreadGroup(cp)
    group.install(monkeypatch)
    seen = {"flash_attn": [], "flash_attn_grad": []}
    for name, causal_at in (("flash_attn", 6), ("flash_attn_grad", 9)):  # (the flag's position in Paddle's call)
        def tagged(*args, _inner=getattr(paddle._C_ops, name), _seen=seen[name], _at=causal_at):
            q, k = args[0], args[1]
            _seen.append((group.rank, (q.shape[0] * q.shape[2], k.shape[1], q.shape[3], bool(args[_at]), k.shape[2],
                                       q.shape[1])))
            return _inner(*args)

        monkeypatch.setattr(paddle._C_ops, name, tagged)
    tensors = random_tensors(np.random.default_rng(5), b=b, s=4 * cp, nh=nh, nkv=nkv, d=d, dv=d, dtype="float16")
    run_exchange(group, "ring", tensors, dtype="float16")
    planned = micro_batch_kernels(MicroBatchSpec(cfg, b, 4 * cp, t=1, e=2, gpu=True, flash=True, cp=cp, layers=1,
                                                 first=False, last=False))
    for name, kind in (("flash_attn", "attn_fwd"), ("flash_attn_grad", "attn_bwd")):
        want = sorted(k.shape for k in planned.forward + planned.backward if k.kind == kind)
        assert len(want) == cp and sorted(s for r, s in seen[name] if r == 0) == want, (name, seen[name], want)
        work = lambda shapes: sorted((bh * keys * rows, causal) for bh, keys, _, causal, _, rows in shapes)  # noqa: E731
        assert work(s for r, s in seen[name] if r == 1) == work(want), name

"""GPU-only branch `flash-attn-v3`: on Hopper with a Paddle that has FlashAttention-3, llmtrain sets
`FLAGS_flash_attn_version=3`, so Paddle's `flash_attention` runs `_C_ops.flash_attn_v3`.

    python -m pytest tests/gpu_paths/test_flash_attn_v3.py -q

`choose_flash_version` (llmtrain/paddle_compat/flash_attn.py, called when `model.attention` resolves to flash
attention on a GPU) sets the flag. On CPU llmtrain is told it runs on an H100 (capability 9.0); `paddle.set_flags`
is the checked stand-in (its signature bound) over a flag table, which Paddle's own `flash_attention` wrapper then
reads; the wrapper runs for real (its device check told "gpu:0") and calls `_C_ops.flash_attn_v3`, a C builtin
without a Python signature: its stand-in takes exactly the 16 positional arguments the wrapper passes in Paddle
3.3.1 (a changed call fails to bind), refuses any value of the ones it does not model (q_v, the descales, windows,
softcap, splits, GQA packing, sm margin) other than the wrapper's, checks fp16/bf16 inputs, and computes attention
in fp32 (gpu_references.dense_attention) with the given softmax scale. Checked: the flag is set once, to 3, and the
forward and q/k/v gradients through llmtrain's `flash_attention_gpu` (GQA 4/2 heads, causal) equal the math
path's on the same fp16-rounded inputs within fp16 rounding; FA2 is kept where the capability is not 9.0, where the
kernel is missing and where the environment names a version. On a GPU no stand-in is installed: where FA3 can run
the test compares it with FA2 (the acceptance numerics, `GPU_TOL`, not yet measured on Paddle).
"""
from __future__ import annotations

import numpy as np
import paddle
import pytest

import gpu_references as ref
from gpu_rehearsal import ON_GPU, checked, reaches
from llmtrain.models.layers import flash_attention_gpu, math_attention
from llmtrain.paddle_compat import flash_attn, kernels

FA = __import__("paddle.nn.functional.flash_attention", fromlist=["flash_attention"])
CPU_TOL = 4 * 2.0**-11
"""Both sides compute in fp32 from the same fp16 inputs; the FA3 path rounds its output to fp16 once (one unit)."""
GPU_TOL = 2e-2
"""FA3 against FA2 in bf16 on a Hopper GPU: not yet measured."""
V3_DEFAULTS = (None, None, None, None)  # q_v, q_descale, k_descale, v_descale
V3_TAIL = (-1, -1, 0.0, 1, False, False, 0)  # window left/right, softcap, num_splits, manual pack, pack_gqa, sm_margin


def flash_attn_v3_reference(q, k, v, q_v, q_descale, k_descale, v_descale, softmax_scale, causal, window_size_left,
                            window_size_right, softcap, num_splits, manual_set_pack_gqa, pack_gqa, sm_margin):
    """_C_ops.flash_attn_v3 as Paddle 3.3.1's flash_attention calls it -> (out [b, s, nh, d], lse [b, nh, s])."""
    if (q_v, q_descale, k_descale, v_descale) != V3_DEFAULTS:
        raise AssertionError("flash_attn_v3: q_v / descales are not modelled by the CPU reference")
    tail = (window_size_left, window_size_right, softcap, num_splits, manual_set_pack_gqa, pack_gqa, sm_margin)
    if tail != V3_TAIL:
        raise AssertionError(f"flash_attn_v3: {tail} differs from the wrapper's {V3_TAIL}")
    ref._low_precision("flash_attn_v3", q=q, k=k, v=v)
    out = ref.dense_attention(q, k, v, causal=bool(causal), scale=float(softmax_scale))
    return out.astype(q.dtype), None


@pytest.fixture
def hopper(monkeypatch):
    """On CPU: an H100 with FA3 as llmtrain and Paddle's wrapper see it; returns (flags, set_flags stand-in)."""
    if ON_GPU:
        return None
    flags = table = {flash_attn.FLAG: 2, "FLAGS_cudnn_deterministic": False}
    real_get = paddle.get_flags

    def get_flags(names):
        names = [names] if isinstance(names, str) else list(names)
        if all(n in flags for n in names):
            return {n: flags[n] for n in names}
        return real_get(names)

    def set_flags_reference(flags):  # the name paddle.set_flags gives it
        table.update(flags)

    setter = checked(paddle.set_flags, set_flags_reference, ("flags",))
    monkeypatch.delenv(flash_attn.FLAG, raising=False)
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(paddle, "get_flags", get_flags)
    monkeypatch.setattr(paddle.base.framework, "get_flags", get_flags)
    monkeypatch.setattr(paddle, "set_flags", setter)
    monkeypatch.setattr(paddle._C_ops, "flash_attn_v3", flash_attn_v3_reference, raising=False)
    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:0")
    from paddle.nn.attention.sdpa import SDPBackend  # a GPU build enables flash, efficient and math

    monkeypatch.setattr(FA, "_get_enabled_backends", lambda: [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                              SDPBackend.MATH])
    return flags, setter


def _qkv(dtype="float16"):
    rng = np.random.default_rng(3)
    return [paddle.to_tensor(rng.standard_normal((2, 16, n, 32)).astype("float32")).astype(dtype) for n in (4, 2, 2)]


def test_hopper_runs_fa3_and_it_equals_the_math_path(hopper):
    with reaches("flash-attn-v3"):
        chosen = flash_attn.choose_flash_version()
    if hopper is None and not flash_attn.fa3_available()[0]:
        pytest.skip(f"this GPU keeps FA2: {chosen}")
    assert chosen == "fa3"
    if hopper is not None:
        flags, setter = hopper
        assert flags[flash_attn.FLAG] == 3 and [c["flags"] for c in setter.calls] == [{flash_attn.FLAG: 3}]
    q, k, v = _qkv("float16" if hopper is not None else "bfloat16")
    for t in (q, k, v):
        t.stop_gradient = False
    out = flash_attention_gpu(q, k, v, causal=True)
    out.astype("float32").sum().backward()
    got = [out.astype("float32").numpy()] + [t.grad.astype("float32").numpy() for t in (q, k, v)]
    if hopper is None:  # a real Hopper GPU: FA3 against FA2 (the acceptance numerics)
        paddle.set_flags({flash_attn.FLAG: 2})
        try:
            q2, k2, v2 = (t.detach() for t in (q, k, v))
            for t in (q2, k2, v2):
                t.stop_gradient = False
            out2 = flash_attention_gpu(q2, k2, v2, causal=True)
            out2.astype("float32").sum().backward()
            want = [out2.astype("float32").numpy()] + [t.grad.astype("float32").numpy() for t in (q2, k2, v2)]
        finally:
            paddle.set_flags({flash_attn.FLAG: 3})
        tol = GPU_TOL
    else:
        q32, k32, v32 = (t.detach().astype("float32") for t in (q, k, v))
        for t in (q32, k32, v32):
            t.stop_gradient = False
        out32 = math_attention(q32, k32, v32, causal=True)
        out32.sum().backward()
        want = [out32.numpy()] + [t.grad.numpy() for t in (q32, k32, v32)]
        tol = CPU_TOL
    for g, w, name in zip(got, want, ("out", "dq", "dk", "dv")):
        assert float(np.abs(g - w).max()) <= tol * max(1.0, float(np.abs(w).max())), name


@pytest.mark.skipif(ON_GPU, reason="the refusals are rehearsed on CPU; a GPU has its own answer")
@pytest.mark.parametrize("case", ["ampere", "no_kernel", "environment"])
def test_fa2_is_kept_where_fa3_cannot_or_must_not_run(hopper, monkeypatch, case):
    flags, setter = hopper
    if case == "ampere":
        monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda *a: (8, 0))
    elif case == "no_kernel":
        monkeypatch.delattr(paddle._C_ops, "flash_attn_v3")
    else:
        monkeypatch.setenv(flash_attn.FLAG, "2")
    chosen = flash_attn.choose_flash_version()
    assert chosen.startswith("fa2"), chosen
    assert {"ampere": "8.0", "no_kernel": "flash_attn_v3", "environment": "environment"}[case] in chosen
    assert not setter.calls and flags[flash_attn.FLAG] == 2

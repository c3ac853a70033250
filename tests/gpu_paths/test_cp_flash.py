"""GPU-only branch `cp-flash`: the all-gather exchange's query chunks through Paddle's flashmask attention.

    python -m pytest tests/gpu_paths/test_cp_flash.py -q

On a GPU with fp16/bf16 activations each local query chunk of the all-gather exchange attends to the gathered keys
up to its end through `paddle.nn.functional.flash_attention.flashmask_attention` with a column-wise bidirectional
mask (`context_exchange._flash_prefix`: per key, the first row below its document's end and the first row it may
be seen from), causal and per-document in one. Here llmtrain is told it runs on a GPU (`kernels.on_gpu`) and
flashmask is `gpu_references.flashmask_attention` behind `checked` (the installed signature, the wrapper's input
checks, the documented mask). The whole exchange runs, forward and backward (its reduce-scatter included), on a cp
group played by threads (tests/gpu_paths/cp_threads.py), cp2 and cp3, without and with packed documents, and with
multi-head latent attention's narrower values (zero-padded for the kernel). Every rank's output and q/k/v
gradients must equal one device's attention over the whole sequence (`gpu_references.dense_attention`, fp32, the
same fp16 values), within `CPU_TOL`: the chunks' outputs are rounded to fp16 once, the gradients once.
Paddle's CPU build has no fp16 `gather` kernel (the exchange puts the gathered keys in sequence order with it): on
CPU it runs through fp32 here, which moves the same values exactly. On a real GPU
the kernel is not replaced (`GPU_TOL`, not yet measured on a GPU).
"""
from __future__ import annotations

import importlib

import numpy as np
import paddle
import pytest

import gpu_references as ref
from cp_threads import ThreadGroup, random_tensors, run_exchange, whole_sequence, worst_error
from gpu_rehearsal import ON_GPU, checked, reaches
from llmtrain.paddle_compat import kernels

FA = importlib.import_module("paddle.nn.functional.flash_attention")
CPU_TOL = 8 * 2.0**-11
"""Per entry (values O(1), gradients up to ~4): one fp16 rounding of each chunk's output and of each gradient
(measured <= 1.8e-3); a mask off by one row or a lost document boundary moves entries by O(0.1)."""
GPU_TOL = 3e-2
"""With the real kernel: not yet measured on a GPU."""


def _gather_via_fp32(real):
    def gather(x, index, axis=None, name=None, out=None):
        if x.dtype == paddle.float16:
            return real(x.astype("float32"), index, axis).astype("float16")
        return real(x, index, axis)

    return gather


@pytest.fixture
def flashmask(monkeypatch):
    if ON_GPU:
        return None
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    monkeypatch.setattr(paddle, "gather", _gather_via_fp32(paddle.gather))
    stand_in = checked(FA.flashmask_attention, ref.flashmask_attention, ref.FLASHMASK_ARGS)
    monkeypatch.setattr(FA, "flashmask_attention", stand_in)
    return stand_in


def _documents(b: int, s: int) -> np.ndarray:
    """[b, s] document ids: row 0 three documents (5, 9, the rest), row 1 one."""
    seg = np.zeros([b, s], np.int64)
    seg[0] = np.repeat([0, 1, 2], [5, 9, s - 14])
    return seg


@pytest.mark.parametrize("cp, documents, dv", [(2, False, 8), (3, False, 8), (2, True, 8), (3, True, 8),
                                               (2, True, 4)], ids=["cp2", "cp3", "cp2-docs", "cp3-docs", "cp2-mla"])
def test_allgather_through_flashmask_equals_one_device(cp, documents, dv, flashmask, monkeypatch):
    rng = np.random.default_rng(10 * cp + dv)
    s = 8 * cp
    tensors = random_tensors(rng, b=2, s=s, nh=4, nkv=2, d=8, dv=dv, dtype="float16")
    seg = _documents(2, s) if documents else None
    group = ThreadGroup(cp)
    group.install(monkeypatch)
    with reaches("cp-flash"):
        got = run_exchange(group, "allgather", tensors, dtype="float16", segments=seg)
    err = worst_error(got, whole_sequence(tensors, seg), cp)
    assert max(err.values()) <= (GPU_TOL if ON_GPU else CPU_TOL), err
    if flashmask is not None:
        assert len(flashmask.calls) == 2 * cp  # one per query chunk, every rank
        for call in flashmask.calls:
            assert call["causal"] is False and call["startend_row_indices"].shape[-1] == 2
            assert call["query"].shape[1] == s // (2 * cp)  # one chunk of queries
            assert call["value"].shape[-1] == call["query"].shape[-1]  # padded to one width
    whole = whole_sequence(tensors)
    if documents:  # the documents changed the result: the mask reached the kernel
        assert max(float(np.abs(g["out"] - whole["out"][:, _index(s, cp, r)]).max()) for r, g in enumerate(got)) > 0.05


def _index(s: int, cp: int, rank: int):
    from llmtrain.parallel.context_chunks import ChunkLayout

    return ChunkLayout(s, cp).index(rank)

"""Record the ops the PyTorch twin issues (benchmarks/gpu_model.py, gpu_moe.py, gpu_deepseek.py) at the op-sequence test's shapes.

    python benchmarks/twin_ops.py --out benchmarks/data/twin_ops        # in an environment with PyTorch (CPU is enough)

For each case of `CASES` (the twin's `Arch` / `MoE` (/ `MLA`, `SigmoidRouter`: DeepSeek) at one micro-batch [2, 16],
the shapes of tests/plan/test_op_sequence.py) the twin's forward (the loss) and backward run on CPU in fp32 under a
`TorchDispatchMode` that records every GEMM aten op (mm, addmm, bmm, baddbmm) as (m, n, k, batch) of
C[m, n] = A[m, k] @ B[k, n], counts the attention calls (scaled_dot_product_*) and every aten op by name (the
test compares them by class). Written per case as
`<case>.json` with the SHA-256 of the twin's source files and this command: tests/plan/test_twin_ops.py compares
them with the GEMMs llmtrain's Paddle model runs for the same configuration (and fails when the twin's sources
changed since the recording: run this command again). PyTorch is an instrument, never a dependency of llmtrain.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_model import Arch, Decoder, gpt, llama, make_batch  # noqa: E402
from gpu_deepseek import MLA, DeepSeekDecoder, SigmoidRouter  # noqa: E402
from gpu_moe import MoE, MoEDecoder  # noqa: E402

SOURCES = ("gpu_model.py", "gpu_moe.py", "gpu_deepseek.py")
"""The twin's files (benchmarks/): their hashes go into every recording."""
COMMAND = "python benchmarks/twin_ops.py --out benchmarks/data/twin_ops"
MICRO, SEQ, VOCAB = 2, 16, 256
TINY_LLAMA = dict(layers=4, hidden=128, heads=4, kv_heads=2, seq=SEQ, vocab=VOCAB)
TINY_MLA = MLA(q_rank=48, kv_rank=64, nope=32, rope=16, v=32)
V3_ROUTER = SigmoidRouter(groups=4, keep=2, group_score="top2", routed_scale=2.5, first_dense=1, dense_ffn=352)
TINY_DEEPSEEK = dict(TINY_LLAMA, kv_heads=4)
CASES = {  # name: (Arch, MoE or None, recompute, the Paddle model's overrides, DeepSeek's (MLA, SigmoidRouter) or None)
    "llama": (llama(ffn=352, **TINY_LLAMA), None, False, ["model=llama-tiny"], None),
    "llama-full-recompute": (llama(ffn=352, **TINY_LLAMA), None, True, ["model=llama-tiny", "train.recompute=full"],
                             None),
    "gpt": (gpt(4, 128, 4, 512, SEQ, vocab=VOCAB), None, False, ["model=gpt-tiny"], None),
    "moe-capacity": (llama(ffn=96, **TINY_LLAMA), MoE(8, 2, 96, shared_ffn=96, capacity_factor=1.25), False,
                     ["model=moe-tiny", "model.moe_capacity_factor=1.25", "model.moe_first_dense_layers=0"], None),
    "moe-dropless": (llama(ffn=96, **TINY_LLAMA), MoE(8, 2, 96, shared_ffn=96), False,
                     ["model=moe-tiny", "model.moe_first_dense_layers=0"], None),
    "deepseek-capacity": (llama(ffn=64, **TINY_DEEPSEEK), MoE(16, 4, 64, shared_ffn=64, capacity_factor=1.25,
                                                               aux_coef=1e-4), False,
                          ["model=deepseek-tiny", "model.moe_capacity_factor=1.25"], (TINY_MLA, V3_ROUTER)),
    "deepseek-dropless": (llama(ffn=64, **TINY_DEEPSEEK), MoE(16, 4, 64, shared_ffn=64, aux_coef=1e-4), False,
                          ["model=deepseek-tiny"], (TINY_MLA, V3_ROUTER)),
}
GEMMS = {"mm", "addmm", "bmm", "baddbmm"}


def gemm_shape(name: str, args) -> tuple:
    """(m, n, k, batch) of one GEMM aten op's call."""
    if name in ("addmm", "baddbmm"):
        args = args[1:]  # (bias / input, a, b)
    a, b = args[0].shape, args[1].shape
    if name in ("mm", "addmm"):
        return a[0], b[1], a[1], 1
    return a[1], b[2], a[2], a[0]


class Record(TorchDispatchMode):
    """Every GEMM's shape, the attention calls and every aten op's name (counted), while active."""

    def __init__(self):
        super().__init__()
        self.gemms, self.attention, self.ops = [], 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        if name in GEMMS:
            self.gemms.append([int(v) for v in gemm_shape(name, args)])
        elif name.startswith("_scaled_dot_product") or name.startswith("_flash_attention"):
            self.attention += 1
        return func(*args, **(kwargs or {}))


def sources_sha256() -> dict:
    """{file: SHA-256} of the twin's sources."""
    out = {}
    for name in SOURCES:
        with open(os.path.join(HERE, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def record(a: Arch, moe, recompute: bool, deepseek=None) -> dict:
    """The twin's forward and backward GEMMs, attention calls and aten ops by name for one micro-batch
    [MICRO, a.seq]; `deepseek`: (MLA, SigmoidRouter) for `DeepSeekDecoder`."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    kw = dict(device="cpu", dtype=torch.float32, recompute=recompute, generator=gen)
    if deepseek is not None:
        model = DeepSeekDecoder(a, moe, *deepseek, **kw)
    else:
        model = MoEDecoder(a, moe, **kw) if moe is not None else Decoder(a, **kw)
    batch = make_batch(a, MICRO, "cpu", generator=gen)
    with Record() as fwd:
        loss = model(*batch)
    with Record() as bwd:
        loss.backward()
    return {"forward": fwd.gemms, "backward": bwd.gemms, "attention": [fwd.attention, bwd.attention],
            "ops": [dict(sorted(fwd.ops.items())), dict(sorted(bwd.ops.items()))]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for <case>.json (benchmarks/data/twin_ops)")
    ap.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    sha = sources_sha256()
    for name, (a, moe, recompute, overrides, deepseek) in CASES.items():
        if args.only and name not in args.only:
            continue
        got = record(a, moe, recompute, deepseek)
        doc = {"case": name, "command": COMMAND, "sources_sha256": sha, "torch": torch.__version__,
               "micro_batch": MICRO, "arch": a.as_dict(), "moe": moe.as_dict() if moe else None,
               "mla": deepseek[0].as_dict() if deepseek else None, "router": deepseek[1].as_dict() if deepseek else None,
               "recompute": recompute, "paddle_overrides": overrides, **got}
        with open(os.path.join(args.out, f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        print(f"{name}: {len(got['forward'])} forward GEMMs, {len(got['backward'])} backward, attention {got['attention']}")


if __name__ == "__main__":
    main()

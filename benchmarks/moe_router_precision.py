"""How many top-k routing choices a bf16 (or TF32) router GEMM flips against an exact one, on CPU (numpy).

    python benchmarks/moe_router_precision.py [--tokens 8192] [--seed 0]

The router of an MoE layer under AMP O2 gets the bf16 activations x [T, h] (RMS-normalised: entries ~ N(0, 1) here,
rounded to bf16 as O2 holds them) and its weight W [h, E] (N(0, sigma^2), llmtrain's init_std 0.02; the master copy is
fp32). The GEMMs compared, each emulated exactly on CPU (CPU Paddle 3.3.1 has no bf16 matmul):

- `exact`: x @ W in float64, the reference;
- `fp32`: fp32 operands, fp32 sums (numpy's sgemm) = `model.moe_router_dtype=fp32` with TF32 off;
- `tf32`: what that fp32 GEMM is on an Ampere/Hopper GPU under Paddle's default (`core.get_cublas_switch()` is True:
  cuBLAS may run fp32 GEMMs on TF32 tensor cores): operands rounded to 10 mantissa bits (round to nearest even
  here; x, already bf16, is unchanged), products summed in fp32;
- `bf16`: `model.moe_router_dtype=amp` (llmtrain before fp32 routing): the weight rounded to bf16 (O2's decorate casts
  it), bf16 x bf16 products summed in fp32 (cuBLAS's bf16 GEMM accumulates in fp32), the result rounded to bf16.
  This is the right emulation of the GPU's GEMM: rounding the inputs and the output, not the logits alone;
- `bf16 logits`: the exact logits rounded to bf16 (the output rounding alone, for comparison).

For each, the share of tokens whose top-k expert set differs from the exact one, the share of the T k choices that
differ, and the relative change of the Switch aux loss E sum_i f_i P_i (f from the top-k, P the softmax mean). The
top-k of softmax (or sigmoid) scores is the top-k of the logits, so flips are counted on logits. A uniform rescale of
W scales the logits and their bf16 rounding errors alike (bf16 is relative), so the flip rate depends on the shape
of the logit distribution, not on its scale (the rows with 3 sigma check it); a trained router's shape was not at hand.
Prints a markdown table (docs/models.md holds a run).
"""
from __future__ import annotations

import argparse

import numpy as np

SHAPES = [  # (label, hidden, experts, top_k)
    ("64 experts top-6, h 2560 (ERNIE-4.5-21B-A3B)", 2560, 64, 6),
    ("128 experts top-8, h 2048 (Qwen3-30B-A3B)", 2048, 128, 8),
    ("256 experts top-8, h 7168 (DeepSeek-V3)", 7168, 256, 8),
]


def round_mantissa(a: np.ndarray, bits: int) -> np.ndarray:
    """fp32 values rounded to `bits` explicit mantissa bits, round to nearest even (bf16: 7, TF32: 10)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    shift = 23 - bits
    half = np.uint32((1 << (shift - 1)) - 1) + ((u >> np.uint32(shift)) & np.uint32(1))
    return (((u + half) >> np.uint32(shift)) << np.uint32(shift)).view(np.float32)


def bf16(a):
    return round_mantissa(a, 7)


def logits_by_kind(x: np.ndarray, w: np.ndarray) -> dict[str, np.ndarray]:
    """x [T, h] (bf16 values), w [h, E] fp32 -> {kind: logits [T, E]} (module docstring)."""
    exact = x.astype(np.float64) @ w.astype(np.float64)
    return {"exact": exact,
            "fp32": x @ w,
            "tf32": round_mantissa(x, 10) @ round_mantissa(w, 10),
            "bf16": bf16(x @ bf16(w)),
            "bf16 logits": bf16(exact.astype(np.float32))}


def topk_sets(logits: np.ndarray, k: int) -> np.ndarray:
    """[T, k] chosen experts, sorted per token (a set)."""
    return np.sort(np.argpartition(-logits, k - 1, axis=-1)[:, :k], axis=-1)


def aux_loss(logits: np.ndarray, chosen: np.ndarray, experts: int) -> float:
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    f = np.bincount(chosen.ravel(), minlength=experts) / logits.shape[0]
    return float(experts * (f * p.mean(0)).sum())


def compare(tokens: int, hidden: int, experts: int, top_k: int, sigma: float, rng) -> dict[str, tuple]:
    """{kind: (tokens flipped, choices flipped, |aux change| / aux)} over `tokens` tokens, in chunks of 2048."""
    w = rng.standard_normal((hidden, experts), dtype=np.float32) * np.float32(sigma)
    flips: dict[str, list] = {}
    chosen: dict[str, list] = {}
    logits_of: dict[str, list] = {}
    for start in range(0, tokens, 2048):
        x = bf16(rng.standard_normal((min(2048, tokens - start), hidden), dtype=np.float32))
        for kind, logits in logits_by_kind(x, w).items():
            sets = topk_sets(logits, top_k)
            chosen.setdefault(kind, []).append(sets)
            logits_of.setdefault(kind, []).append(logits.astype(np.float32))
    ref = np.concatenate(chosen["exact"])
    aux_ref = aux_loss(np.concatenate(logits_of["exact"]), ref, experts)
    for kind in chosen:
        if kind == "exact":
            continue
        got = np.concatenate(chosen[kind])
        differ = np.array([len(np.setdiff1d(a, b, assume_unique=True)) for a, b in zip(got, ref)])
        aux = aux_loss(np.concatenate(logits_of[kind]), got, experts)
        flips[kind] = ((differ > 0).mean(), differ.sum() / differ.size / top_k, abs(aux - aux_ref) / aux_ref)
    logit_std = float(np.concatenate(logits_of["exact"]).std())
    return flips, logit_std


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sigma", type=float, default=0.02, help="router weight std (llmtrain's init_std)")
    a = ap.parse_args(argv)
    print(f"{a.tokens} tokens per row, x ~ N(0, 1) in bf16, W ~ N(0, sigma^2), seed {a.seed}\n")
    print("| router | W std | logit std | GEMM | tokens with a different top-k set | choices flipped "
          "| aux loss change |")
    print("|---|---|---|---|---|---|---|")
    for label, hidden, experts, top_k in SHAPES:
        for scale in (1, 3):
            rng = np.random.default_rng(a.seed)
            flips, std = compare(a.tokens, hidden, experts, top_k, a.sigma * scale, rng)
            for kind, (tok, choice, aux) in flips.items():
                print(f"| {label} | {a.sigma * scale:g} | {std:.2f} | {kind} | {100 * tok:.2f}% | {100 * choice:.3f}% "
                      f"| {aux:.1e} |")


if __name__ == "__main__":
    main()

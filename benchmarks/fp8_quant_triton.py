"""Fused blockwise FP8 quantisation in Triton: the instrument for the class of Paddle's `fp8_quant_blockwise`.

    python benchmarks/fp8_quant_triton.py --out DIR          # on a CUDA GPU with FP8 (sm_89+): check, then time
    python benchmarks/fp8_quant_triton.py --out DIR --quick  # the bit-exactness check and one shape only

Paddle 3.3.1's `paddle.incubate.nn.functional.fp8_quant_blockwise(x, quant_method, input_transpose,
return_transpose_only, output_scale_transpose, using_pow2_scale)` is one CUDA pass per call (its kernels
`quantize_1x128_kernel`, `quantize_128x128_kernel`, `quant_per_token_per_block`): read bf16, amax per tile, a
power-of-two multiplier, write e4m3 and fp32 decode scales, and, with `input_transpose`, the transposed copy the
dW GEMM reads. No Paddle GPU build runs on the measuring machine, so this file writes the same single pass in
Triton, one kernel per variant Paddle offers (llmtrain's GPU path calls the first four,
llmtrain/paddle_compat/fp8_kernels.py):

| variant    | Paddle call                                             | in -> out                                          |
|------------|---------------------------------------------------------|----------------------------------------------------|
| `1x128`    | quant_method="1x128"                                    | x [R, C] -> q [R, C], decode [C/128, R]            |
| `1x128T`   | "1x128", input_transpose, return_transpose_only         | x [R, C] -> q [C, R] (128 rows of x a tile), [R/128, C] |
| `128x128`  | quant_method="128x128"                                  | x [R, C] -> q [R, C], decode [R/128, C/128]        |
| `128x128T` | "128x128", input_transpose, return_transpose_only       | x [R, C] -> qᵀ [C, R], decode [C/128, R/128]       |
| `1x128+T`  | "1x128", input_transpose (both outputs, one pass)        | both of `1x128` and `1x128T`                       |

Scale rule (Paddle's `ScaleWrapper<pow2>`): amax = max |x| over the tile; m = 2^floor(log2(448 / amax)) (the
exponent bits of the fp32 quotient; 2^127 where the quotient overflows), m = 1 for a zero tile; q = e4m3(x * m)
(round to nearest even, saturating); decode = 1 / m. The kernels take the exponent from amax's bits with integer
arithmetic (exact: 448 = 1.75 * 2^8, so floor(log2(448 / amax)) = 8 - e or 7 - e by whether amax's mantissa is
above 1.75; no division whose rounding or flush-to-zero could move it) and build 1 / m from bits too (2^-127 is
an fp32 subnormal). `check()` compares every variant bit for bit with a PyTorch reference written from Paddle's
CUDA source (IEEE division, as Paddle computes it) on fresh random data and planted edge tiles (zero tiles,
bf16 subnormals, amax exactly 1.75 * 2^e, amax 448 and 450, outliers that push tile mates to e4m3 subnormals),
outputs poisoned (NaN bytes) before each run so an unwritten element fails. NaN and inf inputs are left out:
Paddle's amax (fmaxf) skips a NaN, which llmtrain's FP8 health check reports before it matters.

Timing: benchmarks/gpu_reference.py's `Bench.time_calls` (CUDA graphs over rotated inputs, CUDA events,
median), the (rows, cols) grid of gpu_h100.run_fp8_quant, a few launch configurations per variant (the fastest
kept, every one listed); `gbps` counts 2 B read and 1 B written per element per output copy (scales ignored), as
fp8_quant.json's other rows do. Ceilings in the same call: a bf16 device copy (4 B / element) and PyTorch's plain
bf16 -> e4m3 cast (3 B / element, no scales).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_reference import Bench  # noqa: E402

FP8 = torch.float8_e4m3fn
SHAPES = [(4096, 4096), (4096, 11008), (8192, 4096), (16384, 4096), (16384, 11008), (16384, 2048), (16384, 5632)]
"""gpu_h100.run_fp8_quant's grid (fp8_quant.json)."""
VARIANTS = ("1x128", "1x128T", "128x128", "128x128T", "1x128+T")
OUT_COPIES = {"1x128": 1, "1x128T": 1, "128x128": 1, "128x128T": 1, "1x128+T": 2}


# ---------------------------------------------------------------- kernels
@triton.jit
def _multiplier_bits(amax):
    """amax fp32 >= 0 (any shape) -> (m, 1 / m) fp32: m = 2^k, k = floor(log2(448 / amax)) clamped to 127, k = 0
    where amax = 0 (module docstring), exact from the bits."""
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF  # biased exponent of amax
    mant = bits & 0x7FFFFF
    k = tl.where(mant <= 0x600000, 135 - e, 134 - e)  # 8 - (e - 127) or 7 - (e - 127)
    k = tl.where(e == 0, 127, k)  # a subnormal amax: 448 / amax overflows fp32, Paddle takes 2^127
    k = tl.minimum(k, 127)
    k = tl.where(bits == 0, 0, k)  # a zero tile: m = 1
    m = ((k + 127) << 23).to(tl.float32, bitcast=True)
    dec_bits = tl.where(k < 127, (127 - k) << 23, 0x00400000)  # 2^-k; 2^-127 is the subnormal 0x00400000
    return m, dec_bits.to(tl.float32, bitcast=True)


@triton.jit
def _quant_1x128(x_ptr, q_ptr, s_ptr, R, C, BLOCK_M: tl.constexpr):
    """x [R, C] bf16 -> q [R, C] e4m3 by 1x128 tiles, decode scales [ceil(C/128), R] (Paddle's transposed scale
    layout); ragged R and C masked (a tile is the part that exists)."""
    pid_m, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_c * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, 128]
    m, dec = _multiplier_bits(tl.max(tl.abs(x), axis=1))  # [BLOCK_M]
    tl.store(q_ptr + offs, (x * m[:, None]).to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + pid_c.to(tl.int64) * R + rows, dec, mask=rows < R)


@triton.jit
def _quant_128x128(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, R, C, PLAIN: tl.constexpr, TRANS: tl.constexpr):
    """x [R, C] bf16 (R, C multiples of 128) -> q [R, C] and/or qᵀ [C, R] e4m3 by 128x128 blocks; decode scales
    [R/128, C/128] and/or [C/128, R/128]."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * 128 + tl.arange(0, 128)
    cols = pid_c * 128 + tl.arange(0, 128)
    xb = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :])  # [128, 128] bf16
    m, dec = _multiplier_bits(tl.max(tl.max(tl.abs(xb.to(tl.float32)), axis=1), axis=0))
    if PLAIN:
        q = (xb.to(tl.float32) * m).to(tl.float8e4nv)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], q)
        tl.store(s_ptr + pid_r * tl.cdiv(C, 128) + pid_c, dec)
    if TRANS:  # the bf16 tile transposed on chip, then quantised with the same block scale
        qt = (tl.trans(xb).to(tl.float32) * m).to(tl.float8e4nv)  # [128 (cols), 128 (rows)]
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * R + rows[None, :], qt)
        tl.store(st_ptr + pid_c * tl.cdiv(R, 128) + pid_r, dec)


@triton.jit
def _quant_1x128_t(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, R, C, PLAIN: tl.constexpr, TRANS: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """x [R, C] bf16 (R a multiple of 128, C of BLOCK_C) -> q [R, C] by 1x128 tiles (decode [C/128, R]) and/or
    qᵀ [C, R] by 1x128 tiles of xᵀ, i.e. 128 rows of one column of x (decode [R/128, C])."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * 128 + tl.arange(0, 128)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    xb = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :])  # [128, BLOCK_C] bf16
    if PLAIN:  # BLOCK_C == 128: one 1x128 tile per row
        x = xb.to(tl.float32)
        m, dec = _multiplier_bits(tl.max(tl.abs(x), axis=1))  # [128]
        tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], (x * m[:, None]).to(tl.float8e4nv))
        tl.store(s_ptr + pid_c.to(tl.int64) * R + rows, dec)
    if TRANS:
        xt = tl.trans(xb).to(tl.float32)  # [BLOCK_C, 128]: one 1x128 tile of xᵀ per row
        mt, dect = _multiplier_bits(tl.max(tl.abs(xt), axis=1))  # [BLOCK_C]
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * R + rows[None, :], (xt * mt[:, None]).to(tl.float8e4nv))
        tl.store(st_ptr + pid_r.to(tl.int64) * C + cols, dect)


def outputs(x: torch.Tensor, variant: str) -> dict:
    """Fresh output buffers of `variant` for x [R, C], poisoned: e4m3 bytes 0x7F (NaN), scales NaN."""
    R, C = x.shape
    nan8 = lambda *s: torch.full(s, 0x7F, dtype=torch.uint8, device=x.device).view(FP8)  # noqa: E731
    nan32 = lambda *s: torch.full(s, float("nan"), dtype=torch.float32, device=x.device)  # noqa: E731
    out = {}
    if variant in ("1x128", "1x128+T"):
        out["q"], out["s"] = nan8(R, C), nan32(triton.cdiv(C, 128), R)
    if variant in ("1x128T", "1x128+T"):
        out["qt"], out["st"] = nan8(C, R), nan32(R // 128, C)
    if variant == "128x128":
        out["q"], out["s"] = nan8(R, C), nan32(R // 128, C // 128)
    if variant == "128x128T":
        out["qt"], out["st"] = nan8(C, R), nan32(C // 128, R // 128)
    return out


def launch(x: torch.Tensor, variant: str, out: dict, cfg: dict) -> None:
    """One launch of `variant` on x [R, C] into `out` (from `outputs`) with launch configuration `cfg`."""
    R, C = x.shape
    q, s, qt, st = (out.get(k, x) for k in ("q", "s", "qt", "st"))  # x: an unused pointer
    if variant == "1x128":
        bm = cfg.get("BLOCK_M", 32)
        _quant_1x128[(triton.cdiv(R, bm), triton.cdiv(C, 128))](x, q, s, R, C, BLOCK_M=bm,
                                                                  num_warps=cfg.get("num_warps", 4))
    elif variant.startswith("128x128"):
        assert R % 128 == 0 and C % 128 == 0, (R, C)
        _quant_128x128[(R // 128, C // 128)](x, q, s, qt, st, R, C, PLAIN=variant == "128x128",
                                              TRANS=variant == "128x128T", num_warps=cfg.get("num_warps", 8))
    else:
        bc = 128 if variant == "1x128+T" else cfg.get("BLOCK_C", 128)
        assert R % 128 == 0 and C % bc == 0, (R, C, bc)
        _quant_1x128_t[(R // 128, C // bc)](x, q, s, qt, st, R, C, PLAIN=variant == "1x128+T", TRANS=True,
                                            BLOCK_C=bc, num_warps=cfg.get("num_warps", 8))


CONFIGS = {
    "1x128": [{"BLOCK_M": 16, "num_warps": 4}, {"BLOCK_M": 32, "num_warps": 4}, {"BLOCK_M": 64, "num_warps": 8}],
    "1x128T": [{"BLOCK_C": 64, "num_warps": 4}, {"BLOCK_C": 128, "num_warps": 8}, {"BLOCK_C": 64, "num_warps": 8}],
    "128x128": [{"num_warps": 4}, {"num_warps": 8}, {"num_warps": 16}],
    "128x128T": [{"num_warps": 4}, {"num_warps": 8}, {"num_warps": 16}],
    "1x128+T": [{"num_warps": 4}, {"num_warps": 8}, {"num_warps": 16}],
}
"""Launch configurations timed per variant and shape (the fastest is the row's time)."""


# ---------------------------------------------------------------- reference (Paddle's CUDA semantics)
def ref_tiles(x: torch.Tensor, tr: int, tc: int):
    """x [R, C] bf16 -> (q e4m3 [R, C], decode fp32 [ceil(R/tr), ceil(C/tc)]) by tr x tc tiles, Paddle's rule with
    IEEE fp32 division (ScaleWrapper<true>: 448 / amax, inf -> 2^127, exponent bits kept; zero tile -> 1)."""
    R, C = x.shape
    nr, nc = -(-R // tr), -(-C // tc)
    xf = torch.zeros(nr * tr, nc * tc, dtype=torch.float32, device=x.device)
    xf[:R, :C] = x.float()
    t = xf.view(nr, tr, nc, tc)
    amax = t.abs().amax(dim=(1, 3))  # [nr, nc]
    ratio = (448.0 / torch.where(amax > 0, amax, torch.ones_like(amax))).clamp(max=2.0 ** 127)
    m = (ratio.view(torch.int32) & 0x7F800000).view(torch.float32)
    m = torch.where(amax > 0, m, torch.ones_like(m))
    q = (t * m[:, None, :, None]).to(FP8).view(nr * tr, nc * tc)[:R, :C]
    return q, 1.0 / m.double()  # decode in float64: 2^-127 exactly, compared after the fp32 cast


def reference(x: torch.Tensor, variant: str) -> dict:
    """The outputs `outputs()/launch()` must produce, computed by `ref_tiles`."""
    out = {}
    if variant in ("1x128", "1x128+T"):
        q, d = ref_tiles(x, 1, 128)
        out["q"], out["s"] = q, d.t()
    if variant in ("1x128T", "1x128+T"):
        q, d = ref_tiles(x.t().contiguous(), 1, 128)  # xᵀ [C, R] by 1x128 tiles, decode [C, R/128]
        out["qt"], out["st"] = q, d.t()
    if variant == "128x128":
        out["q"], out["s"] = ref_tiles(x, 128, 128)
    if variant == "128x128T":
        q, d = ref_tiles(x, 128, 128)
        out["qt"], out["st"] = q.t(), d.t()
    return out


def test_input(R: int, C: int, gen: torch.Generator, device) -> torch.Tensor:
    """Random bf16 [R, C] with rows at scales 2^-20..2^20 and planted edge tiles (module docstring)."""
    x = torch.randn(R, C, device=device, generator=gen)
    x *= torch.exp2(torch.randint(-20, 21, (R, 1), device=device, generator=gen).float())
    # a fifth of the 128-element row tiles get one outlier 2^6..2^14 times the rest (tile mates -> e4m3 subnormals)
    nt = -(-C // 128)
    hit = torch.rand(R, nt, device=device, generator=gen) < 0.2
    pos = torch.randint(0, 128, (R, nt), device=device, generator=gen) + torch.arange(nt, device=device) * 128
    pos = pos.clamp(max=C - 1)
    boost = torch.exp2(torch.randint(6, 15, (R, nt), device=device, generator=gen).float())
    rr = torch.arange(R, device=device)[:, None].expand(R, nt)
    x[rr[hit], pos[hit]] *= boost[hit]
    x = x.to(torch.bfloat16)
    if R >= 256 and C >= 256:
        x[0:128, 128:256] = 0  # a zero 128x128 block (zero 1x128 tiles too)
        x[128:130, :] = 1e-39  # bf16 subnormals: 448 / amax overflows, m = 2^127, decode 2^-127
        x[130, :] = 0.21875  # amax = 1.75 * 2^-3: 448 / amax is exactly 2^11
        x[131, :] = 448.0  # m = 1
        x[132, :] = 450.0  # m = 0.5 (next bf16 above 448)
        x[133, :128] = -torch.arange(128, device=device).to(torch.bfloat16) * 3.5  # amax 444.5, negatives
        x[134:136, :] = (torch.randn(2, C, device=device, generator=gen) * 1e30).to(torch.bfloat16)  # large
        x[136, :] = -0.0
        x[256 - 3:256, 5] = 1e-39  # a column tile (1x128T) whose rows mix subnormals with normal values
    return x


def compare(got: dict, want: dict) -> list[str]:
    """Mismatch messages (empty: every output equal bit for bit, every element written)."""
    bad = []
    for key, w in want.items():
        g = got[key]
        if key.startswith("q"):
            gb, wb = g.view(torch.uint8), w.contiguous().view(torch.uint8)
            n = int((gb != wb).sum())
            if n:
                idx = (gb != wb).nonzero()[:3].tolist()
                bad.append(f"{key}: {n} of {gb.numel()} bytes differ, e.g. at {idx}: got "
                           f"{[int(gb[i, j]) for i, j in idx]} want {[int(wb[i, j]) for i, j in idx]}")
        else:
            gw, ww = g.view(torch.int32), w.float().contiguous().view(torch.int32)
            n = int((gw != ww).sum())
            if n:
                bad.append(f"{key}: {n} of {gw.numel()} scales differ (got {g.flatten()[:3].tolist()} want "
                           f"{w.flatten()[:3].tolist()})")
    return bad


def check(dev, quick: bool) -> list[dict]:
    """Every variant against the reference on several shapes: one result row per (variant, shape)."""
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    shapes = [(256, 384), (512, 1024), (200, 300), (4096, 11008)] + ([] if quick else [(16384, 2048)])
    rows = []
    for R, C in shapes:
        for variant in VARIANTS:
            ragged = R % 128 or C % 128
            if ragged and variant != "1x128":
                continue  # Paddle takes ragged shapes by 1x128 tiles without transpose only
            for cfg in CONFIGS[variant]:
                if variant == "1x128T" and C % cfg.get("BLOCK_C", 128):
                    continue
                x = test_input(R, C, gen, dev)
                out = outputs(x, variant)
                launch(x, variant, out, cfg)
                torch.cuda.synchronize()
                bad = compare(out, reference(x, variant))
                rows.append({"variant": variant, "rows": R, "cols": C, "config": cfg, "bit_exact": not bad,
                             "mismatches": bad})
                print(f"[check] {variant} {R}x{C} {cfg}: " + ("bit-exact" if not bad else "; ".join(bad)),
                      flush=True)
    return rows


def sample(dev, path: str) -> None:
    """A small input and every variant's output (raw bits) for the CPU test of llmtrain's emulation
    (tests/fp8/test_emulation_matches_gpu_kernel.py): x [256, 384] bf16 from `test_input`."""
    gen = torch.Generator(device=dev)
    gen.manual_seed(7)
    x = test_input(256, 384, gen, dev)
    arrays = {"x_bf16_bits": x.view(torch.int16).cpu().numpy()}
    for variant in VARIANTS:
        out = outputs(x, variant)
        launch(x, variant, out, CONFIGS[variant][0])
        torch.cuda.synchronize()
        assert not compare(out, reference(x, variant)), variant
        for key, t in out.items():
            arrays[f"{variant}.{key}"] = (t.view(torch.uint8) if key.startswith("q") else t).cpu().numpy()
    np.savez_compressed(path, **arrays)


# ---------------------------------------------------------------- timing
def time_rows(b: Bench, shapes, deadline: float) -> list[dict]:
    rows = []
    for R, C in shapes:
        n_copies = b.copies(3 * R * C)
        xs = [torch.randn(R, C, device=b.dev, generator=b.gen).to(torch.bfloat16) for _ in range(n_copies)]
        for tile, fn, nbytes in (("copy", lambda x, y: y.copy_(x), 4), ("cast", lambda x, y: x.to(FP8), 3)):
            ys = [torch.empty_like(x) for x in xs]
            sec, how = b.time_calls([lambda x=x, y=y: fn(x, y) for x, y in zip(xs, ys)])
            rows.append({"rows": R, "cols": C, "tile": tile, "impl": "torch", "ms": sec * 1e3,
                         "gbps": nbytes * R * C / sec / 1e9, "timing": how, "ceiling": True})
            del ys
        for variant in VARIANTS:
            if time.time() > deadline:
                rows.append({"note": "time budget spent"})
                return rows
            sweep = []
            for cfg in CONFIGS[variant]:
                outs = [outputs(x, variant) for x in xs]
                try:
                    sec, how = b.time_calls([lambda x=x, o=o, c=cfg: launch(x, variant, o, c)
                                             for x, o in zip(xs, outs)])
                    sweep.append({"config": cfg, "ms": sec * 1e3, "timing": how})
                except Exception as e:  # noqa: BLE001
                    sweep.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:300]})
                del outs
            ok = [s for s in sweep if "ms" in s]
            best = min(ok, key=lambda s: s["ms"]) if ok else None
            nbytes = 2 + OUT_COPIES[variant]
            row = {"rows": R, "cols": C, "tile": variant, "impl": "triton", "sweep": sweep}
            if best:
                row.update(ms=best["ms"], gbps=nbytes * R * C / (best["ms"] * 1e-3) / 1e9, timing=best["timing"],
                           config=best["config"])
            rows.append(row)
            print(f"[time] {variant} {R}x{C}: " + (f"{row['ms']:.4f} ms {row['gbps']:.0f} GB/s {best['config']}"
                                                   if best else str(sweep)), flush=True)
        del xs
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds for the timing")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    args.cpu, args.smoke, args.warmup, args.steps_n = False, False, 2, 8
    b = Bench(args)
    assert b.cuda, "needs a CUDA GPU with FP8 (sm_89+)"
    t0 = time.time()
    checks = check(b.dev, args.quick)
    exact = all(r["bit_exact"] for r in checks)
    print(f"[check] {sum(r['bit_exact'] for r in checks)} of {len(checks)} bit-exact ({time.time() - t0:.1f} s)",
          flush=True)
    result = {"provenance": {**__import__("gpu_reference").provenance(b), "triton": triton.__version__},
              "check": {"all_bit_exact": exact, "rows": checks}, "rows": []}
    path = os.path.join(args.out, "fp8_quant_triton.json")

    def flush():
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)

    flush()
    try:
        sample(b.dev, os.path.join(args.out, "fp8_quant_sample.npz"))
    except Exception as e:  # noqa: BLE001
        result["sample_error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"[sample] {result['sample_error']}", flush=True)
    if not exact:
        print("[time] skipped: a variant is not bit-exact", flush=True)
        flush()
        return
    shapes = SHAPES[:1] if args.quick else SHAPES
    result["rows"] = time_rows(b, shapes, time.time() + args.budget)
    result["notes"] = ("Triton kernels of benchmarks/fp8_quant_triton.py (Paddle's fp8_quant_blockwise class, "
                       "pow2 scales); gbps counts 2 B read + 1 B written per element per output copy (scales "
                       "ignored); tile 'copy' / 'cast' (impl torch, ceiling) are a bf16 device copy (4 B) and "
                       "x.to(float8_e4m3fn) (3 B) in the same call")
    flush()
    print(f"[time] {len([r for r in result['rows'] if 'ms' in r])} rows ({time.time() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()

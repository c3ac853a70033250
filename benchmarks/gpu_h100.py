"""H100 measurements beyond gpu_reference.py / gpu_tables.py: FA3-class attention, held-out twin steps with it,
FP8 GEMM and quantisation tables, recompute-mode steps (PyTorch as the instrument, as gpu_reference.py).

    python benchmarks/gpu_h100.py --out DIR --only attention_fa3          # where PyTorch and a CUDA GPU are present
    python benchmarks/gpu_h100.py --out DIR --only steps_dense,steps_long,steps_moe --budget steps_moe=60
    python benchmarks/gpu_h100.py --out /tmp/smoke --smoke                # tiny shapes, runs on CPU (logic check)

Tables (one JSON file each in DIR, with gpu_reference's `provenance`; rewritten after every row):
- `attention_fa3`: causal attention fwd and bwd, seq 512..65536, on the twin's layout (split views of one
  [b, s, (nh + 2 nkv) d] tensor, transposed to [b, heads, s, d]: the memory layout Paddle's flash_attention
  reads), through cuDNN (`impl` "cudnn", the FA3-class kernel on Hopper that PyTorch ships: the GPU image's
  torch has no FlashAttention-3) and through PyTorch's FlashAttention-2 (`impl` "flash2"), side by side.
- `steps` / `long_steps` / `moe_steps`: held-out twin steps (benchmarks/gpu_model.py, gpu_moe.py), never fitted,
  with SDPA pinned to cuDNN where cuDNN takes the shape (`attention_backend` per row says which kernel ran):
  dense rows <= 8k (gpu_reference.STEP_ROWS that fit 80 GB), 16k-64k rows that fit, MoE capacity 1.25 and
  dropless rows (gpu_tables.moe_rows "final", slots formulation).
- `fp8_gemm`: C[m, n] = A[m, k] B[k, n] in bf16 (`torch.mm`) and through `torch._scaled_mm` with e4m3 operands:
  tensorwise, rowwise, blockwise_1x128_128x128 (A 1x128 tiles, B 128x128 blocks: DeepSeek-V3's recipe) and
  blockwise_1x128_1x128, bf16 output; `rel_err` of each recipe against the bf16 product on fresh operands.
  Timed as gemm.json (CUDA graphs over rotated operands, CUDA events, median).
- `fp8_quant`: bf16 [rows, cols] -> e4m3 plus fp32 scales per tile ("tensor", "1x128", "128x128"), eager
  (amax, scale, multiply, cast: several kernels) and fused by torch.compile (`impl`).
- `recompute_steps`: llama-7b-twin (h 4096, 32 heads, ffn 11008; 4 or 8 layers) steps per recompute mode: none,
  full (each block), full_attn (norm + attention sub-block), core_attn (the SDPA call), mlp (norm + MLP
  sub-block); `step_ms` (median), `peak_gib` (max allocated in the timed steps), `static_gib` (allocated before
  a step: weights, grads, optimizer state), `act_gib` = peak - static.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_model  # noqa: E402
from gpu_model import Decoder, MasterAdamW, llama, make_batch, train_step  # noqa: E402
from gpu_reference import STEP_ROWS, Bench, randn  # noqa: E402
from gpu_tables import _free as free, _timed_steps as timed, run_tables  # noqa: E402

TABLES = ("attention_fa3", "fp8_gemm", "fp8_quant", "recompute_steps", "steps_dense", "steps_long", "steps_moe")
GIB = 2 ** 30
SDPA = F.scaled_dot_product_attention
BACKEND_USED: set = set()


# ---------------------------------------------------------------- attention backend policy
def probe_cudnn(b: Bench) -> dict:
    """{(gqa, head_dim): True/False}: whether cuDNN's SDPA runs fwd+bwd on the twin's layout for that case."""
    if not b.cuda:
        return {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for gqa in (False, True):
        for d in (64, 128):
            nh, nkv = 8, (2 if gqa else 8)
            qkv = randn(b, 1, 256, (nh + 2 * nkv) * d).requires_grad_(True)
            q, k, v = (t.view(1, 256, -1, d).transpose(1, 2) for t in qkv.split([nh * d, nkv * d, nkv * d], -1))
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    y = SDPA(q, k, v, is_causal=True, enable_gqa=gqa)
                y.float().sum().backward()
                b.sync()
                out[(gqa, d)] = True
            except Exception as e:  # noqa: BLE001
                out[(gqa, d)] = False
                print(f"[probe] cudnn refused gqa={gqa} d={d}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    return out


def pin_attention(b: Bench, ok: dict):
    """Route the twin's SDPA calls to cuDNN where the probe says it runs, else FlashAttention-2; every call adds
    its backend to BACKEND_USED."""
    if not b.cuda:
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(q, k, v, *args, enable_gqa=False, **kw):
        cud = ok.get((bool(enable_gqa), q.shape[-1]), False)
        BACKEND_USED.add("cudnn" if cud else "flash2")
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if cud else SDPBackend.FLASH_ATTENTION):
            return SDPA(q, k, v, *args, enable_gqa=enable_gqa, **kw)
    F.scaled_dot_product_attention = sdpa  # gpu_model / gpu_moe call it through this module


# ---------------------------------------------------------------- attention_fa3
def attention_configs(smoke: bool):
    """((batch, heads, kv_heads, head_dim), seqs): gpu_reference's attention configs up to 8k (batch x seq <=
    32768), gpu_tables' long configs from 4k to 64k."""
    if smoke:
        return [((1, 4, 2, 16), (64, 128)), ((1, 4, 4, 32), (64,))]
    short = [(1, 32, 32, 128), (4, 32, 32, 128), (1, 32, 4, 128), (2, 16, 16, 128), (8, 16, 16, 64), (4, 32, 32, 64)]
    out = [(c, (16384, 32768, 65536)) for c in ((1, 32, 4, 64), (1, 32, 32, 128))]  # the long rows first
    out += [(c, tuple(s for s in (512, 1024, 2048, 4096, 8192) if c[0] * s <= 32768)) for c in short]
    out += [((1, 32, 4, 64), (4096, 8192))]
    return out


def run_attention_fa3(b: Bench, deadline: float):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ways = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash2", SDPBackend.FLASH_ATTENTION)) if b.cuda else \
        (("math", SDPBackend.MATH),)
    reps0 = b.args.reps
    for (bs, nh, nkv, d), seqs in attention_configs(b.args.smoke):
        for s in seqs:
            for impl, backend in ways:
                if time.time() > deadline:
                    b.add("attention_fa3", {"note": "time budget spent"})
                    return
                row = {"batch": bs, "heads": nh, "kv_heads": nkv, "seq": s, "head_dim": d, "causal": True,
                       "impl": impl, "layout": "twin views of [b, s, (nh + 2 nkv) d]"}
                b.args.reps = 5 if s >= 32768 else reps0
                try:
                    qkv = randn(b, bs, s, (nh + 2 * nkv) * d).requires_grad_(True)
                    q, k, v = (t.view(bs, s, -1, d).transpose(1, 2) for t in qkv.split([nh * d, nkv * d, nkv * d], -1))

                    def fwd():
                        with sdpa_kernel(backend):
                            return SDPA(q, k, v, is_causal=True, enable_gqa=nkv != nh)
                    out = fwd()
                    dout = randn(b, *out.shape, dtype=out.dtype)
                    flops = 4 * bs * nh * s * s * d / 2
                    row["fwd_s"], row["timing"] = b.time_calls([fwd], graph=False)
                    row["bwd_s"], _ = b.time_calls([lambda: torch.autograd.grad(out, qkv, dout, retain_graph=True)],
                                                   graph=False)
                    row.update(fwd_tflops=flops / row["fwd_s"] / 1e12, bwd_tflops=2.5 * flops / row["bwd_s"] / 1e12)
                    del out, dout, q, k, v, qkv
                except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                b.add("attention_fa3", row, {"flops_note": "fwd 4*b*nh*s^2*d/2 (causal half), bwd 2.5x fwd; bwd "
                                                           "is autograd.grad into the fused qkv tensor"})
                print(f"[attention_fa3] {impl} b{bs} h{nh}/{nkv} d{d} s{s}: " + (row.get("error") or
                      f"fwd {row['fwd_tflops']:.0f} bwd {row['bwd_tflops']:.0f}"), flush=True)
                free(b)
    b.args.reps = reps0


# ---------------------------------------------------------------- fp8
def fp8_shapes(smoke: bool) -> list[tuple]:
    if smoke:
        return [(256, 256, 256), (128, 384, 256)]
    out = set()
    for m in (4096, 16384):
        for n, k in ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008),  # llama-7b qkv, o, gate_up, down
                     (3072, 2048), (11264, 2048), (2048, 5632)):  # llama-1b qkv (GQA 32/4 d64), gate_up, down
            out.add((m, n, k))
    out.update((s, s, s) for s in (2048, 4096, 8192))
    return sorted(out)


def quantize(x: torch.Tensor, tile: str, fp8=torch.float8_e4m3fn):
    """x [r, c] -> (e4m3 [r, c], fp32 dequantisation scales): "tensor" (scalar), "row" ([r, 1]), "1x128"
    ([r, c/128]), "128x128" ([r/128, c/128])."""
    mx = torch.finfo(fp8).max
    xf = x.float()
    if tile == "tensor":
        amax = xf.abs().amax().clamp(min=1e-12)
        return (xf * (mx / amax)).to(fp8), amax / mx
    if tile == "row":
        amax = xf.abs().amax(1, keepdim=True).clamp(min=1e-12)
        return (xf * (mx / amax)).to(fp8), amax / mx
    r, c = x.shape
    bo = 1 if tile == "1x128" else 128
    blocks = xf.view(r // bo, bo, c // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)  # [r/bo, 1, c/128, 1]
    q = (blocks * (mx / amax)).to(fp8).view(r, c)
    return q, (amax / mx).view(r // bo, c // 128)


def fp8_call(recipe: str, a: torch.Tensor, w: torch.Tensor):
    """A callable computing C = a [m, k] @ w^T, w stored [n, k] (the weight as _scaled_mm wants it: B
    column-major), through `recipe`."""
    if recipe == "bf16":
        wt = w.t()
        return lambda: torch.mm(a, wt)
    if recipe == "tensorwise":
        (qa, sa), (qw, sw) = quantize(a, "tensor"), quantize(w, "tensor")
    elif recipe == "rowwise":
        (qa, sa), (qw, sw) = quantize(a, "row"), quantize(w, "row")
        sw = sw.t()  # [1, n]
    else:
        tile_w = "128x128" if recipe == "blockwise_1x128_128x128" else "1x128"
        (qa, sa), (qw, sw) = quantize(a, "1x128"), quantize(w, tile_w)
        sa = sa.t().contiguous().t()  # 1x128 scales outer-dim-major ([m, k/128], stride (1, m))
        if tile_w == "1x128":
            sw = sw.t().contiguous().t()
        sw = sw.t()
    qwt = qw.t()
    return lambda: torch._scaled_mm(qa, qwt, scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)


RECIPES = ("bf16", "tensorwise", "rowwise", "blockwise_1x128_128x128", "blockwise_1x128_1x128")


def run_fp8_gemm(b: Bench, deadline: float):
    if not b.cuda:
        print("[fp8_gemm] needs a CUDA GPU with FP8 (sm_89+); smoke checks the quantisation only", flush=True)
        for tile in ("tensor", "row", "1x128", "128x128"):
            x = randn(b, 256, 256)
            q, s = quantize(x, tile)
            print(f"[fp8_gemm] smoke quantize {tile}: q {tuple(q.shape)} scales {tuple(s.shape)}", flush=True)
        return
    for m, n, k in fp8_shapes(b.args.smoke):
        for recipe in RECIPES:
            if time.time() > deadline:
                b.add("fp8_gemm", {"note": "time budget spent"})
                return
            row = {"m": m, "n": n, "k": k, "recipe": recipe}
            try:
                a, w = randn(b, m, k), randn(b, n, k) * 0.02
                ref = torch.mm(a.float(), w.float().t())
                fn = fp8_call(recipe, a, w)
                got = fn().float()
                row["rel_err"] = float((got - ref).norm() / ref.norm())
                del ref, got
                copies = b.copies(m * k + n * k + 2 * m * n)
                fns = [fn] + [fp8_call(recipe, randn(b, m, k), randn(b, n, k) * 0.02) for _ in range(copies - 1)]
                sec, how = b.time_calls(fns)
                row.update(ms=sec * 1e3, tflops=2 * m * n * k / sec / 1e12, timing=how)
                del fns, a, w
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            b.add("fp8_gemm", row, {"notes": "C = A[m,k] @ W[n,k]^T, bf16 out; e4m3 operands, fp32 dequantisation "
                                             "scales (blockwise: A 1x128 tiles, W 128x128 blocks or 1x128 tiles) "
                                             "through torch._scaled_mm (cuBLAS); quantisation not timed here "
                                             "(fp8_quant.json); rel_err = |C - C_fp32| / |C_fp32| on one operand set"})
            print(f"[fp8_gemm] {m}x{n}x{k} {recipe}: " + (row.get("error") or
                  f"{row['ms']:.3f} ms {row['tflops']:.0f} TFLOP/s err {row['rel_err']:.3g}"), flush=True)
            free(b)


def run_fp8_quant(b: Bench, deadline: float):
    shapes = [(256, 256)] if b.args.smoke else \
        [(4096, 4096), (4096, 11008), (8192, 4096), (16384, 4096), (16384, 11008), (16384, 2048), (16384, 5632)]
    impls = [("eager", quantize)]
    if b.cuda:
        impls.append(("compiled", torch.compile(quantize, dynamic=True)))
    for impl, fn in impls:
        for r, c in shapes:
            for tile in ("tensor", "1x128", "128x128"):
                if time.time() > deadline:
                    b.add("fp8_quant", {"note": "time budget spent"})
                    return
                row = {"rows": r, "cols": c, "tile": tile, "impl": impl}
                try:
                    xs = [randn(b, r, c) for _ in range(b.copies(3 * r * c))]
                    calls = [lambda x=x: fn(x, tile) for x in xs]
                    calls[0]()
                    sec, how = b.time_calls(calls)
                    row.update(ms=sec * 1e3, gbps=3 * r * c / sec / 1e9, timing=how)
                    del xs, calls
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                b.add("fp8_quant", row, {"notes": "bf16 [rows, cols] -> e4m3 + fp32 scales per tile; gbps counts "
                                                  "2 B read + 1 B written per element (scales ignored); eager = "
                                                  "gpu_h100.quantize op by op, compiled = torch.compile of it"})
                print(f"[fp8_quant] {impl} {r}x{c} {tile}: " + (row.get("error") or f"{row['ms']:.3f} ms"), flush=True)
                free(b)


# ---------------------------------------------------------------- recompute modes
class RecomputeDecoder(Decoder):
    """gpu_model.Decoder with one recompute mode (module docstring), torch.utils.checkpoint non-reentrant."""

    def __init__(self, a, device, dtype, mode: str, generator=None):
        super().__init__(a, device, dtype, recompute=(mode == "full"), generator=generator)
        self.mode = mode

    def block(self, blk, x):
        if self.mode in ("none", "full"):
            return super().block(blk, x)
        core = self.mode == "core_attn"
        n1 = (blk.norm1_w, getattr(blk, "norm1_b", None))
        n2 = (blk.norm2_w, getattr(blk, "norm2_b", None))
        if self.saved == "llmtrain":  # llmtrain's parts leave the norm outside (its output is the kept input)
            part = lambda fn, n: lambda y: checkpoint(fn, blk, self.norm(y, *n), use_reentrant=False)  # noqa: E731
        else:  # the twin2 rows: the norm inside the recomputed part
            part = lambda fn, n: lambda y: checkpoint(lambda z: fn(blk, self.norm(z, *n)), y,  # noqa: E731
                                                      use_reentrant=False)
        attn = lambda y: self.attention(blk, self.norm(y, *n1))  # noqa: E731
        mlp = lambda y: self.mlp(blk, self.norm(y, *n2))  # noqa: E731
        if self.mode == "full_attn":
            x = x + part(self.attention, n1)(x)
        else:
            if core:
                sdpa = F.scaled_dot_product_attention
                F.scaled_dot_product_attention = lambda *a, **k: checkpoint(sdpa, *a, use_reentrant=False, **k)
                try:
                    x = x + attn(x)
                finally:
                    F.scaled_dot_product_attention = sdpa
            else:
                x = x + attn(x)
        if self.mode == "mlp":
            return x + part(self.mlp, n2)(x)
        return x + mlp(x)


def run_recompute(b: Bench, deadline: float):
    cases = [(2, 128, 1)] if b.args.smoke else [(4, 4096, 1), (4, 4096, 2), (8, 4096, 1)]
    for layers, seq, mb in cases:
        a = llama(layers, 64, 4, 4, 160, seq, vocab=256) if b.args.smoke else llama(layers, 4096, 32, 32, 11008, seq)
        for mode in ("none", "full", "full_attn", "core_attn", "mlp"):
            row = {"model": "llama-7b-twin", "layers": layers, "mode": mode, "seq": seq, "mb": mb}
            if time.time() > deadline:
                row["error"] = "time budget spent before this row"
                b.add("recompute_steps", row)
                continue
            model = opt = None
            try:
                free(b)
                model = RecomputeDecoder(a, b.dev, b.dtype, mode, generator=b.gen)
                opt = MasterAdamW(model.parameters())
                batch = make_batch(a, mb, b.dev, b.gen)
                train_step(model, opt, batch)
                train_step(model, opt, batch)
                b.sync()
                if b.cuda:
                    torch.cuda.reset_peak_memory_stats()
                    row["static_gib"] = torch.cuda.memory_allocated() / GIB
                times = timed(b, model, opt, batch, 0, 5 if not b.args.smoke else 2)
                row.update(step_ms=statistics.median(times) * 1e3, step_s=times)
                if b.cuda:
                    row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                    row["act_gib"] = row["peak_gib"] - row["static_gib"]
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            del model, opt
            b.add("recompute_steps", row, {"notes": run_recompute.__doc__ or RecomputeDecoder.__doc__,
                                           "arch": a.as_dict()})
            print(f"[recompute] L{layers} mb{mb} {mode}: " + (row.get("error") or
                  f"{row['step_ms']:.1f} ms peak {row.get('peak_gib', 0):.2f} act {row.get('act_gib', 0):.2f} GiB"),
                  flush=True)


run_recompute.__doc__ = ("llama-7b-twin (gpu_model.llama(L, 4096, 32, 32, 11008, seq)) steps under each recompute mode "
                         "(RecomputeDecoder); 2 warm-up + 5 timed steps (host clock between synchronisations), median; "
                         "peak_gib = max allocated over the timed steps, static_gib = allocated before them")


# ---------------------------------------------------------------- held-out steps
def dense_rows(smoke: bool) -> dict:
    from gpu_reference import SMOKE_ROWS

    return dict(SMOKE_ROWS) if smoke else {k: v for k, v in STEP_ROWS.items() if k != "llama-7b-mb1"}


def long_rows(smoke: bool) -> dict:
    """name -> (arch, micro_batch): 16k-64k rows that fit 80 GB (gpu_tables.long_rows minus the two that
    peaked above 80 GiB on the H200, llama-1b-s32k at 22 layers as 12 layers)."""
    if smoke:
        return {"llama-smoke-s256": (llama(2, 64, 4, 2, 160, 256, vocab=256), 1)}
    return {"llama-1b-s16k": (llama(22, 2048, 32, 4, 5632, 16384), 1),
            "llama-7b-4L-s16k": (llama(4, 4096, 32, 32, 11008, 16384), 1),
            "llama-1b-12L-s32k": (llama(12, 2048, 32, 4, 5632, 32768), 1),
            "llama-7b-4L-s32k": (llama(4, 4096, 32, 32, 11008, 32768), 1),
            "llama-1b-8L-s64k": (llama(8, 2048, 32, 4, 5632, 65536), 1)}


def run_step_rows(b: Bench, table: str, rows: dict, deadline: float, make_model, n: int):
    """Whole training steps of `rows` (name -> (arch, micro_batch, extra)) into `table`."""
    for name, (a, mb, extra) in rows.items():
        row = {"name": name, "arch": a.as_dict(), "micro_batch": mb}
        if time.time() > deadline:
            row["error"] = "time budget spent before this row"
            b.add(table, row)
            continue
        model = opt = None
        try:
            free(b)
            model = make_model(a, extra, row)
            opt = MasterAdamW(model.parameters())
            row["tensors"] = len(opt.params)
            batch = make_batch(a, mb, b.dev, b.gen)
            BACKEND_USED.clear()
            steps_n = n if a.seq < 32768 else max(3, n // 2)
            times = timed(b, model, opt, batch, 2 if a.seq < 32768 else 1, steps_n if not b.args.smoke else 2)
            row.update(step_s=times, step_s_median=statistics.median(times),
                       tokens_per_s=mb * a.seq / statistics.median(times),
                       attention_backend=sorted(BACKEND_USED))
            if b.cuda:
                row["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            if hasattr(model, "stat_counts") and model.stat_counts is not None:
                import gpu_moe

                c = model.stat_counts
                row["imbalance_accumulated"] = float(c.max() / c.mean())
                caps = list(gpu_moe.CAPACITIES)  # every layer of every step (warm-up included), in order
                if caps:
                    L = a.layers
                    row["capacities"] = [caps[i:i + L] for i in range(0, len(caps), L)]
                    m = model.moe
                    row["capacity_mean_factor"] = statistics.mean(caps) / (mb * a.seq * m.top_k / m.experts)
            if not b.args.no_profile and a.seq < 32768:
                from gpu_reference import profile_step
                row.update(profile_step(b, model, opt, batch))
        except Exception as e:  # noqa: BLE001 - an out-of-memory row is recorded, the others still run
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        del model, opt
        b.add(table, row, {"notes": "held-out twin steps (never fitted): 2 warm-up (1 from 32k) + n timed steps on "
                                    "the host clock between synchronisations, median; SDPA pinned per "
                                    "attention_backend; kernel_time_s from one profiled step (below 32k)"})
        print(f"[{table}] {name}: " + (row.get("error") or f"{row['step_s_median'] * 1e3:.1f} ms, peak "
              f"{row.get('peak_mem_bytes', 0) / GIB:.1f} GiB, attn {row['attention_backend']}, busy "
              f"{row.get('kernel_time_s')}"), flush=True)


def run_steps_dense(b: Bench, deadline: float):
    rows = {k: (a, mb, rc) for k, (a, mb, rc) in dense_rows(b.args.smoke).items()}

    def make(a, recompute, row):
        row["recompute"] = recompute
        return Decoder(a, b.dev, b.dtype, recompute, generator=b.gen)
    run_step_rows(b, "steps", rows, deadline, make, b.args.steps_n)


def run_steps_long(b: Bench, deadline: float):
    rows = {k: (a, mb, None) for k, (a, mb) in long_rows(b.args.smoke).items()}
    run_step_rows(b, "long_steps", rows, deadline, lambda a, _, row: Decoder(a, b.dev, b.dtype, False,
                                                                              generator=b.gen), 6)


def moe_rows(smoke: bool) -> dict:
    """gpu_tables.moe_rows("final")'s slots rows, capacity 1.25 and dropless, that fit 80 GB (Mixtral mb2 peaked
    at 73-80 GiB on the H200: left out; Mixtral mb1 last)."""
    import gpu_tables

    rows = gpu_tables.moe_rows(smoke, "final")
    keep = {k: v for k, v in rows.items() if "-slots-" in k and not k.startswith("mixtral-2L-mb2")}
    return dict(sorted(keep.items(), key=lambda kv: kv[0].startswith("mixtral")))


def run_steps_moe(b: Bench, deadline: float):
    import zlib

    import gpu_moe
    from gpu_moe import MoEDecoder

    rows = {k: (a, mb, m) for k, (a, m, mb, _n) in moe_rows(b.args.smoke).items()}

    def make(a, m, row):
        b.gen.manual_seed(zlib.crc32(row["name"].rsplit("-", 2)[0].encode()))  # same weights and batch per shape/mb
        row["moe"] = m.as_dict()
        gpu_moe.CAPACITIES.clear()
        return MoEDecoder(a, m, b.dev, b.dtype, generator=b.gen)
    run_step_rows(b, "moe_steps", rows, deadline, make, 8)
    for r in b.rows("moe_steps"):  # the dropless buffers' C per layer of the timed steps (host reads)
        r.setdefault("capacity_factor", r.get("moe", {}).get("capacity_factor"))


RUNNERS = {"attention_fa3": run_attention_fa3, "fp8_gemm": run_fp8_gemm, "fp8_quant": run_fp8_quant,
           "recompute_steps": run_recompute, "steps_dense": run_steps_dense, "steps_long": run_steps_long,
           "steps_moe": run_steps_moe}


def pin_for_steps(b: Bench, only: list[str], always: bool = False) -> None:
    """Probe cuDNN SDPA on the twin's layout and pin the attention backend (`pin_attention`), when a step table is
    in `only` (or `always`)."""
    if always or any(t.startswith("steps") or t == "recompute_steps" for t in only):
        ok = probe_cudnn(b)
        print(f"[probe] cudnn SDPA on the twin's layout (gqa, head_dim) -> runs: {ok}", flush=True)
        pin_attention(b, ok)


def main(argv=None):
    run_tables(__doc__, TABLES, RUNNERS, argv, warmup=2, steps_n=8, setup=pin_for_steps)


if __name__ == "__main__":
    main()

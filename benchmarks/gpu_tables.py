"""H200 tables for Mixture-of-Experts and long sequences, measured with PyTorch (as benchmarks/gpu_reference.py).

    python benchmarks/gpu_tables.py --out DIR                       # every table, where a CUDA GPU is present
    python benchmarks/gpu_tables.py --out DIR --only moe_steps,bmm  # some of them
    python benchmarks/gpu_tables.py --out /tmp/smoke --smoke        # tiny shapes, runs on CPU (logic check)

Tables (one JSON file each in DIR, with gpu_reference's `provenance`; rewritten after every row):
- `moe_steps`: whole training steps of the MoE twin (benchmarks/gpu_moe.py) at the Qwen-MoE, Mixtral and
  DeepSeek-V2-Lite shapes, micro-batch 1 and 2, seq 4096: the agreed formulation (`slots`) with capacity factor
  1.25 (the static buffers expert parallelism moves) and dropless; the grouped-GEMM reference (dropless); main's
  per-expert loop. Per row the step times, the routing's per-layer loads of the last step (`layer_loads`: max
  and mean choices per expert), peak memory and one profiled step's kernel count and busy time.
- `bmm`: `torch.bmm` of the experts' GEMMs at the rows' shapes, forward (nn), input gradient (nt: B read
  transposed) and weight gradient (tn: A read transposed), at the capacity C and a grid of dropless C.
- `gemm_extra`: `torch.mm` of the MoE rows' and long rows' dense GEMMs (qkv, o, shared gate_up/down, router,
  LM head; fwd nn, dgrad nt, wgrad tn) at their shapes (for exact lookups; gemm.json stays as it is).
- `moe_ops`: the dispatch's memory-bound and integer ops by class (`op`), at the rows' sizes and a sweep.
- `attention_long`: causal flash attention fwd and bwd from 4k to 64k (128k for two configs), three ways: the
  flash backend on contiguous [b, heads, s, d] (attention.json's call), the flash backend on the twin's
  transposed views of [b, s, heads, d] split from one qkv tensor (gpu_model.Decoder.attention), and cuDNN's
  backend on contiguous tensors.
- `long_steps`: dense twin steps (gpu_model.Decoder) at 16k, 32k and 64k tokens, one micro-batch.

Timing as gpu_reference.py: kernel tables CUDA graphs of back-to-back calls over rotated operands (eager where
a graph cannot be captured, said per row), medians of CUDA-event times; steps on the host clock between two
synchronisations, after warm-up steps, median.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_model import Decoder, MasterAdamW, llama, make_batch, train_step  # noqa: E402
from gpu_moe import MoE, MoEDecoder  # noqa: E402
from gpu_reference import Bench, gemm_row, profile_step, randint, randn  # noqa: E402

TABLES = ("moe_steps", "bmm", "gemm_extra", "moe_ops", "attention_long", "long_steps")
SEQ = 4096


def moe_shapes(smoke: bool) -> dict:
    """name -> (Arch, MoE without impl/capacity): every block MoE; Arch.ffn is the shared expert's width."""
    if smoke:
        return {"qwen-smoke": (llama(2, 64, 4, 4, 96, 32, vocab=256), MoE(12, 4, 32, 96, norm_topk=False)),
                "mixtral-smoke": (llama(2, 64, 4, 2, 16, 32, vocab=256), MoE(4, 2, 48, 0))}
    return {"qwen-moe-4L": (llama(4, 2048, 16, 16, 5632, SEQ), MoE(60, 4, 1408, 5632, norm_topk=False, aux_coef=0.001)),
            "mixtral-2L": (llama(2, 4096, 32, 8, 14336, SEQ), MoE(8, 2, 14336, 0, norm_topk=True, aux_coef=0.02)),
            "deepseek-v2-lite-4L": (llama(4, 2048, 16, 16, 2816, SEQ),
                                    MoE(64, 6, 1408, 2816, norm_topk=False, aux_coef=0.001))}


def moe_rows(smoke: bool, which: str = "all") -> dict:
    """moe_steps rows: name -> (Arch, MoE, micro_batch, timed steps). `which`: "all" (the first sweep, 2026-12-03
    10:59, before MOE-FORMULATION a593f33: index_add dispatch, PyTorch's own cumsum) or "final": llmtrain's final
    op sequence (gather through the inverse map, Paddle's cumsum kernel written out: gpu_moe's defaults) with
    capacity and dropless, the grouped reference, the loop for the Qwen shape, and two variants of the Qwen mb1
    capacity row (the index_add dispatch; PyTorch's cumsum), every row of a shape and micro-batch from the same
    weights and batch (a seed per shape and micro-batch)."""
    import dataclasses as dc

    rows = {}
    shapes = moe_shapes(smoke)
    if which == "final":
        first = next(iter(shapes))
        for name, (a, m) in shapes.items():
            for mb in (1, 2):
                for cf, tag in ((1.25, "cap1.25"), (0.0, "dropless")):
                    rows[f"{name}-mb{mb}-slots-{tag}"] = (a, dc.replace(m, capacity_factor=cf), mb, 10)
                rows[f"{name}-mb{mb}-grouped-dropless"] = (a, dc.replace(m, capacity_factor=0.0, impl="grouped"), mb, 6)
                if name == first:
                    rows[f"{name}-mb{mb}-loop-cap1.25"] = (a, dc.replace(m, capacity_factor=1.25, impl="loop"), mb, 4)
        a, m = shapes[first]
        rows[f"{first}-mb1-slots_indexadd-cap1.25"] = (a, dc.replace(m, capacity_factor=1.25, dispatch="index_add"), 1, 10)
        rows[f"{first}-mb1-slots_torchscan-cap1.25"] = (a, dc.replace(m, capacity_factor=1.25, scan="torch"), 1, 10)
        return rows
    for name, (a, m) in shapes.items():
        for mb in (1, 2):
            for cf, tag in ((1.25, "cap1.25"), (0.0, "dropless")):
                rows[f"{name}-mb{mb}-slots-{tag}"] = (a, dc.replace(m, capacity_factor=cf, impl="slots", scan="torch",
                                                                    dispatch="index_add"), mb, 10)
            rows[f"{name}-mb{mb}-grouped-dropless"] = (a, dc.replace(m, capacity_factor=0.0, impl="grouped"), mb, 6)
    first = next(iter(shapes))
    for name, (a, m) in shapes.items():
        for mb in ((1, 2) if name == first else (1,)):
            rows[f"{name}-mb{mb}-loop-cap1.25"] = (a, dc.replace(m, capacity_factor=1.25, impl="loop"), mb, 5)
            if name == first:
                rows[f"{name}-mb{mb}-loop-dropless"] = (a, dc.replace(m, capacity_factor=0.0, impl="loop"), mb, 5)
    return rows


def long_rows(smoke: bool) -> dict:
    """long_steps rows: name -> (Arch, micro_batch)."""
    if smoke:
        return {"llama-smoke-s128": (llama(2, 64, 4, 2, 160, 128, vocab=256), 1)}
    return {"llama-1b-s16k": (llama(22, 2048, 32, 4, 5632, 16384), 1),
            "llama-1b-s32k": (llama(22, 2048, 32, 4, 5632, 32768), 1),
            "llama-1b-8L-s64k": (llama(8, 2048, 32, 4, 5632, 65536), 1),
            "llama-7b-4L-s16k": (llama(4, 4096, 32, 32, 11008, 16384), 1),
            "llama-7b-4L-s32k": (llama(4, 4096, 32, 32, 11008, 32768), 1),
            "llama-7b-4L-s64k": (llama(4, 4096, 32, 32, 11008, 65536), 1)}


def _free(b: Bench):
    gc.collect()
    if b.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _timed_steps(b: Bench, model, opt, batch, warmup: int, n: int) -> list[float]:
    for _ in range(warmup):
        train_step(model, opt, batch)
    times = []
    for _ in range(n):
        b.sync()
        t0 = time.perf_counter()
        train_step(model, opt, batch)
        b.sync()
        times.append(time.perf_counter() - t0)
    return times


def run_moe_steps(b: Bench, deadline: float):
    import zlib

    import gpu_moe

    for name, (a, m, mb, n) in moe_rows(b.args.smoke, b.args.moe_set).items():
        row = {"name": name, "arch": a.as_dict(), "moe": m.as_dict(), "micro_batch": mb}
        if b.args.moe_set == "final":  # the same weights and batch for every row of a shape and micro-batch
            b.gen.manual_seed(zlib.crc32(name.rsplit("-", 2)[0].encode()))
            row["seed"] = "crc32 of " + name.rsplit("-", 2)[0]
        if time.time() > deadline:
            row["error"] = "time budget spent before this row"
            b.add("moe_steps", row)
            continue
        model = opt = None
        try:
            _free(b)
            model = MoEDecoder(a, m, b.dev, b.dtype, generator=b.gen)
            opt = MasterAdamW(model.parameters())
            row.update(params=sum(p.numel() for p in model.parameters()), tensors=len(opt.params))
            batch = make_batch(a, mb, b.dev, b.gen)
            for _ in range(2 if n < 10 else 3):
                train_step(model, opt, batch)
            gpu_moe.CAPACITIES.clear()
            times = _timed_steps(b, model, opt, batch, 0, n if not b.args.smoke else 2)
            if m.impl == "slots":  # C of every layer of every timed step (dropless: the host reads)
                L = a.layers
                row["capacities"] = [gpu_moe.CAPACITIES[i:i + L] for i in range(0, len(gpu_moe.CAPACITIES), L)]
                row["capacity_mean_factor"] = statistics.mean(gpu_moe.CAPACITIES) / (mb * a.seq * m.top_k / m.experts)
            row.update(step_s=times, step_s_median=statistics.median(times),
                       tokens_per_s=mb * a.seq / statistics.median(times))
            loads = []  # per layer of one more forward: (max, mean) choices per expert
            with torch.no_grad():
                model.stat_counts = None
                model.layer_counts = []
                orig = model.mlp

                def spy(blk, x):
                    before = None if model.stat_counts is None else model.stat_counts.clone()
                    y = orig(blk, x)
                    c = model.stat_counts - (before if before is not None else 0)
                    loads.append([float(c.max()), float(c.mean())])
                    return y
                model.mlp = spy
                model(*batch)
                model.mlp = orig
            row["layer_loads"] = loads
            row["imbalance"] = statistics.mean(mx / mean for mx, mean in loads)
            if b.cuda:
                row["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            if not b.args.no_profile:
                row.update(profile_step(b, model, opt, batch))
        except Exception as e:  # noqa: BLE001 - recorded, the other rows still run
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        del model, opt
        b.add("moe_steps", row, {"notes": run_moe_steps.__doc__ or "see gpu_tables.py"})
        print(f"[moe_steps] {name}: " + (row.get("error") or f"{row['step_s_median'] * 1e3:.1f} ms, imbalance "
              f"{row['imbalance']:.3f}, peak {row.get('peak_mem_bytes', 0) / 2**30:.1f} GiB, kernels "
              f"{row.get('kernels_per_step')} busy {row.get('kernel_time_s')}"), flush=True)


def expert_gemms(E: int, C: int, h: int, f: int) -> list[tuple]:
    """(batch, m, n, k, layout) of one MoE layer's expert GEMMs at capacity C: gate|up and down, forward (nn),
    input gradient dY @ W^T (nt), weight gradient X^T @ dY (tn)."""
    return [(E, C, 2 * f, h, "nn"), (E, C, h, f, "nn"), (E, C, h, 2 * f, "nt"), (E, C, f, h, "nt"),
            (E, h, 2 * f, C, "tn"), (E, f, h, C, "tn")]


DROPLESS_C = (1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0)
"""Dropless capacities measured: C = factor x T k / E (the largest expert's load is not known before the run)."""


def bmm_shapes(smoke: bool, factors=DROPLESS_C) -> list[tuple]:
    out = set()
    for a, m in moe_shapes(smoke).values():
        for mb in (1, 2):
            T = mb * a.seq
            mean = T * m.top_k / m.experts
            cs = {math.ceil(1.25 * mean)} | {int(round(x * mean)) for x in factors}
            for C in cs:
                out.update(expert_gemms(m.experts, C, a.hidden, m.ffn))
    return sorted(out)


def run_bmm(b: Bench, deadline: float):
    factors = tuple(float(x) for x in b.args.bmm_c.split(",")) if b.args.bmm_c else DROPLESS_C
    for E, m, n, k, lay in bmm_shapes(b.args.smoke, factors):
        if time.time() > deadline:
            b.add("bmm", {"note": "time budget spent"})
            return
        copies = b.copies(2 * E * (m * k + k * n + m * n))
        ops = []
        for _ in range(copies):
            x = randn(b, E, k, m).transpose(1, 2) if lay == "tn" else randn(b, E, m, k)
            w = randn(b, E, n, k).transpose(1, 2) if lay == "nt" else randn(b, E, k, n)
            c = torch.empty(E, m, n, device=b.dev, dtype=b.dtype)
            ops.append(lambda x=x, w=w, c=c: torch.bmm(x, w, out=c))
        sec, how = b.time_calls(ops)
        b.add("bmm", {"batch": E, "m": m, "n": n, "k": k, "layout": lay, "seconds": sec,
                      "tflops": 2 * E * m * n * k / sec / 1e12, "timing": how})
        del ops
        _free(b)


def extra_gemm_shapes(smoke: bool) -> list[tuple]:
    shapes = set()
    lin = []
    for a, m in moe_shapes(smoke).values():
        for mb in (1, 2):
            t = mb * a.seq
            ls = [x for x in a.linears() if x[0] in ("qkv", "o", "lm_head")] + [("router", a.hidden, m.experts)]
            if m.shared_ffn:
                ls += [("gate_up", a.hidden, 2 * m.shared_ffn), ("down", m.shared_ffn, a.hidden)]
            lin += [(t, i, o) for _, i, o in ls]
    for a, mb in long_rows(smoke).values():
        lin += [(mb * a.seq, i, o) for _, i, o in a.linears()]
    for t, i, o in lin:
        shapes.update({(t, o, i, "nn"), (t, i, o, "nt"), (i, o, t, "tn")})
    return sorted(shapes)


def run_gemm_extra(b: Bench, deadline: float):
    for m, n, k, lay in extra_gemm_shapes(b.args.smoke):
        if time.time() > deadline:
            b.add("gemm_extra", {"note": "time budget spent"})
            return
        b.add("gemm_extra", gemm_row(b, m, n, k, lay, "moe/long rows"))
        _free(b)


def moe_op_makers(b: Bench, n: int, width: int, k: int):
    """op -> make(): a callable over fresh operands, for `n` rows of `width` (E for the routing classes, h for the
    row classes); numel = n x width. The ops of gpu_moe.route / experts_slots, each as the twin runs it."""
    dt, dev = b.dtype, b.dev
    E = width

    def ints(): return torch.randint(0, E, (n,), device=dev, generator=b.gen)  # noqa: E704

    def onehot(): return F.one_hot(ints(), E)  # noqa: E704

    def rows_idx(R): return torch.randint(0, R, (n,), device=dev, generator=b.gen)  # noqa: E704

    def grad_of(f, *shapes, dtype=torch.float32):
        def make():
            ins = [torch.randn(*s, device=dev, dtype=dtype, generator=b.gen).requires_grad_(True) for s in shapes]
            y = f(*ins)
            dy = torch.randn(*y.shape, device=dev, dtype=y.dtype, generator=b.gen)
            return lambda: torch.autograd.grad(y, ins, dy, retain_graph=True)
        return make

    ops = {  # routing classes: [n, E]
        "moe_one_hot": lambda: (lambda i=ints(): F.one_hot(i, E)),
        "moe_cumsum": lambda: (lambda o=onehot(): torch.cumsum(o, 0)),
        "moe_mul_i64": lambda: (lambda o=onehot(), p=onehot(): o * p),
        "moe_rowsum_i64": lambda: (lambda o=onehot(): o.sum(-1)),
        "moe_colsum_i64": lambda: (lambda o=onehot(): o.sum(0)),
        "moe_softmax": lambda: (lambda x=torch.randn(n, E, device=dev, generator=b.gen): F.softmax(x, -1)),
        "moe_softmax_bwd": grad_of(lambda x: F.softmax(x, -1), (n, E)),
        "moe_logsumexp": lambda: (lambda x=torch.randn(n, E, device=dev, generator=b.gen): torch.logsumexp(x, -1)),
        "moe_logsumexp_bwd": grad_of(lambda x: torch.logsumexp(x, -1), (n, E)),
        f"moe_topk{k}": lambda: (lambda x=torch.randn(n, E, device=dev, generator=b.gen): torch.topk(x, k, -1)),
        # Paddle's cumsum over axis 0 (gpu_moe.cumsum0 "paddle"): transpose [n, E] -> [E, n], scan along the
        # contiguous axis, transpose back ([E, n] -> [n, E], the same bytes as the first)
        "moe_t_copy_i64": lambda: (lambda o=onehot(): o.t().contiguous()),
        "moe_cumsum_emajor": lambda: (lambda o=onehot().t().contiguous(): torch.cumsum(o, 1)),
        # the inverse map: source = scatter(full([n + 1], T), slot, tok) over the n = k T choices (int64)
        "moe_scatter_i64": lambda: (lambda d=torch.full((n + 1,), n, device=dev, dtype=torch.int64),
                                    i=torch.randperm(n + 1, device=dev, generator=b.gen)[:n],
                                    t=ints(): d.scatter_(0, i, t)),
    }
    h = width  # row classes: [n, h] bf16
    R = max(1, n // 2)
    row_ops = {
        "moe_gather_rows": lambda: (lambda x=randn(b, R, h), i=rows_idx(R): x.index_select(0, i)),
        "moe_index_add_rows": lambda: (lambda buf=torch.zeros(R, h, device=dev, dtype=dt), i=rows_idx(R),
                                       s=randn(b, n, h): buf.index_add_(0, i, s)),
        "moe_fill": lambda: (lambda buf=torch.empty(n, h, device=dev, dtype=dt): buf.zero_()),
        # the dispatch gather's backward: the n = E C buffer rows' gradient index_added into [T + 1, h], each
        # token k times, the empty rows into the zero row T (20% of the rows at C = 1.25 T k / E; inv60: 60%,
        # a dropless buffer twice as deep)
        "moe_index_add_inv": lambda: inverse_index_add(b, n, h, k, 0.2),
        "moe_index_add_inv60": lambda: inverse_index_add(b, n, h, k, 0.6),
        "moe_sum_mid": lambda: (lambda x=randn(b, max(1, n // k), k, h): x.sum(1)),  # the token-major combine's sum
        "moe_mul_rows": lambda: (lambda x=randn(b, n, h), w=randn(b, n, 1): x * w),
        "moe_rowsum_bf16": lambda: (lambda x=randn(b, n, h): x.sum(-1)),
        "moe_sum_k": lambda: (lambda x=randn(b, k, max(1, n // k), h): x.sum(0)),
        "moe_swiglu_view": lambda: (lambda gu=randn(b, n, 2 * h): (lambda g, u: F.silu(g) * u)(*gu.chunk(2, -1))),
        "moe_swiglu_view_bwd": grad_of(lambda gu: (lambda g, u: F.silu(g) * u)(*gu.chunk(2, -1)), (n, 2 * h),
                                       dtype=dt),
    }
    return ops, row_ops


def inverse_index_add(b: Bench, n: int, h: int, k: int, empty: float):
    """One index_add of n buffer rows [n, h] into [T + 1, h] through an inverse map with `empty` of the rows on
    the zero row T and the rest spread over T = (1 - empty) n / k tokens, k rows each (a callable over fresh
    operands)."""
    T = max(1, int((1 - empty) * n) // k)
    src = torch.cat([torch.arange(T, device=b.dev).repeat(k), torch.full((n - k * T,), T, device=b.dev)])
    src = src[torch.randperm(n, device=b.dev, generator=b.gen)]
    buf, g = torch.zeros(T + 1, h, device=b.dev, dtype=b.dtype), randn(b, n, h)
    return lambda: buf.index_add_(0, src, g)


def moe_op_sizes(smoke: bool) -> tuple[list, list]:
    """([(n, E, k)] routing sizes, [(n, h, k)] row sizes): each row's (T and k T, E) and (rows, h), then sweeps."""
    route, rows = set(), set()
    for a, m in moe_shapes(smoke).values():
        for mb in (1, 2):
            T = mb * a.seq
            route.update({(T, m.experts, m.top_k), (m.top_k * T, m.experts, m.top_k)})
            C = math.ceil(1.25 * T * m.top_k / m.experts)
            rows.update({(T, a.hidden, m.top_k), (m.top_k * T, a.hidden, m.top_k), (m.experts * C, a.hidden, m.top_k),
                         (m.experts * C, m.ffn, m.top_k)})
    sweep = (2 ** 8, 2 ** 10) if smoke else tuple(2 ** i for i in range(10, 19, 2))
    route.update((n, 64, 4) for n in sweep)
    rows.update((n, 2048, 4) for n in sweep)
    return sorted(route), sorted(rows)


PER_CHOICE = ("moe_scatter_i64",)
"""Op classes whose numel is n (one element per choice), not n x width."""


def run_moe_ops(b: Bench, deadline: float):
    route, rows = moe_op_sizes(b.args.smoke)
    for kind, sizes in (("route", route), ("rows", rows)):
        for n, width, k in sizes:
            ops, row_ops = moe_op_makers(b, n, width, k)
            for op, make in (ops if kind == "route" else row_ops).items():
                if b.args.ops and op not in b.args.ops.split(","):
                    continue
                if time.time() > deadline:
                    b.add("moe_ops", {"note": "time budget spent"})
                    return
                numel = n if op in PER_CHOICE else n * width
                row = {"op": op, "numel": numel, "n": n, "width": width, "k": k}
                try:
                    nbytes = numel * (8 if kind == "route" else 2) * 3
                    fns = [make() for _ in range(b.copies(nbytes))]
                    row["seconds"], row["timing"] = b.time_calls(fns)
                    del fns
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                b.add("moe_ops", row, {"notes": "numel = n x width (moe_scatter_i64: n; routing classes: [n, E] int64/fp32; row "
                                                "classes: [n, h] bf16; moe_swiglu_view: silu(g) * u on the chunk "
                                                "views of [n, 2h]; moe_sum_k: [k, n/k, h].sum(0))"})
            _free(b)


ATTN_CONFIGS = ((1, 32, 4, 64), (1, 32, 32, 128))
"""(batch, heads, kv_heads, head_dim) of the long rows: llama-1b (GQA 32/4, d 64) and llama-7b (MHA, d 128)."""


def run_attention_long(b: Bench, deadline: float):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seqs = [4096, 8192, 16384, 32768, 65536, 131072] if not b.args.smoke else [64, 128]
    configs = ATTN_CONFIGS if not b.args.smoke else ((1, 4, 2, 16),)
    ways = ("flash_twin_views", "flash_contiguous", "cudnn_contiguous") if b.cuda else ("flash_twin_views",)
    reps0 = b.args.reps
    for (bs, nh, nkv, d), s in ((c, s) for s in seqs for c in configs):
        for way in ways:
            if time.time() > deadline:
                b.add("attention_long", {"note": "time budget spent"})
                return
            if s > 65536 and way != "flash_twin_views":
                continue
            row = {"batch": bs, "heads": nh, "kv_heads": nkv, "seq": s, "head_dim": d, "causal": True, "way": way}
            b.args.reps = 5 if s >= 32768 else reps0
            try:
                if way == "flash_twin_views":  # gpu_model.Decoder.attention: split views of one [b, s, qkv] tensor
                    qkv = randn(b, bs, s, (nh + 2 * nkv) * d).requires_grad_(True)
                    q, k, v = qkv.split([nh * d, nkv * d, nkv * d], -1)
                    q, k, v = (t.view(bs, s, -1, d).transpose(1, 2) for t in (q, k, v))
                else:
                    q, k, v = (randn(b, bs, n, s, d).requires_grad_(True) for n in (nh, nkv, nkv))
                backend = SDPBackend.CUDNN_ATTENTION if way.startswith("cudnn") else SDPBackend.FLASH_ATTENTION
                if not b.cuda:
                    backend = SDPBackend.MATH

                def fwd():
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
                out = fwd()
                dout = randn(b, *out.shape, dtype=out.dtype)
                flops = 4 * bs * nh * s * s * d / 2
                row["fwd_s"], row["timing"] = b.time_calls([fwd], graph=False)
                grad = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
                row["bwd_s"], _ = b.time_calls([grad], graph=False)
                row["fwd_tflops"] = flops / row["fwd_s"] / 1e12
                row["bwd_tflops"] = 2.5 * flops / row["bwd_s"] / 1e12
                row["fwd_bwd_tflops"] = 3.5 * flops / (row["fwd_s"] + row["bwd_s"]) / 1e12
                del out, dout, q, k, v
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            b.add("attention_long", row, {"flops_note": "fwd 4*b*nh*s^2*d/2 (causal half), bwd 2.5x fwd"})
            print(f"[attention_long] {way} b{bs} h{nh}/{nkv} d{d} s{s}: " + (row.get("error") or
                  f"fwd {row['fwd_tflops']:.0f} bwd {row['bwd_tflops']:.0f} fwd+bwd {row['fwd_bwd_tflops']:.0f}"),
                  flush=True)
            _free(b)
    b.args.reps = reps0


def run_long_steps(b: Bench, deadline: float):
    for name, (a, mb) in long_rows(b.args.smoke).items():
        row = {"name": name, "arch": a.as_dict(), "micro_batch": mb, "recompute": False}
        if time.time() > deadline:
            row["error"] = "time budget spent before this row"
            b.add("long_steps", row)
            continue
        model = opt = None
        try:
            _free(b)
            model = Decoder(a, b.dev, b.dtype, False, generator=b.gen)
            opt = MasterAdamW(model.parameters())
            row["tensors"] = len(opt.params)
            batch = make_batch(a, mb, b.dev, b.gen)
            times = _timed_steps(b, model, opt, batch, 2, 6 if not b.args.smoke else 2)
            row.update(step_s=times, step_s_median=statistics.median(times),
                       tokens_per_s=mb * a.seq / statistics.median(times))
            if b.cuda:
                row["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            if not b.args.no_profile:
                row.update(profile_step(b, model, opt, batch))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        del model, opt
        b.add("long_steps", row, {"notes": "dense twin steps, one micro-batch, 2 warm-up + 6 timed steps, median"})
        print(f"[long_steps] {name}: " + (row.get("error") or f"{row['step_s_median'] * 1e3:.1f} ms, peak "
              f"{row.get('peak_mem_bytes', 0) / 2**30:.1f} GiB, busy {row.get('kernel_time_s')}"), flush=True)


RUNNERS = {"moe_steps": run_moe_steps, "bmm": run_bmm, "gemm_extra": run_gemm_extra, "moe_ops": run_moe_ops,
           "attention_long": run_attention_long, "long_steps": run_long_steps}


def run_tables(doc: str, tables: tuple, runners: dict, argv=None, *, warmup: int = 3, steps_n: int = 10,
               options: tuple = (), setup=None) -> None:
    """The command line of every GPU table script (this one, gpu_h100.py, gpu_h100_twin.py, gpu_moe_launches.py):
    --out, --only (a comma list of `tables`), --smoke (tiny shapes, at most 3 repetitions), --cpu, --reps,
    --warmup, --steps-n, --no-profile, --budget (seconds per table) and the script's own `options` [(flags,
    argparse keywords)]; then `setup(bench, only)` (e.g. the attention pin of the step tables) and every table of
    --only in turn, `runners[table](bench, deadline)`."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=",".join(tables), help=f"comma list of {tables}")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--steps-n", type=int, default=steps_n)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--budget", default="", help="seconds per table, e.g. moe_steps=200,bmm=60")
    for flags, kw in options:
        ap.add_argument(*flags, **kw)
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps = min(args.reps, 3)
    budgets = {k: float(v) for k, v in (kv.split("=") for kv in args.budget.split(",") if kv)}
    only = [t for t in args.only.split(",") if t]
    bad = [t for t in only if t not in tables]
    if bad:
        raise SystemExit(f"--only: unknown tables {bad}; known: {tables}")
    b = Bench(args)
    if setup is not None:
        setup(b, only)
    print(f"device {b.dev}; torch {torch.__version__}; tables {only}", flush=True)
    for table in only:
        t0 = time.time()
        runners[table](b, t0 + budgets.get(table, 1e9))
        print(f"[{table}] {time.time() - t0:.1f} s", flush=True)


def main(argv=None):
    run_tables(__doc__, TABLES, RUNNERS, argv, options=(
        (("--moe-set",), {"default": "all", "choices": ("all", "final"), "help": "moe_steps rows (moe_rows)"}),
        (("--ops",), {"default": "", "help": "moe_ops: only these op classes (comma list)"}),
        (("--bmm-c",), {"default": "", "help": "bmm: dropless C factors of T k / E (default DROPLESS_C)"})))


if __name__ == "__main__":
    main()

"""Kernel tables measured with Paddle on this process's device, in the layout the profile fitter reads.

    python -m llmtrain.plan --calibrate           # calls these, then fit.py, then writes the profile
    rows = gemm_table(grid(...)); mem = memory_bound_table(); host = host_table(); opt = optimizer_table()

The row formats are those of the raw H200 tables under benchmarks/data/h200/ (README.md there): GEMM rows
{m, n, k, dtype, seconds, tflops}, flash attention rows {batch, heads, kv_heads, seq, head_dim, causal, fwd_s,
bwd_s} (GPU only), memory-bound rows {op, numel, dtype, bytes_read, bytes_written, seconds}, the host's per-op
times, and AdamW steps vs elements and tensors. Timing: on a GPU `paddle.device.synchronize()` around `reps`
back-to-back calls after a warm-up (the device time of a kernel once the queue is full; a kernel shorter than
the host's dispatch shows the dispatch instead), the median of three such runs; on a CPU the fastest of `reps`
single calls (each op runs in its calling thread, so one call is the op's time including its dispatch; on a
host shared with other work the fastest call is the op's own time, the slower ones carry the neighbours').
"""
from __future__ import annotations

import statistics
import time


def _on_gpu() -> bool:
    import paddle

    return paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu")


def _sync():
    import paddle

    if _on_gpu():
        paddle.device.synchronize()


def timeit(fn, reps: int = 5, warmup: int = 1) -> float:
    """Seconds of one call of `fn` (GPU: mean of `reps` queued calls, median of three such runs; CPU: the fastest
    of `reps` calls)."""
    for _ in range(warmup):
        fn()
    _sync()
    if _on_gpu():
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            _sync()
            runs.append((time.perf_counter() - t0) / reps)
        return statistics.median(runs)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cpu_matmul_peak(n: int = 1024, repeats: int = 5) -> float:
    """Best observed fp32 FLOP/s of an n x n x n matmul on this process's threads (MFU's denominator on CPU)."""
    import paddle

    a = paddle.randn([n, n], dtype="float32")
    b = paddle.randn([n, n], dtype="float32")
    paddle.matmul(a, b)  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = paddle.matmul(a, b)
        float(c[0, 0])
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def grid(sizes, max_flops: float) -> list[tuple[int, int, int]]:
    """Every (m, n, k) of `sizes`³ whose GEMM has at most `max_flops` FLOPs."""
    return [(m, n, k) for m in sizes for n in sizes for k in sizes if 2.0 * m * n * k <= max_flops]


def gemm_table(shapes, dtype: str = "float32", reps: int = 3) -> list[dict]:
    import paddle

    rows = []
    for m, n, k in shapes:
        a, b = paddle.randn([m, k]).astype(dtype), paddle.randn([k, n]).astype(dtype)
        t = timeit(lambda: paddle.matmul(a, b), reps)
        rows.append({"m": m, "n": n, "k": k, "layout": "nn", "dtype": dtype, "seconds": t,
                     "tflops": 2.0 * m * n * k / t / 1e12, "source": "grid"})
    return rows


def attention_table(configs, dtype: str = "bfloat16", reps: int = 5) -> list[dict]:
    """Flash attention (GPU only): configs [(batch, heads, kv_heads, seq, head_dim)], causal, forward and backward."""
    import paddle
    from paddle.nn.functional.flash_attention import flash_attention

    rows = []
    for b, nh, nkv, s, d in configs:
        q = paddle.randn([b, s, nh, d]).astype(dtype)
        k = paddle.randn([b, s, nkv, d]).astype(dtype)
        v = paddle.randn([b, s, nkv, d]).astype(dtype)
        for x in (q, k, v):
            x.stop_gradient = False
        fwd = timeit(lambda: flash_attention(q, k, v, causal=True)[0], reps)

        def both():
            out = flash_attention(q, k, v, causal=True)[0]
            out.backward(paddle.ones_like(out))

        rows.append({"batch": b, "heads": nh, "kv_heads": nkv, "seq": s, "head_dim": d, "causal": True,
                     "impl": "paddle flash_attention", "fwd_s": fwd, "bwd_s": max(timeit(both, reps) - fwd, 1e-9)})
    return rows


def _mem_ops(numel: int, dtype: str):
    """{op class: (callable, bytes read, bytes written)} over tensors of `numel` elements (rows of 1024)."""
    import paddle
    import paddle.nn.functional as F

    e = paddle.to_tensor([], dtype=dtype).element_size()
    cols = 1024 if numel >= 1024 else numel
    shape = [numel // cols, cols]
    x, y = paddle.randn(shape).astype(dtype), paddle.randn(shape).astype(dtype)
    w = paddle.ones([cols]).astype(dtype)
    ln_w, ln_b = paddle.ones([cols], dtype="float32"), paddle.zeros([cols], dtype="float32")
    x32 = x.astype("float32")
    ids = paddle.randint(0, shape[0], [shape[0]])
    n = numel
    ops = {
        "copy": (lambda: paddle.assign(x), n * e, n * e),
        "add": (lambda: x + y, 2 * n * e, n * e),
        "mul": (lambda: x * y, 2 * n * e, n * e),
        "cast": (lambda: x.astype("float16" if dtype == "float32" else "float32"), n * e, n * (2 if dtype == "float32" else 4)),
        "reduce": (lambda: x.sum(-1), n * e, shape[0] * e),
        "softmax": (lambda: F.softmax(x32, -1), n * 4, n * 4),
        "gelu": (lambda: F.gelu(x, approximate=True), n * e, n * e),
        "silu": (lambda: F.silu(x), n * e, n * e),
        "layernorm": (lambda: F.layer_norm(x32, [cols], ln_w, ln_b), n * 4, n * 4 + 8 * shape[0]),
        "embedding": (lambda: F.embedding(ids, x), shape[0] * 8 + n * e, n * e),
    }
    return ops


def memory_bound_table(sizes=(2**10, 2**13, 2**16, 2**19, 2**22), dtype: str = "float32", reps: int = 5) -> list[dict]:
    """Elementwise, reduction, norm, activation and gather ops over `sizes` elements (forward calls)."""
    rows = []
    for numel in sizes:
        for op, (fn, r, w) in _mem_ops(numel, dtype).items():
            rows.append({"op": op, "numel": numel, "dtype": dtype, "bytes_read": r, "bytes_written": w,
                         "seconds": timeit(fn, reps)})
    return rows


def host_table(n: int = 200) -> dict:
    """Per-op host seconds: a bare tiny op (`dispatch_s`), the extra of recording it for autograd (`fwd_extra_s`),
    a backward node's time (`bwd_node_s`), a reshape (`view_s`); on a GPU also the queued rate of tiny ops
    (`fwd_op_s`: dispatch + recording, the host's per-kernel time of eager execution)."""
    import paddle

    a = paddle.ones([4])
    g = paddle.ones([4])
    g.stop_gradient = False

    def chain(x):
        for _ in range(n):
            x = x + 1.0
        return x

    def bare():
        chain(a)

    def fwd():
        chain(g)

    def both():
        chain(g).sum().backward()

    t_bare, t_fwd, t_both = (timeit(f, 5) / n for f in (bare, fwd, both))
    t_view = timeit(lambda: [a.reshape([2, 2]) for _ in range(n)], 5) / n
    return {"dispatch_s": t_bare, "fwd_extra_s": max(0.0, t_fwd - t_bare), "fwd_op_s": t_fwd,
            "bwd_node_s": max(0.0, t_both - t_fwd), "view_s": t_view, "ops_per_loop": n}


def optimizer_table(configs=((4, 2**12), (64, 2**12), (4, 2**18), (16, 2**18), (4, 2**20)),
                    multi_precision: bool = False, reps: int = 5) -> list[dict]:
    """AdamW steps over `tensors` parameters of `numel` elements each: {tensors, numel (total), seconds}."""
    import paddle

    rows = []
    for tensors, numel in configs:
        params = [paddle.create_parameter([numel], "float32") for _ in range(tensors)]
        paddle.add_n([p.sum() for p in params]).backward()  # a gradient of ones on each (kept across steps)
        opt = paddle.optimizer.AdamW(1e-4, parameters=params, weight_decay=0.01, multi_precision=multi_precision)
        rows.append({"tensors": tensors, "numel": tensors * numel, "seconds": timeit(opt.step, reps)})
    return rows

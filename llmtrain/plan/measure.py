"""Kernel tables measured with Paddle on this process's device, in the layout the profile fitter reads.

    python -m llmtrain.plan --calibrate           # calls these, then fit.py, then writes the profile
    rows = gemm_table(grid(...)); mem = memory_bound_table(); host = host_table(); opt = optimizer_table()

The row formats are those of the raw H200 tables under benchmarks/data/h200/ (README.md there): GEMM rows
{m, n, k, dtype, seconds, tflops}, flash attention rows {batch, heads, kv_heads, seq, head_dim, causal, fwd_s,
bwd_s} (GPU only), memory-bound rows {op, numel, dtype, bytes_read, bytes_written, seconds}, the host's per-op
times, and AdamW steps vs elements and tensors. Timing: on a GPU `paddle.device.synchronize()` around `reps`
back-to-back calls after a warm-up (the device time of a kernel once the queue is full; a kernel shorter than
the host's dispatch shows the dispatch instead), the median of three such runs; on a CPU the same definition
(each op runs in its calling thread, so a call's time holds its dispatch): the median of three runs' mean
call, a typical call as a training step's sum of ops sees it, never the fastest of the repeats (which on a
shared host under-prices every op against the median step it is compared with).
"""
from __future__ import annotations

import os
import statistics
import time


def _on_gpu() -> bool:
    import paddle

    return paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu")


def _sync():
    import paddle

    if _on_gpu():
        paddle.device.synchronize()


CPU_RUNS = 3
"""On a CPU, `timeit` splits its calls into this many back-to-back runs and returns the median of their means."""


def timeit(fn, reps: int = 5, warmup: int = 1) -> float:
    """Seconds of one call of `fn`. GPU: mean of `reps` queued calls, median of three such runs. CPU: the same
    definition over `reps` calls in all, split into CPU_RUNS back-to-back runs (median of the runs' means): a
    typical call, slow calls included in proportion, as a training step sums its ops (the planner's CPU rows
    compare with the median step)."""
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
    per_run = max(1, -(-reps // CPU_RUNS))
    runs = []
    for _ in range(CPU_RUNS):
        t0 = time.perf_counter()
        for _ in range(per_run):
            fn()
        runs.append((time.perf_counter() - t0) / per_run)
    return statistics.median(runs)


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


def gemm_table(shapes, dtype: str = "float32", reps: int = 3, passes: int = 1, layouts=("nn",)) -> list[dict]:
    """GEMM rows C[m, n] = A[m, k] @ B[k, n] per layout: "nn", "nt" (B stored [n, k], `transpose_y`), "tn" (A
    stored [k, m], `transpose_x`); `passes` > 1 sweeps the whole grid that many times and keeps each shape's
    median pass (on a host shared with other work, a burst of its load then hits one pass of a shape, not all
    of them)."""
    import paddle

    seen: dict = {}
    for _ in range(passes):
        for m, n, k in shapes:
            for lay in layouts:
                a = paddle.randn([k, m] if lay == "tn" else [m, k]).astype(dtype)
                b = paddle.randn([n, k] if lay == "nt" else [k, n]).astype(dtype)
                seen.setdefault((m, n, k, lay), []).append(
                    timeit(lambda: paddle.matmul(a, b, transpose_x=lay == "tn", transpose_y=lay == "nt"), reps))
    return [{"m": m, "n": n, "k": k, "layout": lay, "dtype": dtype, "seconds": statistics.median(t),
             "tflops": 2.0 * m * n * k / statistics.median(t) / 1e12, "source": "grid"}
            for (m, n, k, lay), t in seen.items()]


MATH_ATTENTION = tuple((bh, s, d) for d in (8, 16, 32, 64, 128) for s in (16, 32, 64, 128, 256, 512, 1024)
                       for bh in (1, 2, 4, 8, 16, 32, 64) if bh * s * s <= 2**21)
"""(batch·heads, seq, head_dim) of `math_attention_table` in `--calibrate`: a log-spaced grid, scores of at most
2**21 elements per call."""


def math_attention_table(configs=MATH_ATTENTION, reps: int = 3, causal: bool = True) -> list[dict]:
    """The math attention core as llmtrain's layers run it on a CPU, one composite op: q, k, v [b, s, heads·d]
    (the projections' outputs) reshaped to heads, `layers.math_attention` (strided q·kᵀ and probs·v, scale,
    causal mask, softmax), reshaped back to [b, s, heads·d] (o_proj's input); forward with autograd recording,
    and the backward through it. Rows {batch, heads, seq, head_dim, causal, fwd_s, bwd_s}."""
    import paddle

    from llmtrain.models.layers import math_attention

    rows = []
    for bh, s, d in configs:
        heads = min(bh, 4)
        b = bh // heads

        def core(q, k, v):
            q, k, v = (x.reshape([0, 0, -1, d]) for x in (q, k, v))  # [b, s, heads, d]
            return math_attention(q, k, v, causal).reshape([0, 0, -1])  # [b, s, heads * d]

        ins = [paddle.randn([b, s, heads * d]) for _ in range(3)]
        for x in ins:
            x.stop_gradient = False
        fwd = timeit(lambda: core(*ins), reps)
        out = core(*ins)
        dy = paddle.ones_like(out)
        bwd = timeit(lambda: paddle.grad([out], ins, [dy], retain_graph=True), reps)
        rows.append({"batch": b, "heads": heads, "seq": s, "head_dim": d, "causal": causal, "impl": "layers.math_attention",
                     "fwd_s": fwd, "bwd_s": bwd})
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
    """{op class: (make() -> callable, numel)}: elementwise, reduction, norm, activation, rotary, gather and
    cross-entropy ops over `numel` elements of one input (rows of 1024; cross entropy: rows of a 4096 vocabulary;
    the embedding's gradient: elements of the table),
    as llmtrain's layers call them; `X_bwd`: the gradient of X through autograd over a kept forward."""
    import paddle
    import paddle.nn.functional as F

    cols = 1024 if numel >= 1024 else numel
    rows = max(1, numel // cols)
    n = rows * cols

    def t(*shape, dt=dtype, grad=False):
        x = paddle.randn(list(shape)).astype(dt)
        x.stop_gradient = not grad
        return x

    def fwd(f, *shapes):
        def make():
            ins = [t(*sh) for sh in shapes]
            return lambda: f(*ins)
        return make

    def bwd(f, *shapes):
        def make():
            ins = [t(*sh, grad=True) for sh in shapes]
            y = f(*ins)
            dy = paddle.ones_like(y)
            return lambda: paddle.grad([y], ins, [dy], retain_graph=True)
        return make

    def rope(x):  # layers.Rotary.apply on [1, rows, cols/64, 64]
        x1, x2 = x.chunk(2, axis=-1)
        return x * cos + paddle.concat([-x2, x1], axis=-1) * sin

    d = 64 if cols % 64 == 0 else cols
    cos, sin = t(1, rows, 1, d), t(1, rows, 1, d)
    w, bias = paddle.ones([cols], dtype=dtype), paddle.zeros([cols], dtype=dtype)
    vocab = 4096
    tokens = max(1, n // vocab)
    labels = paddle.randint(0, vocab, [tokens, 1])
    table = t(vocab, cols)

    def ce(lg):
        return F.cross_entropy(lg.astype("float32"), labels, reduction="none")

    def emb(tab):
        return F.embedding(paddle.randint(0, vocab, [rows]), tab)

    sq = (rows, cols)
    ops = {
        "copy": (fwd(paddle.assign, sq), n), "add": (fwd(paddle.add, sq, sq), n), "mul": (fwd(paddle.multiply, sq, sq), n),
        "cast": (fwd(lambda x: x.astype("float16" if dtype == "float32" else "float32"), sq), n),
        "reduce": (fwd(lambda x: x.sum(-1), sq), n),
        "softmax": (fwd(lambda x: F.softmax(x, -1), sq), n), "softmax_bwd": (bwd(lambda x: F.softmax(x, -1), sq), n),
        "gelu": (fwd(lambda x: F.gelu(x, approximate=True), sq), n),
        "gelu_bwd": (bwd(lambda x: F.gelu(x, approximate=True), sq), n),
        "swiglu": (fwd(lambda g, u: F.silu(g) * u, sq, sq), n), "swiglu_bwd": (bwd(lambda g, u: F.silu(g) * u, sq, sq), n),
        "layernorm": (fwd(lambda x: F.layer_norm(x, [cols], w, bias), sq), n),
        "layernorm_bwd": (bwd(lambda x: F.layer_norm(x, [cols], w, bias), sq), n),
        "rope": (fwd(rope, (1, rows, cols // d, d)), n), "rope_bwd": (bwd(rope, (1, rows, cols // d, d)), n),
        "cross_entropy": (fwd(ce, (tokens, vocab)), tokens * vocab),
        "cross_entropy_bwd": (bwd(ce, (tokens, vocab)), tokens * vocab),
        "embedding": (lambda: (lambda: emb(table)), n),
    }

    def emb_bwd():  # indexed by the table's elements (its zero-filled gradient dominates): [n / 64, 64], 256 ids
        tab = t(max(1, n // 64), 64, grad=True)
        y = F.embedding(paddle.randint(0, max(1, n // 64), [256]), tab)
        return lambda: paddle.grad([y], [tab], [paddle.ones_like(y)], retain_graph=True)

    ops["embedding_bwd"] = (emb_bwd, n)
    if not _on_gpu():  # tensor parallelism's loss on a CPU: llmtrain's stand-in for fleet's fused kernel, op by op
        from llmtrain.paddle_compat.cpu_backend.mp_ops import vocab_ce_backward, vocab_ce_forward

        glob = paddle.randint(0, 2 * vocab, [tokens])  # this rank holds half the vocabulary (tp 2)

        def vp_ce():
            lg = t(tokens, vocab, dt="float32")
            return lambda: vocab_ce_forward(lg, glob, 0, -100, lambda x, op: None)

        def vp_ce_bwd():
            saved = vocab_ce_forward(t(tokens, vocab, dt="float32"), glob, 0, -100, lambda x, op: None)[2]
            dloss = paddle.ones([tokens, 1])
            return lambda: vocab_ce_backward(saved, dloss)

        ops["vocab_parallel_ce"] = (vp_ce, tokens * vocab)
        ops["vocab_parallel_ce_bwd"] = (vp_ce_bwd, tokens * vocab)
    return ops


def memory_bound_table(sizes=(2**10, 2**13, 2**16, 2**19, 2**22), dtype: str = "float32", reps: int = 5,
                       passes: int = 1) -> list[dict]:
    """Memory-bound ops (`_mem_ops`) over `sizes` elements: rows {op, numel, dtype, seconds} (median pass)."""
    seen: dict = {}
    for _ in range(passes):
        for numel in sizes:
            for op, (make, n) in _mem_ops(numel, dtype).items():
                seen.setdefault((op, n), []).append(timeit(make(), reps))
    return [{"op": op, "numel": n, "dtype": dtype, "seconds": statistics.median(t)} for (op, n), t in seen.items()]


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


TRAINER_RUNS = ((1, 1), (1, 4), (2, 2), (4, 1), (4, 4))
"""(layers, micro-batches per step) of the tiny GPT the Trainer runs in `trainer_loop_table`."""


def trainer_overrides(layers: int, micro_batches: int, prefix: str, tokenizer: str, steps: int, seq: int = 16) -> list[str]:
    """pretrain.py overrides of one `trainer_loop_table` run: gpt-tiny shrunk to h 32, seq 16, micro-batch 1,
    the CPU leg's settings otherwise (no progress bar, VisualDL or final checkpoint, data.num_workers=0)."""
    return ["model=gpt-tiny", "model.hidden_size=32", f"model.num_layers={layers}", "model.num_heads=4",
            "model.ffn_hidden_size=64", f"model.max_position_embeddings={seq}", "model.vocab_size=16000",
            f"data.seq_len={seq}", f"data.prefixes=[{prefix}]", f"data.tokenizer={tokenizer}", "data.num_workers=0",
            f"train.max_steps={steps}", f"train.global_batch_size={micro_batches}", "train.micro_batch_size=1",
            "train.progress_bar=false", "train.visualdl=false", "checkpoint.save_final=false", "checkpoint.resume=none"]


def trainer_loop_table(runs=TRAINER_RUNS, steps: int = 14) -> list[dict]:
    """Step times of the real Trainer (`llmtrain/pretrain.py`, one process, as a user runs it) on a tiny GPT whose
    kernels take microseconds to a millisecond: the data path, the step runner, the divergence guard, the clip's
    bookkeeping, the metrics record, the watchdog and stop checks. A synthetic corpus of random token ids is
    written for it (the packaged tokenizer `tokenizers/pd1998-bpe16k`). One row per (layers, micro-batches): the
    median step_time of steps 3..`steps` from metrics.jsonl (as the kernel tables are typical calls, `timeit`).
    calibrate.fit_loop subtracts what the kernel tables predict for the same runs (the model as the run resolved
    it: `model` of its config.yaml)."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import numpy as np
    from omegaconf import OmegaConf

    from llmtrain.data.indexed import IndexedWriter

    repo = Path(__file__).resolve().parents[2]
    tokenizer = str(repo / "tokenizers" / "pd1998-bpe16k")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "random_text_document")
        w = IndexedWriter(prefix, np.uint16)
        rng = np.random.default_rng(0)
        w.add_documents(rng.integers(3, 16000, size=200 * 256), np.full(200, 256))
        w.finalize()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        for layers, m in runs:
            run_dir = Path(tmp) / f"L{layers}_m{m}"
            overrides = trainer_overrides(layers, m, prefix, tokenizer, steps)
            proc = subprocess.run([sys.executable, str(repo / "llmtrain" / "pretrain.py"), *overrides,
                                   f"run.dir={run_dir}"], cwd=tmp, env=env,
                                  capture_output=True, text=True, timeout=600)
            metrics = run_dir / "metrics.jsonl"
            if proc.returncode != 0 or not metrics.exists():
                raise RuntimeError(f"trainer loop run failed (exit {proc.returncode}): {' '.join(overrides)}\n"
                                   f"{proc.stderr[-3000:]}")
            times = [r["step_time"] for r in map(json.loads, metrics.read_text().splitlines())
                     if "step_time" in r and r.get("step", 0) > 2]
            model = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml").model, resolve=True)
            rows.append({"layers": layers, "micro_batches": m, "micro_batch": 1, "seq": 16, "overrides": overrides,
                         "model": model, "seconds": statistics.median(times), "fastest_s": min(times),
                         "steps": len(times)})
    return rows


SHARED_HOST_WORK = (("gemm", 256), ("gemm", 1024), ("memory_bound", 2**16), ("memory_bound", 2**19),
                    ("memory_bound", 2**20), ("memory_bound", 2**21), ("memory_bound", 2**22))
"""The kernels `shared_host_table` runs in 1 and in 2 processes at once: fp32 n x n x n GEMMs, and adds of n fp32
elements whose working sets (3n x 4 bytes) span the caches: 768 KiB (a core's own), 6-24 MiB (the shared last
level), 48 MiB (memory)."""


def _shared_host_worker(commands, results) -> None:
    """One process of `shared_host_table`: for each (kind, size, start, seconds) command, waits until the wall
    clock reaches `start`, calls the kernel for `seconds` and puts the median call; None ends it."""
    import paddle

    from llmtrain.paddle_compat.cpu_backend.host_allocator import keep_freed_memory

    keep_freed_memory()  # as the trainer's processes run

    while True:
        cmd = commands.get()
        if cmd is None:
            return
        kind, size, start, seconds = cmd
        if kind == "gemm":
            a, b = paddle.randn([size, size]), paddle.randn([size, size])
            fn = lambda: paddle.matmul(a, b)  # noqa: E731
        else:
            x, y = paddle.randn([size]), paddle.randn([size])
            fn = lambda: paddle.add(x, y)  # noqa: E731
        for _ in range(3):
            fn()
        time.sleep(max(0.0, start - time.time()))
        wall, cpu, end = [], [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        results.put((statistics.median(wall), statistics.median(cpu)))


def shared_host_rows(rounds: dict) -> list[dict]:
    """`shared_host_table`'s rows from {(kind, size): [(alone, [each process together]), ...] one per round},
    each timing a (median wall-clock call, median thread-CPU call): a round's "together" is its slowest process."""
    rows = []
    for (kind, size), pairs in rounds.items():
        slowest = [(a, tuple(max(x[i] for x in both) for i in (0, 1))) for a, both in pairs]
        rows.append({"kind": kind, "size": size, "alone_s": statistics.median(a[0] for a, _ in slowest),
                     "together_s": statistics.median(t[0] for _, t in slowest),
                     "slowdown": statistics.median(t[0] / a[0] for a, t in slowest),
                     "cpu_time_slowdown": statistics.median(t[1] / a[1] for a, t in slowest)})
    return rows


def shared_host_table(ranks: int = 2, seconds: float = 0.5, rounds: int = 5, work=SHARED_HOST_WORK) -> dict:
    """How much slower a kernel runs while `ranks` processes (one OpenMP thread each, as a multi-process CPU run
    places them) run it at once on this host than one process alone. `ranks` processes are started once; each
    round times every kernel of `work` in process 0 alone, then in all of them at once (same wall-clock start);
    a kernel's slowdown is the median over rounds of (the slowest process's median call together) / (median call
    alone), in wall-clock time: {"ranks", "rows": [{kind, size, alone_s, together_s, slowdown, cpu_time_slowdown}]}.
    The slowest, not the typical process: a multi-process job meets at every collective, so it moves at its
    slowest rank's pace, and on a shared host the processes' speeds wander apart (two pinned matmul loops at
    once: the slower 5-12% above the mean; benchmarks/README.md, "Measurements the planner's code cites").
    What it holds:
    the hardware the processes share (caches, memory bandwidth, SMT siblings; `cpu_time_slowdown`, the same
    ratio in each thread's CPU time, is that part alone) and the host's other work, which a single process
    leaves to the idle cores but `ranks` processes on as many cores must share time with. The planner scales
    the kernels of a layout with that many processes on one host by it (profile.Profile.shared_host_slowdown);
    like every table it holds for the load the host had when it was measured."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queues, results = [ctx.Queue() for _ in range(ranks)], ctx.Queue()
    procs = [ctx.Process(target=_shared_host_worker, args=(q, results), daemon=True) for q in queues]
    for p in procs:
        p.start()
    ratios: dict = {}
    try:
        for _ in range(rounds):
            for kind, size in work:
                start = time.time() + 0.3
                queues[0].put((kind, size, start, seconds))
                alone = results.get(timeout=300)
                start = time.time() + 0.3
                for q in queues:
                    q.put((kind, size, start, seconds))
                both = [results.get(timeout=300) for _ in queues]
                ratios.setdefault((kind, size), []).append((alone, both))
    finally:
        for q in queues:
            q.put(None)
        for p in procs:
            p.join(timeout=60)
    rows = shared_host_rows(ratios)
    return {"ranks": ranks, "seconds": seconds, "rounds": rounds, "rows": rows}

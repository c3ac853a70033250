"""Measure this machine into a device profile: kernel tables with Paddle, and collectives.

    python -m llmtrain.plan --calibrate                        # writes work/cpu-here.json (plan.profile's default)
    python -m llmtrain.plan --calibrate --out /tmp/here.json   # elsewhere (then plan.profile=/tmp/here.json)
    python -m llmtrain.plan --calibrate --quick                # small tables (seconds; what the tests run)

Kernel tables (llmtrain/plan/measure.py, the same tables the H200 profile is fitted from): GEMMs over a
log-spaced grid of (m, n, k) (three sweeps, each shape's median kept), on a CPU the math attention core as one
composite op over (batch·heads, seq, head_dim), memory-bound ops (copy, add, mul, cast, reduce, softmax, GeLU, SiLU, LayerNorm,
embedding gather) over sizes, flash attention on a GPU, the host's per-op time of eager execution and AdamW
steps vs tensors and elements; fitted by llmtrain/plan/fit.py into the profile's tables. On a CPU, then, the
training loop's own work: whole steps of the real Trainer (`llmtrain/pretrain.py`, one process) on a tiny GPT
(`measure.trainer_loop_table`; not with --quick), less what the fitted tables predict for them, fitted as a cost per step, per micro-batch and per op (`fit_loop`)
into the host block (`step_s`, `micro_batch_s`, and the per-op share added to `fwd_op_s`/`bwd_op_s`/`view_op_s`). Then (CPU, not with --quick) how much slower a GEMM and a streaming add run while 2 processes compute at
once than alone (`measure.shared_host_table`, the profile's `shared_host`): the planner slows the kernels of a
layout with more than one process on the host by it. On a CPU the op times
hold their own dispatch (`tables_include_host`) and ops run where they are dispatched (`async_launch` false);
on a GPU the tables are device times and the host's queued per-op time is measured apart (timeline.py). The
CPU's fp32 matmul peak is MFU's denominator there (`peak_flops`); a GPU keeps its datasheet peak.

Communication: one 2-process
`paddle.distributed.launch` over gloo (the CPU backend training uses) runs, for a few message sizes, the
fastest of the repeats after a barrier (the transfer's own cost; the typical wait for a computing peer is the
busy alpha below, a mean; the medians are kept in the file too) of a ring all-reduce of n fp32 bytes and of a blocking send/recv ping-pong, and fits t = c0 + c1·bytes
by least squares; when c0 comes out not positive (a latency small against the noise: seen here on a quiet
machine) the line goes through the smallest message's time instead. For 2 ranks a ring all-reduce costs
2·(n-1)/n·bytes/bw + 2·(n-1)·alpha = bytes/bw + 2·alpha, so bw = 1/c1 and alpha = c0/2; one send/recv
(half a ping-pong) costs alpha + bytes/bw, alpha = c0.
Then, with no barrier, 10 x `repeats` all-reduces of 128 KiB between ranks that each run a ~1 ms matmul
before every call, as training interleaves compute and collectives: their mean per call, less the transfer
time, halved, is `collective_alpha_busy` (each call also waits for the other rank to arrive, which on this
shared host costs milliseconds where the quiet alpha is tens of microseconds). The same with ~0.15, 8 and
60 ms matmuls, then 1 and 5 forward+backward passes of a small MLP (autograd work of ~50 and ~250 ms, a
micro-batch's or a step's worth), between the calls gives `alpha_by_gap` (the wait grows with the compute
between two meetings; the measured curve is in benchmarks/README.md, "Measurements the planner's code cites"),
which the planner
reads at each collective's gap (tp's all-reduces a few ms apart, ZeRO-2's reduces once a micro-batch, the
gradient sync once a step).
The planner uses the collective bandwidth and the busy alpha for dp/sharding/tp and the send/recv figures
for pipeline p2p. Everything on loopback TCP of one host: both "links" of the profile (in-node and across
nodes) get the same figures. On a GPU machine (GPU-only branch, `gpu_base`; not run here: Paddle's GPU
build cannot be installed on the machines we test on) the profile is named after the packaged profile whose
`match` string the GPU's name holds (its datasheet peak, memory and links kept), the tables are device
times (`async_launch`), and the collectives are measured only with 2 or more GPUs (the launcher then places one
process per GPU and the same worker runs over NCCL); with one GPU the links keep the packaged figures.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 2 * 2**20, 8 * 2**20)  # bytes per message
REPO = Path(__file__).resolve().parents[2]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (c0, c1) of y = c0 + c1·x; when c0 comes out not positive (a latency small against the
    noise), the line through the point of the smallest x instead: c1 by least squares of the others relative
    to it, c0 = its y minus c1·x (its y alone when that would not be positive)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    c1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if my - c1 * mx > 0:
        return my - c1 * mx, c1
    i0 = min(range(len(xs)), key=xs.__getitem__)
    x0, y0 = xs[i0], ys[i0]
    c1 = sum((x - x0) * (y - y0) for x, y in zip(xs, ys)) / sum((x - x0) ** 2 for x in xs)
    c0 = y0 - c1 * x0
    return (c0 if c0 > 0 else y0), c1


def _worker(out: str, sizes, repeats: int) -> None:
    """Run under paddle.distributed.launch on 2 processes: times of all-reduce and ping-pong per size."""
    import paddle
    import paddle.distributed as dist

    if paddle.get_device() == "cpu":  # the allocator the trainer runs with (cpu_backend.host_allocator)
        from llmtrain.paddle_compat.cpu_backend.host_allocator import keep_freed_memory

        keep_freed_memory()
    dist.init_parallel_env()
    rank = dist.get_rank()
    rows = []
    for nbytes in sizes:
        x = paddle.ones([nbytes // 4], dtype="float32")
        ar, pp = [], []
        for i in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if i:
                ar.append(time.perf_counter() - t0)
        for i in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, dst=1)
                dist.recv(x, src=1)
            else:
                dist.recv(x, src=0)
                dist.send(x, dst=0)
            if i:
                pp.append((time.perf_counter() - t0) / 2)
        rows.append({"bytes": nbytes, "all_reduce_s": min(ar), "send_recv_s": min(pp),
                     "all_reduce_median_s": statistics.median(ar), "send_recv_median_s": statistics.median(pp)})
    busy = _busy_all_reduce(dist, repeats * BUSY_CALLS_PER_REPEAT)
    back_to_back = _back_to_back(dist)
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "busy": busy, "back_to_back": back_to_back}))


BACK_TO_BACK_BYTES = (1024, 16 * 2**10, 256 * 2**10)  # the small tensors of a model's parameter list
BACK_TO_BACK_CALLS = 40


def _back_to_back(dist) -> dict:
    """Mean seconds per call of `dist.reduce` (to rank 0) and `dist.broadcast` (from rank 0) issued back to back,
    BACK_TO_BACK_CALLS of each size of BACK_TO_BACK_BYTES after one barrier: how fleet's stage-1 sharding
    optimizer meets, one reduce per gradient and one broadcast per updated parameter. On this CPU they took
    0.5-1.3 ms (reduce) and 0.2-0.45 ms (broadcast) per call, 5-10x the quiet all-reduce's alpha."""
    import paddle

    out = {}
    for name, call in (("reduce_s", lambda x: dist.reduce(x, dst=0)), ("broadcast_s", lambda x: dist.broadcast(x, src=0))):
        per_size = []
        for nbytes in BACK_TO_BACK_BYTES:
            x = paddle.ones([nbytes // 4], dtype="float32")
            dist.barrier()
            call(x)
            t0 = time.perf_counter()
            for _ in range(BACK_TO_BACK_CALLS):
                call(x)
            per_size.append((time.perf_counter() - t0) / BACK_TO_BACK_CALLS)
        out[name] = statistics.fmean(per_size)
    return dict(out, bytes=list(BACK_TO_BACK_BYTES), calls=BACK_TO_BACK_CALLS)


BUSY_BYTES = 128 * 2**10  # one all-reduce of a tiny model's [2, 128, 128] fp32 activation
BUSY_MATMULS = ((128, 4), (256, 1), (512, 0.4), (1024, 0.12))  # (n of an n x n x n fp32 matmul between two calls:
# about 0.15, 1, 8 and 60 ms on one thread here; share of the calls) -- training's gaps between its collectives
# span that range (tp's all-reduces a few ms apart, the gradient buckets tens of ms)
BUSY_CALLS_PER_REPEAT = 10
BUSY_PASSES = ((1, 0.3), (5, 0.3))  # (forward + backward passes of a small residual MLP between two calls: about
# 50 and 250 ms here; share of the calls) -- a micro-batch's or a whole step's work between two meetings (ZeRO-2's
# reduces, the gradient sync), with training's own mix of autograd, small kernels and allocation. 30 calls at the
# long gap (~8 s): its mean wait is heavy-tailed (12 calls read 6-31 ms in three calibrations minutes apart)


def _mlp_pass():
    """One forward + backward of a 4-block residual MLP (LayerNorm, Linear 128->512, GELU, Linear 512->128) on
    [256, 128]: autograd work like a tiny model's micro-batch. Returns the callable that runs one pass."""
    import paddle
    from paddle import nn

    paddle.seed(0)
    blocks = [nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(4)]
    x = paddle.randn([256, 128], dtype="float32")

    def run():
        h = x  # [256, 128]
        for blk in blocks:
            h = h + blk(h)
        h.mean().backward()
    return run


def _busy_all_reduce(dist, calls: int) -> dict:
    """All-reduces of BUSY_BYTES between two processes that compute between the calls, as training does (no
    barrier): each call also waits for the other rank to arrive, which on a shared host (other tenants, ranks
    descheduled) costs far more than the quiet alpha above, and more the longer the ranks computed apart (their
    drift grows with the work between two meetings). Mean and median seconds per call with the ~1 ms gap, and
    `by_gap`: the same for each of BUSY_MATMULS and BUSY_PASSES, with the gap (that work's own median time on
    this rank)."""
    import paddle

    x = paddle.ones([BUSY_BYTES // 4], dtype="float32")
    by_gap = []
    for n, share in BUSY_MATMULS:
        a = paddle.randn([n, n], dtype="float32")
        work = lambda a=a: float(paddle.matmul(a, a)[0, 0])  # noqa: E731
        by_gap.append(dict(_after(dist, x, work, max(3, int(calls * share)), 3), matmul=n))
    mlp = _mlp_pass()
    for passes, share in BUSY_PASSES:
        work = lambda passes=passes: [mlp() for _ in range(passes)]  # noqa: E731
        by_gap.append(dict(_after(dist, x, work, max(3, int(calls * share)), 2), mlp_passes=passes))
    one = next(r for r in by_gap if r.get("matmul") == 256)
    return {"bytes": BUSY_BYTES, "calls": one["calls"], "mean_s": one["mean_s"], "median_s": one["median_s"],
            "by_gap": by_gap}


def _after(dist, x, work, calls: int, probes: int) -> dict:
    """`calls` all-reduces of `x`, each right after `work()` on both ranks (no barrier between): the gap (`work`'s
    median time over `probes` runs alone on this rank) and each call's mean and median seconds."""
    gaps = []
    for _ in range(probes):
        t0 = time.perf_counter()
        work()
        gaps.append(time.perf_counter() - t0)
    dist.barrier()
    times = []
    for i in range(calls + 1):
        work()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if i:  # the first call meets the barrier's skew
            times.append(time.perf_counter() - t0)
    return {"gap_s": statistics.median(gaps), "calls": len(times), "mean_s": statistics.fmean(times),
            "median_s": statistics.median(times)}


def measure_gloo(sizes=SIZES, repeats: int = 10, log_dir: str | None = None) -> dict:
    """{"rows": fastest and median all-reduce and one-way send/recv seconds per message size, "busy": the
    all-reduce between computing ranks (`_busy_all_reduce`)}, from one 2-process launch."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gloo.json"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.pop("PADDLE_TRAINERS_NUM", None)
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--master", f"127.0.0.1:{port}", "--nproc_per_node", "2",
               "--log_dir", log_dir or str(Path(tmp) / "log"), str(Path(__file__).resolve()), "--worker", str(out),
               ",".join(str(s) for s in sizes), str(repeats)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0 or not out.exists():
            logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted((Path(log_dir or Path(tmp) / "log")).glob("workerlog.*")))
            raise RuntimeError(f"calibration launch failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}\n{logs}")
        return json.loads(out.read_text())


GEMM_SIZES = (16, 64, 256, 1024, 4096, 16384)
MEM_SIZES = (2**8, 2**11, 2**14, 2**17, 2**20, 2**21, 2**22)  # 2^21: fp32 tensors of 8 MiB fit the 32 MiB L3 of
# this host with their inputs, 2^22 do not (benchmarks/README.md, "Measurements the planner's code cites"): the
# curve needs both sides
QUICK = {"gemm_sizes": (16, 128, 1024), "gemm_max_flops": 2e8, "mem_sizes": (2**8, 2**12, 2**16),
         "optimizer": ((2, 2**10), (8, 2**10), (2, 2**14)), "gloo_sizes": (4 * 2**10, 2**20, 4 * 2**20),
         "repeats": 3, "passes": 1, "math_attention": ((1, 16, 8), (4, 64, 8), (4, 16, 32))}
FULL = {"gemm_sizes": GEMM_SIZES, "gemm_max_flops": 5e9, "mem_sizes": MEM_SIZES,
        "optimizer": ((4, 2**12), (64, 2**12), (4, 2**18), (16, 2**18), (4, 2**20)), "gloo_sizes": SIZES, "repeats": 10,
        "passes": 3}


GEMM_LAYOUTS = ("nn", "nt", "tn")
"""Every GEMM shape is timed as A @ B, A @ Bᵀ and Aᵀ @ B: a linear's forward, input gradient and weight gradient
as Paddle's matmul_grad calls them (on this CPU the transposed ones ran up to 30% slower at the same shape)."""


def measure_tables(sizes: dict) -> dict:
    """The raw kernel tables of this process's device (measure.py), in fit.py's input layout."""
    from llmtrain.plan import measure

    host = measure.host_table()
    on_gpu = measure._on_gpu()
    passes = sizes.get("passes", 1)
    raw = {"gemm": measure.gemm_table(measure.grid(sizes["gemm_sizes"], sizes["gemm_max_flops"]),
                                      "bfloat16" if on_gpu else "float32", passes=passes,
                                      layouts=GEMM_LAYOUTS),
           "memory_bound": measure.memory_bound_table(sizes["mem_sizes"], "bfloat16" if on_gpu else "float32",
                                                      passes=passes),
           "optimizer": measure.optimizer_table(sizes["optimizer"], multi_precision=on_gpu),
           "host": ({"fwd_op_s": host["fwd_op_s"], "bwd_op_s": host["bwd_node_s"], "view_op_s": host["view_s"]}
                    if on_gpu else  # CPU: the tables hold one dispatch per op; add the autograd extras
                    {"fwd_op_s": host["fwd_extra_s"], "bwd_op_s": max(0.0, host["bwd_node_s"] - host["dispatch_s"]),
                     "view_op_s": host["view_s"], "dispatch_s": host["dispatch_s"]}),
           "host_measured": host}
    if not on_gpu:  # the math attention core as one composite op (flash attention on a GPU, below)
        raw["attention_math"] = measure.math_attention_table(sizes.get("math_attention", measure.MATH_ATTENTION))
    if on_gpu:
        raw["attention"] = measure.attention_table([(b, 32, 8, s, 128) for b, s in ((8, 1024), (4, 2048), (2, 4096), (1, 8192))]
                                                   + [(16, 16, 16, 1024, 64)])
    return raw


def cpu_base(peak: float, gloo: dict, load: float) -> dict:
    """The constants of the cpu-here profile (the tables come from fit.py)."""
    return {"name": "cpu-here", "peak_flops": peak, "memory_bytes": 8 * 2**30, "framework_bytes": 0, "dtype_bytes": 4,
            "async_launch": False, "tables_include_host": True,
            "links": {"nvlink_bw": gloo["collective_bw"], "net_bw": gloo["collective_bw"],
                      "nvlink_alpha": gloo["collective_alpha_busy"], "net_alpha": gloo["collective_alpha_busy"],
                      "p2p_bw": gloo["p2p_bw"], "p2p_alpha": gloo["p2p_alpha"],
                      "burst_alpha": gloo.get("collective_alpha", gloo["collective_alpha_busy"]),
                      "alpha_by_gap": gloo.get("alpha_by_gap") or None,
                      "reduce_call_s": gloo.get("reduce_call_s"), "broadcast_call_s": gloo.get("broadcast_call_s"),
                      "source": "gloo over loopback TCP, 2 processes, this host (calibrate.py)"},
            "source": f"python -m llmtrain.plan --calibrate on this host (load average {load:.1f})"}


def fit_gloo(measured: dict) -> dict:
    rows, busy = measured["rows"], measured["busy"]
    xs = [r["bytes"] for r in rows]
    # the fastest calls after a barrier: the transfer's own cost (the typical wait for a peer that is computing is
    # the busy alpha below, a mean); medians of a few calls per size were too noisy for the line (a negative slope)
    c0, c1 = fit_line(xs, [r["all_reduce_s"] for r in rows])
    if c1 <= 0 and len(rows) > 2:
        # gloo's all-reduce of the smallest message is at times slower than of 1 MiB (4 KiB: 3.3 ms against 0.7 ms,
        # every repeat of one calibration): the bandwidth from the larger sizes, the intercept still anchored there
        c0, c1 = fit_line(xs[1:], [r["all_reduce_s"] for r in rows[1:]])
    p0, p1 = fit_line(xs, [r["send_recv_s"] for r in rows])
    problems = [f"{what}: larger messages were not slower than the smallest (slope {v:.3g} s/byte): measurements {rows}"
                for what, v in (("all-reduce", c1), ("send/recv", p1)) if v <= 0]
    if problems:
        raise RuntimeError("; ".join(problems))
    # per-call latency of a collective between computing ranks: the busy call's mean minus its transfer time,
    # halved as alpha is for a 2-rank ring (never below the quiet alpha)
    alpha = lambda mean: max(c0 / 2, (mean - busy["bytes"] * c1) / 2)  # noqa: E731
    return {"collective_bw": 1.0 / c1, "collective_alpha": c0 / 2, "p2p_bw": 1.0 / p1, "p2p_alpha": p0,
            "collective_alpha_busy": alpha(busy["mean_s"]),
            "alpha_by_gap": sorted([r["gap_s"], alpha(r["mean_s"])] for r in busy.get("by_gap", [])),
            "reduce_call_s": measured.get("back_to_back", {}).get("reduce_s"),
            "broadcast_call_s": measured.get("back_to_back", {}).get("broadcast_s"),
            "busy_all_reduce": busy, "measurements": rows}


def gpu_base(gloo: dict | None) -> dict:
    """GPU only: the packaged profile matching this GPU's name, its tables replaced by the measured ones."""
    import paddle

    from llmtrain.plan.profile import _raw, datasheet_peak

    name = paddle.device.cuda.get_device_name()
    found = datasheet_peak(name)
    if found is None:
        raise RuntimeError(f"GPU {name!r} matches no packaged profile (llmtrain/plan/profiles/*.json `match`): add one "
                           "with its datasheet peak, memory and links, then calibrate")
    base = {k: v for k, v in _raw(found[1]).items() if k not in ("scaled_from", "scale", "gemm", "attention",
                                                                  "memory_bound", "host", "optimizer")}
    base.update({"async_launch": True, "tables_include_host": False,
                 "source": f"python -m llmtrain.plan --calibrate on {name}; peak, memory from the datasheet"})
    if gloo is not None:
        base["links"] = dict(base["links"], nvlink_bw=gloo["collective_bw"], nvlink_alpha=gloo["collective_alpha_busy"],
                             p2p_bw=gloo["p2p_bw"], p2p_alpha=gloo["p2p_alpha"],
                             source="NCCL in this node measured by --calibrate (2 processes); network: datasheet")
    return base


def _predict_loop_row(profile: dict, r: dict) -> tuple[float, int]:
    """(seconds the kernel tables of `profile` predict for one loop-table row, dispatches of one micro-batch): the
    planner's compute time of the row's model (`model`: its resolved config) on one process."""
    from math import prod

    from llmtrain.models.config import ModelConfig
    from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels
    from llmtrain.plan.params import model_param_specs
    from llmtrain.plan.profile import from_dict
    from llmtrain.plan.timeline import StepSpec, step_compute

    m, s, b, layers = r["micro_batches"], r["seq"], r["micro_batch"], r["layers"]
    model = ModelConfig(**r["model"])
    tensors = [(int(prod(x.shape)), 4) for x in model_param_specs(model) if not x.frozen]
    prof = from_dict(profile)
    micro = MicroBatchSpec(model, b, s, 1, prof.dtype_bytes, False, False, "none", layers,
                           math_core=prof.math_attn is not None,
                           ce_core="vocab_parallel_ce" in prof.mem_curves)
    pred = step_compute(prof, StepSpec(micro, m, tensors, tensors))["compute_s"]
    mb = micro_batch_kernels(MicroBatchSpec(model, b, s, 1, 4, False, False, "none", layers,
                                            math_core=bool(profile.get("attention_math", {}).get("fwd"))))
    return pred, len(mb.forward) + len(mb.backward)


def fit_loop(profile: dict, rows: list[dict]) -> dict:
    """The training loop's own host work from `measure.trainer_loop_table` rows: each row's measured step minus what `profile`'s kernel tables predict for the same
    step is fitted by least squares as
        step_s + micro_batches·micro_batch_s + micro_batches·ops·op_s
    (ops: the dispatches kernels.py counts for one micro-batch of that model), each coefficient kept
    non-negative (a negative one is dropped and the others refitted). Returns {step_s, micro_batch_s, op_s, rows}."""
    import numpy as np

    eqs, ys, out_rows = [], [], []
    for r in rows:
        pred, ops = _predict_loop_row(profile, r)
        m = r["micro_batches"]
        eqs.append([1.0, m, m * ops])
        ys.append(r["seconds"] - pred)
        out_rows.append({k: v for k, v in r.items() if k not in ("model", "overrides")}
                        | {"predicted_kernels_s": pred, "ops": ops})
    a, y = np.array(eqs), np.array(ys)
    keep = [0, 1, 2]
    while keep:
        coef = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            break
        keep = [k for k, c in zip(keep, coef) if c >= 0]
    full = [0.0, 0.0, 0.0]
    for k, c in zip(keep, coef if keep else []):
        full[k] = float(c)
    for r, e in zip(out_rows, eqs):
        r["fitted_s"] = r["predicted_kernels_s"] + sum(c * x for c, x in zip(full, e))
    return {"step_s": full[0], "micro_batch_s": full[1], "op_s": full[2], "rows": out_rows}


def add_loop(profile: dict, loop: dict, when: str) -> dict:
    """`profile` with the loop's own work in its host block (timeline.py reads `step_s` and `micro_batch_s`; the
    per-op share is added to every dispatch's host time) and the measurement beside it."""
    host = dict(profile["host"])
    host["kernel_tables_only"] = {k: host[k] for k in ("fwd_op_s", "bwd_op_s", "view_op_s")}
    for k in ("fwd_op_s", "bwd_op_s", "view_op_s"):
        host[k] = host[k] + loop["op_s"]
    host["step_s"], host["micro_batch_s"] = loop["step_s"], loop["micro_batch_s"]
    host["loop_source"] = (f"{loop['table']} ({when}): {loop['what']}; minus the kernel tables' prediction of the "
                           "same steps; least squares (calibrate.fit_loop)")
    return dict(profile, host=host, loop=loop)


def calibrate(out: str = "work/cpu-here.json", quick: bool = False) -> dict:
    """Measure, fit and write the profile of this process's device; returns it."""
    from llmtrain.plan.fit import fit_profile
    from llmtrain.plan.measure import _on_gpu, cpu_matmul_peak

    sizes = QUICK if quick else FULL
    t0, steps = time.time(), 4 if quick else 6

    def phase(k: int, what: str) -> None:  # minutes of measuring: say what runs now
        print(f"calibrate [{k}/{steps}] {what} ({time.time() - t0:.0f} s so far)", file=sys.stderr, flush=True)

    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load = os.getloadavg()[0]
    on_gpu = _on_gpu()
    gpus = 0
    if not on_gpu:  # time the kernels under the allocator the trainer runs with (cpu_backend.host_allocator)
        from llmtrain.paddle_compat.cpu_backend.host_allocator import keep_freed_memory

        keep_freed_memory()
    if on_gpu:
        import paddle

        gpus = paddle.device.cuda.device_count()
    phase(1, "collectives between 2 processes")
    gloo = fit_gloo(measure_gloo(sizes["gloo_sizes"], sizes["repeats"])) if (not on_gpu or gpus > 1) else None
    phase(2, "kernel tables: GEMMs, attention, memory-bound ops, host time per op, AdamW")
    raw = measure_tables(sizes)
    prov = {"summary": f"(Paddle {_paddle_version()} on this CPU, {when}, OMP_NUM_THREADS "
                       f"{os.environ.get('OMP_NUM_THREADS', '1')}, each op the median of three runs' mean call)",
            "measured_at": when, "load_average": load, "command": " ".join(["python -m llmtrain.plan"] + sys.argv[1:])}
    phase(3, "the matmul peak and the fit of the tables")
    base = gpu_base(gloo) if on_gpu else cpu_base(cpu_matmul_peak(), gloo, load)
    profile = fit_profile(raw, base, prov, split_layouts=True)
    if not on_gpu:  # the training loop's own work (on a GPU it overlaps the queued kernels: not measured here)
        from llmtrain.plan.measure import trainer_loop_table

        if not quick:  # the real Trainer, one process per run (--quick: not measured, the constants stay 0)
            phase(4, "the training loop's own work: the real Trainer on a tiny GPT, 9 runs")
            loop = dict(fit_loop(profile, trainer_loop_table()), table="measure.trainer_loop_table",
                        what="llmtrain/pretrain.py on a tiny GPT (h 32, seq 16, micro-batch 1; 1, 2 and 4 layers; 1, 2 "
                             "and 4 micro-batches per step) over random tokens, median step_time of steps 3-14")
            profile = add_loop(profile, loop, when)
            from llmtrain.plan.measure import shared_host_table

            # kernels while 2 processes compute at once (a 2-process CPU layout) against one alone
            phase(5, "kernels while 2 processes compute at once")
            profile["shared_host"] = dict(shared_host_table(), source=f"measure.shared_host_table ({when})")
    phase(steps, f"writing {out}")
    profile["measured_at"] = when
    profile["gloo"] = gloo
    profile["raw"] = {k: raw[k] for k in ("host_measured", "optimizer")}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(profile, indent=1))
    return profile


def _paddle_version() -> str:
    import paddle

    return paddle.__version__


def main(argv: list[str]) -> None:
    if "--out" in argv and argv.index("--out") + 1 >= len(argv):
        sys.exit("--out needs a path: python -m llmtrain.plan --calibrate --out PATH")
    out = argv[argv.index("--out") + 1] if "--out" in argv else "work/cpu-here.json"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    p = calibrate(out, quick="--quick" in argv)
    g = p["gloo"] or {"collective_bw": float("nan"), "collective_alpha": float("nan"),
                      "collective_alpha_busy": float("nan"), "p2p_bw": float("nan"), "p2p_alpha": float("nan")}
    print(f"{p['name']} calibrated -> {out}: peak {p['peak_flops'] / 1e9:.1f} GFLOP/s; {len(p['gemm']['rows'])} GEMM "
          f"shapes, {len(p['memory_bound']['classes'])} memory-bound classes, host {p['host']['fwd_op_s'] * 1e6:.1f} us "
          f"autograd extra per op; gloo all-reduce {g['collective_bw'] / 1e9:.3f} GB/s, alpha "
          f"{g['collective_alpha'] * 1e6:.0f} us (between computing ranks {g['collective_alpha_busy'] * 1e6:.0f} us); "
          f"send/recv {g['p2p_bw'] / 1e9:.3f} GB/s, alpha {g['p2p_alpha'] * 1e6:.0f} us (load average "
          f"{p['provenance']['load_average']:.1f})")


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], [int(s) for s in sys.argv[3].split(",")], int(sys.argv[4]))

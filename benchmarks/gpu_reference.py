"""GPU reference for the planner: kernel tables and whole training steps, measured with PyTorch.

    python benchmarks/gpu_reference.py --out DIR                   # where PyTorch and a CUDA GPU are present
    python benchmarks/gpu_reference.py --out DIR --only steps,attention --steps llama-1b-mb4
    python benchmarks/gpu_reference.py --out /tmp/smoke --smoke    # tiny shapes, runs on CPU too (logic check)
    python benchmarks/gpu_reference.py --out DIR --only host_model  # host time of the model's own code path

Writes, into DIR, one JSON file per table (gemm, attention, memory_bound, host, host_model, optimizer) and steps.json, each
with a top-level "provenance" (GPU, driver, CUDA, torch, date, command, timing method). Every file is rewritten
after each row, so a run stopped early leaves what it measured. PyTorch is an instrument here, never a dependency
of llmtrain (Paddle's GPU build cannot be installed on the machine we measure); the model twin and its training
step are in `benchmarks/gpu_model.py`, which says where its kernels differ from Paddle's.

Timing: device work is timed with CUDA events. Kernel tables: `--reps` (default 20) timed repetitions after
warm-up, median; a repetition is a CUDA graph of n back-to-back calls (n so that it lasts >= ~1 ms), operands
rotated over up to 64 copies so that small inputs do not sit in the 50 MB L2, time / n. Where a graph cannot be
captured (autograd), n eager calls back to back between two events (the row's "timing" says which). Steps:
`--warmup` (3) steps, then `--steps-n` (10) steps each timed on the host clock after torch.cuda.synchronize(),
median; tokens/s = micro_batch * seq / median step seconds; one more step under torch.profiler counts the kernels.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_model import Decoder, MasterAdamW, gpt, llama, make_batch, train_step  # noqa: E402

TABLES = ("host", "host_model", "optimizer", "attention", "memory_bound", "gemm_model", "steps", "gemm_grid",
          "steps_pass", "eager_floor", "attention_cudnn", "gemm_context", "views")
ROTATE_BYTES = 256 << 20  # rotate operand copies until they span this many bytes (L2 is 50 MB)

# steps.json rows: name -> (arch, micro_batch, recompute); issue 22's validation rows
STEP_ROWS = {}
for _mb in (1, 2, 4, 8):
    STEP_ROWS[f"llama-1b-mb{_mb}"] = (llama(22, 2048, 32, 4, 5632, 2048), _mb, False)
for _mb in (8, 2):
    STEP_ROWS[f"gpt-1024-mb{_mb}"] = (gpt(24, 1024, 16, 4096, 1024), _mb, False)
for _mb in (4, 1):
    STEP_ROWS[f"gpt-2048-mb{_mb}"] = (gpt(24, 2048, 16, 8192, 2048), _mb, False)
for _mb in (1, 2, 4):
    STEP_ROWS[f"llama-7b-8L-mb{_mb}"] = (llama(8, 4096, 32, 32, 11008, 4096), _mb, False)
STEP_ROWS["llama-7b-8L-mb4-recompute"] = (llama(8, 4096, 32, 32, 11008, 4096), 4, True)
STEP_ROWS["llama-7b-mb1"] = (llama(32, 4096, 32, 32, 11008, 4096), 1, False)
SMOKE_ROWS = {"llama-smoke-mb2": (llama(2, 64, 4, 2, 160, 32, vocab=256), 2, False),
              "llama-smoke-mb2-recompute": (llama(2, 64, 4, 2, 160, 32, vocab=256), 2, True),
              "gpt-smoke-mb2": (gpt(2, 64, 4, 256, 32, vocab=256), 2, False)}


class Bench:
    """Timing on one device, plus the JSON files of one output directory."""

    def __init__(self, args):
        self.args = args
        self.dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
        self.cuda = self.dev.type == "cuda"
        self.dtype = torch.bfloat16
        # every random operand comes from this generator: the default one is tied to the CUDA graphs captured
        # here (dropout), and drawing from it outside a capture then fails ("Offset increment outside graph
        # capture encountered unexpectedly", seen on torch 2.11)
        self.gen = torch.Generator(device=self.dev)
        self.gen.manual_seed(0)
        if self.cuda:  # flash attention only: SDPA must not fall back silently to another kernel
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_math_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.files: dict[str, dict] = {}
        os.makedirs(args.out, exist_ok=True)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def rows(self, name: str) -> list:
        if name not in self.files:
            self.files[name] = {"provenance": provenance(self), "rows": []}
        return self.files[name]["rows"]

    def add(self, name: str, row: dict, extra: dict | None = None):
        self.rows(name).append(row)
        if extra:
            self.files[name].update(extra)
        self.flush(name)

    def flush(self, name: str):
        path = os.path.join(self.args.out, f"{name}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.files[name], f, indent=1)
        os.replace(path + ".tmp", path)

    def time_calls(self, fns, graph: bool = True) -> tuple[float, str]:
        """Median seconds of one call, fns a list of equivalent callables over rotated operands."""
        reps = self.args.reps
        for fn in fns[:3]:
            fn()
        self.sync()
        t0 = time.perf_counter()
        fns[0]()
        self.sync()
        est = max(time.perf_counter() - t0, 1e-6)
        n = max(len(fns), int(1e-3 / est)) if est < 1e-3 else 1
        if est > 5e-3:  # long calls: fewer repetitions keep a sweep short, the median stays stable
            reps = max(10, reps // 2)
        seq = [fns[i % len(fns)] for i in range(n)]
        if not self.cuda:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for fn in seq:
                    fn()
                times.append((time.perf_counter() - t0) / n)
            return statistics.median(times), "host-clock"
        run, how = None, "events-eager"
        if graph:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for fn in fns[:3]:
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for fn in seq:
                        fn()
                g.replay()
                self.sync()
                run, how = g.replay, "events-cudagraph"
            except Exception as e:  # noqa: BLE001 - autograd and some ops refuse capture; eager timing below
                self.sync()
                how = f"events-eager (graph: {type(e).__name__})"
        if run is None:
            def run():
                for fn in seq:
                    fn()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / n)
        return statistics.median(times), how

    def copies(self, nbytes: int) -> int:
        """How many operand copies to rotate over so they span ROTATE_BYTES (at most 64)."""
        if not self.cuda:
            return 1
        return int(max(1, min(64, ROTATE_BYTES // max(nbytes, 1))))


def provenance(b: Bench) -> dict:
    p = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
         "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
         "host_cpu": cpu_model(), "host_cores": os.cpu_count(), "device": str(b.dev),
         "timing": (f"kernel tables: warm-up, then median of {b.args.reps} repetitions timed with CUDA events; a "
                    "repetition is a CUDA graph of n back-to-back calls (>= ~1 ms) over up to 64 rotated operand "
                    "copies, or n eager calls where no graph can be captured ('timing' per row); per-call seconds. "
                    f"steps: {b.args.warmup} warm-up steps, then {b.args.steps_n} steps timed on the host clock "
                    "after torch.cuda.synchronize(), median"),
         "smoke": bool(b.args.smoke), "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if b.cuda:
        prop = torch.cuda.get_device_properties(0)
        p.update(gpu=prop.name, sm_count=prop.multi_processor_count, gpu_mem_bytes=prop.total_memory,
                 driver=_smi("driver_version"), clocks_sm_max_mhz=_smi("clocks.max.sm"))
    return p


def _smi(field: str):
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def randn(b: Bench, *shape, dtype=None):
    return torch.randn(*shape, device=b.dev, dtype=dtype or b.dtype, generator=b.gen)


def randint(b: Bench, high: int, *shape):
    return torch.randint(0, high, shape, device=b.dev, generator=b.gen)


# ---------------------------------------------------------------- gemm
def gemm_row(b: Bench, m: int, n: int, k: int, layout: str, source: str) -> dict:
    """C[m, n] = A[m, k] @ B[k, n]; layout nn, nt (B stored [n, k]) or tn (A stored [k, m])."""
    copies = b.copies(2 * (m * k + k * n + m * n))
    ops = []
    for _ in range(copies):
        a = randn(b, k, m).t() if layout == "tn" else randn(b, m, k)
        bb = randn(b, n, k).t() if layout == "nt" else randn(b, k, n)
        c = torch.empty(m, n, device=b.dev, dtype=b.dtype)
        ops.append(lambda a=a, bb=bb, c=c: torch.mm(a, bb, out=c))
    sec, how = b.time_calls(ops)
    return {"m": m, "n": n, "k": k, "layout": layout, "dtype": "bf16", "seconds": sec,
            "tflops": 2 * m * n * k / sec / 1e12, "source": source, "timing": how}


def model_gemm_shapes(rows) -> list[tuple]:
    """The fwd (nn), input-grad (nt) and weight-grad (tn) GEMMs of every linear of the step rows."""
    shapes = []
    for a, mb, _ in rows.values():
        t = mb * a.seq
        for _, i, o in a.linears():
            shapes += [(t, o, i, "nn"), (t, i, o, "nt"), (i, o, t, "tn")]
    return sorted(set(shapes))


def run_gemm(b: Bench, which: str, rows: dict, deadline: float):
    if which == "gemm_model":
        shapes = [(*s, "model") for s in model_gemm_shapes(rows)]
    else:
        sizes = [2 ** i for i in range(8, 17)] if not b.args.smoke else [16, 64]
        cap = 3e13 if not b.args.smoke else 1e8
        sub = [256, 1024, 4096, 16384, 65536] if not b.args.smoke else [32]
        shapes = [(m, n, k, "nn", "grid") for m, n, k in itertools.product(sizes, sizes, sizes) if 2 * m * n * k <= cap]
        shapes += [(m, n, k, lay, "grid") for lay in ("nt", "tn") for m, n, k in itertools.product(sub, sub, sub)
                   if 2 * m * n * k <= cap]
        if b.args.grid_coarse_first:  # a time budget then cuts a uniform subsample: the 4^i shapes first
            shapes.sort(key=lambda r: sum(int(math.log2(x)) % 2 for x in r[:3]))
    for m, n, k, lay, src in shapes:
        if time.time() > deadline:
            b.add("gemm", {"note": f"{which}: time budget spent, {len(shapes)} shapes planned"})
            return
        if b.args.smoke:
            m, n, k = max(16, m // 256), max(16, n // 256), max(16, k // 256)
        b.add("gemm", gemm_row(b, m, n, k, lay, src))
        torch.cuda.empty_cache() if b.cuda else None


# ---------------------------------------------------------------- attention
def attention_cases(b: Bench, configs, seqs, deadline: float):
    """((batch, heads, kv_heads, head_dim, seq), (q, k, v)) for every config x seq with batch·seq <= 32768, until
    the deadline; q [b, nh, s, d], k/v [b, nkv, s, d], requiring grad."""
    for (bs, nh, nkv, d), s in itertools.product(configs, seqs):
        if time.time() > deadline:
            return
        if bs * s > 32768:
            continue
        yield (bs, nh, nkv, d, s), tuple(randn(b, bs, n, s, d).requires_grad_(True) for n in (nh, nkv, nkv))


def time_attention(b: Bench, row: dict, fwd, inputs, flops: float) -> None:
    """Fill `row` with the forward's and the backward's (autograd.grad over the kept forward) median seconds and
    TFLOP/s (`flops` of the forward; the backward counted as 2.5x), or with the error that stopped them."""
    try:
        out = fwd()
        dout = randn(b, *out.shape, dtype=out.dtype)
        row["fwd_s"], row["timing"] = b.time_calls([fwd], graph=False)
        grad = lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)  # noqa: E731
        row["bwd_s"], _ = b.time_calls([grad], graph=False)
        row["fwd_tflops"] = flops / row["fwd_s"] / 1e12
        row["bwd_tflops"] = 2.5 * flops / row["bwd_s"] / 1e12
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        row["error"] = f"{type(e).__name__}: {e}"[:300]


def run_attention(b: Bench, deadline: float):
    """Causal flash attention (SDPA) fwd and bwd; q [b, nh, s, d], k/v [b, nkv, s, d]."""
    configs = [(1, 32, 32, 128), (4, 32, 32, 128), (1, 32, 4, 128), (2, 16, 16, 128), (8, 16, 16, 64), (4, 32, 32, 64)]
    seqs = [512, 1024, 2048, 4096, 8192]
    if b.args.smoke:
        configs, seqs = [(1, 4, 2, 16), (2, 4, 4, 8)], [32, 64]
    for (bs, nh, nkv, d, s), (q, k, v) in attention_cases(b, configs, seqs, deadline):
        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)

        row = {"batch": bs, "heads": nh, "kv_heads": nkv, "seq": s, "head_dim": d, "causal": True,
               "impl": "flash (torch SDPA, only the flash backend enabled)" if b.cuda else "sdpa-cpu"}
        time_attention(b, row, fwd, (q, k, v), 4 * bs * nh * s * s * d / 2)  # causal: half of QK^T and PV
        b.add("attention", row, {"flops_note": "fwd 4*b*nh*s^2*d/2 (causal half), bwd 2.5x fwd"})
        del q, k, v


# ---------------------------------------------------------------- memory-bound
def memory_ops(b: Bench, numel: int):
    """name -> (make(): callable over fresh operands, bytes_read, bytes_written, kernels note), rows of width h."""
    h = 4096 if numel >= 4096 * 8 else 64
    rows = numel // h
    n = rows * h
    dt = b.dtype

    def x16(): return randn(b, rows, h)  # noqa: E704

    def autograd(f, *shapes):  # backward of f, timed as autograd.grad over the kept forward
        def make():
            ins = [randn(b, *s).requires_grad_(True) for s in shapes]
            y = f(*ins)
            dy = randn(b, *y.shape, dtype=y.dtype)
            return lambda: torch.autograd.grad(y, ins, dy, retain_graph=True)
        return make

    w = torch.ones(h, device=b.dev, dtype=dt)
    bias = torch.zeros(h, device=b.dev, dtype=dt)
    rope_cos = randn(b, 1, rows, 1, 128) if h >= 128 else None
    table = randn(b, 32000, h)  # one word table shared by the embedding copies
    ops = {
        "copy": (lambda: (lambda x=x16(), y=x16(): y.copy_(x)), 2 * n, 2 * n),
        "add": (lambda: (lambda x=x16(), y=x16(), z=x16(): torch.add(x, y, out=z)), 4 * n, 2 * n),
        "mul": (lambda: (lambda x=x16(), y=x16(), z=x16(): torch.mul(x, y, out=z)), 4 * n, 2 * n),
        "cast_bf16_fp32": (lambda: (lambda x=x16(), y=randn(b, rows, h, dtype=torch.float32): y.copy_(x)), 2 * n, 4 * n),
        "cast_fp32_bf16": (lambda: (lambda x=randn(b, rows, h, dtype=torch.float32), y=x16(): y.copy_(x)), 4 * n, 2 * n),
        "rmsnorm_fwd": (lambda: (lambda x=x16(): F.rms_norm(x, (h,), w, 1e-5)), 2 * n, 2 * n),
        "rmsnorm_bwd": (autograd(lambda x, ww: F.rms_norm(x, (h,), ww, 1e-5), (rows, h), (h,)), 4 * n, 2 * n),
        "layernorm_fwd": (lambda: (lambda x=x16(): F.layer_norm(x, (h,), w, bias, 1e-5)), 2 * n, 2 * n),
        "layernorm_bwd": (autograd(lambda x, ww, bb: F.layer_norm(x, (h,), ww, bb, 1e-5), (rows, h), (h,), (h,)),
                          4 * n, 2 * n),
        "silu_mul_fwd": (lambda: (lambda g=x16(), u=x16(): F.silu(g) * u), 4 * n, 2 * n),
        "silu_mul_bwd": (autograd(lambda g, u: F.silu(g) * u, (rows, h), (rows, h)), 6 * n, 4 * n),
        "gelu_tanh_fwd": (lambda: (lambda x=x16(): F.gelu(x, approximate="tanh")), 2 * n, 2 * n),
        "gelu_tanh_bwd": (autograd(lambda x: F.gelu(x, approximate="tanh"), (rows, h)), 4 * n, 2 * n),
        "dropout_fwd": (lambda: (lambda x=x16(): F.dropout(x, 0.1, True)), 2 * n, 3 * n),
        "embedding_fwd": (lambda: (lambda ids=randint(b, 32000, rows): F.embedding(ids, table)),
                          2 * n, 2 * n),
    }
    if rope_cos is not None and rows >= 1:
        heads = h // 128

        def rope(x, cos=rope_cos):  # x [1, rows, heads, 128] rotate-half, as gpu_model.Decoder.rope
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat([-x2, x1], dim=-1) * cos
        ops["rope_fwd"] = (lambda: (lambda x=randn(b, 1, rows, heads, 128): rope(x)), 2 * n, 2 * n)
    vocab = 32000
    tokens = max(1, n // vocab)
    ce_n = tokens * vocab

    def ce(lg, t=randint(b, vocab, tokens)):
        return F.cross_entropy(lg.float(), t, reduction="none").sum()
    ops["cross_entropy_fwd"] = (lambda: (lambda lg=randn(b, tokens, vocab): ce(lg)), 2 * ce_n, 0, ce_n)

    def ce_bwd():
        lg = randn(b, tokens, vocab).requires_grad_(True)
        y = ce(lg)
        return lambda: torch.autograd.grad(y, [lg], retain_graph=True)
    ops["cross_entropy_bwd"] = (ce_bwd, 2 * ce_n, 2 * ce_n, ce_n)
    return {k: (v[0], v[1], v[2], v[3] if len(v) > 3 else n) for k, v in ops.items()}


def run_memory_bound(b: Bench, deadline: float):
    sizes = [2 ** i for i in range(16, 32, 2)] + [2 ** 31]  # bytes of one bf16 input: 64 KiB .. 2 GiB
    if b.args.smoke:
        sizes = [2 ** 16, 2 ** 18]
    for nbytes in sizes:
        for op, (make, rd, wr, numel) in memory_ops(b, nbytes // 2).items():
            if time.time() > deadline:
                return
            row = {"op": op, "numel": numel, "dtype": "bf16", "bytes_read": rd, "bytes_written": wr}
            try:
                fns = [make() for _ in range(b.copies(rd + wr))]
                row["seconds"], row["timing"] = b.time_calls(fns)
                row["gbps"] = (rd + wr) / row["seconds"] / 1e9
                del fns
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            b.add("memory_bound", row, {"bytes_note": "bytes_read/written: the fewest bytes the op must move (each "
                                                      "input read once, output written once); numel: elements of "
                                                      "one input ([rows, 4096]; cross entropy: tokens x 32000)"})
            if b.cuda:
                torch.cuda.empty_cache()


# ---------------------------------------------------------------- host
def run_host(b: Bench):
    """Host seconds per eager op (tiny tensors: the GPU never waits on data), forward-only and forward+backward."""
    calls = 2000 if not b.args.smoke else 50
    x = randn(b, 8, 64)
    w = randn(b, 64, 64)
    nw = torch.ones(64, device=b.dev, dtype=b.dtype)
    ops = {"add": lambda t: t + 1, "mul": lambda t: t * x, "matmul": lambda t: t @ w,
           "rms_norm": lambda t: F.rms_norm(t, (64,), nw, 1e-5), "layer_norm": lambda t: F.layer_norm(t, (64,)),
           "silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
           "cat_split": lambda t: torch.cat([t, t], -1)[..., :64]}
    for name, f in ops.items():
        for _ in range(20):
            f(x)
        b.sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            f(x)
        b.sync()
        fwd = (time.perf_counter() - t0) / calls
        chain = 100
        xs = x.clone().requires_grad_(True)

        def fb():
            y = xs
            for _ in range(chain):
                y = f(y)
            y.float().sum().backward()
        fb()
        b.sync()
        t0 = time.perf_counter()
        reps = max(2, calls // chain)
        for _ in range(reps):
            fb()
        b.sync()
        both = (time.perf_counter() - t0) / (reps * chain)
        b.add("host", {"kind": "eager_op", "op": name, "fwd_s_per_op": fwd, "fwd_bwd_s_per_op": both,
                       "shape": [8, 64]})
    # the GPU's own floor for back-to-back tiny kernels (no host in the way): a CUDA graph of tiny adds
    if b.cuda:
        y = x.clone()
        fns = [lambda: y.add_(1.0)] * 200
        sec, how = b.time_calls(fns)
        b.add("host", {"kind": "kernel_floor_gpu", "op": "add_ tiny", "seconds_per_kernel": sec, "timing": how})
    # the host's eager launch floor: one tiny in-place add, no allocation
    y = x.clone()
    b.sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        y.add_(1.0)
    b.sync()
    b.add("host", {"kind": "eager_launch_floor", "op": "add_ tiny in place", "seconds_per_op": (time.perf_counter() - t0) / calls})
    # optimizer.step() per parameter tensor (tiny tensors: host-bound)
    for count in (16, 128, 1024) if not b.args.smoke else (4, 16):
        params = [randn(b, 64).requires_grad_(True) for _ in range(count)]
        for p in params:
            p.grad = randn(b, *p.shape)
        opt = MasterAdamW(params)
        sec = _wall(b, opt.step, 10 if not b.args.smoke else 3)
        b.add("host", {"kind": "optimizer_step_tiny_tensors", "tensors": count, "seconds": sec,
                       "seconds_per_tensor": sec / count})


# ---------------------------------------------------------------- host time of the model's code path
HOST_MODEL_LAYERS = (1, 2, 4, 8, 16)


def host_model_rows(smoke: bool) -> dict:
    """host_model.json rows: name -> (arch, micro_batch, recompute); tiny shapes (h 64, seq 16, vocab 256) where
    every kernel is far shorter than its dispatch, so the wall time of a synchronised pass is the host's."""
    layers = (1, 2) if smoke else HOST_MODEL_LAYERS
    rows = {}
    for n in layers:
        rows[f"llama-L{n}"] = (llama(n, 64, 4, 2, 160, 16, vocab=256), 1, False)
        rows[f"gpt-L{n}"] = (gpt(n, 64, 4, 256, 16, vocab=256), 1, False)
    for n in layers[:3:2] if smoke else (2, 8):
        rows[f"llama-L{n}-recompute"] = (llama(n, 64, 4, 2, 160, 16, vocab=256), 1, True)
    big = 2 if smoke else 4  # shape check: the same code path at a larger micro-batch and sequence
    rows[f"llama-L{big}-mb4-s64"] = (llama(big, 64, 4, 2, 160, 64, vocab=256), 4, False)
    rows[f"gpt-L{big}-mb4-s64"] = (gpt(big, 64, 4, 256, 64, vocab=256), 4, False)
    return rows


def run_host_model(b: Bench, deadline: float):
    """Host seconds of the model twin's own code path (benchmarks/gpu_model.py) at tiny shapes, per pass: the
    forward with the loss (autograd recording), forward + backward, the optimizer step, and the whole training
    step, each synchronised and timed on the host clock (median of `reps` after warm-up), for 1-16 layers of each
    family: the slope over layers is a block's host time, the intercept the embedding, head and loss. Two sweeps
    (a second process-internal repeat) say how steady the host is."""
    reps = 30 if not b.args.smoke else 3
    rows = host_model_rows(b.args.smoke)
    for sweep in (1, 2):
        for name, (a, mb, recompute) in rows.items():
            if time.time() > deadline:
                return
            model = Decoder(a, b.dev, b.dtype, recompute, generator=b.gen)
            opt = MasterAdamW(model.parameters())
            batch = make_batch(a, mb, b.dev, b.gen)

            def fwd():
                model(*batch)

            def fwd_bwd():
                model(*batch).backward()

            row = {"name": name, "sweep": sweep, "arch": a.as_dict(), "micro_batch": mb, "recompute": recompute,
                   "tensors": len(list(model.parameters())),
                   "fwd_s": _wall(b, fwd, reps, warm=5), "fwd_bwd_s": _wall(b, fwd_bwd, reps, warm=5),
                   "opt_s": _wall(b, opt.step, reps, warm=3),
                   "step_s": _wall(b, lambda: train_step(model, opt, batch), reps, warm=3)}
            if b.cuda:  # the GPU's own busy time of one training step (it must be far below step_s)
                row.update({f"gpu_{k}": v for k, v in profile_step(b, model, opt, batch).items()})
            b.add("host_model", row, {"notes": "seconds per pass on the host clock after a synchronize, median of "
                                               f"{reps}; tiny shapes (the GPU idles between kernels): host time of "
                                               "the code path. fwd_s: forward with the loss; fwd_bwd_s: forward + "
                                               "backward (grads accumulate into existing buffers, as in a step "
                                               "after the first); opt_s: MasterAdamW.step (clip, AdamW, zeroing); "
                                               "step_s: train_step"})
            print(f"[host_model] {name} sweep {sweep}: fwd {row['fwd_s'] * 1e3:.2f} ms, fwd+bwd "
                  f"{row['fwd_bwd_s'] * 1e3:.2f} ms, opt {row['opt_s'] * 1e3:.2f} ms, step {row['step_s'] * 1e3:.2f} ms"
                  + (f", gpu busy {row.get('gpu_kernel_time_s', 0) * 1e3:.2f} ms, kernels {row.get('gpu_kernels_per_step')}"
                     if b.cuda else ""), flush=True)
            del model, opt


def _wall(b: Bench, fn, reps: int, warm: int = 2) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        b.sync()
        t0 = time.perf_counter()
        fn()
        b.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------- optimizer
def run_optimizer(b: Bench, deadline: float):
    sizes = [10 ** 6, 10 ** 7, 10 ** 8, 10 ** 9] if not b.args.smoke else [10 ** 3, 10 ** 4]
    for total, count in itertools.product(sizes, (1, 16, 256)):
        if time.time() > deadline:
            return
        per = total // count
        params = [randn(b, per).requires_grad_(True) for _ in range(count)]
        for p in params:
            p.grad = randn(b, *p.shape)
        opt = MasterAdamW(params)
        grads = [p.grad for p in params]
        norm = lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)  # noqa: E731

        def adamw():
            for c, masters, o in zip(opt.chunks, opt.masters, opt.opts):
                torch._foreach_copy_([m.grad for m in masters], [p.grad for p in c])
                o.step()
                torch._foreach_copy_([p.data for p in c], masters)
        reps = 10 if not b.args.smoke else 3
        row = {"params": per * count, "tensors": count, "chunks": len(opt.chunks),
               "clip_s": _wall(b, norm, reps), "adamw_s": _wall(b, adamw, reps),
               "zero_grad_s": _wall(b, lambda: torch._foreach_zero_(grads), reps)}
        row["step_s"] = _wall(b, opt.step, reps)
        row["note"] = ("step_s = clip (fp32 norm of bf16 grads, scale) + per chunk [bf16 grads -> fp32 buffer, fused "
                       "AdamW on fp32 masters, masters -> bf16 weights] + zero the bf16 grads; 40 bytes/param moved by "
                       "adamw_s (Paddle's fused multi-precision kernel: 28)")
        b.add("optimizer", row)
        del params, opt, grads
        if b.cuda:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- steps
def count_params(model, a) -> dict:
    total = sum(p.numel() for p in model.parameters())
    embed = model.word.numel() + (model.pos.numel() if model.pos is not None else 0)
    n = total - embed + (model.word.numel() if a.tie_embeddings else 0)  # the output projection counts, tied or not
    return {"params": total, "params_for_flops": n,
            "model_flops_per_token": 6 * n + 12 * a.layers * a.hidden * a.seq}


def profile_step(b: Bench, model, opt, batch) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if b.cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        train_step(model, opt, batch)
        b.sync()
    dev = torch.autograd.DeviceType.CUDA if b.cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == dev]
    busy = sum(e.device_time_total if b.cuda else 0 for e in events) / 1e6
    return {"kernels_per_step": len(events), "kernel_time_s": busy if b.cuda else None}


def run_steps(b: Bench, rows: dict, deadline: float):
    for name, (a, mb, recompute) in rows.items():
        if time.time() > deadline:
            b.add("steps", {"name": name, "error": "time budget spent before this row"})
            continue
        row = {"name": name, "arch": a.as_dict(), "micro_batch": mb, "recompute": recompute}
        model = opt = None
        try:
            if b.cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            model = Decoder(a, b.dev, b.dtype, recompute, generator=b.gen)
            opt = MasterAdamW(model.parameters())
            row.update(count_params(model, a))
            batch = make_batch(a, mb, b.dev, b.gen)
            losses = []
            for _ in range(b.args.warmup):
                losses.append(float(train_step(model, opt, batch)))
            times = []
            for _ in range(b.args.steps_n):
                b.sync()
                t0 = time.perf_counter()
                loss = train_step(model, opt, batch)
                b.sync()
                times.append(time.perf_counter() - t0)
            losses.append(float(loss))
            med = statistics.median(times)
            row.update(step_s_median=med, step_s=times, tokens_per_s=mb * a.seq / med, losses=losses)
            row["mfu_989"] = row["tokens_per_s"] * row["model_flops_per_token"] / 989e12
            if b.cuda:
                row["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
                row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
            if not b.args.no_profile:
                row.update(profile_step(b, model, opt, batch))
        except Exception as e:  # noqa: BLE001 - an out-of-memory row is recorded, the others still run
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        del model, opt
        b.add("steps", row, {"notes": "tokens = micro_batch x seq (fully packed); model_flops_per_token = 6N + "
                                      "12 L h s (N without the input embedding, output projection counted; causal "
                                      "attention not halved); mfu_989 against 989 TFLOP/s bf16 dense"})
        print(f"[steps] {name}: " + (row.get("error") or
              f"{row['tokens_per_s']:.0f} tok/s, {row['step_s_median'] * 1e3:.1f} ms, MFU {row['mfu_989']:.3f}, "
              f"peak {row.get('peak_mem_bytes', 0) / 2**30:.1f} GiB, kernels {row.get('kernels_per_step')}"), flush=True)


# ---------------------------------------------------------------- steps, one pass of every row (re-measurement)
def step_phases(model, opt, batch, sync) -> dict:
    """One training step with host timestamps at its phase boundaries, no synchronisation inside: `fwd_host_s`,
    `bwd_host_s`, `opt_host_s` are how long the host took to dispatch each phase (it blocks only where the
    stream forces it), `step_s` the wall time to the end of the device work."""
    sync()
    t0 = time.perf_counter()
    loss = model(*batch)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    sync()
    t4 = time.perf_counter()
    return {"fwd_host_s": t1 - t0, "bwd_host_s": t2 - t1, "opt_host_s": t3 - t2, "step_s": t4 - t0}


def classify_kernel(name: str) -> str:
    """Kernel category of a CUDA kernel name (PyTorch 2.11 / cuBLAS 13 / flash attention 2 names)."""
    n = name.lower()
    if "flash" in n or "fmha" in n or "cudnn" in n and "attn" in n:
        return "attn_bwd" if "bwd" in n or "backward" in n else "attn_fwd"
    if any(t in n for t in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "splitk")):
        return "gemm"
    if "multi_tensor_apply" in n or "fused_adam" in n:
        return "multi_tensor"
    if "memcpy" in n:
        return "memcpy"
    if "memset" in n:
        return "memset"
    if "norm" in n and "multi_tensor" not in n:
        return "norm"
    if "softmax" in n or "nll_loss" in n or "cross_entropy" in n:
        return "loss"
    if "reduce" in n:
        return "reduce"
    if "cat" in n and "batched" in n:
        return "cat"
    if "index" in n or "embedding" in n or "scatter" in n or "gather" in n:
        return "index"
    if "elementwise" in n or "fill" in n or "copy" in n:
        return "elementwise"
    return "other"


def profiled_step(b: Bench, model, opt, batch):
    """One training step under torch.profiler (CPU and CUDA activities, input shapes), its forward, backward and
    optimizer inside `phase_forward` / `phase_backward` / `phase_optimizer` ranges; returns the profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.cuda else [])
    with profile(activities=acts, record_shapes=True) as prof:
        with record_function("phase_forward"):
            loss = model(*batch)
        with record_function("phase_backward"):
            loss.backward()
        with record_function("phase_optimizer"):
            opt.step()
        b.sync()
    return prof


def profile_step_detail(b: Bench, model, opt, batch) -> dict:
    """One step under torch.profiler (CPU and CUDA): kernels grouped by name (count, device seconds, median
    seconds, category), by category, and by (aten op, input shapes) with the kernels each launches."""
    prof = profiled_step(b, model, opt, batch)
    events = prof.events()
    dev = torch.autograd.DeviceType.CUDA
    # device-side events that are not kernels: the record_function ranges above and the optimizer's own
    # "Optimizer.step#..." range appear as GPU user annotations spanning their kernels (left out here)
    kernels = [e for e in events if e.device_type == dev and not e.name.startswith(("phase_", "Optimizer."))] \
        if b.cuda else []
    by_name: dict[str, list] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time_total / 1e6)
    names = [{"name": k[:300], "category": classify_kernel(k), "count": len(v), "seconds": sum(v),
              "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)}
             for k, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))]
    cats: dict[str, dict] = {}
    for r in names:
        c = cats.setdefault(r["category"], {"count": 0, "seconds": 0.0})
        c["count"] += r["count"]
        c["seconds"] += r["seconds"]
    # device time and kernel count per phase, from the kernels' start times inside the phases' host ranges is not
    # exact (the device lags); the aten-op table below attributes kernels to the op that launched them instead
    ops = []
    for a in prof.key_averages(group_by_input_shape=True):
        self_dev = getattr(a, "self_device_time_total", getattr(a, "self_cuda_time_total", 0))
        ops.append({"op": a.key, "shapes": str(a.input_shapes)[:400], "count": a.count,
                    "self_device_s": self_dev / 1e6, "self_cpu_s": a.self_cpu_time_total / 1e6,
                    "cpu_s": a.cpu_time_total / 1e6})
    ops.sort(key=lambda r: -r["self_device_s"])
    phases = {}
    for e in events:
        if e.name.startswith("phase_") and e.device_type == torch.autograd.DeviceType.CPU:
            phases[e.name] = {"cpu_s": e.cpu_time_total / 1e6}
    return {"kernels_per_step": len(kernels), "kernel_time_s": sum(e.device_time_total for e in kernels) / 1e6,
            "categories": cats, "kernels_by_name": names, "ops": ops[:600], "ops_total": len(ops),
            "phases_profiled_host": phases}


def run_steps_pass(b: Bench, rows: dict, deadline: float):
    """One pass over the step rows (llama-7b-mb1 first, in a fresh process it fits): per row a fresh model,
    `--warmup` steps, then `--steps-n` steps with the host's dispatch time per phase (`step_phases`); with
    `--profile`, one more step under torch.profiler into step_profile.json."""
    import gc

    order = sorted(rows, key=lambda n: n != "llama-7b-mb1")
    fname = f"steps_pass{b.args.pass_id}"
    for name in order:
        a, mb, recompute = rows[name]
        if time.time() > deadline:
            b.add(fname, {"name": name, "error": "time budget spent before this row"})
            continue
        row = {"name": name, "pass": b.args.pass_id, "arch": a.as_dict(), "micro_batch": mb, "recompute": recompute}
        model = opt = None
        try:
            gc.collect()
            if b.cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            model = Decoder(a, b.dev, b.dtype, recompute, generator=b.gen)
            opt = MasterAdamW(model.parameters())
            row["tensors"] = len(opt.params)
            batch = make_batch(a, mb, b.dev, b.gen)
            for _ in range(b.args.warmup):
                train_step(model, opt, batch)
            ph = [step_phases(model, opt, batch, b.sync) for _ in range(b.args.steps_n)]
            row["steps"] = ph
            row["step_s"] = [p["step_s"] for p in ph]
            row["step_s_median"] = statistics.median(row["step_s"])
            for k in ("fwd_host_s", "bwd_host_s", "opt_host_s"):
                row[k + "_median"] = statistics.median(p[k] for p in ph)
            if b.cuda:
                row["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            if b.args.profile:
                detail = profile_step_detail(b, model, opt, batch)
                row["kernels_per_step"], row["kernel_time_s"] = detail["kernels_per_step"], detail["kernel_time_s"]
                b.add("step_profile", {"name": name, "arch": a.as_dict(), "micro_batch": mb, "recompute": recompute,
                                       **detail},
                      {"notes": "one training step under torch.profiler (CPU+CUDA activities, record_shapes): "
                                "kernels_by_name (count, device seconds; category by classify_kernel), categories, "
                                "ops = key_averages(group_by_input_shape=True) sorted by self device time (first "
                                "600), phases_profiled_host = the record_function ranges' CPU time (profiler "
                                "overhead included)"})
        except Exception as e:  # noqa: BLE001 - recorded, the other rows still run
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        del model, opt
        b.add(fname, row, {"notes": "one pass of every row in a fresh process; the three passes interleave the rows "
                                    "so drift hits all alike. steps: per timed step the host's dispatch seconds of "
                                    "forward (with loss), backward, optimizer step (no synchronisation inside the "
                                    "step) and the wall step_s (synchronised before and after)"})
        print(f"[steps_pass {b.args.pass_id}] {name}: " + (row.get("error") or
              f"{row['step_s_median'] * 1e3:.1f} ms (host fwd {row['fwd_host_s_median'] * 1e3:.1f} bwd "
              f"{row['bwd_host_s_median'] * 1e3:.1f} opt {row['opt_host_s_median'] * 1e3:.1f} ms)"
              + (f", kernels {row.get('kernels_per_step')} busy {row.get('kernel_time_s', 0) * 1e3:.1f} ms"
                 if b.args.profile else "")), flush=True)


# ---------------------------------------------------------------- eager floor: small kernels back to back
def run_eager_floor(b: Bench, deadline: float):
    """Device seconds per kernel of eager small kernels launched back to back while the GPU is still busy with a
    long GEMM (the host is far ahead, so the queue is full): CUDA events around the small kernels only. Ops: an
    in-place add, a fill (zero_), a bf16->fp32 cast, an add of two tensors, at 2^8..2^24 elements; and the host's
    dispatch seconds per call of the same loop (host clock, no synchronisation)."""
    if not b.cuda:
        sizes = [256, 4096]
    else:
        sizes = [2 ** i for i in (8, 12, 16, 18, 20, 22, 24)]
    big = randn(b, 8192, 8192) if b.cuda else randn(b, 64, 64)
    n = 400 if b.cuda else 20
    for numel in sizes:
        if time.time() > deadline:
            return
        x, y = randn(b, numel), randn(b, numel)
        out32 = torch.empty(numel, device=b.dev, dtype=torch.float32)
        ops = {"add_inplace": lambda: x.add_(1.0), "fill_zero": lambda: y.zero_(),
               "cast_bf16_fp32": lambda: out32.copy_(x), "add": lambda: x + y}
        for op, fn in ops.items():
            for _ in range(5):
                fn()
            times, hosts = [], []
            for _ in range(5):
                b.sync()
                for _ in range(3):
                    big @ big  # ~2 ms each on an H200: the queue fills behind them
                e0, e1 = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if b.cuda else (None, None)
                if b.cuda:
                    e0.record()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                hosts.append((time.perf_counter() - t0) / n)
                if b.cuda:
                    e1.record()
                    e1.synchronize()
                    times.append(e0.elapsed_time(e1) / 1e3 / n)
                b.sync()
            b.add("eager_floor", {"op": op, "numel": numel, "dtype": "bf16",
                                  "device_s_per_kernel": statistics.median(times) if times else None,
                                  "host_s_per_call": statistics.median(hosts)},
                  {"notes": "eager kernels back to back behind three 8192^3 GEMMs (host ahead of the device): "
                            "device_s_per_kernel = CUDA events around n calls / n (gaps between kernels included); "
                            "host_s_per_call = host clock of the n dispatches / n; median of 5"})


# ---------------------------------------------------------------- attention through cuDNN
def run_attention_cudnn(b: Bench, deadline: float):
    """Flash attention through cuDNN (SDPA with only the cuDNN backend), causal and not, head dim 128 and 64,
    bf16, seq 1024..8192; rows in attention.json's format with impl "cudnn"."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    configs = [(1, 32, 32, 128), (4, 32, 32, 128), (1, 32, 8, 128), (2, 16, 16, 128), (8, 16, 16, 64), (4, 32, 32, 64)]
    seqs = [1024, 2048, 4096, 8192]
    if b.args.smoke:
        configs, seqs = [(1, 4, 4, 16)], [32]
    backend = SDPBackend.CUDNN_ATTENTION if b.cuda else SDPBackend.MATH
    cases = ((case, causal) for case in attention_cases(b, configs, seqs, deadline) for causal in (True, False))
    for ((bs, nh, nkv, d, s), (q, k, v)), causal in cases:  # lazily: one case's tensors at a time
        def fwd():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=nkv != nh)

        row = {"batch": bs, "heads": nh, "kv_heads": nkv, "seq": s, "head_dim": d, "causal": causal,
               "impl": "cudnn" if b.cuda else "sdpa-cpu-math"}
        time_attention(b, row, fwd, (q, k, v), 4 * bs * nh * s * s * d / (2 if causal else 1))
        b.add("attention_cudnn", row, {"flops_note": "fwd 4*b*nh*s^2*d (halved when causal), bwd 2.5x fwd; SDPA "
                                                     "under sdpa_kernel(SDPBackend.CUDNN_ATTENTION)"})
        del q, k, v


# ---------------------------------------------------------------- GEMMs: isolated vs as a step runs them
def run_gemm_context(b: Bench, rows: dict, deadline: float):
    """The model GEMM shapes timed four ways, to tell why the isolated table (gemm.json: CUDA graphs of
    back-to-back calls over N(0, 1) operands) differs from the same GEMMs inside a step: `graph_randn` (as
    gemm.json), `graph_weights` (same, the weight operand N(0, 0.02) as the model's), `eager_between`
    (one call between CUDA events, each after a ~0.2 ms memory-bound kernel, as GEMMs sit between other kernels
    in a step; N(0, 1)), `eager_between_weights` (that with the weight operand N(0, 0.02)). Median of --reps."""
    shapes = model_gemm_shapes(rows)
    fill = randn(b, 64 << 20 if b.cuda else 1024)  # 128 MiB: ~0.06 ms per pass on an H200
    for m, n, k, lay in shapes:
        if time.time() > deadline:
            b.add("gemm_context", {"note": f"time budget spent, {len(shapes)} shapes planned"})
            return
        if b.args.smoke:
            m, n, k = max(16, m // 256), max(16, n // 256), max(16, k // 256)
        row = {"m": m, "n": n, "k": k, "layout": lay, "dtype": "bf16"}
        for scale, tag in ((1.0, "randn"), (0.02, "weights")):
            a = randn(b, k, m).t() if lay == "tn" else randn(b, m, k)
            # the weight operand: B for nn/nt (x @ W, dy @ W^T), the other for tn (x^T @ dy: both activations)
            w = (randn(b, n, k).t() if lay == "nt" else randn(b, k, n)) * (scale if lay != "tn" else 1.0)
            c = torch.empty(m, n, device=b.dev, dtype=b.dtype)
            fn = lambda a=a, w=w, c=c: torch.mm(a, w, out=c)  # noqa: E731
            sec, how = b.time_calls([fn])
            row[f"graph_{tag}_s"] = sec
            times = []
            for _ in range(b.args.reps):
                for _ in range(3):
                    fill.mul_(1.0)
                if b.cuda:
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    fn()
                    e1.record()
                    for _ in range(3):
                        fill.mul_(1.0)
                    e1.synchronize()
                    times.append(e0.elapsed_time(e1) / 1e3)
                else:
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
            row[f"eager_between_{tag}_s"] = statistics.median(times)
            del a, w, c
        b.add("gemm_context", row, {"notes": run_gemm_context.__doc__})
        torch.cuda.empty_cache() if b.cuda else None


# ---------------------------------------------------------------- memory-bound ops on the twin's views
def run_views(b: Bench, rows: dict, deadline: float):
    """silu(gate)*up and RoPE as the twin runs them, on views (gate, up: chunks of the fused gate|up output
    [T, 2f]; q, k: views of the fused q|k|v output [b, s, (nh + 2 nkv) d]) and on contiguous copies of the same
    tensors, forward and backward (autograd.grad to the fused output), for the step rows' shapes. Eager calls
    between CUDA events (`time_calls` without a graph)."""
    seen = set()
    for name, (a, mb, _) in rows.items():
        if time.time() > deadline:
            return
        if a.family != "llama":
            continue
        s = a.seq if not b.args.smoke else 16
        T, f, d = mb * s, a.ffn if not b.args.smoke else 32, a.head_dim
        nh, nkv = a.heads, a.kv_heads
        key = (mb, s, f, nh, nkv, d)
        if key in seen:
            continue
        seen.add(key)
        model = Decoder.__new__(Decoder)  # only its rope() and the cos/sin tables
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=b.dev, dtype=torch.float32) / d))
        emb = torch.cat([torch.outer(torch.arange(s, device=b.dev, dtype=torch.float32), inv)] * 2, -1)
        cos, sin = emb.cos().to(b.dtype)[None, :, None, :], emb.sin().to(b.dtype)[None, :, None, :]

        def rope(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat([-x2, x1], dim=-1) * sin

        out = {"row": name, "micro_batch": mb, "seq": s, "tokens": T, "ffn": f, "heads": nh, "kv_heads": nkv,
               "head_dim": d}
        gu = randn(b, mb, s, 2 * f).requires_grad_(True)
        for layout in ("views", "contiguous"):
            gate, up = gu.chunk(2, dim=-1)
            if layout == "contiguous":
                gate, up = gate.detach().contiguous().requires_grad_(True), up.detach().contiguous().requires_grad_(True)
            src = (gu,) if layout == "views" else (gate, up)
            fwd = lambda gate=gate, up=up: F.silu(gate) * up  # noqa: E731
            y = fwd()
            dy = randn(b, *y.shape)
            out[f"swiglu_{layout}_fwd_s"], _ = b.time_calls([fwd], graph=False)
            out[f"swiglu_{layout}_bwd_s"], _ = b.time_calls(
                [lambda y=y, dy=dy, src=src: torch.autograd.grad(y, src, dy, retain_graph=True)], graph=False)
            del y, dy
        del gu
        qkv = randn(b, mb, s, (nh + 2 * nkv) * d).requires_grad_(True)
        for layout in ("views", "contiguous"):
            q, k, _ = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
            q, k = q.view(mb, s, nh, d), k.view(mb, s, nkv, d)
            if layout == "contiguous":
                q, k = q.detach().contiguous().requires_grad_(True), k.detach().contiguous().requires_grad_(True)
            src = (qkv,) if layout == "views" else (q, k)
            fwd = lambda q=q, k=k: (rope(q), rope(k))  # noqa: E731
            yq, yk = fwd()
            dq, dk = randn(b, *yq.shape), randn(b, *yk.shape)
            out[f"rope_qk_{layout}_fwd_s"], _ = b.time_calls([fwd], graph=False)
            out[f"rope_qk_{layout}_bwd_s"], _ = b.time_calls(
                [lambda yq=yq, yk=yk, dq=dq, dk=dk, src=src: torch.autograd.grad((yq, yk), src, (dq, dk),
                                                                                 retain_graph=True)], graph=False)
            del yq, yk, dq, dk
        del qkv, model
        b.add("views", out, {"notes": run_views.__doc__})
        if b.cuda:
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for the JSON files")
    ap.add_argument("--only", default=",".join(TABLES), help=f"comma list of {TABLES}")
    ap.add_argument("--steps", default="", help="comma list of step rows (default: all); names: " + ", ".join(STEP_ROWS))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and models (logic check, runs on CPU)")
    ap.add_argument("--cpu", action="store_true", help="run on CPU even where a GPU is present")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per kernel-table row")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per step row")
    ap.add_argument("--steps-n", type=int, default=10, help="timed steps per step row (median)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled step (kernels_per_step)")
    ap.add_argument("--budget", default="", help="seconds per table, e.g. gemm_grid=90,steps=150")
    ap.add_argument("--grid-coarse-first", action="store_true", help="gemm_grid: the shapes whose sides are all "
                    "powers of 4 first, so that a --budget cut leaves a coarser whole grid")
    ap.add_argument("--pass-id", type=int, default=1, help="steps_pass: the pass number (file steps_pass<N>.json)")
    ap.add_argument("--profile", action="store_true", help="steps_pass: also write step_profile.json (one "
                    "profiled step per row: kernels by name and by aten op and input shapes)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps, args.steps_n, args.warmup = min(args.reps, 3), min(args.steps_n, 3), min(args.warmup, 1)
    budgets = {k: float(v) for k, v in (kv.split("=") for kv in args.budget.split(",") if kv)}
    b = Bench(args)
    rows = SMOKE_ROWS if args.smoke else STEP_ROWS
    if args.steps:
        pick = args.steps.split(",")
        unknown = [n for n in pick if n not in rows]
        if unknown:
            raise SystemExit(f"--steps: unknown rows {unknown}; known: {list(rows)}")
        rows = {n: rows[n] for n in pick}
    only = [t for t in args.only.split(",") if t]
    bad = [t for t in only if t not in TABLES]
    if bad:
        raise SystemExit(f"--only: unknown tables {bad}; known: {TABLES}")
    print(f"device {b.dev}; torch {torch.__version__}; tables {only}", flush=True)
    for table in TABLES:
        if table not in only:
            continue
        t0 = time.time()
        deadline = t0 + budgets.get(table, 1e9)
        if table == "host":
            run_host(b)
        elif table == "host_model":
            run_host_model(b, deadline)
        elif table == "optimizer":
            run_optimizer(b, deadline)
        elif table == "attention":
            run_attention(b, deadline)
        elif table == "memory_bound":
            run_memory_bound(b, deadline)
        elif table in ("gemm_model", "gemm_grid"):
            run_gemm(b, table, rows, deadline)
        elif table == "steps":
            run_steps(b, rows, deadline)
        elif table == "steps_pass":
            run_steps_pass(b, rows, deadline)
        elif table == "eager_floor":
            run_eager_floor(b, deadline)
        elif table == "attention_cudnn":
            run_attention_cudnn(b, deadline)
        elif table == "gemm_context":
            run_gemm_context(b, rows, deadline)
        elif table == "views":
            run_views(b, rows, deadline)
        print(f"[{table}] {time.time() - t0:.1f} s", flush=True)
    summary(b)


def summary(b: Bench):
    """A short table of the key figures (the device reply carries the end of the output)."""
    g = [r for r in b.files.get("gemm", {}).get("rows", []) if "tflops" in r]
    if g:
        big = [r["tflops"] for r in g if r["m"] * r["n"] * r["k"] >= 2 ** 33]
        print(f"gemm: {len(g)} rows, TFLOP/s min {min(r['tflops'] for r in g):.1f} max {max(r['tflops'] for r in g):.1f}"
              + (f", shapes >= 2^33 MNK: {min(big):.0f}-{max(big):.0f}" if big else ""))
    for r in b.files.get("attention", {}).get("rows", []):
        if "fwd_s" in r:
            print(f"attn b{r['batch']} h{r['heads']}/{r['kv_heads']} s{r['seq']} d{r['head_dim']}: fwd "
                  f"{r['fwd_tflops']:.0f} bwd {r['bwd_tflops']:.0f} TFLOP/s")
    for r in b.files.get("memory_bound", {}).get("rows", []):
        if r["op"] in ("copy", "add") and "gbps" in r:
            print(f"mem {r['op']} {r['numel'] * 2 / 2**20:.1f} MiB: {r['gbps']:.0f} GB/s")
    for r in b.files.get("host", {}).get("rows", []):
        print("host", {k: (f"{v * 1e6:.2f}us" if isinstance(v, float) else v) for k, v in r.items()})
    for r in b.files.get("optimizer", {}).get("rows", []):
        print(f"opt {r['params']:.0e} params x{r['tensors']}: step {r['step_s'] * 1e3:.2f} ms "
              f"(clip {r['clip_s'] * 1e3:.2f}, adamw {r['adamw_s'] * 1e3:.2f})")
    for r in b.files.get("steps", {}).get("rows", []):
        if "tokens_per_s" in r:
            print(f"step {r['name']}: {r['tokens_per_s']:.0f} tok/s ({r['step_s_median'] * 1e3:.1f} ms) "
                  f"MFU {r['mfu_989']:.3f} peak {r.get('peak_mem_bytes', 0) / 2**30:.1f} GiB "
                  f"kernels {r.get('kernels_per_step')} busy {r.get('kernel_time_s')}")
        else:
            print(f"step {r['name']}: {r.get('error')}")


if __name__ == "__main__":
    main()

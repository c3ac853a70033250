"""Where a real CPU training step's time goes, op by op: gpt-tiny (vocabulary 16000, seq 128) at micro-batch 2,
4 micro-batches per step (global batch 8), AdamW with the global-norm clip, under paddle.profiler (CPU timers).

    OMP_NUM_THREADS=1 python benchmarks/cpu_step_ops.py [MICRO_BATCH] [--out DIR]

Prints the plain loop's step time (fastest and median of 8), then per step: every op class's time (forward ops
`X dygraph`, backward nodes `Global_XGradNode`), and the median and fastest time of each of the 33 matmuls of a
micro-batch (q, k, v, q·kᵀ, probs·v, o, up, down per block, then the LM head) and of their backward nodes, for
comparison with what llmtrain/plan/kernels.py + the cpu-here profile predict (benchmarks/README.md, "Planner:
operator-level cost model", This CPU). The chrome trace is written under DIR (default a temporary directory).
"""
from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(mb: int, out: str) -> None:
    import paddle
    import paddle.nn.functional as F
    import paddle.profiler as profiler

    from llmtrain.config import compose_config, register_configs, to_config
    from llmtrain.models import build_model

    register_configs()
    cfg = to_config(compose_config(["model=gpt-tiny", "model.vocab_size=16000", "data.seq_len=128"]))
    paddle.seed(0)
    model = build_model(cfg.model)
    opt = paddle.optimizer.AdamW(1e-4, parameters=model.parameters(), weight_decay=0.01,
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    ids = paddle.randint(0, 16000, [mb, 129])
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        for _ in range(8 // mb):
            logits = model(x)  # [mb, 128, 16000]
            F.cross_entropy(logits.astype("float32"), y.unsqueeze(-1), reduction="none").mean().backward()
        opt.step()
        opt.clear_grad()

    for _ in range(3):
        step()
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(f"plain loop step: fastest {min(times):.3f} s, median {statistics.median(times):.3f} s")
    steps = 3
    p = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU],
                          on_trace_ready=profiler.export_chrome_tracing(out))
    p.start()
    for _ in range(steps):
        step()
        p.step()
    p.stop()
    trace = sorted(glob.glob(os.path.join(out, "*.json")), key=os.path.getmtime)[-1]
    d = json.load(open(trace))
    rx = re.compile(r"^(.*)\[[\d.]+ (us|ms|ns|s)\]$")
    evs = sorted((e["ts"], e["dur"], (rx.match(e.get("name", "")) or [None, e.get("name", "")])[1])
                 for e in (d["traceEvents"] if isinstance(d, dict) else d) if "dur" in e)
    tot, cnt = defaultdict(float), defaultdict(int)
    for _, du, n in evs:
        if n.endswith(" dygraph") or n.startswith("Global_"):
            tot[n] += du
            cnt[n] += 1
    print("per step: ms, calls, op")
    for n, v in sorted(tot.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{v / steps / 1e3:9.3f} {cnt[n] // steps:5d}  {n}")
    per = 8 * cfg.model.num_layers + 1
    for name, label in (("matmul dygraph", "forward"), ("Global_MatmulGradNode", "backward")):
        seq = [du for _, du, n in evs if n == name]
        k = len(seq) // per
        print(f"matmul {label} by position in the micro-batch (ms, median / fastest of {k}):")
        print("  " + "  ".join(f"{i}:{statistics.median(seq[j * per + i] for j in range(k)) / 1e3:.2f}/"
                               f"{min(seq[j * per + i] for j in range(k)) / 1e3:.2f}" for i in range(per)))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else tempfile.mkdtemp(prefix="cpu_step_ops_")
    if "--out" in sys.argv:
        args = [a for a in args if a != out]
    main(int(args[0]) if args else 2, out)

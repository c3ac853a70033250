"""Collectives: measure them with `paddle.distributed` and fit per-collective latency (alpha) and bandwidth (beta).

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/plan/collectives.py --out coll.json
    python -m paddle.distributed.launch --nproc_per_node 8 llmtrain/plan/collectives.py --out coll.json --max-bytes 1073741824

`measure()` runs in every rank of a launched job and times, per message size, all-reduce, reduce-scatter,
all-gather, all-to-all and a point-to-point send/recv ping-pong (ranks 0 and 1) on the global group; a collective
the backend lacks is reported, not run (gloo, the CPU backend, has no reduce-scatter and no all-to-all). Each call
is checked once on known data after timing (an all-reduce must return the sum), so a collective that silently does
nothing cannot be measured.

`fit()` is pure numpy (no Paddle: `benchmarks/collectives.py` fits PyTorch/NCCL measurements with it). Message size
`bytes` follows nccl-tests: the whole buffer of one rank (all-reduce: the tensor; all-gather: the gathered output;
reduce-scatter: the input before scattering; all-to-all: the send buffer; send/recv: the message). The model of one
call is a ring's,

    t = alpha + factor(n) * bytes / beta,   factor = 2(n-1)/n (all-reduce), (n-1)/n (reduce-scatter, all-gather,
                                            all-to-all), 1 (send/recv),

so beta is the bus bandwidth (per direction, per device: the figure the planner's links use) and alpha the fixed
time of one call; `alpha_per_step` divides it by the ring's steps (2(n-1) for all-reduce, n-1 for the others, 1 for
send/recv), the per-message latency of the planner's ring formulas. The fit is least squares on relative error
(times span decades from 4 KiB to 1 GiB), with alpha held at 0 when it would come out negative.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv")
UNSUPPORTED = {"gloo": ("reduce_scatter", "all_to_all")}
"""Collectives a backend does not implement (Paddle 3.3.1's ProcessGroupGloo), reported instead of run."""


def bus_factor(collective: str, n: int) -> float:
    """Bytes each device sends per byte of `bytes` in a ring: 2(n-1)/n, (n-1)/n, or 1 (send/recv)."""
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if collective in ("send_recv", "broadcast"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}: expected one of {COLLECTIVES}")


def ring_steps(collective: str, n: int) -> int:
    """Messages in a row that one ring call waits on: 2(n-1) for all-reduce, n-1 for the others, 1 for send/recv."""
    if collective == "all_reduce":
        return 2 * (n - 1)
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return n - 1
    bus_factor(collective, n)  # raises on an unknown name
    return 1


def fit_alpha_beta(nbytes, seconds, collective: str, n: int) -> dict:
    """Fit t = alpha + bus_factor(collective, n) * bytes / beta to one collective at one world size.

    Least squares on relative error: minimise sum(((alpha + x_i / beta) - t_i) / t_i)^2, x = factor * bytes.
    Returns {"collective", "world", "alpha_s", "alpha_per_step_s", "bus_bw" (beta, bytes/s), "points",
    "max_rel_err"}. Raises ValueError with the numbers when the times do not grow with the message size."""
    b = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if b.shape != t.shape or b.size < 2 or np.unique(b).size < 2:
        raise ValueError(f"{collective} (n={n}): need >= 2 distinct message sizes, got bytes={list(b)}")
    if np.any(t <= 0):
        raise ValueError(f"{collective} (n={n}): times must be positive, got {list(t)}")
    x = bus_factor(collective, n) * b
    a = np.stack([1.0 / t, x / t], axis=1)  # [points, 2]: (alpha, 1/beta) in units of each point's own time
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:  # latency under the noise: the line through the origin
        alpha = 0.0
        inv_beta = float(np.sum(x / t) / np.sum((x / t) ** 2))
    if inv_beta <= 0:
        raise ValueError(f"{collective} (n={n}): larger messages were not slower (slope {inv_beta:.3g} s/byte); "
                         f"bytes={list(b)} seconds={list(t)}")
    pred = alpha + x * inv_beta
    return {"collective": collective, "world": int(n), "alpha_s": float(alpha),
            "alpha_per_step_s": float(alpha) / ring_steps(collective, n), "bus_bw": float(1.0 / inv_beta),
            "points": int(b.size), "max_rel_err": float(np.max(np.abs(pred - t) / t))}


def fit(rows: list[dict]) -> list[dict]:
    """One `fit_alpha_beta` per (collective, world) of measured rows {"collective", "world", "bytes", "seconds"};
    rows with "unsupported" are skipped."""
    groups: dict[tuple, list] = {}
    for r in rows:
        if "seconds" in r:
            groups.setdefault((r["collective"], r["world"]), []).append(r)
    return [fit_alpha_beta([r["bytes"] for r in g], [r["seconds"] for r in g], c, n)
            for (c, n), g in sorted(groups.items())]


def links(fits: list[dict]) -> dict:
    """The planner profile's `links` figures from fits: the all-reduce of the largest world for the collectives
    (bus bandwidth, per-step latency), send/recv for pipeline p2p."""
    ar = [f for f in fits if f["collective"] == "all_reduce"]
    p2p = [f for f in fits if f["collective"] == "send_recv"]
    out = {}
    if ar:
        big = max(ar, key=lambda f: f["world"])
        out.update(nvlink_bw=big["bus_bw"], nvlink_alpha=big["alpha_per_step_s"])
    if p2p:
        out.update(p2p_bw=p2p[0]["bus_bw"], p2p_alpha=p2p[0]["alpha_s"])
    return out


# ------------------------------------------------------------------ measuring (Paddle, in a launched job)
def _backend() -> str:
    import paddle

    return "nccl" if paddle.get_device().startswith("gpu") else "gloo"


def _sync():
    import paddle

    if paddle.get_device().startswith("gpu"):
        paddle.device.synchronize()


def _ops(collective: str, nbytes: int, n: int, rank: int, dtype: str):
    """(call, verify) for one collective over a buffer of `nbytes` (nccl-tests' size convention). verify() refills
    the very buffers `call` uses with known values, runs `call` once and checks what it delivered."""
    import paddle.distributed as dist

    item = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    numel = max(n, nbytes // item // n * n)  # divisible by n for the scattering collectives
    part = numel // n

    def full(size):
        import paddle

        return paddle.zeros([size], dtype=dtype)

    def first(t):
        return float(t[0])

    if collective == "all_reduce":
        x = full(numel)

        def call():
            dist.all_reduce(x)

        def verify():
            x.fill_(rank + 1.0)
            call()
            return first(x) == float(x[-1]) == n * (n + 1) / 2
    elif collective == "all_gather":
        x, out = full(part), []

        def call():
            out.clear()
            dist.all_gather(out, x)

        def verify():
            x.fill_(rank + 1.0)
            call()
            return [first(t) for t in out] == [r + 1.0 for r in range(n)]
    elif collective == "reduce_scatter":
        x, parts = full(part), [full(part) for _ in range(n)]

        def call():
            dist.reduce_scatter(x, parts)

        def verify():
            for r, t in enumerate(parts):
                t.fill_(rank + 1.0 + r)
            call()
            return first(x) == n * (n + 1) / 2 + n * rank
    elif collective == "all_to_all":
        send, recv = [full(part) for _ in range(n)], []

        def call():
            recv.clear()
            dist.alltoall(send, recv)

        def verify():
            for r, t in enumerate(send):
                t.fill_(float(rank * n + r))
            call()
            return [first(t) for t in recv] == [float(r * n + rank) for r in range(n)]
    elif collective == "send_recv":  # ping-pong between ranks 0 and 1; a call is one round trip (two messages)
        x = full(numel)

        def call():
            if rank == 0:
                dist.send(x, dst=1)
                dist.recv(x, src=1)
            elif rank == 1:
                dist.recv(x, src=0)
                dist.send(x, dst=0)

        def verify():
            x.fill_(7.0 if rank == 0 else 0.0)
            call()
            return rank > 1 or first(x) == float(x[-1]) == 7.0
    else:
        raise ValueError(f"unknown collective {collective!r}: expected one of {COLLECTIVES}")
    return call, verify


def measure(sizes, collectives=COLLECTIVES, reps: int = 5, warmup: int = 1, dtype: str = "float32") -> list[dict]:
    """Run in every rank of a launched job (global group): rows {"collective", "world", "bytes", "seconds", ...}.

    seconds: the median over `reps` timed calls (after `warmup`), each between a barrier and a device sync, of the
    slowest rank (a collective ends when its last rank does); send/recv: half the round trip. Every rank returns
    the same rows. Raises RuntimeError when a collective delivers wrong data."""
    import paddle
    import paddle.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    backend = _backend()
    rows = []
    for coll in collectives:
        if coll in UNSUPPORTED.get(backend, ()):
            rows.append({"collective": coll, "world": n, "unsupported": backend})
            continue
        for nbytes in sizes:
            call, verify = _ops(coll, int(nbytes), n, rank, dtype)
            times = []
            for i in range(warmup + reps):
                dist.barrier()
                _sync()
                t0 = time.perf_counter()
                call()
                _sync()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            ok = paddle.to_tensor([1.0 if verify() else 0.0])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if float(ok[0]) != 1.0:
                raise RuntimeError(f"{coll} over {n} ranks ({backend}) delivered wrong data at {nbytes} bytes")
            slowest = paddle.to_tensor([statistics.median(times)], dtype="float64")
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            sec = float(slowest[0]) / (2 if coll == "send_recv" else 1)
            rows.append({"collective": coll, "world": n, "bytes": int(nbytes), "seconds": sec, "dtype": dtype,
                         "backend": backend, "reps": reps})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description="measure and fit collectives (run under paddle.distributed.launch)")
    ap.add_argument("--out", required=True, help="JSON file written by rank 0: rows, fits, links")
    ap.add_argument("--min-bytes", type=int, default=4096)
    ap.add_argument("--max-bytes", type=int, default=4 << 20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", help="float32 (CPU/gloo) or bfloat16 (GPU)")
    args = ap.parse_args(argv)
    import paddle.distributed as dist

    dist.init_parallel_env()
    sizes, s = [], args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= 4
    rows = measure(sizes, reps=args.reps, dtype=args.dtype)
    if dist.get_rank() == 0:
        fits = fit(rows)
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "fits": fits, "links": links(fits),
                       "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1)
        for r in fits:
            print(f"{r['collective']} n={r['world']}: alpha {r['alpha_s'] * 1e6:.1f} us, bus {r['bus_bw'] / 1e9:.3f} GB/s")


if __name__ == "__main__":
    main()

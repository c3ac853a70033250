"""Collectives over NCCL with PyTorch, one process per GPU: times per message size and alpha-beta fits for the planner.

    python benchmarks/collectives.py --out DIR                                  # every world of 2, 4, 8 the node has
    python benchmarks/collectives.py --out DIR --worlds 8 --max-bytes 268435456
    python benchmarks/collectives.py --out /tmp/c --backend gloo --worlds 2 --max-bytes 4194304   # CPU check

PyTorch is the instrument (Paddle's GPU build cannot be installed on the machines we measure); the fitting is
llmtrain's own (`llmtrain/plan/collectives.py`, pure numpy, loaded by path so neither Paddle nor llmtrain's
dependencies are needed here). NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set for this process and every rank it starts.

Per world size (one `torch.multiprocessing.spawn` each, ranks on GPUs 0..n-1): all-reduce, reduce-scatter,
all-gather, all-to-all (`*_tensor`/`all_to_all_single`) and a send/recv ping-pong between ranks 0 and 1, bf16 on
NCCL (fp32 on gloo), message sizes 4 KiB to 1 GiB by x4 in nccl-tests' convention (the whole buffer of one rank).
A timed repetition is `iters` back-to-back calls (20 up to 1 MiB, 10 up to 64 MiB, 3 above) between a barrier plus
device sync and a device sync, divided by `iters`; median of `--reps` repetitions, the slowest rank's; send/recv is
half the round trip. After timing each buffer is refilled with known values and the call is checked once (a rank
that got wrong data fails the run). A collective the backend lacks is recorded as unsupported.

Writes DIR/collectives.json: {"provenance", "rows", "fits" (per collective and world: alpha_s, alpha_per_step_s,
bus_bw, max_rel_err), "links" (nvlink_bw, nvlink_alpha, p2p_bw, p2p_alpha: the h200 profile's `links` figures)}.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)  # before torch starts NCCL; spawned ranks inherit it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv")


def load_fit():
    """llmtrain/plan/collectives.py by path (beside the repository's benchmarks/, or copied beside this file)."""
    for path in (os.path.join(HERE, "..", "llmtrain", "plan", "collectives.py"), os.path.join(HERE, "plan_collectives.py")):
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("plan_collectives", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    raise FileNotFoundError("llmtrain/plan/collectives.py not found beside benchmarks/ nor as plan_collectives.py here")


def ops(coll: str, nbytes: int, n: int, rank: int, dev, dtype):
    """(call, verify) over one rank's buffer of `nbytes`; verify refills the buffers `call` uses and checks it."""
    numel = max(n, nbytes // torch.tensor([], dtype=dtype).element_size() // n * n)
    part = numel // n

    def buf(size):
        return torch.zeros(size, device=dev, dtype=dtype)

    if coll == "all_reduce":
        x = buf(numel)

        def call():
            dist.all_reduce(x)

        def verify():
            x.fill_(rank + 1.0)
            call()
            return bool((x == n * (n + 1) / 2).all())
    elif coll == "reduce_scatter":
        inp, out = buf(numel), buf(part)

        def call():
            dist.reduce_scatter_tensor(out, inp)

        def verify():
            for r in range(n):
                inp[r * part:(r + 1) * part].fill_(rank + 1.0 + r)
            call()
            return bool((out == n * (n + 1) / 2 + n * rank).all())
    elif coll == "all_gather":
        inp, out = buf(part), buf(numel)

        def call():
            dist.all_gather_into_tensor(out, inp)

        def verify():
            inp.fill_(rank + 1.0)
            call()
            return all(bool((out[r * part:(r + 1) * part] == r + 1.0).all()) for r in range(n))
    elif coll == "all_to_all":
        inp, out = buf(numel), buf(numel)

        def call():
            dist.all_to_all_single(out, inp)

        def verify():
            for r in range(n):
                inp[r * part:(r + 1) * part].fill_(float(rank * n + r))
            call()
            return all(bool((out[r * part:(r + 1) * part] == float(r * n + rank)).all()) for r in range(n))
    elif coll == "send_recv":  # ping-pong between ranks 0 and 1: one call is a round trip
        x = buf(numel)

        def call():
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)

        def verify():
            x.fill_(7.0 if rank == 0 else 0.0)
            call()
            return rank > 1 or bool((x == 7.0).all())
    else:
        raise ValueError(f"unknown collective {coll!r}")
    return call, verify


def worker(rank: int, world: int, backend: str, port: int, sizes, reps: int, out_path: str):
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor collectives renamed in newer PyTorch
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def slowest(value: float, op) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=op)
        return float(t[0])

    rows = []
    for coll in COLLECTIVES:
        for nbytes in sizes:
            try:
                call, verify = ops(coll, nbytes, world, rank, dev, dtype)
                iters = 20 if nbytes <= 1 << 20 else 10 if nbytes <= 64 << 20 else 3
                for _ in range(2):
                    call()
                times = []
                for _ in range(reps):
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        call()
                    sync()
                    times.append((time.perf_counter() - t0) / iters)
                ok = slowest(1.0 if verify() else 0.0, dist.ReduceOp.MIN)
            except (RuntimeError, NotImplementedError, ValueError) as e:  # the backend lacks it: the same on every rank
                rows.append({"collective": coll, "world": world, "unsupported": f"{backend}: {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]}"})
                break
            if ok != 1.0:
                raise RuntimeError(f"{coll} over {world} ranks ({backend}) delivered wrong data at {nbytes} bytes")
            sec = slowest(statistics.median(times), dist.ReduceOp.MAX) / (2 if coll == "send_recv" else 1)
            rows.append({"collective": coll, "world": world, "bytes": int(nbytes), "seconds": sec,
                         "dtype": str(dtype).replace("torch.", ""), "backend": backend, "iters": iters, "reps": reps})
            if rank == 0:
                print(f"[n={world}] {coll} {nbytes} B: {sec * 1e6:.1f} us", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def provenance(args, backend: str) -> dict:
    p = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "torch": torch.__version__,
         "backend": backend, "env": dict(NO_MULTICAST),
         "timing": f"per size: iters back-to-back calls between barrier+sync and sync, / iters; median of {args.reps} "
                   "repetitions, slowest rank; send/recv: half a ping-pong between ranks 0 and 1"}
    if backend == "nccl":
        p.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), cuda=torch.version.cuda,
                 nccl=".".join(map(str, torch.cuda.nccl.version())))
        try:
            p["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=20).stdout.split()[0]
            p["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
        except Exception:  # noqa: BLE001
            pass
    return p


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for collectives.json")
    ap.add_argument("--backend", default=None, help="nccl (default where GPUs are) or gloo")
    ap.add_argument("--worlds", default="2,4,8", help="world sizes to measure (those larger than the node are skipped)")
    ap.add_argument("--min-bytes", type=int, default=4 << 10)
    ap.add_argument("--max-bytes", type=int, default=1 << 30)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    have = torch.cuda.device_count() if backend == "nccl" else os.cpu_count() or 1
    worlds = [w for w in (int(x) for x in args.worlds.split(",")) if 2 <= w <= max(have, 2 if backend == "gloo" else 0)]
    if not worlds:
        raise SystemExit(f"no world size of {args.worlds} fits: {have} {'GPUs' if backend == 'nccl' else 'CPUs'}")
    sizes, s = [], args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= 4
    fitmod = load_fit()
    os.makedirs(args.out, exist_ok=True)
    result = {"provenance": provenance(args, backend), "rows": [], "fits": []}
    for world in worlds:
        part = os.path.join(args.out, f".rows_{world}.json")
        mp.spawn(worker, args=(world, backend, free_port(), sizes, args.reps, part), nprocs=world, join=True)
        with open(part) as f:
            result["rows"] += json.load(f)
        os.remove(part)
        result["fits"] = fitmod.fit(result["rows"])
        result["links"] = dict(fitmod.links(result["fits"]), source=(
            f"measured {result['provenance']['date_utc']} with benchmarks/collectives.py ({backend}, PyTorch "
            f"{torch.__version__}): all-reduce of the largest world for nvlink_bw/nvlink_alpha (bus bandwidth, "
            "latency per ring step), send/recv for p2p"))
        with open(os.path.join(args.out, "collectives.json"), "w") as f:  # rewritten after every world
            json.dump(result, f, indent=1)
    for r in result["fits"]:
        print(f"{r['collective']:>14} n={r['world']}: alpha {r['alpha_s'] * 1e6:7.1f} us "
              f"({r['alpha_per_step_s'] * 1e6:.2f}/step), bus {r['bus_bw'] / 1e9:8.2f} GB/s, "
              f"max rel err {r['max_rel_err']:.2f}")
    for r in result["rows"]:
        if "unsupported" in r:
            print(f"{r['collective']:>14} n={r['world']}: {r['unsupported']}")


if __name__ == "__main__":
    main()

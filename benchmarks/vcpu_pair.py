"""How far apart two processes computing at once on this host run, against each alone.

    python benchmarks/vcpu_pair.py [--rounds 3] [--seconds 2] [--n 512]

Each round: a loop of n x n x n fp32 matmuls (one thread) pinned to CPU 0 alone, then to CPU 1 alone, then
one process on each at once (same wall-clock start); prints each process's median call. A multi-process job
whose ranks meet at every collective moves at the slower process's pace, which is why `--calibrate`'s
`shared_host` table takes the slowest process (llmtrain/plan/measure.py `shared_host_rows`).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker(cpu: int, start: float, seconds: float, n: int) -> None:
    os.sched_setaffinity(0, {cpu})
    import paddle

    a, b = paddle.randn([n, n]), paddle.randn([n, n])
    for _ in range(3):
        paddle.matmul(a, b)
    time.sleep(max(0.0, start - time.time()))
    calls, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        paddle.matmul(a, b)
        calls.append(time.perf_counter() - t0)
    print(json.dumps({"cpu": cpu, "ms": statistics.median(calls) * 1e3, "calls": len(calls)}))


def at_once(cpus: list[int], seconds: float, n: int) -> list[float]:
    """Median ms a call of each process, all started at the same wall-clock moment (4 s from now: imports)."""
    start = time.time() + 4.0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(c), str(start), str(seconds), str(n)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True) for c in cpus]
    return [json.loads(p.communicate()[0])["ms"] for p in procs]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        cpu, start, seconds, n = sys.argv[2:6]
        return worker(int(cpu), float(start), float(seconds), int(n))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--n", type=int, default=512)
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("vcpu_pair.py needs 2 CPUs: this process may use " + str(sorted(os.sched_getaffinity(0))))
    for r in range(args.rounds):
        (a0,), (a1,) = at_once([0], args.seconds, args.n), at_once([1], args.seconds, args.n)
        t0, t1 = at_once([0, 1], args.seconds, args.n)
        print(f"round {r}: alone cpu0 {a0:.2f} ms, cpu1 {a1:.2f} ms; at once cpu0 {t0:.2f}, cpu1 {t1:.2f} ms "
              f"(slower / mean {max(t0, t1) / ((t0 + t1) / 2):.3f})", flush=True)


if __name__ == "__main__":
    main()

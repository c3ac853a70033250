"""Device kernels launched and host seconds per op of the MoE twin, tiny-shape host rows, and dropless steps routed by
a balanced random router (one H100 call, benchmarks/data/h100/launches).

    python benchmarks/gpu_moe_launches.py --out DIR --only ops,layers,dropless --budget ops=60,layers=120,dropless=150
    python benchmarks/gpu_moe_launches.py --out /tmp/smoke --smoke --cpu          # tiny shapes, logic only

Tables (one JSON file each in DIR, gpu_reference's `provenance`):
- `launches`: every op class of gpu_tables.moe_op_makers (the MoE dispatch's ops as the twin runs them) and the
  generic ops the planner lists around them, at the qwen-moe-4L micro-batch-1 sizes: `host_s` (one call's host
  seconds until it returns, mean of `reps` calls in a row after a synchronize: the dispatch, not the device) and
  `kernels`, `memsets`, `memcpys` per call (torch.profiler's device events over `reps` calls / reps) and
  `launch_calls` (the host's cudaLaunchKernel / cudaMemsetAsync / cudaMemcpyAsync calls per call).
- `layers`: the twin (gpu_model.Decoder, gpu_moe.MoEDecoder capacity 1.25) at tiny shapes (h 64, seq 16), where
  every kernel is far shorter than its dispatch: `fwd_s`, `fwd_bwd_s` (synchronised, host clock, median) and the
  device kernels of one forward and of one backward (`fwd_kernels`, `bwd_kernels`), for 1, 2 and 4 blocks of the
  qwen, deepseek and mixtral MoE shapes' E and k and of the dense block (the same call's reference).
- `dropless_steps`: the dropless MoE rows (gpu_h100.moe_rows) with the router as the twin has it (`router`
  "init": random-initialised weights) and with its logits replaced by i.i.d. standard normal draws per token
  (`router` "balanced": logits x 0 + noise, so that the router's GEMM and every backward kernel still run; each
  token's top-k is then uniform over the experts, the load of a balanced router), 2 warm-up + 8 timed steps,
  `capacity_mean_factor` (mean C read by the host over mean load T k / E), `layer_factors` (per layer), and
  `shared_share` per MoE layer: |mean over tokens of the router's input|^2 / mean |input|^2 (the share of one
  component common to every token, what correlates the routing of a random-initialised model).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h100  # noqa: E402
import gpu_moe  # noqa: E402
from gpu_model import Decoder, MasterAdamW, llama, make_batch, train_step  # noqa: E402
from gpu_moe import MoE, MoEDecoder  # noqa: E402
from gpu_reference import Bench, _wall  # noqa: E402
from gpu_tables import _free as free, _timed_steps as timed, moe_op_makers, run_tables  # noqa: E402

TABLES = ("ops", "layers", "dropless")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemsetAsync",
                "cudaMemcpyAsync", "cudaLaunchCooperativeKernel")


def count_device(b: Bench, fn, reps: int) -> dict:
    """Device events and host launch calls per call of `fn` over `reps` calls under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.cuda else [])
    b.sync()
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        b.sync()
    kern = mset = mcpy = calls = syncs = 0
    for e in prof.events():
        if b.cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            n = e.name.lower()
            if n.startswith("memset"):
                mset += 1
            elif n.startswith("memcpy"):
                mcpy += 1
            else:
                kern += 1
        elif e.name in LAUNCH_CALLS:
            calls += 1
        elif e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy"):
            syncs += 1
    return {"kernels": kern / reps, "memsets": mset / reps, "memcpys": mcpy / reps, "launch_calls": calls / reps,
            "syncs_in_window": syncs}


def host_per_call(b: Bench, fns, reps: int) -> float:
    """Mean host seconds of one call, `reps` calls dispatched in a row after a synchronize (none waits for the
    device: the queue holds far more than `reps` launches)."""
    for fn in fns[:3]:
        fn()
    times = []
    for _ in range(5):
        b.sync()
        t0 = time.perf_counter()
        for i in range(reps):
            fns[i % len(fns)]()
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def generic_ops(b: Bench, T: int, h: int, E: int, k: int) -> dict:
    """The planner's generic classes around the dispatch, as the twin calls them: op -> make()."""
    dev, dt = b.dev, b.dtype

    def r(*s, dtype=dt):
        return torch.randn(*s, device=dev, dtype=dtype, generator=b.gen)

    def idx():
        return torch.randint(0, E, (k * T,), device=dev, generator=b.gen)
    return {
        "add_bf16": lambda: (lambda x=r(T, h), y=r(T, h): x + y),
        "mul_bf16": lambda: (lambda x=r(T, h), y=r(T, h): x * y),
        "cast_f32": lambda: (lambda x=r(T, h): x.float()),
        "add_i64_kT": lambda: (lambda i=idx(): i * 3 + 1),
        "where_full_like_kT": lambda: (lambda i=idx(): torch.where(i >= 0, i, torch.full_like(i, -1))),
        "ge_kT": lambda: (lambda i=idx(): i >= 0),
        "clamp_kT": lambda: (lambda i=idx(): i.clamp(min=0)),
        "arange_repeat": lambda: (lambda: torch.arange(T, device=dev).repeat(k)),
        "full_i64": lambda: (lambda: torch.full((E * T + 1,), T, device=dev, dtype=torch.int64)),
        "new_zeros_cat": lambda: (lambda x=r(T, h): torch.cat([x, x.new_zeros(1, h)])),
        "index_select_rows": lambda: (lambda x=r(T + 1, h), i=torch.randint(0, T + 1, (k * T,), device=dev,
                                                                            generator=b.gen): x.index_select(0, i)),
        "gather_k": lambda: (lambda s=r(T, E, dtype=torch.float32), i=torch.randint(0, E, (T, k), device=dev,
                                                                                    generator=b.gen): torch.gather(s, -1, i)),
        "one_hot_mask": lambda: (lambda i=idx(): torch.nn.functional.one_hot(i.clamp(min=0), E) * (i >= 0)[:, None]),
        "t_reshape_view": lambda: (lambda i=torch.randint(0, E, (T, k), device=dev, generator=b.gen): i.t().reshape(-1)),
        "mean0_f32": lambda: (lambda x=r(T, E, dtype=torch.float32): x.mean(0)),
        "pow_mean": lambda: (lambda x=r(T, dtype=torch.float32): x.pow(2).mean()),
        "stack_mean": lambda: (lambda xs=[r(1, dtype=torch.float32)[0] for _ in range(4)]: torch.stack(xs).mean()),
        "cumsum0_paddle": lambda: (lambda o=torch.nn.functional.one_hot(idx(), E): gpu_moe.cumsum0(o, MoE(E, k, 1))),
        "bmm": lambda: (lambda x=r(E, 8, h), w=r(E, h, 64): torch.bmm(x, w)),
        "silu_mul": lambda: (lambda g=r(T, h), u=r(T, h): torch.nn.functional.silu(g) * u),
        # host-only entries of the dense list (views: no device kernel), to price `view_op_s` apart from launches
        "view_reshape": lambda: (lambda x=r(T, h): x.reshape(T, h // 64, 64)),
        "view_transpose": lambda: (lambda x=r(T, h): x.transpose(0, 1)),
        "view_split3": lambda: (lambda x=r(T, h): x.split([h // 2, h // 4, h // 4], dim=-1)),
        "view_chunk2": lambda: (lambda x=r(T, h): x.chunk(2, dim=-1)),
        "view_unsqueeze": lambda: (lambda x=r(T, h): x.unsqueeze(0)),
    }


def launch_row(b: Bench, row: dict, make, reps: int) -> dict:
    """`row` with one call's host seconds and device events (three operand sets from `make`), or the error."""
    try:
        fns = [make() for _ in range(3)]
        row["host_s"] = host_per_call(b, fns, reps)
        row.update(count_device(b, fns[0], reps))
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def run_ops(b: Bench, deadline: float):
    """`launches` (module docstring) at the qwen-moe-4L micro-batch-1 sizes: T = 4096, E = 60, k = 4, h = 2048."""
    T, E, k, h = (64, 12, 4, 64) if b.args.smoke else (4096, 60, 4, 2048)
    C = -(-5 * T * k // (4 * E))  # capacity 1.25
    reps = 4 if b.args.smoke else 50
    sizes = [("route", T, E), ("route", k * T, E), ("rows", E * C, h), ("rows", k * T, h)]
    seen = set()
    for kind, n, width in sizes:
        ops, row_ops = moe_op_makers(b, n, width, k)
        for op, make in (ops if kind == "route" else row_ops).items():
            if time.time() > deadline:
                b.add("launches", {"note": "time budget spent"})
                return
            b.add("launches", launch_row(b, {"op": op, "n": n, "width": width, "k": k, "kind": kind}, make, reps))
            seen.add(op)
        free(b)
    for op, make in generic_ops(b, T, h, E, k).items():
        if time.time() > deadline:
            return
        row = launch_row(b, {"op": op, "n": T, "width": h, "E": E, "k": k, "kind": "generic"}, make, reps)
        b.add("launches", row, {"notes": run_ops.__doc__ + " " + (__doc__ or "").split("- `launches`:")[1].split("- `layers`")[0]})
    print(f"[ops] {len(b.rows('launches'))} rows", flush=True)


TINY_MOE = {"qwen": MoE(60, 4, 96, 160, capacity_factor=1.25, norm_topk=False, aux_coef=0.001),
            "deepseek": MoE(64, 6, 96, 160, capacity_factor=1.25, norm_topk=False, aux_coef=0.001),
            "mixtral": MoE(8, 2, 160, 0, capacity_factor=1.25, norm_topk=True, aux_coef=0.02)}
"""The held-out rows' E, k, shared expert and norm_topk at tiny widths (h 64, expert width 96 / 160)."""


def run_layers(b: Bench, deadline: float):
    """`layers` (module docstring): host seconds of tiny twins, MoE and dense, 1 / 2 / 4 blocks."""
    reps = 3 if b.args.smoke else 30
    layers = (1, 2) if b.args.smoke else (1, 2, 4)
    for sweep in (1, 2):
        for fam in ("dense", *TINY_MOE):
            for n in layers:
                if time.time() > deadline:
                    return
                a = llama(n, 64, 4, 2, 160, 16, vocab=256)
                m = TINY_MOE.get(fam)
                name = f"{fam}-L{n}"
                row = {"name": name, "sweep": sweep, "arch": a.as_dict(), "moe": m.as_dict() if m else None,
                       "micro_batch": 1}
                try:
                    model = Decoder(a, b.dev, b.dtype, generator=b.gen) if m is None else \
                        MoEDecoder(a, m, b.dev, b.dtype, generator=b.gen)
                    opt = MasterAdamW(model.parameters())
                    batch = make_batch(a, 1, b.dev, b.gen)
                    row["tensors"] = len(list(model.parameters()))
                    row["fwd_s"] = _wall(b, lambda: model(*batch), reps, warm=5)
                    row["fwd_bwd_s"] = _wall(b, lambda: model(*batch).backward(), reps, warm=5)
                    row["step_s"] = _wall(b, lambda: train_step(model, opt, batch), reps, warm=3)
                    f = count_device(b, lambda: model(*batch), 1)
                    loss = model(*batch)
                    bw = count_device(b, loss.backward, 1)
                    row.update({f"fwd_{k}": v for k, v in f.items()})
                    row.update({f"bwd_{k}": v for k, v in bw.items()})
                    del model, opt
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                b.add("layers", row, {"notes": run_layers.__doc__})
                print(f"[layers] {name} sweep {sweep}: " + (row.get("error") or
                      f"fwd {row['fwd_s'] * 1e3:.2f} ms, fwd+bwd {row['fwd_bwd_s'] * 1e3:.2f} ms, kernels "
                      f"{row['fwd_kernels']:.0f} + {row['bwd_kernels']:.0f}"), flush=True)
        free(b)


class Balanced(MoEDecoder):
    """MoEDecoder whose router logits are i.i.d. N(0, 1) per token and expert (the GEMM still runs: logits x 0 +
    noise), and which records each MoE layer input's shared-component share."""

    def __init__(self, *args, balanced: bool, **kw):
        super().__init__(*args, **kw)
        self.balanced, self.shares = balanced, []
        self.noise_gen = torch.Generator(device=args[2])
        self.noise_gen.manual_seed(1)

    def mlp(self, blk, x):
        flat = x.detach().reshape(-1, x.shape[-1]).float()
        self.shares.append(flat.mean(0).pow(2).sum() / flat.pow(2).sum(-1).mean())  # stays on the device
        if not self.balanced:
            return super().mlp(blk, x)
        w = blk.w_router
        noise = torch.randn(flat.shape[0], w.shape[1], device=w.device, dtype=torch.float32, generator=self.noise_gen)
        orig = gpu_moe.route  # MoEDecoder.mlp routes through the module's `route`: the router GEMM runs, its output

        def route(logits, moe):  # replaced by the noise (x 0 keeps the GEMM's backward)
            return orig(logits * 0 + noise, moe)
        gpu_moe.route = route
        try:
            return super().mlp(blk, x)
        finally:
            gpu_moe.route = orig


def run_dropless(b: Bench, deadline: float):
    """`dropless_steps` (module docstring)."""
    rows = {k: v for k, v in gpu_h100.moe_rows(b.args.smoke).items() if v[1].capacity_factor == 0}
    for router in ("balanced", "init"):
        for name, (a, m, mb, _n) in rows.items():
            row = {"name": name, "router": router, "arch": a.as_dict(), "moe": m.as_dict(), "micro_batch": mb}
            if time.time() > deadline:
                row["error"] = "time budget spent before this row"
                b.add("dropless_steps", row)
                continue
            model = opt = None
            try:
                free(b)
                b.gen.manual_seed(zlib.crc32(name.rsplit("-", 2)[0].encode()))
                gpu_moe.CAPACITIES.clear()
                model = Balanced(a, m, b.dev, b.dtype, generator=b.gen, balanced=router == "balanced")
                opt = MasterAdamW(model.parameters())
                batch = make_batch(a, mb, b.dev, b.gen)
                times = timed(b, model, opt, batch, 2, 8 if not b.args.smoke else 2)
                row.update(step_s=times, step_s_median=statistics.median(times))
                caps = list(gpu_moe.CAPACITIES)
                mean_load = mb * a.seq * m.top_k / m.experts
                row["capacity_mean_factor"] = statistics.mean(caps) / mean_load
                row["layer_factors"] = [c / mean_load for c in caps[-a.layers:]]
                row["shared_share"] = [float(s) for s in model.shares[-a.layers:]]
                if b.cuda:
                    row["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            del model, opt
            b.add("dropless_steps", row, {"notes": run_dropless.__doc__ + " " + (__doc__ or "").split("- `dropless_steps`:")[1]})
            print(f"[dropless] {name} {router}: " + (row.get("error") or f"{row['step_s_median'] * 1e3:.1f} ms, "
                  f"factor {row['capacity_mean_factor']:.2f}, shared share {[round(s, 2) for s in row['shared_share']]}"),
                  flush=True)


def main(argv=None):
    run_tables(__doc__, TABLES, {"ops": run_ops, "layers": run_layers, "dropless": run_dropless}, argv, warmup=2,
               steps_n=8, setup=lambda b, only: gpu_h100.pin_for_steps(b, only, always=True))


if __name__ == "__main__":
    main()

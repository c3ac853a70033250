"""The twin as llmtrain runs it, re-measured on the H100: fused weights rebuilt in the backward, experts as two bmm.

    python benchmarks/gpu_h100_twin.py --out DIR --only recompute,saved,moe,moe_concat,dense,dispatch   # CUDA GPU
    python benchmarks/gpu_h100_twin.py --out /tmp/smoke --smoke --cpu                          # tiny shapes, logic

Two differences between the twin of the first H100 call (benchmarks/data/h100/steps, 2026-12-06) and llmtrain:
the fused projections (`fuse_qkv`, `fuse_ffn`) kept their concatenated weight for the backward (autograd over
torch.cat; llmtrain's ConcatLinear rebuilds it), and the routed experts ran one bmm over [E, h, 2f] concatenated at
every forward (llmtrain: two bmm on the stacked parameters). gpu_model.Decoder and gpu_moe now run llmtrain's way
by default; the old ways stay selectable (`fused_weights="kept"`, `MoE.gate_up="concat"`) and are measured
beside the new in the same call. Tables (one JSON file each in DIR, gpu_reference's `provenance`):

- `recompute_steps`: llama-7b-twin (h 4096, 32 heads, f 11008, seq 4096) L4 mb1 / L4 mb2 / L8 mb1 per recompute
  mode (gpu_h100.RecomputeDecoder) with `fused_weights` and `swiglu` per row: "rebuilt"/"unfused" (the time rows),
  "rebuilt"/"saves_input" (Paddle's swiglu saved tensors: a memory row; its eager backward is not Paddle's time)
  and "kept"/"unfused" at L4 mb1 (the first call's twin, same card). `step_ms` (median of 5 after 2 warm-up),
  `static_gib` (allocated before a step: weights, grads, optimizer state), `held_gib` (allocated after the
  forward and loss, before the backward, minus static: what the step keeps for its backward), `peak_gib` /
  `act_gib` (max allocated over the timed steps, and minus static), `fwd_peak_gib` / `bwd_peak_gib` (the peak
  above static during forward + loss, and during the backward, of the step that read `held_gib`). With
  `--saved-variants` (benchmarks/h100_recompute.sh, a fourth call not made yet: no machine came): `saved` "llmtrain" (gpu_model.Decoder: Paddle's
  saved tensors for split, RoPE and the loss; recomputed parts without their norm, as llmtrain/models/decoder.py)
  for rebuilt/unfused and rebuilt/saves_input at every shape, and "torch" (the twin2 rows' twin) at L4 mb1.
- `saved`: the tensors the autograd graph of one forward keeps (llama-7b-twin L4 mb1, mode none), by the op that
  saved them (grad_fn `_saved_*` fields and custom Functions' saved_tensors; each storage counted once, at the
  first op found holding it; parameters left out), per variant.
- `moe_steps`: gpu_h100.moe_rows (capacity 1.25 and dropless, qwen-moe-4L, deepseek-v2-lite-4L, mixtral-2L) with
  the experts as two bmm; 2 warm-up + 8 timed; `fwd_bwd_s` / `opt_s`: the forward+backward and the optimizer
  step timed apart (host clock after a synchronize, median of 3).
- `moe_profile`: one step of each capacity row and of llama-7b-8L-mb1 (a dense reference) under torch.profiler
  (gpu_reference.profile_step_detail: kernels by name, categories, aten ops with shapes).
- `moe_concat_steps`: the capacity rows again with `gate_up="concat"` (the first call's twin), same card.
- `steps`: the held-out dense rows (gpu_h100.dense_rows) with the rebuilt fused weights.
- `dispatch`: the MoE capacity rows and llama-7b-8L-mb1: aten ops dispatched by one forward and one backward, and
  the host time of each against its wall time (`run_dispatch`).
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
from gpu_model import MasterAdamW, llama, make_batch, train_step  # noqa: E402
from gpu_reference import Bench, profile_step_detail  # noqa: E402
from gpu_tables import _free as free, _timed_steps as timed, run_tables  # noqa: E402

TABLES = ("recompute", "saved", "moe", "moe_concat", "dense", "dispatch")
GIB = 2 ** 30
MODES = ("none", "full", "full_attn", "core_attn", "mlp")


def _arch(b: Bench, layers: int, seq: int):
    return llama(layers, 64, 4, 4, 160, seq, vocab=256) if b.args.smoke else llama(layers, 4096, 32, 32, 11008, seq)


def _model(b: Bench, a, mode: str, fused_weights: str, swiglu: str, saved: str = "llmtrain"):
    m = gpu_h100.RecomputeDecoder(a, b.dev, b.dtype, mode, generator=b.gen)
    m.fused_weights, m.swiglu, m.saved = fused_weights, swiglu, saved  # read at every forward
    return m


def _peak() -> float:
    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0


def _reset():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _alloc() -> float:
    return torch.cuda.memory_allocated() / GIB if torch.cuda.is_available() else 0.0


def run_recompute(b: Bench, deadline: float):
    cases = [(2, 128, 1)] if b.args.smoke else [(4, 4096, 1), (4, 4096, 2), (8, 4096, 1)]
    variants = [("rebuilt", "unfused", "llmtrain"), ("rebuilt", "saves_input", "llmtrain"),
                ("rebuilt", "unfused", "torch")] if b.args.saved_variants else [
        ("rebuilt", "unfused", "torch"), ("rebuilt", "saves_input", "torch"), ("kept", "unfused", "torch")]
    for fw, sw, sv in variants:
        for layers, seq, mb in cases:
            if (fw == "kept" or (sv == "torch" and b.args.saved_variants)) and (layers, mb) != (cases[0][0],
                                                                                                 cases[0][2]):
                continue  # the earlier call's twin at L4 mb1 only
            a = _arch(b, layers, seq)
            for mode in MODES:
                row = {"model": "llama-7b-twin", "layers": layers, "mode": mode, "seq": seq, "mb": mb,
                       "fused_weights": fw, "swiglu": sw, "saved": sv}
                if time.time() > deadline:
                    row["error"] = "time budget spent before this row"
                    b.add("recompute_steps", row)
                    continue
                model = opt = None
                try:
                    free(b)
                    model = _model(b, a, mode, fw, sw, sv)
                    opt = MasterAdamW(model.parameters())
                    batch = make_batch(a, mb, b.dev, b.gen)
                    train_step(model, opt, batch)
                    train_step(model, opt, batch)
                    b.sync()
                    static = _alloc()
                    _reset()
                    loss = model(*batch)  # one step with the bytes held between forward and backward read
                    b.sync()
                    held, fwd_peak = _alloc() - static, _peak() - static
                    _reset()
                    loss.backward()
                    b.sync()
                    bwd_peak = _peak() - static  # forward + loss's peak vs the backward's: which phase makes it
                    opt.step()
                    del loss
                    b.sync()
                    if b.cuda:
                        torch.cuda.reset_peak_memory_stats()
                    times = timed(b, model, opt, batch, 0, 5 if not b.args.smoke else 2)
                    row.update(step_ms=statistics.median(times) * 1e3, step_s=times, static_gib=static, held_gib=held,
                               fwd_peak_gib=fwd_peak, bwd_peak_gib=bwd_peak)
                    if b.cuda:
                        row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                        row["act_gib"] = row["peak_gib"] - static
                except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                del model, opt
                b.add("recompute_steps", row, {"notes": __doc__.split("- `recompute_steps`:")[1].split("- `saved`")[0]
                                               .strip(), "arch": a.as_dict()})
                print(f"[recompute] {fw}/{sw}/{sv} L{layers} mb{mb} {mode}: " + (row.get("error") or
                      f"{row['step_ms']:.1f} ms held {row['held_gib']:.2f} act {row.get('act_gib', 0):.2f} GiB (fwd peak "
                      f"{row['fwd_peak_gib']:.2f}, bwd {row['bwd_peak_gib']:.2f})"),
                      flush=True)


def saved_inventory(loss, params) -> tuple[dict, int]:
    """({op name: bytes}, total bytes) of the storages the autograd graph of `loss` keeps, parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen, by_op = set(), {}
    stack, visited = [loss.grad_fn], {}  # id -> node: the node kept alive, so no id is reused by another
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in visited:
            continue
        visited[id(fn)] = fn
        found = []
        for name in dir(fn):
            if name.startswith("_saved_") or name == "saved_tensors":
                try:
                    v = getattr(fn, name)
                except Exception:  # noqa: BLE001 - released or not a tensor field
                    continue
                found += list(v) if isinstance(v, (tuple, list)) else [v]
        for t in found:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in skip or key in seen or key == 0:
                continue
            seen.add(key)
            by_op[fn.name()] = by_op.get(fn.name(), 0) + st.nbytes()
        stack += [n for n, _ in fn.next_functions]
    return dict(sorted(by_op.items(), key=lambda kv: -kv[1])), sum(by_op.values())


def run_saved(b: Bench, deadline: float):
    layers, seq, mb = (2, 128, 1) if b.args.smoke else (4, 4096, 1)
    a = _arch(b, layers, seq)
    for fw, sw in (("rebuilt", "unfused"), ("rebuilt", "saves_input"), ("kept", "unfused")):
        row = {"model": "llama-7b-twin", "layers": layers, "seq": seq, "mb": mb, "mode": "none",
               "fused_weights": fw, "swiglu": sw}
        if time.time() > deadline:
            row["error"] = "time budget spent before this row"
            b.add("saved", row)
            continue
        model = None
        try:
            free(b)
            model = _model(b, a, "none", fw, sw)
            batch = make_batch(a, mb, b.dev, b.gen)
            before = _alloc()
            loss = model(*batch)
            b.sync()
            row["held_gib"] = _alloc() - before
            by_op, total = saved_inventory(loss, list(model.parameters()))
            row.update(saved_gib=total / GIB, saved_by_op_bytes=by_op)
            del loss
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        del model
        b.add("saved", row, {"notes": "saved tensors of one forward by the op holding them (module docstring)"})
        print(f"[saved] {fw}/{sw}: " + (row.get("error") or f"held {row['held_gib']:.3f} saved "
              f"{row['saved_gib']:.3f} GiB; " + ", ".join(f"{k} {v / GIB:.3f}" for k, v in
                                                        list(row['saved_by_op_bytes'].items())[:8])), flush=True)


def _phases(b: Bench, model, opt, batch, n: int = 3) -> tuple[float, float]:
    """Median (forward + backward, optimizer) seconds over n steps, host clock between synchronisations."""
    fb, op = [], []
    for _ in range(n):
        b.sync()
        t0 = time.perf_counter()
        model(*batch).backward()
        b.sync()
        t1 = time.perf_counter()
        opt.step()
        b.sync()
        fb.append(t1 - t0)
        op.append(time.perf_counter() - t1)
    return statistics.median(fb), statistics.median(op)


def run_moe(b: Bench, deadline: float, table: str, gate_up: str, capacity_only: bool, profile: bool):
    import gpu_moe
    from gpu_moe import MoEDecoder

    rows = gpu_h100.moe_rows(b.args.smoke)
    for name, (a, m, mb, _n) in rows.items():
        if capacity_only and m.capacity_factor == 0:
            continue
        m = dataclasses.replace(m, gate_up=gate_up)
        row = {"name": name, "arch": a.as_dict(), "moe": m.as_dict(), "micro_batch": mb}
        if time.time() > deadline:
            row["error"] = "time budget spent before this row"
            b.add(table, row)
            continue
        model = opt = None
        try:
            free(b)
            b.gen.manual_seed(zlib.crc32(name.rsplit("-", 2)[0].encode()))  # same weights and batch per shape/mb
            gpu_moe.CAPACITIES.clear()
            model = MoEDecoder(a, m, b.dev, b.dtype, generator=b.gen)
            opt = MasterAdamW(model.parameters())
            batch = make_batch(a, mb, b.dev, b.gen)
            times = timed(b, model, opt, batch, 2, 8 if not b.args.smoke else 2)
            row.update(step_s=times, step_s_median=statistics.median(times))
            row["fwd_bwd_s"], row["opt_s"] = _phases(b, model, opt, batch)
            caps = list(gpu_moe.CAPACITIES)
            if m.capacity_factor == 0 and caps:
                row["capacity_mean_factor"] = statistics.mean(caps) / (mb * a.seq * m.top_k / m.experts)
            if b.cuda:
                row["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            if profile and m.capacity_factor > 0:
                d = profile_step_detail(b, model, opt, batch)
                b.add("moe_profile", {"name": name, "gate_up": gate_up, "step_s_median": row["step_s_median"],
                                      **{k: d[k] for k in ("kernels_per_step", "kernel_time_s", "categories")},
                                      "kernels_by_name": d["kernels_by_name"][:80], "ops": d["ops"][:120]})
                row["kernel_time_s"] = d["kernel_time_s"]
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        del model, opt
        b.add(table, row, {"notes": f"MoE twin steps, experts gate_up={gate_up} (module docstring)"})
        print(f"[{table}] {name}: " + (row.get("error") or f"{row['step_s_median'] * 1e3:.1f} ms (fwd+bwd "
              f"{row['fwd_bwd_s'] * 1e3:.1f}, opt {row['opt_s'] * 1e3:.1f}) busy {row.get('kernel_time_s')}"),
              flush=True)
    if profile:  # a dense reference row under the profiler, its optimizer beside the MoE rows'
        a, mb = (_arch(b, 2, 128), 1) if b.args.smoke else (llama(8, 4096, 32, 32, 11008, 4096), 1)
        try:
            free(b)
            from gpu_model import Decoder
            model = Decoder(a, b.dev, b.dtype, generator=b.gen)
            opt = MasterAdamW(model.parameters())
            batch = make_batch(a, mb, b.dev, b.gen)
            times = timed(b, model, opt, batch, 2, 6 if not b.args.smoke else 2)
            fb, op = _phases(b, model, opt, batch)
            d = profile_step_detail(b, model, opt, batch)
            b.add("moe_profile", {"name": "dense-llama-7b-8L-mb1", "step_s_median": statistics.median(times),
                                  "fwd_bwd_s": fb, "opt_s": op,
                                  **{k: d[k] for k in ("kernels_per_step", "kernel_time_s", "categories")},
                                  "kernels_by_name": d["kernels_by_name"][:80], "ops": d["ops"][:120]})
            print(f"[moe_profile] dense llama-7b-8L-mb1: {statistics.median(times) * 1e3:.1f} ms, fwd+bwd "
                  f"{fb * 1e3:.1f}, opt {op * 1e3:.1f}", flush=True)
            del model, opt
        except Exception as e:  # noqa: BLE001
            b.add("moe_profile", {"name": "dense-llama-7b-8L-mb1", "error": f"{type(e).__name__}: {e}"[:400]})


def run_dispatch(b: Bench, deadline: float):
    """Per row: the aten ops one forward and one backward dispatch (a TorchDispatchMode counting them; the
    backward's run on autograd's thread under the same mode), and the host time of each (until the call returns)
    against its wall time (until the device is done)."""
    import gpu_moe
    from torch.utils._python_dispatch import TorchDispatchMode

    from gpu_model import Decoder
    from gpu_moe import MoEDecoder

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket.__name__)
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    moe = gpu_h100.moe_rows(b.args.smoke)
    rows = [(n, moe[n]) for n in moe if "-mb1-slots-cap" in n or "-mb2-slots-cap" in n]
    rows.append(("dense-llama-7b-8L-mb1", None))
    for name, spec in rows:
        row = {"name": name}
        if time.time() > deadline:
            row["error"] = "time budget spent before this row"
            b.add("dispatch", row)
            continue
        model = opt = None
        try:
            free(b)
            if spec is None:
                a, mb = (_arch(b, 2, 128), 1) if b.args.smoke else (llama(8, 4096, 32, 32, 11008, 4096), 1)
                model = Decoder(a, b.dev, b.dtype, generator=b.gen)
            else:
                a, m, mb, _n = spec
                b.gen.manual_seed(zlib.crc32(name.rsplit("-", 2)[0].encode()))
                gpu_moe.CAPACITIES.clear()
                model = MoEDecoder(a, m, b.dev, b.dtype, generator=b.gen)
            opt = MasterAdamW(model.parameters())
            batch = make_batch(a, mb, b.dev, b.gen)
            timed(b, model, opt, batch, 2, 0)
            host_f, wall_f, host_b, wall_b = [], [], [], []
            for _ in range(3):
                b.sync()
                t0 = time.perf_counter()
                loss = model(*batch)
                t1 = time.perf_counter()
                b.sync()
                t2 = time.perf_counter()
                loss.backward()
                t3 = time.perf_counter()
                b.sync()
                t4 = time.perf_counter()
                opt.step()
                host_f.append(t1 - t0), wall_f.append(t2 - t0), host_b.append(t3 - t2), wall_b.append(t4 - t2)
            row.update(host_fwd_s=statistics.median(host_f), wall_fwd_s=statistics.median(wall_f),
                       host_bwd_s=statistics.median(host_b), wall_bwd_s=statistics.median(wall_b))
            with Count() as c:
                loss = model(*batch)
            row["fwd_ops"] = dict(sorted(c.ops.items(), key=lambda kv: -kv[1]))
            with Count() as c:
                loss.backward()
            row["bwd_ops"] = dict(sorted(c.ops.items(), key=lambda kv: -kv[1]))
            row["fwd_ops_total"], row["bwd_ops_total"] = sum(row["fwd_ops"].values()), sum(row["bwd_ops"].values())
            opt.step()
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        del model, opt
        b.add("dispatch", row, {"notes": run_dispatch.__doc__})
        print(f"[dispatch] {name}: " + (row.get("error") or f"fwd host {row['host_fwd_s'] * 1e3:.1f} / wall "
              f"{row['wall_fwd_s'] * 1e3:.1f} ms, bwd host {row['host_bwd_s'] * 1e3:.1f} / wall "
              f"{row['wall_bwd_s'] * 1e3:.1f} ms; aten ops fwd {row['fwd_ops_total']} bwd {row['bwd_ops_total']}"),
              flush=True)


RUNNERS = {"recompute": run_recompute, "saved": run_saved,
           "moe": lambda b, end: run_moe(b, end, "moe_steps", "two_bmm", False, not b.args.no_profile),
           "moe_concat": lambda b, end: run_moe(b, end, "moe_concat_steps", "concat", True, False),
           "dense": gpu_h100.run_steps_dense, "dispatch": run_dispatch}


def main(argv=None):
    run_tables(__doc__, TABLES, RUNNERS, argv, warmup=2, steps_n=6,
               setup=lambda b, only: gpu_h100.pin_for_steps(b, only, always=True), options=(
                   (("--saved-variants",), {"action": "store_true", "help": "recompute: gpu_model.Decoder.saved "
                                            "'llmtrain' rows (+ 'torch' at L4 mb1): benchmarks/h100_recompute.sh"}),))


if __name__ == "__main__":
    main()

"""What `python -m llmtrain.plan` prints: the ranked table, or one layout explained, in units.

    python -m llmtrain.plan model=llama-7b plan.devices=64 plan.device=h100               # ranked_table(...)
    python -m llmtrain.plan model=llama-7b plan.devices=8 +parallel=dp2tp2 parallel.sharding=2   # explained(...)

Memory in GiB (2**30 bytes) on the worst rank, times in ms, throughput in tokens/s per device, MFU in percent.
Each row comes with the overrides that launch it (`llmtrain.plan.overrides`), and the precision the rows were
planned in is said in the heading (a GPU profile with `train.amp=none` is planned as bf16 AMP).
"""
from __future__ import annotations

GIB = 2**30
RECOMPUTE_SHORT = {"none": "none", "full": "full", "full_attn": "fattn", "core_attn": "core", "selective": "core"}
NOT_RUNNABLE = "* selective recompute (attention core only): planned, not runnable in llmtrain yet"
MEMORY = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer states"),
          ("activations", "activations"), ("other", "logits and framework margin"))
TIMES = (("compute_s", "compute"), ("dp_sharding_comm_s", "dp/sharding gradient sync (exposed)"),
         ("tp_comm_s", "tp all-reduces"), ("pp_p2p_s", "pipeline send/recv"), ("bubble_s", "pipeline bubble"),
         ("loop_comm_s", "training loop's collectives"))
HEADER = (f"{'#':>3} {'layout':<22} {'mb':>3} {'recmp':>5} "
          + " ".join(f"{k:>7}" for k in ("params", "grads", "optim", "activ", "other", "total"))
          + f" {'fits':>4} {'step_ms':>8} " + " ".join(f"{k:>8}" for k in ("comp", "dp/sh", "tp", "pp", "bubble", "loop"))
          + f" {'tok/s/dev':>9} {'mfu%':>5}")


def precision(rows: list[dict], given_amp: str) -> str:
    """The heading's words for the precision the rows were planned in."""
    amp = rows[0]["amp"] if rows else given_amp
    if amp == "none":
        return "fp32"
    if given_amp == "none":
        return (f"{amp} AMP (train.amp=none, but a GPU profile is planned in bf16: fp32 training on a GPU is not "
                f"modelled; the launch overrides add train.amp={amp})")
    return f"{amp} AMP"


def _row_line(i: int, r: dict) -> str:
    m = r["memory_bytes"]
    return (f"{i:>3} {r['name']:<22} {r['micro_batch']:>3} {RECOMPUTE_SHORT[r['recompute_granularity']] + ('+o' if r.get('offload_optimizer') else ''):>5} "
            + " ".join(f"{m[k] / GIB:7.1f}" for k in ("params", "grads", "optimizer", "activations", "other", "total"))
            + f" {'yes' if r['fits'] else 'NO':>4} " + (
                f"{1e3 * r['step_time_s']:8.1f} " + " ".join(f"{1e3 * r[k]:8.1f}" for k, _ in TIMES)
                + f" {r['tokens_per_sec_per_device']:9.0f} {100 * r['mfu']:5.1f}" if r["step_time_s"] is not None
                else f"{'-':>8} " + " ".join(f"{'-':>8}" for _ in TIMES) + f" {'-':>9} {'-':>5}"))


def profile_line(device: str) -> str:
    """Where the device profile's tables come from: measured, or UNMEASURED with the measured scaling error."""
    from llmtrain.plan.profile import measured_note

    try:
        return f"device profile {device}: {measured_note(device)}"
    except ValueError:  # a calibrated profile file that is not packaged
        return f"device profile {device}: measured by --calibrate (plan.profile)"


def ranked_table(rows: list[dict], cfg, top: int) -> list[str]:
    """The heading, the first `top` rows, then each row's launch overrides."""
    p = cfg.plan
    fit = sum(r["fits"] for r in rows)
    shown = rows[:top]
    lines = [f"{cfg.model.name}, seq {cfg.data.seq_len}, global batch {cfg.train.global_batch_size}, {p.devices} x "
             f"{p.device} ({p.devices_per_node} per node), {precision(rows, cfg.train.amp)}: {len(rows)} valid (layout, "
             f"micro-batch, recompute), {fit} fit; memory in GiB for the worst rank, times in ms per step (rows that do "
             "not fit are not timed: -)" + (f"; {rows.pruned} more exceed the device's memory under every pipeline split "
                                            "(a lower bound) and are not listed" if getattr(rows, "pruned", 0) else ""),
             profile_line(p.device), HEADER]
    lines += [_row_line(i, r) for i, r in enumerate(shown, 1)]
    if any(not r["runnable"] for r in shown):
        lines.append(NOT_RUNNABLE)
    lines.append("to launch a row, add its overrides to this command's model, data and train overrides (a layout "
                 "name is not a conf/parallel/ file):")
    lines += [f"{i:>3} {' '.join(r['overrides'])}" + ("" if r["runnable"] else "   (* not runnable)")
              for i, r in enumerate(shown, 1)]
    return lines


def explained(r: dict, cfg, device_memory_bytes: float) -> list[str]:
    """One layout: its degrees and batch split, memory by part, time by part, throughput, and how to launch it."""
    p, m = cfg.plan, r["memory_bytes"]
    global_batch = r["micro_batch"] * r["grad_accum"] * r["dp"] * r["sharding"]
    pipeline = (f", pp {r['pp']} ({r['pp_schedule']}" + (f", {r['virtual_pp']} virtual stages" if r["virtual_pp"] > 1
                                                            else "") + ")") if r["pp"] > 1 else ", pp 1"
    lines = [
        f"{cfg.model.name}, seq {cfg.data.seq_len}, global batch {global_batch}, {p.devices} x {p.device} "
        f"({p.devices_per_node} per node), {precision([r], cfg.train.amp)}",
        profile_line(p.device),
        f"layout {r['name']}: dp {r['dp']}, tp {r['tp']}{pipeline}, sharding {r['sharding']}"
        + (f" (ZeRO stage {r['sharding_stage']})" if r["sharding"] > 1 else "")
        + f"; micro-batch {r['micro_batch']} x {r['grad_accum']} accumulated; recompute {r['recompute_granularity']}",
        f"memory on the worst rank: {m['total'] / GIB:.2f} GiB of {device_memory_bytes / GIB:.2f} GiB "
        f"({'fits' if r['fits'] else 'does NOT fit'}; {m['allocated'] / GIB:.2f} GiB of it counted by the allocator)",
    ]
    lines += [f"  {label:<28} {m[k] / GIB:8.2f} GiB" for k, label in MEMORY]
    lines.append(f"step time {1e3 * r['step_time_s']:.1f} ms:")
    lines += [f"  {label:<38} {1e3 * r[k]:8.1f} ms" for k, label in TIMES]
    for axis, c in (r.get("comm_syncs") or {}).items():  # llmtrain/plan/overlap.py: what each option does
        size = f"{c['buckets']} buckets of {c['bucket_bytes'] / 2**20:.0f} MiB" if c["bucket_bytes"] else \
            f"{c['buckets']} collectives"
        how = ("issued from the backward" + (f" (parallel.{c['option']})" if c["option"] else "")) if c["overlapped"] \
            else "after the backward" + (f" (parallel.{c['option']}=true would overlap it)" if c["option"] else "")
        lines.append(f"  ({axis} {c['kind']}: {size}, {how}: {1e3 * c['comm_s']:.1f} ms of collectives, "
                     f"{1e3 * c['exposed_s']:.1f} ms exposed)")
    lines.append(f"  (compute: host dispatch {1e3 * r['host_s']:.1f} ms, device {1e3 * r['device_s']:.1f} ms, "
                 f"{r['kernels_per_step']} kernels per step)")
    lines.append(f"throughput {r['tokens_per_sec_per_device']:,.0f} tokens/s per device, MFU {100 * r['mfu']:.1f}%")
    lines.append("launch it with: " + " ".join(r["overrides"]))
    if not r["runnable"]:
        lines.append(NOT_RUNNABLE)
    return lines

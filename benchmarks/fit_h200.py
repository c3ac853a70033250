"""Fit the packaged `h200` device profile from the H200's raw kernel tables (never from its end-to-end steps).

    python benchmarks/fit_h200.py benchmarks/data/h200              # -> llmtrain/plan/profiles/h200.json
    python benchmarks/fit_h200.py DATA_DIR --out /tmp/h200.json
    python benchmarks/fit_h200.py DATA_DIR --moe-data benchmarks/data/h200_moe,benchmarks/data/h200_moe/final
                                                                    # the default further directories
    python benchmarks/fit_h200.py benchmarks/data/h200 --moe-data ... --views-from benchmarks/data/h100/launches/launches.json
                                                                    # view_op_s from another call's bare views

DATA_DIR holds gemm.json, attention.json, memory_bound.json, host.json, host_model.json and optimizer.json as
benchmarks/gpu_reference.py writes them (their README.md describes each); steps*.json, if there, are not read.
The host block comes from host_model.json (the model twin's own code path at tiny shapes, `host_from_model`);
without that file, from host.json's loops of tiny eager ops (`host_times`), which miss the model code's Python.
The constants that are not measured there come from the datasheet and are said so in the file.
Further directories (`--moe-data`, a comma list, default benchmarks/data/h200_moe and its `final/` (the second
run: the dispatch's new op classes); benchmarks/gpu_tables.py writes them) add kernel tables only, never their
steps (a later directory's rows of the same op and size join the earlier's medians): `bmm.json` (the experts' batched GEMMs), `gemm_extra.json` (exact-hit
dense shapes), `moe_ops.json` (the dispatch's ops, each its own memory-bound class, named by op) and
`attention_long.json` (its `flash_twin_views` rows: the layout the twin and Paddle's flash attention run).
"""
from __future__ import annotations

import json
import statistics
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmtrain.plan.fit import fit_profile, read_tables

GB, GIB = 1e9, 2**30
BASE = {
    "name": "h200", "match": ["H200"], "peak_flops": 989e12, "memory_bytes": 141 * GB, "framework_bytes": 2 * GIB,
    "dtype_bytes": 2, "async_launch": True, "tables_include_host": False,
    "links": {"nvlink_bw": 450 * GB, "net_bw": 50 * GB, "nvlink_alpha": 5e-6, "net_alpha": 10e-6,
              "host_bw": 64 * GB,  # PCIe Gen5 x16 per direction (datasheet): the price of offload
              "source": "datasheet, not measured (one GPU was measured): NVLink 900 GB/s total = 450 per direction; "
                        "NDR 400 Gb/s per GPU = 50 GB/s; alpha: NCCL's per-message latency, a few us in a node, "
                        "~10 us across IB (assumed)"},
    "source": "NVIDIA H200 SXM datasheet for the peak (989 TFLOP/s bf16 dense, MFU's denominator), memory (141 GB) "
              "and links; every kernel table measured on one H200 (provenance)",
}


BWD_KERNELS = {"add": 1, "mul": 2, "matmul": 2, "rms_norm": 1, "layer_norm": 1, "silu": 1, "gelu_tanh": 1,
               "cat_split": 2}
"""Backward kernels of each tiny eager op of host.json (mul, matmul: one per input; cat/split: split and concat)."""


def host_times(host: dict) -> dict:
    """The profile's host block (timeline.py) from host.json's loops of tiny eager ops: `fwd_op_s` = median per-op
    time of the forward loops (autograd recording on), `bwd_op_s` = median of (forward+backward - forward) per
    op over its backward kernels, `view_op_s` = the eager launch floor (an in-place add without autograd)."""
    import statistics

    ops = [r for r in host["rows"] if r.get("kind") == "eager_op"]
    floor = [r["seconds_per_op"] for r in host["rows"] if r.get("kind") == "eager_launch_floor"]
    return {"fwd_op_s": statistics.median(r["fwd_s_per_op"] for r in ops),
            "bwd_op_s": statistics.median((r["fwd_bwd_s_per_op"] - r["fwd_s_per_op"]) / BWD_KERNELS.get(r["op"], 1)
                                          for r in ops),
            "view_op_s": floor[0] if floor else statistics.median(r["fwd_s_per_op"] for r in ops),
            "source": "host.json: loops of tiny eager PyTorch ops on the H200's host (16-core Xeon): forward per "
                      "op, backward per kernel, launch floor for host-only dispatches",
            "ops": {r["op"]: [r["fwd_s_per_op"], r["fwd_bwd_s_per_op"]] for r in ops}}


def _op_counts(row: dict) -> tuple[int, int, int, int, int, int, int]:
    """(forward ops, forward views, backward ops, backward views, backward launches, forward parts, backward parts)
    the planner enumerates (kernels.py) for one host_model.json row, the model configured as benchmarks/planner.py
    configures the H200 rows; parts (`kernel_ops.part`: dispatched ops whose device time is in a composite row) are
    not among the ops."""
    from llmtrain.config import compose_config, register_configs, to_config
    from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels
    from benchmarks.planner import h200_overrides

    register_configs()
    a = row["arch"]
    cfg = to_config(compose_config(h200_overrides(a, row["micro_batch"], row["recompute"]))).model
    mb = micro_batch_kernels(MicroBatchSpec(cfg, row["micro_batch"], a["seq"], 1, 2, True, True,
                                            "full" if row["recompute"] else "none"))
    f, b = mb.forward, mb.backward
    nf = sum(k.kind not in ("view", "part") for k in f)
    nb = sum(k.kind not in ("view", "part") and k.host != "launch" for k in b)
    # launched by the autograd engine at the bare launch cost (kernels.Kernel.host): gradient sums inside the
    # backward and the add of each parameter's gradient into its zeroed buffer (one per parameter tensor)
    launches = sum(k.host == "launch" for k in b) + row["tensors"]
    vf, vb = sum(k.kind == "view" for k in f), sum(k.kind == "view" for k in b)
    return nf, vf, nb, vb, launches, sum(k.kind == "part" for k in f), sum(k.kind == "part" for k in b)


def bare_view_s(launches: dict) -> float:
    """The median host seconds of one bare view (reshape, transpose, split, chunk, unsqueeze: no device kernel)
    from launches.json's generic rows (benchmarks/gpu_moe_launches.py)."""
    got = [r["host_s"] for r in launches["rows"] if str(r.get("op", "")).startswith("view_") and "host_s" in r]
    if not got:
        raise ValueError("launches.json has no bare view rows (view_*): measured before they were added")
    return statistics.median(got)


def bare_part_s(host: dict) -> tuple[float, float]:
    """(forward, backward) host seconds of one bare eager op with autograd, host.json's `mul` row (fwd_s_per_op,
    fwd_bwd_s_per_op - fwd_s_per_op): what a `part` (an op inside a composite row: RoPE's neg/cat/mul/add, the
    unfused SwiGLU's product, the loss's cast) costs, called from inside one function, no module around it."""
    mul = next(r for r in host["rows"] if r.get("kind") == "eager_op" and r.get("op") == "mul")
    return mul["fwd_s_per_op"], mul["fwd_bwd_s_per_op"] - mul["fwd_s_per_op"]


def host_block(data: Path, host: dict, views: Path | None) -> dict:
    """The host block from `data`'s host_model.json (`host_from_model`; without it host.json's loops, `host_times`),
    with `view_op_s` from the bare views of `views` (a launches.json) and the parts at host.json's eager `mul` when
    given."""
    hm = data / "host_model.json"
    if not hm.exists():
        return host_times(host)
    view_s = bare_view_s(json.loads(views.read_text())) if views is not None else None
    return host_from_model(json.loads(hm.read_text()), host, view_s, bare_part_s(host) if view_s is not None else None)


def host_from_dispatch(rows: list[dict], base: dict, kinds=("real",)) -> dict:
    """`base` (a host block) with the forward's and backward's per-op host seconds and the per-micro-batch constant
    refitted to dispatch.json's rows of `kinds` (benchmarks/gpu_dispatch.py: the host seconds until the forward's and
    the backward's call return, unsynchronised, at real shapes where the device is the slower side): least squares
        fwd_host_s = fwd_op_s·ops + view_op_s·views + part_fwd_s·parts + c_fwd
        bwd_host_s = bwd_op_s·ops + view_op_s·views + part_bwd_s·parts + launch_op_s·launches + c_bwd
    over the dispatches kernels.py counts (`_op_counts`), the view, part and launch seconds kept from `base`. Rows
    whose dispatch reached their wall time (`queue_bound`) are left out: their host figure is not the host's."""
    import numpy as np

    use = [r for r in rows if r.get("kind") in kinds and "fwd_host_s" in r and not r.get("queue_bound")]
    if len(use) < 2:
        raise ValueError(f"dispatch rows of kinds {kinds}: {len(use)} usable (need 2)")
    view, launch = base["view_op_s"], base["launch_op_s"]
    pf_s, pb_s = base.get("part_fwd_s", 0.0), base.get("part_bwd_s", 0.0)
    ef, yf, eb, yb, check = [], [], [], [], {}
    for r in use:
        nf, vf, nb, vb, nl, pf, pb = _op_counts(r)
        ef.append([nf, 1.0])
        yf.append(r["fwd_host_s"] - view * vf - pf_s * pf)
        eb.append([nb, 1.0])
        yb.append(r["bwd_host_s"] - view * vb - pb_s * pb - launch * nl)
    (fwd, c_f), (bwd, c_b) = (np.linalg.lstsq(np.array(e, float), np.array(y), rcond=None)[0] for e, y in
                              ((ef, yf), (eb, yb)))
    for r, e_f, y_f, e_b, y_b in zip(use, ef, yf, eb, yb):
        check[f"{r['name']}:{r.get('variant', '')}"] = {
            "fwd_s": [round(r["fwd_host_s"], 6), round(r["fwd_host_s"] - y_f + fwd * e_f[0] + c_f, 6)],
            "bwd_s": [round(r["bwd_host_s"], 6), round(r["bwd_host_s"] - y_b + bwd * e_b[0] + c_b, 6)]}
    return {**base, "fwd_op_s": float(fwd), "bwd_op_s": float(bwd), "micro_batch_s": max(float(c_f + c_b), 0.0),
            "source": base.get("source", "") + f"; fwd_op_s, bwd_op_s and micro_batch_s refitted to {len(use)} "
                      f"dispatch rows ({', '.join(kinds)} shapes: unsynchronised host seconds, "
                      "benchmarks/fit_h200.py host_from_dispatch)",
            "dispatch_check": {"measured_vs_fitted": check, "note": "[measured, fitted] host seconds per row"}}


def host_from_model(host_model: dict, host: dict, view_s: float | None = None,
                    part_s: tuple[float, float] | None = None) -> dict:
    """The profile's host block from host_model.json: the twin's forward (with the loss) and backward at tiny
    shapes, whose wall time is the host's, against the dispatches the planner counts for the same model
    (`_op_counts`). Least squares over the rows without recompute (both sweeps' medians averaged per row):
        fwd_s = fwd_op_s·ops + view_op_s·views + c_fwd
        fwd_bwd_s - fwd_s - launch_op_s·launches = bwd_op_s·ops + view_op_s·views + c_bwd
    where `launch_op_s` is host.json's eager launch floor (a tiny in-place add dispatched from Python; the
    autograd engine's own launches, gradient sums and the adds into the zeroed gradient buffers, cost no more);
    `micro_batch_s` = c_fwd + c_bwd (the forward call, the loss and the autograd engine's start, per micro-batch);
    with `view_s` (a bare view's host seconds measured alone: `bare_view_s`) `view_op_s` is that measurement and
    the other four are fitted around it (the rows alone cannot tell views from ops: both grow with the layers);
    with `part_s` (forward, backward seconds of a bare eager op: `bare_part_s`) the parts are priced at it
    (`part_fwd_s`, `part_bwd_s`), without it they count as ops;
    `step_s` = the median of step_s - fwd_bwd_s - opt_s (train_step's own Python; the optimizer's time is
    optimizer.json's). Recompute rows are not fitted: their residual is reported (`check`)."""
    import numpy as np

    by: dict[str, list] = {}
    for r in host_model["rows"]:
        by.setdefault(r["name"], []).append(r)
    mean = lambda rs, k: sum(x[k] for x in rs) / len(rs)  # noqa: E731
    launch = [r["seconds_per_op"] for r in host["rows"] if r.get("kind") == "eager_launch_floor"][0]
    eqs, ys, counts = [], [], {}
    for name, rs in by.items():
        counts[name] = _op_counts(rs[0])
        if rs[0]["recompute"]:
            continue
        nf, vf, nb, vb, nl, pf, pb = counts[name]
        if part_s is None:
            nf, nb, pf, pb = nf + pf, nb + pb, 0, 0
        eqs += [[nf, 0, vf, 1, 0], [0, nb, vb, 0, 1]]
        ys += [mean(rs, "fwd_s") - (pf * part_s[0] if pf else 0.0),
               mean(rs, "fwd_bwd_s") - mean(rs, "fwd_s") - launch * nl - (pb * part_s[1] if pb else 0.0)]
    a, y = np.array(eqs, float), np.array(ys)
    if view_s is None:
        fwd, bwd, view, c_f, c_b = (float(v) for v in np.linalg.lstsq(a, y, rcond=None)[0])
    else:
        view = float(view_s)
        fwd, bwd, c_f, c_b = (float(v) for v in np.linalg.lstsq(a[:, [0, 1, 3, 4]], y - view * a[:, 2], rcond=None)[0])
    step = statistics.median(r["step_s"] - r["fwd_bwd_s"] - r["opt_s"] for r in host_model["rows"])
    check = {}
    pfs, pbs = part_s if part_s is not None else (fwd, bwd)
    for name, rs in by.items():
        nf, vf, nb, vb, nl, pf, pb = counts[name]
        pred_f = fwd * nf + view * vf + pfs * pf + c_f
        pred_b = (bwd * nb + view * vb + pbs * pb + c_b + launch * nl) if not rs[0]["recompute"] else None
        if rs[0]["recompute"]:  # the recomputed forward at the forward's cost (timeline.Stream.run)
            cfg_ops = counts[name.replace("-recompute", "")] if name.replace("-recompute", "") in counts else None
            if cfg_ops:
                pred_b = (bwd * cfg_ops[2] + view * cfg_ops[3] + pbs * cfg_ops[6] + c_b + launch * cfg_ops[4] +
                          (pred_f - c_f))
        meas_b = mean(rs, "fwd_bwd_s") - mean(rs, "fwd_s")
        check[name] = {"fwd_s": [round(mean(rs, "fwd_s"), 6), round(pred_f, 6)],
                       "bwd_s": [round(meas_b, 6), round(pred_b, 6) if pred_b is not None else None]}
    prov = host_model.get("provenance", {})
    parts = {"part_fwd_s": part_s[0], "part_bwd_s": part_s[1]} if part_s is not None else {}
    return {"fwd_op_s": fwd, "bwd_op_s": bwd, "view_op_s": view, **parts, "launch_op_s": launch,
            "micro_batch_s": c_f + c_b, "step_s": max(step, 0.0),
            "source": f"host_model.json ({prov.get('date_utc', '?')}, {prov.get('command', '?')}): the model twin "
                      "(benchmarks/gpu_model.py) at tiny shapes (h 64, seq 16, 1-16 layers, llama and gpt), host "
                      "clock after a synchronize; least squares of its forward and backward seconds over the "
                      "dispatches kernels.py counts (benchmarks/fit_h200.py host_from_model)" +
                      (f"; view_op_s measured alone ({view_s * 1e6:.2f} us: bare views' host seconds, launches.json), "
                       "the rest fitted around it" if view_s is not None else "") +
                      ("; parts at a bare eager op with autograd (host.json `mul`)" if part_s is not None else ""),
            "check": {"measured_vs_fitted": check, "note": "[measured, fitted] seconds per row; recompute rows "
                      "not fitted"},
            "tiny_op_loop": {k: v for k, v in host_times(host).items() if k != "ops"}}


def optimizer_rows(rows: list[dict]) -> list[dict]:
    """optimizer.json rows -> {tensors, numel, seconds}: the whole step (clip, AdamW per chunk, zeroing)."""
    return [{"tensors": r["tensors"], "numel": r["params"], "seconds": r["step_s"]} for r in rows if r.get("step_s")]


def moe_tables(dirs: list[Path]) -> dict:
    """The profile blocks fitted from benchmarks/gpu_tables.py directories (kernel tables only; see the module
    docstring): {"bmm", "gemm_exact", "attention_long", "moe_classes", "provenance"}; {} when absent."""
    from llmtrain.plan.fit import fit_attention

    def load(name):
        found = [json.loads((d / f"{name}.json").read_text()) for d in dirs if (d / f"{name}.json").exists()]
        if not found:
            return None
        return {"rows": [r for f in found for r in f["rows"]], "provenance": [f.get("provenance", {}) for f in found]}

    out, prov = {}, {}
    bmm = load("bmm")
    if bmm:
        med: dict = {}
        for r in bmm["rows"]:
            if r.get("seconds"):
                med.setdefault((r["batch"], r["m"], r["n"], r["k"], r["layout"]), []).append(r["seconds"])
        out["bmm"] = {"rows": [[*key, 2.0 * key[0] * key[1] * key[2] * key[3] / statistics.median(t)]
                               for key, t in sorted(med.items())]}
        prov["bmm"] = bmm.get("provenance", {})
    extra = load("gemm_extra")
    if extra:
        med = {}
        for r in extra["rows"]:
            if r.get("seconds"):
                med.setdefault((r["m"], r["n"], r["k"], r["layout"]), []).append(r["seconds"])
        out["gemm_exact"] = {"rows": [[*key, 2.0 * key[0] * key[1] * key[2] / statistics.median(t)]
                                      for key, t in sorted(med.items())]}
        prov["gemm_extra"] = extra.get("provenance", {})
    attn = load("attention_long")
    if attn:
        rows = [r for r in attn["rows"] if r.get("way") == "flash_twin_views" and r.get("fwd_s")]
        fitted = fit_attention(rows)  # [bh, s, d, causal, fwd, bwd]
        out["attention_long"] = {"rows": [[*f[:4], r["kv_heads"], *f[4:]] for f, r in zip(fitted, rows)]}
        prov["attention_long"] = attn.get("provenance", {})
    ops = load("moe_ops")
    if ops:
        by: dict = {}
        for r in ops["rows"]:
            if r.get("seconds") and "eager" not in str(r.get("timing", "")):
                by.setdefault(r["op"], {}).setdefault(float(r["numel"]), []).append(r["seconds"])
        out["moe_classes"] = {op: [[n, statistics.median(t)] for n, t in sorted(sizes.items())]
                              for op, sizes in sorted(by.items())}
        prov["moe_ops"] = ops.get("provenance", {})
    if out:
        out["provenance"] = prov
    return out


def main(argv: list[str]) -> None:
    data = Path(argv[0] if argv and not argv[0].startswith("--") else "benchmarks/data/h200")
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else \
        Path(__file__).resolve().parent.parent / "llmtrain/plan/profiles/h200.json"
    raw, prov = read_tables(data)
    views = Path(argv[argv.index("--views-from") + 1]) if "--views-from" in argv else None
    raw["host"] = host_block(data, raw["host"], views)
    if views:  # the H200 calls measured no bare view: PyTorch's view dispatch on another call's host, named
        raw["host"]["source"] += f" (view_op_s from {views}: not measured on the H200's host)"
    raw["optimizer"] = optimizer_rows(raw["optimizer"])
    g = prov.get("gemm", {})
    prov["summary"] = (f"({g.get('gpu', 'H200')}, driver {g.get('driver', '?')}, CUDA {g.get('cuda', '?')}, torch "
                       f"{g.get('torch', '?')}, {g.get('date_utc', '?')}; CUDA events, medians)")
    prov["fitted_by"] = f"python benchmarks/fit_h200.py {data}" + (f" --views-from {views}" if views else "")
    prof = fit_profile(raw, BASE, prov)
    prof["optimizer"]["includes_clip"] = True  # step_s holds the clip (and zeroing the grads)
    moe_arg = argv[argv.index("--moe-data") + 1] if "--moe-data" in argv else \
        f"{data.parent / 'h200_moe'},{data.parent / 'h200_moe' / 'final'}"
    moe_dirs = [Path(x) for x in moe_arg.split(",") if x]
    extra = moe_tables(moe_dirs)
    if extra:
        src = f"fitted from {moe_arg} (benchmarks/gpu_tables.py), kernel tables only"
        for key in ("bmm", "gemm_exact", "attention_long"):
            if key in extra:
                prof[key] = {"source": src, **extra[key]}
        prof["memory_bound"]["classes"].update(extra.get("moe_classes", {}))
        prof["provenance"]["moe_tables"] = extra["provenance"]
        prof["provenance"]["fitted_by"] += f" --moe-data {moe_arg}"
    out.write_text(json.dumps(prof, indent=1))
    print(f"wrote {out}: {len(prof['gemm']['rows'])} GEMM shapes, {len(prof.get('attention', {}).get('rows', []))} "
          f"attention rows, memory-bound classes {sorted(prof['memory_bound']['classes'])}, host {prof['host']}, "
          f"optimizer {prof['optimizer']}")


if __name__ == "__main__":
    main(sys.argv[1:])

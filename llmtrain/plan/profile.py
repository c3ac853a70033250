"""Device profiles as data: one JSON file per device under llmtrain/plan/profiles/, with provenance.

    python -m llmtrain.plan plan.device=h200 ...             # llmtrain/plan/profiles/h200.json
    python -m llmtrain.plan plan.profile=work/cpu-here.json  # a profile `--calibrate` wrote
    prof = load_profile("h200"); prof.gemm_seconds(4096, 5632, 2048)

A profile holds the device's constants (datasheet peak, memory, links) and the measured tables of the
operator-level cost model (llmtrain/plan/kernels.py, timeline.py):

- `gemm.rows` [m, n, k, FLOP/s]: an exact measured shape returns its own rate; otherwise log(rate) is
  interpolated trilinearly in (log m, log n, log k) over the grid rows around the shape (coordinates clamped
  to the grid's range; corners the grid lacks, e.g. above its FLOP cap, are left out and the weights
  renormalised; with no corner at all, inverse-distance weighting of the nearest rows);
- `gemm_layouts` (profiles from `--calibrate`) {"nt": {"rows": ...}, "tn": {...}}: the same grid timed with B
  (`transpose_y`) or A (`transpose_x`) read transposed, as Paddle's matmul_grad computes a linear's input and
  weight gradients; kernels carry their layout (kernels.Kernel.layout), "nn" and any layout without a table use
  `gemm`;
- `attention.rows` [batch·heads, seq, head_dim, causal, fwd FLOP/s, bwd FLOP/s] (flash attention), the same way
  in (log batch·heads, log seq), among rows of the same head dim and causality when there are any;
- `attention_math` (CPU profiles from `--calibrate`) {"fwd": [[batch·heads, seq, head_dim, FLOP/s], ...], "bwd":
  [...]}: the math attention core as llmtrain's `layers.math_attention` runs it (views of q, k, v, both batched
  matmuls on strided operands, the scale, the causal mask, the softmax; its backward through autograd), one
  composite op priced by its rate at (b·heads, seq, head_dim) interpolated as GEMM rates are (the FLOPs of the
  full s² square, kernels.attention_flops(..., causal=False)); a profile without it prices the core as its
  batched GEMMs and memory-bound ops (kernels.py);
- `gemm_exact.rows` [m, n, k, layout, FLOP/s] (h200: benchmarks/data/h200_moe/gemm_extra.json): shapes measured
  for the MoE and long-sequence rows, used only where a kernel's (m, n, k, layout) is one of them exactly and
  `gemm` has no row of that (m, n, k), so they move no interpolated rate of `gemm`; not carried into profiles
  scaled from this one (`scaled_from`: their `gemm` grid keeps its interpolation);
- `bmm.rows` [batch, m, n, k, layout, FLOP/s] (the experts' batched GEMMs, [E, C, h] x [E, h, f] and their
  gradients): an exact shape its own rate; otherwise log(rate) interpolated linearly in log m (the capacity)
  between the measured rows of the same (batch, n, k, layout), the end rows' rates outside them (the rate of a
  longer buffer taken as the longest measured one's); without such rows, `gemm` at (batch·m, n, k);
- `attention_long.rows` [batch·heads, seq, head_dim, causal, kv_heads, fwd FLOP/s, bwd FLOP/s] (flash attention
  measured to 128k on the layout the twin and Paddle run, [b, s, heads, d]): for a sequence longer than the
  longest of `attention.rows`, the rate of the row set of the same head dim (nearest batch·heads), linear in
  log seq between its measured lengths and flat past the longest: long sequences are priced from the measured
  rate, never from a fitted curve;
- `shared_host` (CPU profiles from `--calibrate`): {"ranks": 2, "rows": [{kind, size, slowdown}, ...]}: how
  much slower a GEMM and adds (in cache, streaming) run in the slowest of that many processes computing on the
  host at once than alone (measure.shared_host_table); timeline.step_compute scales a rank's kernels by it when the layout
  puts more than one process on the host;
- `memory_bound.classes` {op class: [[elements of one input, seconds], ...]}: piecewise-linear in log-log
  between sizes, the smallest size's time below it, the largest size's rate above it; a class without rows takes
  the `fallback` class (its backward `X_bwd` first tries `X`);
- `host`: seconds the host spends per eager op in the forward (`fwd_op_s`, with autograd recording) and per
  backward node (`bwd_op_s`), for a `view` op (`view_op_s`) and, on a GPU, for a kernel the autograd engine
  launches by itself (`launch_op_s`: gradient sums and accumulation; absent: `bwd_op_s`); the training loop's
  own work outside the ops,
  `micro_batch_s` per micro-batch and `step_s` per step (0 when absent). GPU: measured on the model's code path
  at tiny shapes (h200: benchmarks/data/h200/host_model.json); CPU: `--calibrate` times the real Trainer on a
  tiny model;
- `optimizer`: AdamW step seconds = `per_tensor_s`·tensors + `per_elem_s`·elements (fitted, multi-precision
  on GPU), clip and accumulation being memory-bound kernels of their own; optional `per_tensor_device_s` (device
  per tensor) and `per_step_s` (host per step), the h100 profile's stream fit (timeline.Stream.run_optimizer);
- `async_launch`: true on a GPU (the host queues kernels and runs ahead: timeline.py overlaps the two), false
  on a CPU (each op runs in its dispatching thread; `tables_include_host`: the tables' times already hold one
  dispatch, so only the autograd extra is added).

A profile may be `scaled_from` another one (`scale`: {"flops", "bandwidth", "host"} factors): the scaled tables are
the source's times divided by the factors, which the file states with their reasons (datasheet ratios).
Every table carries its `source` (where, when, with what it was measured, or which datasheet).
"""
from __future__ import annotations

import bisect
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
GB = 1e9
GIB = 2**30


def _idw(rows: list[tuple], point: tuple, k: int = 6) -> float:
    """Inverse-distance-weighted value of rows [(coords..., value)] at point (coords already transformed)."""
    if len(rows) > 64:  # the same sums with numpy (a ranking interpolates thousands of shapes)
        import numpy as np

        arr = _IDW_ARRAYS.get(id(rows))
        if arr is None or arr[0] is not rows:
            arr = _IDW_ARRAYS[id(rows)] = (rows, np.array(rows, dtype=float))
        table = arr[1]
        d2 = ((table[:, :-1] - np.array(point, dtype=float)) ** 2).sum(axis=1)
        i = int(d2.argmin())
        if d2[i] < 1e-12:
            return float(table[i, -1])
        near = np.argsort(d2, kind="stable")[:k]
        w = 1.0 / d2[near]
        return float((w * table[near, -1]).sum() / w.sum())
    scored = []
    for r in rows:
        d2 = sum((a - b) ** 2 for a, b in zip(r[:-1], point))
        if d2 < 1e-12:
            return r[-1]
        scored.append((d2, r[-1]))
    scored.sort(key=lambda x: x[0])
    near = scored[:k]
    w = [1.0 / d2 for d2, _ in near]
    return sum(wi * v for wi, (_, v) in zip(w, near)) / sum(w)


_IDW_ARRAYS: dict = {}


class GemmTable:
    """Rates of measured GEMM shapes; see the module docstring for the interpolation."""

    def __init__(self, rows):
        self.exact = {(int(m), int(n), int(k)): float(r) for m, n, k, r in rows}
        self.logs = {(math.log(m), math.log(n), math.log(k)): math.log(r) for (m, n, k), r in self.exact.items()}
        self.axes = [sorted({c[i] for c in self.logs}) for i in range(3)]
        self.rows = [(*c, math.exp(v)) for c, v in self.logs.items()]

    def rate(self, m: float, n: float, k: float) -> float:
        hit = self.exact.get((int(m), int(n), int(k)))
        if hit is not None:
            return hit
        point = (math.log(m), math.log(n), math.log(k))
        brackets = []
        for x, axis in zip(point, self.axes):
            x = min(max(x, axis[0]), axis[-1])
            i = min(max(bisect.bisect_right(axis, x), 1), len(axis) - 1) if len(axis) > 1 else 0
            lo, hi = axis[max(i - 1, 0)], axis[i]
            w = 0.0 if hi == lo else (x - lo) / (hi - lo)
            brackets.append(((lo, 1.0 - w), (hi, w)))
        total = acc = 0.0
        for (a, wa) in brackets[0]:
            for (b, wb) in brackets[1]:
                for (c, wc) in brackets[2]:
                    w = wa * wb * wc
                    v = self.logs.get((a, b, c))
                    if w > 0 and v is not None:
                        total += w
                        acc += w * v
        if total > 1e-9:
            return math.exp(acc / total)
        return _idw(self.rows, point)


@dataclass
class Curve:
    """Seconds vs elements of one memory-bound op class, piecewise-linear in log-log."""

    xs: list
    ys: list

    @classmethod
    def of(cls, rows):
        rows = sorted((float(b), float(t)) for b, t in rows if b > 0 and t > 0)
        if not rows:
            raise ValueError("a memory-bound class needs at least one [bytes, seconds] row")
        return cls([math.log(b) for b, _ in rows], [math.log(t) for _, t in rows])

    def seconds(self, nbytes: float) -> float:
        if nbytes <= 0:
            return math.exp(self.ys[0])
        x = math.log(nbytes)
        if x <= self.xs[0]:
            return math.exp(self.ys[0])
        if x >= self.xs[-1]:  # the largest size's bandwidth
            return math.exp(self.ys[-1]) * nbytes / math.exp(self.xs[-1])
        i = bisect.bisect_right(self.xs, x)
        x0, x1, y0, y1 = self.xs[i - 1], self.xs[i], self.ys[i - 1], self.ys[i]
        return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class BmmTable:
    """Rates of measured batched GEMMs [(batch, m, n, k, layout, FLOP/s)]; see the module docstring."""

    def __init__(self, rows):
        self.exact = {(int(b), int(m), int(n), int(k), lay): float(r) for b, m, n, k, lay, r in rows}
        self.lines: dict = {}
        for (b, m, n, k, lay), r in self.exact.items():
            self.lines.setdefault((b, n, k, lay), []).append((math.log(m), math.log(r)))
        for pts in self.lines.values():
            pts.sort()

    def rate(self, batch: int, m: int, n: int, k: int, layout: str) -> float | None:
        hit = self.exact.get((int(batch), int(m), int(n), int(k), layout))
        if hit is not None:
            return hit
        pts = self.lines.get((int(batch), int(n), int(k), layout))
        if not pts:
            return None
        return math.exp(_piecewise(pts, math.log(max(m, 1))))


@dataclass
class Profile:
    name: str
    peak_flops: float
    """Datasheet dense FLOP/s in the training dtype (MFU's denominator), or the measured matmul peak on a CPU."""
    memory_bytes: float
    nvlink_bw: float
    net_bw: float
    nvlink_alpha: float
    net_alpha: float
    framework_bytes: float
    dtype_bytes: int
    async_launch: bool
    tables_include_host: bool
    gemm: GemmTable
    attn_rows: list
    mem_curves: dict
    fallback: str
    host: dict
    optimizer: dict
    p2p_bw: float | None = None
    host_bw: float | None = None
    """Bytes/s one way between the device and pinned host memory (PCIe x16, datasheet; `links.host_bw`): the price of
    offload (llmtrain/plan/recompute.py); None on a CPU profile (host and device are one memory)."""
    p2p_alpha: float | None = None
    fp8: Any = None
    """`train.fp8`: how the transformer's GEMMs are priced in FP8 (`llmtrain.plan.fp8.FP8Pricing`), None: not."""
    burst_alpha: float | None = None
    """Latency of a collective issued back to back with the previous one (ranks already in step: the quiet
    alpha, where `nvlink_alpha`/`net_alpha` of a CPU profile are those of collectives between computing ranks);
    None: the link's alpha."""
    reduce_call_s: float | None = None
    broadcast_call_s: float | None = None
    """Seconds per `reduce` / `broadcast` of a small tensor issued back to back, as fleet's stage-1 sharding
    optimizer issues one per gradient and per updated parameter (`--calibrate`, calibrate._back_to_back; CPU
    profiles), or None: `burst_alpha`."""
    alpha_by_gap: list | None = None
    """[(gap s, alpha s)] ascending: a collective's latency between ranks that computed `gap` seconds since their
    last meeting (`--calibrate`'s busy all-reduces at several gaps; CPU profiles), or None: the link's alpha."""
    shared_host: dict | None = None
    """`--calibrate`'s measured slowdown of kernels while several processes compute on this host
    (measure.shared_host_table), or None."""
    math_attn: dict | None = None
    """{"fwd": GemmTable, "bwd": GemmTable} over (batch·heads, seq, head_dim) of the measured math attention core,
    or None (then kernels.py decomposes the core)."""
    gemm_layouts: dict = field(default_factory=dict)
    """{"nt" | "tn": GemmTable} measured with that operand transposed (CPU profiles from `--calibrate`: on this
    CPU a weight gradient Xᵀ @ dY ran up to 30% slower than the same shape untransposed); absent: `gemm`."""
    gemm_exact: dict = field(default_factory=dict)
    """{(m, n, k, layout): FLOP/s} of `gemm_exact` (exact hits only)."""
    bmm: BmmTable | None = None
    """The experts' batched GEMMs (`bmm`), or None: `gemm` at (batch·m, n, k)."""
    attn_long: list = field(default_factory=list)
    """`attention_long.rows` [(batch·heads, seq, head_dim, causal, kv_heads, fwd FLOP/s, bwd FLOP/s)]."""
    source: str = ""
    raw: dict = field(default_factory=dict, repr=False)

    # -- per-op times -------------------------------------------------------------------------------------------
    def gemm_seconds(self, m: int, n: int, k: int, batch: int = 1, layout: str = "nn") -> float:
        """Seconds of a (batched) GEMM C[m, n] = A[m, k] @ B[k, n]; a batch counts as batch·m rows for its rate;
        `layout` "nt" / "tn" (B / A read transposed) from that layout's table where the profile has one
        (`gemm_layouts`), else from `gemm`."""
        flops = 2.0 * m * n * k * batch
        if flops <= 0:
            return 0.0
        if batch > 1 and self.bmm is not None:
            r = self.bmm.rate(batch, m, n, k, layout)
            if r is not None:
                return flops / r
        table = self.gemm_layouts.get(layout, self.gemm)
        if batch == 1 and self.gemm_exact and (int(m), int(n), int(k)) not in table.exact:
            r = self.gemm_exact.get((int(m), int(n), int(k), layout))
            if r is not None:
                return flops / r
        return flops / table.rate(m * batch, n, k)

    def attention_seconds(self, bh: int, s: int, d: int, causal: bool, flops: float, backward: bool) -> float:
        rows = [r for r in self.attn_rows if r[2] == d and r[3] == causal] or self.attn_rows
        if not rows:
            raise ValueError(f"profile {self.name}: no attention rows (flash attention cannot be costed)")
        if self.attn_long and s > max(r[1] for r in rows):
            return flops / self.long_attention_rate(bh, s, d, causal, backward)
        i = 5 if backward else 4
        rate = _idw([(math.log(r[0]), math.log(r[1]), r[i]) for r in rows], (math.log(bh), math.log(s)))
        return flops / rate

    def long_attention_rate(self, bh: int, s: int, d: int, causal: bool, backward: bool) -> float:
        """FLOP/s of flash attention past the `attention` table's longest sequence, from `attention_long`: the
        row set of head dim d (else the nearest head dim) and causality, nearest in batch·heads, linear in
        log seq between its lengths, the longest length's rate beyond it."""
        rows = [r for r in self.attn_long if r[3] == causal] or self.attn_long
        dd = min({r[2] for r in rows}, key=lambda x: abs(math.log(x / d)))
        rows = [r for r in rows if r[2] == dd]
        nb = min({r[0] for r in rows}, key=lambda x: abs(math.log(x / bh)))
        i = 6 if backward else 5
        pts = sorted((math.log(r[1]), r[i]) for r in rows if r[0] == nb)
        return _piecewise(pts, math.log(s))

    def math_attention_seconds(self, bh: int, s: int, d: int, flops: float, backward: bool) -> float:
        """Seconds of the composite math attention core (forward, or its backward) from `attention_math`."""
        if not self.math_attn:
            raise ValueError(f"profile {self.name}: no attention_math rows (the math core is costed op by op)")
        return flops / self.math_attn["bwd" if backward else "fwd"].rate(bh, s, d)

    def alpha_at(self, gap_s: float, default: float) -> float:
        """A collective's alpha between ranks that each compute `gap_s` seconds between two calls: `alpha_by_gap`
        interpolated linearly in log(gap), its end values outside it; `default` for a profile without it."""
        if not self.alpha_by_gap:
            return default
        return _piecewise([(math.log(g), a) for g, a in self.alpha_by_gap], math.log(gap_s))

    def shared_host_slowdown(self, local_ranks: float) -> dict:
        """{"attention", "host": factor (the GEMMs' median), "gemm": [(log operand elements, log factor)], "mem":
        [(log elements of one input, log factor)] (`slowdown_at`), "optimizer": factor} for `local_ranks`
        processes computing at once on one host, from the `shared_host` table (measured with its `ranks` processes; more ranks than that take
        the same factors; a fractional `local_ranks`, other processes busy part of the time, that share of the
        slowdown); {} for one rank or a profile without the table."""
        t = self.shared_host
        if local_ranks <= 1 or not t:
            return {}
        # local_ranks between 1 and the measured ranks (processes busy part of the time, e.g. pipeline stages):
        # that share of the measured slowdown
        share = min(1.0, (local_ranks - 1) / max(1, int(t["ranks"]) - 1))
        part = lambda f: 1.0 + share * (float(f) - 1.0)  # noqa: E731
        gemm = sorted((3 * r["size"] ** 2, r["slowdown"]) for r in t["rows"] if r["kind"] == "gemm")
        mem = sorted((r["size"], r["slowdown"]) for r in t["rows"] if r["kind"] == "memory_bound")
        g = part(statistics.median(f for _, f in gemm)) if gemm else 1.0
        out = {"gemm": [(math.log(n), math.log(part(f))) for n, f in gemm] if gemm else g, "attention": g, "host": g}
        if mem:
            out["mem"] = [(math.log(n), math.log(part(f))) for n, f in mem]
            out["optimizer"] = part(mem[-1][1])  # AdamW streams its states: the largest add's factor
        return out

    def mem_seconds(self, op: str, numel: float) -> float:
        curve = self.mem_curves.get(op)
        if curve is None and op.endswith("_bwd"):
            curve = self.mem_curves.get(op[:-4])
        if curve is None:
            curve = self.mem_curves[self.fallback]
        return curve.seconds(numel)

    def optimizer_seconds(self, numel: int, tensors: int) -> float:
        o = self.optimizer
        return (o.get("per_step_s", 0.0) + (o["per_tensor_s"] + o.get("per_tensor_device_s", 0.0)) * tensors
                + o["per_elem_s"] * numel)


def slowdown_at(factor, numel: float) -> float:
    """A `shared_host_slowdown` entry at a kernel of `numel` elements: a number as is; [(log size, log factor)]
    interpolated linearly in log-log between the measured sizes, the nearest size's factor outside them."""
    if not isinstance(factor, list):
        return float(factor)
    return math.exp(_piecewise(factor, math.log(max(numel, 1.0))))


def _piecewise(points: list, x: float) -> float:
    """y at x on the polyline through `points` [(x, y)] ascending in x; the end values outside it."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    i = bisect.bisect_right([a for a, _ in points], x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _scaled(raw: dict, base: dict) -> dict:
    """`raw` (a scaled profile) with the tables of `base` divided by raw["scale"]'s factors."""
    f = raw["scale"]
    flops, bw, host = float(f["flops"]), float(f["bandwidth"]), float(f.get("host", 1.0))
    out = dict(base)
    out.update({k: v for k, v in raw.items() if k not in ("gemm", "attention", "memory_bound", "host", "optimizer")})
    out.pop("gemm_exact", None)  # exact hits of the measured device only: a scaled grid keeps its interpolation
    for key, first in (("bmm", 5), ("attention_long", 5)):  # rates from column `first` on
        if base.get(key):
            out[key] = {"source": f"{base['name']} {key} rates x {flops:.4g}", "rows": [
                [*r[:first], *(x * flops for x in r[first:])] for r in base[key]["rows"]]}
    out["gemm"] = {"source": f"{base['name']} gemm rates x {flops:.4g}", "rows": [
        [m, n, k, r * flops] for m, n, k, r in base["gemm"]["rows"]]}
    out["attention"] = {"source": f"{base['name']} attention rates x {flops:.4g}", "rows": [
        [*r[:4], r[4] * flops, r[5] * flops] for r in base["attention"]["rows"]]}
    out["memory_bound"] = {"fallback": base["memory_bound"]["fallback"],
                           "source": f"{base['name']} memory-bound times / {bw:.4g} above 2**19 elements (launch floor kept)",
                           "classes": {c: [[n, t if n < 2**19 else t / bw] for n, t in rows]
                                       for c, rows in base["memory_bound"]["classes"].items()}}
    out["host"] = {k: (v / host if k.endswith("_s") else v) for k, v in base["host"].items()}
    out["optimizer"] = {**base["optimizer"], "per_elem_s": base["optimizer"]["per_elem_s"] / bw,
                        "per_tensor_s": base["optimizer"]["per_tensor_s"] / host}
    for k, f in (("per_tensor_device_s", bw), ("per_step_s", host)):
        if k in base["optimizer"]:
            out["optimizer"][k] = base["optimizer"][k] / f
    return out


def from_dict(raw: dict, where: str = "") -> Profile:
    if "scaled_from" in raw:
        raw = _scaled(raw, _raw(raw["scaled_from"]))
    need = ("name", "peak_flops", "memory_bytes", "links", "gemm", "memory_bound", "host", "optimizer")
    missing = [k for k in need if k not in raw]
    if missing:
        raise ValueError(f"{where or raw.get('name', '?')}: device profile lacks {missing}")
    links = raw["links"]
    mb = raw["memory_bound"]
    return Profile(
        name=raw["name"], peak_flops=float(raw["peak_flops"]), memory_bytes=float(raw["memory_bytes"]),
        nvlink_bw=float(links["nvlink_bw"]), net_bw=float(links["net_bw"]),
        nvlink_alpha=float(links["nvlink_alpha"]), net_alpha=float(links["net_alpha"]),
        p2p_bw=links.get("p2p_bw"), host_bw=links.get("host_bw"), p2p_alpha=links.get("p2p_alpha"), burst_alpha=links.get("burst_alpha"),
        reduce_call_s=links.get("reduce_call_s"), broadcast_call_s=links.get("broadcast_call_s"),
        alpha_by_gap=sorted(tuple(map(float, r)) for r in links["alpha_by_gap"]) if links.get("alpha_by_gap") else None,
        framework_bytes=float(raw.get("framework_bytes", 2 * GIB)), dtype_bytes=int(raw.get("dtype_bytes", 2)),
        async_launch=bool(raw.get("async_launch", True)), tables_include_host=bool(raw.get("tables_include_host", False)),
        gemm=GemmTable(raw["gemm"]["rows"]),
        gemm_layouts={lay: GemmTable(t["rows"]) for lay, t in raw.get("gemm_layouts", {}).items()},
        attn_rows=[tuple(r) for r in raw.get("attention", {}).get("rows", [])],
        attn_long=[tuple(r) for r in raw.get("attention_long", {}).get("rows", [])],
        gemm_exact={(int(m), int(n), int(k), lay): float(r) for m, n, k, lay, r in raw.get("gemm_exact", {}).get("rows", [])},
        bmm=BmmTable(raw["bmm"]["rows"]) if raw.get("bmm", {}).get("rows") else None,
        shared_host=raw.get("shared_host"),
        math_attn=({k: GemmTable(raw["attention_math"][k]) for k in ("fwd", "bwd")}
                   if raw.get("attention_math", {}).get("fwd") else None),
        mem_curves={c: Curve.of(rows) for c, rows in mb["classes"].items() if rows},
        fallback=mb.get("fallback", "copy"), host=dict(raw["host"]), optimizer=dict(raw["optimizer"]),
        source=raw.get("source", where), raw=raw)


def names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


@lru_cache(maxsize=None)
def _raw(name: str) -> dict:
    path = PROFILE_DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"plan.device={name!r}: no profile {path}; expected one of {names()}")
    return json.loads(path.read_text())


def load_profile(name: str, path: str | None = None) -> Profile:
    """The packaged profile `name`, or the file `path` when given and present (a calibrated profile)."""
    if path and os.path.exists(path):
        with open(path) as f:
            return from_dict(json.load(f), path)
    return from_dict(_raw(name), str(PROFILE_DIR / f"{name}.json"))


def datasheet_peak(gpu_name: str) -> tuple[float, str] | None:
    """(dense peak FLOP/s, profile name) of the packaged GPU profile whose `match` strings occur in `gpu_name`
    (e.g. "NVIDIA H200"), or None. The one table of GPU peaks (train/peak.py reads it)."""
    hits = [(len(m), n) for n in names() for m in _raw(n).get("match", []) if m in gpu_name]
    if not hits:  # the longest match wins ("H200" over "H20")
        return None
    n = max(hits)[1]
    return float(_raw(n)["peak_flops"]), n


SCALING_ERROR = ("scaling the H200's tables by datasheet ratios gave an H100 profile {scaled}; the measured h100 "
                 "profile: {measured} (benchmarks/README.md, \"H100\")")
"""The measured error of datasheet scaling, printed beside every profile that is scaled rather than measured."""
SCALING_FIGURES = {"scaled": "10.8% off on average and up to +29% on measured H100 steps",
                   "measured": "dense 11/12 within 10% (mean 3.9%, worst +10.9%), 16k-64k 5/5 (mean 1.6%), MoE "
                               "capacity 5/5 within 10% (worst -8.9%), dropless 5/5 within 15% at a balanced router's "
                               "expected busiest expert (worst -7.4%)"}


def measured_note(name: str) -> str:
    """One line on where profile `name`'s tables come from: "measured on ..." or "UNMEASURED: ..." with the
    measured error of the datasheet scaling that made it."""
    raw = _raw(name)
    if "scaled_from" not in raw:
        if name == "cpu-here":
            return "measured on this machine (python -m llmtrain.plan --calibrate)"
        return f"measured on one GPU {raw.get('provenance', {}).get('summary', '')}".strip()
    base, f = raw["scaled_from"], raw["scale"]
    how = (f"the {base} profile's measured tables with this device's links" if float(f["flops"]) == 1.0 and
           float(f["bandwidth"]) == 1.0 else f"the {base} profile's measured tables scaled by datasheet ratios (flops "
           f"x{float(f['flops']):.3g}, memory bandwidth x{float(f['bandwidth']):.3g})")
    return f"UNMEASURED: {how}; " + SCALING_ERROR.format(**SCALING_FIGURES)

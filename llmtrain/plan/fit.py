"""Fit a device profile (profile.py) from raw kernel tables: the H200's (benchmarks/data/h200/) or Paddle's own
(`python -m llmtrain.plan --calibrate`, measure.py). Kernel tables only: end-to-end steps are never fitted.

    python benchmarks/fit_h200.py benchmarks/data/h200       # the packaged h200 profile
    profile = fit_profile({"gemm": [...], "memory_bound": [...], "host": {...}, "optimizer": [...]}, base)

- gemm: every row's achieved FLOP/s at its (m, n, k) (layouts pooled, or split into `gemm` ("nn") and
  `gemm_layouts` ("nt", "tn") for `--calibrate`'s tables; the median where a shape repeats);
- attention: per row [batch·heads, seq, head_dim, causal, fwd FLOP/s, bwd FLOP/s] with the FLOPs of
  kernels.attention_flops (causal halves, backward 2.5x);
- attention_math (CPU): the composite math attention core, forward and backward rates per (batch·heads, seq,
  head_dim);
- memory_bound: rows grouped into op classes (`op_class`: rmsnorm_fwd -> rmsnorm, cast_bf16_fp32 -> cast, ...),
  each class [elements of one input (`numel`), seconds] (median per size);
- host: the per-op times of eager execution (GPU: `fwd_op_s`, `bwd_op_s`, `view_op_s`; CPU: the autograd
  extras over a bare call, the bare call being inside the tables);
- optimizer: least squares of seconds = per_tensor_s·tensors + per_elem_s·elements over the AdamW rows
  (non-negative; a coefficient that comes out negative is dropped and the other refitted); or (`fit_optimizer_stream`,
  the h100 profile) the four constants of the stream the planner runs the update in on a GPU, fitted to every row's
  relative error.
"""
from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from llmtrain.plan.kernels import attention_flops

CLASS_RULES = [  # (regex on the raw op name, class); first match wins
    (r"rms_?norm.*(bwd|backward|grad)", "rmsnorm_bwd"), (r"rms_?norm", "rmsnorm"),
    (r"layer_?norm.*(bwd|backward|grad)", "layernorm_bwd"), (r"layer_?norm", "layernorm"),
    (r"(swiglu|silu_?mul).*(bwd|backward|grad)", "swiglu_bwd"), (r"swiglu|silu_?mul", "swiglu"),
    (r"silu.*(bwd|backward|grad)", "silu_bwd"), (r"silu", "silu"),
    (r"gelu.*(bwd|backward|grad)", "gelu_bwd"), (r"gelu", "gelu"),
    (r"rope.*(bwd|backward|grad)", "rope_bwd"), (r"rope|rotary", "rope"),
    (r"(cross_?entropy|_ce\b|^ce).*(bwd|backward|grad)", "cross_entropy_bwd"), (r"cross_?entropy|^ce", "cross_entropy"),
    (r"softmax.*(bwd|backward|grad)", "softmax_bwd"), (r"softmax", "softmax"),
    (r"embedding.*(scatter|bwd|backward|grad)", "embedding_bwd"), (r"embedding|gather", "embedding"),
    (r"dropout", "dropout"), (r"cast|convert|to_(fp|bf)", "cast"),
    (r"reduce|sum|norm", "reduce"), (r"add", "add"), (r"mul", "mul"), (r"copy|clone|assign", "copy"),
]


def op_class(name: str) -> str:
    n = name.lower()
    for pattern, cls in CLASS_RULES:
        if re.search(pattern, n):
            return cls
    return n


def _median_by(rows, key, value):
    groups = defaultdict(list)
    for r in rows:
        groups[key(r)].append(value(r))
    return {k: statistics.median(v) for k, v in groups.items()}


def fit_gemm(rows: list[dict]) -> list[list]:
    med = _median_by(rows, lambda r: (int(r["m"]), int(r["n"]), int(r["k"])), lambda r: float(r["seconds"]))
    return [[m, n, k, 2.0 * m * n * k / t] for (m, n, k), t in sorted(med.items()) if t > 0]


def fit_attention(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        bh, s, d, causal = int(r["batch"]) * int(r["heads"]), int(r["seq"]), int(r["head_dim"]), bool(r["causal"])
        fl = attention_flops(bh, s, d, causal)
        out.append([bh, s, d, causal, fl / float(r["fwd_s"]), 2.5 * fl / float(r["bwd_s"])])
    return out


def fit_math_attention(rows: list[dict]) -> dict:
    """{"fwd": [[batch·heads, seq, head_dim, FLOP/s]], "bwd": [...]} of the composite math attention core
    (measure.math_attention_table), with the FLOPs the kernels carry: attention_flops(..., causal=False) forward,
    twice that backward."""
    out = {"fwd": [], "bwd": []}
    for r in rows:
        bh, s, d = int(r["batch"]) * int(r["heads"]), int(r["seq"]), int(r["head_dim"])
        fl = attention_flops(bh, s, d, False)
        out["fwd"].append([bh, s, d, fl / float(r["fwd_s"])])
        out["bwd"].append([bh, s, d, 2 * fl / float(r["bwd_s"])])
    return out


def fit_memory_bound(rows: list[dict]) -> dict:
    by = defaultdict(list)
    for r in rows:
        if r.get("seconds") and not r.get("error"):
            by[op_class(r["op"])].append(r)
    for cls, rs in by.items():  # a row timed eagerly (host dispatch included) where graph-timed rows exist: dropped
        graphed = [r for r in rs if "eager" not in str(r.get("timing", ""))]
        if graphed and len(graphed) < len(rs) and any("graph" in str(r.get("timing", "")) for r in graphed):
            by[cls] = graphed
    return {cls: [[b, t] for b, t in sorted(_median_by(
        rs, lambda r: float(r["numel"]), lambda r: float(r["seconds"])).items())]
        for cls, rs in sorted(by.items())}


def fit_optimizer(rows: list[dict]) -> dict:
    """seconds = a·tensors + b·numel by least squares, both coefficients kept non-negative."""
    xs = [(float(r["tensors"]), float(r["numel"]), float(r["seconds"])) for r in rows]
    saa = sum(a * a for a, _, _ in xs)
    sbb = sum(b * b for _, b, _ in xs)
    sab = sum(a * b for a, b, _ in xs)
    say = sum(a * y for a, _, y in xs)
    sby = sum(b * y for _, b, y in xs)
    det = saa * sbb - sab * sab
    a = (say * sbb - sby * sab) / det if det else 0.0
    b = (saa * sby - sab * say) / det if det else 0.0
    if a < 0:
        a, b = 0.0, sby / sbb
    if b < 0:
        a, b = say / saa, 0.0
    return {"per_tensor_s": a, "per_elem_s": b}


def stream_optimizer_seconds(o: dict, tensors: int, numel: float) -> float:
    """One AdamW step over `tensors` equal tensors of `numel` elements in all, from an idle stream, as
    timeline.Stream.run_optimizer runs it on a GPU: `per_step_s` of host first, then per tensor `per_tensor_s` of
    host dispatch and `per_tensor_device_s` + `per_elem_s`·elements of device; the device starts a tensor once it
    is dispatched. Closed form: c + h + T·d when the device is the slower (d >= h), else c + T·h + d."""
    h, c = o["per_tensor_s"], o.get("per_step_s", 0.0)
    d = o.get("per_tensor_device_s", 0.0) + o["per_elem_s"] * numel / tensors
    return c + (h + tensors * d if d >= h else tensors * h + d)


def fit_optimizer_stream(rows: list[dict]) -> dict:
    """{per_step_s, per_tensor_s, per_tensor_device_s, per_elem_s} of `stream_optimizer_seconds` minimising the
    rows' squared relative errors: for each host cost h on a log grid, the other three by non-negative least
    squares (each row's branch, device- or host-bound, settled by iterating), the best h kept. Relative errors
    weigh the 1e9-element rows as much as the 256-tensor rows (plain least squares of seconds let the large rows
    trade 8-10% away against the per-tensor time)."""
    import numpy as np
    from scipy.optimize import nnls

    xs = [(float(r["tensors"]), float(r["numel"]), float(r["seconds"])) for r in rows]
    best = None
    for h in np.geomspace(1e-7, 1e-3, 241):
        dev = [True] * len(xs)  # start: every row device-bound
        for _ in range(8):
            a = np.array([[1.0, T, N] if db else [1.0, 1.0, N / T] for (T, N, _), db in zip(xs, dev)])
            y = np.array([s - (h if db else T * h) for (T, _, s), db in zip(xs, dev)])
            w = np.array([1.0 / s for _, _, s in xs])
            coef, _ = nnls(a * w[:, None], y * w)
            c, d0, e = (float(v) for v in coef)
            new = [d0 + e * N / T >= h for T, N, _ in xs]
            if new == dev:
                break
            dev = new
        o = {"per_step_s": c, "per_tensor_s": float(h), "per_tensor_device_s": d0, "per_elem_s": e}
        err = sum((stream_optimizer_seconds(o, int(T), N) / s - 1) ** 2 for T, N, s in xs)
        if best is None or err < best[0]:
            best = (err, o)
    return best[1]


def fit_profile(raw: dict, base: dict, provenance: dict | None = None, split_layouts: bool = False) -> dict:
    """`base` (the device's constants: name, peak, memory, links, ...) with the tables fitted from `raw`
    ({"gemm": rows, "attention": rows, "memory_bound": rows, "host": {...}, "optimizer": rows}).
    `split_layouts` (`--calibrate`, which times every shape in every layout): `gemm` from the "nn" rows and
    `gemm_layouts` {"nt", "tn"} from theirs; otherwise every layout pooled into `gemm` (the H200 tables, whose
    layouts cover different shapes)."""
    prof = dict(base)
    src = (provenance or {}).get("summary", "")
    rows = raw["gemm"]
    if split_layouts:
        by = {}
        for r in rows:
            by.setdefault(r.get("layout", "nn"), []).append(r)
        rows = by.pop("nn")
        prof["gemm_layouts"] = {lay: {"source": f"fitted from measured {lay} GEMMs {src}".strip(), "rows": fit_gemm(rs)}
                                for lay, rs in sorted(by.items())}
    prof["gemm"] = {"source": f"fitted from measured GEMMs {src}".strip(), "rows": fit_gemm(rows)}
    if raw.get("attention"):
        prof["attention"] = {"source": f"fitted from measured flash attention {src}".strip(),
                             "rows": fit_attention(raw["attention"])}
    if raw.get("attention_math"):
        prof["attention_math"] = {"source": f"fitted from the measured math attention core {src}".strip(),
                                  **fit_math_attention(raw["attention_math"])}
    prof["memory_bound"] = {"source": f"fitted from measured memory-bound ops {src}".strip(),
                            "fallback": "copy" if "copy" in {op_class(r["op"]) for r in raw["memory_bound"]} else "add",
                            "classes": fit_memory_bound(raw["memory_bound"])}
    prof["host"] = dict(raw["host"])
    prof["optimizer"] = {**fit_optimizer(raw["optimizer"]), "source": f"least squares over measured AdamW steps {src}".strip()}
    if provenance:
        prof["provenance"] = provenance
    return prof


def read_tables(data: Path) -> tuple[dict, dict]:
    """The raw tables of a directory in the benchmarks/data/h200 layout: ({"gemm", "attention", "memory_bound",
    "host", "optimizer"}, provenance)."""
    def load(name):
        path = data / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    raw, prov = {}, {}
    for name in ("gemm", "attention", "memory_bound", "optimizer"):
        d = load(name)
        if d is None:
            if name == "attention":
                continue
            raise FileNotFoundError(f"{data / (name + '.json')}: missing (needed to fit a profile)")
        raw[name] = d["rows"]
        prov[name] = d.get("provenance", {})
    host = load("host")
    if host is None:
        raise FileNotFoundError(f"{data / 'host.json'}: missing (needed to fit a profile)")
    raw["host"] = host
    prov["host"] = host.get("provenance", {})
    return raw, prov

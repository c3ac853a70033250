"""FP8 GEMM and quantisation kernel times, fitted to measured tables (H100, `torch._scaled_mm` as the instrument).

    python -m llmtrain.plan.fp8 --fit benchmarks/data/h100 --out llmtrain/plan/profiles/fp8/h100.json
    model = load_fp8_model("h100"); model.gemm_ms("blockwise_1x128_128x128", 4096, 11008, 4096)
    model.quant_ms("1x128", rows=4096, cols=4096)

GEMM C[m, n] = A[m, k] @ W[n, k]ᵀ per recipe (`bf16`, `tensorwise`, `rowwise`, `blockwise_1x128_128x128` - the
forward and dx GEMMs of `train.fp8=blockwise` -, `blockwise_1x128_1x128` - its dW GEMM):

    ms = c + a · 2mnk + b · mn + d · (mk + nk)         (launch, tensor-core work, the output's epilogue, operand reads)

fitted by non-negative least squares on relative error over every other measured shape (sorted by (m, n, k)); the
others are held out (`held_out_error`). Quantisation (bf16 -> e4m3 + fp32 scales) per tile kind (`tensor`,
`1x128`, `128x128`) and implementation: ms = c + a · rows · cols, fitted the same way. Rows a table marks `invalid`
(a wrong product) are left out. The coefficients ship in `profiles/fp8/<device>.json` with the table they came from.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import numpy as np

PROFILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles", "fp8")


def _gemm_features(m, n, k) -> list[float]:
    return [1e-3, 2.0 * m * n * k * 1e-15, m * n * 1e-9, (m * k + n * k) * 1e-9]


def _quant_features(rows, cols) -> list[float]:
    return [1e-3, rows * cols * 1e-9]


def _nnls_relative(features: np.ndarray, ms: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error: min || (A x - y) / y ||."""
    from scipy.optimize import nnls

    w = 1.0 / ms
    coef, _ = nnls(features * w[:, None], ms * w)
    return coef


def split_shapes(rows: list[dict]) -> tuple[set, set]:
    """(fitted, held-out) GEMM shapes: every other distinct (m, n, k), in sorted order."""
    shapes = sorted({(r["m"], r["n"], r["k"]) for r in rows})
    return set(shapes[0::2]), set(shapes[1::2])


@dataclass
class FP8Model:
    """Fitted FP8 kernel times of one device."""

    device: str
    gemm: dict
    """recipe -> [c, a, b, d] of the GEMM form (module docstring)."""
    quant: dict
    """"<tile>/<impl>" -> [c, a] of the quantisation form."""
    source: str = ""

    def gemm_ms(self, recipe: str, m: int, n: int, k: int) -> float:
        return float(np.dot(_gemm_features(m, n, k), self.gemm[recipe]))

    def quant_ms(self, tile: str, rows: int, cols: int, impl: str = "eager") -> float:
        return float(np.dot(_quant_features(rows, cols), self.quant[f"{tile}/{impl}"]))

    def to_json(self) -> dict:
        return {"device": self.device, "source": self.source, "gemm": self.gemm, "quant": self.quant}


def fit(gemm_table: dict, quant_table: dict, device: str, source: str = "") -> FP8Model:
    """Fit the GEMM form per recipe on the fitted half of the shapes, and the quantisation form on every row."""
    rows = [r for r in gemm_table["rows"] if not r.get("invalid")]
    fitted, _ = split_shapes(rows)
    gemm = {}
    for recipe in sorted({r["recipe"] for r in rows}):
        own = [r for r in rows if r["recipe"] == recipe and (r["m"], r["n"], r["k"]) in fitted]
        a = np.array([_gemm_features(r["m"], r["n"], r["k"]) for r in own])
        gemm[recipe] = [float(x) for x in _nnls_relative(a, np.array([r["ms"] for r in own]))]
    quant = {}
    qrows = [r for r in quant_table["rows"] if "tile" in r and "ms" in r]  # (a table may end with a note row)
    for key in sorted({f"{r['tile']}/{r.get('impl', 'eager')}" for r in qrows}):
        own = [r for r in qrows if f"{r['tile']}/{r.get('impl', 'eager')}" == key]
        a = np.array([_quant_features(r["rows"], r["cols"]) for r in own])
        quant[key] = [float(x) for x in _nnls_relative(a, np.array([r["ms"] for r in own]))]
    return FP8Model(device, gemm, quant, source)


def held_out_error(model: FP8Model, gemm_table: dict) -> dict:
    """recipe -> the largest |predicted / measured - 1| over the held-out shapes."""
    rows = [r for r in gemm_table["rows"] if not r.get("invalid")]
    _, held = split_shapes(rows)
    out: dict = {}
    for r in rows:
        if (r["m"], r["n"], r["k"]) in held:
            err = abs(model.gemm_ms(r["recipe"], r["m"], r["n"], r["k"]) / r["ms"] - 1.0)
            out[r["recipe"]] = max(out.get(r["recipe"], 0.0), err)
    return out


def load_fp8_model(device: str) -> FP8Model:
    """The shipped fit of `device` (profiles/fp8/<device>.json); FileNotFoundError when none was measured."""
    with open(os.path.join(PROFILES, f"{device}.json"), encoding="utf-8") as f:
        raw = json.load(f)
    return FP8Model(raw["device"], raw["gemm"], raw["quant"], raw.get("source", ""))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", required=True, help="a directory with fp8_gemm.json and fp8_quant.json")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with open(os.path.join(args.fit, "fp8_gemm.json"), encoding="utf-8") as f:
        gemm_table = json.load(f)
    with open(os.path.join(args.fit, "fp8_quant.json"), encoding="utf-8") as f:
        quant_table = json.load(f)
    model = fit(gemm_table, quant_table, args.device,
                source=f"fitted by llmtrain.plan.fp8 from {args.fit.rstrip('/')}/fp8_gemm.json, fp8_quant.json "
                       f"({gemm_table.get('device', '?')})")
    for recipe, err in sorted(held_out_error(model, gemm_table).items()):
        print(f"{recipe}: held-out max |error| {err:.3f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(model.to_json(), f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()


LINEARS = {"q", "k", "v", "qkv", "o", "q_a", "q_b", "kv_a", "kv_b", "gate", "up", "gate_up", "down"}
"""The planner's GEMM names (`llmtrain/plan/kernels.py`, `kernel_ops.py`) of the linears `train.fp8` computes in FP8;
the routed experts' are `expert.*`. The LM head and the router stay in the training dtype (`llmtrain/fp8/apply.py`)."""


def is_fp8_gemm(op: str) -> bool:
    """Whether the planner's GEMM kernel `op` ("q.fwd", "down.wgrad", "expert.up.dgrad", ...) runs in FP8."""
    return op.startswith("expert.") or op.split(".")[0] in LINEARS


@dataclass
class FP8Pricing:
    """How the planner prices an FP8 GEMM of `recipe` (`train.fp8`) on a device whose bf16 GEMM table it has: the
    device's own bf16 time x the measured FP8 / bf16 ratio at that shape (`model`), plus the quantisation of both
    operands (A [m, k] by 1x128 tiles - the tokens for dW -, B by 128x128 blocks for the forward and dx GEMMs or by
    1x128 tiles for dW; one scale per tensor under tensorwise)."""

    recipe: str
    model: FP8Model

    def gemm_seconds(self, bf16_seconds: float, op: str, m: int, n: int, k: int, batch: int = 1) -> float:
        wgrad = op.endswith(".wgrad")
        if self.recipe == "tensorwise":
            fp8, a_tile, b_tile = "tensorwise", "tensor", "tensor"
        else:
            fp8 = "blockwise_1x128_1x128" if wgrad else "blockwise_1x128_128x128"
            a_tile, b_tile = "1x128", "1x128" if wgrad else "128x128"
        ratio = self.model.gemm_ms(fp8, m, n, k) / self.model.gemm_ms("bf16", m, n, k)
        impl = "compiled" if f"{a_tile}/compiled" in self.model.quant else "eager"
        quant_ms = self.model.quant_ms(a_tile, m, k, impl) + self.model.quant_ms(b_tile, k, n, impl)
        return bf16_seconds * ratio + batch * quant_ms * 1e-3


def with_fp8(dev, fp8: str, measured_on: str = "h100"):
    """The device profile `dev` pricing the transformer's GEMMs in FP8 (`train.fp8`); `dev` itself for `none`."""
    import dataclasses

    if fp8 == "none":
        return dev
    if fp8 not in ("blockwise", "tensorwise"):
        raise ValueError(f"train.fp8={fp8!r}: expected none, blockwise or tensorwise")
    return dataclasses.replace(dev, fp8=FP8Pricing(fp8, load_fp8_model(measured_on)))

"""FP8 GEMM and quantisation kernel times, fitted to measured tables (H100, `torch._scaled_mm` as the instrument).

    python -m llmtrain.plan.fp8 --fit benchmarks/data/h100 --out llmtrain/plan/profiles/fp8/h100.json
    model = load_fp8_model("h100"); model.gemm_ms("blockwise_1x128_128x128", 4096, 11008, 4096)
    model.quant_ms("1x128", rows=4096, cols=4096)

GEMM C[m, n] = A[m, k] @ W[n, k]ᵀ per recipe (`bf16`, `tensorwise`, `rowwise`, `blockwise_1x128_128x128` - the
forward and dx GEMMs of `train.fp8=blockwise` -, `blockwise_1x128_1x128` - its dW GEMM):

    ms = c + a · 2mnk + b · mn + d · (mk + nk)         (launch, tensor-core work, the output's epilogue, operand reads)

fitted by non-negative least squares on relative error over every other measured shape (sorted by (m, n, k)); the
others are held out (`held_out_error`). Rows a table marks `invalid` (a wrong product) are left out.

Quantisation (bf16 -> e4m3 + fp32 scales), per tile variant and implementation (`<tile>/<impl>`): ms = c + a · rows
· cols, fitted the same way over every measured shape. Tile variants: `tensor`, `1x128`, `128x128` (an output like
the input) and, as Paddle's `fp8_quant_blockwise` offers them, `1x128T` (the transposed copy only, 1x128 tiles of
xᵀ: 128 tokens of one column - what the dW GEMM reads), `128x128T` (the transposed copy of the 128x128 blocks: Wᵀ
for the forward) and `1x128+T` (both outputs in one pass). Implementations: `eager` and `compiled` (PyTorch op by op
and torch.compile-fused) and `triton` (benchmarks/fp8_quant_triton.py: one fused pass, bit-exact to Paddle's CUDA
kernel's rule - the instrument for that kernel, which the measuring machine cannot run). The pricing takes, per tile
variant, the FASTEST measured implementation (`FP8Model.priced`: the lowest fitted time at 16384 x 4096 elements,
written into the profile as `quant_priced`); on the H100 that is the fused Triton pass for every blockwise variant.
The coefficients ship in `profiles/fp8/<device>.json` with the table they came from.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

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
    quant_priced: dict = field(default_factory=dict)
    """tile variant -> the implementation the pricing uses (the fastest measured, `fastest_impls`)."""

    def gemm_ms(self, recipe: str, m: int, n: int, k: int) -> float:
        return float(np.dot(_gemm_features(m, n, k), self.gemm[recipe]))

    def quant_ms(self, tile: str, rows: int, cols: int, impl: str | None = None) -> float:
        """Milliseconds of quantising a bf16 [rows, cols] by `tile` with `impl` (None: the priced implementation;
        a transposed variant with no rows of its own falls back to its plain tile: `1x128T` -> `1x128`)."""
        if impl is None:
            tile = self.variant(tile)
            impl = self.quant_priced.get(tile) or fastest_impls(self.quant)[tile]
        return float(np.dot(_quant_features(rows, cols), self.quant[f"{tile}/{impl}"]))

    def variant(self, tile: str) -> str:
        """`tile` if some implementation of it was measured, else its plain tile (`1x128T` -> `1x128`)."""
        if any(k.split("/")[0] == tile for k in self.quant):
            return tile
        return {"1x128T": "1x128", "128x128T": "128x128", "1x128+T": "1x128"}.get(tile, tile)

    def to_json(self) -> dict:
        return {"device": self.device, "source": self.source, "gemm": self.gemm, "quant": self.quant,
                "quant_priced": {**self.quant_priced, "rule": PRICED_RULE}}


PRICED_AT = 16384 * 4096
"""Elements at which the implementations of a tile variant are compared (a mid point of the measured grid)."""
PRICED_RULE = ("per tile variant, the implementation with the lowest fitted time at 16384 x 4096 elements among "
               "those measured (eager, compiled, triton)")


def fastest_impls(quant: dict) -> dict:
    """tile variant -> the implementation with the lowest fitted time at `PRICED_AT` elements."""
    best: dict = {}
    for key, coef in quant.items():
        tile, impl = key.split("/")
        ms = float(np.dot(_quant_features(PRICED_AT, 1), coef))
        if tile not in best or ms < best[tile][1]:
            best[tile] = (impl, ms)
    return {tile: impl for tile, (impl, _) in sorted(best.items())}


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
    qrows = [r for r in quant_table["rows"]  # (a table may end with a note row; `ceiling` rows are copies, not quant)
             if "tile" in r and "ms" in r and not r.get("ceiling")]
    for key in sorted({f"{r['tile']}/{r.get('impl', 'eager')}" for r in qrows}):
        own = [r for r in qrows if f"{r['tile']}/{r.get('impl', 'eager')}" == key]
        a = np.array([_quant_features(r["rows"], r["cols"]) for r in own])
        quant[key] = [float(x) for x in _nnls_relative(a, np.array([r["ms"] for r in own]))]
    return FP8Model(device, gemm, quant, source, fastest_impls(quant))


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
    priced = {k: v for k, v in raw.get("quant_priced", {}).items() if k != "rule"}
    return FP8Model(raw["device"], raw["gemm"], raw["quant"], raw.get("source", ""), priced)


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
    for tile, impl in model.quant_priced.items():
        ms = model.quant_ms(tile, PRICED_AT, 1)
        print(f"quantisation {tile}: priced as {impl} ({ms:.3f} ms at {PRICED_AT:,} elements, "
              f"{(4 if tile.endswith('+T') else 3) * PRICED_AT / ms / 1e6:.0f} GB/s, 2 B read + 1 B per output)")
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
    device's own bf16 time x the measured FP8 / bf16 ratio at that shape (`model`), plus the quantisations that
    llmtrain's GPU path (llmtrain/paddle_compat/fp8_kernels.py) runs for that GEMM, each one
    `fp8_quant_blockwise` call priced by the fastest measured implementation of its variant (`FP8Model.quant_ms`):

        forward  y = x W    (m T, n N, k K): x by 1x128 [T, K]; Wᵀ by 128x128, transposed copy only [K, N]
        dgrad    dx = dy Wᵀ (m T, n K, k N): dy by 1x128 [T, N]; W by 128x128 [K, N]
        wgrad    dW = xᵀ dy (m K, n N, k T): xᵀ by 1x128T [T, K] and dyᵀ by 1x128T [T, N] (transposed copies only)

    (the forward's 1x128T of x is priced with the wgrad, where its operand is used; x's and dy's two passes each are
    llmtrain's calls - one `1x128+T` pass would read them once). Tensorwise: one scale per tensor (`tensor`),
    both operands of every GEMM.

    `weight_cache` (`train.fp8_weight_cache`, llmtrain/fp8/cache.py): the weights' copies (Wᵀ of the forward, W of
    the dgrad; tensorwise's one W) are made once per optimizer step, not per micro-batch: `gemm_seconds` leaves
    them out and `weight_seconds` prices them once for the step (`llmtrain.plan.timeline.step_compute`)."""

    recipe: str
    model: FP8Model
    weight_cache: bool = True

    @property
    def cached_copies(self) -> int:
        """FP8 copies of each weight the GPU path keeps for the whole step under the cache (blockwise: W and Wᵀ;
        tensorwise: W); 0 without the cache (`memory_estimate`'s `fp8_cached_copies`)."""
        return (2 if self.recipe == "blockwise" else 1) if self.weight_cache else 0

    def _tiles(self, op: str) -> tuple[str, str, str]:
        """(FP8 GEMM recipe, a's tile, b's tile) of the planner's GEMM `op`."""
        wgrad, fwd = op.endswith(".wgrad"), not op.endswith((".dgrad", ".wgrad"))  # "q.fwd", "expert.up"
        if self.recipe == "tensorwise":
            return "tensorwise", "tensor", "tensor"
        if wgrad:
            return "blockwise_1x128_1x128", "1x128T", "1x128T"
        return "blockwise_1x128_128x128", "1x128", "128x128T" if fwd else "128x128"

    def quantisations(self, op: str, m: int, n: int, k: int) -> tuple[list, list]:
        """(activation, weight) quantisations of one FP8 GEMM `op` (m, n, k) (per expert of a batched one): lists
        of (tile, rows, cols), the tensor [rows, cols] that llmtrain's GPU path hands `fp8_quant_blockwise`
        (llmtrain/paddle_compat/fp8_kernels.py; a transposed variant reads [rows, cols] and writes its transpose,
        the tokens padded with zero rows to a multiple of 128, `_pad_rows`). The weight's ([K, N]: Wᵀ for the
        forward, W for the dgrad) is made once per step under `weight_cache` (`weight_quantisations`); a wgrad has
        none. Checked against the calls of the GPU path rehearsed on CPU (tests/plan/test_op_sequence.py)."""
        _, a_tile, b_tile = self._tiles(op)
        if self.recipe == "tensorwise":  # one scale per tensor: a [m, k], b [k, n] (a wgrad's: x and dy)
            return ([(a_tile, m, k), (b_tile, k, n)], []) if op.endswith(".wgrad") else ([(a_tile, m, k)], [(b_tile, k, n)])
        pad = lambda t: -(-t // 128) * 128  # noqa: E731
        if op.endswith(".wgrad"):  # dW [K, N] = xᵀ dy, (m, n, k) = (K, N, T): x [T', K] and dy [T', N]
            return [(a_tile, pad(k), m), (b_tile, pad(k), n)], []
        if op.endswith(".dgrad"):  # dx [T, K] = dy Wᵀ, (m, n, k) = (T, K, N): dy [T, N], W [K, N]
            return [(a_tile, m, k)], [(b_tile, n, k)]
        return [(a_tile, m, k)], [(b_tile, k, n)]  # y [T, N] = x W: x [T, K], W [K, N]

    def gemm_seconds(self, bf16_seconds: float, op: str, m: int, n: int, k: int, batch: int = 1) -> float:
        fp8 = self._tiles(op)[0]
        ratio = self.model.gemm_ms(fp8, m, n, k) / self.model.gemm_ms("bf16", m, n, k)
        acts, weights = self.quantisations(op, m, n, k)
        quant = acts + ([] if self.weight_cache else weights)  # cached: the weight is made once per step
        return bf16_seconds * ratio + batch * sum(self.model.quant_ms(*q) for q in quant) * 1e-3

    def weight_quantisations(self, forward: list, backward: list) -> list:
        """The weight quantisations [(tile, rows, cols)] of one micro-batch's FP8 GEMMs in `forward` and `backward`
        (kernel lists), each expert's apart: under `weight_cache` one step's (tensorwise: the forward's only; the
        GPU path reuses them for every micro-batch and recompute's second forward)."""
        out = []
        for ks, want in ((forward, "fwd"), (backward, "dgrad")):
            for k in ks:
                if k.kind != "gemm" or not is_fp8_gemm(k.op):
                    continue
                kind = "dgrad" if k.op.endswith(".dgrad") else "wgrad" if k.op.endswith(".wgrad") else "fwd"
                if kind != want or (self.recipe == "tensorwise" and kind == "dgrad"):
                    continue
                m, n, kk, batch = k.shape
                out += self.quantisations(k.op, m, n, kk)[1] * batch
        return out

    def weight_seconds(self, forward: list, backward: list) -> float:
        """Seconds of one step's weight quantisations under `weight_cache` (0 without it): every FP8 forward GEMM
        of a micro-batch's `forward` kernels makes its Wᵀ copy, every dgrad of its `backward` its W copy
        (tensorwise: one copy, the forward's). Recompute's second forward reuses the copies."""
        if not self.weight_cache:
            return 0.0
        return sum(self.model.quant_ms(*q) for q in self.weight_quantisations(forward, backward)) * 1e-3


def with_fp8(dev, fp8: str, measured_on: str = "h100", weight_cache: bool = True):
    """The device profile `dev` pricing the transformer's GEMMs in FP8 (`train.fp8`); `dev` itself for `none`.
    `weight_cache`: `train.fp8_weight_cache` (weights quantised once per step)."""
    import dataclasses

    if fp8 == "none":
        return dev
    if fp8 not in ("blockwise", "tensorwise"):
        raise ValueError(f"train.fp8={fp8!r}: expected none, blockwise or tensorwise")
    return dataclasses.replace(dev, fp8=FP8Pricing(fp8, load_fp8_model(measured_on), weight_cache))

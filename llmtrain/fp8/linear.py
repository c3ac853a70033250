"""The FP8 GEMMs of a linear layer or of the stacked routed experts: forward and both backward GEMMs quantised.

    python -m pytest tests/fp8/test_linear.py -q
    gemm = FP8Gemm(RECIPES["blockwise"], health, "layers.0.attn.q_proj")
    y = gemm(x, weight, bias)          # x [.., K], weight [K, N], bias [N] or None -> [.., N]  (a linear)
    y = gemm.bmm(x, w)                 # x [E, N, K], w [E, K, F] -> [E, N, F]  (one GEMM per expert)

The three GEMMs, each on quantised operands (tiles and formats from the recipe, `llmtrain.fp8.recipe`):

    forward    y  = Q(x, activation) Q(W, weight)                 [M, K] x [K, N] -> [M, N]
    backward   dx = Q(dy, activation) Q(W, weight)ᵀ               [M, N] x [N, K] -> [M, K]
               dW = Q(x, wgrad)ᵀ Q(dy, wgrad)                     [K, M] x [M, N] -> [K, N]

Q quantises to FP8 and the GEMM accumulates in fp32 (the bias is added outside, in the activations' dtype). The
forward keeps for the backward what the GPU recipe keeps: Q(x, wgrad) and Q(W, weight) as FP8 plus their scales,
one byte per element.

On CPU (emulation): Q is Paddle's cast to the FP8 dtype, dequantised to fp32, and the GEMM is an fp32 matmul of the
dequantised operands. On a GPU (`blockwise` only) the same quantisations and GEMMs run as Paddle's FP8 kernels
(`llmtrain.paddle_compat.fp8_kernels`): `fp8_quant_blockwise` and `fp8_gemm_blockwise` (the recipe's scales are the
kernel's pow2 scales).
"""
from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from llmtrain.fp8.health import FP8Health
from llmtrain.fp8.recipe import Recipe, quantize


class _EmulatedGemm(PyLayer):
    """x [.., M, K] (or [.., K] flattened to [M, K] by the caller), w [.., K, N] -> fp32 [.., M, N]; `splits`: the
    (x, W, dY) slices a tp rank would hold, each quantised on its own (`llmtrain.fp8.emulate.tp_slices`)."""

    @staticmethod
    def forward(ctx, x, w, recipe: Recipe, health: FP8Health, name: str, splits=(None, None, None), cache=None):
        fwd, pow2 = recipe.forward_format, recipe.pow2
        qx = quantize(x, recipe.activation, fwd, pow2, splits[0])  # [.., M, K]
        make_w = lambda: quantize(w, recipe.weight, fwd, pow2, splits[1])  # noqa: E731  [.., K, N]
        qw = make_w() if cache is None else cache.get(name, w, "W", make_w)  # once a step (cache)
        qxt = qx if recipe.wgrad == recipe.activation else quantize(x, recipe.wgrad, fwd, pow2, splits[0])
        if health is not None:
            health.record(qx.amax, f"{name}:x")
            health.record(qw.amax, f"{name}:W")
        y = paddle.matmul(qx.dequantize(), qw.dequantize())  # [.., M, N] fp32
        ctx.save_for_backward(qxt.data, qxt.decode, qw.data, qw.decode)
        ctx.tiles = (qxt.tile, qw.tile)
        ctx.recipe, ctx.health, ctx.name, ctx.splits = recipe, health, name, splits
        ctx.dtypes = (x.dtype, w.dtype)
        ctx.needs = (not x.stop_gradient, not w.stop_gradient)
        return y

    @staticmethod
    def backward(ctx, dy):  # dy [.., M, N]
        from llmtrain.fp8.recipe import Quantized

        xt_data, xt_decode, w_data, w_decode = ctx.saved_tensor()
        recipe, bwd, splits = ctx.recipe, ctx.recipe.backward_format, ctx.splits
        xt = Quantized(xt_data, xt_decode, ctx.tiles[0], None, splits[0])
        w = Quantized(w_data, w_decode, ctx.tiles[1], None, splits[1])
        w_ndim = w_data.ndim - (splits[1] is not None)  # the weight's own axes (a split stacks its slices)
        qdy = quantize(dy, recipe.activation, bwd, recipe.pow2, splits[2])
        qdyt = qdy if recipe.wgrad == recipe.activation else quantize(dy, recipe.wgrad, bwd, recipe.pow2, splits[2])
        if ctx.health is not None:
            ctx.health.record(qdy.amax, f"{ctx.name}:dY")
            if qdyt is not qdy:
                ctx.health.record(qdyt.amax, f"{ctx.name}:dY")
        dx = paddle.matmul(qdy.dequantize(), w.dequantize(), transpose_y=True).astype(ctx.dtypes[0]) \
            if ctx.needs[0] else None  # [.., M, K]
        dw = paddle.matmul(xt.dequantize(), qdyt.dequantize(), transpose_x=True)  # [.., K, N]
        if dw.ndim > w_ndim:  # a weight shared by token groups (`TokenView`: one per cp rank): summed, as cp does
            dw = dw.sum(axis=list(range(dw.ndim - w_ndim)))
        return dx, (dw.astype(ctx.dtypes[1]) if ctx.needs[1] else None)


class FP8Gemm:
    """The FP8 GEMMs of one layer (a linear's `linear(x, weight, bias)` or the experts' `bmm(x, w)`).

    `cache` (`llmtrain.fp8.cache.WeightCache`): the weight quantised once per optimizer step, not per micro-batch.
    `splits` and `tokens` make one process quantise as the ranks of a tp / sp / cp run (`llmtrain.fp8.emulate`,
    CPU emulation only): the (x, W, dY) slices of a tp rank, and the order and grouping of the tokens."""

    def __init__(self, recipe: Recipe, health: FP8Health | None, name: str, *, splits=(None, None, None),
                 tokens=None, weight_shape=None, cache=None):
        self.recipe, self.health, self.name, self.cache = recipe, health, name, cache
        self.splits, self.tokens = tuple(splits), tokens
        self.weight_shape = weight_shape  # [K, N] the splits were planned for (a fused weight must not be cut)

    def _gemm(self, x, w):
        from llmtrain.paddle_compat.kernels import on_gpu

        if on_gpu():
            if self.tokens is not None or any(self.splits):
                raise RuntimeError(f"{self.name}: train.fp8_emulate is a CPU emulation (on a GPU each rank "
                                   "quantises its own slice and tokens)")
            from llmtrain.paddle_compat import fp8_kernels

            return fp8_kernels.blockwise_gemm(x, w, self.health, self.name, self.cache)
        return _EmulatedGemm.apply(x, w, self.recipe, self.health, self.name, self.splits, self.cache)

    def __call__(self, x, weight, bias=None, name=None):
        """x [.., K] @ weight [K, N] (+ bias [N]) -> [.., N] in x's dtype (the signature of `F.linear`)."""
        if any(self.splits) and self.weight_shape is not None and list(weight.shape) != list(self.weight_shape):
            raise ValueError(f"{self.name}: train.fp8_emulate planned the tp slices of a weight {self.weight_shape}, "
                             f"got {list(weight.shape)} (a fused projection is not emulated)")
        if self.tokens is not None:  # x [b, s, K] -> the ranks' tokens [G, M/G, K] -> y [b, s, N]
            if x.ndim != 3:
                raise ValueError(f"{self.name}: train.fp8_emulate orders tokens of x [b, s, K], got {list(x.shape)}")
            b, s = int(x.shape[0]), int(x.shape[1])
            y = self.tokens.from_ranks(self._gemm(self.tokens.to_ranks(x), weight), b, s).astype(x.dtype)
        else:
            lead = list(x.shape[:-1])
            y = self._gemm(x.reshape([-1, x.shape[-1]]), weight).astype(x.dtype)  # [M, N]
            y = y.reshape(lead + [weight.shape[-1]])
        return y if bias is None else y + bias

    def bmm(self, x, w):
        """x [E, N, K] @ w [E, K, F] -> [E, N, F] in x's dtype (the signature of `paddle.bmm`)."""
        return self._gemm(x, w).astype(x.dtype)

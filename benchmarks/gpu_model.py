"""PyTorch twin of llmtrain's decoder and training step, the instrument of `benchmarks/gpu_reference.py`.

    python benchmarks/gpu_reference.py --out /tmp/h200 --only steps     # where PyTorch and a CUDA GPU are present

PyTorch is a measuring instrument here, never a dependency of llmtrain (Paddle's GPU build cannot be installed
on the machine we measure). The op sequence follows `llmtrain/models/{decoder,layers,roles}.py` with the GPU
defaults (`model.fuse_* = auto` -> on):

- pre-norm blocks: x + attn(norm(x)), then + mlp(norm(x)); a final norm; LM head (untied) or the word table (tied);
- weights stored [in, out] as Paddle's `nn.Linear` holds them, so forward / input-grad / weight-grad GEMMs have
  the layouts nn / nt / tn;
- q, k, v as ONE matmul with the three weights concatenated at every forward (`fuse_qkv`), likewise gate and up
  (`fuse_ffn`); biases (GPT) concatenated the same way and added after the matmul. `Decoder.fused_weights`
  "rebuilt" (the default since benchmarks/data/h100/twin2) runs it as llmtrain/models/fused_linear.py's ConcatLinear does
  (`ConcatLinear` below: the concatenation a transient of the forward, built again in the backward; x and the
  weights saved); "kept" is autograd over torch.cat, which keeps the concatenated copy [h, 3h] and [h, 2f] per
  block until its backward (what every row before benchmarks/data/h100/twin2 ran: 0.26 GiB per llama-7b block);
  the product is split into q, k, v (gate, up) each its own tensor, as Paddle's `split` returns copies (`saved`
  "llmtrain", the default after benchmarks/data/h100/twin2; "torch": views that pin the whole product, so flash
  attention's saved v kept all of qkv, 2 s·b·h more per block than llmtrain);
- RMSNorm through `F.rms_norm` (Paddle: `fused_rms_norm`), LayerNorm through `F.layer_norm`;
- RoPE rotate-half, unfused kernels (Paddle fuses q and k in one kernel; PyTorch has no such eager kernel: more
  kernels), saving only cos/sin as the fused kernel does (`RoPE`; Paddle's unfused ops would keep q, k and their
  rotated halves);
- SwiGLU as silu(gate) * up (Paddle: one `swiglu` kernel; here two; `Decoder.swiglu` "unfused", the default) or
  "saves_input": `SwiGLU` below, which saves what Paddle's fused kernel saves (swiglu_grad takes the input and
  out_grad: the [.., 2f] input only, not silu(gate)); its backward is eager PyTorch ops (a memory instrument, not
  Paddle's kernel time);
- attention: flash attention through SDPA on [b, heads, s, d] views (GQA through `enable_gqa`, no repeat of k/v);
- loss: logits cast to fp32, per-token cross entropy, times the loss mask, sum / max(sum(mask), 1); the cross
  entropy as Paddle's cross_entropy_with_softmax keeps it (`SoftmaxCrossEntropy`: the fp32 softmax saved, its
  gradient made in that buffer; `saved` "torch": F.cross_entropy, three fp32 [N, V] buffers in its backward);
- recompute: `torch.utils.checkpoint` per block, non-reentrant, without early stop (the whole block re-runs).

AMP as Paddle's O2 with master weights holds it: every parameter bf16 (LayerNorm too: Paddle keeps norms fp32 only
for fp16), bf16 gradients, the global-norm clip on the bf16 gradients, then multi-precision AdamW on fp32 master
weights whose result is copied back into the bf16 weights. PyTorch's fused AdamW needs grads of the parameter's
dtype, so the step runs per chunk of <= `CHUNK` elements: bf16 grads cast into one reusable fp32 buffer, fused
AdamW on the fp32 masters, masters copied into the bf16 weights. Per parameter that moves 40 bytes where Paddle's
fused multi-precision kernel moves 28 (it reads the bf16 grad and writes the bf16 weight itself).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

CHUNK = 1 << 28  # elements per optimizer chunk (1 GiB of fp32 grad buffer)


@dataclass
class Arch:
    """One decoder architecture, with the fields of steps.json's `arch`."""

    family: str  # "llama" or "gpt"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    norm: str  # rmsnorm | layernorm
    activation: str  # swiglu | gelu_tanh
    position: str  # rope | learned
    bias: bool
    tie_embeddings: bool

    def as_dict(self):
        return asdict(self)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of the matmuls of one block as run on GPU (fused qkv and gate/up), then the LM head."""
        d = self.head_dim
        out = [("qkv", self.hidden, (self.heads + 2 * self.kv_heads) * d), ("o", self.heads * d, self.hidden)]
        if self.activation == "swiglu":
            out.append(("gate_up", self.hidden, 2 * self.ffn))
        else:
            out.append(("up", self.hidden, self.ffn))
        out.append(("down", self.ffn, self.hidden))
        return out + [("lm_head", self.hidden, self.vocab)]


def llama(layers, hidden, heads, kv_heads, ffn, seq, vocab=32000) -> Arch:
    return Arch("llama", layers, hidden, heads, kv_heads, ffn, vocab, seq, "rmsnorm", "swiglu", "rope", False, False)


def gpt(layers, hidden, heads, ffn, seq, vocab=50304) -> Arch:
    return Arch("gpt", layers, hidden, heads, heads, ffn, vocab, seq, "layernorm", "gelu_tanh", "learned", True, True)


class ConcatLinear(torch.autograd.Function):
    """x [.., in] @ [W_1 .. W_n] ([in, out_i] each) -> [.., sum out_i], as llmtrain/models/fused_linear.py runs it:
    the concatenated weight is a transient of the forward and is built again in the backward; saved: x and the
    weights themselves (no copy). `widths` (None: one output): the output split into [.., out_i] pieces, each its
    own tensor as Paddle's `split` returns them (copies: the [.., sum out_i] product is freed at once, and a piece
    kept for a backward pins only its own bytes)."""

    @staticmethod
    def forward(ctx, widths, x, *weights):
        ctx.save_for_backward(x, *weights)
        y = x @ torch.cat(weights, dim=1)  # the [in, sum out_i] copy is freed after the GEMM
        if widths is None:
            return y
        return tuple(p.contiguous() for p in y.split(widths, dim=-1))  # [.., out_i] each, own storage

    @staticmethod
    def backward(ctx, *dys):  # dys: [.., sum out_i] or its pieces [.., out_i]
        x, *weights = ctx.saved_tensors
        dy = dys[0] if len(dys) == 1 else torch.cat(dys, dim=-1)  # [.., sum out_i] (Paddle's backward concatenates)
        dx = dy @ torch.cat(weights, dim=1).t()  # [.., in]; the concatenation again, transient
        dw = x.reshape(-1, x.shape[-1]).t() @ dy.reshape(-1, dy.shape[-1])  # [in, sum out_i]
        return (None, dx, *dw.split([w.shape[1] for w in weights], dim=1))


class SwiGLUInput(torch.autograd.Function):
    """`SwiGLU` of gu = [g | u] [.., 2f] (views of one tensor, `Decoder.saved` "torch": the twin2 rows), saving gu."""

    @staticmethod
    def forward(ctx, gu):
        ctx.save_for_backward(gu)
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, dout):
        (gu,) = ctx.saved_tensors
        g, u = (t.float() for t in gu.chunk(2, dim=-1))
        sg, d = torch.sigmoid(g), dout.float()
        return torch.cat([d * u * sg * (1 + g * (1 - sg)), d * g * sg], dim=-1).to(gu.dtype)


class SwiGLU(torch.autograd.Function):
    """silu(g) * u -> [.., f] of g, u [.., f], saving only g and u, as Paddle's fused `swiglu` (its backward
    swiglu_grad takes the inputs and out_grad; PyTorch's silu(g) * u also keeps silu(g) [.., f])."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, dout):
        g, u = (t.float() for t in ctx.saved_tensors)
        sg, d = torch.sigmoid(g), dout.float()
        return (d * u * sg * (1 + g * (1 - sg))).to(dout.dtype), (d * g * sg).to(dout.dtype)


class RoPE(torch.autograd.Function):
    """Rotate-half RoPE x [b, s, heads, d] -> x cos + rot(x) sin (rot(x) = [-x2, x1]) saving nothing but the
    constant tables, as Paddle's fused_rotary_position_embedding (llmtrain's GPU default, `fuse_rope`): its
    backward takes only cos/sin. Autograd over the same ops (`Decoder.saved` "torch") keeps nothing either
    (PyTorch's mul saves only the factor that needs no grad), but Paddle's unfused ops keep x and rot(x)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.cos, ctx.sin = cos, sin  # module constants, no grad
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    @staticmethod
    def backward(ctx, dy):  # d/dx of rot(x) * sin: rot^T(dy sin) = [g2, -g1] of g = dy sin
        g1, g2 = (dy * ctx.sin).chunk(2, dim=-1)
        return dy * ctx.cos + torch.cat([g2, -g1], dim=-1), None, None


class SoftmaxCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of fp32 logits [N, V] and targets [N] -> [N], as Paddle's
    cross_entropy_with_softmax (llmtrain's `roles.token_loss`): the forward saves the fp32 softmax [N, V] (not its
    input), the backward turns that buffer into the logits' gradient in place (softmax - onehot, times the loss
    gradient). PyTorch's F.cross_entropy (log_softmax + nll_loss; `Decoder.saved` "torch") holds three fp32 [N, V]
    buffers in its backward (the saved log-probabilities, nll's gradient, log_softmax's gradient)."""

    @staticmethod
    def forward(ctx, logits, target):
        prob = torch.softmax(logits, dim=-1)  # [N, V] fp32
        ctx.save_for_backward(prob, target)
        return -torch.log(prob.gather(1, target[:, None]).squeeze(1))  # [N]

    @staticmethod
    def backward(ctx, dloss):  # dloss [N]
        prob, target = ctx.saved_tensors
        prob[torch.arange(prob.shape[0], device=prob.device), target] -= 1  # in place: the saved buffer
        return prob.mul_(dloss[:, None]), None


class Decoder(torch.nn.Module):
    """llmtrain's DecoderLM for one `Arch`, every parameter created in `dtype` on `device`. `fused_weights`:
    "rebuilt" (llmtrain's ConcatLinear) or "kept" (autograd over torch.cat, the rows before benchmarks/data/h100/twin2);
    `swiglu`: "unfused" (silu(g) * u) or "saves_input" (`SwiGLU`, Paddle's saved tensors); `saved`: "llmtrain" (the
    default after benchmarks/data/h100/twin2: what Paddle's ops keep for the backward where autograd keeps other
    tensors: the fused projections' outputs split into their own tensors, RoPE as the fused kernel, the loss as
    Paddle's softmax cross entropy) or "torch" (PyTorch's own ops, the twin2 rows: a split piece is a view that
    pins the whole fused output, F.cross_entropy's three fp32 [N, V] buffers in the backward)."""

    def __init__(self, a: Arch, device, dtype=torch.bfloat16, recompute: bool = False, generator=None,
                 fused_weights: str = "rebuilt", swiglu: str = "unfused", saved: str = "llmtrain"):
        super().__init__()
        if fused_weights not in ("rebuilt", "kept") or swiglu not in ("unfused", "saves_input"):
            raise ValueError(f"fused_weights={fused_weights!r} (rebuilt|kept), swiglu={swiglu!r} (unfused|saves_input)")
        if saved not in ("llmtrain", "torch"):
            raise ValueError(f"saved={saved!r} (llmtrain|torch)")
        self.a, self.recompute = a, recompute
        self.fused_weights, self.swiglu, self.saved = fused_weights, swiglu, saved
        kw = dict(device=device, dtype=dtype)

        def mat(i, o, std=0.02):  # [in, out], as Paddle's Linear weight
            return torch.nn.Parameter(torch.randn(i, o, **kw, generator=generator) * std)

        def vec(n, value=0.0):
            return torch.nn.Parameter(torch.full((n,), value, **kw))

        self.word = torch.nn.Parameter(torch.randn(a.vocab, a.hidden, **kw, generator=generator) * 0.02)  # [V, h]
        self.pos = torch.nn.Parameter(torch.randn(a.seq, a.hidden, **kw, generator=generator) * 0.02) if a.position == "learned" else None
        d, nh, nkv = a.head_dim, a.heads, a.kv_heads
        self.blocks = torch.nn.ModuleList()
        for _ in range(a.layers):
            b = torch.nn.Module()
            b.norm1_w, b.norm2_w = vec(a.hidden, 1.0), vec(a.hidden, 1.0)
            b.wq, b.wk, b.wv = mat(a.hidden, nh * d), mat(a.hidden, nkv * d), mat(a.hidden, nkv * d)
            b.wo = mat(nh * d, a.hidden, 0.02 / math.sqrt(2 * a.layers))
            b.wup = mat(a.hidden, a.ffn)
            b.wgate = mat(a.hidden, a.ffn) if a.activation == "swiglu" else None
            b.wdown = mat(a.ffn, a.hidden, 0.02 / math.sqrt(2 * a.layers))
            if a.norm == "layernorm":
                b.norm1_b, b.norm2_b = vec(a.hidden), vec(a.hidden)
            if a.bias:
                b.bq, b.bk, b.bv, b.bo = vec(nh * d), vec(nkv * d), vec(nkv * d), vec(a.hidden)
                b.bup, b.bdown = vec(a.ffn), vec(a.hidden)
            self.blocks.append(b)
        self.final_w = vec(a.hidden, 1.0)
        self.final_b = vec(a.hidden) if a.norm == "layernorm" else None
        self.head = None if a.tie_embeddings else mat(a.hidden, a.vocab)
        if a.position == "rope":
            inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
            freqs = torch.outer(torch.arange(a.seq, device=device, dtype=torch.float32), inv)  # [s, d/2]
            emb = torch.cat([freqs, freqs], -1)  # [s, d]
            self.cos = emb.cos().to(dtype)[None, :, None, :]  # [1, s, 1, d]
            self.sin = emb.sin().to(dtype)[None, :, None, :]

    def norm(self, x, w, b=None):  # x [b, s, h]
        if self.a.norm == "rmsnorm":
            return F.rms_norm(x, (x.shape[-1],), w, 1e-5)
        return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)

    def rope(self, x):  # x [b, s, heads, d], rotate-half
        if self.saved == "llmtrain":
            return RoPE.apply(x, self.cos, self.sin)
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat([-x2, x1], dim=-1) * self.sin

    def attention(self, blk, x):  # x [b, s, h] -> [b, s, h]
        a = self.a
        d = a.head_dim
        q, k, v = self.fused(x, [blk.wq, blk.wk, blk.wv], [blk.bq, blk.bk, blk.bv] if a.bias else None)  # fuse_qkv
        q = q.view(*q.shape[:2], a.heads, d)  # [b, s, nh, d]
        k = k.view(*k.shape[:2], a.kv_heads, d)  # [b, s, nkv, d]
        v = v.view(*v.shape[:2], a.kv_heads, d)
        if a.position == "rope":
            q, k = self.rope(q), self.rope(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             enable_gqa=a.kv_heads != a.heads)  # [b, nh, s, d]
        out = out.transpose(1, 2).reshape(*x.shape[:2], a.heads * d)  # [b, s, nh d]
        y = out @ blk.wo
        return y + blk.bo if a.bias else y

    def mlp(self, blk, x):  # x [b, s, h] -> [b, s, h]
        a = self.a
        if a.activation == "swiglu":
            if self.saved == "torch":  # gu [b, s, 2f], gate and up its views (the twin2 rows)
                gu = self.concat_gemm(x, [blk.wgate, blk.wup])
                if self.swiglu == "saves_input":
                    inner = SwiGLUInput.apply(gu)  # [b, s, f]
                else:
                    gate, up = gu.chunk(2, dim=-1)  # [b, s, f] each
                    inner = F.silu(gate) * up
            else:
                gate, up = self.fused(x, [blk.wgate, blk.wup])  # fuse_ffn: [b, s, f] each, own tensors
                inner = SwiGLU.apply(gate, up) if self.swiglu == "saves_input" else F.silu(gate) * up
        else:
            inner = F.gelu(x @ blk.wup + blk.bup, approximate="tanh")  # [b, s, f]
        y = inner @ blk.wdown
        return y + blk.bdown if a.bias else y

    def fused(self, x, weights, biases=None):  # x [b, s, in], weights [in, out_i] -> [[b, s, out_i] ...]
        widths = [w.shape[1] for w in weights]
        if biases is None and self.fused_weights == "rebuilt" and self.saved == "llmtrain":
            return list(ConcatLinear.apply(widths, x, *weights))  # each piece its own tensor, as Paddle's split
        y = self.concat_gemm(x, weights)  # [b, s, sum out_i]
        if biases is not None:
            y = y + torch.cat(biases)
        pieces = y.split(widths, dim=-1)  # views of y ("torch")
        return [p.contiguous() for p in pieces] if self.saved == "llmtrain" else list(pieces)

    def concat_gemm(self, x, weights):  # x [b, s, in], weights [in, out_i] -> [b, s, sum out_i]
        if self.fused_weights == "rebuilt":
            return ConcatLinear.apply(None, x, *weights)
        return x @ torch.cat(weights, dim=1)  # autograd keeps the concatenated copy until the backward

    def block(self, blk, x):
        b1, b2 = getattr(blk, "norm1_b", None), getattr(blk, "norm2_b", None)
        x = x + self.attention(blk, self.norm(x, blk.norm1_w, b1))
        return x + self.mlp(blk, self.norm(x, blk.norm2_w, b2))

    def forward(self, ids, target, mask):  # ids, target [b, s] int64; mask [b, s] fp32 -> scalar fp32 loss
        logits = self.logits(ids)  # [b, s, V]
        if self.saved == "llmtrain":  # Paddle's cross_entropy_with_softmax: the fp32 softmax kept, grad in place
            ce = SoftmaxCrossEntropy.apply(logits.float().flatten(0, 1), target.flatten()).view_as(mask)
        else:
            ce = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none").view_as(mask)
        return (ce * mask).sum() / mask.sum().clamp(min=1.0)

    def logits(self, ids):  # ids [b, s] int64 -> [b, s, V]
        x = F.embedding(ids, self.word)  # [b, s, h]
        if self.pos is not None:
            x = x + self.pos[None, : ids.shape[1]]
        for blk in self.blocks:
            if self.recompute:  # the whole block again, as Paddle's recompute (no early stop: PyTorch's default
                with set_checkpoint_early_stop(False):  # skips a block's last ops, whose outputs no backward reads)
                    x = checkpoint(self.block, blk, x, use_reentrant=False)
            else:
                x = self.block(blk, x)
        x = self.norm(x, self.final_w, self.final_b)
        return x @ (self.word.t() if self.head is None else self.head)  # [b, s, V]


class MasterAdamW:
    """Multi-precision AdamW as Paddle's O2 holds it: fp32 masters (and moments) beside bf16 weights.

    step(): global-norm clip of the bf16 grads (fp32 norm), then per chunk: bf16 grads -> fp32 buffer, fused AdamW
    on the masters, masters -> bf16 weights; finally the grads are zeroed (Paddle's clear_grad sets to zero)."""

    def __init__(self, params, lr=3e-4, weight_decay=0.1, clip=1.0, chunk=CHUNK):
        self.params = [p for p in params]
        self.clip = clip
        fused = self.params[0].device.type == "cuda"
        self.chunks, chunk_now, size = [], [], 0
        for p in self.params:
            if chunk_now and size + p.numel() > chunk:
                self.chunks.append(chunk_now)
                chunk_now, size = [], 0
            chunk_now.append(p)
            size += p.numel()
        self.chunks.append(chunk_now)
        longest = max(sum(p.numel() for p in c) for c in self.chunks)
        self.buffer = torch.empty(longest, dtype=torch.float32, device=self.params[0].device)
        self.opts, self.masters = [], []
        for c in self.chunks:
            masters = [p.detach().float().requires_grad_(True) for p in c]
            offset = 0
            for m in masters:  # grads are views into the one shared buffer
                m.grad = self.buffer[offset : offset + m.numel()].view_as(m)
                offset += m.numel()
            self.masters.append(masters)
            self.opts.append(torch.optim.AdamW(masters, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay,
                                               fused=fused, foreach=None if fused else True))

    def step(self):
        grads = [p.grad for p in self.params]
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        for c, masters, opt in zip(self.chunks, self.masters, self.opts):
            torch._foreach_copy_([m.grad for m in masters], [p.grad for p in c])  # bf16 -> fp32
            opt.step()
            torch._foreach_copy_([p.data for p in c], masters)  # fp32 -> bf16
        torch._foreach_zero_(grads)
        return norm


def train_step(model, opt, batch):
    """One training step: forward with the loss, backward, clip + multi-precision AdamW."""
    loss = model(*batch)
    loss.backward()
    opt.step()
    return loss


def make_batch(a: Arch, micro_batch: int, device, generator=None):
    ids = torch.randint(0, a.vocab, (micro_batch, a.seq + 1), device=device, generator=generator)
    mask = torch.ones(micro_batch, a.seq, device=device, dtype=torch.float32)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), mask

"""PyTorch twin of llmtrain's decoder and training step, the instrument of `benchmarks/gpu_reference.py`.

    python benchmarks/gpu_reference.py --out /tmp/h200 --only steps     # where PyTorch and a CUDA GPU are present

PyTorch is a measuring instrument here, never a dependency of llmtrain (Paddle's GPU build cannot be installed
on the machine we measure). The op sequence follows `llmtrain/models/{decoder,layers,roles}.py` with the GPU
defaults (`model.fuse_* = auto` -> on):

- pre-norm blocks: x + attn(norm(x)), then + mlp(norm(x)); a final norm; LM head (untied) or the word table (tied);
- weights stored [in, out] as Paddle's `nn.Linear` holds them, so forward / input-grad / weight-grad GEMMs have
  the layouts nn / nt / tn;
- q, k, v as ONE matmul with the three weights concatenated at every forward (`fuse_qkv`), likewise gate and up
  (`fuse_ffn`); biases (GPT) concatenated the same way and added after the matmul;
- RMSNorm through `F.rms_norm` (Paddle: `fused_rms_norm`), LayerNorm through `F.layer_norm`;
- RoPE rotate-half, unfused (Paddle fuses q and k in one kernel; PyTorch has no such eager kernel: more kernels);
- SwiGLU as silu(gate) * up (Paddle: one `swiglu` kernel; here two);
- attention: flash attention through SDPA on [b, heads, s, d] views (GQA through `enable_gqa`, no repeat of k/v);
- loss: logits cast to fp32, per-token cross entropy, times the loss mask, sum / max(sum(mask), 1);
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


class Decoder(torch.nn.Module):
    """llmtrain's DecoderLM for one `Arch`, every parameter created in `dtype` on `device`."""

    def __init__(self, a: Arch, device, dtype=torch.bfloat16, recompute: bool = False, generator=None):
        super().__init__()
        self.a, self.recompute = a, recompute
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
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat([-x2, x1], dim=-1) * self.sin

    def attention(self, blk, x):  # x [b, s, h] -> [b, s, h]
        a = self.a
        d = a.head_dim
        w = torch.cat([blk.wq, blk.wk, blk.wv], dim=1)  # [h, (nh + 2 nkv) d]: fuse_qkv, a copy per forward
        qkv = x @ w
        if a.bias:
            qkv = qkv + torch.cat([blk.bq, blk.bk, blk.bv])
        q, k, v = qkv.split([a.heads * d, a.kv_heads * d, a.kv_heads * d], dim=-1)
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
            gate, up = (x @ torch.cat([blk.wgate, blk.wup], dim=1)).chunk(2, dim=-1)  # fuse_ffn: [b, s, f] each
            inner = F.silu(gate) * up
        else:
            inner = F.gelu(x @ blk.wup + blk.bup, approximate="tanh")  # [b, s, f]
        y = inner @ blk.wdown
        return y + blk.bdown if a.bias else y

    def block(self, blk, x):
        b1, b2 = getattr(blk, "norm1_b", None), getattr(blk, "norm2_b", None)
        x = x + self.attention(blk, self.norm(x, blk.norm1_w, b1))
        return x + self.mlp(blk, self.norm(x, blk.norm2_w, b2))

    def forward(self, ids, target, mask):  # ids, target [b, s] int64; mask [b, s] fp32 -> scalar fp32 loss
        logits = self.logits(ids)  # [b, s, V]
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

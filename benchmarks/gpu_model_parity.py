"""Check that the PyTorch twin (`benchmarks/gpu_model.py`) computes llmtrain's decoder: same weights, same loss.

    python benchmarks/gpu_model_parity.py export DIR        # with Paddle (llmtrain's venv): weights, ids, logits, loss
    /path/to/torch-venv/bin/python benchmarks/gpu_model_parity.py compare DIR   # with PyTorch: the twin on them

Two processes because Paddle and PyTorch live in different environments here. `export` builds llmtrain's
`DecoderLM` in fp32 on CPU for a tiny Llama (RMSNorm, RoPE, SwiGLU, GQA, untied, fused q/k/v and gate/up) and a tiny
GPT (LayerNorm, GeLU-tanh, learned positions, bias, tied), runs one batch, and saves every parameter by canonical
name with the ids, the logits and the loss. `compare` loads them into `gpu_model.Decoder` and asserts that logits and
loss agree to 1e-5 relative (fp32). A twin that drops or reorders an op fails here.
"""
from __future__ import annotations

import os
import sys

import numpy as np

ARCHS = {  # name -> (llmtrain ModelConfig fields, gpu_model constructor arguments)
    "llama": (dict(name="llama-parity", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=160,
                   vocab_size=256, max_position_embeddings=32, position="rope", norm="rmsnorm", norm_eps=1e-5,
                   activation="swiglu", bias=False, tie_embeddings=False, fuse_qkv="true", fuse_ffn="true",
                   attention="math"),
              ("llama", dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, seq=32, vocab=256))),
    "gpt": (dict(name="gpt-parity", hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=256, vocab_size=256,
                 max_position_embeddings=32, position="learned", norm="layernorm", norm_eps=1e-5, activation="gelu_tanh",
                 bias=True, tie_embeddings=True, fuse_qkv="true", attention="math"),
            ("gpt", dict(layers=2, hidden=64, ffn=256, heads=4, seq=32, vocab=256))),
}
SEQ, BATCH = 32, 2


def export(out: str) -> None:
    import paddle

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from llmtrain.models import build_model
    from llmtrain.models.config import ModelConfig
    from llmtrain.contracts.steps import mean_loss
    from llmtrain.models.stages import canonical_parameters

    os.makedirs(out, exist_ok=True)
    for name, (fields, _) in ARCHS.items():
        paddle.seed(0)
        model = build_model(ModelConfig(**fields))
        for n, p in canonical_parameters(model):  # non-trivial norms and biases too
            p.set_value(paddle.randn(p.shape, dtype="float32") * 0.05 + (1.0 if "norm.weight" in n else 0.0))
        ids = paddle.randint(0, 256, [BATCH, SEQ + 1])
        inputs, target = ids[:, :-1], ids[:, 1:]
        mask = paddle.ones([BATCH, SEQ], dtype="float32")
        logits = model(inputs)
        loss = mean_loss(model.loss_fn(logits, (target, mask)))  # (sum, tokens) -> the mean token loss
        arrays = {f"param/{n}": p.numpy() for n, p in canonical_parameters(model)}
        np.savez(os.path.join(out, f"{name}.npz"), ids=ids.numpy(), logits=logits.numpy(), loss=loss.numpy(), **arrays)
        print(f"{name}: loss {float(loss):.6f}, {len(arrays)} parameters -> {out}/{name}.npz")


def load_into(model, params: dict) -> None:
    """Canonical llmtrain names -> the twin's parameters (both hold linear weights as [in, out])."""
    import torch

    a = model.a
    table = {"embed.word.weight": model.word, "final_norm.norm.weight": model.final_w}
    if model.pos is not None:
        table["embed.pos.weight"] = model.pos
    if model.final_b is not None:
        table["final_norm.norm.bias"] = model.final_b
    if model.head is not None:
        table["lm_head.proj.weight"] = model.head
    for i, b in enumerate(model.blocks):
        p = f"layers.{i}."
        table.update({p + "attn_norm.weight": b.norm1_w, p + "mlp_norm.weight": b.norm2_w,
                      p + "attn.q_proj.weight": b.wq, p + "attn.k_proj.weight": b.wk, p + "attn.v_proj.weight": b.wv,
                      p + "attn.o_proj.weight": b.wo, p + "mlp.up_proj.weight": b.wup, p + "mlp.down_proj.weight": b.wdown})
        if b.wgate is not None:
            table[p + "mlp.gate_proj.weight"] = b.wgate
        if a.norm == "layernorm":
            table.update({p + "attn_norm.bias": b.norm1_b, p + "mlp_norm.bias": b.norm2_b})
        if a.bias:
            table.update({p + "attn.q_proj.bias": b.bq, p + "attn.k_proj.bias": b.bk, p + "attn.v_proj.bias": b.bv,
                          p + "attn.o_proj.bias": b.bo, p + "mlp.up_proj.bias": b.bup, p + "mlp.down_proj.bias": b.bdown})
    missing = sorted(set(params) ^ set(table))
    if missing:
        raise AssertionError(f"names on one side only: {missing}")
    with torch.no_grad():
        for n, t in table.items():
            src = torch.from_numpy(params[n])
            if n == "embed.pos.weight":
                src = src[: t.shape[0]]
            if tuple(src.shape) != tuple(t.shape):
                raise AssertionError(f"{n}: llmtrain {tuple(src.shape)} vs twin {tuple(t.shape)}")
            t.copy_(src)


def compare(out: str) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_model

    for name, (_, (family, kw)) in ARCHS.items():
        data = np.load(os.path.join(out, f"{name}.npz"))
        a = gpu_model.llama(**kw) if family == "llama" else gpu_model.gpt(**kw)
        model = gpu_model.Decoder(a, "cpu", torch.float32)
        load_into(model, {k[len("param/"):]: data[k] for k in data.files if k.startswith("param/")})
        ids = torch.from_numpy(data["ids"]).long()
        inputs, target = ids[:, :-1], ids[:, 1:]
        mask = torch.ones(BATCH, SEQ)
        with torch.no_grad():
            loss = float(model(inputs, target, mask))
            logits = model.logits(inputs).numpy()
        want = data["logits"]
        rel = float(np.linalg.norm(logits - want) / np.linalg.norm(want))
        loss_rel = abs(loss - float(data["loss"])) / abs(float(data["loss"]))
        print(f"{name}: logits rel err {rel:.2e}, loss {loss:.6f} vs llmtrain {float(data['loss']):.6f} (rel {loss_rel:.1e})")
        assert rel < 1e-5 and loss_rel < 1e-5, name


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("export", "compare"):
        raise SystemExit("usage: gpu_model_parity.py export|compare DIR")
    (export if sys.argv[1] == "export" else compare)(sys.argv[2])

"""Helpers for the PaddleNLP interop tests: tiny real PaddleNLP models, random states, logits.

    python -m pytest tests/interop -q
"""
from __future__ import annotations

import numpy as np
import paddle

from llmtrain.interop.keys import model_shapes
from llmtrain.models import build_model
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import load_full_state

TOL = 1e-4  # max abs logit difference allowed in fp32


def token_ids(vocab_size: int, seed: int = 0, batch: int = 2, seq: int = 16) -> paddle.Tensor:
    return paddle.to_tensor(np.random.default_rng(seed).integers(0, vocab_size, (batch, seq)), dtype="int64")


def random_values(name: str, shape, rng: np.random.Generator) -> np.ndarray:
    """Values that make every parameter matter: norm weights near 1, everything else non-zero noise.

    (Default inits set norms to 1 and biases to 0, under which a swapped norm or bias would go unseen.)"""
    if name.endswith("expert_bias"):  # the selection bias stays zero unless a run moves it (formats without it refuse it)
        return np.zeros(shape, np.float32)
    if len(shape) == 1 and ("norm" in name or "layernorm" in name) and name.endswith("weight"):
        return (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    scale = 0.5 if "embed" in name else 0.1
    return (scale * rng.standard_normal(shape)).astype(np.float32)


@paddle.no_grad()
def randomize_paddlenlp(model, seed: int) -> None:
    """Overwrite every parameter of a PaddleNLP model (tied ones once) with `random_values`."""
    rng = np.random.default_rng(seed)
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        p.set_value(paddle.to_tensor(random_values(name, list(p.shape), rng)))


@paddle.no_grad()
def randomize_lora(lora_model, marker: str, scale: float, seed: int) -> None:
    """Overwrite the adapter parameters of a PaddleNLP `LoRAModel` whose names contain `marker` ("lora_": A and B;
    "lora_B": B only, PaddleNLP initialises it to zero) with `scale` x standard normal noise."""
    rng = np.random.default_rng(seed)
    for name, p in lora_model.model.named_parameters():
        if marker in name:
            p.set_value(paddle.to_tensor((scale * rng.standard_normal(p.shape)).astype(np.float32)))


def random_state(cfg, seed: int) -> dict[str, np.ndarray]:
    """A canonical state for our model `cfg` with `random_values`."""
    rng = np.random.default_rng(seed)
    return {name: random_values(name, shape, rng) for name, shape in model_shapes(cfg).items()}


def our_logits(cfg, state, ids) -> np.ndarray:
    model = build_model(cfg)
    load_full_state(canonical_parameters(model), state, source="test state")
    model.eval()
    with paddle.no_grad():
        return model(ids).numpy()


def paddlenlp_logits(model, ids) -> np.ndarray:
    model.eval()
    with paddle.no_grad():
        out = model(ids)
    if isinstance(out, (tuple, list)):
        out = out[0]
    out = getattr(out, "logits", out)
    return out.astype("float32").numpy()


def assert_close(ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    assert ours.shape == theirs.shape, f"{what}: shapes {ours.shape} vs {theirs.shape}"
    assert np.abs(theirs).max() > 0.1, f"{what}: logits too small for the comparison to mean anything"
    diff = float(np.abs(ours - theirs).max())
    assert diff <= TOL, f"{what}: max abs logit difference {diff:.3g} > {TOL}"


class _PreV3Where:
    """`paddle` as PaddleNLP 2.8.1's Mixtral expects it: `paddle.where(cond)` returning [n, 1] index tensors.

    Paddle 3.3.1's one-argument `where` (= `nonzero(as_tuple=True)`) returns 1-D [n] tensors, so
    `MixtralSparseMoeBlock.forward` multiplies [n, h] by `routing_weights[top_x, idx]` of shape [n]
    and fails ("Broadcast dimension mismatch") whenever an expert receives n != 1 tokens (n != h).
    With [n, 1] indices (the form it was written for) the weights are [n, 1]; nothing else changes."""

    def __getattr__(self, name):
        return getattr(paddle, name)

    @staticmethod
    def where(condition, x=None, y=None, name=None):
        if x is None and y is None:
            return tuple(t.unsqueeze(-1) for t in paddle.nonzero(condition, as_tuple=True))
        return paddle.where(condition, x, y, name)


def runnable_paddlenlp_mixtral(monkeypatch) -> None:
    """Let PaddleNLP 2.8.1's MixtralForCausalLM run its forward on Paddle 3.3.1 (see `_PreV3Where`)."""
    from paddlenlp.transformers.mixtral import modeling

    monkeypatch.setattr(modeling, "paddle", _PreV3Where())

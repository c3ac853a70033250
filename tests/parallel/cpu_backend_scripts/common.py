"""Tiny models, data and single-process references shared by the CPU-backend workers and tests.

Not run directly. Worker scripts in this folder import it (their folder is on sys.path
when launched with `python -m paddle.distributed.launch ... <script>.py`), and
tests/parallel/test_cpu_backend*.py import it to compute the single-process reference.

Every weight is drawn from numpy with a fixed seed, in full, and each parallel rank keeps
its slice; so the parallel and the single-process models start from identical numbers.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

# ---------------------------------------------------------------- tensor parallel (tp2)
VOCAB, HIDDEN, FFN = 16, 8, 16
BATCH, SEQ = 4, 5
IGNORE_INDEX = -100
TP_STEPS, TP_LR = 3, 0.1

# How each TP parameter is split over tp ranks: axis of the full tensor, or None (replicated).
TP_SPLIT_AXIS = {
    "emb.weight": 0,  # VocabParallelEmbedding [V, H] split by vocabulary rows
    "up.weight": 1,  # ColumnParallelLinear [H, F] split by output columns
    "up.bias": 0,
    "down.weight": 0,  # RowParallelLinear [F, H] split by input rows
    "down.bias": None,
    "gather.weight": 1,  # ColumnParallelLinear(gather_output=True)
    "gather.bias": 0,
    "split.weight": 0,  # RowParallelLinear(input_is_parallel=False)
    "split.bias": None,
    "head.weight": 1,  # ColumnParallelLinear lm head, logits stay vocab-parallel
}
TP_SHAPES = {
    "emb.weight": [VOCAB, HIDDEN],
    "up.weight": [HIDDEN, FFN],
    "up.bias": [FFN],
    "down.weight": [FFN, HIDDEN],
    "down.bias": [HIDDEN],
    "gather.weight": [HIDDEN, FFN],
    "gather.bias": [FFN],
    "split.weight": [FFN, HIDDEN],
    "split.bias": [HIDDEN],
    "head.weight": [HIDDEN, VOCAB],
}


def tp_full_weights(seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    return {k: (0.5 * rng.standard_normal(s)).astype("float32") for k, s in TP_SHAPES.items()}


def shard(full: np.ndarray, axis: int | None, rank: int, nranks: int) -> np.ndarray:
    """This rank's slice of `full` along `axis` (whole tensor when axis is None)."""
    if axis is None:
        return full
    return np.split(full, nranks, axis=axis)[rank]


def tp_batch(seed: int = 11) -> tuple[np.ndarray, np.ndarray]:
    """ids [B, S] and labels [B, S] with a few positions set to IGNORE_INDEX."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, VOCAB, size=(BATCH, SEQ)).astype("int64")
    labels = rng.randint(0, VOCAB, size=(BATCH, SEQ)).astype("int64")
    labels[0, :2] = IGNORE_INDEX
    labels[2, -1] = IGNORE_INDEX
    return ids, labels


def tp_forward(m, ids, labels, loss_fn):
    """Shared forward. Returns per-token loss [B, S] and the mean over counted tokens."""
    h = m.emb(ids)  # [B, S, H]
    x = h + m.down(F.gelu(m.up(h)))  # up: [B, S, F(/n)], down: [B, S, H]
    x = x + m.split(F.gelu(m.gather(x)))  # gather: [B, S, F] full, split: [B, S, H]
    logits = m.head(x)  # [B, S, V(/n)]
    per_token = loss_fn(logits, labels).reshape([BATCH, SEQ])  # [B, S]
    counted = (labels != IGNORE_INDEX).astype("float32").sum()
    return per_token, per_token.sum() / counted


class TPReference(nn.Layer):
    """The tp model on one process: plain Embedding/Linear with the full weights."""

    def __init__(self, weights):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
        self.gather, self.split = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias_attr=False)
        for name, p in self.named_parameters():
            p.set_value(weights[name])

    def forward(self, ids, labels):
        def loss_fn(logits, lab):
            return F.cross_entropy(logits, lab, reduction="none", ignore_index=IGNORE_INDEX)

        return tp_forward(self, ids, labels, loss_fn)


def tp_reference_run(weights, ids, labels) -> dict[str, np.ndarray]:
    """Single-process run of TP_STEPS SGD steps; returns losses, step-0 grads, final params."""
    paddle.seed(0)
    model = TPReference(weights)
    opt = paddle.optimizer.SGD(learning_rate=TP_LR, parameters=model.parameters())
    out: dict[str, np.ndarray] = {}
    ids_t, lab_t = paddle.to_tensor(ids), paddle.to_tensor(labels)
    for step in range(TP_STEPS):
        per_token, loss = model(ids_t, lab_t)
        loss.backward()
        out[f"loss/{step}"] = loss.numpy()
        out[f"per_token/{step}"] = per_token.numpy()
        if step == 0:
            for name, p in model.named_parameters():
                out[f"grad/{name}"] = p.grad.numpy()
        opt.step()
        opt.clear_grad()
    for name, p in model.named_parameters():
        out[f"param/{name}"] = p.numpy()
    return out


# ---------------------------------------------------------------- pipeline (pp2 / pp4)
PP_HIDDEN = 8


def block_weights(idx: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(1000 + idx)
    w = (rng.standard_normal((PP_HIDDEN, PP_HIDDEN)) / np.sqrt(PP_HIDDEN)).astype("float32")
    b = (0.1 * rng.standard_normal(PP_HIDDEN)).astype("float32")
    return w, b


class Block(nn.Layer):
    """x + tanh(x W + b); weights depend only on the block index, never on the layout."""

    def __init__(self, idx: int):
        super().__init__()
        self.idx = idx
        self.linear = nn.Linear(PP_HIDDEN, PP_HIDDEN)
        w, b = block_weights(idx)
        self.linear.weight.set_value(w)
        self.linear.bias.set_value(b)

    def forward(self, x):
        return x + paddle.tanh(self.linear(x))


def mse(out, target):
    return F.mse_loss(out, target)


def pp_batch(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    x = rng.standard_normal((n, PP_HIDDEN)).astype("float32")
    y = rng.standard_normal((n, PP_HIDDEN)).astype("float32")
    return x, y


def pp_reference_run(num_blocks, batches, lr) -> dict[str, np.ndarray]:
    """Blocks in sequence on one process, SGD on the full batch (= mean of micro-batches)."""
    blocks = nn.LayerList([Block(i) for i in range(num_blocks)])
    opt = paddle.optimizer.SGD(learning_rate=lr, parameters=blocks.parameters())
    out: dict[str, np.ndarray] = {}
    for step, (x, y) in enumerate(batches):
        h = paddle.to_tensor(x)
        for blk in blocks:
            h = blk(h)
        loss = mse(h, paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        out[f"loss/{step}"] = loss.numpy()
    for blk in blocks:
        out[f"block{blk.idx}/w"] = blk.linear.weight.numpy()
        out[f"block{blk.idx}/b"] = blk.linear.bias.numpy()
    return out


def block_params(layer: nn.Layer) -> dict[str, np.ndarray]:
    """{"block<i>/w": ..., "block<i>/b": ...} for every Block held by `layer`."""
    out = {}
    for sub in layer.sublayers(include_self=True):
        if isinstance(sub, Block):
            out[f"block{sub.idx}/w"] = sub.linear.weight.numpy()
            out[f"block{sub.idx}/b"] = sub.linear.bias.numpy()
    return out


# ---------------------------------------------------------------- tied embeddings (pp2)
TIED_VOCAB, TIED_SEQ = 12, 3


def tied_embedding_weight() -> np.ndarray:
    rng = np.random.RandomState(5)
    return (0.5 * rng.standard_normal((TIED_VOCAB, PP_HIDDEN))).astype("float32")


class TiedEmbedding(nn.Layer):
    """Holds the shared [V, H] table; used as input embedding and as output projection."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(TIED_VOCAB, PP_HIDDEN)
        self.embedding.weight.set_value(tied_embedding_weight())

    def forward(self, ids):
        return self.embedding(ids)  # [B, S] -> [B, S, H]


def tied_logits(layer: TiedEmbedding, x):
    return paddle.matmul(x, layer.embedding.weight, transpose_y=True)  # [B, S, V]


def tied_ce(logits, labels):
    return F.cross_entropy(logits.reshape([-1, TIED_VOCAB]), labels.reshape([-1, 1]))


def tied_batch(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, TIED_VOCAB, size=(n, TIED_SEQ)).astype("int64")
    labels = rng.randint(0, TIED_VOCAB, size=(n, TIED_SEQ)).astype("int64")
    return ids, labels


def tied_reference_run(num_blocks, batches, lr) -> dict[str, np.ndarray]:
    emb = TiedEmbedding()
    blocks = nn.LayerList([Block(i) for i in range(num_blocks)])
    params = emb.parameters() + blocks.parameters()
    opt = paddle.optimizer.SGD(learning_rate=lr, parameters=params)
    out: dict[str, np.ndarray] = {}
    for step, (ids, labels) in enumerate(batches):
        h = emb(paddle.to_tensor(ids))
        for blk in blocks:
            h = blk(h)
        loss = tied_ce(tied_logits(emb, h), paddle.to_tensor(labels))
        loss.backward()
        opt.step()
        opt.clear_grad()
        out[f"loss/{step}"] = loss.numpy()
    out["embedding"] = emb.embedding.weight.numpy()
    return out

"""Tiny models, data and single-process references shared by the CPU-backend workers and tests.

Not run directly. Worker scripts in this folder import it (their folder is on sys.path
when launched with `python -m paddle.distributed.launch ... <script>.py`), and
tests/paddle_compat/test_cpu_*.py import it to compute the single-process reference.

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
    per_token = loss_fn(logits, labels).reshape(labels.shape)  # [B, S]
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


class TPParallel(nn.Layer):
    """The same network from fleet's tensor-parallel layers, holding this rank's shards.

    With mp degree 1 the fleet layers act as plain ones; ParallelCrossEntropy then
    returns None in Paddle (its group has no members), so a plain cross entropy is used.
    """

    def __init__(self, weights, mp_rank: int, mp_degree: int):
        super().__init__()
        from paddle.distributed import fleet

        mp = fleet.meta_parallel
        self.emb = mp.VocabParallelEmbedding(VOCAB, HIDDEN)
        self.up = mp.ColumnParallelLinear(HIDDEN, FFN, has_bias=True, gather_output=False)
        self.down = mp.RowParallelLinear(FFN, HIDDEN, has_bias=True, input_is_parallel=True)
        self.gather = mp.ColumnParallelLinear(HIDDEN, FFN, has_bias=True, gather_output=True)
        self.split = mp.RowParallelLinear(FFN, HIDDEN, has_bias=True, input_is_parallel=False)
        self.head = mp.ColumnParallelLinear(HIDDEN, VOCAB, has_bias=False, gather_output=False)
        self.ce = mp.ParallelCrossEntropy(ignore_index=IGNORE_INDEX) if mp_degree > 1 else None
        for name, p in self.named_parameters():
            p.set_value(shard(weights[name], TP_SPLIT_AXIS[name], mp_rank, mp_degree))

    def forward(self, ids, labels):
        def plain_ce(logits, lab):
            return F.cross_entropy(logits, lab, reduction="none", ignore_index=IGNORE_INDEX)

        return tp_forward(self, ids, labels, self.ce or plain_ce)


# Non-pipeline layouts run by hybrid_worker.py. Data-parallel-like ranks (dp x sharding)
# each take one equal row block of the batch.
HYBRID_LAYOUTS = {
    "tp2": dict(dp=1, mp=2, sharding=1, opt="sgd"),
    "dp2": dict(dp=2, mp=1, sharding=1, opt="adam"),  # the two-node test
    "dp2tp2": dict(dp=2, mp=2, sharding=1, opt="adam"),
    "sharding2": dict(dp=1, mp=1, sharding=2, opt="adam"),
    "sharding2dp2": dict(dp=2, mp=1, sharding=2, opt="adam"),
    "sharding2tp2": dict(dp=1, mp=2, sharding=2, opt="adam"),
}


def make_optimizer(name: str, parameters):
    """"sgd" (lr TP_LR) or "adam" (lr 0.01): the same choice on both sides of a comparison."""
    if name == "sgd":
        return paddle.optimizer.SGD(learning_rate=TP_LR, parameters=parameters)
    return paddle.optimizer.Adam(learning_rate=0.01, parameters=parameters)


def optimizer_state_bytes(opt) -> int:
    """Bytes of optimizer state (moments, beta powers, master weights) this process holds.

    Unwraps fleet's wrappers (HybridParallelOptimizer -> DygraphShardingOptimizer ->
    inner optimizer; group-sharded `_optim`) down to the paddle optimizer that owns them.
    """
    seen = set()
    while id(opt) not in seen:
        seen.add(id(opt))
        if getattr(opt, "_accumulators", None):
            break
        opt = getattr(opt, "_inner_opt", None) or getattr(opt, "_optim", None) or opt
    total = 0
    for per_param in getattr(opt, "_accumulators", {}).values():
        for t in per_param.values():
            total += int(np.prod(t.shape)) * t.element_size()
    for t in getattr(opt, "_master_weights", {}).values():
        total += int(np.prod(t.shape)) * t.element_size()
    return total


def tp_reference_run(weights, ids, labels, shards=1, opt_name="sgd") -> dict[str, np.ndarray]:
    """Single-process run of TP_STEPS steps on the full batch.

    With shards > 1 the batch is cut into `shards` equal row blocks (what data-parallel or
    sharding ranks see) and the loss is the mean of the blocks' losses, as data-parallel
    gradient averaging computes it. Returns losses, step-0 grads, final params and the
    optimizer-state bytes.
    """
    paddle.seed(0)
    model = TPReference(weights)
    opt = make_optimizer(opt_name, model.parameters())
    out: dict[str, np.ndarray] = {}
    for step in range(TP_STEPS):
        losses, per_tokens = [], []
        for k in range(shards):
            ids_k, lab_k = (paddle.to_tensor(dp_slice(a, k, shards)) for a in (ids, labels))
            per_token, loss = model(ids_k, lab_k)
            losses.append(loss)
            per_tokens.append(per_token)
        loss = paddle.add_n(losses) / shards
        loss.backward()
        out[f"loss/{step}"] = loss.numpy()
        out[f"per_token/{step}"] = paddle.concat(per_tokens, axis=0).numpy()
        if step == 0:
            for name, p in model.named_parameters():
                out[f"grad/{name}"] = p.grad.numpy()
        opt.step()
        opt.clear_grad()
    for name, p in model.named_parameters():
        out[f"param/{name}"] = p.numpy()
    out["optimizer_state_bytes"] = np.array(optimizer_state_bytes(opt))
    return out


# ---------------------------------------------------------------- pipeline (pp2 / pp4)
PP_HIDDEN, PP_FFN = 8, 16
# Block parameters split over tp ranks (tp2 x pp2); same convention as TP_SPLIT_AXIS.
BLOCK_SPLIT_AXIS = {"up.weight": 1, "up.bias": 0, "down.weight": 0, "down.bias": None}


def block_weights(idx: int) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(1000 + idx)
    return {
        "up.weight": (rng.standard_normal((PP_HIDDEN, PP_FFN)) / np.sqrt(PP_HIDDEN)).astype("float32"),
        "up.bias": (0.1 * rng.standard_normal(PP_FFN)).astype("float32"),
        "down.weight": (rng.standard_normal((PP_FFN, PP_HIDDEN)) / np.sqrt(PP_FFN)).astype("float32"),
        "down.bias": (0.1 * rng.standard_normal(PP_HIDDEN)).astype("float32"),
    }


class Block(nn.Layer):
    """x + down(tanh(up(x))); weights depend only on the block index, never on the layout.

    With tp_degree > 1 (inside a fleet job) up/down are Column/RowParallelLinear holding
    this rank's slices; otherwise plain Linear with the full weights.
    """

    def __init__(self, idx: int, tp_degree: int = 1, tp_rank: int = 0):
        super().__init__()
        self.idx = idx
        if tp_degree > 1:
            from paddle.distributed import fleet

            mp = fleet.meta_parallel
            self.up = mp.ColumnParallelLinear(PP_HIDDEN, PP_FFN, has_bias=True, gather_output=False)
            self.down = mp.RowParallelLinear(PP_FFN, PP_HIDDEN, has_bias=True, input_is_parallel=True)
        else:
            self.up, self.down = nn.Linear(PP_HIDDEN, PP_FFN), nn.Linear(PP_FFN, PP_HIDDEN)
        for name, full in block_weights(idx).items():
            part = shard(full, BLOCK_SPLIT_AXIS[name], tp_rank, tp_degree)
            dict(self.named_parameters())[name].set_value(part)

    def forward(self, x):
        return x + self.down(paddle.tanh(self.up(x)))  # [N, H] -> [N, F(/tp)] -> [N, H]


def mse(out, target):
    return F.mse_loss(out, target)


def pp_batch(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    x = rng.standard_normal((n, PP_HIDDEN)).astype("float32")
    y = rng.standard_normal((n, PP_HIDDEN)).astype("float32")
    return x, y


def _blocks_loss(blocks, x, y):
    h = paddle.to_tensor(x)
    for blk in blocks:
        h = blk(h)
    return mse(h, paddle.to_tensor(y))


def pp_reference_run(num_blocks, batches, lr, eval_batch=None) -> dict[str, np.ndarray]:
    """Blocks in sequence on one process, SGD on the full batch (= mean of micro-batches);
    `eval/loss` is the loss on `eval_batch` after training."""
    blocks = nn.LayerList([Block(i) for i in range(num_blocks)])
    opt = paddle.optimizer.SGD(learning_rate=lr, parameters=blocks.parameters())
    out: dict[str, np.ndarray] = {}
    for step, (x, y) in enumerate(batches):
        loss = _blocks_loss(blocks, x, y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        out[f"loss/{step}"] = loss.numpy()
    if eval_batch is not None:
        with paddle.no_grad():
            out["eval/loss"] = _blocks_loss(blocks, *eval_batch).numpy()
    for blk in blocks:
        out.update(block_params(blk))
    return out


def block_params(layer: nn.Layer) -> dict[str, np.ndarray]:
    """{"block<i>/<param name>": value} for every Block held by `layer` (this rank's shards)."""
    out = {}
    for sub in layer.sublayers(include_self=True):
        if isinstance(sub, Block):
            for name, p in sub.named_parameters():
                out[f"block{sub.idx}/{name}"] = p.numpy()
    return out


# ---------------------------------------------------------------- tied embeddings (pp2)
TIED_VOCAB, TIED_SEQ = 12, 3


def tied_embedding_weight() -> np.ndarray:
    rng = np.random.RandomState(5)
    return (0.5 * rng.standard_normal((TIED_VOCAB, PP_HIDDEN))).astype("float32")


class TiedEmbedding(nn.Layer):
    """Holds the shared [V, H] table `weight`: input embedding here, output projection
    through `tied_logits` (the forward_func of the second SharedLayerDesc)."""

    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([TIED_VOCAB, PP_HIDDEN])
        self.weight.set_value(tied_embedding_weight())

    def forward(self, ids):
        return F.embedding(ids, self.weight)  # [B, S] -> [B, S, H]


def tied_logits(layer: TiedEmbedding, x):
    return paddle.matmul(x, layer.weight, transpose_y=True)  # [B, S, H] -> [B, S, V]


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
    out["embedding"] = emb.weight.numpy()
    return out


# ---------------------------------------------------------------- pipeline layouts
# Global batch per step = dp * accumulate * micro_batch rows; dp rank r takes block r.
PP_LR = 0.1
PP_LAYOUTS = {
    # 1F1B on pp2, plus eval_batch and a SharedLayerDesc-tied embedding model
    "pp2": dict(dp=1, mp=1, pp=2, blocks=4, acc=4, mb=2, virtual=1, steps=3, tied=True),
    # 1F1B (+ eval_batch) on pp4, then the interleaved schedule: 8 blocks = 4 stages x 2
    # virtual chunks, acc >= 2 * pp
    "pp4_vpp": dict(dp=1, mp=1, pp=4, blocks=8, acc=8, mb=1, virtual=2, steps=2, tied=False, also_1f1b=True),
    # the same with overlap_p2p_comm: the unbatched isend/irecv path with deferred waits
    "pp4_vpp_overlap": dict(dp=1, mp=1, pp=4, blocks=8, acc=8, mb=1, virtual=2, steps=2, tied=False,
                            overlap=True),
    "dp2pp2": dict(dp=2, mp=1, pp=2, blocks=4, acc=2, mb=2, virtual=1, steps=3, tied=False),
    "tp2pp2": dict(dp=1, mp=2, pp=2, blocks=4, acc=2, mb=2, virtual=1, steps=3, tied=False),
}


def pp_global_batches(layout: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    n = layout["dp"] * layout["acc"] * layout["mb"]
    return [pp_batch(n, seed=100 + step) for step in range(layout["steps"])]


def pp_eval_batch(layout: dict) -> tuple[np.ndarray, np.ndarray]:
    return pp_batch(layout["dp"] * layout["acc"] * layout["mb"], seed=999)


def tied_global_batches(layout: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    n = layout["dp"] * layout["acc"] * layout["mb"]
    return [tied_batch(n, seed=200 + step) for step in range(layout["steps"])]


def dp_slice(array: np.ndarray, dp_rank: int, dp: int) -> np.ndarray:
    return np.split(array, dp, axis=0)[dp_rank]


# ---------------------------------------------------------------- ZeRO stages 2 / 3
# Wide enough that the 4096-byte buffer alignment of the group-sharded storages is
# negligible next to the parameters, so per-rank optimizer state ~ 1/k is visible.
ZERO_IN, ZERO_FFN, ZERO_ROWS, ZERO_STEPS, ZERO_CLIP = 64, 256, 8, 3, 0.3
ZERO_LAYOUTS = {"zero2": dict(level="os_g", sharding=2), "zero3": dict(level="p_g_os", sharding=2)}


class WideMLP(nn.Layer):
    """x -> fc2(gelu(fc1(x))) + x, MSE to a target; deterministic weights."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(ZERO_IN, ZERO_FFN), nn.Linear(ZERO_FFN, ZERO_IN)
        rng = np.random.RandomState(3)
        for _, p in self.named_parameters():
            p.set_value((0.05 * rng.standard_normal(p.shape)).astype("float32"))

    def forward(self, x, y):
        return mse(self.fc2(F.gelu(self.fc1(x))) + x, y)  # [N, D] -> [N, F] -> [N, D]


def zero_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.RandomState(21)
    return [
        (rng.standard_normal((ZERO_ROWS, ZERO_IN)).astype("float32"),
         rng.standard_normal((ZERO_ROWS, ZERO_IN)).astype("float32"))
        for _ in range(ZERO_STEPS)
    ]


def zero_optimizer(parameters):
    """Adam with global-norm clipping; ZERO_CLIP is below the grad norm (~0.7), so the
    sharded clip really rescales."""
    clip = paddle.nn.ClipGradByGlobalNorm(ZERO_CLIP)
    return paddle.optimizer.Adam(learning_rate=0.01, parameters=parameters, grad_clip=clip)


def zero_reference_run(shards: int) -> dict[str, np.ndarray]:
    model = WideMLP()
    opt = zero_optimizer(model.parameters())
    out: dict[str, np.ndarray] = {}
    for step, (x, y) in enumerate(zero_batches()):
        losses = [model(paddle.to_tensor(dp_slice(x, k, shards)), paddle.to_tensor(dp_slice(y, k, shards)))
                  for k in range(shards)]
        loss = paddle.add_n(losses) / shards
        loss.backward()
        opt.step()
        opt.clear_grad()
        out[f"loss/{step}"] = loss.numpy()
    for name, p in model.named_parameters():
        out[f"param/{name}"] = p.numpy()
    out["optimizer_state_bytes"] = np.array(optimizer_state_bytes(opt))
    return out

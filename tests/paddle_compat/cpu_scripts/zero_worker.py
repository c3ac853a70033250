"""ZeRO-2 / ZeRO-3 worker: Paddle's group_sharded_parallel on CPU through the CPU backend.

Run (the tests do this; LAYOUTS is "zero2", "zero3" or "zero2,zero3", see common.ZERO_LAYOUTS):
    PYTHONPATH=<repo> python -m paddle.distributed.launch --nproc_per_node 2 \
        tests/paddle_compat/cpu_scripts/zero_worker.py LAYOUTS OUT_DIR

fleet.init with data parallel over all ranks (Paddle's documented setup for
group_sharded_parallel), wraps common.WideMLP and Adam + ClipGradByGlobalNorm with
GroupShardedOptimizerStage2 + GroupShardedStage2 (zero2, no device argument) or
`paddle.distributed.sharding.group_sharded_parallel(level="p_g_os")` (zero3), trains
ZERO_STEPS steps (each rank its row block of the batch) and writes OUT_DIR/rank<r>.npz:
losses, the full parameters after training (stage 3 gathers them with
get_all_parameters) and the optimizer-state bytes this rank holds, each key prefixed with
"<layout>/". Several layouts run one after another in the same processes (one fleet.init,
a fresh model and optimizer each), so one launch serves both stages.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import paddle
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2 import (
    GroupShardedOptimizerStage2,
)
from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage2 import GroupShardedStage2

import common
from llmtrain.paddle_compat import cpu_backend


def train(layout_name: str, rank: int, world: int) -> dict[str, np.ndarray]:
    layout = common.ZERO_LAYOUTS[layout_name]
    assert world == layout["sharding"]
    model = common.WideMLP()
    opt = common.zero_optimizer(model.parameters())
    if layout["level"] == "os_g":
        # Stage 2 through the classes, without a device argument (CPU default).
        opt = GroupShardedOptimizerStage2(params=opt._parameter_list, optim=opt)
        model = GroupShardedStage2(model, opt)
    else:
        # Stage 3 through the public entry point. Looked up on the module at call time:
        # a name imported before install() would still be Paddle's GPU-only original.
        # segment_size=0: slice every parameter (the default keeps small ones whole).
        sharded = paddle.distributed.sharding.group_sharded_parallel
        model, opt, _ = sharded(model, opt, level=layout["level"], segment_size=0)

    out: dict[str, np.ndarray] = {}
    for step, (x, y) in enumerate(common.zero_batches()):
        xs, ys = (paddle.to_tensor(common.dp_slice(a, rank, world)) for a in (x, y))
        loss = model(xs, ys)
        loss.backward()
        opt.step()
        opt.clear_grad()
        out[f"{layout_name}/loss/{step}"] = loss.numpy()
    out[f"{layout_name}/optimizer_state_bytes"] = np.array(common.optimizer_state_bytes(opt))
    if layout["level"] == "p_g_os":
        model.get_all_parameters()
    for name, p in model._layer.named_parameters():
        out[f"{layout_name}/param/{name}"] = p.numpy()
    return out


def main(layout_names: str, out_dir: str) -> None:
    assert cpu_backend.install(), "CPU backend must install on a CPU device"
    fleet.init(is_collective=True)
    rank, world = paddle.distributed.get_rank(), paddle.distributed.get_world_size()
    out: dict[str, np.ndarray] = {}
    for name in layout_names.split(","):
        out.update(train(name, rank, world))
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Which FlashAttention Paddle's `flash_attention` runs: FlashAttention-3 on Hopper where the installed Paddle has
it, FlashAttention-2 elsewhere.

    python -c "from llmtrain.paddle_compat.flash_attn import fa3_available; print(fa3_available())"

Paddle 3.3.1's `paddle.nn.functional.flash_attention.flash_attention` runs `_C_ops.flash_attn_v3` when the GPU
flag `FLAGS_flash_attn_version` is 3 (unless `FLAGS_cudnn_deterministic` is on) and FA2's `_C_ops.flash_attn`
otherwise. FA3 is built for Hopper (compute capability 9.0) only, has no dropout (llmtrain's attention has none)
and, on the H100 measured for the planner, the FA3-class kernel ran 1.3-1.9x FA2's speed (benchmarks/README.md,
"H100"). `choose_flash_version` is called once when `model.attention` resolves to flash attention on a GPU
(llmtrain/models/layers.py): it sets the flag to 3 where `fa3_available()`, leaves it alone where the user set
`FLAGS_flash_attn_version` in the environment (Paddle reads it at start: `FLAGS_flash_attn_version=2` keeps FA2),
and says which version runs. On CPU nothing is set (the flag does not exist in the CPU build).
"""
from __future__ import annotations

import os

import paddle

from llmtrain.paddle_compat import kernels

FLAG = "FLAGS_flash_attn_version"
HOPPER = (9, 0)


def fa3_available() -> tuple[bool, str]:
    """(True, "") where FlashAttention-3 can run here, else (False, why not)."""
    if not kernels.on_gpu():
        return False, "not on a GPU"
    try:
        cap = tuple(paddle.device.cuda.get_device_capability())
    except ValueError as e:  # a build without CUDA (a CPU rehearsal of another GPU branch)
        return False, f"no CUDA device capability ({e})"
    if cap != HOPPER:
        return False, f"compute capability {cap[0]}.{cap[1]}: FlashAttention-3 is built for Hopper (9.0) only"
    if not hasattr(paddle._C_ops, "flash_attn_v3"):
        return False, f"Paddle {paddle.__version__} has no _C_ops.flash_attn_v3"
    try:
        paddle.get_flags([FLAG])
    except ValueError:
        return False, f"Paddle {paddle.__version__} has no {FLAG}"
    return True, ""


def choose_flash_version() -> str:
    """Set `FLAGS_flash_attn_version` to 3 where FlashAttention-3 can run and the environment does not name a
    version; return what runs ("fa3", "fa2" with the reason, or the environment's choice)."""
    if FLAG in os.environ:
        return f"fa{os.environ[FLAG]} ({FLAG} from the environment)"
    ok, why = fa3_available()
    if not ok:
        return f"fa2 ({why})"
    paddle.set_flags({FLAG: 3})  # GPU-ONLY(flash-attn-v3)
    return "fa3"

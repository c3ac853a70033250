"""DualPipeV's point-to-point on CPU: its batched send/recv through the ordered pipeline channels.

Use: installed by `llmtrain.paddle_compat.cpu_backend.install()`; afterwards fleet's `DualPipeVParallel`
(`pp_configs.use_dualpipev=True`) trains on CPU processes. Nothing to call by hand.

Why fleet's code cannot run on gloo (Paddle 3.3.1, fleet/meta_parallel/dualpipev.py): every
`_commit_and_wait_comm` posts the queued `P2POp`s with `paddle.distributed.batch_isend_irecv` on the whole pipe
group, which gloo runs inline and in order (a send blocks until the peer's matching recv, and every op on the group
advances one shared tag counter, see `pipeline_p2p`), asks the group for its CUDA stream
(`process_group.get_stream`), and, whenever nothing is queued, returns
`deep_ep.get_event_from_custom_stream(...)` from `paddle.distributed.communication.deep_ep`, a module the CPU wheel
does not ship.

What we do instead: the same ops, in the same order (forward ops, then backward ops), each queued on the
pipeline channel of its direction (`pipeline_p2p._LINKS`), then waited for; the sent tensors are copied when
queued, so fleet may free them right after (`_free_tensors`) as it does after NCCL's call. A send to the next
stage goes on the "next" channel and a receive from the previous stage on the "prev" one: under pp = 2 the next
and the previous stage are the same rank, and every message between two ranks then travels one FIFO per
direction, the order NCCL gives p2p between two ranks of one communicator (which fleet's schedule relies on). The
returned event is None (it only feeds the GPU-only overlapped forward-backward path, which needs
`overlapped_forward_backward` on the model; llmtrain's models do not define it).

Replaced: `DualPipeVParallel._commit_and_wait_comm`. The meta-data broadcast of the first forward
(`BatchCommHelper`, a collective) and the final loss all-reduce run as Paddle wrote them.
"""

from __future__ import annotations

import paddle.distributed as dist
from paddle.distributed.fleet.meta_parallel import dualpipev

from . import pipeline_p2p
from ..patching import replace


def _channel(pipe, op) -> tuple[str, str]:
    """(direction, role) of the pipeline channel that carries `op` (a fleet `P2POp` to/from a global rank)."""
    if op.op is dist.isend:
        return ("next" if op.peer == pipe.next_rank else "prev"), "send"
    return ("prev" if op.peer == pipe.prev_rank else "next"), "recv"


def commit_and_wait_comm(self, p2p_overlap=False, use_outer_event_wait=False):
    """CPU stand-in for `DualPipeVParallel._commit_and_wait_comm` (same signature; the overlap flags are GPU
    stream options and change nothing here).

    GPU: `batch_isend_irecv` of the forward ops, wait, then of the backward ops, wait (or CUDA events when
    `overlap_p2p_comm`), clear both lists, free the sent activations, return a deep_ep event. Here: the ops on
    the channels in the same order, wait for all, clear, free, return None."""
    handles = []
    for op in [*self.comm_forward_ops, *self.comm_backward_ops]:
        handles += pipeline_p2p._LINKS.submit(*_channel(self, op), op.tensor)
    for handle in handles:
        handle.wait()
    self.comm_forward_ops = []
    self.comm_backward_ops = []
    self._free_tensors()
    return None


def install_patches() -> None:
    replace(dualpipev.DualPipeVParallel, "_commit_and_wait_comm", commit_and_wait_comm)

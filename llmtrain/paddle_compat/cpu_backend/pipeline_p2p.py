"""Pipeline point-to-point on CPU: ordered, non-blocking send/recv channels over gloo.

Use: installed by `llmtrain.paddle_compat.cpu_backend.install()`. Afterwards fleet's
`PipelineParallel` (1F1B `train_batch`/`eval_batch`) and
`PipelineParallelWithInterleave` (virtual stages) run on CPU processes, alone or
combined with dp / tp / sharding. Nothing to call by hand.

Why Paddle's p2p cannot run on gloo (3.3.1, fleet/meta_parallel/pp_utils/
p2p_communication.py), measured on 2 CPU processes:
  * the default batched path calls `process_group.send_on_calc_stream` /
    `recv_on_calc_stream`, and with tp > 1 `send_partial_on_calc_stream` /
    `recv_partial_on_calc_stream` + `all_gather_partial_on_calc_stream`; ProcessGroupGloo
    raises NotImplementedError ("does not support send with sync_op and use_calc_stream
    flag") for all of them;
  * gloo's send/recv are synchronous rendezvous (a send returns only once the peer posted
    the matching recv; two ranks that both send first time out), and `isend` is no
    different (ProcessGroupGloo runs every task inline), so the NCCL-style "post all four
    ops, then wait" batch deadlocks when run in order;
  * gloo matches a send to a recv by a per-process-group tag counter that every op on the
    group advances. Paddle sends all p2p (and the shape/dtype "meta" messages) over the
    whole pipe group; a middle stage that talks to both neighbours advances its counter
    for both, so for pp > 2 the tags stop matching and a recv can pair with the wrong
    message. The earlier prototype's tp2 x pp2 symptom (a stage received input ids instead
    of activations) is consistent with exactly that: several message kinds sharing one
    tag stream. PipelineParallel itself does not broadcast inputs across tp ranks in
    3.3.1 (every tp rank of the first stage gets the batch from the caller).

What we do instead: every pipeline link a->b gets two dedicated 2-rank gloo groups,
one per direction, used by nothing else. On the sending rank a background thread per
channel performs the sends in submission order; on the receiving rank a background
thread per channel performs the recvs in submission order. Each direction of a link
therefore has exactly one sender and one receiver, its tags advance in lockstep, and
messages match in FIFO order -- the same ordering NCCL gives per peer. Sends never
block the schedule (the tensor is copied first, because the 1F1B schedule frees
activations right after sending them), so any schedule that is deadlock-free with
NCCL's asynchronous p2p is deadlock-free here.

Partial send/recv across tp ranks (`enable_partial_send_recv`) is switched off on CPU:
it is a bandwidth optimisation that sends 1/tp of an activation that every tp rank
holds identically and re-assembles it with an all-gather; sending the whole tensor gives
the same values.

Replaced (all in p2p_communication.py): `initialize_p2p_groups`, `_batched_p2p_ops`,
`_p2p_ops`, `SendRecvMeta.send_meta`, `SendRecvMeta.recv_meta`. On GPU none of this is
installed and the original NCCL calc-stream batch p2p runs.
"""

from __future__ import annotations

import atexit
import json
import queue
import threading

import numpy as np
import paddle
from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p
from paddle.distributed.fleet.meta_parallel.pp_utils.utils import paddle_2_number

from ..patching import original, replace


class _Handle:
    """Completion of one queued send/recv; `wait()` re-raises a failure of the worker."""

    def __init__(self, what: str):
        self._what = what
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> bool:
        """Block until done (or `timeout` seconds: then False); True when completed."""
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise RuntimeError(f"pipeline p2p {self._what} failed") from self._error
        return True


class _Channel:
    """One direction of one pipeline link, served in FIFO order by its own thread."""

    def __init__(self, group, peer: int, sending: bool, name: str):
        self._group = group
        self._peer_in_group = group.get_group_rank(peer)
        self._sending = sending
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, tensor) -> _Handle:
        if self._sending:
            # Private contiguous copy: the schedule may free or reuse `tensor` at once.
            tensor = tensor.detach().clone()
        handle = _Handle(self.name)
        self._queue.put((tensor, handle))
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        return handle

    def stop(self, timeout: float) -> None:
        """Let the thread finish queued work and exit (used at interpreter exit)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)

    def _serve(self) -> None:
        pg = self._group.process_group
        while True:
            item = self._queue.get()
            if item is None:
                return
            tensor, handle = item
            try:
                if self._sending:
                    pg.send(tensor, self._peer_in_group, True)
                else:
                    pg.recv(tensor, self._peer_in_group, True)
                handle._finish()
            except BaseException as error:  # surfaced by handle.wait()
                handle._finish(error)


class _Links:
    """This rank's four channels: send/recv towards the next and the previous stage."""

    def __init__(self):
        self.hcg = None
        self.channels: dict[tuple[str, str], _Channel] = {}

    def build(self, hcg) -> None:
        """Create the direction groups of every pipe; collective, same order on all ranks."""
        me = paddle.distributed.get_rank()
        channels = {}
        for pipe in hcg.topology().get_comm_list("pipe"):
            n = len(pipe)
            for i in range(n):
                a, b = pipe[i], pipe[(i + 1) % n]  # a's next is b, b's prev is a
                forward = paddle.distributed.new_group(ranks=[a, b])  # a -> b
                backward = paddle.distributed.new_group(ranks=[a, b])  # b -> a
                if me == a:
                    channels["next", "send"] = _Channel(forward, b, True, f"p2p {a}->{b} next")
                    channels["next", "recv"] = _Channel(backward, b, False, f"p2p {b}->{a} prev")
                if me == b:
                    channels["prev", "recv"] = _Channel(forward, a, False, f"p2p {a}->{b} next")
                    channels["prev", "send"] = _Channel(backward, a, True, f"p2p {b}->{a} prev")
        self.stop()  # threads of links built for an earlier hcg
        self.hcg, self.channels = hcg, channels

    def stop(self) -> None:
        """Stop every channel thread (at exit, or when a new hcg replaces the links)."""
        for channel in self.channels.values():
            channel.stop(timeout=2.0)

    def submit(self, direction: str, role: str, tensors) -> list[_Handle]:
        if tensors is None:
            return []
        items = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
        channel = self.channels[direction, role]
        return [channel.submit(t) for t in items]


_LINKS = _Links()
atexit.register(_LINKS.stop)  # let the channel threads end before interpreter teardown


def _submit_all(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next):
    handles = _LINKS.submit("prev", "send", tensor_send_prev)
    handles += _LINKS.submit("next", "send", tensor_send_next)
    handles += _LINKS.submit("prev", "recv", tensor_recv_prev)
    handles += _LINKS.submit("next", "recv", tensor_recv_next)
    return handles


def initialize_p2p_groups(hcg, enable_partial_send_recv=True, enable_timer=False):
    """CPU stand-in for `p2p_communication.initialize_p2p_groups` (called by
    `PipelineParallel.__init__` on every rank).

    GPU: Paddle's function only records hcg, the partial send/recv flag and timers. Here:
    the same with partial send/recv forced off (see module docstring), then the
    per-direction channel groups are built once per hybrid communicate group (collective:
    every rank constructs its PipelineParallel, so all ranks create them in one order).
    """
    original(p2p, "initialize_p2p_groups")(hcg, False, enable_timer)
    if _LINKS.hcg is not hcg and hcg.get_pipe_parallel_world_size() > 1:
        _LINKS.build(hcg)


def _batched_p2p_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg):
    """CPU stand-in for `p2p_communication._batched_p2p_ops` (the default path).

    GPU: one NCCL group call of send/recv on the calc stream (then a partial all-gather
    over tp). Here: queue all sends and recvs on their channels and wait for all, so the
    received tensors are filled when this returns, as after the GPU call.
    """
    for handle in _submit_all(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next):
        handle.wait()


def _p2p_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg):
    """CPU stand-in for `p2p_communication._p2p_ops` (use_batch_p2p_comm=False / overlap).

    GPU: `paddle.distributed.isend/irecv` on the pipe group, returning the tasks.
    Here: the same ops queued on the channels, returning handles with `wait()`.
    """
    return _submit_all(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next)


def _describe(tensor) -> dict:
    tensors = [tensor] if isinstance(tensor, paddle.Tensor) else list(tensor)
    return {
        "is_tuple": not isinstance(tensor, paddle.Tensor),
        "items": [
            [list(t.shape), paddle_2_number(t.dtype), bool(t.stop_gradient), getattr(t, "key", None)]
            for t in tensors
        ],
    }


def send_meta(self, tensor, group, reverse=False, broadcast=False):
    """CPU stand-in for `SendRecvMeta.send_meta`: shapes/dtypes to the neighbour.

    GPU: two `paddle.distributed.send` calls on the whole pipe group (sharing its tag
    stream with every other p2p, see module docstring). Here: a JSON description sent
    on the same channel as the data that follows it. `broadcast=True` (used by
    batch_comm_helper, a collective) goes to Paddle unchanged.
    """
    if broadcast:
        return original(p2p.SendRecvMeta, "send_meta")(self, tensor, group, reverse, broadcast)
    payload = np.frombuffer(json.dumps(_describe(tensor)).encode(), dtype=np.uint8)
    direction = "prev" if reverse else "next"
    _LINKS.submit(direction, "send", paddle.to_tensor([payload.size], dtype="int64"))
    _LINKS.submit(direction, "send", paddle.to_tensor(payload))
    return None


def recv_meta(self, group, reverse=False, broadcast=False):
    """CPU stand-in for `SendRecvMeta.recv_meta`; fills the same `recv_*_message` fields.

    GPU: two `paddle.distributed.recv` calls on the pipe group. Here: the JSON written by
    `send_meta`, read from the channel of the matching direction.
    """
    if broadcast:
        return original(p2p.SendRecvMeta, "recv_meta")(self, group, reverse, broadcast)
    direction = "next" if reverse else "prev"
    size = paddle.empty([1], dtype="int64")
    _LINKS.submit(direction, "recv", size)[0].wait()
    payload = paddle.empty([int(size.item())], dtype="uint8")
    _LINKS.submit(direction, "recv", payload)[0].wait()
    meta = json.loads(payload.numpy().tobytes().decode())
    shapes, dtypes, stop_grads, keys = (list(field) for field in zip(*meta["items"]))
    if meta["is_tuple"]:
        self.recv_shape_message = tuple(shapes)
        self.recv_dtype_message = tuple(dtypes)
        self.recv_stop_gradient = tuple(stop_grads)
        self.recv_key_message = tuple(keys)
    else:
        self.recv_shape_message = shapes[0]
        self.recv_dtype_message = dtypes[0]
        self.recv_stop_gradient = stop_grads[0]
        self.recv_key_message = keys[0]
    return None


def install_patches() -> None:
    replace(p2p, "initialize_p2p_groups", initialize_p2p_groups)
    replace(p2p, "_batched_p2p_ops", _batched_p2p_ops)
    replace(p2p, "_p2p_ops", _p2p_ops)
    replace(p2p.SendRecvMeta, "send_meta", send_meta)
    replace(p2p.SendRecvMeta, "recv_meta", recv_meta)

"""fleet's DualPipeV schedule as llmtrain runs it: the step loss kept for the guard, an evaluation pass, and stages
carrying position and document ids.

    model = dualpipev_model(pipeline_layer)     # in place of fleet.distributed_model(pipeline_layer)
    loss = model.train_batch([ids, labels], optimizer, lr_scheduler, scaler)   # fleet's schedule, unchanged
    model.step_loss                             # the step's mean loss on stage 0 (None elsewhere)
    loss = model.eval_batch([ids, labels], compute_loss=True)                   # forward only, down and up the V

Read in Paddle 3.3.1 (fleet/meta_parallel/dualpipev.py): `DualPipeVParallel` computes the loss on stage 0 (the V's
last chunk) and forgets it (`_reset_states`) before the optimizer step, where llmtrain's divergence guard reads
the step loss; `DualPipeV._broadcast_final_loss` keeps it as `step_loss`. The class defines no `eval_batch`, so
fleet's 1F1B one would run (it ignores the chunks), and its own `forward_backward_pipeline(forward_only=True)`
feeds every chunk None (`_get_forward_inputs` overwrites the received input when `forward_only`). `eval_batch`
here runs each micro-batch forward down the V and back up with fleet's own pass and send/recv helpers, under
no_grad, and returns what `train_batch` would: the sum of the micro-batch losses / accumulate_steps on every
stage.

Packed documents (`data.document_mask`, `data.reset_position_ids`): every stage's input and output is then the tuple
(hidden, position_ids[, segment_ids]) (llmtrain/parallel/pipeline.py `_carrying`). fleet's p2p helper
(`pp_utils.batch_comm_helper.BatchCommHelper`) sizes every send and receive of the step from one meta message,
broadcast by stage 0 at its first send, and gets them wrong for a tuple holding tensors without a gradient: stage 0
keeps as its own copy only the tensors that need a gradient (`SendRecvMeta.set_send_message` drops the others)
while the other stages receive all of them. So stage 0's first send fails fleet's check (`_check_valid`: 3 tensors
against 1 shape) and the next stage waits in its receive until the watchdog or the timeout stops it; past that,
stage 0 would post one buffer for the three tensors stage 1 sends back up the V, and every stage three gradient
buffers where the sender sends one (only the hidden states have a gradient). `CarriedCommHelper` keeps the whole
message on every stage and sizes the gradient sends and receives (`_send_backward`, `_recv_backward`) by the
tensors that need one; at the V's turn (the last stage hands chunk 0's outputs to chunk 1) the ids keep their
`stop_gradient` (fleet's `detach_and_requires_grad` would ask a gradient of int64 ids). With the hidden states
alone every message is the one fleet sends.

`fleet.distributed_model` builds `DualPipeVParallel(layer, hcg, strategy)` when `pp_configs.use_dualpipev` is set
(its other work, AMP O2 decoration and a GradScaler when `strategy.amp`, llmtrain never asks of it);
`dualpipev_model` builds this subclass the same way. Nothing here depends on the device: on CPU the p2p under
these helpers is `cpu_backend.dualpipe_p2p`'s, on GPU fleet's NCCL batch.
"""
from __future__ import annotations

import contextlib
import functools

import paddle

from llmtrain.paddle_compat.version import require_tested_paddle


@functools.cache
def _carried_comm_helper_class():
    from paddle.distributed.fleet.meta_parallel.pp_utils.batch_comm_helper import BatchCommHelper
    from paddle.distributed.fleet.meta_parallel.pp_utils.utils import paddle_2_number

    class CarriedCommHelper(BatchCommHelper):
        """fleet's `BatchCommHelper` for stage tuples holding tensors without a gradient (see the module): every
        stage keeps the whole meta message (shapes, dtypes, stop_gradient of each tensor), activations are sent and
        received whole, gradients (inside `gradients()`) only for the tensors whose stop_gradient is False."""

        grads = False

        @contextlib.contextmanager
        def gradients(self):
            """Sends and receives of gradients: one buffer per tensor that needs a gradient, in the tuple's order."""
            self.grads = True
            try:
                yield
            finally:
                self.grads = False

        def _send_meta(self, tensors, group, broadcast=False):
            """fleet's broadcast of the message, then stage 0's own copy set to what the other stages receive
            (fleet keeps the shapes of the tensors needing a gradient only)."""
            super()._send_meta(tensors, group, broadcast=broadcast)
            meta = self._send_recv_meta
            meta.recv_shape_message = tuple(list(t.shape) for t in tensors)
            meta.recv_dtype_message = tuple(paddle_2_number(t.dtype) for t in tensors)
            meta.recv_stop_gradient = tuple(bool(t.stop_gradient) for t in tensors)

        def _needing_grad(self):
            """Indices of the message's tensors that need a gradient."""
            stop = self._send_recv_meta.recv_stop_gradient
            return [i for i, s in enumerate(stop if isinstance(stop, tuple) else (stop,)) if not s]

        def _build_from_meta(self):
            built = super()._build_from_meta()  # one empty tensor per tensor of the message
            return [built[i] for i in self._needing_grad()] if self.grads else built

        def _check_valid(self, tensors):
            if not self.grads:
                return super()._check_valid(tensors)
            meta, keep = self._send_recv_meta, self._needing_grad()
            shapes = meta.recv_shape_message if isinstance(meta.recv_shape_message, tuple) else (meta.recv_shape_message,)
            dtypes = meta.recv_dtype_message if isinstance(meta.recv_dtype_message, tuple) else (meta.recv_dtype_message,)
            want = [(list(shapes[i]), dtypes[i]) for i in keep]
            got = [(list(t.shape), paddle_2_number(t.dtype)) for t in tensors]
            if got != want:
                raise ValueError(f"DualPipeV gradient send: {got} (shape, dtype) where the stage message gives {want} "
                                 "for the tensors needing a gradient")

    return CarriedCommHelper


@functools.cache
def _dualpipev_class():
    from paddle.distributed.fleet.meta_parallel.dualpipev import DualPipeVParallel

    class DualPipeV(DualPipeVParallel):
        """fleet's DualPipeVParallel with `step_loss`, `eval_batch`, and stage tuples carrying ids (see the module)."""

        step_loss = None

        def __init__(self, layers, hcg, strategy):
            super().__init__(layers, hcg, strategy)
            self._p2p_helper = _carried_comm_helper_class()(self._using_cache)

        def _recv_backward(self, phase):
            with self._p2p_helper.gradients():
                super()._recv_backward(phase)

        def _send_backward(self, phase):
            with self._p2p_helper.gradients():
                super()._send_backward(phase)

        def _store_forward_tensors(self, phase, outputs, schedule_chunk):
            super()._store_forward_tensors(phase, outputs, schedule_chunk)
            if self.is_pipeline_last_stage() and phase == 0:  # the V's turn: chunk 1's inputs, detached by fleet
                for out, turned in zip(outputs, self.input_tensors[1][-1]):
                    turned.stop_gradient = out.stop_gradient  # ids stay without a gradient

        def _broadcast_final_loss(self):
            loss = super()._broadcast_final_loss()  # [1] on every stage: sum of the micro-batch losses / count
            self.step_loss = loss.reshape([]) if self.is_pipeline_first_stage() else None
            return loss

        def eval_batch(self, data, compute_loss=True):
            """The mean micro-batch loss of `data` ([ids, labels], cut into accumulate_steps micro-batches as in
            `train_batch`), forward only: each micro-batch down the V (chunk 0 of every stage) and back up (chunk
            1), losses on stage 0, the sum / accumulate_steps all-reduced over the pipe group."""
            self._layers.eval()
            saved = self._compute_loss
            self._compute_loss = compute_loss
            self.forward_only = False  # fleet's forward_only drops the received inputs; no backward runs anyway
            self._reset_states()
            self._p2p_helper.recv_meta_from_head(self.pp_group, self.need_recv_meta)  # first use: shapes
            self.need_recv_meta = False
            data = data if self.is_pipeline_first_stage() else None
            micro = [self._wrap_data(data, 0), self._wrap_data(data, 1)]
            try:
                with paddle.no_grad():
                    for _ in range(self.accumulate_steps):
                        self._forward_pass(0, micro)  # recv from the previous stage, chunk 0, send to the next
                        self._forward_pass(1, micro)  # recv from the next stage, chunk 1, send to the previous
                    self._commit_and_wait_comm()
                    loss = self._broadcast_final_loss() if compute_loss else None
            finally:
                self._reset_states()
                self._compute_loss = saved
                self._layers.train()
            return loss

    return DualPipeV


def dualpipev_model(layer):
    """`DualPipeV` over a `PipelineLayer` built with `use_dualpipev=True`, for fleet's hybrid group and strategy (what
    `fleet.distributed_model` returns under `pp_configs.use_dualpipev`, plus `step_loss` and `eval_batch`)."""
    require_tested_paddle()
    from paddle.distributed import fleet

    if not getattr(layer, "_use_dualpipev", False):
        raise ValueError("dualpipev_model: the PipelineLayer was not built with use_dualpipev=True "
                         "(llmtrain.parallel.pipeline does so for parallel.pp_schedule=dualpipev)")
    # the strategy's pp_configs.use_dualpipev only steers fleet.distributed_model's choice, bypassed here
    return _dualpipev_class()(layer, fleet.fleet._hcg, strategy=fleet.fleet._user_defined_strategy)


def is_dualpipev(model) -> bool:
    """Whether `model` runs fleet's DualPipeV schedule."""
    from paddle.distributed.fleet.meta_parallel.dualpipev import DualPipeVParallel

    return isinstance(model, DualPipeVParallel)

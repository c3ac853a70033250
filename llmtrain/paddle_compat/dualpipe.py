"""fleet's DualPipeV schedule as llmtrain runs it: the step loss kept for the guard, and an evaluation pass.

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

`fleet.distributed_model` builds `DualPipeVParallel(layer, hcg, strategy)` when `pp_configs.use_dualpipev` is set
(its other work, AMP O2 decoration and a GradScaler when `strategy.amp`, llmtrain never asks of it);
`dualpipev_model` builds this subclass the same way. Nothing here depends on the device: on CPU the p2p under
these helpers is `cpu_backend.dualpipe_p2p`'s, on GPU fleet's NCCL batch.
"""
from __future__ import annotations

import functools

import paddle

from llmtrain.paddle_compat.version import require_tested_paddle


@functools.cache
def _dualpipev_class():
    from paddle.distributed.fleet.meta_parallel.dualpipev import DualPipeVParallel

    class DualPipeV(DualPipeVParallel):
        """fleet's DualPipeVParallel with `step_loss` and `eval_batch` (see the module)."""

        step_loss = None

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

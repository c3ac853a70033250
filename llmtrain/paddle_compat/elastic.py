"""Paddle 3.3.1's restarting launcher (`--master etcd://`) with its restart race fixed; run through `llmtrain.launch`.

    python -m llmtrain.launch --master etcd://127.0.0.1:2379 --job_id run1 --nnodes 1 --nproc_per_node 2 \\
        --max_restart 3 --elastic_level 1 llmtrain/pretrain.py +parallel=dp2

    install()     # in the launcher process, before paddle.distributed.launch.main.launch()

What Paddle does (paddle/distributed/launch/controllers/{controller,master,collective}.py): each
node's launcher keeps a leased heartbeat key under `/paddle/<job>/heartbeat/` (refreshed by a
thread every 5 s) and watches that prefix; any event there marks the node RESTARTING. When one
of its workers fails, `Controller.watch` marks the node FAILED, `ETCDMaster.restart_peer`
deletes every heartbeat (so every node's watch fires and each stops its workers), and the
restart loop of `CollectiveElasticController.run` waits until all nodes beat again.

The race (seen here: a two-node job whose launcher exited instead of restarting, 1 run of 2):
only etcd's watch callback, on another thread, turns FAILED into RESTARTING. The restart loop
calls `wait_peer_ready` at once; if the callback has not run yet, the status still reads as
finished, so it skips waiting, counts no heartbeat (just deleted), logs "peer not ready" and
the launcher exits with the failed worker's status. And a heartbeat thread that wakes while
the status is FAILED ends for good, so the restart waits `--elastic_timeout` x 10 s for a beat
that never comes, then gives up.

Fixed here: `restart_peer` marks the node RESTARTING itself before deleting the heartbeats,
and `wait_peer_ready` registers the heartbeat again (new lease, watch and thread) when its
thread has ended while the job is not done. The launcher is otherwise Paddle's own.
"""
from __future__ import annotations

from llmtrain.paddle_compat.patching import original, replace
from llmtrain.paddle_compat.version import require_tested_paddle

_INSTALLED = False


def install() -> None:
    """Patch `ETCDMaster` (idempotent). Only the launcher process needs it."""
    global _INSTALLED
    if _INSTALLED:
        return
    require_tested_paddle()
    from paddle.distributed.launch.controllers.master import ETCDMaster

    def register_heartbeat(self, job_id, pod_id, ttl=10):
        self._llmtrain_heartbeat = (job_id, pod_id, ttl)  # to register again if the thread ends
        return original(ETCDMaster, "register_heartbeat")(self, job_id, pod_id, ttl)

    def restart_peer(self):
        self.ctx.status.restart()  # now, not when etcd's watch callback gets to it
        return original(ETCDMaster, "restart_peer")(self)

    def wait_peer_ready(self, replicas_min, replicas_max, timeout):
        beat = getattr(self, "beat_thread", None)
        if beat is not None and not beat.is_alive() and not self.ctx.status.is_done():
            self.ctx.logger.warning("heartbeat thread had ended; registering the heartbeat again")
            del self.heartbeat_prefix  # register_heartbeat refuses to run twice otherwise
            register_heartbeat(self, *self._llmtrain_heartbeat)
        return original(ETCDMaster, "wait_peer_ready")(self, replicas_min, replicas_max, timeout)

    replace(ETCDMaster, "register_heartbeat", register_heartbeat)
    replace(ETCDMaster, "restart_peer", restart_peer)
    replace(ETCDMaster, "wait_peer_ready", wait_peer_ready)
    _INSTALLED = True

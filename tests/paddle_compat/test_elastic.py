"""llmtrain.paddle_compat.elastic: Paddle 3.3.1's etcd restart race, shown with and without the fix, on a real etcd.

    python -m pytest tests/paddle_compat/test_elastic.py -q     (~10 s)

One child process (protobuf's pure-Python implementation, as `llmtrain.launch` selects for
Paddle's etcd3 client) builds Paddle's own launcher Context and ETCDMaster against the
etcd server and replays what `Controller.watch` and `CollectiveElasticController.run` do when
a worker fails: mark the node FAILED, publish it, delete the heartbeats, then wait for the
peers. Here the heartbeat thread has already ended (it woke while the node was FAILED, which
in a real run happens in a few-millisecond window), so nothing but the fix can bring the
heartbeat back. Unpatched, `wait_peer_ready` gives up at once (the launcher would exit
instead of restarting); patched, the node is RESTARTING at once and its heartbeat is back.
"""
from __future__ import annotations

import json
import subprocess
import sys

from launch import REPO, env, etcd_server

CHILD = r"""
import json, sys, time
endpoint = sys.argv[1]
sys.argv = ["launch", "--master", f"etcd://{endpoint}", "--nnodes", "1", "--job_id", "race", "x.py"]
from paddle.distributed.launch.context import Context
from paddle.distributed.launch.controllers.master import ETCDMaster


def replay(job):
    ctx = Context(enable_plugin=False)
    master = ETCDMaster(ctx)
    master.register_heartbeat(job, "pod0", ttl=2)  # the heartbeat thread wakes every ttl/2 = 1 s
    alive_before = master.fetch_peer_alive()
    ctx.status.fail()                               # Controller.watch, a worker failed
    master.beat_thread.join(timeout=10)             # the thread saw FAILED and ended
    thread_ended = not master.beat_thread.is_alive()
    master.set_status(ctx.status.FAILED)
    master.restart_peer()
    t0 = time.time()
    ok, peers = master.wait_peer_ready(1, 1, 3)     # CollectiveElasticController.run, next loop
    return {"alive_before": alive_before, "thread_ended": thread_ended,
            "restarting": ctx.status.is_restarting(), "ready": ok, "peers": peers, "waited_s": time.time() - t0}


out = {"paddle": replay("race-paddle")}
from llmtrain.paddle_compat.elastic import install
install()
out["fixed"] = replay("race-fixed")
print("RESULT " + json.dumps(out))
"""


def test_restart_race_of_paddles_etcd_launcher_and_its_fix(tmp_path):
    with etcd_server(tmp_path) as endpoint:
        proc = subprocess.run([sys.executable, "-c", CHILD, endpoint], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env=env() | {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(lines[0][len("RESULT "):])
    print(got)
    paddle, fixed = got["paddle"], got["fixed"]
    assert all(r["alive_before"] == ["pod0"] and r["thread_ended"] for r in (paddle, fixed)), got
    # Paddle 3.3.1 alone: still FAILED, no heartbeat, "peer not ready" at once -> the launcher exits
    assert (paddle["restarting"], paddle["ready"], paddle["peers"]) == (False, False, 0), paddle
    assert paddle["waited_s"] < 1, paddle
    # with llmtrain.paddle_compat.elastic: RESTARTING, the heartbeat registered again, the peer (this node) ready
    assert (fixed["restarting"], fixed["ready"], fixed["peers"]) == (True, True, 1), fixed

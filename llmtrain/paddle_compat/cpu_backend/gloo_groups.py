"""Gloo sub-groups that do not race: each group rendezvouses through its own TCP store.

Use: installed by `llmtrain.paddle_compat.cpu_backend.install()`; afterwards every
`paddle.distributed.new_group(...)` on the gloo backend (including the ones `fleet.init`
creates for dp/mp/pp/sharding) gets a private store. Nothing to call by hand.

Why. `ProcessGroupGloo`'s constructor (Paddle 3.3.1, process_group_gloo.cc) runs gloo's
`connectFullMesh` on the store it is given, and `new_group` always gives it the job's
global TCP store with no per-group key prefix. Two groups of the same size that are
created back to back (dp2 x mp2 on 4 processes builds two 2-rank "model" groups) then
read and overwrite each other's address keys, and the second group fails with
"connect [127.0.0.1]:PORT: Connection refused" (measured: 5 of 5 tries).

How. For every gloo group except the default one (id 0, built by `init_parallel_env`
through its own import of the original function), the group's local rank 0:
  1. asks the OS for a free TCP port (bind to port 0), so two jobs on one machine,
     or two groups of one job, can never pick the same port;
  2. publishes "host:port" under `llmtrain/gloo_group_store/<group id>` in the job's
     global store (the group id is the same on every rank: new_group is collective);
  3. starts a `core.TCPStore` server on that port; the other members read the key and
     connect as clients. `ProcessGroupGloo.create` then rendezvouses on that store.
The host is the one in this rank's `PADDLE_CURRENT_ENDPOINT` (reachable from the other
nodes of a multi-node job); it falls back to 127.0.0.1 for single-node jobs.
"""

from __future__ import annotations

import os
import socket

from paddle.base import core
from paddle.distributed import collective

from ..patching import original, replace

_STORE_KEY = "llmtrain/gloo_group_store/{gid}"
_STORE_TIMEOUT_S = 900  # Paddle's own TCPStore default
# group id -> TCPStore; the server must outlive the rendezvous, so we keep every store.
_GROUP_STORES: dict[int, core.TCPStore] = {}


def _this_host() -> str:
    endpoint = os.environ.get("PADDLE_CURRENT_ENDPOINT", "")
    host = endpoint.rsplit(":", 1)[0] if ":" in endpoint else ""
    return host or "127.0.0.1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _group_store(global_store, rank: int, world_size: int, group_id: int):
    """A fresh TCPStore shared by exactly the members of group `group_id`."""
    key = _STORE_KEY.format(gid=group_id)
    if rank == 0:
        host, port = _this_host(), _free_port()
        global_store.set(key, f"{host}:{port}")
        store = core.TCPStore(host, port, True, world_size, _STORE_TIMEOUT_S)
    else:
        global_store.wait(key)
        host, port = global_store.get(key).decode().rsplit(":", 1)
        store = core.TCPStore(host, int(port), False, world_size, _STORE_TIMEOUT_S)
    _GROUP_STORES[group_id] = store
    return store


def _new_process_group_impl(
    backend,
    store,
    rank,
    world_size,
    group_name,
    pg_options,
    group_id=0,
    nccl_comm_init_option=0,
    nccl_config=None,
):
    """CPU stand-in for `paddle.distributed.collective._new_process_group_impl`.

    Paddle: python/paddle/distributed/collective.py (3.3.1), called by `new_group` for
    members of a new group. Replaced because a gloo group built on the shared global
    store can collide with another group's rendezvous (see module docstring). For gloo
    sub-groups we build a private store and then create the group exactly as Paddle
    does (`core.ProcessGroupGloo.create(store, rank, world_size, group_id)`); every
    other backend and the default group go to Paddle's function unchanged. On GPU this
    stand-in is never installed and NCCL groups rendezvous through the global store by
    hashed unique ids, which do not collide.
    """
    if backend != "gloo" or group_id == 0:
        return original(collective, "_new_process_group_impl")(
            backend,
            store,
            rank,
            world_size,
            group_name,
            pg_options,
            group_id=group_id,
            nccl_comm_init_option=nccl_comm_init_option,
            nccl_config=nccl_config,
        )
    group_store = _group_store(store, rank, world_size, group_id)
    return core.ProcessGroupGloo.create(group_store, rank, world_size, group_id)


def install_patches() -> None:
    replace(collective, "_new_process_group_impl", _new_process_group_impl)

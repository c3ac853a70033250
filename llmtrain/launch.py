"""Paddle's launcher for restarting jobs over etcd: `python -m paddle.distributed.launch` plus three fixes.

    python -m llmtrain.launch --master etcd://127.0.0.1:2379 --job_id run1 --nnodes 1 --nproc_per_node 2 \\
        --max_restart 3 --elastic_level 1 llmtrain/pretrain.py +parallel=dp2 checkpoint.interval=100

Same arguments and behaviour as `python -m paddle.distributed.launch` (it is that launcher,
run in this process). With an `etcd://` master, before Paddle is imported:

- protobuf's pure-Python implementation is selected for this process only. Paddle imports
  the `etcd3` client (0.12.0, its last release), whose generated code predates protobuf 4;
  the compiled implementation refuses it ("Descriptors cannot be created directly"). The
  variable is removed again before the launcher copies its environment for the workers, so
  they keep the compiled one.
- `GRPC_ENABLE_FORK_SUPPORT=0`: the launcher forks its workers while etcd3's gRPC threads
  run; with gRPC's fork handlers on, a forked child sometimes aborts before it execs
  (status -6, 2 of 40 forks in a check here, 0 of 150 with the variable set), which the
  launcher counts as a failed worker.
- `llmtrain.paddle_compat.elastic.install()`: Paddle 3.3.1's restart race (see there).

Without an etcd master it only runs Paddle's launcher. Either way, the overrides of a recipe it
launches (`llmtrain/pretrain.py`, `llmtrain/finetune.py`) are checked first: an unknown key or
preset (`train.max_step=10`, with or without `+`) exits with status 2 naming the nearest valid one,
before any worker starts (`llmtrain.config.refuse_unknown_keys`). `--help` prints what llmtrain adds, then Paddle's
options.
"""
from __future__ import annotations

import os
import sys


def _etcd_master(argv: list[str]) -> bool:
    """Is the launcher's master (`--master X`, `--master=X`, or PADDLE_MASTER, which overrides them) an etcd URL?"""
    master = None
    for i, arg in enumerate(argv):
        if arg.startswith("--master="):
            master = arg.split("=", 1)[1]
        elif arg == "--master" and i + 1 < len(argv):
            master = argv[i + 1]
    master = os.environ.get("PADDLE_MASTER", master)
    return bool(master) and master.startswith("etcd://")


RECIPES = {"pretrain.py": "config", "finetune.py": "finetune"}
"""Entry scripts whose Hydra overrides are checked before the launch -> their root config."""


def _recipe_overrides(argv: list[str]):
    """(root config name, overrides) of the recipe on the launcher's command line, or None."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py"):
            name = RECIPES.get(os.path.basename(arg))
            return (name, argv[i + 1:]) if name else None
    return None


USAGE = """\
usage: python -m llmtrain.launch [PADDLE LAUNCHER OPTIONS] SCRIPT.py [OVERRIDE ...]

llmtrain's wrapper of Paddle's launcher (python -m paddle.distributed.launch): the same options and behaviour, plus
  - the Hydra overrides of llmtrain/pretrain.py and llmtrain/finetune.py are checked before any worker starts: an
    unknown key or preset exits with status 2 naming the nearest valid one;
  - with an etcd master (--master etcd://HOST:PORT, for restarting jobs: --max_restart N --elastic_level 1) the
    three fixes Paddle 3.3.1 needs on CPU: pure-Python protobuf for the launcher's etcd3 client,
    GRPC_ENABLE_FORK_SUPPORT=0, and the restart-loop race fixed (llmtrain.paddle_compat.elastic).

examples:
  python -m llmtrain.launch --nproc_per_node 2 llmtrain/pretrain.py +parallel=dp2
  python -m llmtrain.launch --master etcd://127.0.0.1:2379 --job_id run1 --nnodes 1 --nproc_per_node 2 \\
      --max_restart 3 --elastic_level 1 llmtrain/pretrain.py +parallel=dp2 checkpoint.interval=100

docs/long-runs.md explains restarts. Paddle's launcher options follow.
"""


def _asks_for_help(argv: list[str]) -> bool:
    """--help / -h among the launcher's own arguments (before the script; after it they are the script's)."""
    for arg in argv:
        if arg.endswith(".py"):
            return False
        if arg in ("-h", "--help"):
            return True
    return False


def main() -> None:
    if _asks_for_help(sys.argv[1:]):
        print(USAGE, flush=True)  # then Paddle's own usage, printed by its parser (exit 0)
    recipe = _recipe_overrides(sys.argv[1:])
    if _etcd_master(sys.argv[1:]):
        os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"
        set_here = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION" not in os.environ
        if set_here:
            os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
        import google.protobuf.internal.api_implementation  # noqa: F401  (reads the variable once, here)
        try:
            import etcd3  # noqa: F401
        except ImportError as e:
            sys.exit(f"llmtrain.launch: an etcd:// master needs the etcd3 client ({e}): pip install -e '.[elastic]'")

        if set_here:
            del os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"]
        from llmtrain.paddle_compat.elastic import install

        install()
    if recipe is not None:
        from llmtrain.config import refuse_unknown_keys

        refuse_unknown_keys(recipe[0], recipe[1])  # exit 2 before any worker starts
    from paddle.distributed.launch.main import launch

    launch()


if __name__ == "__main__":
    main()

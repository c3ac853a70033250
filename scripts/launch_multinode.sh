#!/usr/bin/env bash
# Start this node's share of a multi-node llmtrain job with paddle.distributed.launch.
# Run the same command on every node, changing only --rank (0 .. nnodes-1):
#
#   scripts/launch_multinode.sh --master 10.0.0.1:29500 --nnodes 2 --rank 0 --nproc-per-node 8 \
#       llmtrain/pretrain.py model=llama-tiny +parallel=dp2tp2
#   scripts/launch_multinode.sh --master 10.0.0.1:29500 --nnodes 2 --rank 1 --nproc-per-node 8 \
#       llmtrain/pretrain.py model=llama-tiny +parallel=dp2tp2
#
# --master is host:port of node 0 (the port must be free there; node 0 serves the
# rendezvous on it). Global ranks are node_rank * nproc_per_node + local rank, so the
# same layout gives the same ranks whether it runs on 1 node or on N nodes.
# Two "nodes" on one CPU machine (what tests/paddle_compat/test_cpu_multinode.py does):
#
#   scripts/launch_multinode.sh --master 127.0.0.1:29500 --nnodes 2 --rank 0 --nproc-per-node 1 train.py &
#   scripts/launch_multinode.sh --master 127.0.0.1:29500 --nnodes 2 --rank 1 --nproc-per-node 1 train.py
#
# Every option can also come from the environment (Slurm/K8s friendly):
#   MASTER_ADDR + MASTER_PORT, NNODES, NODE_RANK, NPROC_PER_NODE, LOG_DIR, PYTHON.
# Defaults: 1 node, rank 0, one process per visible GPU (nvidia-smi) or 1 on CPU,
# logs in logs/node<rank>, python from PATH. On CPU the workers talk over gloo and the
# entry script must call llmtrain.paddle_compat.cpu_backend.install() before fleet.init.
set -euo pipefail

usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

master=""
[[ -n "${MASTER_ADDR:-}" && -n "${MASTER_PORT:-}" ]] && master="${MASTER_ADDR}:${MASTER_PORT}"
nnodes="${NNODES:-1}"
node_rank="${NODE_RANK:-0}"
nproc="${NPROC_PER_NODE:-}"
log_dir="${LOG_DIR:-}"
python="${PYTHON:-python}"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --master) master="$2"; shift 2 ;;
    --nnodes) nnodes="$2"; shift 2 ;;
    --rank) node_rank="$2"; shift 2 ;;
    --nproc-per-node|--nproc_per_node) nproc="$2"; shift 2 ;;
    --log-dir|--log_dir) log_dir="$2"; shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    -*) echo "unknown option $1" >&2; usage 2 ;;
    *) break ;;
  esac
done

[[ $# -ge 1 ]] || { echo "missing the training script to run" >&2; usage 2; }
if [[ -z "$master" ]]; then
  if [[ "$nnodes" -gt 1 ]]; then echo "--master host:port is required with --nnodes > 1" >&2; exit 2; fi
fi
if [[ -z "$nproc" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nproc="$(nvidia-smi -L | wc -l)"
  else
    nproc=1
  fi
fi
if ! [[ "$node_rank" =~ ^[0-9]+$ && "$node_rank" -lt "$nnodes" ]]; then
  echo "--rank must be in [0, $nnodes), got $node_rank" >&2; exit 2
fi
log_dir="${log_dir:-logs/node${node_rank}}"

args=(-m paddle.distributed.launch --nnodes "$nnodes" --rank "$node_rank"
      --nproc_per_node "$nproc" --log_dir "$log_dir")
[[ -n "$master" ]] && args+=(--master "$master")

echo "[launch_multinode] node ${node_rank}/${nnodes}, ${nproc} process(es), master ${master:-<local>}, logs ${log_dir}" >&2
exec "$python" "${args[@]}" "$@"

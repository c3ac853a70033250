#!/usr/bin/env bash
# PaddleFormers 1.2.0 (the ERNIE 4.5 peer of tests/interop/test_ernie45.py and tests/e2e/family_ernie45.py) in its own
# virtual environment: it pins numpy 1.26 and transformers 5.3, which .venv/'s numpy 2 cannot share.
#   bash scripts/paddleformers_env.sh        # builds .venv-paddleformers/ once (minutes); prints its python's path
# Reuses the environment while scripts/paddleformers-requirements.txt (every package pinned) is unchanged; a changed
# list rebuilds it. LLMTRAIN_PADDLEFORMERS_VENV=DIR puts it elsewhere. The tests call this script themselves
# (tests/paddleformers_ref.py) and skip when it fails, or fail under CI=true, naming the reason.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${LLMTRAIN_PADDLEFORMERS_VENV:-$repo/.venv-paddleformers}"
reqs="$repo/scripts/paddleformers-requirements.txt"
stamp="$venv/.installed-$(sha256sum "$reqs" | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "[paddleformers] building $venv (first time: a few minutes)" >&2
    start=$(date +%s)
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
    "$venv/bin/python" -m pip install --quiet -r "$reqs" >&2
    "$venv/bin/python" -c "import paddleformers, paddle; assert paddleformers.__version__ == '1.2.0', paddleformers.__version__" >&2
    touch "$stamp"
    echo "[paddleformers] built in $(( $(date +%s) - start )) s" >&2
fi
echo "$venv/bin/python"

#!/usr/bin/env bash
# PaddleFormers 1.2.0 (the ERNIE 4.5 peer of tests/interop/test_ernie45.py and tests/e2e/family_ernie45.py) in its own
# virtual environment: it pins numpy 1.26 and transformers 5.3, which .venv/'s numpy 2 cannot share.
#   bash scripts/paddleformers_env.sh        # builds the environment once (minutes); prints its python's path
# The environment lives outside the checkout, in ~/.cache/llmtrain/venv-paddleformers-<hash of the pins> (or
# $LLMTRAIN_PADDLEFORMERS_VENV), so fresh clones on one machine (CI's) reuse it; scripts/paddleformers-requirements.txt
# pins every package, and a changed list gets an environment of its own. One build at a time (flock): pytest's two
# workers may ask at once. scripts/test.sh calls it before the suite; the tests call it too (tests/paddleformers_ref.py)
# and skip when it fails, or fail under CI=true, naming the reason.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
reqs="$repo/scripts/paddleformers-requirements.txt"
hash="$(sha256sum "$reqs" | cut -c1-16)"
venv="${LLMTRAIN_PADDLEFORMERS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/llmtrain/venv-paddleformers-$hash}"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.installed-$hash" ]; then
    echo "[paddleformers] building $venv (first time: 4-12 minutes, mostly downloads)" >&2
    start=$(date +%s)
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
    "$venv/bin/python" -m pip install --quiet -r "$reqs" >&2
    "$venv/bin/python" -c "import paddleformers, paddle; assert paddleformers.__version__ == '1.2.0', paddleformers.__version__" >&2
    touch "$venv/.installed-$hash"
    echo "[paddleformers] built in $(( $(date +%s) - start )) s" >&2
fi
echo "$venv/bin/python"

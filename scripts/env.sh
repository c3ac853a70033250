# Source me: creates ./.venv (once) and installs llmtrain into it (again only when pyproject.toml changed).
#   source scripts/env.sh            # runtime dependencies
#   LLMTRAIN_EXTRAS=dev source scripts/env.sh   # + test dependencies (pytest, paddlenlp with its pins, etcd3)
# Needs only python3 (3.10+) and pip on PATH.
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="$_repo/.venv"
if [ ! -x "$_venv/bin/python" ]; then
    echo "[env] creating $_venv"
    python3 -m venv "$_venv" 2>/dev/null || {
        echo "[env] python3 -m venv unavailable; using virtualenv"
        python3 -m pip install --user --quiet virtualenv && python3 -m virtualenv --quiet "$_venv"
    }
fi
# shellcheck disable=SC1091
source "$_venv/bin/activate"
_extras="${LLMTRAIN_EXTRAS:-}"
_stamp="$_venv/.llmtrain-installed${_extras:+-$_extras}"
if [ ! -f "$_stamp" ] || [ "$_repo/pyproject.toml" -nt "$_stamp" ]; then
    echo "[env] installing llmtrain${_extras:+[$_extras]} into $_venv (first time: a few minutes)"
    python -m pip install --quiet --upgrade pip
    python -m pip install --quiet -e "$_repo${_extras:+[$_extras]}"
    touch "$_stamp"
fi
export PYTHONPATH="$_repo${PYTHONPATH:+:$PYTHONPATH}"
unset _repo _venv _extras _stamp

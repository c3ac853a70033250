#!/usr/bin/env bash
# The test suite (CPU; ~15 minutes on 2 cores with the first install). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMTRAIN_EXTRAS=dev source scripts/env.sh
bash scripts/install_system_deps.sh   # prometheus + promtool for tests/deploy, etcd for the restart tests (apt on Debian)
python -m pytest -q tests "$@"
